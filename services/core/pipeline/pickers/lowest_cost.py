"""`lowest-cost`: cost-based's choice. The least cost (services/core/pipeline/cost.py), with
every candidate within max(`tie_rel` x it, `tie_abs_ms`) of it tied; among ties the fewest
pending (`tie_break` fewest-pending), then a draw (`ctx.rng`, worker-id order). Scores ignored:
the tie window is in milliseconds."""

from __future__ import annotations

from services.core.pipeline.cost import cost_of, most_cached
from services.core.pipeline.protocol import Plugin
from services.core.policies.protocol import Candidate, PolicyParams, RouteContext


class LowestCostParams(PolicyParams):
    prefill_weight: float = 0.0
    tie_rel: float = 0.10
    tie_abs_ms: float = 20.0
    tie_break: str = "fewest-pending"

    def validate(self) -> "LowestCostParams":
        if self.tie_break not in ("fewest-pending", "random"):
            raise ValueError(f"picker lowest-cost: tie_break must be fewest-pending or random, got {self.tie_break!r}")
        return self


class LowestCost(Plugin):
    name = "lowest-cost"
    uses_totals = False
    Params = LowestCostParams

    def pick(self, ctx: RouteContext, cands: list[Candidate], totals: list[float]) -> tuple[int, str]:
        p = self.params
        most = most_cached(ctx) if p.prefill_weight else 0
        costs = [cost_of(c, most, ctx.num_prompt_tokens, p.prefill_weight) for c in cands]
        best = min(costs)
        window = max(p.tie_rel * best, p.tie_abs_ms)
        limit = best + window
        ties = [i for i in range(len(cands)) if costs[i] <= limit]
        if len(ties) > 1 and p.tie_break == "fewest-pending":
            fewest = min(cands[i].num_pending for i in ties)
            ties = [i for i in ties if cands[i].num_pending == fewest]
        if len(ties) == 1:
            pick = ties[0]
        else:
            ties.sort(key=lambda i: cands[i].worker_id)
            pick = ties[ctx.rng.randrange(len(ties))]
        return pick, f"cost {costs[pick]:.1f} ms (min {best:.1f}, tie window {window:.1f} ms, {len(ties)} tied)"
