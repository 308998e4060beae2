"""Corpus split (stable, disjoint) and the tokenizer (exact round trip, EOS, AutoTokenizer)."""

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


def test_split_depends_only_on_the_path():
    # fixed expectations: the same on every machine and Python version
    assert [corpus.is_held_out(p) for p in ("stdlib/json/decoder.py", "stdlib/os.py", "stdlib/asyncio/tasks.py")] == [
        corpus.stable_fraction(p) < 0.05 for p in ("stdlib/json/decoder.py", "stdlib/os.py", "stdlib/asyncio/tasks.py")
    ]
    assert corpus.stable_fraction("stdlib/os.py") == pytest.approx(int.from_bytes(
        __import__("hashlib").sha256(b"stdlib/os.py").digest()[:8], "big") / 2**64)
    held = [f"stdlib/m{i}.py" for i in range(4000) if corpus.is_held_out(f"stdlib/m{i}.py")]
    assert held == [f"stdlib/m{i}.py" for i in range(4000) if corpus.is_held_out(f"stdlib/m{i}.py")]
    assert 140 < len(held) < 260  # about 5% of 4000


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
