"""The requests in flight: committed tokens, budgets and which rows are done.

Invariant: ``token_ids[r, :lengths[r]]`` is row r's request's prompt followed by every token
committed so far, exactly; a row is finished once it has committed an EOS token, completed a stop
sequence or committed its ``max_new_tokens[r]`` tokens, and a finished row takes part in no
further forward pass. A row without a request (``BatchState.empty``, or after ``release``)
counts as finished. ``admit`` gives a free row a new request (the engine's continuous batching).
All of this is host-side control data, updated once per step from the verdict the step copied
to the host. Each row also keeps its request's SamplingParams: ``sampling_of`` hands rows that
share one that object (every rule's uniform path) and others a RowSampling.
"""

from __future__ import annotations

import numpy as np

from .types import PAD_ID, HostVerdict, RowSampling, SamplingParams

NO_EOS = -2  # pads a row's EOS ids (never a token, nor PAD_ID)


class BatchState:
    def __init__(self, prompts: list[np.ndarray], max_new_tokens, seeds: np.ndarray, eos_token_ids: np.ndarray,
                 stop_sequences: list[np.ndarray] = (), min_new_tokens: int = 0, max_total_len: int | None = None,
                 sampling: SamplingParams | None = None):
        """max_new_tokens: one budget for every row, or [B]. max_total_len: the row width (prompt
        plus output) to allocate; by default the longest prompt plus the largest budget.
        sampling: every row's until ``admit`` gives one its own (default greedy)."""
        self.num_rows = len(prompts)
        self.prompt_lengths = np.array([len(p) for p in prompts], dtype=np.int64)  # [B]
        self.max_new_tokens = np.broadcast_to(np.asarray(max_new_tokens, dtype=np.int64), (self.num_rows,)).copy()  # [B]
        needed = int((self.prompt_lengths + self.max_new_tokens).max(initial=0))
        self.max_total_len = needed if max_total_len is None else max_total_len
        if self.max_total_len < needed:
            raise ValueError(f"max_total_len={max_total_len} is shorter than a row's prompt plus budget ({needed})")
        self.token_ids = np.full((self.num_rows, self.max_total_len), PAD_ID, dtype=np.int64)  # [B, T]
        for row, prompt in enumerate(prompts):
            self.token_ids[row, : len(prompt)] = prompt
        self.lengths = self.prompt_lengths.copy()  # [B] committed tokens, prompt included
        self.seeds = seeds.astype(np.int64)  # [B]
        self.eos_token_ids = eos_token_ids.astype(np.int64)  # [E], may be empty: every row's unless admit() says
        self.row_eos = np.tile(self.eos_token_ids, (self.num_rows, 1))  # [B, E'] each row's EOS ids, NO_EOS-padded
        self.stop_sequences = [np.asarray(s, dtype=np.int64) for s in stop_sequences]  # a row stops after one
        self.min_new_tokens = min_new_tokens  # EOS is impossible before a row has generated this many
        self.finished = self.max_new_tokens == 0  # [B]
        self.stopped = np.zeros(self.num_rows, dtype=bool)  # [B] ended by an EOS token or a stop sequence
        self.logprobs: np.ndarray | None = None  # [B, T] float32 once a verdict carries them
        self.sampling = SamplingParams() if sampling is None else sampling  # the rows' unless admit() says
        self.row_params = np.full(self.num_rows, self.sampling, dtype=object)  # [B] each row's SamplingParams
        self.row_sampling = np.tile(RowSampling.host_rows(self.sampling), (self.num_rows, 1))  # [B, 4] RowSampling.host_rows
        self._own_sampling = False  # whether admit() ever gave a row other sampling than the batch's

    @classmethod
    def empty(cls, num_rows: int, max_total_len: int, eos_token_ids: np.ndarray, stop_sequences=(),
              min_new_tokens: int = 0, sampling: SamplingParams | None = None) -> "BatchState":
        """``num_rows`` free rows of width ``max_total_len``, for ``admit``."""
        return cls([np.zeros(0, dtype=np.int64)] * num_rows, 0, np.zeros(num_rows, dtype=np.int64), eos_token_ids,
                   stop_sequences, min_new_tokens, max_total_len=max_total_len, sampling=sampling)

    def admit(self, row: int, prompt: np.ndarray, max_new_tokens: int, seed: int,
              eos_token_ids: np.ndarray | None = None, sampling: SamplingParams | None = None) -> None:
        """Give free row ``row`` a new request: its prompt, budget, seed, EOS ids and sampling
        (None: the batch's); nothing of the row's previous request remains."""
        if not self.finished[row]:
            raise ValueError(f"row {row} still holds an unfinished request")
        if len(prompt) + max_new_tokens > self.max_total_len:
            raise ValueError(f"a prompt of {len(prompt)} tokens and max_new_tokens={max_new_tokens} need "
                             f"{len(prompt) + max_new_tokens} positions; rows hold {self.max_total_len}")
        self.token_ids[row] = PAD_ID
        self.token_ids[row, : len(prompt)] = prompt
        self.prompt_lengths[row] = self.lengths[row] = len(prompt)
        self.max_new_tokens[row] = max_new_tokens
        self.seeds[row] = seed
        eos = self.eos_token_ids if eos_token_ids is None else np.asarray(eos_token_ids, dtype=np.int64)
        if len(eos) > self.row_eos.shape[1]:
            wider = np.full((self.num_rows, len(eos)), NO_EOS, dtype=np.int64)
            wider[:, : self.row_eos.shape[1]] = self.row_eos
            self.row_eos = wider
        self.row_eos[row] = NO_EOS
        self.row_eos[row, : len(eos)] = eos
        params = self.sampling if sampling is None else sampling
        self.row_params[row] = params
        self._own_sampling |= params != self.sampling
        self.row_sampling[row] = RowSampling.host_rows(params)
        self.finished[row] = max_new_tokens == 0
        self.stopped[row] = False
        if self.logprobs is not None:
            self.logprobs[row] = np.nan

    def release(self, row: int) -> None:
        """Free ``row`` (its request finished or was cancelled): it joins no further pass."""
        self.finished[row] = True

    @property
    def num_generated(self) -> np.ndarray:
        return self.lengths - self.prompt_lengths

    @property
    def remaining(self) -> np.ndarray:
        """[B] tokens each row may still emit (0 once finished)."""
        return np.where(self.finished, 0, self.max_new_tokens - self.num_generated)

    def has_eos(self) -> bool:
        """Whether some unfinished row stops at an EOS token."""
        return bool((self.row_eos[~self.finished] != NO_EOS).any())

    def active_rows(self) -> np.ndarray:
        return np.flatnonzero(~self.finished)

    def sampling_of(self, rows: np.ndarray, device) -> SamplingParams | RowSampling:
        """How ``rows`` [R] sample: their one SamplingParams when they share it (always so in
        generate()), else a RowSampling on ``device`` (one small host-to-device copy, no
        synchronisation)."""
        if len(rows) == 0 or not self._own_sampling:
            return self.sampling
        host = self.row_sampling[rows]  # [R, 4]
        if (host == host[0]).all():  # the same numbers: the same processing (host_rows)
            return self.row_params[rows[0]]
        return RowSampling.of(host, device)

    def packed_tokens(self, rows: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
        """Committed tokens [starts[i], ends[i]) of each rows[i], packed row after row -> [N]."""
        columns = np.arange(self.token_ids.shape[1])
        wanted = (columns >= starts[:, None]) & (columns < ends[:, None])  # [R, T]
        return self.token_ids[rows][wanted]

    def last_token_ids(self, rows: np.ndarray) -> np.ndarray:
        return self.token_ids[rows, self.lengths[rows] - 1]

    def commit(self, verdict: HostVerdict) -> np.ndarray:
        """Append each row's emitted tokens, cut after the first EOS and at the budget.

        Returns [B] the number of tokens appended per row; sets ``finished``.
        """
        emitted = verdict.token_ids  # [B, K+1]
        slots = np.arange(emitted.shape[1])
        is_eos = (emitted[:, :, None] == self.row_eos[:, None, :]).any(axis=2) & (slots < verdict.num_emitted[:, None])  # [B, K+1]
        through_eos = np.where(is_eos.any(axis=1), is_eos.argmax(axis=1) + 1, verdict.num_emitted)
        appended = np.minimum(np.minimum(verdict.num_emitted, through_eos), self.remaining)  # [B]
        rows, cols = np.nonzero(slots < appended[:, None])
        self.token_ids[rows, self.lengths[rows] + cols] = emitted[rows, cols]
        if verdict.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = np.full(self.token_ids.shape, np.nan, dtype=np.float32)
            self.logprobs[rows, self.lengths[rows] + cols] = verdict.logprobs[rows, cols]
        hit_eos = is_eos.any(axis=1) & (through_eos <= appended)
        hit_stop = self._cut_at_stop_sequences(appended)
        self.lengths += appended
        self.stopped |= hit_eos | hit_stop
        self.finished |= hit_eos | hit_stop | (self.num_generated >= self.max_new_tokens)
        return appended

    def _cut_at_stop_sequences(self, appended: np.ndarray) -> np.ndarray:
        """Shorten ``appended`` [B] (in place) to end right after the first stop sequence that one
        of a row's new tokens completes (a match may begin in the prompt); -> [B] rows that hit one."""
        hit = np.zeros(self.num_rows, dtype=bool)
        if not self.stop_sequences:
            return hit
        for row in np.flatnonzero(appended):
            start = self.lengths[row]
            for end in range(start + 1, start + appended[row] + 1):  # each new token, in order
                if any(end >= len(s) and np.array_equal(self.token_ids[row, end - len(s) : end], s)
                       for s in self.stop_sequences):
                    self.token_ids[row, end : start + appended[row]] = PAD_ID
                    appended[row], hit[row] = end - start, True
                    break
        return hit

    def outputs(self) -> list[list[int]]:
        """Generated tokens per request: prompt excluded, EOS included."""
        return [self.token_ids[r, self.prompt_lengths[r] : self.lengths[r]].tolist() for r in range(self.num_rows)]

    def output_logprobs(self) -> list[list[float]]:
        """Each generated token's log-probability, as ``outputs()`` (verdicts must carry them)."""
        if self.logprobs is None:  # no step ran (max_new_tokens = 0)
            return [[] for _ in range(self.num_rows)]
        return [self.logprobs[r, self.prompt_lengths[r] : self.lengths[r]].tolist() for r in range(self.num_rows)]
