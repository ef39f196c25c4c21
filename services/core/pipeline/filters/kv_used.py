"""`kv-used`: drops a worker whose KV in use (reported, plus what we reserved there and it does
not show yet) passes `factor` x the average over every candidate of the decision."""

from __future__ import annotations

from services.core.pipeline.filters import FactorParams, within_factor_of_average
from services.core.pipeline.protocol import Plugin
from services.core.policies.protocol import Candidate, RouteContext


class KvUsed(Plugin):
    name = "kv-used"
    Params = FactorParams

    def keep(self, ctx: RouteContext, cands: list[Candidate]) -> list[bool]:
        return within_factor_of_average([c.kv_used_tokens for c in cands], self.params.factor)
