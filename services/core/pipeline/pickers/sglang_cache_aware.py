"""`cache-aware`: SGLang's router rule, as one picker (scores ignored). When the load is
imbalanced (max − min pending > `balance_abs_threshold` and max > `balance_rel_threshold` x
min), the shortest queue; else the best prefix match (then fewer pending, then the lower id)
if its share of the prompt passes `cache_threshold`; else the smallest cache (then fewer
pending, then the lower id)."""

from __future__ import annotations

from services.core.pipeline.protocol import Plugin
from services.core.policies.cache_aware import CacheAwareParams
from services.core.policies.protocol import Candidate, RouteContext


class CacheAwarePick(Plugin):
    name = "cache-aware"
    uses_totals = False
    Params = CacheAwareParams  # (services/core/policies/cache_aware.py: the policy's, whole)

    def pick(self, ctx: RouteContext, cands: list[Candidate], totals: list[float]) -> tuple[int, str]:
        p = self.params
        order = sorted(range(len(cands)), key=lambda i: cands[i].worker_id)
        pendings = [cands[i].num_pending for i in order]
        lo, hi = min(pendings), max(pendings)
        if hi - lo > p.balance_abs_threshold and hi > p.balance_rel_threshold * lo:
            i = min(order, key=lambda i: (cands[i].num_pending, cands[i].worker_id))
            return i, f"load imbalanced (pending {lo}..{hi}): shortest queue"
        best = max(order, key=lambda i: (cands[i].num_cached_tokens, -cands[i].num_pending))
        ratio = cands[best].num_cached_tokens / max(1, ctx.num_prompt_tokens)
        if ratio > p.cache_threshold:
            return best, f"prefix match {ratio:.2f} > {p.cache_threshold}"
        i = min(order, key=lambda i: (cands[i].num_cache_blocks, cands[i].num_pending, cands[i].worker_id))
        return i, f"best match {ratio:.2f} <= {p.cache_threshold}: smallest cache"
