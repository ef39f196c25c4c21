"""`round-robin`: the next worker id, in sorted order, after the last committed pick (wrapping;
the first ever: the lowest id); scores ignored. Stateful: `record` folds the committed pick,
so a rejected request does not advance it."""

from __future__ import annotations

from services.core.pipeline.protocol import NoPluginParams, Plugin
from services.core.policies.protocol import Candidate, RouteContext


class RoundRobinPick(Plugin):
    name = "round-robin"
    uses_totals = False

    def __init__(self, params: NoPluginParams) -> None:
        super().__init__(params)
        self.last_worker_id: str | None = None  # the last committed pick

    def pick(self, ctx: RouteContext, cands: list[Candidate], totals: list[float]) -> tuple[int, str]:
        ids = sorted(c.worker_id for c in cands)
        nxt = next((i for i in ids if self.last_worker_id is None or i > self.last_worker_id), ids[0])
        return (next(i for i, c in enumerate(cands) if c.worker_id == nxt),
                f"next after {self.last_worker_id or '(start)'} of {len(ids)}")

    def record(self, worker_id: str) -> None:
        self.last_worker_id = worker_id
