"""`weighted-random`: a candidate drawn with probability proportional to its total score
(`ctx.rng`, one draw, over the worker-id order); the last one where rounding leaves the draw
past every total. With the scorer least-kv-used this is kv-aware's draw."""

from __future__ import annotations

from services.core.pipeline.protocol import Plugin
from services.core.policies.protocol import Candidate, RouteContext


class WeightedRandom(Plugin):
    name = "weighted-random"

    def pick(self, ctx: RouteContext, cands: list[Candidate], totals: list[float]) -> tuple[int, str]:
        order = sorted(range(len(cands)), key=lambda i: cands[i].worker_id)
        total = sum(totals[i] for i in order)
        x = ctx.rng.random() * total
        acc = 0.0
        chosen = order[-1]
        for i in order:
            acc += totals[i]
            if x < acc:
                chosen = i
                break
        return chosen, f"weighted random (w={totals[chosen]:.3f} of {total:.3f})"
