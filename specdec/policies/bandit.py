"""BanditPolicy: learn which drafter serves each request best (SPIN, Chen et al., INFOCOM 2025,
arXiv 2503.15921, §III: heterogeneous drafters chosen by a multi-armed bandit whose reward is a
rate of tokens per second; ALGORITHMS.md §2 gives specdec's reading of it).

Arms are the drafters given to generate(); every row drafts ``num_draft_tokens`` tokens with the
drafter its bandit picks. ``scope="request"`` keeps one bandit per request (row), started with
each generate() call from what earlier requests taught (``warm_start`` pseudo-pulls per arm at
the population's mean reward); ``scope="batch"`` keeps one bandit for the whole batch that picks one
drafter per step (a "time slot", as in the paper) and keeps learning across calls.

Reward of a row in a step (request scope): tokens it emitted / seconds attributed to it.
Attribution (our choice; the paper's full text was not available): the verify pass is one read of
the target's weights shared by every row, so measured verify time is split equally over the step's
active rows; a drafter's measured time (the larger of its GPU time ``StepRecord.drafter_time_s``
and its host-clock time ``drafter_wall_s``: prompt lookup works on the host) is split over the
rows it drafted for in proportion to the tokens they asked for. With a ``CostModel`` the times are predicted
instead of measured (no timing noise): fixed and per-pass terms are split equally, per-row,
per-token and per-KV-token terms go to the row that caused them. The batch-level reward is the
emitted tokens per active row over the step's wall time (``StepRecord.step_time_s``; without
it, or with a cost model, the draft + verify times): per row, so that slots with all rows active
and slots in a call's tail compare. Rewards are normalised by the largest reward seen so far.

Switches (request and batch scope): a bandit that plays another drafter than at its last step
(or its first step of a call) plays it for ``hold_steps`` steps (2 per request, 4 per batch)
and learns from all but the first. A model
drafter switched in first reads every token it missed (the prompt, in a call's first step),
in a step that can cost several ordinary ones; learnt from, with every exploratory pull such a
step, it would make the model drafters' mean rewards read a fraction of their worth. Batch
scope also prices a switch (``SwitchCosts``, measured times): a drafter other than the one
being played is weighed by the share of its reward that survives its catch-up (its mean over
the steps the call has left, its confidence radius over the hold), so drafters within the
noise of each other are not swapped at a few steps' price each time.

``objective="call"`` (batch scope, ours) makes the time slot a whole generate() call: the bandit
plays one drafter for the call and learns, when the next call starts (or at ``end_call``), the
call's tokens per row over its steps' seconds. A static batch lasts as long as its slowest row,
and per-step rewards do not see a drafter's stragglers: two drafters can make the same tokens
per row per second while one's calls take many more steps. A call's reward holds its stragglers, and no call pays a switch's catch-up. The price: one
sample per call, so the exploration constant is lower (CALL_EXPLORATION), and the bandit needs a
few calls of each drafter behind it. ``hold_steps`` and ``charge_switches`` do not apply. Rewards
are per row, so calls of one size compare exactly and calls of very different sizes (a short
tail call after full ones) only roughly.

Strategies (``BanditState``, vectorised over independent bandits):
- "ucb": UCB1 (Auer et al. 2002): untried arms first, then argmax mean + c * sqrt(ln t / n),
  t the bandit's pulls so far, n the arm's.
- "epoch": explore-then-commit in epochs of doubling length (8, 16, 32, ... slots). The first
  slots of each epoch explore: round robin (fewest pulls first) over the candidate arms, those
  whose upper confidence bound mean + c * sqrt(ln t / n) reaches the best mean, until one is left or
  half the epoch is spent; the rest of the epoch exploits the best empirical mean. An arm of gap
  Delta stops being a candidate after O(c^2 ln t / Delta^2) pulls and the number of epochs grows
  as log t, so the pseudo-regret grows as O(sum ln T / Delta) (SPIN's Theorem 1 states O(log T)).

``scope="joint"`` (specdec's extension of SPIN) keeps one bandit per request like "request", but
chooses every row's arm in one decision per step, because a drafter's pass costs about the same
whether it drafts for one row or for all of them (one pass of a small model per draft token): with
rows free to pick, request scope ends up running every drafter every step. A row's reward is the
tokens it emitted in a step (in [0, k + 1], k = ``num_draft_tokens``; warm started from the
population as in request scope); its optimistic estimate for drafter d is
u[r, d] = mean + c * (k + 1) * sqrt(ln t_r / n_rd) (k + 1 for an arm never tried, nor known from
the population). Time enters only through the step: T_verify and T_d, each drafter's pass, are
exponential moving averages (0.85 old, 0.15 new) of measured times (T_d over the steps in which
drafter d drafted for some row; 0, optimistic, until first measured), or a ``CostModel``'s
predictions for this step's rows (T_d as if the drafter drafted for every drafting row; the
verify pass's keys are sum(L_r + k_r), as in ``CostModel.step_time``). Each step takes the subset S
of drafters, among all non-empty ones, that maximises the predicted goodput
sum_r max_{d in S} u[r, d] / (T_verify + sum_{d in S} T_d) (ties: the smaller subset, then
lower indices); each row drafts with its best drafter in S. The subsets are enumerated, so joint
scope takes at most 6 drafters, and it plays UCB only. With ``objective="finish"`` (ours,
for static batches, which last until their slowest row is done) S instead minimises the
predicted time to finish, max_r (R_r / max_{d in S} u[r, d]) * (T_verify + sum_{d in S} T_d), R_r
the row's remaining budget: drafters that tie per step differ per call where one serves the
slowest rows worse.

Invariant: the policy changes only which drafter proposes; the acceptance rule keeps the
output the target's own whatever the choice. Cost: O(B x D) numpy work per step (joint scope:
O(2^D x B x D)).
"""

