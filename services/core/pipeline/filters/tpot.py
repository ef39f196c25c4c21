"""`tpot`: drops a worker whose predicted decode step with this request would pass the TPOT
hold's limit (the batcher's `tpot_headroom` x the request's TPOT target): it would only hold
the request there. No limit (no hold, no target): keeps every worker."""

from __future__ import annotations

from services.core.pipeline.protocol import Plugin
from services.core.policies.protocol import Candidate, RouteContext


class Tpot(Plugin):
    name = "tpot"

    def keep(self, ctx: RouteContext, cands: list[Candidate]) -> list[bool]:
        return [not 0 < ctx.tpot_limit_ms < c.tpot_ms for c in cands]
