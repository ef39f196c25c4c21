"""Routing policies as plugins: each picks one worker from candidates the scheduler scored.

Contract
- The scheduler builds one `Candidate` per live worker of the right role, with every input
  a policy may use already computed (prefix hit, predicted prefill, waits, pending, KV).
  It never passes a dead or draining worker.
- `select(ctx) -> Pick` is a pure choice: it does not mutate the policy. It returns the
  pick (or None with a reason) and the score card of every candidate, including which
  filter removed it — the decision is data (`route.decided`).
- `record(pick)` is called once the pick is committed; only stateful policies (round-robin)
  change there. A rejected request leaves no trace.
- `ctx.rng` is the only randomness: a `DecisionRng` (splitmix64) seeded per decision by the
  caller (tests may pass a `random.Random`).

Registry: `build_policy(stage, name, params)` from an explicit table; parameters are typed
msgspec Structs that reject unknown keys; every error names the policy and the field.

Prefill policies (stage "prefill"; colocated pd_fusion workers use these too)
- `cost-based` (FlexLB): score = predicted prefill of this request given the worker's
  prefix hit + predicted wait of its inflight batches + predicted wait in its batcher queue.
  Filters, in order: pending above the hysteresis gate (closes at `pending_gate_high` 64,
  reopens at 64 − 15% = 55; the scheduler keeps the gate state); TPOT (`tpot_filter`, ours:
  the worker's predicted TPOT with this request above the batcher's TPOT-hold limit, which
  would only hold it there); optional SLO filter
  (wait + prefill > SLO − `slo_margin_ms` 100); hotspot (pending > `hotspot_factor` 3 ×
  average); imbalance (wait > `imbalance_factor` 3 × average). If nothing survives: the
  least-waiting worker. Where we differ: hotspot and imbalance also need an absolute excess
  over the average (`hotspot_min_excess` 4 requests, `imbalance_min_excess_ms` 100 ms).
  With FlexLB's pure ratios, a worker holding 2 requests while the others hold none is a
  "hotspot", so the second request of a shared prefix was pushed off the worker that is
  about to cache it; the excess keeps the filters for real hot spots. Pick: uniform among scores within max(`tie_rel` 10% × min,
  `tie_abs_ms` 20 ms) of the minimum.
- `cache-aware` (SGLang router): if the load is imbalanced — max pending − min pending >
  `balance_abs_threshold` (32) and max pending > `balance_rel_threshold` (1.5) × min
  pending — the shortest queue; else the best prefix-match ratio if it is above
  `cache_threshold` (0.5), else the worker with the smallest cache (to spread new prefixes).
- `least-loaded`: fewest pending requests (ties: lowest predicted wait, then id).
- `power-of-two`: two distinct candidates drawn at random, the one with fewer pending.
- `round-robin`: next worker id after the last committed pick.
- `random`: uniform.

Decode policies (stage "decode", disaggregated mode)
- `kv-aware` (FlexLB): expected KV = prompt + min(max_tokens, `expected_output_cap` 1000).
  Filters: available KV < prompt tokens; KV usage ≥ `max_kv_usage` (0.9, with the same
  hysteresis as the gate, 15%); load > 3× average; KV used > 3× average. Nothing left →
  no pick (`no_worker`, no fallback). Pick: weighted random, weight = exp(−`kv_weight_per_token`
  (0.001) × (kv_used − min kv_used)): a worker with 500 tokens used is picked e^1 ≈ 2.7×
  as often as one with 1,500.
- `least-loaded`, `round-robin`, `random` as above (load = running + reserved requests).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Protocol

import msgspec

from services.core.view import WorkerInfo


class _CandidateFields(NamedTuple):
    worker: WorkerInfo
    worker_id: str
    num_cached_tokens: int  # predicted prefix-cache hit of this request on this worker
    prefill_ms: float  # predicted prefill of this request alone, given the hit
    wait_ms: float  # predicted wait for the worker's inflight batches
    queue_ms: float  # predicted wait in the worker's batcher queue
    num_pending: int  # requests we reserved there (inflight) + queued in its batcher
    num_cache_blocks: int  # blocks the prefix index says it holds (its "tree size")
    kv_total_tokens: int
    kv_used_tokens: int  # reported used + Σ expected reservations not yet visible
    kv_available_tokens: int  # reported free − Σ hard reservations not yet visible
    gated: bool  # pending above the hysteresis gate (prefill) / KV usage gate (decode)
    ttft_ms: float  # prefill_ms + wait_ms + queue_ms: predicted time to first token there
    tpot_ms: float  # predicted decode step (TPOT) there with this request added; 0: idle or not predicted


class Candidate(_CandidateFields):
    """One worker as the scheduler scored it for this request: an immutable snapshot (a
    tuple: the scheduler builds one per worker per decision, so it must be cheap; its hot
    path calls `tuple.__new__(Candidate, fields)` with every field, ttft_ms included)."""

    __slots__ = ()

    def __new__(cls, worker: WorkerInfo, num_cached_tokens: int = 0, prefill_ms: float = 0.0, wait_ms: float = 0.0,
                queue_ms: float = 0.0, num_pending: int = 0, num_cache_blocks: int = 0, kv_total_tokens: int = 0,
                kv_used_tokens: int = 0, kv_available_tokens: int = 0, gated: bool = False,
                tpot_ms: float = 0.0) -> "Candidate":
        return tuple.__new__(cls, (worker, worker.worker_id, num_cached_tokens, prefill_ms, wait_ms, queue_ms, num_pending,
                                   num_cache_blocks, kv_total_tokens, kv_used_tokens, kv_available_tokens, gated,
                                   prefill_ms + wait_ms + queue_ms, tpot_ms))

    def __repr__(self) -> str:
        return f"Candidate({self.worker_id}, ttft={self.ttft_ms:.1f}ms)"


class RouteContext:
    """One decision's inputs. `rng` is built on first use from `seed` (most decisions draw
    nothing: seeding a Random costs more than scoring a worker); pass a Random or a seed."""

    __slots__ = ("request_id", "num_prompt_tokens", "max_tokens", "candidates", "now_ns", "_rng", "_seed",
                 "num_prompt_blocks", "slo_ttft_ms", "tpot_limit_ms")

    def __init__(self, request_id: str, num_prompt_tokens: int, max_tokens: int, candidates: list[Candidate],
                 now_ns: int, rng: random.Random | int, num_prompt_blocks: int = 0, slo_ttft_ms: float = 0.0,
                 tpot_limit_ms: float = 0.0) -> None:
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self.max_tokens = max_tokens
        self.candidates = candidates
        self.now_ns = now_ns
        self._rng = rng if isinstance(rng, random.Random) else None
        self._seed = rng if isinstance(rng, int) else None
        self.num_prompt_blocks = num_prompt_blocks  # full blocks of the prompt (for match ratios)
        self.slo_ttft_ms = slo_ttft_ms  # 0: no SLO
        # The decode step above which a worker holds new work for TPOT (the batcher's
        # tpot_headroom x the request's TPOT target); 0: no TPOT hold
        self.tpot_limit_ms = tpot_limit_ms

    @property
    def rng(self) -> "random.Random | DecisionRng":
        if self._rng is None:
            self._rng = DecisionRng(self._seed)
        return self._rng


_MASK64 = (1 << 64) - 1


class DecisionRng:
    """The draws of one decision: a splitmix64 stream from the decision's seed. The subset of
    `random.Random` the policies use, at a fraction of its cost (seeding a Mersenne Twister
    takes longer than scoring a worker). Deterministic across platforms and versions, so a
    replay re-draws exactly what the router drew."""

    __slots__ = ("_state",)

    def __init__(self, seed: int) -> None:
        self._state = seed & _MASK64

    def _next(self) -> int:
        self._state = z = (self._state + 0x9E3779B97F4A7C15) & _MASK64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        return z ^ (z >> 31)

    def random(self) -> float:
        """Uniform in [0, 1), 53 bits."""
        return (self._next() >> 11) * (1.0 / 9007199254740992.0)

    def randrange(self, n: int) -> int:
        """Uniform in [0, n)."""
        if n <= 0:
            raise ValueError(f"randrange: empty range {n}")
        return (self._next() * n) >> 64  # multiply-shift: bias <= n / 2^64

    def choice(self, seq):  # noqa: ANN001, ANN201 - mirrors random.Random.choice
        return seq[self.randrange(len(seq))]

    def sample(self, population, k: int) -> list:  # noqa: ANN001 - mirrors random.Random.sample
        """k distinct elements (partial Fisher-Yates)."""
        pool = list(population)
        if not 0 <= k <= len(pool):
            raise ValueError(f"sample: k={k} out of range for {len(pool)}")
        for i in range(k):
            j = i + self.randrange(len(pool) - i)
            pool[i], pool[j] = pool[j], pool[i]
        return pool[:k]


@dataclass(slots=True)
class Score:
    worker_id: str
    score: float
    components: dict[str, float] = field(default_factory=dict)
    filtered_by: str | None = None


class Pick:
    """The choice (None: nothing could be picked, see reason) and the score card of every
    candidate. The cards and the reason text may be built on first read (`scores`,
    `reason`) from a snapshot the policy passed: building them costs more than the
    decision, and most readers are the shell's event encoder, once."""

    __slots__ = ("worker_id", "_reason", "_scores", "_cards", "_reason_fn")

    def __init__(self, worker_id: str | None, reason: str | None = None, scores: list[Score] | None = None,
                 cards: Callable[[], list[Score]] | None = None, reason_fn: Callable[[], str] | None = None) -> None:
        if reason is None and reason_fn is None:
            raise ValueError("a Pick needs a reason")
        self.worker_id = worker_id
        self._reason = reason
        self._reason_fn = reason_fn
        self._scores = scores if scores is not None or cards is not None else []
        self._cards = cards

    @property
    def reason(self) -> str:
        if self._reason is None:
            self._reason = self._reason_fn()
            self._reason_fn = None
        return self._reason

    @property
    def scores(self) -> list[Score]:
        if self._scores is None:
            self._scores = self._cards()
            self._cards = None
        return self._scores

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, Pick) and self.worker_id == other.worker_id and self.reason == other.reason
                and self.scores == other.scores)

    def __repr__(self) -> str:
        return f"Pick({self.worker_id!r}, {self.reason!r})"


