"""`load`: drops a worker whose pending requests pass `factor` x the average over every
candidate of the decision."""

from __future__ import annotations

from services.core.pipeline.filters import FactorParams, within_factor_of_average
from services.core.pipeline.protocol import Plugin
from services.core.policies.protocol import Candidate, RouteContext


class Load(Plugin):
    name = "load"
    Params = FactorParams

    def keep(self, ctx: RouteContext, cands: list[Candidate]) -> list[bool]:
        return within_factor_of_average([c.num_pending for c in cands], self.params.factor)