from __future__ import annotations

import collections
import functools
import itertools
import math
import statistics

import numpy as np

from ..stats import StepRecord
from ..types import Plan, is_int_at_least
from .base import Policy
from .cost_model import CostModel

STRATEGIES = ("ucb", "epoch")
CONFIDENCES = ("range", "variance")
PRIOR_SPREAD_PULLS = 2.0  # confidence="variance": pseudo-pulls at the widest spread, so an arm's first pulls cannot read as noiseless
SCOPES = ("request", "batch", "joint")
OBJECTIVES = ("step", "finish", "call")
BATCH_FINISH_QUANTILE = 0.25  # batch scope, objective "finish": the share of drafting rows, furthest from done first, a step's reward counts
# objective "call": a reward averages a whole call, whose spread from call to call is a few percent,
# so the radius need not be as wide as for one step's reward. At 1.0, the radius of an arm with one
# call behind it (about 1.2 at the fifth call) outweighs a drafter 0.64 as fast; at 0.3 (0.35) it
# does not, though it still outweighs one 0.86 as fast
CALL_EXPLORATION = 0.3
# objective "call": the prior's pseudo-pulls spread 0.7 of the widest (a standard deviation of 0.35
# of the best call's reward, not 0.5). At 1.0 an arm with one call behind it reads as noisy as a
# coin, and at the ninth call a drafter under 0.7 as fast can still outweigh the best drafter's
# six calls; at 0.7 the ninth call goes back to one above about 0.77. Simulated
# (3 drafters 3-40% apart, per-call noise 3% or 8% with slow spells in 5% of calls, 300 seeds):
# the two calls after 8 read 0.96-0.99 of the best on average instead of 0.87-0.98, regret over
# 500 calls fell from 2.0-2.6 to 1.4-2.0 calls' worth, and the best drafter played under half of
# calls 100-500 in at most 1% of seeds either way; at 20% noise with 10% slow spells that rose
# from 0-14% of seeds to 1-20% (0.5: up to 28%).
CALL_PRIOR_SPREAD = 0.7
MAX_JOINT_DRAFTERS = 6  # joint scope enumerates the 2^D - 1 subsets of drafters
MIN_STEP_S = 1e-9  # predicted step times are floored here (nothing measured yet: all times 0)


