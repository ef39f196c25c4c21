"""`random`: uniform among the candidates (`ctx.rng`, over the worker-id order); scores ignored."""

from __future__ import annotations

from services.core.pipeline.protocol import Plugin
from services.core.policies.protocol import Candidate, RouteContext


class RandomPick(Plugin):
    name = "random"
    uses_totals = False

    def pick(self, ctx: RouteContext, cands: list[Candidate], totals: list[float]) -> tuple[int, str]:
        ids = sorted(c.worker_id for c in cands)
        chosen = ctx.rng.choice(ids)
        return next(i for i, c in enumerate(cands) if c.worker_id == chosen), f"uniform of {len(ids)}"
