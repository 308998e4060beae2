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
with brute force). Cost O(K^2 A) work per iteration, a few iterations: up to SMALL_SEARCH rows
as Python loops over lists (``_search_rows``), where numpy's fixed cost per call would dominate,
above as [depths, rows, lengths] numpy arrays (``_search_exact``). Both take the same float
operations in the same order (a sum over rows in numpy's pairwise order, ``numpy_sum``), so they
decide, and predict, bit for bit alike (tests/policies/test_goodput.py).

Speculation must beat plain decoding (k = 0) by ``min_gain``; otherwise every row decodes
plainly (SmartSpec: 10%).
"""

from __future__ import annotations

import numpy as np

from .finish import call_times, shortest_best
from .step_time import LinearStepTime, numpy_sum, row_values

SEARCHES = ("exact", "finish")
SMALL_SEARCH = 16  # rows up to which the exact search loops in Python (fewer numpy calls than rows to loop over)


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


def _costs(step_time: LinearStepTime, num_rows: int, max_k: int) -> list[list[float]]:
    """[A][K+1] what each row adds to the step drafting each length 0..K, as _search_exact reads it
    (the row's cost plus its token cost times the length; 0.0 at length 0)."""
    costs = []
    for start, token_cost in zip(row_values(step_time.row_cost, num_rows), row_values(step_time.token_cost, num_rows)):
        row = [0.0]
        for length in range(1, max_k + 1):
            row.append(start + token_cost * length)
        costs.append(row)
    return costs


def _gathered(cumulative: list[list[float]], costs: list[list[float]], k: list[int]) -> tuple[float, float]:
    """Choice k [A]'s tokens beyond one a row and its rows' share of the step time (_costs),
    each summed over the rows in numpy's order (numpy_sum: one running sum below 8 rows)."""
    if len(k) < 8:
        tokens = per_row = 0.0
        for gains, cost, length in zip(cumulative, costs, k):
            tokens += gains[length]
            per_row += cost[length]
        return tokens, per_row
    return (numpy_sum([gains[length] for gains, length in zip(cumulative, k)]),
            numpy_sum([cost[length] for cost, length in zip(costs, k)]))


def _rows_goodput(cumulative: list[list[float]], costs: list[list[float]], k: list[int],
                  step_time: LinearStepTime) -> float:
    """_goodput over lists (cumulative gains and _costs [A][K+1]), in its float operations."""
    longest = max(k, default=0)
    if longest == 0:  # plain decoding: every row's column 0, whose sums are 0.0
        return (len(k) + 0.0) / (step_time.base + 0.0)
    tokens, per_row = _gathered(cumulative, costs, k)
    return (len(k) + tokens) / (step_time.base + per_row + (step_time.draft_fixed + step_time.depth_cost * longest))


def _search_rows(cumulative: list[list[float]], costs: list[list[float]], caps: list[int], step_time: LinearStepTime,
                 start: list[int] | None, plain: float, tolerance: float = 1e-12) -> tuple[list[int], float]:
    """_search_exact as Python loops over lists (cumulative gains and _costs [A][K+1]), caps [A]
    (at most K), start [A] or None,
    plain: G of plain decoding; the same iterations in the same float operations, so the same
    choice [A], returned with its goodput (_rows_goodput's). Every depth starts from the same
    ratio, so one scan of each row gives every depth's first choice (the first maximum over each
    prefix of its lengths); a depth whose first choice is that of the depth before it, which
    stopped there, stops there too (its step time is no shorter where depth_cost >= 0, its
    choice's goodput the same) and is skipped."""
    num_rows, max_depth = len(caps), max(caps, default=0)
    best, best_k = plain, [0] * num_rows
    if start is not None:
        start = [min(length, cap) for length, cap in zip(start, caps)]
        started = _rows_goodput(cumulative, costs, start, step_time)
        if started > best:
            best, best_k = started, start
    if max_depth < 1:
        return best_k, best
    base, draft_fixed, depth_cost = step_time.base, step_time.draft_fixed, step_time.depth_cost
    margin, initial = 1.0 + tolerance, best
    firsts = []  # [A][max_depth+1] each row's first maximum at ratio ``initial`` over its lengths 0..min(cap, depth)
    for gains, cost, cap in zip(cumulative, costs, caps):
        best_length, best_value, row = 0, gains[0] - initial * cost[0], [0]
        for length in range(1, cap + 1):
            value = gains[length] - initial * cost[length]
            if value > best_value:
                best_length, best_value = length, value
            row.append(best_length)
        firsts.append(row + [best_length] * (max_depth - cap))
    stopped = None  # [A] the last depth's choice, where it stopped at its first one
    for depth in range(1, max_depth + 1):
        k = [row[depth] for row in firsts]  # [A]
        if k == stopped:
            continue
        fixed = base + draft_fixed + depth_cost * depth
        ratio = initial
        for iteration in range(100):
            tokens, per_row = _gathered(cumulative, costs, k)
            new_ratio = (num_rows + tokens) / (fixed + per_row)
            if not new_ratio > ratio * margin or iteration == 99:
                break
            ratio, k = new_ratio, []
            for gains, cost, cap in zip(cumulative, costs, caps):
                best_length, best_value = 0, gains[0] - ratio * cost[0]
                for length in range(1, min(cap, depth) + 1):
                    value = gains[length] - ratio * cost[length]
                    if value > best_value:
                        best_length, best_value = length, value
                k.append(best_length)
        monotone = depth_cost >= 0 and num_rows + tokens >= 0 and fixed + per_row > 0
        stopped = k if iteration == 0 and monotone else None
        longest = max(k)
        if longest > 0:  # the depth's choice at its true time (its longest draft may be below the depth)
            achieved = (num_rows + tokens) / (base + per_row + (draft_fixed + depth_cost * longest))
            if achieved > best * margin:
                best, best_k = achieved, k
    return best_k, best


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
    if len(caps) <= SMALL_SEARCH:
        k, chosen, plain = choose_rows(cumulative_gains(gains).tolist(), caps.tolist(), step_time, min_gain,
                                       None if start is None else np.asarray(start, dtype=np.int64).tolist())
        return np.array(k, dtype=np.int64), chosen, plain
    cumulative = cumulative_gains(gains)  # [A, K+1]
    plain = _goodput(cumulative, zeros, step_time)
    if caps.max() <= 0:
        return zeros, plain, plain
    k = _search_exact(cumulative, caps, step_time, start=start, plain=plain)
    chosen = _goodput(cumulative, k, step_time)
    if chosen < (1.0 + min_gain) * plain:
        return zeros, plain, plain
    return k, chosen, plain


def choose_rows(cumulative: list[list[float]], caps: list[int], step_time: LinearStepTime, min_gain: float = 0.10,
                start: list[int] | None = None) -> tuple[list[int], float, float]:
    """choose_lengths(search="exact") over Python lists, its exact search as loops (_search_rows):
    cumulative gains [A][K+1] (cumulative_gains'), caps [A] (at most K), start [A]; the same
    lengths [A] and goodputs, bit for bit, at a cost that grows with the rows where numpy's is
    fixed (SMALL_SEARCH rows at the most)."""
    costs = _costs(step_time, len(caps), len(cumulative[0]) - 1 if cumulative else 0)
    zeros = [0] * len(caps)
    plain = _rows_goodput(cumulative, costs, zeros, step_time)
    if max(caps, default=0) <= 0:
        return zeros, plain, plain
    k, chosen = _search_rows(cumulative, costs, caps, step_time, start, plain)
    if chosen < (1.0 + min_gain) * plain:
        return zeros, plain, plain
    return k, chosen, plain
