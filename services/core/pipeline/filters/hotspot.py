"""`hotspot`: drops a worker whose pending requests pass `factor` x the average over every
candidate and exceed that average by at least `min_excess`."""

from __future__ import annotations

from services.core.pipeline.protocol import Plugin
from services.core.policies.protocol import Candidate, PolicyParams, RouteContext


class HotspotParams(PolicyParams):
    factor: float = 3.0
    min_excess: int = 4


class Hotspot(Plugin):
    name = "hotspot"
    Params = HotspotParams

    def keep(self, ctx: RouteContext, cands: list[Candidate]) -> list[bool]:
        avg = sum([c.num_pending for c in cands]) / len(cands)
        ratio, least = self.params.factor * avg, avg + self.params.min_excess
        return [not (c.num_pending > ratio and c.num_pending >= least) for c in cands]
