"""`max-score`: the highest total score; ties by the least predicted wait (inflight + queue),
then the worker id. With the one scorer `fewest-pending` this is `least-loaded`."""

from __future__ import annotations

from services.core.pipeline.protocol import Plugin
from services.core.policies.protocol import Candidate, RouteContext


class MaxScore(Plugin):
    name = "max-score"

    def pick(self, ctx: RouteContext, cands: list[Candidate], totals: list[float]) -> tuple[int, str]:
        i = min(range(len(cands)), key=lambda i: (-totals[i], cands[i].wait_ms + cands[i].queue_ms, cands[i].worker_id))
        return i, f"highest score {totals[i]:.3f} of {len(cands)}"
