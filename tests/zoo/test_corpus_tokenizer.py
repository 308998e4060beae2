"""Corpus split (stable, disjoint) and the tokenizer (exact round trip, EOS, AutoTokenizer)."""

import os
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from specdec.zoo import corpus
from specdec.zoo.tokenizer import EOS_TOKEN, train_tokenizer


def test_split_is_disjoint_complete_and_about_five_percent():
    files = corpus.find_sources()
    train, held = corpus.split(files)
    train_paths, held_paths = {f.relative_path for f in train}, {f.relative_path for f in held}
    assert not train_paths & held_paths
    assert train_paths | held_paths == {f.relative_path for f in files}
    assert 0.02 < len(held) / len(files) < 0.09
    assert all(p.startswith("stdlib/") for p in train_paths | held_paths)


# SHA-256 of each path (`printf %s PATH | sha256sum`), its first 8 bytes as a fraction of 2**64:
# fixed expectations, the same on every machine and Python version
KNOWN_FRACTIONS = {
    "stdlib/json/decoder.py": 0xA36215419A5B550A / 2**64,  # 0.638: trained on
    "stdlib/os.py": 0x73F25B43E336F48D / 2**64,  # 0.453: trained on
    "stdlib/m31.py": 0x0700BC74DF132ED5 / 2**64,  # 0.027: held out
    "stdlib/m76.py": 0x013564234FAF045F / 2**64,  # 0.005: held out
}


@pytest.mark.parametrize("path", sorted(KNOWN_FRACTIONS))
def test_split_follows_the_sha256_of_the_path(path):
    assert corpus.stable_fraction(path) == pytest.approx(KNOWN_FRACTIONS[path], rel=1e-12)
    assert corpus.is_held_out(path) == (KNOWN_FRACTIONS[path] < 0.05)


def test_split_is_the_same_in_another_process():
    """Python's own str hash changes from process to process; the split must not."""
    paths = [f"stdlib/m{i}.py" for i in range(4000)]
    held = [p for p in paths if corpus.is_held_out(p)]
    assert 140 < len(held) < 260  # about 5% of 4000
    # the module alone, by its path (importing specdec would import torch: seconds)
    code = ("import importlib.util as u, sys; s = u.spec_from_file_location('corpus', sys.argv[1]); "
            "corpus = sys.modules['corpus'] = u.module_from_spec(s); s.loader.exec_module(corpus); "
            "print(','.join(p for p in (f'stdlib/m{i}.py' for i in range(4000)) if corpus.is_held_out(p)))")
    other = subprocess.run([sys.executable, "-c", code, corpus.__file__], env={**os.environ, "PYTHONHASHSEED": "12345"},
                           capture_output=True, text=True, check=True).stdout.strip().split(",")
    assert other == held


def test_shuffled_order_is_a_stable_permutation():
    files = corpus.find_sources()[:200]
    assert corpus.shuffled(files) == corpus.shuffled(list(reversed(files)))
    assert sorted(f.relative_path for f in corpus.shuffled(files)) == [f.relative_path for f in files]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    texts = [f.read() for f in corpus.find_sources()[:60]]
    trained = train_tokenizer(texts, vocab_size=400)
    folder = tmp_path_factory.mktemp("tokenizer")
    trained.save_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder)


@pytest.mark.parametrize("text", [
    "def f(x):\n    return x ** 2  # square\n",
    "\tmixed  spacing\r\n and unicode: é, ß, 漢字, emoji 🐍\n",
    "",
    "   leading spaces and trailing   ",
])
def test_tokenizer_round_trips_exactly(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text


def test_tokenizer_has_eos_and_its_vocabulary(tokenizer):
    assert tokenizer.eos_token == EOS_TOKEN
    assert tokenizer.convert_tokens_to_ids(EOS_TOKEN) == tokenizer.eos_token_id
    assert len(tokenizer) == 400
    assert type(tokenizer).__name__ in ("PreTrainedTokenizerFast", "TokenizersBackend")
