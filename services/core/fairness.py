"""The admission queue under overload: priority classes served by strict priority with a
starvation bound, tenants within a class by weighted fair share of tokens (VTC).

Pure: every call takes `now_ns`; no clock, no asyncio, no RNG. The router (not wired yet)
offers each request it cannot hand to an engine at once, and calls `pop(now_ns, can_take)`
whenever the engines have room (what they can run plus a small buffer). Every call returns
records (`Queued`, `Refused`, `Dispatched`, `Settled`, `Cancelled`) that say what happened
and why, so the shell can journal them; the same calls with the same `now_ns` give the same
records (ties go by arrival order), so a replay of the journal re-derives them.

Classes. `critical` > `standard` > `sheddable`. The existing numeric priority (1-100,
default 50, the SLO multiplier's input in slo.py) maps by bands: 70-100 critical (the
tightest SLO multiplier, 0.5, starts at 70), 30-69 standard, 1-29 sheddable (below the
loosest multiplier's point, 30: work whose client already said it can wait).
`class_of_priority` does the mapping; a request may also name its class directly.

Strict priority with a starvation bound. `pop` serves the highest class with queued work,
except that a lower class that has been backlogged and unserved for more than
`starvation_bound_ms` (default 5,000 ms) is served once first (the starved class whose wait is
longest; within it the tenant VTC picks, see below). The class's clock restarts at that
dispatch, so a lower class gets at least one dispatch per bound while backlogged, and higher
classes keep everything else: with the default, critical work loses at most two dispatches
per 5 s to lower classes. Why 5 s: longer than every default TTFT target at the standard
priority (the largest bucket is 2,400 ms), so the bound acts only when a lower class is
already far past its SLO, not as a second scheduler; short enough that a lower class makes
visible progress well inside a client's usual 30-60 s timeout instead of timing out behind a
critical burst. Why the class's clock and not each request's age: under a long critical
burst every lower-class request soon exceeds any bound; serving "every request older than
the bound" would then be FCFS, and critical would lose its priority altogether.

VTC within a class (Sheng et al., OSDI'24, "Fairness in Serving Large Language Models").
Each tenant has a virtual counter per class: the service it has received, in cost tokens
(input + `w_out` x output) divided by its weight. `pop` serves the backlogged tenant with the
smallest counter (ties: a tenant just lifted, below, first; else the tenant whose head
request arrived first), its oldest request.
- Charged at dispatch with the prompt and the estimated output (the request's `max_tokens`
  or the caller's estimate); corrected by `settle(dispatched, actual_output_tokens)` when the
  real output is known (the difference x `w_out` / weight). Every dispatched request should
  be settled once (0 output tokens when it failed before producing any).
- No banked credit: a tenant that becomes backlogged in a class after idling has its counter
  lifted to the smallest counter of the class's backlogged tenants (or, when none is
  backlogged, to the counter of the last tenant that left the backlog), as VTC does. Lifted
  beside backlogged tenants (its counter was below theirs), it wins the tie at the floor for
  its first dispatch: VTC leaves ties open, and by arrival the backlogged tenant's older
  head would go first, so the returning tenant waited one more of its requests (one slot
  free: measured, bench/CORE.md "Fair admission behind the router"). A credit of one tie:
  its counter is the floor's, and rises by its request's cost like any.
- Bound (VTC's, and the property test's): without settle corrections, the counters of a
  class's backlogged tenants stay within one request's cost (the largest cost / weight) of
  each other; settle corrections move a counter by the estimate's error on top of that.
- `w_out` default 2.0: one output token costs about twice an input token on the fleets this
  router serves (decode is memory bound, one token per step per sequence; prefill runs a
  whole prompt per step), which is also VTC's evaluation setting (w_p = 1, w_q = 2) and the
  ratio of most providers' output to input prices.
- Weights per tenant (`tenant_weights`, default `default_weight` 1.0): a tenant with weight
  4 gets four times the cost tokens of a weight-1 tenant while both are backlogged.

Bounds. `max_queued_per_class` (critical, standard, sheddable; default 1,024 each),
`max_queued_per_tenant` (default 256, per class: one tenant's burst fills its own share, not
the class, so a quiet tenant beside it is still queued) and `max_queued_total` (default
2,048, all classes). An offer over its tenant's or its class's limit is refused
`queue_full`. An offer that finds the total full is queued anyway when it is critical or
standard and a sheddable request is queued: the newest sheddable request is evicted and
refused `shed`. A sheddable offer that finds the total full is refused `shed`; any other
is refused `queue_full`. `max_queue_wait_ms` (critical, standard, sheddable; default 60,000,
60,000, 30,000 ms): `expire(now_ns)` refuses `queue_timeout` every request that has waited
longer. Why: without it a full sheddable queue is served one request per starvation bound,
so what it holds waits for hours (bench/fairness.py measured a 10-minute p99 before this
bound existed); a client has long given up by then (60 s is the usual gateway and
load-balancer idle timeout), and a refusal with Retry-After tells it so. Sheddable work, the
first to give way, gets half. Every refusal carries `retry_after_ms` (default 1,000 ms, the
`Retry-After` hint; the router may replace it with its own drain estimate).
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field
from typing import Literal, Mapping

PriorityClass = Literal["critical", "standard", "sheddable"]
RefusalCode = Literal["queue_full", "shed", "queue_timeout"]
CLASSES: tuple[PriorityClass, ...] = ("critical", "standard", "sheddable")  # highest first
_RANK = {c: i for i, c in enumerate(CLASSES)}

# Numeric priority bands (1-100): at or above CRITICAL_MIN_PRIORITY critical, below
# SHEDDABLE_BELOW_PRIORITY sheddable, standard in between (why: the module docstring).
CRITICAL_MIN_PRIORITY = 70
SHEDDABLE_BELOW_PRIORITY = 30
DEFAULT_PRIORITY = 50


# The numeric priorities of each class: (lowest, highest), the bands class_of_priority reads.
CLASS_BANDS: dict[str, tuple[int, int]] = {"critical": (CRITICAL_MIN_PRIORITY, 100),
                                           "standard": (SHEDDABLE_BELOW_PRIORITY, CRITICAL_MIN_PRIORITY - 1),
                                           "sheddable": (1, SHEDDABLE_BELOW_PRIORITY - 1)}


def class_of_priority(priority: int | None) -> PriorityClass:
    """The class of a numeric priority (1-100; None is the default, 50: standard)."""
    p = DEFAULT_PRIORITY if priority is None else priority
    if not 1 <= p <= 100:
        raise ValueError(f"priority must be 1-100, got {p}")
    if p >= CRITICAL_MIN_PRIORITY:
        return "critical"
    if p < SHEDDABLE_BELOW_PRIORITY:
        return "sheddable"
    return "standard"


@dataclass(frozen=True, kw_only=True)
class FairnessParams:
    """The queue's parameters (meaning and why of each default: the module docstring)."""

    w_out: float = 2.0  # cost of one output token, in input tokens
    starvation_bound_ms: float = 5_000.0  # a backlogged lower class is served once per this, at least
    max_queued_per_class: tuple[int, int, int] = (1_024, 1_024, 1_024)  # critical, standard, sheddable
    max_queued_per_tenant: int = 256  # per tenant per class
    max_queued_total: int = 2_048  # all classes
    max_queue_wait_ms: tuple[float, float, float] = (60_000.0, 60_000.0, 30_000.0)  # critical, standard, sheddable
    retry_after_ms: int = 1_000  # the hint every refusal carries
    default_weight: float = 1.0
    tenant_weights: Mapping[str, float] = field(default_factory=dict)  # tenant -> weight

    def __post_init__(self) -> None:
        if self.w_out < 0:
            raise ValueError(f"fairness w_out must be >= 0, got {self.w_out}")
        if self.starvation_bound_ms <= 0:
            raise ValueError(f"fairness starvation_bound_ms must be > 0, got {self.starvation_bound_ms}")
        if len(self.max_queued_per_class) != len(CLASSES) or any(n < 1 for n in self.max_queued_per_class):
            raise ValueError(f"fairness max_queued_per_class must be three limits >= 1, got {self.max_queued_per_class}")
        if self.max_queued_per_tenant < 1 or self.max_queued_total < 1:
            raise ValueError("fairness max_queued_per_tenant and max_queued_total must be >= 1")
        if len(self.max_queue_wait_ms) != len(CLASSES) or any(not w > 0 for w in self.max_queue_wait_ms):
            raise ValueError(f"fairness max_queue_wait_ms must be three waits > 0, got {self.max_queue_wait_ms}")
        if self.retry_after_ms < 0:
            raise ValueError(f"fairness retry_after_ms must be >= 0, got {self.retry_after_ms}")
        bad = {t: w for t, w in self.tenant_weights.items() if not w > 0}
        if not self.default_weight > 0 or bad:
            raise ValueError(f"fairness weights must be > 0: default {self.default_weight}, {bad}")

    def weight_of(self, tenant: str) -> float:
        return self.tenant_weights.get(tenant, self.default_weight)


