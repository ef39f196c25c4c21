"""`power-of-two` (prefill stage): two distinct candidates drawn at random (`ctx.rng`, from the
worker-id order), the one with fewer pending requests (ties: the lower id); a lone candidate
is picked. No parameters.
"""

from __future__ import annotations

from services.core.policies.base import StatelessPolicy, no_pick, score_components
from services.core.policies.protocol import Pick, RouteContext, Score


class PowerOfTwo(StatelessPolicy):
    name = "power-of-two"

    def select(self, ctx: RouteContext) -> Pick:
        cands = sorted(ctx.candidates, key=lambda c: c.worker_id)
        if not cands:
            return no_pick("no live candidate", [])
        scores = [Score(c.worker_id, float(c.num_pending), score_components(c)) for c in cands]
        if len(cands) == 1:
            return Pick(cands[0].worker_id, "only candidate", scores)
        a, b = ctx.rng.sample(cands, 2)
        c = a if (a.num_pending, a.worker_id) <= (b.num_pending, b.worker_id) else b
        return Pick(c.worker_id, f"fewer pending of {a.worker_id}/{b.worker_id}", scores)

