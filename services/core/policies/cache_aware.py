"""`cache-aware` (prefill stage): SGLang router's cache-aware rule on the scheduler's prefix index.

Candidates in worker-id order. If the load is imbalanced (max pending − min pending >
`balance_abs_threshold` and max pending > `balance_rel_threshold` × min pending): the
fewest pending (then id). Otherwise the best prefix match (most cached tokens, then fewer
pending, then id) if its match ratio (cached tokens / prompt tokens) > `cache_threshold`;
else the worker with the smallest cache (fewest blocks in the prefix index, then pending,
then id), to spread new prefixes. It is a pipeline (services/core/pipeline/ `cache_aware`):
this rule is its picker; the cards show each worker's match ratio (scorer prefix-affinity).

Parameters (`CacheAwareParams`, defaults): cache_threshold 0.5, balance_abs_threshold 32,
balance_rel_threshold 1.5.
"""

from __future__ import annotations

from services.core.policies.protocol import PolicyParams


class CacheAwareParams(PolicyParams):
    cache_threshold: float = 0.5  # prefix-match ratio above which the best match wins
    balance_abs_threshold: int = 32  # imbalanced when max − min pending exceeds this ...
    balance_rel_threshold: float = 1.5  # ... and max pending > this × min pending

    def validate(self) -> "CacheAwareParams":
        if not 0 <= self.cache_threshold <= 1:
            raise ValueError("cache-aware: cache_threshold must be in [0, 1]")
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1:
            raise ValueError("cache-aware: balance_abs_threshold >= 0 and balance_rel_threshold >= 1 required")
        return self
