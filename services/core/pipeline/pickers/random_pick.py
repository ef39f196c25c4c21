"""`random`: uniform among the candidates (`ctx.rng`, over the worker-id order); scores ignored."""

from __future__ import annotations

from services.core.pipeline.protocol import NoPluginParams
from services.core.policies.protocol import Candidate, RouteContext


class RandomPick:
    name = "random"
    Params = NoPluginParams

    def __init__(self, params: NoPluginParams) -> None:
        self.params = params

    def pick(self, ctx: RouteContext, cands: list[Candidate], totals: list[float]) -> tuple[int, str]:
        ids = sorted(c.worker_id for c in cands)
        chosen = ctx.rng.choice(ids)
        return next(i for i, c in enumerate(cands) if c.worker_id == chosen), f"uniform of {len(ids)}"

    def record(self, worker_id: str) -> None:
        """Stateless."""
