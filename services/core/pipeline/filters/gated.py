"""`gated`: drops a worker whose gate is closed (prefill: too many pending requests, the
policy parameters' `pending_gate_high`; decode: KV usage above `max_kv_usage`)."""

from __future__ import annotations

from services.core.pipeline.protocol import Plugin
from services.core.policies.protocol import Candidate, RouteContext


class Gated(Plugin):
    name = "gated"

    def keep(self, ctx: RouteContext, cands: list[Candidate]) -> list[bool]:
        return [not c.gated for c in cands]
