"""`late`: where some worker (its gate open) meets the request's TTFT target, drops every
worker that would miss it (predicted TTFT past the target). Off with `prefill_weight` 0:
cost-based's cost then is the TTFT itself, and the least one wins anyway."""

from __future__ import annotations

from services.core.pipeline.protocol import Plugin
from services.core.policies.protocol import Candidate, PolicyParams, RouteContext


class LateParams(PolicyParams):
    prefill_weight: float = 0.0


class Late(Plugin):
    name = "late"
    Params = LateParams

    def keep(self, ctx: RouteContext, cands: list[Candidate]) -> list[bool]:
        slo = ctx.slo_ttft_ms
        if not self.params.prefill_weight or slo <= 0 or not any(c.ttft_ms <= slo and not c.gated for c in cands):
            return [True] * len(cands)
        return [c.ttft_ms <= slo for c in cands]
