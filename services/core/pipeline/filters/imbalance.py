"""`imbalance`: drops a worker whose predicted wait (inflight + queue) passes `factor` x the
average over every candidate and exceeds it by at least `min_excess_ms` (`factor` 0: off)."""

from __future__ import annotations

from services.core.pipeline.protocol import Plugin
from services.core.policies.protocol import Candidate, PolicyParams, RouteContext


class ImbalanceParams(PolicyParams):
    factor: float = 3.0
    min_excess_ms: float = 100.0


class Imbalance(Plugin):
    name = "imbalance"
    Params = ImbalanceParams

    def keep(self, ctx: RouteContext, cands: list[Candidate]) -> list[bool]:
        if not self.params.factor:
            return [True] * len(cands)
        waits = [c.wait_ms + c.queue_ms for c in cands]
        avg = sum(waits) / len(waits)
        ratio, least = self.params.factor * avg, avg + self.params.min_excess_ms
        return [not (w > ratio and w >= least) for w in waits]