class BanditState:
    """``num_bandits`` independent bandits over ``num_arms`` arms.

    exploration: c in the confidence radius c * s * sqrt(ln t / n). Rewards are normalised by the
    bandit's best arm mean, so the best arm scores about 1 (sqrt(2) is UCB1's constant for
    rewards in [0, 1]; 1.0, the default, explores less and kept regret logarithmic in the tests,
    0.5 locked onto a worse Bernoulli arm in some runs). confidence: what s is: "range" (1, as
    UCB1: rewards as noisy as a fair coin over [0, 1]) or "variance" (the arm's measured standard
    deviation over 0.5, the widest a reward in [0, 1] can spread, with PRIOR_SPREAD_PULLS
    pseudo-pulls at 0.5: an arm whose rewards barely vary needs far fewer pulls to be told from
    one a few percent better, as tokens per second over a batch's step do; the empirical-variance
    idea of UCB-V, Audibert et al. 2009, without its range term). epoch_length: slots of the first
    epoch ("epoch"); max_explore_fraction: the most of an epoch spent exploring. prior_spread
    ("variance"): the pseudo-pulls' spread as a share of the widest, in (0, 1] (1: an untried
    spread reads as a fair coin's; less, for rewards known to be steadier, such as whole calls).
    """

    def __init__(self, num_bandits: int, num_arms: int, strategy: str = "ucb", exploration: float = 1.0,
                 epoch_length: int = 8, max_explore_fraction: float = 0.5, confidence: str = "range",
                 prior_spread: float = 1.0):
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        if confidence not in CONFIDENCES:
            raise ValueError(f"confidence must be one of {CONFIDENCES}, got {confidence!r}")
        if num_arms < 1:
            raise ValueError("a bandit needs at least one arm")
        if not 0.0 < prior_spread <= 1.0:
            raise ValueError(f"prior_spread must be in (0, 1] (a share of the widest spread), got {prior_spread!r}")
        self.prior_spread = float(prior_spread)
        self.strategy, self.exploration, self.confidence = strategy, float(exploration), confidence
        self.epoch_length, self.max_explore_fraction = int(epoch_length), float(max_explore_fraction)
        self.num_arms = num_arms
        self.counts = np.zeros((num_bandits, num_arms), dtype=np.int64)  # [N, A] pulls
        self.sums = np.zeros((num_bandits, num_arms))  # [N, A] raw rewards
        self.squares = np.zeros((num_bandits, num_arms))  # [N, A] raw rewards squared
        self._exploring = np.ones(num_bandits, dtype=bool)  # [N] epoch strategy: still in the explore phase

    @property
    def pulls(self) -> np.ndarray:
        return self.counts.sum(axis=1)

    def raw_means(self) -> np.ndarray:
        """[N, A] mean reward in the rewards' own unit (0 for untried arms)."""
        return self.sums / np.maximum(self.counts, 1)

    def _scale(self) -> np.ndarray:
        """[N, 1] the bandit's best raw arm mean (1 where none is positive yet)."""
        scale = self.raw_means().max(axis=1, keepdims=True)
        return np.where(scale > 0, scale, 1.0)

    def means(self) -> np.ndarray:
        """[N, A] mean reward divided by the bandit's best arm mean (0 for untried arms)."""
        return self.raw_means() / self._scale()

    def upper_bounds(self, reward_range: float) -> np.ndarray:
        """[N, A] raw mean + reward_range * c * s * sqrt(ln t / n) for rewards in [0, reward_range]
        (s: ``confidence``, the spread read against reward_range / 2); an untried arm gets
        reward_range, the most it could pay."""
        bounds = self.raw_means() + reward_range * self._radius(reward_range / 2.0)
        return np.where(self.counts == 0, reward_range, bounds)

    def spread(self, half_range: np.ndarray | float) -> np.ndarray | float:
        """[N, A] s of the confidence radius: 1 for "range"; for "variance" each arm's standard
        deviation (PRIOR_SPREAD_PULLS pseudo-pulls at prior_spread x ``half_range``) over ``half_range``."""
        if self.confidence == "range":
            return 1.0
        n = self.counts
        deviations = np.maximum(self.squares - n * self.raw_means() ** 2, 0.0)  # [N, A] sum of squared deviations
        prior = PRIOR_SPREAD_PULLS * np.square(self.prior_spread * half_range)
        variance = (deviations + prior) / (np.maximum(n - 1, 0) + PRIOR_SPREAD_PULLS)
        return np.sqrt(variance) / half_range

    def _radius(self, half_range: np.ndarray | float | None = None) -> np.ndarray:
        """[N, A] c * s * sqrt(ln t / n); half_range: what s reads spreads against (default: half
        the best arm's mean, the normalised rewards' 0.5)."""
        log_t = np.log(np.maximum(self.pulls, 2))[:, None]  # [N, 1]
        spread = self.spread(0.5 * self._scale() if half_range is None else half_range)
        return self.exploration * spread * np.sqrt(log_t / np.maximum(self.counts, 1))

    def choose(self, mean_worth: np.ndarray | None = None, radius_worth: np.ndarray | None = None) -> np.ndarray:
        """[N] the arm each bandit plays next. mean_worth, radius_worth: [N, A] the share of each
        arm's mean reward and of its confidence radius that a switch to it keeps once its price
        is paid (1 for the arm being played; ``SwitchCosts.worth``): a switch to exploit is paid
        over the rest of the call, one to explore over the steps it is held. Untried arms still first."""
        untried = self.counts == 0
        shape = self.counts.shape
        mean_worth = np.ones(shape) if mean_worth is None else np.broadcast_to(mean_worth, shape)
        radius_worth = mean_worth if radius_worth is None else np.broadcast_to(radius_worth, shape)
        means, radius = self.means() * mean_worth, self._radius() * radius_worth
        if self.strategy == "ucb":
            return np.argmax(np.where(untried, np.inf, means + radius), axis=1)
        return self._choose_epoch(untried, means, radius)

    def _epoch_position(self) -> tuple[np.ndarray, np.ndarray]:
        """[N] slot within the current epoch and that epoch's length; epoch e spans
        epoch_length * 2^e slots starting at epoch_length * (2^e - 1)."""
        slot = self.pulls
        epoch = np.floor(np.log2(slot / self.epoch_length + 1.0)).astype(np.int64)
        start = self.epoch_length * (2 ** epoch - 1)
        return slot - start, self.epoch_length * 2 ** epoch

    def _choose_epoch(self, untried: np.ndarray, means: np.ndarray, radius: np.ndarray) -> np.ndarray:
        position, length = self._epoch_position()
        self._exploring |= position == 0  # an epoch starts with exploration
        best_mean = np.max(np.where(untried, -np.inf, means), axis=1, keepdims=True)  # [N, 1]
        candidate = untried | (means + radius >= best_mean)  # [N, A]
        self._exploring &= (candidate.sum(axis=1) > 1) & (position < self.max_explore_fraction * length)
        self._exploring |= untried.any(axis=1)  # every arm is tried before any commitment
        fewest = np.argmin(np.where(candidate, self.counts, np.iinfo(np.int64).max), axis=1)  # round robin
        best = np.argmax(np.where(untried, -np.inf, means), axis=1)
        return np.where(self._exploring, fewest, best)

    def update(self, bandits: np.ndarray, arms: np.ndarray, rewards: np.ndarray) -> None:
        """Bandit ``bandits[i]`` played ``arms[i]`` and got ``rewards[i]`` (>= 0, any unit)."""
        rewards = np.asarray(rewards, dtype=np.float64)
        keep = np.isfinite(rewards)
        bandits, arms, rewards = np.asarray(bandits)[keep], np.asarray(arms)[keep], np.maximum(rewards[keep], 0.0)
        np.add.at(self.counts, (bandits, arms), 1)
        np.add.at(self.sums, (bandits, arms), rewards)
        np.add.at(self.squares, (bandits, arms), rewards ** 2)


def charged_drafter_times(record: StepRecord, gpu_s: np.ndarray) -> np.ndarray:
    """[D] what each drafter's pass is charged: the larger of its GPU time ``gpu_s`` and its
    host-clock time (``record.drafter_wall_s``, when recorded); prompt lookup works on the host
    and leaves no trace on the GPU's clock, a model drafter's launches may run ahead of the GPU."""
    gpu_s = np.asarray(gpu_s, dtype=np.float64)
    return gpu_s if record.drafter_wall_s is None else np.maximum(gpu_s, np.asarray(record.drafter_wall_s, dtype=np.float64))


