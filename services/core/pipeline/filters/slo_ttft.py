"""`slo-ttft`: drops a worker whose predicted TTFT (prefill + waits) passes the request's TTFT
target less `margin_ms`. A request without a target keeps every worker."""

from __future__ import annotations

from services.core.pipeline.protocol import Plugin
from services.core.policies.protocol import Candidate, PolicyParams, RouteContext


class SloTtftParams(PolicyParams):
    margin_ms: float = 100.0

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
        return [c.ttft_ms <= budget for c in cands]
