"""`fewest-pending`: 1 / (1 + the requests pending on the worker): 1 for an idle worker."""

from __future__ import annotations

from services.core.pipeline.protocol import NoPluginParams
from services.core.policies.protocol import Candidate, RouteContext


class FewestPending:
    name = "fewest-pending"
    Params = NoPluginParams

    def __init__(self, params: NoPluginParams) -> None:
        self.params = params

    def score(self, ctx: RouteContext, cands: list[Candidate]) -> list[float]:
        return [1.0 / (1 + c.num_pending) for c in cands]
