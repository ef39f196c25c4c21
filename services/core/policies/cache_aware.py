"""`cache-aware` (prefill stage): SGLang router's cache-aware rule on the scheduler's prefix index.

Candidates in worker-id order. If the load is imbalanced (max pending − min pending >
`balance_abs_threshold` and max pending > `balance_rel_threshold` × min pending): the
fewest pending (then id). Otherwise the best prefix match (most cached tokens, then fewer
pending, then id) if its match ratio (cached tokens / prompt tokens) > `cache_threshold`;
else the worker with the smallest cache (fewest blocks in the prefix index, then pending,
then id), to spread new prefixes. Score cards show each worker's match ratio.

Parameters (`CacheAwareParams`, defaults): cache_threshold 0.5, balance_abs_threshold 32,
balance_rel_threshold 1.5.
"""

from __future__ import annotations

from services.core.policies.base import StatelessPolicy, no_pick, score_components
from services.core.policies.protocol import Pick, PolicyParams, RouteContext, Score


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


class CacheAware(StatelessPolicy):
    name = "cache-aware"
    params: CacheAwareParams

    def select(self, ctx: RouteContext) -> Pick:
        p = self.params
        cands = sorted(ctx.candidates, key=lambda c: c.worker_id)
        if not cands:
            return no_pick("no live candidate", [])
        denom = max(1, ctx.num_prompt_tokens)
        scores = [Score(c.worker_id, c.num_cached_tokens / denom, score_components(c)) for c in cands]
        pendings = [c.num_pending for c in cands]
        lo, hi = min(pendings), max(pendings)
        if hi - lo > p.balance_abs_threshold and hi > p.balance_rel_threshold * lo:
            c = min(cands, key=lambda c: (c.num_pending, c.worker_id))
            return Pick(c.worker_id, f"load imbalanced (pending {lo}..{hi}): shortest queue", scores)
        best = max(cands, key=lambda c: (c.num_cached_tokens, -c.num_pending))
        ratio = best.num_cached_tokens / denom
        if ratio > p.cache_threshold:
            return Pick(best.worker_id, f"prefix match {ratio:.2f} > {p.cache_threshold}", scores)
        c = min(cands, key=lambda c: (c.num_cache_blocks, c.num_pending, c.worker_id))
        return Pick(c.worker_id, f"best match {ratio:.2f} <= {p.cache_threshold}: smallest cache", scores)

