"""Seeded randomness of the core: splitmix64, the per-decision seed and the draws of one decision.

`splitmix64(state)` is the output function of Steele, Lea and Flood's SplitMix64 generator:
three xor-shift-multiply rounds that turn a 64-bit state into a well-mixed 64-bit value.
Everything random in the core derives from it, so a replay of the same inputs re-draws
exactly what the router drew, on any platform and Python version:
- `decision_seed(seed, decision_seq)`: the seed of decision number `decision_seq` of a router
  seeded with `seed` (SchedulerConfig.seed, default 0): splitmix64(seed·γ + seq + γ), γ the
  golden-ratio increment 0x9E3779B97F4A7C15. Independent, reproducible seeds per decision.
- `DecisionRng(seed)`: the draws of one decision, the SplitMix64 stream from that seed (the
  state advances by γ, each draw is splitmix64 of the state). The subset of `random.Random`
  the policies use, at a fraction of its cost: seeding a Mersenne Twister takes longer than
  scoring a worker.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

MASK64 = (1 << 64) - 1
GAMMA = 0x9E3779B97F4A7C15  # the SplitMix64 increment (2^64 / golden ratio, odd)

T = TypeVar("T")


def splitmix64(state: int) -> int:
    """The SplitMix64 output of a 64-bit `state` (taken modulo 2^64)."""
    z = state & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def decision_seed(seed: int, decision_seq: int) -> int:
    """The seed of decision `decision_seq` of a router seeded with `seed`."""
    return splitmix64(seed * GAMMA + decision_seq + GAMMA)


class DecisionRng:
    """The draws of one decision: the SplitMix64 stream from the decision's seed."""

    __slots__ = ("_state",)

    def __init__(self, seed: int) -> None:
        self._state = seed & MASK64

    def _next(self) -> int:
        self._state = (self._state + GAMMA) & MASK64
        return splitmix64(self._state)

    def random(self) -> float:
        """Uniform in [0, 1), 53 bits."""
        return (self._next() >> 11) * (1.0 / 9007199254740992.0)

    def randrange(self, n: int) -> int:
        """Uniform in [0, n)."""
        if n <= 0:
            raise ValueError(f"randrange: empty range {n}")
        return (self._next() * n) >> 64  # multiply-shift: bias <= n / 2^64

    def choice(self, seq: Sequence[T]) -> T:
        return seq[self.randrange(len(seq))]

    def sample(self, population: Sequence[T], k: int) -> list[T]:
        """k distinct elements (partial Fisher-Yates)."""
        pool = list(population)
        if not 0 <= k <= len(pool):
            raise ValueError(f"sample: k={k} out of range for {len(pool)}")
        for i in range(k):
            j = i + self.randrange(len(pool) - i)
            pool[i], pool[j] = pool[j], pool[i]
        return pool[:k]