@dataclass(frozen=True, kw_only=True, slots=True)
class FairRequest:
    """A request as the queue sees it."""

    request_id: str
    tenant: str
    priority_class: PriorityClass
    num_input_tokens: int
    num_est_output_tokens: int  # charged at dispatch; settle() corrects it
    payload: object = None  # the shell's handle; the queue never looks inside


@dataclass(frozen=True, kw_only=True, slots=True)
class Refused:
    request_id: str
    priority_class: PriorityClass
    tenant: str
    code: RefusalCode
    retry_after_ms: int
    reason: str  # which limit, in words
    request: FairRequest


@dataclass(frozen=True, kw_only=True, slots=True)
class Queued:
    request_id: str
    priority_class: PriorityClass
    tenant: str
    num_queued_in_class: int  # after this one
    evicted: Refused | None = None  # the sheddable request it pushed out, refused `shed`


@dataclass(frozen=True, kw_only=True, slots=True)
class Dispatched:
    request: FairRequest
    priority_class: PriorityClass
    tenant: str
    reason: Literal["priority", "starvation"]  # highest backlogged class, or a starved lower one
    counter_before: float  # the tenant's virtual counter in its class (cost tokens / weight)
    counter_after: float
    cost_tokens: float  # input + w_out x estimated output (before the weight)
    weight: float
    waited_ns: int  # offer to dispatch

    @property
    def request_id(self) -> str:
        return self.request.request_id


