"""`round-robin` (prefill or decode stage): the next worker id, in sorted order, after the last
committed pick (wrapping; the first ever: the lowest id). The one stateful policy: `record`
folds the committed pick, so a rejected request does not advance it. No parameters.
"""

from __future__ import annotations

from services.core.policies.base import StatelessPolicy, no_pick, score_components
from services.core.policies.protocol import NoParams, Pick, RouteContext, Score


class RoundRobin(StatelessPolicy):
    name = "round-robin"

    def __init__(self, params: NoParams) -> None:
        super().__init__(params)
        self.last_worker_id: str | None = None  # the last committed pick

    def select(self, ctx: RouteContext) -> Pick:
        if not ctx.candidates:
            return no_pick("no live candidate", [])
        ids = sorted(c.worker_id for c in ctx.candidates)
        nxt = next((i for i in ids if self.last_worker_id is None or i > self.last_worker_id), ids[0])
        scores = [Score(c.worker_id, 0.0, score_components(c)) for c in ctx.candidates]
        return Pick(nxt, f"next after {self.last_worker_id or '(start)'} of {len(ids)}", scores)

    def record(self, pick: Pick) -> None:
        if pick.worker_id is not None:
            self.last_worker_id = pick.worker_id

