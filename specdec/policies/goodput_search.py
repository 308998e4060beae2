"""GoodputPolicy's choice of draft lengths (SmartSpec, Liu et al. 2024, arXiv 2406.14066;
ALGORITHMS.md §3): over the active rows, lengths k_i in 0..cap_i that maximise

    G(k) = sum_i E[tau_i](k_i) / T(k),   E[tau_i](k) = 1 + sum_{j<k} g_ij,

g_ij the expected tokens the j-th draft token of row i adds (non-increasing in j) and T the
step time (step_time.LinearStepTime), or, with search "finish", one length for every row that
minimises the predicted time until every row is done (finish.call_times).

"exact": for each depth m = 1..K (the longest draft), Dinkelbach's method on the ratio; with m
fixed, max_k N(k) - lambda T(k) separates over rows and each row's best k is found by
enumeration, so every iteration is exact and the iteration converges to the depth's optimum
ratio; the best depth wins. Invariant: the global optimum of G under the model (tests compare
with brute force). Cost O(K^2 A) numpy work per iteration, a few iterations.

Speculation must beat plain decoding (k = 0) by ``min_gain``; otherwise every row decodes
plainly (SmartSpec: 10%).
"""

from __future__ import annotations

import numpy as np

from .finish import call_times, shortest_best
from .step_time import LinearStepTime

SEARCHES = ("exact", "finish")


def cumulative_gains(gains: np.ndarray) -> np.ndarray:
    """[..., A, K] gains -> [..., A, K+1] the expected tokens each length 0..K adds beyond the one emitted."""
    cumulative = np.zeros(gains.shape[:-1] + (gains.shape[-1] + 1,))
    np.cumsum(gains, axis=-1, out=cumulative[..., 1:])
    return cumulative


def _goodput(cumulative: np.ndarray, k: np.ndarray, step_time: LinearStepTime) -> float:
    """sum_i E[tau_i](k_i) / T(k) with the cumulative gains [A, K+1]."""
    k = np.asarray(k, dtype=np.int64)
    return float(len(k) + cumulative[np.arange(len(k)), k].sum()) / float(step_time(k))


def goodput_of(gains: np.ndarray, k: np.ndarray, step_time: LinearStepTime) -> float:
    """G(k) for gains [A, K] and lengths k [A]."""
    return _goodput(cumulative_gains(np.asarray(gains, dtype=np.float64)), k, step_time)


def search_exact(gains: np.ndarray, caps: np.ndarray, step_time: LinearStepTime, tolerance: float = 1e-12,
                 start: np.ndarray | None = None) -> np.ndarray:
    """argmax_k G(k) with 0 <= k_i <= caps_i (module docstring), every depth iterated at once
    ([depths, rows, lengths] arrays). gains: [A, K]; caps: [A]; start: [A] a choice to begin from
    (the last decision's): each depth starts from the better of it and plain decoding, a lower
    bound of the optimum, so a good start saves iterations."""
    return _search_exact(cumulative_gains(np.asarray(gains, dtype=np.float64)), caps, step_time, tolerance, start)


