"""`random` (prefill or decode stage): uniform among the candidates (`ctx.rng`, over the
worker-id order). No parameters.
"""

from __future__ import annotations

from services.core.policies.base import StatelessPolicy, no_pick, score_components
from services.core.policies.protocol import Pick, RouteContext, Score


class RandomPolicy(StatelessPolicy):
    name = "random"

    def select(self, ctx: RouteContext) -> Pick:
        if not ctx.candidates:
            return no_pick("no live candidate", [])
        ids = sorted(c.worker_id for c in ctx.candidates)
        scores = [Score(c.worker_id, 0.0, score_components(c)) for c in ctx.candidates]
        return Pick(ctx.rng.choice(ids), f"uniform of {len(ids)}", scores)

