import numpy as np
import pytest

from specdec.drafters import PromptLookupDrafter
from specdec.drafters.lookup import find_continuations
from specdec.types import PAD_ID

# tokens, wanted, min_ngram, max_ngram -> proposal
CASES = [
    ([1, 2, 3, 4, 1, 2], 3, 1, 2, [3, 4, 1]),  # "1 2" occurred at 0: copy what followed
    ([1, 2, 3, 4, 1, 2], 5, 1, 2, [3, 4, 1, 2]),  # only as many tokens as exist after the match
    ([5, 1, 9, 7, 1, 8, 7, 1], 2, 1, 2, [8, 7]),  # latest occurrence of "7 1" wins (index 3)
    ([5, 1, 9, 7, 2, 8, 6, 1], 2, 1, 2, [9, 7]),  # falls back to the unigram "1"
    ([5, 1, 9, 7, 2, 8, 6, 1], 2, 2, 3, []),  # no bigram match and unigrams not allowed
    ([3, 3, 3, 3], 2, 1, 3, [3]),  # latest earlier "3 3 3" starts at 0, followed by one 3
    ([4, 6, 4, 6, 4], 3, 1, 1, [6, 4]),  # latest earlier "4" at index 2
    ([7], 2, 1, 2, []),  # nothing earlier to match
    ([1, 2, 1, 2], 0, 1, 2, []),  # not asked
    ([2, 9, 1, 2, 9, 5, 2, 9], 2, 1, 3, [5, 2]),  # longest first: "2 9" twice, latest at 3
    ([8, 1, 2, 3, 0, 1, 2, 3, 4, 2, 3], 2, 2, 3, [4, 2]),  # "2 3" latest earlier occurrence at 6
]


@pytest.mark.parametrize("tokens,wanted,min_n,max_n,expected", CASES)
def test_find_continuations_table(tokens, wanted, min_n, max_n, expected):
    width = len(tokens) + 3
    row = np.full((1, width), PAD_ID)
    row[0, : len(tokens)] = tokens
    proposals, counts = find_continuations(row, np.array([len(tokens)]), np.array([wanted]), min_n, max_n)
    assert counts[0] == len(expected)
    assert proposals[0, : counts[0]].tolist() == expected
    assert (proposals[0, counts[0]:] == PAD_ID).all()


def test_rows_are_independent_in_one_call():
    rows = [[1, 2, 3, 1, 2], [4, 4, 4], [9, 8, 7]]
    width = 8
    table = np.full((3, width), PAD_ID)
    for r, t in enumerate(rows):
        table[r, : len(t)] = t
    lengths = np.array([len(t) for t in rows])
    proposals, counts = find_continuations(table, lengths, np.array([2, 2, 2]), 1, 3)
    singles = [find_continuations(table[r : r + 1], lengths[r : r + 1], np.array([2]), 1, 3) for r in range(3)]
    for r, (p, c) in enumerate(singles):
        assert counts[r] == c[0] and proposals[r, : c[0]].tolist() == p[0, : c[0]].tolist()
    assert counts.tolist() == [2, 1, 0]


@pytest.mark.parametrize("min_n,max_n", [(0, 2), (3, 2), (1.5, 2), (-1, -1)])
def test_bad_ngram_bounds(min_n, max_n):
    with pytest.raises(ValueError, match="min_ngram"):
        PromptLookupDrafter(min_ngram=min_n, max_ngram=max_n)


def _brute_force(tokens, length, wanted, min_n, max_n):
    """The definition, one row at a time: the longest n, then the latest earlier occurrence."""
    for n in range(max_n, min_n - 1, -1):
        if length <= n:
            continue
        suffix = list(tokens[length - n : length])
        for start in range(length - n - 1, -1, -1):  # occurrences ending before the last token
            if list(tokens[start : start + n]) == suffix:
                first = start + n
                return list(tokens[first : min(first + wanted, length)])
    return []


def test_find_continuations_equals_brute_force_on_random_rows():
    rng = np.random.default_rng(0)
    for trial in range(200):
        rows, width = int(rng.integers(1, 6)), int(rng.integers(2, 40))
        tokens = rng.integers(0, int(rng.integers(2, 6)), (rows, width))  # small alphabets: many matches
        lengths = rng.integers(1, width + 1, rows)
        wanted = rng.integers(0, 6, rows)
        min_n = int(rng.integers(1, 4))
        max_n = int(rng.integers(min_n, 5))
        proposals, counts = find_continuations(tokens, lengths, wanted, min_n, max_n)
        for r in range(rows):
            expected = _brute_force(tokens[r], lengths[r], wanted[r], min_n, max_n) if wanted[r] else []
            assert counts[r] == len(expected), (trial, r)
            assert list(proposals[r, : counts[r]]) == expected, (trial, r)
            assert (proposals[r, counts[r] :] == PAD_ID).all()


def test_ngrams_longer_than_every_row_find_nothing():
    tokens = np.array([[5, 6, 5], [1, 2, 3]])
    proposals, counts = find_continuations(tokens, np.array([3, 2]), np.array([3, 3]), min_ngram=8, max_ngram=9)
    assert counts.tolist() == [0, 0] and (proposals == PAD_ID).all()