def _search_exact(cumulative: np.ndarray, caps: np.ndarray, step_time: LinearStepTime, tolerance: float = 1e-12,
                  start: np.ndarray | None = None, plain: float | None = None) -> np.ndarray:
    """search_exact over the cumulative gains [A, K+1]; plain: G of plain decoding, if known."""
    num_rows, max_k = cumulative.shape[0], cumulative.shape[1] - 1
    caps = np.minimum(np.asarray(caps, dtype=np.int64), max_k)
    best_k = np.zeros(num_rows, dtype=np.int64)
    best = _goodput(cumulative, best_k, step_time) if plain is None else plain
    if start is not None:
        start = np.minimum(np.asarray(start, dtype=np.int64), caps)
        started = _goodput(cumulative, start, step_time)
        if started > best:
            best, best_k = started, start
    max_depth = int(caps.max(initial=0))
    if max_depth < 1:
        return best_k
    lengths = np.arange(max_k + 1)
    start_cost = np.broadcast_to(np.asarray(step_time.row_cost, dtype=np.float64), (num_rows,))  # [A]
    row_cost = np.where(lengths > 0, start_cost[:, None], 0.0) + step_time.token_cost[:, None] * lengths  # [A, K+1]
    depths = np.arange(1, max_depth + 1)  # [M]
    allowed = lengths[None, None, :] <= np.minimum(caps[None, :], depths[:, None])[:, :, None]  # [M, A, K+1]
    masked = np.where(allowed, cumulative[None], -np.inf)  # [M, A, K+1]
    fixed = step_time.base + step_time.draft_fixed + step_time.depth_cost * depths  # [M]
    rows = np.arange(num_rows)[None, :]  # [1, A]
    ratio = np.full(len(depths), best)  # [M]
    chosen = np.zeros((len(depths), num_rows), dtype=np.int64)  # [M, A]
    running = np.ones(len(depths), dtype=bool)  # [M] depths still iterating
    for _ in range(100):
        k = np.argmax(masked - ratio[:, None, None] * row_cost[None], axis=2)  # [M, A] first maximum: shorter on ties
        chosen[running] = k[running]
        new_ratio = (num_rows + cumulative[rows, k].sum(axis=1)) / (fixed + row_cost[rows, k].sum(axis=1))  # [M]
        running &= new_ratio > ratio * (1 + tolerance)
        if not running.any():
            break
        ratio = np.where(running, new_ratio, ratio)
    # each depth's choice at its true time (its longest draft may be below the depth)
    achieved = (num_rows + cumulative[rows, chosen].sum(axis=1)) / step_time(chosen)  # [M]
    for m in range(len(depths)):
        if chosen[m].any() and achieved[m] > best * (1 + tolerance):
            best, best_k = float(achieved[m]), chosen[m]
    return best_k.copy()


def choose_lengths(gains: np.ndarray, caps: np.ndarray, step_time: LinearStepTime, search: str = "exact",
                   min_gain: float = 0.10, start: np.ndarray | None = None,
                   remaining: np.ndarray | None = None) -> tuple[np.ndarray, float, float]:
    """Draft lengths [A] by ``search``, or all zeros unless they beat plain decoding by
    ``min_gain``; also the predicted goodput of the choice and of plain decoding (tokens per
    step's second; for "finish", tokens per second until every row is done). gains: [A, K]
    ("finish" also takes samples [J, A, K] and times the call over them); start: [A] the exact
    search's starting choice; remaining: [A] the rows' remaining budgets ("finish" only)."""
    if search not in SEARCHES:
        raise ValueError(f"search must be one of {SEARCHES}, got {search!r}")
    gains = np.asarray(gains, dtype=np.float64)
    caps = np.minimum(np.asarray(caps, dtype=np.int64), gains.shape[-1])
    zeros = np.zeros(len(caps), dtype=np.int64)
    if search == "finish":
        if remaining is None or len(remaining) != len(caps):
            raise ValueError("search='finish' needs every active row's remaining budget (remaining=[A])")
        if len(caps) == 0:
            return zeros, float("nan"), float("nan")
        times = call_times(gains, caps, step_time, remaining)  # [..., K+1]
        times = times.reshape(-1, times.shape[-1]).mean(axis=0)  # [K+1] the expectation over samples of the rates
        if not times[0] > 0:
            return zeros, float("nan"), float("nan")  # no budget left in any row
        goodput = float(np.sum(remaining)) / times  # [K+1]
        best = shortest_best(goodput)  # the soonest finish, the shorter length on ties
        plain, chosen = float(goodput[0]), float(goodput[best])
        if chosen < (1.0 + min_gain) * plain:
            return zeros, plain, plain
        return np.minimum(caps, best).astype(np.int64), chosen, plain
    if gains.ndim != 2:
        raise ValueError("search='exact' takes gains [A, K]; samples of them [J, A, K] are for 'finish' only")
    cumulative = cumulative_gains(gains)  # [A, K+1]
    plain = _goodput(cumulative, zeros, step_time)
    if len(caps) == 0 or caps.max() <= 0:
        return zeros, plain, plain
    k = _search_exact(cumulative, caps, step_time, start=start, plain=plain)
    chosen = _goodput(cumulative, k, step_time)
    if chosen < (1.0 + min_gain) * plain:
        return zeros, plain, plain
    return k, chosen, plain
