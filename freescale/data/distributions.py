"""Length and popularity distributions for synthetic data (numpy, host side)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

LENGTH_KINDS = ("lognormal", "pareto", "uniform", "fixed")


@dataclass(frozen=True)
class LengthDistribution:
    """Distribution of *raw* UIH lengths, before truncation to ``max_uih``.

    The default reproduces the shape of the paper's Fig. 2: most users have
    more than 2,000 interactions (median 4,500), the tail thins out past
    ~16,000 (``cap`` = 17,000: "few samples come with exceptionally long
    interaction histories"), so batch sparsity rises with the maximum UIH
    length and flattens beyond ~16,000.

    kinds: ``lognormal(median, sigma)``, ``pareto(low, alpha)`` (heavier tail),
    ``uniform(low, high)``, ``fixed(median)``; all clipped to ``[low, cap]``.
    """

    kind: str = "lognormal"
    median: float = 4500.0
    sigma: float = 0.55
    alpha: float = 1.5
    low: int = 0
    high: int = 21000
    cap: int = 17000

    def __post_init__(self) -> None:
        if self.kind not in LENGTH_KINDS:
            raise ValueError(f"length kind must be one of {LENGTH_KINDS}, got {self.kind!r}")
        if self.median <= 0 or self.sigma < 0 or self.alpha <= 0:
            raise ValueError("length median and alpha must be > 0 and sigma >= 0")
        if not 0 <= self.low <= self.cap or self.high < self.low:
            raise ValueError(f"need 0 <= low <= cap and low <= high (got {self})")

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.kind == "lognormal":
            raw = np.exp(math.log(self.median) + self.sigma * rng.standard_normal(n))
        elif self.kind == "pareto":
            raw = max(self.low, 1) * (1.0 + rng.pareto(self.alpha, n))
        elif self.kind == "uniform":
            raw = rng.integers(self.low, self.high + 1, n).astype(np.float64)
        else:
            raw = np.full(n, self.median)
        return np.clip(np.round(raw), self.low, self.cap).astype(np.int64)


def zipf_ranks(rng: np.random.Generator, n: int, num_items: int, alpha: float) -> np.ndarray:
    """``n`` popularity ranks in ``[0, num_items)`` with P(rank k) ~ (k+1)^-alpha.

    Continuous inverse-CDF approximation of a bounded Zipf law: O(1) memory,
    so tables of 10^9 rows cost nothing to sample from.
    """
    u = rng.random(n)
    top = float(num_items) + 1.0
    if abs(alpha - 1.0) < 1e-9:
        x = np.exp(u * math.log(top))
    else:
        x = ((top ** (1.0 - alpha) - 1.0) * u + 1.0) ** (1.0 / (1.0 - alpha))
    return np.minimum(np.floor(x).astype(np.int64), num_items) - 1


@dataclass(frozen=True)
class IdScramble:
    """Bijection rank -> row id, ``(a * rank + b) mod n`` with gcd(a, n) = 1.

    Without it the most popular items would be rows 0, 1, 2, ... and a block
    row assignment would put every hot row on rank 0.
    """

    num_items: int
    a: int
    b: int

    @classmethod
    def make(cls, num_items: int, seed: int) -> IdScramble:
        rng = np.random.default_rng([seed, 0x5C4A])
        a = int(rng.integers(num_items // 3 + 1, max(num_items, 2) * 7 // 8 + 2)) | 1
        while math.gcd(a, num_items) != 1:
            a += 2
        return cls(num_items, a, int(rng.integers(0, num_items)))

    def __call__(self, ranks: np.ndarray) -> np.ndarray:
        # Python ints avoid int64 overflow of a * rank for tables up to 2^31 rows.
        if self.num_items <= 2**31:
            return (ranks * self.a + self.b) % self.num_items
        return np.array([(int(r) * self.a + self.b) % self.num_items for r in ranks])
