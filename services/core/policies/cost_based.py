"""`cost-based` (prefill stage; colocated pd_fusion workers too): the worker where this request
would see its first token soonest, after filters that keep load off hot spots.

It is a pipeline (services/core/pipeline/ `cost_based`: the filters below, the fallback
least-waiting, the scorer predicted-cost for the cards, the picker lowest-cost).

Cost (ms, lower is better; services/core/pipeline/cost.py) = the candidate's predicted TTFT there: prefill of this request
given the worker's prefix hit + predicted wait of its inflight batches + predicted wait in its
batcher queue (`Candidate.ttft_ms`), + `prefill_weight` x the prefill it spends for lack of the
best-cached candidate's prefix (its prefill's share of the tokens that candidate has cached
and it has not: 0 between workers whose caches match, whatever their predictors say): a worker
that lacks the prompt's cached prefix spends that extra prefill on engine time every request there waits for (their TTFT, and on a mixed-step or
prefill-first engine every running decode's TPOT), not only on this request's TTFT; a
conversation's next turn stays on the worker holding its history unless waiting there costs
more. 0 (FlexLB's): the request's TTFT alone. Filters, in order (the score card names the
one that removed a worker):
- `gated`: the worker's pending requests closed its hysteresis gate: closed at
  `pending_gate_high`, open again once pending <= high × (1 − `pending_gate_hysteresis`)
  (64 and 0.15: closes at 64, reopens at 54). The scheduler keeps the gate state and passes
  `Candidate.gated`.
- `late` (with `prefill_weight` > 0): the worker's TTFT misses the request's target while
  another (not gated) meets it: the weight never trades a met TTFT for a cache hit.
- `tpot` (`tpot_filter`, off): the worker's predicted TPOT with this request added is above
  `ctx.tpot_limit_ms` (the slo-budget batcher's `tpot_headroom` × the request's TPOT target:
  the batcher would only hold the request there).
- `slo-ttft` (`slo_filter`, off): cost > the request's TTFT target − `slo_margin_ms`.
- `hotspot`: pending > `hotspot_factor` × the average pending AND pending >= average +
  `hotspot_min_excess`.
- `imbalance`: wait + queue > `imbalance_factor` × the average AND >= average +
  `imbalance_min_excess_ms` (`imbalance_factor` 0: off; the score already counts the wait,
  so what this filter adds is pushing a request off the worker whose cache makes it cheapest).
The absolute excess keeps the ratio filters for real hot spots: by the ratio alone, a worker
holding 2 requests while the others hold none is a hot spot, and the second request of a
shared prefix would be pushed off the worker about to cache it.
If every candidate is filtered: the least-waiting one (wait + queue, then id), its card marked
`fallback_from` so a pick is never shown as filtered.
Pick: the ties are the unfiltered workers whose cost is within max(`tie_rel` × min cost,
`tie_abs_ms`) of the minimum; with `tie_break` "fewest-pending" (default) those with the fewest
pending requests (the shortest decode steps, so the best TPOT) are kept, then one is drawn
uniformly (`ctx.rng`, by worker id order); "random" draws among all ties.

Parameters (`CostBasedParams`, defaults): pending_gate_high 64, pending_gate_hysteresis 0.15,
prefill_weight 0, tpot_filter false, slo_filter false, slo_margin_ms 100, hotspot_factor 3, hotspot_min_excess
4, imbalance_factor 3, imbalance_min_excess_ms 100, tie_rel 0.10, tie_abs_ms 20, tie_break
"fewest-pending". The router ships prefill_weight 3 and imbalance_factor 0 over these
(services/settings.py SHIPPED_COST_BASED_PARAMS). Why these defaults (tie_break, tpot_filter
off, the two shipped): README, "Defaults, and the numbers that chose them".
"""

from __future__ import annotations

import math

from services.core.policies.protocol import PolicyParams


class CostBasedParams(PolicyParams):
    pending_gate_high: int = 64  # a worker with this many pending requests stops taking more
    pending_gate_hysteresis: float = 0.15  # ... until pending falls to high × (1 − this)
    slo_filter: bool = False  # drop workers whose wait + prefill exceeds the SLO − margin
    slo_margin_ms: float = 100.0
    hotspot_factor: float = 3.0  # pending > factor × average: filtered ...
    hotspot_min_excess: int = 4  # ... if also pending − average >= this (ours, see below)
    imbalance_factor: float = 3.0  # wait > factor × average: filtered ... (0: off)
    imbalance_min_excess_ms: float = 100.0  # ... if also wait − average >= this (ours)
    tie_rel: float = 0.10  # tie window: max(tie_rel × min score, tie_abs_ms)
    tie_abs_ms: float = 20.0
    tie_break: str = "fewest-pending"  # among ties: "fewest-pending" then uniform | "random": uniform
    tpot_filter: bool = False  # drop workers whose predicted TPOT would pass the TPOT hold's limit
    # The prefill a worker spends beyond the least among the candidates (it lacks the prompt's
    # cached prefix) counts this many times more in the score: engine time taken from every
    # request there, not only this one's TTFT (0: the score is the request's TTFT alone)
    prefill_weight: float = 0.0

    def pending_gate(self) -> tuple[float, float]:
        return self.pending_gate_high, self.pending_gate_hysteresis

    def validate(self) -> "CostBasedParams":
        if self.tie_break not in ("fewest-pending", "random"):
            raise ValueError(f"cost-based: tie_break must be fewest-pending or random, got {self.tie_break!r}")
        if self.pending_gate_high < 1:
            raise ValueError("cost-based: pending_gate_high must be >= 1")
        if not 0 <= self.pending_gate_hysteresis < 1:
            raise ValueError("cost-based: pending_gate_hysteresis must be in [0, 1)")
        if self.hotspot_factor <= 1:
            raise ValueError("cost-based: hotspot_factor must be > 1")
        if self.imbalance_factor <= 1 and self.imbalance_factor != 0:
            raise ValueError("cost-based: imbalance_factor must be > 1, or 0 (off)")
        if not (math.isfinite(self.prefill_weight) and self.prefill_weight >= 0):
            raise ValueError("cost-based: prefill_weight must be a finite number >= 0")
        if self.hotspot_min_excess < 0 or self.imbalance_min_excess_ms < 0:
            raise ValueError("cost-based: hotspot_min_excess and imbalance_min_excess_ms must be >= 0")
        if self.tie_rel < 0 or self.tie_abs_ms < 0 or self.slo_margin_ms < 0:
            raise ValueError("cost-based: tie_rel, tie_abs_ms and slo_margin_ms must be >= 0")
        return self
