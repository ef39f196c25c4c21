"""`power-of-two`: two distinct candidates drawn at random (`ctx.rng`, from the worker-id
order), the one with the higher total score, ties by fewer pending requests then the lower id;
a lone candidate is picked. With no scorer this is `power-of-two`'s rule: the less loaded."""

from __future__ import annotations

from services.core.pipeline.protocol import Plugin
from services.core.policies.protocol import Candidate, RouteContext


class PowerOfTwoPick(Plugin):
    name = "power-of-two"

    def pick(self, ctx: RouteContext, cands: list[Candidate], totals: list[float]) -> tuple[int, str]:
        order = sorted(range(len(cands)), key=lambda i: cands[i].worker_id)
        if len(order) == 1:
            return order[0], "only candidate"
        a, b = ctx.rng.sample(order, 2)
        key = lambda i: (-totals[i], cands[i].num_pending, cands[i].worker_id)  # noqa: E731
        i = a if key(a) <= key(b) else b
        return i, f"better of {cands[a].worker_id}/{cands[b].worker_id}"