def attributed_times(record: StepRecord, asked: np.ndarray, lengths: np.ndarray,
                     cost_model: CostModel | None = None) -> np.ndarray:
    """[A] seconds of the step attributed to each active row (``record.rows``), as the module
    docstring describes. asked: [B] draft lengths the policy planned (after budget caps);
    lengths: [B] committed lengths when the step was planned."""
    rows = np.asarray(record.rows, dtype=np.int64)
    num_active = len(rows)
    drafter = np.asarray(record.drafter_index, dtype=np.int64)[rows]
    drafted = np.asarray(record.num_drafted, dtype=np.int64)[rows]
    wanted = np.asarray(asked, dtype=np.int64)[rows]
    context = np.asarray(lengths, dtype=np.int64)[rows]
    times = np.zeros(num_active)
    if cost_model is None:
        times += record.verify_time_s / num_active
    else:
        c = dict(zip(cost_model.target.features, cost_model.target.coefficients))
        times += c["fixed"] / num_active + c["rows"] + c["tokens"] * (drafted + 1) + c["kv_tokens"] * (context + drafted)
    if cost_model is None and record.drafter_time_s is None:  # one pool of draft time
        if wanted.sum() > 0:
            times += record.draft_time_s * wanted / wanted.sum()
        return times
    drafter_s = charged_drafter_times(record, record.drafter_time_s) if cost_model is None else None
    for d in np.unique(drafter[wanted > 0]):
        mine = (drafter == d) & (wanted > 0)
        if cost_model is None:
            times[mine] += drafter_s[d] * wanted[mine] / wanted[mine].sum()
        else:
            c = dict(zip(cost_model.drafters[d].features, cost_model.drafters[d].coefficients))
            shared = c["fixed"] + c["steps"] * wanted[mine].max()
            times[mine] += (shared / mine.sum() + c["rows"] + c["tokens"] * wanted[mine]
                            + c["kv_tokens"] * wanted[mine] * context[mine] + c["context_tokens"] * context[mine])
    return times


def laggard_tokens(emitted: np.ndarray, remaining: np.ndarray, counted: np.ndarray,
                   share: float = BATCH_FINISH_QUANTILE) -> float:
    """The step's tokens as if every active row had emitted what the rows furthest from done
    did: the mean over the counted rows whose remaining budget (when the step was planned) is
    at least the ceil(share x n)-th largest (ties all in: at a call's start every row), times
    the active rows. emitted, remaining: [A] per active row; counted: [A] whether the row
    drafted and was judged to the end. NaN when no row counts (a step that says nothing about
    the drafter). A static batch lasts as long as its slowest rows, and the rows furthest from
    done are the likeliest to be last: a drafter that serves them poorly finishes late however
    fast its other rows go. Where a drafter's acceptance comes in bursts (prompt lookup's),
    which row is furthest behind mid-call says little about which row ends last; objective
    "call" sees the stragglers themselves."""
    counted = np.asarray(counted, dtype=bool)
    mine = np.asarray(emitted, dtype=np.float64)[counted]  # [n]
    if len(mine) == 0:
        return float("nan")
    behind = np.asarray(remaining, dtype=np.float64)[counted]  # [n]
    threshold = np.sort(behind)[::-1][min(len(mine), max(1, math.ceil(share * len(mine)))) - 1]
    return float(mine[behind >= threshold].mean() * len(emitted))


class StepTimeAverages:
    """Joint scope's measured step times: an exponential moving average (``decay`` old, 1 - decay
    new) of the rest of the step (verification, commit, policy), and per drafter the median of
    its last ``window`` passes over the steps it drafted in; a time never measured stays 0.

    A drafter's first pass in each generate() call is not a sample: it reads the call's prompts,
    many times an ordinary pass's work and a cost of the call rather than of a step; taken as a
    step's price it would make model drafters look far dearer than they are. The median keeps the catch-up spikes that follow a switch from
    moving the estimate either."""

    def __init__(self, num_drafters: int, decay: float = 0.85, window: int = 8):
        if window < 1:
            raise ValueError(f"window must be >= 1 (passes kept per drafter), got {window!r}")
        self.decay = decay
        self.verify_s = 0.0
        self.drafter_s = np.zeros(num_drafters)  # [D]
        self._verify_measured = False
        self._samples = [collections.deque(maxlen=window) for _ in range(num_drafters)]
        self._ran_this_call = np.zeros(num_drafters, dtype=bool)  # [D]

    @property
    def num_drafters(self) -> int:
        return len(self.drafter_s)

    def new_call(self) -> None:
        """A new generate() call begins: each drafter's next pass reads its prompts."""
        self._ran_this_call[:] = False

    def update(self, verify_s: float, drafter_s: np.ndarray, drafted: np.ndarray) -> None:
        """One step: verify time, [D] each drafter's time, [D] whether it drafted for a row."""
        if verify_s > 0:
            old = self.verify_s if self._verify_measured else verify_s
            self.verify_s = float(self.decay * old + (1.0 - self.decay) * verify_s)
            self._verify_measured = True
        ran = drafted & (drafter_s > 0)  # [D]
        for d in np.flatnonzero(ran & self._ran_this_call):
            self._samples[d].append(float(drafter_s[d]))
            self.drafter_s[d] = statistics.median(self._samples[d])
        self._ran_this_call |= ran


