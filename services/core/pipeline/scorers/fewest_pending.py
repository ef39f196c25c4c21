"""`fewest-pending`: 1 / (1 + the requests pending on the worker): 1 for an idle worker."""

from __future__ import annotations

from services.core.pipeline.protocol import Plugin
from services.core.policies.protocol import Candidate, RouteContext


class FewestPending(Plugin):
    name = "fewest-pending"

    def score(self, ctx: RouteContext, cands: list[Candidate]) -> list[float]:
        return [1.0 / (1 + c.num_pending) for c in cands]
