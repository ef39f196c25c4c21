"""`least-loaded` (prefill or decode stage): the fewest pending requests; ties by the lowest
predicted wait (inflight + queue), then worker id. No parameters.
"""

from __future__ import annotations

from services.core.policies.base import StatelessPolicy, no_pick, score_components
from services.core.policies.protocol import Pick, RouteContext, Score


class LeastLoaded(StatelessPolicy):
    name = "least-loaded"

    def select(self, ctx: RouteContext) -> Pick:
        if not ctx.candidates:
            return no_pick("no live candidate", [])
        scores = [Score(c.worker_id, float(c.num_pending), score_components(c)) for c in ctx.candidates]
        c = min(ctx.candidates, key=lambda c: (c.num_pending, c.wait_ms + c.queue_ms, c.worker_id))
        return Pick(c.worker_id, f"fewest pending ({c.num_pending})", scores)

