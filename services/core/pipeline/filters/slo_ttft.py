"""`slo-ttft`: drops a worker whose predicted TTFT (prefill + waits; with `prefill_weight`, the
cost of services/core/pipeline/cost.py) passes the request's TTFT target less `margin_ms`. A
request without a target keeps every worker."""

from __future__ import annotations

from services.core.pipeline.cost import costs
from services.core.pipeline.protocol import Plugin
from services.core.policies.protocol import Candidate, PolicyParams, RouteContext


class SloTtftParams(PolicyParams):
    margin_ms: float = 100.0
    prefill_weight: float = 0.0

    def validate(self) -> "SloTtftParams":
        if not self.margin_ms >= 0:
            raise ValueError("filter slo-ttft: margin_ms must be >= 0")
        return self


class SloTtft(Plugin):
    name = "slo-ttft"
    Params = SloTtftParams

    def keep(self, ctx: RouteContext, cands: list[Candidate]) -> list[bool]:
        if ctx.slo_ttft_ms <= 0:
            return [True] * len(cands)
        budget = ctx.slo_ttft_ms - self.params.margin_ms
        return [v <= budget for v in costs(ctx, cands, self.params.prefill_weight)]