class SwitchCosts:
    """Batch scope's price of a switch, learnt from measured step wall times: per drafter, an
    exponential moving average (``decay`` old) of its clean steps (played the step before too)
    and of its switch steps' excess over a clean step, as a multiple of that clean step (the
    catch-up on the tokens it missed; a model drafter's first step of a call reads the prompts,
    the same work). In multiples, a price learnt on a full batch holds for the call's tail.

    ``worth`` turns the prices into the share of its reward a switch keeps over the steps it is
    played: S / (S + x_d) for a drafter whose switch costs x_d clean steps; 1 for the drafter
    being played and for one whose price is not known yet. BanditPolicy weighs a drafter's mean
    by it over the fewest steps the call has left (a switch to exploit lasts the call) and its
    confidence radius over ``hold_steps`` (a switch to explore may last no longer). A switch
    can cost a few clean steps, so a drafter explored for a few steps keeps only part of its
    worth, and a bandit that ignores it switches every few steps between drafters whose
    per-step rewards are within the noise of each other."""

    def __init__(self, num_drafters: int, decay: float = 0.8):
        self.decay = decay
        self.step_s = np.full(num_drafters, np.nan)  # [D] a clean step's seconds
        self.excess = np.full(num_drafters, np.nan)  # [D] a switch step's extra seconds over a clean one, in clean steps
        self._last_clean_s = math.nan  # the latest clean step, whichever drafter

    @property
    def num_drafters(self) -> int:
        return len(self.step_s)

    def _average(self, values: np.ndarray, index: int, sample: float) -> None:
        old = values[index]
        values[index] = sample if np.isnan(old) else self.decay * old + (1.0 - self.decay) * sample

    def observe(self, drafter: int, seconds: float, switched: bool) -> None:
        """One step on ``drafter`` took ``seconds``; ``switched``: it was not played the step before."""
        if not switched:
            self._average(self.step_s, drafter, seconds)
            self._last_clean_s = seconds
            return
        clean = self.step_s[drafter] if np.isfinite(self.step_s[drafter]) else self._last_clean_s
        if np.isfinite(clean) and clean > 0:
            self._average(self.excess, drafter, max(seconds / clean - 1.0, 0.0))

    def worth(self, current: int, steps: float) -> np.ndarray:
        """[D] share of its reward each drafter keeps when a switch to it is played ``steps`` steps."""
        excess = np.where(np.isfinite(self.excess), self.excess, 0.0)  # [D]
        worth = steps / (steps + excess)
        worth[current] = 1.0
        return worth


@functools.cache
def drafter_subsets(num_drafters: int) -> np.ndarray:
    """[S, D] every non-empty subset of the drafters as a mask, S = 2^D - 1: smaller subsets
    first, subsets of one size in lexicographic order of their indices."""
    drafters = range(num_drafters)
    masks = np.array([np.isin(drafters, chosen) for size in range(1, num_drafters + 1)
                      for chosen in itertools.combinations(drafters, size)])
    masks.flags.writeable = False
    return masks


