"""Workloads for policy experiments: copy-heavy requests, where prompt lookup shines, and plain
continuation requests, where model drafters win, mixed in set proportions (or alone).

Every request comes from one held-out source file (the model zoo's ``heldout_texts()``, or any
``(id, text)`` pairs), cut at line boundaries as ``zoo.prompts.cut_at_line`` does:

- **continuation**: the file's beginning, at most ``prompt_tokens`` tokens. The model continues
  the file; the text it should produce is nowhere in its context.
- **copy**: the same beginning followed by the file's own first lines again (at most
  ``repeat_tokens`` tokens). A model that has learnt to copy continues with the rest of the
  beginning it has already seen, which prompt lookup proposes verbatim.

Both kinds of request i come from the same file i (files in a seeded order, those too short to
make both skipped), so a copy request differs from its continuation twin only by the repeated
lines, and workloads of any mixture draw from the same files: the copy workload is requests
0..n-1 in their copy form, the continuation workload the same files in their continuation form,
the mixed workload each file in one form or the other.

Proportions hold in every block of ``BLOCK`` consecutive requests (so the first few requests, as
used at batch size 1, are mixed as the whole is), with the order inside a block seeded; the total
number of copy requests is round(fraction x count).

Invariant: a workload is a pure function of (texts, tokenizer, settings, seed); nothing else
(no global random state) changes it. When fewer files qualify than requests are asked for,
files are reused in the same order (``Workload.distinct_files`` says how many were used).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from specdec.drafters.lookup import find_continuations
from specdec.zoo.prompts import cut_at_line

KINDS = ("copy", "continuation")
STANDARD = {"mixed": 0.5, "copy": 1.0, "continuation": 0.0}  # workload name -> fraction of copy requests
BLOCK = 8  # proportions hold in every block of this many consecutive requests


@dataclass(frozen=True)
class Request:
    id: str  # the source file
    kind: str  # "copy" or "continuation"
    prompt: str
    token_ids: tuple[int, ...]
    reference: str  # what the source file itself says next (the text a perfect copier would produce)


@dataclass
class Workload:
    name: str
    copy_fraction: float
    seed: int
    requests: list[Request] = field(default_factory=list)

    def prompts(self, count: int | None = None) -> list[list[int]]:
        """Token ids of the first ``count`` requests (all when None)."""
        return [list(r.token_ids) for r in self.requests[:count]]

    def cycled(self, count: int) -> Workload:
        """The same workload lengthened (or cut) to ``count`` requests by repeating its own in order."""
        if not self.requests:
            raise ValueError(f"workload {self.name!r} has no requests to repeat")
        requests = [self.requests[i % len(self.requests)] for i in range(count)]
        return Workload(name=self.name, copy_fraction=self.copy_fraction, seed=self.seed, requests=requests)

    def kinds(self, count: int | None = None) -> list[str]:
        return [r.kind for r in self.requests[:count]]

    @property
    def distinct_files(self) -> int:
        return len({r.id for r in self.requests})

    def summary(self) -> dict:
        """JSON-ready description: counts, prompt lengths by kind, the request ids and kinds."""
        lengths = {kind: [len(r.token_ids) for r in self.requests if r.kind == kind] for kind in KINDS}
        return {
            "name": self.name, "copy_fraction": self.copy_fraction, "seed": self.seed,
            "num_requests": len(self.requests), "distinct_files": self.distinct_files,
            "num_copy": len(lengths["copy"]), "num_continuation": len(lengths["continuation"]),
            "prompt_tokens": {kind: {"mean": float(np.mean(v)), "min": int(min(v)), "max": int(max(v))}
                              for kind, v in lengths.items() if v},
            "ids": [r.id for r in self.requests], "kinds": self.kinds(),
        }


class WorkloadGenerator:
    """Requests from held-out files (module docstring).

    texts: (id, text) pairs; tokenizer: a Hugging Face tokenizer; prompt_tokens: the most tokens
    of a file's beginning in a prompt; repeat_tokens: the most tokens of the repeated first lines
    of a copy request (prompt_tokens // 4 by default); min_tokens: the fewest tokens of a file's
    beginning; seed: the order of the files and of the kinds within each block.
    """

    def __init__(self, texts: Sequence[tuple[str, str]], tokenizer, prompt_tokens: int = 128,
                 repeat_tokens: int | None = None, min_tokens: int = 32, seed: int = 0):
        if prompt_tokens < 2:
            raise ValueError(f"prompt_tokens must be >= 2, got {prompt_tokens}")
        self.texts = list(texts)
        self.tokenizer = tokenizer
        self.prompt_tokens = int(prompt_tokens)
        self.repeat_tokens = int(repeat_tokens) if repeat_tokens is not None else max(1, prompt_tokens // 4)
        self.min_tokens = int(min_tokens)
        self.seed = int(seed)
        self._order = np.random.default_rng([self.seed, 0]).permutation(len(self.texts))
        self._next = 0  # position in _order of the next file to try
        self._pairs: list[tuple[Request, Request]] = []  # (copy, continuation) per qualifying file

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _pair(self, file_id: str, text: str) -> tuple[Request, Request] | None:
        body = cut_at_line(text, self.tokenizer, self.prompt_tokens)
        head = cut_at_line(text, self.tokenizer, self.repeat_tokens)
        if body is None or head is None or len(head) >= len(body) or not head.strip():
            return None
        if len(self._encode(body)) < self.min_tokens:
            return None
        if not body.endswith("\n"):  # the whole file fitted and lacks a final newline
            body += "\n"
        copy_prompt = body + head
        copy = Request(file_id, "copy", copy_prompt, tuple(self._encode(copy_prompt)), text[len(head):])
        continuation = Request(file_id, "continuation", body, tuple(self._encode(body)), text[len(body):])
        return copy, continuation

    def available(self, limit: int) -> int:
        """How many distinct files make requests, counting no further than ``limit``."""
        self._read_until(limit)
        return min(len(self._pairs), int(limit))

    def _read_until(self, wanted: int) -> None:
        while len(self._pairs) < wanted and self._next < len(self._order):
            file_id, text = self.texts[self._order[self._next]]
            self._next += 1
            pair = self._pair(file_id, text)
            if pair is not None:
                self._pairs.append(pair)

    def pairs(self, count: int, offset: int = 0) -> list[tuple[Request, Request]]:
        """(copy, continuation) requests of files offset..offset+count-1 in the seeded order
        (files reused from the first when there are not enough)."""
        self._read_until(offset + count)
        if not self._pairs:
            raise ValueError(f"none of the {len(self.texts)} texts makes a request of {self.min_tokens}.."
                             f"{self.prompt_tokens} tokens with a shorter repeated beginning")
        return [self._pairs[i % len(self._pairs)] for i in range(offset, offset + count)]

    def workload(self, copy_fraction: float, count: int, offset: int = 0, name: str | None = None) -> Workload:
        """``count`` requests, round(copy_fraction x count) of them copy-heavy, spread evenly
        (every block of BLOCK requests holds its share) in a seeded order within each block."""
        if not 0.0 <= copy_fraction <= 1.0:
            raise ValueError(f"copy_fraction must lie in [0, 1], got {copy_fraction!r}")
        is_copy = copy_pattern(copy_fraction, count, np.random.default_rng([self.seed, 1, offset, count,
                                                                            round(copy_fraction * 1e6)]))
        requests = [pair[0] if copy else pair[1] for pair, copy in zip(self.pairs(count, offset), is_copy)]
        name = name if name is not None else f"copy {copy_fraction:.0%}"
        return Workload(name=name, copy_fraction=float(copy_fraction), seed=self.seed, requests=requests)

    def standard(self, count: int, names: Sequence[str] = tuple(STANDARD), offset: int = 0,
                 mixed_fraction: float = STANDARD["mixed"]) -> dict[str, Workload]:
        """The named workloads of STANDARD (mixed, copy, continuation) over the same files."""
        unknown = set(names) - set(STANDARD)
        if unknown:
            raise ValueError(f"unknown workloads {sorted(unknown)}; choose from {sorted(STANDARD)}")
        fractions = {**STANDARD, "mixed": mixed_fraction}
        return {name: self.workload(fractions[name], count, offset, name=name) for name in names}


def copy_pattern(copy_fraction: float, count: int, rng: np.random.Generator) -> np.ndarray:
    """[count] bools, True for a copy request: request i is copy when floor((i+1) f + 1/2) >
    floor(i f + 1/2) (so every prefix holds its share, within one, and the total is round(f n)),
    then shuffled within blocks of BLOCK."""
    index = np.arange(count)
    pattern = np.floor((index + 1) * copy_fraction + 0.5) > np.floor(index * copy_fraction + 0.5)
    for start in range(0, count, BLOCK):
        pattern[start : start + BLOCK] = rng.permutation(pattern[start : start + BLOCK])
    return pattern


def oracle_lookup_tau(request: Request, tokenizer, num_draft_tokens: int = 4, max_new_tokens: int = 128,
                      min_ngram: int = 1, max_ngram: int = 3) -> float:
    """Tokens per step prompt lookup would give if the target produced exactly the source file's
    own continuation (``request.reference``): each step proposes ``num_draft_tokens`` by
    PromptLookupDrafter's matching, accepts the proposal's longest prefix that agrees with the
    reference, and emits one more token. A property of the request, not of any model."""
    text = request.reference[: 64 * max_new_tokens]  # far more characters than max_new_tokens tokens need
    reference = tokenizer(text, add_special_tokens=False)["input_ids"][:max_new_tokens]
    if not reference:
        return float("nan")
    sequence = np.array(list(request.token_ids) + reference, dtype=np.int64)[None, :]  # [1, T]
    length, end = len(request.token_ids), len(request.token_ids) + len(reference)
    steps = 0
    while length < end:
        wanted = np.array([min(num_draft_tokens, end - length - 1)], dtype=np.int64)
        proposals, counts = find_continuations(sequence, np.array([length]), wanted, min_ngram, max_ngram)
        proposed = proposals[0, : counts[0]]
        truth = sequence[0, length : length + len(proposed)]
        accepted = int(np.argmin(np.append(proposed == truth, False)))  # the agreeing prefix
        length += accepted + 1
        steps += 1
    return len(reference) / steps


def mean_oracle_lookup_tau(workload: Workload, tokenizer, num_draft_tokens: int = 4,
                           max_new_tokens: int = 128) -> dict[str, float]:
    """Mean ``oracle_lookup_tau`` of the workload's requests, by kind."""
    found = {}
    for kind in KINDS:
        taus = [oracle_lookup_tau(r, tokenizer, num_draft_tokens, max_new_tokens) for r in workload.requests
                if r.kind == kind]
        taus = [t for t in taus if not math.isnan(t)]
        if taus:
            found[kind] = float(np.mean(taus))
    return found