@dataclass(frozen=True, kw_only=True, slots=True)
class Settled:
    request_id: str
    priority_class: PriorityClass
    tenant: str
    counter_before: float
    counter_after: float
    correction_tokens: float  # w_out x (actual - estimated output), before the weight


@dataclass(frozen=True, kw_only=True, slots=True)
class Cancelled:
    request_id: str
    priority_class: PriorityClass
    tenant: str
    waited_ns: int


@dataclass(slots=True)
class _Entry:
    request: FairRequest
    seq: int  # arrival order (ties)
    offered_ns: int
    is_gone: bool = False  # dispatched, evicted, expired or cancelled (left in `arrivals` until it reaches an end)


@dataclass(slots=True)
class _ClassQueue:
    request_id_to_entry: dict[str, _Entry] = field(default_factory=dict)  # queued ones
    # Arrival order, for expiry and eviction; gone ones are dropped lazily at either end (so it
    # holds at most what arrived within the class's max_queue_wait_ms).
    arrivals: deque[_Entry] = field(default_factory=deque)
    tenant_to_queue: dict[str, deque[_Entry]] = field(default_factory=dict)  # backlogged tenants only
    tenant_to_counter: dict[str, float] = field(default_factory=dict)  # cost tokens / weight, every tenant seen
    heap: list[tuple[float, int, str]] = field(default_factory=list)  # (counter, head seq, tenant); stale ones skipped
    last_left_counter: float = 0.0  # counter of the last tenant whose backlog emptied
    backlogged_since_ns: int = 0  # starvation clock: max(first queued, last dispatch) while backlogged
    lifted: set[str] = field(default_factory=set)  # back from idle beside others, not served since: win ties