def choose_joint(upper: np.ndarray, verify_s: float, drafter_s: np.ndarray,
                 remaining: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Joint scope's choice. upper: [A, D] each drafting row's optimistic tokens per step with
    each drafter; verify_s: the verify pass's seconds; drafter_s: [D] each drafter's pass.
    Returns ([D] mask of the subset S of drafters with the largest predicted goodput
    sum_r max_{d in S} upper[r, d] / (verify_s + sum_{d in S} drafter_s[d]), the first such
    subset in ``drafter_subsets`` order; [A] each row's best drafter in S, the lowest index on ties).
    remaining: [A] the rows' remaining budgets; given, S minimises the predicted time to finish
    instead, max_r remaining[r] / max_{d in S} upper[r, d] times the same step seconds."""
    upper = np.asarray(upper, dtype=np.float64)
    subsets = drafter_subsets(upper.shape[1])  # [S, D]
    within = np.where(subsets[:, None, :], upper[None, :, :], -np.inf)  # [S, A, D]
    seconds = np.maximum(verify_s + subsets @ np.asarray(drafter_s, dtype=np.float64), MIN_STEP_S)  # [S]
    if remaining is None:
        best = int(np.argmax(within.max(axis=2).sum(axis=1) / seconds))  # tokens per step [S] / seconds
    else:
        per_step = np.maximum(within.max(axis=2), 1e-12)  # [S, A] each row's tokens per step in S
        steps = (np.asarray(remaining, dtype=np.float64)[None, :] / per_step).max(axis=1)  # [S] the slowest row's
        best = int(np.argmin(steps * seconds))
    return subsets[best].copy(), within[best].argmax(axis=1)


class BanditPolicy(Policy):
    def __init__(self, num_draft_tokens: int = 4, strategy: str = "ucb", scope: str = "request",
                 cost_model: CostModel | None = None, exploration: float | None = None, epoch_length: int = 8,
                 max_explore_fraction: float = 0.5, warm_start: int = 2, objective: str = "step",
                 confidence: str = "variance", hold_steps: int | None = None, charge_switches: bool = True):
        """num_draft_tokens: every row's draft length; strategy: "ucb" or "epoch" ("ucb" only for
        joint scope); scope: "request" (one bandit per row), "batch" (one drafter for the whole
        batch per step) or "joint" (one bandit per row, the rows' drafters chosen together so
        that the drafters a step runs pay for themselves; at most 6 drafters); cost_model:
        predicted rather than measured times (optional); exploration: c in the confidence radius
        (default 1.0 for request and batch scope, whose rewards are normalised by the best arm,
        CALL_EXPLORATION for objective "call";
        0.2 for joint scope, whose radius is c * (k + 1) * sqrt(ln t / n) in tokens per step);
        warm_start (request and joint scope): a new request's bandit starts from what every
        earlier request taught, as up to this many pseudo-pulls per arm at the population's mean
        reward (0: each request explores every arm from scratch, which eats a short request's life);
        objective (batch and joint scope): "step" (joint: the drafters that maximise predicted
        tokens per second of the step; batch: the reward is the batch's tokens per second of the
        step) or "finish" (joint: those that finish the batch's slowest row soonest; batch: the
        reward counts the tokens of the quarter of drafting rows furthest from done,
        BATCH_FINISH_QUANTILE, as if every row had emitted as much, ``laggard_tokens``, since a
        static batch lasts as long as its slowest row) or, batch scope only, "call" (one
        drafter per generate() call, rewarded by the call's tokens per row per second);
        confidence: "variance" (the radius scaled by each arm's measured spread, BanditState:
        tokens per second over a step are steady, and drafters a few percent apart are told apart
        within a call) or "range" (UCB1's radius, for rewards as noisy as coins); hold_steps
        (request and batch scope): steps a bandit plays a drafter it switched to before it may
        switch again, learning from all but the first (the catch-up); default 2 for request
        scope, 4 for batch scope, where every switch makes the whole batch catch up (a step that
        can cost a few clean ones), so an exploratory pull is worth three
        clean steps rather than one; charge_switches (batch scope, measured times): weigh a drafter
        the batch would switch to by the share of its reward its switch keeps (``SwitchCosts``:
        its catch-up, learnt from measured steps), so that drafters within the noise of each other
        are not switched between at a catch-up's price every few steps."""
        if not is_int_at_least(num_draft_tokens, 1):
            raise ValueError(f"BanditPolicy's num_draft_tokens must be an integer >= 1, got {num_draft_tokens!r}")
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        if scope not in SCOPES:
            raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")
        if scope == "joint" and strategy != "ucb":
            raise ValueError(f"scope='joint' chooses drafters by upper confidence bounds: strategy must be 'ucb', got {strategy!r}")
        if objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
        if objective != "step" and scope == "request":
            raise ValueError(f"objective={objective!r} is for batch and joint scope; request scope rewards each row by its own tokens per second")
        if objective == "call" and scope != "batch":
            raise ValueError(f"objective='call' plays one drafter per generate() call and is for batch scope, got scope={scope!r}")
        self.objective = objective
        self._call = np.zeros(2)  # objective "call": the call so far (tokens per row, seconds)
        if hold_steps is None:
            hold_steps = 4 if scope == "batch" else 2
        if not is_int_at_least(hold_steps, 2):
            raise ValueError(f"hold_steps must be an integer >= 2 (a switch's catch-up, then a step to learn from), got {hold_steps!r}")
        self.hold_steps = int(hold_steps)
        if not isinstance(charge_switches, bool):
            raise ValueError(f"charge_switches must be True or False, got {charge_switches!r}")
        self.charge_switches = charge_switches
        self.switch_costs: SwitchCosts | None = None  # batch scope: kept across calls
        if cost_model is not None and not isinstance(cost_model, CostModel):
            raise TypeError(f"cost_model must be a CostModel, got {type(cost_model).__name__}")
        if exploration is None:
            exploration = 0.2 if scope == "joint" else CALL_EXPLORATION if objective == "call" else 1.0
        self.num_draft_tokens = int(num_draft_tokens)
        self.strategy, self.scope, self.cost_model = strategy, scope, cost_model
        if confidence not in CONFIDENCES:
            raise ValueError(f"confidence must be one of {CONFIDENCES}, got {confidence!r}")
        self._options = {"strategy": strategy, "exploration": exploration, "epoch_length": epoch_length,
                         "max_explore_fraction": max_explore_fraction, "confidence": confidence,
                         "prior_spread": CALL_PRIOR_SPREAD if objective == "call" else 1.0}
        self.bandits: BanditState | None = None
        self._batch = None
        if not is_int_at_least(warm_start, 0):
            raise ValueError(f"warm_start must be an integer >= 0, got {warm_start!r}")
        self.warm_start = int(warm_start)
        self.population: BanditState | None = None  # request and joint scope: every request's rewards, across calls
        self.step_times: StepTimeAverages | None = None  # joint scope, measured times: kept across calls

    @property
    def max_draft_tokens(self) -> int:
        return self.num_draft_tokens

    def plan(self, batch, num_drafters):
        if num_drafters < 1:
            raise ValueError(f"{self!r} chooses among drafters but generate() was given none")
        if self.cost_model is not None and self.cost_model.num_drafters < num_drafters:
            raise ValueError(f"{self!r}: the cost model times {self.cost_model.num_drafters} drafter(s), "
                             f"generate() was given {num_drafters}")
        if self.scope == "joint" and num_drafters > MAX_JOINT_DRAFTERS:
            raise ValueError(f"{self!r}: joint scope enumerates every subset of the drafters and supports at most "
                             f"{MAX_JOINT_DRAFTERS} drafters, generate() was given {num_drafters}")
        per_row = self.scope != "batch"
        fresh = self.bandits is None or self.bandits.num_arms != num_drafters
        if fresh:
            self._call = np.zeros(2)  # a call served with other drafters teaches these bandits nothing
        if fresh or (per_row and batch is not self._batch):
            self.bandits = BanditState(batch.num_rows if per_row else 1, num_drafters, **self._options)
            if per_row:
                self._seed_from_population(num_drafters)
        if self.scope == "batch" and self.objective != "call" and self.charge_switches and (self.switch_costs is None
                                                              or self.switch_costs.num_drafters != num_drafters):
            self.switch_costs = SwitchCosts(num_drafters)
        if self.scope == "joint" and (self.step_times is None or self.step_times.num_drafters != num_drafters):
            self.step_times = StepTimeAverages(num_drafters)
        if self.scope == "joint" and batch is not self._batch:
            self.step_times.new_call()
        if batch is not self._batch:  # a new call: every model drafter's first pass reads the prompts
            self.end_call()  # objective "call": the call before is learnt (once: end_call clears it)
            self._previous = np.full(self.bandits.counts.shape[0], -1, dtype=np.int64)  # [N] the arm played last step
            self._switching = np.zeros(self.bandits.counts.shape[0], dtype=bool)  # [N] whether that step was a switch
            self._hold_left = np.zeros(self.bandits.counts.shape[0], dtype=np.int64)  # [N] steps the arm is still held for
        self._batch = batch
        self._remaining = batch.remaining  # [B] (computed by BatchState on each read)
        self._asked = np.minimum(self.num_draft_tokens, np.maximum(self._remaining - 1, 0))
        self._lengths = batch.lengths.copy()
        if self.objective == "call":
            arms = self._call_arm(batch)
        elif self.scope == "joint":
            arms = self._choose_jointly(batch)
        else:  # a switch is held for hold_steps steps, its first not rewarded (it reads what the drafter missed)
            worth = {}
            if self.switch_costs is not None and self._previous[0] >= 0:  # a call's first step switches anyway
                current = int(self._previous[0])
                # the fewest steps the call has left: every active row emitting k + 1 tokens a step
                steps_left = max(self.hold_steps, int(self._remaining.max()) / (self.num_draft_tokens + 1))
                worth = {"mean_worth": self.switch_costs.worth(current, steps_left)[None, :],  # [1, D]
                         "radius_worth": self.switch_costs.worth(current, self.hold_steps)[None, :]}
            arms = np.where(self._hold_left > 0, self._previous, self.bandits.choose(**worth))  # [N]
            self._switching = arms != self._previous
            self._hold_left = np.where(self._switching, self.hold_steps - 1, np.maximum(self._hold_left - 1, 0))
            self._previous = arms
        self._arms = np.broadcast_to(arms, (batch.num_rows,)).astype(np.int64)
        return Plan(drafter_index=self._arms.copy(), num_draft_tokens=np.full(batch.num_rows, self.num_draft_tokens, dtype=np.int64))

    def _call_arm(self, batch) -> np.ndarray:
        """Objective "call": [1] the drafter of the whole call, chosen at its first step (after
        learning from the call before)."""
        if self._previous[0] < 0:  # the call's first step
            self._previous = self.bandits.choose()
            self._call_rows = max(len(batch.active_rows()), 1)
        return self._previous

    def end_call(self) -> None:
        """Objective "call": the bandit learns the call just served, its tokens per row over the
        seconds its steps took (nothing when no step was measured)."""
        tokens_per_row, seconds = self._call
        if self.objective == "call" and self.bandits is not None and seconds > 0:
            self.bandits.update(np.zeros(1, dtype=np.int64), self._previous[:1], [tokens_per_row / seconds])
        self._call = np.zeros(2)

    def _choose_jointly(self, batch) -> np.ndarray:
        """[B] joint scope's drafter per row (0 for rows that draft nothing)."""
        active = batch.active_rows()  # [A']
        drafting = active[self._asked[active] > 0]  # [A]
        arms = np.zeros(batch.num_rows, dtype=np.int64)
        if len(drafting):
            upper = self.bandits.upper_bounds(self.num_draft_tokens + 1)[drafting]  # [A, D]
            remaining = self._remaining[drafting] if self.objective == "finish" else None
            _, arms[drafting] = choose_joint(upper, *self._predicted_times(active, drafting), remaining=remaining)
        return arms

    def _predicted_times(self, active: np.ndarray, drafting: np.ndarray) -> tuple[float, np.ndarray]:
        """Joint scope: the verify pass's seconds and [D] each drafter's, measured averages or the
        cost model's predictions (each drafter as if it drafted for every drafting row)."""
        if self.cost_model is None:
            return self.step_times.verify_s, self.step_times.drafter_s
        asked, lengths = self._asked[active], self._lengths[active]  # [A']
        verify_s = float(self.cost_model.target_time((asked + 1).sum(), (lengths + asked).sum(), len(active)))
        asked, lengths = self._asked[drafting], self._lengths[drafting]  # [A]
        drafter_s = np.array([float(self.cost_model.drafter_time(d, len(drafting), asked.max(), asked.sum(),
                                                                 (asked * lengths).sum(), lengths.sum()))
                              for d in range(self.bandits.num_arms)])  # [D]
        return verify_s, drafter_s

    def _seed_from_population(self, num_drafters: int, rows=slice(None)) -> None:
        """The bandits of ``rows`` (all by default) start from the population's warm start."""
        if self.population is None or self.population.num_arms != num_drafters:
            self.population = BanditState(1, num_drafters, **self._options)
        self.bandits.counts[rows], self.bandits.sums[rows], self.bandits.squares[rows] = 0, 0.0, 0.0
        self.bandits._exploring[rows] = True
        if self.warm_start == 0:
            return
        counts = self.population.counts[0]  # [D]
        pseudo = np.minimum(counts, self.warm_start)  # [D]
        self.bandits.counts[rows] = pseudo
        mean = self.population.sums[0] / np.maximum(counts, 1)  # [D]
        mean_square = self.population.squares[0] / np.maximum(counts, 1)  # [D] the population's spread comes along
        self.bandits.sums[rows] = pseudo * mean
        self.bandits.squares[rows] = pseudo * np.maximum(mean_square, mean ** 2)

    def start_rows(self, batch, rows) -> None:
        """Request and joint scope: new requests in rows of the batch being served (an Engine
        refilling them) get fresh bandits, warm-started from the population, and no held arm.
        A new batch is handled by plan(); batch scope keeps one bandit for the batch."""
        if self.scope == "batch" or batch is not self._batch or self.bandits is None:
            return
        rows = np.asarray(rows, dtype=np.int64)
        self._seed_from_population(self.bandits.num_arms, rows)
        self._previous[rows], self._switching[rows], self._hold_left[rows] = -1, False, 0

    def observe(self, record: StepRecord) -> None:
        rows = np.asarray(record.rows, dtype=np.int64)
        if self.bandits is None or len(rows) == 0:
            return
        emitted = np.asarray(record.num_emitted, dtype=np.float64)[rows]
        if self.scope == "joint":
            self._observe_rows(rows, emitted)
            self._observe_times(record, rows)
            return
        if self.objective == "call":  # the call's totals; no per-row attribution
            self._call += (emitted.sum() / self._call_rows, self._step_seconds(record))
            return
        seconds = attributed_times(record, self._asked, self._lengths, self.cost_model)  # [A]
        if self.scope == "request":
            with np.errstate(divide="ignore", invalid="ignore"):
                rewards = np.where(seconds > 0, emitted / seconds, np.nan)
            # a drafter some row switched to spent the step catching up, and its time is shared by
            # every row it drafted for: none of them learns from this step (NaN: not learnt from)
            arms = self._arms[rows]  # [A]
            caught_up = np.isin(arms, arms[self._switching[rows]])  # [A]
            self._observe_rows(rows, np.where(caught_up, np.nan, rewards))
            return
        drafting = np.any(self._asked[rows] > 0)  # a step nobody drafted in says nothing
        if self.switch_costs is not None and drafting and self.cost_model is None and record.step_time_s:
            self.switch_costs.observe(int(self._arms[0]), float(record.step_time_s), bool(self._switching[0]))
        if not self._switching[0] and drafting:
            total = self._step_seconds(record, seconds)
            accepted = np.asarray(record.num_accepted, dtype=np.float64)[rows]
            whole = (self._asked[rows] > 0) & (emitted == accepted + 1)  # [A] drafted, not cut short by EOS or budget
            tokens = emitted.sum() if self.objective == "step" else laggard_tokens(emitted, self._remaining[rows], whole)
            # per active row: the slots of one call hold from all rows to a straggler or two, and a
            # drafter explored in the tail would read a fraction of its worth
            per_row_s = total * len(rows)
            self.bandits.update(np.zeros(1, dtype=np.int64), self._arms[:1], [tokens / per_row_s if total > 0 else np.nan])

    def _step_seconds(self, record: StepRecord, seconds: np.ndarray | None = None) -> float:
        """Batch scope: the step's seconds, its measured wall time (without a cost model), else
        the sum of its rows' attributed times (``seconds`` [A], when already computed). A model
        drafter's charged host time also holds its wait for the GPU, so verify + drafter charges
        read a model drafter's step too long: the wall time is what the step cost."""
        if self.cost_model is None and record.step_time_s:
            return float(record.step_time_s)
        if seconds is None:
            seconds = attributed_times(record, self._asked, self._lengths, self.cost_model)
        return float(seconds.sum())

    def _observe_rows(self, rows: np.ndarray, rewards: np.ndarray) -> None:
        """Each row's bandit and the population learn the row's reward ([A], for ``rows``; NaN:
        nothing learnt)."""
        drafted = (self._asked[rows] > 0) & np.isfinite(rewards)  # a row capped to 0 tokens did not try its arm this step
        self.bandits.update(rows[drafted], self._arms[rows[drafted]], rewards[drafted])
        self.population.update(np.zeros(int(drafted.sum()), dtype=np.int64), self._arms[rows[drafted]],
                               rewards[drafted])

    def _observe_times(self, record: StepRecord, rows: np.ndarray) -> None:
        """Joint scope: the step's measured times. A drafter's pass costs what
        ``charged_drafter_times`` says; the rest of the step (its wall time less what the
        drafters were charged: verification, the commit, the policy) is what every step costs.
        Without per-drafter times, the draft time is split equally over the drafters that
        drafted; without host-clock drafter times, the verify pass's time is used."""
        drafting = rows[self._asked[rows] > 0]
        drafted = np.isin(np.arange(self.bandits.num_arms), self._arms[drafting])  # [D]
        gpu_s = record.drafter_time_s if record.drafter_time_s is not None else \
            np.where(drafted, record.draft_time_s / max(int(drafted.sum()), 1), 0.0)
        drafter_s = charged_drafter_times(record, gpu_s)
        base_s = float(record.verify_time_s)
        if record.drafter_wall_s is not None and record.step_time_s:  # what is left once each drafter is charged
            base_s = max(float(record.step_time_s) - float(drafter_s[drafter_s > 0].sum()), 0.0)
        self.step_times.update(base_s, drafter_s, drafted)

    def __repr__(self) -> str:
        objective = f", objective={self.objective!r}" if self.scope != "request" else ""
        return (f"BanditPolicy(num_draft_tokens={self.num_draft_tokens}, strategy={self.strategy!r}, scope={self.scope!r}"
                f"{objective}, confidence={self._options['confidence']!r}, hold_steps={self.hold_steps}"
                + (", charge_switches=False" if self.scope == "batch" and not self.charge_switches else "") + ")")
