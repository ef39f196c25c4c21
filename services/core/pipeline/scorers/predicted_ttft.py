"""`predicted-ttft`: the least predicted TTFT among the candidates over this worker's (1 for
the fastest, 0.5 for one twice as slow); every worker 1 where all predict 0."""

from __future__ import annotations

from services.core.pipeline.protocol import Plugin
from services.core.policies.protocol import Candidate, RouteContext


class PredictedTtft(Plugin):
    name = "predicted-ttft"

    def score(self, ctx: RouteContext, cands: list[Candidate]) -> list[float]:
        best = min((c.ttft_ms for c in cands), default=0.0)
        return [best / c.ttft_ms if c.ttft_ms > 0 else 1.0 for c in cands]
