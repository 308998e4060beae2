"""The data that flows between drafters, verifiers and policies (DESIGN §3).

Invariant: tensors at a component boundary have static shapes padded with ``PAD_ID`` and
per-row counts beside them. Device data (token ids, probabilities) are torch tensors; control
data the host decides on (how many tokens each row drafts, how many it emitted) are numpy
arrays, so that building the next forward pass never waits on the device.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np
import torch

from .timing import current_stream
from .transfer import to_device_many


def is_int_at_least(value, minimum: int) -> bool:
    """Whether ``value`` is an integer (Python or numpy, not a bool) of at least ``minimum``: the
    check every count-like option of the library makes before a clear ValueError."""
    return not isinstance(value, bool) and isinstance(value, (int, np.integer)) and value >= minimum

PAD_ID = -1  # fills token slots beyond a row's count


@dataclass(frozen=True)
class SamplingParams:
    """How the target's next-token distribution is processed before sampling.

    ``repetition_penalty`` (greedy decoding too) first divides the logit of every token that
    already occurs in the row by the penalty when positive and multiplies it when negative
    (token_rules.py). ``temperature=0`` is greedy decoding (top-k and top-p are then ignored).
    Otherwise the logits are divided by the temperature, cut to the ``top_k`` most likely
    tokens, then to the smallest set whose probability reaches ``top_p`` (the order Hugging Face
    applies them in). Speculative decoding is lossless with respect to this processed distribution.
    """

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, numbers.Real) or math.isnan(self.temperature):
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if self.temperature < 0:
            raise ValueError(
                f"temperature must be >= 0, got {self.temperature}: use 0 for greedy decoding "
                "or a positive value to sample"
            )
        if self.top_k is not None and not is_int_at_least(self.top_k, 1):
            raise ValueError(f"top_k must be an integer >= 1 or None (no cut), got {self.top_k!r}")
        if self.top_p is not None and (
            not isinstance(self.top_p, numbers.Real) or not (0.0 < self.top_p <= 1.0)
        ):
            raise ValueError(f"top_p must lie in (0, 1] or be None (no cut), got {self.top_p!r}")
        penalty = self.repetition_penalty
        if penalty is not None and (isinstance(penalty, bool) or not isinstance(penalty, numbers.Real)
                                    or not 0.0 < penalty < float("inf")):
            raise ValueError(f"repetition_penalty must be a number > 0 (1 changes nothing) or None, got {penalty!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


NO_TOP_K = 2**62  # RowSampling.top_k of a row without a top-k cut (exact in float64 too)


@dataclass
class RowSampling:
    """The sampling parameters of rows that do not all share one SamplingParams (an Engine
    serving requests that bring their own), one entry per row, as device tensors.

    Rows that share one SamplingParams get that object instead (BatchState.sampling_of), and
    every rule keeps its uniform path for it. Under a RowSampling, sampling.process_logits
    gives a greedy row the point mass on its argmax: the sampled rules then accept a draft token
    exactly when it is the argmax and emit the argmax, which is the greedy rule. Entries that
    change nothing (no cut, no penalty, temperature 1 on greedy rows) are neutral values, so a
    row gets bit-for-bit the numbers its own SamplingParams gives. Host flags say which steps
    any row needs; ``greedy`` (every row greedy) mirrors SamplingParams.greedy.
    """

    temperature: torch.Tensor  # [R] float32, 1 on greedy rows
    inv_temperature: torch.Tensor  # [R] float32, 1 / temperature rounded in float32 (see ``divide``)
    is_greedy: torch.Tensor  # [R] bool
    top_k: torch.Tensor  # [R] int64, NO_TOP_K: no cut
    top_p: torch.Tensor  # [R] float32, inf: no cut
    penalty: torch.Tensor  # [R] float32, 1: no repetition penalty
    inv_penalty: torch.Tensor  # [R] float32, 1 / penalty rounded in float32
    greedy: bool  # host: every row greedy
    some_greedy: bool  # host: some row greedy (its distribution is the point mass on its argmax)
    cuts_top_k: bool  # host: some row cuts to its top k
    cuts_top_p: bool  # host: some row cuts to its top p
    penalises: bool  # host: some row has a repetition penalty

    @staticmethod
    def host_rows(params: SamplingParams) -> tuple[float, float, float, float]:
        """(temperature, top_k, top_p, penalty) of one request, neutral where it changes nothing:
        BatchState keeps these per row, ``of`` turns them into tensors."""
        if params.greedy:
            return 0.0, float(NO_TOP_K), math.inf, _neutral_penalty(params.repetition_penalty)
        top_k = float(NO_TOP_K) if params.top_k is None or params.top_k >= NO_TOP_K else float(params.top_k)
        top_p = math.inf if params.top_p is None or params.top_p >= 1.0 else float(params.top_p)
        return float(params.temperature), top_k, top_p, _neutral_penalty(params.repetition_penalty)

    @classmethod
    def of(cls, rows: np.ndarray, device) -> "RowSampling":
        """rows: [R, 4] float64 (host_rows of each row) -> a RowSampling on ``device``, in one
        host-to-device copy (the float32 values travel as their bits)."""
        temperature, top_k, top_p, penalty = (rows[:, i] for i in range(4))
        greedy = temperature == 0.0
        floats = np.stack([np.where(greedy, 1.0, temperature), top_p, penalty]).astype(np.float32)  # [3, R]
        inverses = np.float32(1.0) / floats[[0, 2]]  # [2, R] IEEE float32 reciprocals, as ATen's host code rounds them
        floats = np.concatenate([floats, inverses])  # [5, R]
        float_bits, top_k_t, greedy_t = to_device_many([floats.view(np.int32), top_k.astype(np.int64), greedy],
                                                       torch.device(device))
        temperature_t, top_p_t, penalty_t, inv_temperature_t, inv_penalty_t = float_bits.int().view(torch.float32)
        return cls(temperature=temperature_t, inv_temperature=inv_temperature_t, is_greedy=greedy_t.bool(),
                   top_k=top_k_t, top_p=top_p_t, penalty=penalty_t, inv_penalty=inv_penalty_t,
                   greedy=bool(greedy.all()), some_greedy=bool(greedy.any()),
                   cuts_top_k=bool((top_k[~greedy] < NO_TOP_K).any()), cuts_top_p=bool(np.isfinite(top_p[~greedy]).any()), penalises=bool((penalty != 1.0).any()))

    def take(self, index: torch.Tensor) -> "RowSampling":
        """The rows ``index`` ([R'] device indices) of these; the host flags stay (a superset)."""
        return RowSampling(temperature=self.temperature[index], inv_temperature=self.inv_temperature[index],
                           is_greedy=self.is_greedy[index], top_k=self.top_k[index], top_p=self.top_p[index],
                           penalty=self.penalty[index], inv_penalty=self.inv_penalty[index],
                           greedy=self.greedy, some_greedy=self.some_greedy, cuts_top_k=self.cuts_top_k,
                           cuts_top_p=self.cuts_top_p, penalises=self.penalises)

    def per_row(self, values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """``values`` [R] shaped to broadcast against ``like`` [R, ...]."""
        return values.view(-1, *([1] * (like.dim() - 1)))

    def divide(self, x: torch.Tensor, divisors: torch.Tensor, reciprocals: torch.Tensor) -> torch.Tensor:
        """x [R, ...] float32 divided by each row's divisor [R], rounded exactly as dividing x by
        that row's value as one Python float rounds on x's device, which the uniform path does: on
        CUDA, ATen divides a tensor by a CPU scalar as x * (1 / b), the reciprocal rounded to float32
        on the host (div_true_kernel_cuda), which can differ from x / b in the last bit; elsewhere
        it divides. So a row's numbers are bit-for-bit those of its own SamplingParams."""
        if x.device.type == "cuda":
            return x * self.per_row(reciprocals, x)
        return x / self.per_row(divisors, x)


def _neutral_penalty(penalty: float | None) -> float:
    return 1.0 if penalty is None else float(penalty)


def take_rows(sampling: "SamplingParams | RowSampling", index: torch.Tensor) -> "SamplingParams | RowSampling":
    """The sampling of rows ``index`` of those ``sampling`` describes (a SamplingParams: itself)."""
    return sampling.take(index) if isinstance(sampling, RowSampling) else sampling


@dataclass
class Plan:
    """What each row does this step: which drafter proposes for it, and how many tokens.

    ``num_draft_tokens`` of 0 means plain decoding for that row this step. ``trees`` asks a
    drafter that grows token trees (it has a TreeSpec) for a tree of ``num_draft_tokens`` nodes
    or for a chain of as many tokens, row by row: the node budget is to trees what k is to chains.
    """

    drafter_index: np.ndarray  # [B] int64
    num_draft_tokens: np.ndarray  # [B] int64
    trees: np.ndarray | None = None  # [B] bool: a token tree (True) or a chain; None: as each drafter's spec says

    @property
    def max_draft_tokens(self) -> int:
        return int(self.num_draft_tokens.max(initial=0))


@dataclass
class Draft:
    """A tree of proposed tokens per row; a chain is the tree whose node i has parent i - 1.

    Nodes are stored parents first: node i's parent ``parents[r, i]`` is an earlier node or -1,
    the row's last committed token (the root). ``parents`` None means every row is a chain.
    ``probs`` holds, for each node, the processed distribution it was drawn from given its parent
    and the siblings drawn before it (for siblings drawn without replacement: the parent's
    distribution with the earlier siblings removed, renormalised); it is ``None`` for point-mass
    proposals (prompt lookup, greedy or top-k children), which the acceptance rule treats as
    one-hot. ``depths`` [B] (host) is each row's tree depth as built (a chain's: its length);
    ``max_children`` bounds the work of the sampling rule (sampling.walk_tree).
    """

    token_ids: torch.Tensor  # [B, K] int64, PAD_ID beyond num_tokens
    num_tokens: np.ndarray  # [B] int64, host-side
    probs: torch.Tensor | None = None  # [B, K, V] float32
    parents: torch.Tensor | None = None  # [B, K] int64, -1 for children of the root
    depths: np.ndarray | None = None  # [B] int64, host-side; None for chains (num_tokens)
    max_children: int | None = None  # host: the most children one node has (None: unknown)
    well_formed: bool = False  # built by specdec's own tree builders, so the verifier need not check it

    @property
    def max_tokens(self) -> int:
        return self.token_ids.shape[1]

    @property
    def is_tree(self) -> bool:
        return self.parents is not None

    @property
    def row_depths(self) -> np.ndarray:
        """[B] how deep each row's draft reaches (the most tokens it can have accepted)."""
        return self.num_tokens if self.depths is None else np.minimum(self.depths, self.num_tokens)

    def to(self, device: torch.device) -> "Draft":
        """The same draft on ``device`` (itself when it is there already): a drafter may sit on
        another device than the target."""
        device = torch.device(device)
        if self.token_ids.device == device:
            return self
        # asynchronous only towards a GPU: a copy to the host must be complete when it is read
        non_blocking = device.type == "cuda"
        move = lambda tensor: None if tensor is None else tensor.to(device, non_blocking=non_blocking)  # noqa: E731
        return Draft(token_ids=move(self.token_ids), num_tokens=self.num_tokens, probs=move(self.probs),
                     parents=move(self.parents), depths=self.depths, max_children=self.max_children,
                     well_formed=self.well_formed)


@dataclass
class Verdict:
    """What the target decided this step, per row (sampling.py defines the vocabulary).

    ``token_ids`` holds the accepted draft tokens (a tree's: its accepted path) followed by one recovered or bonus token;
    rows that took no part in the step have ``num_emitted == 0``.
    """

    token_ids: torch.Tensor  # [B, K+1] int64, PAD_ID beyond num_emitted
    num_emitted: torch.Tensor  # [B] int64
    num_accepted: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None = None  # [B, K+1] float32: log p of each emitted token, when asked for
    path: torch.Tensor | None = None  # [B, K] int64: a tree draft's accepted nodes in order, -1 beyond (device only)
    tree_problems: torch.Tensor | None = None  # [B] int64: a malformed tree's sampling.TREE_PROBLEMS code, 0 if none

    def to_host(self, group=None) -> "HostVerdict":
        """Copy to the host: the one synchronisation of a decoding step. With a process
        ``group`` (a tensor-parallel target), every rank gets rank 0's verdict. Log-probabilities
        travel in the same transfer, as the bits of their float32 values."""
        return self.copy_to_host(group).wait()

    def copy_to_host(self, group=None) -> "HostCopy":
        """Start the copy of ``to_host`` without waiting for it: on a GPU the verdict is queued
        for pinned host memory behind the kernels that compute it, so the host may queue more
        work (the next step) before it waits (``HostCopy.wait``)."""
        parts = [self.token_ids, self.num_emitted[:, None], self.num_accepted[:, None]]
        if self.tree_problems is not None:
            parts.append(self.tree_problems[:, None])
        if self.logprobs is not None:
            parts.append(self.logprobs.float().contiguous().view(torch.int32).long())  # [B, K+1]
        packed = torch.cat(parts, dim=1)  # [B, K+3], + 1 with tree problems, + K+1 with logprobs: one transfer
        if group is not None:
            from .distributed import broadcast_from_first_rank

            packed = broadcast_from_first_rank(packed, group)
        done = None
        if packed.is_cuda:
            host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            host.copy_(packed, non_blocking=True)
            done = torch.cuda.Event()
            done.record(current_stream(packed.device))
        else:
            host = packed
        return HostCopy(host, done, self.token_ids.shape[1], self.tree_problems is not None, self.logprobs is not None)


@dataclass
class HostCopy:
    """A verdict on its way to the host (``Verdict.copy_to_host``)."""

    packed: torch.Tensor  # [B, C] int64 on the host (pinned on a GPU's way)
    done: object  # the torch.cuda.Event recorded after the copy; None on the CPU
    width: int  # K+1
    has_tree_problems: bool
    has_logprobs: bool

    def wait(self) -> "HostVerdict":
        """Wait for the copy (the step's synchronisation) -> the HostVerdict."""
        if self.done is not None:
            self.done.synchronize()
        host = self.packed.numpy()
        width, logprobs, tree_problems = self.width, None, None
        end = width + 2
        if self.has_tree_problems:
            tree_problems, end = host[:, end], end + 1
        if self.has_logprobs:
            logprobs = np.ascontiguousarray(host[:, end:]).astype(np.int32).view(np.float32)
        return HostVerdict(token_ids=host[:, :width], num_emitted=host[:, width], num_accepted=host[:, width + 1],
                           logprobs=logprobs, tree_problems=tree_problems)


@dataclass
class HostVerdict:
    token_ids: np.ndarray  # [B, K+1]
    num_emitted: np.ndarray  # [B]
    num_accepted: np.ndarray  # [B]
    logprobs: np.ndarray | None = None  # [B, K+1] float32
    tree_problems: np.ndarray | None = None  # [B] int64, 0 where the tree is sound


@dataclass
class VerifyCost:
    """What one verification forward cost the target."""

    target_tokens: int  # token slots the target computed, padding included
    padding_tokens: int  # of which padding
