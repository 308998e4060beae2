"""Long-context workloads: prompts of about 1K, 4K or 16K tokens, ragged across the batch.

Where a long context lies in front of every row, the target's verification pass reads a large
KV cache at each step, and a drafter that reads only part of it (a sparse or windowed cache)
becomes cheap next to the target (MagicDec, arXiv 2408.11049); SPIRe (arXiv 2504.06419) stresses
that such rows differ in length, so the batch is ragged. This module makes that regime's prompts
from held-out source files, the model zoo's ``heldout_texts()`` or any ``(id, text)`` pairs:

- Row i's length is drawn uniformly from [context_tokens (1 - spread), context_tokens (1 + spread)]
  (a seeded numpy Generator).
- Its text is the files in a seeded order, each followed by an empty line (a file's trailing
  partial line, as the zoo's 8,000-character held-out samples end mid-line, is left out),
  starting at a different file for each row (rows start evenly spread over the order) and
  running on through the order, back to its first file when the corpus is shorter than the row.
- It is cut at a line end: as many whole lines as keep the prompt within the row's drawn length,
  exactly, by the tokenizer. Files with a line longer than an eighth of the shortest drawn
  length (at least 64 tokens, at most that length) are skipped (minified or data files), so a
  prompt falls short of its drawn length by less than one such line.

Invariant: the prompts are a pure function of (texts, tokenizer, count, context_tokens, spread,
seed, max_tokens); no global random state is read or changed. The file order does not depend on
context_tokens, so 1K, 4K and 16K workloads with one seed start from the same files.

Cost: each file a row reaches is tokenized once (offsets give each line end's token count), and
each prompt once or twice more to check its exact length: O(count x context_tokens) tokenizer
work, about 1 s for 16 prompts of 16K tokens on one CPU core (a fast tokenizer, vocabulary 2048).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

MIN_CONTEXT_TOKENS = 16
LONGEST_LINE_FRACTION = 1 / 8  # of the shortest drawn length (but at least LONGEST_LINE_FLOOR tokens, and at
LONGEST_LINE_FLOOR = 64  # most the shortest drawn length): files with a longer line are skipped


@dataclass(frozen=True)
class LongPrompt:
    token_ids: tuple[int, ...]  # the prompt, exactly as the tokenizer encodes its text
    target_tokens: int  # the drawn length; len(token_ids) <= target_tokens
    file_ids: tuple[str, ...]  # the files it is made of, in order (one repeats when it wrapped around)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def wrapped(self) -> bool:
        """Whether the row ran through the whole order and reused a file."""
        return len(set(self.file_ids)) < len(self.file_ids)


@dataclass(frozen=True)
class _File:
    file_id: str
    text: str  # whole lines, then an empty line
    line_ends: np.ndarray  # [L] character offset after each line's newline
    tokens_before: np.ndarray  # [L] tokens that start before each line end (~ tokens of that prefix)

    @property
    def tokens(self) -> int:
        return int(self.tokens_before[-1])

    @property
    def longest_line(self) -> int:
        return int(np.diff(self.tokens_before, prepend=0).max())


def long_context_prompts(texts: Sequence[tuple[str, str]], tokenizer, count: int, context_tokens: int,
                         spread: float = 0.5, seed: int = 0, max_tokens: int | None = None) -> list[LongPrompt]:
    """``count`` prompts of about ``context_tokens`` tokens from held-out (id, text) pairs (module
    docstring). tokenizer: a fast Hugging Face tokenizer (offsets are needed). max_tokens: the
    most tokens of any prompt (lengths are drawn up to min(context_tokens (1 + spread), max_tokens)),
    e.g. the model's max_position_embeddings less max_new_tokens: the "gpu-long" zoo's 16,384
    positions do not hold a 16K workload at spread 0.5 (up to 24,576 tokens)."""
    if int(count) != count or count < 1:
        raise ValueError(f"count must be a whole number >= 1, got {count!r}")
    if int(context_tokens) != context_tokens or context_tokens < MIN_CONTEXT_TOKENS:
        raise ValueError(f"context_tokens must be a whole number >= {MIN_CONTEXT_TOKENS}, got {context_tokens!r}: "
                         "a long-context workload needs prompts of at least a few lines")
    if int(seed) != seed or seed < 0:
        raise ValueError(f"seed must be a whole number >= 0, got {seed!r}")
    if not 0.0 <= spread < 1.0:
        raise ValueError(f"spread must lie in [0, 1), got {spread!r}: lengths are drawn from "
                         "context_tokens x [1 - spread, 1 + spread] (0 for equal lengths)")
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError("long_context_prompts needs a fast tokenizer (return_offsets_mapping); load it with "
                         "AutoTokenizer.from_pretrained(..., use_fast=True)")
    texts = list(texts)
    if not texts:
        raise ValueError("no texts to make long-context prompts from: pass (id, text) pairs of held-out files, "
                         "e.g. zoo.load(preset).heldout_texts()")
    count, context_tokens = int(count), int(context_tokens)
    low = max(1, math.ceil(context_tokens * (1 - spread)))
    high = max(low, math.floor(context_tokens * (1 + spread)))
    if max_tokens is not None:
        if int(max_tokens) != max_tokens or max_tokens < low:
            raise ValueError(f"max_tokens must be a whole number >= the shortest drawn length {low}, got "
                             f"{max_tokens!r}: lower context_tokens or spread, or allow longer prompts")
        high = min(high, int(max_tokens))
    lengths = np.random.default_rng([seed, 1]).integers(low, high + 1, size=count)
    order = np.random.default_rng([seed, 0]).permutation(len(texts))
    longest_line = min(low, max(LONGEST_LINE_FLOOR, int(low * LONGEST_LINE_FRACTION)))
    starts = (np.arange(count) * len(order)) // count if count <= len(order) else np.arange(count) % len(order)
    files: dict[int, _File | None] = {}

    def file_at(position: int) -> _File | None:
        index = int(order[position % len(order)])
        if index not in files:
            files[index] = _prepare(*texts[index], tokenizer)
        found = files[index]
        return found if found is not None and found.longest_line <= longest_line else None

    prompts = []
    for row, (start, length) in enumerate(zip(starts, lengths)):
        prompts.append(_row(file_at, int(start), int(length), len(order), tokenizer, longest_line, row))
    return prompts


def _prepare(file_id: str, text: str, tokenizer) -> _File | None:
    """The file's whole lines and an empty line, with the token count before each line end."""
    end = text.rfind("\n")
    body = text[: end + 1] if end >= 0 else text + "\n"
    if not body.strip():
        return None
    body += "\n"
    line_ends = np.fromiter((match.end() for match in re.finditer("\n", body)), dtype=np.int64)
    offsets = tokenizer(body, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    token_starts = np.fromiter((start for start, _ in offsets), dtype=np.int64, count=len(offsets))
    # a token that spans a line end ("\n" merged with the next line's indent) counts before it: cut
    # there, its "\n" is still one token
    tokens_before = np.searchsorted(token_starts, line_ends, side="left")
    return _File(file_id, body, line_ends, tokens_before)


def _row(file_at, start: int, length: int, num_files: int, tokenizer, longest_line: int, row: int) -> LongPrompt:
    budget = length
    while True:
        pieces = _take(file_at, start, budget, num_files, longest_line, row, length)
        token_ids = tokenizer("".join(text for _, text in pieces), add_special_tokens=False)["input_ids"]
        if len(token_ids) <= length:
            return LongPrompt(tuple(token_ids), length, tuple(file_id for file_id, _ in pieces))
        # tokens merge differently across file joins: take fewer lines by the excess and check again
        budget -= len(token_ids) - length


def _take(file_at, start: int, budget: int, num_files: int, longest_line: int, row: int, length: int):
    """(file id, text) pieces from the order at ``start`` on, whole lines, about ``budget`` tokens."""
    pieces, used, position, skipped = [], 0, start, 0
    while True:
        found = file_at(position)
        position += 1
        if found is None:
            skipped += 1
            if skipped >= num_files:
                raise ValueError(
                    f"none of the {num_files} texts makes a long-context prompt: each is empty or has a line "
                    f"of more than {longest_line} tokens (an eighth of the shortest drawn length, 64 at least); pass "
                    "more source files, a larger context_tokens or a smaller spread")
            continue
        skipped = 0
        if used + found.tokens <= budget:
            pieces.append((found.file_id, found.text))
            used += found.tokens
            continue
        lines = int(np.searchsorted(found.tokens_before, budget - used, side="right"))
        if lines:
            pieces.append((found.file_id, found.text[: found.line_ends[lines - 1]]))
        if not pieces:  # only when checking against the exact count shrank the budget below one line
            raise ValueError(f"row {row}: the first line of {found.file_id!r} alone is longer than the row's "
                             f"{length} tokens; use a larger context_tokens or a smaller spread")
        return pieces


def summary(prompts: Sequence[LongPrompt]) -> dict:
    """JSON-ready description: drawn and actual lengths (mean, min, max), files used, wrapped rows."""
    drawn = [p.target_tokens for p in prompts]
    actual = [len(p) for p in prompts]
    describe = lambda v: {"mean": float(np.mean(v)), "min": int(min(v)), "max": int(max(v))}  # noqa: E731
    return {
        "num_prompts": len(prompts), "drawn_tokens": describe(drawn), "prompt_tokens": describe(actual),
        "lengths": actual, "distinct_files": len({f for p in prompts for f in p.file_ids}),
        "wrapped_rows": sum(p.wrapped for p in prompts),
    }
