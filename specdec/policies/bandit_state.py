"""The bandits' learning core, vectorised over independent bandits (SPIN, Chen et al., INFOCOM
2025, arXiv 2503.15921: drafter selection as a multi-armed bandit, regret O(log T), Theorem 1).

Strategies:
- "ucb": UCB1 (Auer et al. 2002): untried arms first, then argmax mean + c * s * sqrt(ln t / n),
  t the bandit's pulls so far, n the arm's.
- "epoch": explore-then-commit in epochs of doubling length (8, 16, 32, ... slots), as SPIN
  schedules it. The first slots of each epoch explore: round robin (fewest pulls first) over the
  candidate arms, those whose upper confidence bound reaches the best mean, until one is left or
  half the epoch is spent; the rest of the epoch exploits the best empirical mean. An arm of gap
  Delta stops being a candidate after O(c^2 ln t / Delta^2) pulls and the number of epochs grows
  as log t, so the pseudo-regret grows as O(sum ln T / Delta).

Invariant: the pseudo-regret on stationary arms grows like log T for both strategies and both
confidence radii (tests/policies/test_bandit.py). Cost: O(N x A) numpy work per choice.
"""

from __future__ import annotations

import numpy as np

STRATEGIES = ("ucb", "epoch")
CONFIDENCES = ("range", "variance")
PRIOR_SPREAD_PULLS = 2.0  # "variance": pseudo-pulls at the widest spread, so an arm's first pulls cannot read as noiseless


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

    def choose(self) -> np.ndarray:
        """[N] the arm each bandit plays next: untried arms first, then by the strategy."""
        untried = self.counts == 0
        means, radius = self.means(), self._radius()
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