def _tie(cq: _ClassQueue, tenant: str) -> int:
    """A tenant's tie-break among equal counters: its head's arrival, or 0 (first) while it is
    lifted (`_enqueue`)."""
    return 0 if tenant in cq.lifted else cq.tenant_to_queue[tenant][0].seq


class FairQueue:
    """The admission queue (algorithm, invariants and parameters: the module docstring).

    Calling contract: `offer` each request once; `expire` then `pop` whenever the engines
    have room (and `expire` now and then while they have none); `settle` each dispatched
    request once its real output is known; `cancel` a queued request whose client left.
    Every request offered ends in exactly one `Refused` (at offer, later as an evicted
    sheddable, or expired), `Dispatched` or `Cancelled`.
    """

    def __init__(self, params: FairnessParams | None = None) -> None:
        self.params = params or FairnessParams()
        self._classes = {c: _ClassQueue() for c in CLASSES}
        self._seq = 0
        self._num_queued = 0

    # -- reads (no side effects) --

    def num_queued(self, priority_class: PriorityClass | None = None) -> int:
        if priority_class is None:
            return self._num_queued
        return len(self._classes[priority_class].request_id_to_entry)

    def num_queued_of(self, tenant: str, priority_class: PriorityClass) -> int:
        q = self._classes[priority_class].tenant_to_queue.get(tenant)
        return len(q) if q else 0

    def counters(self, priority_class: PriorityClass) -> dict[str, float]:
        """tenant -> virtual counter (cost tokens / weight) in that class."""
        return dict(self._classes[priority_class].tenant_to_counter)

    def backlogged_tenants(self, priority_class: PriorityClass) -> list[str]:
        return list(self._classes[priority_class].tenant_to_queue)

    def cost_tokens(self, num_input_tokens: int, num_output_tokens: int) -> float:
        return num_input_tokens + self.params.w_out * num_output_tokens

    # -- commands --

    def offer(self, request: FairRequest, now_ns: int) -> Queued | Refused:
        p = self.params
        c = request.priority_class
        cq = self._classes[c]
        if request.request_id in cq.request_id_to_entry:
            raise ValueError(f"request {request.request_id} is already queued")
        if self.num_queued_of(request.tenant, c) >= p.max_queued_per_tenant:
            return self._refuse(request, "queue_full", f"tenant {request.tenant} has {p.max_queued_per_tenant} queued in {c}")
        limit = p.max_queued_per_class[_RANK[c]]
        if len(cq.request_id_to_entry) >= limit:
            return self._refuse(request, "queue_full", f"class {c} has {limit} queued")
        evicted = None
        if self._num_queued >= p.max_queued_total:
            if c == "sheddable":
                return self._refuse(request, "shed", f"{p.max_queued_total} queued in all classes; sheddable is refused first")
            shed_q = self._classes["sheddable"]
            if not shed_q.request_id_to_entry:
                return self._refuse(request, "queue_full", f"{p.max_queued_total} queued in all classes, none sheddable")
            victim = self._newest(shed_q)
            self._remove(shed_q, victim)
            evicted = self._refuse(victim.request, "shed", f"evicted by {c} request {request.request_id}: the queue was full")
        self._enqueue(cq, request, now_ns)
        return Queued(request_id=request.request_id, priority_class=c, tenant=request.tenant,
                      num_queued_in_class=len(cq.request_id_to_entry), evicted=evicted)

    def pop(self, now_ns: int, can_take: int) -> list[Dispatched]:
        """Up to `can_take` requests, in the order the engines should get them."""
        out: list[Dispatched] = []
        bound_ns = int(self.params.starvation_bound_ms * 1e6)
        while len(out) < can_take and self._num_queued:
            top = next(c for c in CLASSES if self._classes[c].request_id_to_entry)
            chosen, reason = top, "priority"
            longest = None
            for c in CLASSES[_RANK[top] + 1:]:
                cq = self._classes[c]
                if cq.request_id_to_entry and now_ns - cq.backlogged_since_ns > bound_ns:
                    if longest is None or cq.backlogged_since_ns < longest[0]:
                        longest = (cq.backlogged_since_ns, c)
            if longest is not None:
                chosen, reason = longest[1], "starvation"
            out.append(self._dispatch(chosen, reason, now_ns))
        return out

    def settle(self, dispatched: Dispatched, actual_output_tokens: int) -> Settled:
        """Correct the counter charged at dispatch by the real output."""
        if actual_output_tokens < 0:
            raise ValueError(f"actual_output_tokens must be >= 0, got {actual_output_tokens}")
        req = dispatched.request
        cq = self._classes[dispatched.priority_class]
        correction = self.params.w_out * (actual_output_tokens - req.num_est_output_tokens)
        before = cq.tenant_to_counter[req.tenant]
        after = before + correction / dispatched.weight
        cq.tenant_to_counter[req.tenant] = after
        q = cq.tenant_to_queue.get(req.tenant)
        if q:  # its heap entry is stale now
            heapq.heappush(cq.heap, (after, _tie(cq, req.tenant), req.tenant))
        return Settled(request_id=req.request_id, priority_class=dispatched.priority_class, tenant=req.tenant,
                       counter_before=before, counter_after=after, correction_tokens=correction)

    def expire(self, now_ns: int) -> list[Refused]:
        """Refuse `queue_timeout` every queued request that has waited more than its class's
        `max_queue_wait_ms` (oldest first, classes highest first). Call it before `pop`."""
        out: list[Refused] = []
        for c, max_wait_ms in zip(CLASSES, self.params.max_queue_wait_ms):
            cq = self._classes[c]
            oldest_ok_ns = now_ns - int(max_wait_ms * 1e6)
            while True:
                entry = self._oldest(cq)
                if entry is None or entry.offered_ns >= oldest_ok_ns:
                    break
                self._remove(cq, entry)
                out.append(self._refuse(entry.request, "queue_timeout",
                                        f"waited {(now_ns - entry.offered_ns) / 1e6:.0f} ms in {c}, over {max_wait_ms:.0f} ms"))
        return out

    def cancel(self, request_id: str, priority_class: PriorityClass, now_ns: int) -> Cancelled | None:
        """Take a queued request out (its client left); None when it is not queued."""
        cq = self._classes[priority_class]
        entry = cq.request_id_to_entry.get(request_id)
        if entry is None:
            return None
        self._remove(cq, entry)
        return Cancelled(request_id=request_id, priority_class=priority_class, tenant=entry.request.tenant,
                         waited_ns=now_ns - entry.offered_ns)

    # -- internals --

    def _refuse(self, request: FairRequest, code: RefusalCode, reason: str) -> Refused:
        return Refused(request_id=request.request_id, priority_class=request.priority_class, tenant=request.tenant,
                       code=code, retry_after_ms=self.params.retry_after_ms, reason=reason, request=request)

    def _enqueue(self, cq: _ClassQueue, request: FairRequest, now_ns: int) -> None:
        self._seq += 1
        entry = _Entry(request, self._seq, now_ns)
        if not cq.request_id_to_entry:
            cq.backlogged_since_ns = now_ns
        cq.request_id_to_entry[request.request_id] = entry
        cq.arrivals.append(entry)
        self._num_queued += 1
        tenant = request.tenant
        q = cq.tenant_to_queue.get(tenant)
        if q is not None:
            q.append(entry)
            return
        # The tenant becomes backlogged: lift its counter (no banked credit). Lifted to the floor
        # beside backlogged tenants, it wins the tie with the one at the floor (whose head is
        # older) for its first dispatch: served next, not after one more of theirs.
        floor = min((cq.tenant_to_counter[t] for t in cq.tenant_to_queue), default=cq.last_left_counter)
        own = cq.tenant_to_counter.get(tenant)
        counter = max(own if own is not None else floor, floor)
        if cq.tenant_to_queue and (own if own is not None else 0.0) < floor:  # (really lifted: served less)
            cq.lifted.add(tenant)
        cq.tenant_to_counter[tenant] = counter
        cq.tenant_to_queue[tenant] = deque((entry,))
        heapq.heappush(cq.heap, (counter, _tie(cq, tenant), tenant))

    def _remove(self, cq: _ClassQueue, entry: _Entry) -> None:
        """Take a queued entry out without serving it (eviction, cancel)."""
        req = entry.request
        del cq.request_id_to_entry[req.request_id]
        entry.is_gone = True
        self._num_queued -= 1
        q = cq.tenant_to_queue[req.tenant]
        was_head = q[0] is entry
        q.remove(entry)
        if not q:
            self._leave(cq, req.tenant)
        elif was_head:
            heapq.heappush(cq.heap, (cq.tenant_to_counter[req.tenant], _tie(cq, req.tenant), req.tenant))

    @staticmethod
    def _oldest(cq: _ClassQueue) -> _Entry | None:
        while cq.arrivals and cq.arrivals[0].is_gone:
            cq.arrivals.popleft()
        return cq.arrivals[0] if cq.arrivals else None

    @staticmethod
    def _newest(cq: _ClassQueue) -> _Entry:
        while cq.arrivals[-1].is_gone:
            cq.arrivals.pop()
        return cq.arrivals[-1]

    def _leave(self, cq: _ClassQueue, tenant: str) -> None:
        del cq.tenant_to_queue[tenant]
        cq.lifted.discard(tenant)
        cq.last_left_counter = cq.tenant_to_counter[tenant]

    def _dispatch(self, c: PriorityClass, reason: Literal["priority", "starvation"], now_ns: int) -> Dispatched:
        cq = self._classes[c]
        while True:  # skip stale heap entries: counter or head changed since pushed, or tenant idle
            counter, seq, tenant = cq.heap[0]
            q = cq.tenant_to_queue.get(tenant)
            if q and _tie(cq, tenant) == seq and cq.tenant_to_counter[tenant] == counter:
                break
            heapq.heappop(cq.heap)
        heapq.heappop(cq.heap)
        if len(cq.heap) > 4 * len(cq.tenant_to_queue) + 64:  # settles left many stale entries: rebuild
            cq.heap = [(cq.tenant_to_counter[t], _tie(cq, t), t) for t in cq.tenant_to_queue if t != tenant]
            heapq.heapify(cq.heap)
        entry = q.popleft()
        entry.is_gone = True
        cq.lifted.discard(tenant)
        req = entry.request
        del cq.request_id_to_entry[req.request_id]
        self._num_queued -= 1
        weight = self.params.weight_of(tenant)
        cost = self.cost_tokens(req.num_input_tokens, req.num_est_output_tokens)
        after = counter + cost / weight
        cq.tenant_to_counter[tenant] = after
        if q:
            heapq.heappush(cq.heap, (after, _tie(cq, tenant), tenant))
        else:
            self._leave(cq, tenant)
        cq.backlogged_since_ns = now_ns  # the class was just served: its starvation clock restarts
        return Dispatched(request=req, priority_class=c, tenant=tenant, reason=reason, counter_before=counter,
                          counter_after=after, cost_tokens=cost, weight=weight, waited_ns=now_ns - entry.offered_ns)
