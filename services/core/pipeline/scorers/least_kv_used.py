"""`least-kv-used`: exp(−`per_token` x (the worker's KV in use − the least among the
candidates)): 1 for the emptiest worker, falling off by e every 1 / `per_token` tokens more."""

from __future__ import annotations

import math

from services.core.pipeline.protocol import Plugin
from services.core.policies.protocol import Candidate, PolicyParams, RouteContext


class LeastKvUsedParams(PolicyParams):
    per_token: float = 0.001

    def validate(self) -> "LeastKvUsedParams":
        if not (math.isfinite(self.per_token) and self.per_token >= 0):
            raise ValueError(f"scorer least-kv-used: per_token must be a finite number >= 0, got {self.per_token!r}")
        return self


class LeastKvUsed(Plugin):
    name = "least-kv-used"
    Params = LeastKvUsedParams

    def score(self, ctx: RouteContext, cands: list[Candidate]) -> list[float]:
        least = min((c.kv_used_tokens for c in cands), default=0)
        w = self.params.per_token
        return [math.exp(-w * (c.kv_used_tokens - least)) for c in cands]