class RoutingPolicy(Protocol):
    name: str

    def select(self, ctx: RouteContext) -> Pick: ...

    def record(self, pick: Pick) -> None: ...


class _Params(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    def validate(self) -> "_Params":
        return self


def _avg(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _components(c: Candidate) -> dict[str, float]:
    return {
        "prefill_ms": c.prefill_ms, "wait_ms": c.wait_ms, "queue_ms": c.queue_ms,
        "cached_tokens": c.num_cached_tokens, "pending": c.num_pending, "tpot_ms": c.tpot_ms,
    }


def _none(reason: str, scores: list[Score]) -> Pick:
    return Pick(None, reason, scores)


# ------------------------------------------------------------------ cost-based
class CostBasedParams(_Params):
    pending_gate_high: int = 64  # a worker with this many pending requests stops taking more
    pending_gate_hysteresis: float = 0.15  # ... until pending falls to high × (1 − this)
    slo_filter: bool = False  # drop workers whose wait + prefill exceeds the SLO − margin
    slo_margin_ms: float = 100.0
    hotspot_factor: float = 3.0  # pending > factor × average: filtered ...
    hotspot_min_excess: int = 4  # ... if also pending − average >= this (ours, see below)
    imbalance_factor: float = 3.0  # wait > factor × average: filtered ...
    imbalance_min_excess_ms: float = 100.0  # ... if also wait − average >= this (ours)
    tie_rel: float = 0.10  # tie window: max(tie_rel × min score, tie_abs_ms)
    tie_abs_ms: float = 20.0
    # Within the tie window the predicted TTFTs are equal for the SLO's purpose; what still
    # differs is the decode load a pick adds to: "fewest-pending" keeps the ties with the
    # fewest requests in flight (running + queued: the shortest decode steps, so the best
    # TPOT), then draws; "random" draws among all ties (the reference's behaviour). Chosen on
    # goodput (bench/tune.py, Azure conv 800 rows, 4 workers, SLO 2 s / 100 ms; README).
    tie_break: str = "fewest-pending"
    # Leave out a worker whose predicted TPOT with this request would pass the TPOT hold's
    # limit (the slo-budget batcher's tpot_headroom x the request's TPOT target: it would only
    # hold the request there), while another has room. Off by default: it sends a conversation's
    # next turn away from the worker that holds its history while that worker is busy, to
    # recompute the history elsewhere, which on the chat workload cost more than waiting for a
    # slot (bench/tune.py, 600 rows: 1.38 against 1.71 req/s at >= 90 % on prefill-first
    # engines; neutral on Azure conv, code and Mooncake).
    tpot_filter: bool = False

    def validate(self) -> "CostBasedParams":
        if self.tie_break not in ("fewest-pending", "random"):
            raise ValueError(f"cost-based: tie_break must be fewest-pending or random, got {self.tie_break!r}")
        if self.pending_gate_high < 1:
            raise ValueError("cost-based: pending_gate_high must be >= 1")
        if not 0 <= self.pending_gate_hysteresis < 1:
            raise ValueError("cost-based: pending_gate_hysteresis must be in [0, 1)")
        for name in ("hotspot_factor", "imbalance_factor"):
            if getattr(self, name) <= 1:
                raise ValueError(f"cost-based: {name} must be > 1")
        if self.hotspot_min_excess < 0 or self.imbalance_min_excess_ms < 0:
            raise ValueError("cost-based: hotspot_min_excess and imbalance_min_excess_ms must be >= 0")
        if self.tie_rel < 0 or self.tie_abs_ms < 0 or self.slo_margin_ms < 0:
            raise ValueError("cost-based: tie_rel, tie_abs_ms and slo_margin_ms must be >= 0")
        return self


class CostBased:
    name = "cost-based"

    def __init__(self, params: CostBasedParams) -> None:
        self.params = params

    def select(self, ctx: RouteContext) -> Pick:
        p = self.params
        cands = ctx.candidates
        if not cands:
            return _none("no live candidate", [])
        k = len(cands)
        waits = [c.wait_ms + c.queue_ms for c in cands]
        costs = [c.ttft_ms for c in cands]
        avg_pending = sum([c.num_pending for c in cands]) / k
        avg_wait = sum(waits) / k
        hot_ratio, hot_abs = p.hotspot_factor * avg_pending, avg_pending + p.hotspot_min_excess
        imb_ratio, imb_abs = p.imbalance_factor * avg_wait, avg_wait + p.imbalance_min_excess_ms
        # (the scheduler gives every request a TTFT target: its own or its bucket's; 0 = none)
        budget = ctx.slo_ttft_ms - p.slo_margin_ms if p.slo_filter and ctx.slo_ttft_ms > 0 else math.inf
        filtered: list[str | None] = [None] * k
        best = math.inf
        num_filtered = 0
        tpot_limit = ctx.tpot_limit_ms if p.tpot_filter else 0.0
        for i, c in enumerate(cands):
            pending = c.num_pending
            if c.gated:
                filtered[i] = "pending_gate"
            elif 0 < tpot_limit < c.tpot_ms:
                filtered[i] = "tpot"
            elif costs[i] > budget:
                filtered[i] = "slo"
            elif pending > hot_ratio and pending >= hot_abs:
                filtered[i] = "hotspot"
            elif waits[i] > imb_ratio and waits[i] >= imb_abs:
                filtered[i] = "imbalance"
            elif costs[i] < best:
                best = costs[i]
                continue
            else:
                continue
            num_filtered += 1

        def cards(fallback: int = -1) -> list[Score]:
            out = [Score(c.worker_id, costs[i], _components(c), filtered[i]) for i, c in enumerate(cands)]
            if fallback >= 0:  # the card of the fallback pick shows the filter lifted
                out[fallback] = Score(out[fallback].worker_id, costs[fallback],
                                      {**out[fallback].components, "fallback_from": 1.0}, None)
            return out

        if num_filtered == k:
            # FlexLB's fallback: the least-waiting worker. Its score card is marked as the
            # fallback (filter lifted) so a pick is never a worker the card shows as filtered.
            fb = min(range(k), key=lambda i: (waits[i], cands[i].worker_id))
            wid = cands[fb].worker_id
            return Pick(wid, f"every candidate filtered; least waiting {wid} (was {filtered[fb]})",
                        cards=lambda: cards(fb))
        window = max(p.tie_rel * best, p.tie_abs_ms)
        limit = best + window
        ties = [i for i in range(k) if filtered[i] is None and costs[i] <= limit]
        if len(ties) > 1 and p.tie_break == "fewest-pending":
            fewest = min(cands[i].num_pending for i in ties)
            ties = [i for i in ties if cands[i].num_pending == fewest]
        if len(ties) == 1:
            pick = ties[0]
        else:
            ties.sort(key=[c.worker_id for c in cands].__getitem__)
            pick = ties[ctx.rng.randrange(len(ties))]
        num_ties = len(ties)
        return Pick(
            cands[pick].worker_id,
            reason_fn=lambda: (f"cost {costs[pick]:.1f} ms (min {best:.1f}, tie window {window:.1f} ms, {num_ties} tied, "
                               f"{num_filtered} filtered)"),
            cards=cards,
        )

    def record(self, pick: Pick) -> None:
        """Stateless: nothing to record (the pending gate is scheduler state)."""


# ------------------------------------------------------------------ cache-aware
class CacheAwareParams(_Params):
    cache_threshold: float = 0.5  # prefix-match ratio above which the best match wins
    balance_abs_threshold: int = 32  # imbalanced when max − min pending exceeds this ...
    balance_rel_threshold: float = 1.5  # ... and max pending > this × min pending

    def validate(self) -> "CacheAwareParams":
        if not 0 <= self.cache_threshold <= 1:
            raise ValueError("cache-aware: cache_threshold must be in [0, 1]")
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1:
            raise ValueError("cache-aware: balance_abs_threshold >= 0 and balance_rel_threshold >= 1 required")
        return self


class CacheAware:
    name = "cache-aware"

    def __init__(self, params: CacheAwareParams) -> None:
        self.params = params

    def select(self, ctx: RouteContext) -> Pick:
        p = self.params
        cands = sorted(ctx.candidates, key=lambda c: c.worker_id)
        if not cands:
            return _none("no live candidate", [])
        denom = max(1, ctx.num_prompt_tokens)
        scores = [Score(c.worker_id, c.num_cached_tokens / denom, _components(c)) for c in cands]
        pendings = [c.num_pending for c in cands]
        lo, hi = min(pendings), max(pendings)
        if hi - lo > p.balance_abs_threshold and hi > p.balance_rel_threshold * lo:
            c = min(cands, key=lambda c: (c.num_pending, c.worker_id))
            return Pick(c.worker_id, f"load imbalanced (pending {lo}..{hi}): shortest queue", scores)
        best = max(cands, key=lambda c: (c.num_cached_tokens, -c.num_pending))
        ratio = best.num_cached_tokens / denom
        if ratio > p.cache_threshold:
            return Pick(best.worker_id, f"prefix match {ratio:.2f} > {p.cache_threshold}", scores)
        c = min(cands, key=lambda c: (c.num_cache_blocks, c.num_pending, c.worker_id))
        return Pick(c.worker_id, f"best match {ratio:.2f} <= {p.cache_threshold}: smallest cache", scores)

    def record(self, pick: Pick) -> None:
        """Stateless: the prefix index learns from KV events, not from picks."""


# ------------------------------------------------------------------ simple policies
class NoParams(_Params):
    pass


class LeastLoaded:
    name = "least-loaded"

    def __init__(self, params: NoParams) -> None:
        self.params = params

    def select(self, ctx: RouteContext) -> Pick:
        if not ctx.candidates:
            return _none("no live candidate", [])
        scores = [Score(c.worker_id, float(c.num_pending), _components(c)) for c in ctx.candidates]
        c = min(ctx.candidates, key=lambda c: (c.num_pending, c.wait_ms + c.queue_ms, c.worker_id))
        return Pick(c.worker_id, f"fewest pending ({c.num_pending})", scores)

    def record(self, pick: Pick) -> None:
        """Stateless."""


class PowerOfTwo:
    name = "power-of-two"

    def __init__(self, params: NoParams) -> None:
        self.params = params

    def select(self, ctx: RouteContext) -> Pick:
        cands = sorted(ctx.candidates, key=lambda c: c.worker_id)
        if not cands:
            return _none("no live candidate", [])
        scores = [Score(c.worker_id, float(c.num_pending), _components(c)) for c in cands]
        if len(cands) == 1:
            return Pick(cands[0].worker_id, "only candidate", scores)
        a, b = ctx.rng.sample(cands, 2)
        c = a if (a.num_pending, a.worker_id) <= (b.num_pending, b.worker_id) else b
        return Pick(c.worker_id, f"fewer pending of {a.worker_id}/{b.worker_id}", scores)

    def record(self, pick: Pick) -> None:
        """Stateless."""


class RoundRobin:
    name = "round-robin"

    def __init__(self, params: NoParams) -> None:
        self.params = params
        self.last_worker_id: str | None = None

    def select(self, ctx: RouteContext) -> Pick:
        if not ctx.candidates:
            return _none("no live candidate", [])
        ids = sorted(c.worker_id for c in ctx.candidates)
        nxt = next((i for i in ids if self.last_worker_id is None or i > self.last_worker_id), ids[0])
        scores = [Score(c.worker_id, 0.0, _components(c)) for c in ctx.candidates]
        return Pick(nxt, f"next after {self.last_worker_id or '(start)'} of {len(ids)}", scores)

    def record(self, pick: Pick) -> None:
        if pick.worker_id is not None:
            self.last_worker_id = pick.worker_id


class RandomPolicy:
    name = "random"

    def __init__(self, params: NoParams) -> None:
        self.params = params

    def select(self, ctx: RouteContext) -> Pick:
        if not ctx.candidates:
            return _none("no live candidate", [])
        ids = sorted(c.worker_id for c in ctx.candidates)
        scores = [Score(c.worker_id, 0.0, _components(c)) for c in ctx.candidates]
        return Pick(ctx.rng.choice(ids), f"uniform of {len(ids)}", scores)

    def record(self, pick: Pick) -> None:
        """Stateless."""


# ------------------------------------------------------------------ kv-aware decode
class KvAwareParams(_Params):
    expected_output_cap: int = 1000  # expected KV = prompt + min(max_tokens, this)
    kv_weight_per_token: float = 0.001  # weight = exp(−this × (kv_used − min kv_used))
    max_kv_usage: float = 0.9  # a worker above this usage is gated (hysteresis below)
    kv_usage_hysteresis: float = 0.15
    load_factor: float = 3.0  # load > factor × average: filtered
    kv_used_factor: float = 3.0  # kv used > factor × average: filtered

    def validate(self) -> "KvAwareParams":
        if self.expected_output_cap < 0 or self.kv_weight_per_token < 0:
            raise ValueError("kv-aware: expected_output_cap and kv_weight_per_token must be >= 0")
        if not 0 < self.max_kv_usage <= 1 or not 0 <= self.kv_usage_hysteresis < 1:
            raise ValueError("kv-aware: max_kv_usage in (0, 1] and kv_usage_hysteresis in [0, 1) required")
        if self.load_factor <= 1 or self.kv_used_factor <= 1:
            raise ValueError("kv-aware: load_factor and kv_used_factor must be > 1")
        return self


class KvAware:
    name = "kv-aware"

    def __init__(self, params: KvAwareParams) -> None:
        self.params = params

    def select(self, ctx: RouteContext) -> Pick:
        p = self.params
        cands = sorted(ctx.candidates, key=lambda c: c.worker_id)
        if not cands:
            return _none("no live candidate", [])
        filtered: dict[str, str] = {}
        avg_load = _avg([c.num_pending for c in cands])
        avg_used = _avg([c.kv_used_tokens for c in cands])
        for c in cands:
            if c.kv_available_tokens < ctx.num_prompt_tokens:
                filtered[c.worker_id] = "kv_available"
            elif c.gated:
                filtered[c.worker_id] = "kv_usage_gate"
            elif avg_load > 0 and c.num_pending > p.load_factor * avg_load:
                filtered[c.worker_id] = "load"
            elif avg_used > 0 and c.kv_used_tokens > p.kv_used_factor * avg_used:
                filtered[c.worker_id] = "kv_used"
        eligible = [c for c in cands if c.worker_id not in filtered]
        min_used = min((c.kv_used_tokens for c in eligible), default=0)
        weights = {c.worker_id: math.exp(-p.kv_weight_per_token * (c.kv_used_tokens - min_used)) for c in eligible}
        scores = [
            Score(c.worker_id, round(weights.get(c.worker_id, 0.0), 6),
                  {"kv_used_tokens": float(c.kv_used_tokens), "kv_available_tokens": float(c.kv_available_tokens),
                   "pending": float(c.num_pending)}, filtered.get(c.worker_id))
            for c in cands
        ]
        if not eligible:
            return _none("every decode candidate filtered", scores)
        total = sum(weights.values())
        x = ctx.rng.random() * total
        acc = 0.0
        chosen = eligible[-1]
        for c in eligible:
            acc += weights[c.worker_id]
            if x < acc:
                chosen = c
                break
        return Pick(chosen.worker_id, f"weighted random (w={weights[chosen.worker_id]:.3f} of {total:.3f})", scores)

    def record(self, pick: Pick) -> None:
        """Stateless: reservations are scheduler state."""


# ------------------------------------------------------------------ registry
@dataclass(frozen=True)
class PolicySpec:
    factory: Callable[[Any], RoutingPolicy]
    params: type


PREFILL_POLICIES: dict[str, PolicySpec] = {
    "cost-based": PolicySpec(CostBased, CostBasedParams),
    "cache-aware": PolicySpec(CacheAware, CacheAwareParams),
    "least-loaded": PolicySpec(LeastLoaded, NoParams),
    "power-of-two": PolicySpec(PowerOfTwo, NoParams),
    "round-robin": PolicySpec(RoundRobin, NoParams),
    "random": PolicySpec(RandomPolicy, NoParams),
}
DECODE_POLICIES: dict[str, PolicySpec] = {
    "kv-aware": PolicySpec(KvAware, KvAwareParams),
    "least-loaded": PolicySpec(LeastLoaded, NoParams),
    "round-robin": PolicySpec(RoundRobin, NoParams),
    "random": PolicySpec(RandomPolicy, NoParams),
}


class UnknownPolicyError(ValueError):
    pass


def build_policy(stage: str, name: str, params: dict[str, Any] | None = None) -> RoutingPolicy:
    """Construct a policy; unknown names, unknown parameters and bad values raise ValueError."""
    table = {"prefill": PREFILL_POLICIES, "decode": DECODE_POLICIES}[stage]
    spec = table.get(name)
    if spec is None:
        raise UnknownPolicyError(f"unknown {stage} policy {name!r}; known: {', '.join(sorted(table))}")
    try:
        typed = msgspec.convert(params or {}, spec.params, strict=False).validate()
    except msgspec.ValidationError as exc:
        raise ValueError(f"{stage} policy {name}: bad parameters: {exc}") from None
    return spec.factory(typed)
