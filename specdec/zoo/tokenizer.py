"""Byte-level BPE tokenizer for the zoo, trained with ``tokenizers`` and saved as a
``PreTrainedTokenizerFast`` (so ``AutoTokenizer.from_pretrained`` loads it).

Invariant: byte-level, so every string round-trips exactly (encode then decode gives it back);
the EOS token separates files in the training stream and is what generation stops at.
"""

from __future__ import annotations

from typing import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

EOS_TOKEN = "<|endoftext|>"


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS_TOKEN, clean_up_tokenization_spaces=False)
