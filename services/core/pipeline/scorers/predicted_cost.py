"""`predicted-cost`: the least cost among the candidates over this worker's (services/core/
pipeline/cost.py: predicted TTFT, plus `prefill_weight` x the prefill it spends for a prefix
it lacks); 1 for the cheapest."""

from __future__ import annotations

from services.core.pipeline.cost import costs
from services.core.pipeline.protocol import Plugin
from services.core.policies.protocol import Candidate, PolicyParams, RouteContext


class PredictedCostParams(PolicyParams):
    prefill_weight: float = 0.0


class PredictedCost(Plugin):
    name = "predicted-cost"
    Params = PredictedCostParams

    def score(self, ctx: RouteContext, cands: list[Candidate]) -> list[float]:
        values = costs(ctx, cands, self.params.prefill_weight)
        best = min(values, default=0.0)
        return [best / v if v > 0 else 1.0 for v in values]
