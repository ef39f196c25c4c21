"""Per-prefill-worker batchers: when does a queue of admitted requests become a batch?

One batcher per prefill worker holds the requests routed to it until they leave as a batch
(`poll` -> `PollResult.batches`), or fail (`expired` -> `queue_timeout`, `too_large` ->
`too_large`), or are taken out (`remove`, e.g. a cancel) or handed back (`drain`, at
shutdown or worker expiry: the caller fails each one). Two algorithms, chosen by name
through `build_batcher(name, params, predict_ms)`:

`fixed-window` (FlexLB's default): FIFO in `add` order.
  Dispatch, checked in this order, when
  - "full":      the queue holds `batch_size_max` requests;
  - "capacity":  the next request in FIFO order would break the worker's padded-token cap,
                 so waiting cannot grow the batch (ours, `dispatch_when_capped`; FlexLB
                 waits out the window here);
  - "threshold": the predicted time of the batch that would leave now reaches
                 `predicted_ms_threshold` (when on);
  - "window":    the head has waited `wait_ms`.
  The batch takes requests FIFO while it stays valid (see "Batch shape") and stops at the
  first one that does not fit (no skipping: FIFO is FIFO).

`slo-budget`: ordered by slack, most urgent first.
  slack(item) = deadline - now - predicted prefill of the item alone - load.wait_ms, where
  deadline = min(`deadline_ns`, expiry = `enqueued_ns + enqueue_deadline_ms`), the expiry
  alone when `deadline_ns` is 0 (no SLO: it still may not outwait the enqueue deadline).
  The order key `deadline - predict([item])` (ties by add order) does not depend on `now`
  or the load and is derived on every call, never cached (FlexLB defect 3: a stale sorted
  cache dispatched removed items), so adds, removes and a re-trained predictor are seen at
  once.
  The candidate is the batch that would leave now: greedily, in slack order, under the
  batch-shape caps. Its head must start prefill by
      latest_start = deadline(head) - load.wait_ms - predict(candidate)
  to meet its deadline. Dispatch, checked in this order, when
  - "guard":     now >= latest_start - `guard_ms` (the head cannot wait any longer);
  - "window":    the oldest queued request has waited `window_ms` (bounds the wait of
                 requests with loose or no deadlines);
  - "full":      the candidate holds `batch_size_max` requests;
  - "capacity":  the next request in slack order would break the padded-token cap;
  - "target":    the next arrival is not expected before we must stop waiting. We may wait
                 until X = min(latest_start - guard_ms, oldest + window_ms); the expected
                 gap to the next arrival is max(EMA of inter-arrival times, time since the
                 last arrival) (the current gap is a lower bound of the next one, so a pause
                 in traffic ends the wait at its midpoint instead of at X). Equivalently,
                 target batch size = candidate size + arrivals expected before X; dispatch
                 when the candidate reaches it. With no inter-arrival history yet (fewer
                 than two arrivals) no arrival is expected: dispatch at once.
  As the expected gap is >= 0, "target" comes due no later than "guard" and "window": those
  two name batches whose limit was already past when the state changed (a tight arrival, a
  candidate grown by an arrival, a higher load.wait_ms, a late poll). Expect mostly
  "target" and "full" in the metrics of a healthy worker.
  The batch that leaves is the candidate, cut at the first member that would make the
  predicted batch time exceed the remaining budget (deadline - now - load.wait_ms) of a
  member that can still meet its deadline. Members already late (budget < their own
  predicted time) do not constrain it: when the head is late the batch is filled by the
  caps alone, so an overloaded worker gets full batches instead of a spiral of singletons.
  Backpressure: while the worker has `max_inflight_batches` or more batches inflight,
  nothing leaves except on an "emergency": now >= latest_start - `emergency_guard_ms`.
  We read FlexLB's "guard 40 ms (emergency 150 ms)" this way: under backpressure the
  worker's queue is long and its wait estimate least reliable, so the head breaks through
  with the wider margin. As the deadline is capped by the expiry, a held request breaks
  through before it would expire: under slo-budget, queue_timeout only happens when the
  caller polls later than `next_due_ns` asked (or with a much larger load.wait_ms).

Batch shape (both algorithms). Members are taken while
  - count <= `batch_size_max`;
  - padded tokens: max(num_prompt_tokens) x count <= load.max_batch_tokens (0 or negative:
    no cap);
  - KV: sum of kv_tokens of the members other than the head <= load.free_kv_tokens. The head
    always goes (the engine admits one request even without room; FlexLB does the same),
    so a large request never blocks the queue on KV.
  A request whose prompt alone exceeds load.max_batch_tokens can never be dispatched:
  `poll` fails it as too_large wherever it is in the queue (FlexLB checks only the head; the
  answer is the same, just sooner).
  Several batches may leave in one poll; each later one sees the KV, inflight count and
  wait of the earlier ones (free_kv - their kv_tokens, inflight + 1 each, wait_ms + their
  predicted time).

Expiry (both): a request that has waited `enqueue_deadline_ms` (now >= enqueued_ns +
enqueue_deadline_ms) is returned in `expired`, wherever it is in the queue, backpressure or
not; the caller fails it with `queue_timeout`. `deadline_ns` (the TTFT SLO) alone never
expires a request: a late answer beats an error, and slo-budget already serves it first.

Calling contract
- `add(item)`, then `poll(now_ns, load)` whenever `next_due_ns(now_ns, load)` <= now, after
  each add and whenever the load changes. `load` is the worker as the caller knows it,
  including the batches it has dispatched (inflight count, wait_ms, free KV).
- Until the caller's load shows the batches of the last poll — that is, while
  `next_due_ns` gets a load equal to the one that poll got — the batcher counts them itself
  (a stale load must not make it dispatch past its backpressure limit or misjudge slack).
  `poll` always trusts the load it is given.
- No busy-wait (FlexLB defect 5): right after `poll(now, load)`, `next_due_ns(now, load)`
  is None or > now, and at the time it names a poll makes progress. (Exception: a caller
  that never reports its dispatches may see one poll find nothing, because poll trusts the
  load it is given; the next `next_due_ns` is then later, never a spin.) None means an
  empty queue; a queue held by backpressure still names its next expiry (or, slo-budget,
  its next emergency).
- Nothing is lost (FlexLB defect 4): every item added leaves exactly once, through a batch,
  `expired`, `too_large`, `remove` or `drain`. Items are never taken out "to look at".
- `predict_ms` must be deterministic between two calls that do not retrain it; a NaN,
  infinite or negative prediction raises ValueError (no silent clamping).
- Cost per call: O(n) for fixed-window, O(n log n) and n predictions for slo-budget
  (n <= the per-worker queue bound, 1,024).

Default: `DEFAULT_BATCHER` = fixed-window, FlexLB's default, until a measurement in bench/
says otherwise (changing it is a release-note item: FlexLB defect 15). Its `wait_ms`
default is FlexLB's 300 ms; the values we ship are measured and passed in by the caller.

Parameters and defaults
FixedWindowParams (FlexLB's defaults; its tested high-throughput setting is wait 160 ms,
threshold 500 ms, size 32):
  batch_size_max          8      requests per batch, and the "full" trigger
  wait_ms                 300.0  window: the head waits at most this long
  predicted_ms_threshold  0.0    dispatch when the batch's predicted prefill ms reaches it
                                 (0 = off)
  enqueue_deadline_ms     5000.0 a request waiting longer is expired (queue_timeout)
  max_inflight_batches    0      backpressure: hold while the worker has >= N inflight
                                 batches (0 = off)
  dispatch_when_capped    True   "capacity" trigger (False = FlexLB: wait for the window)
SloBudgetParams (FlexLB's defaults):
  batch_size_max          8      requests per batch
  window_ms               300.0  the oldest request waits at most this long
  guard_ms                40.0   dispatch guard: slack margin at which the head leaves
  emergency_guard_ms      150.0  slack margin at which the head breaks backpressure
  ema_alpha               0.2    weight of the newest gap in the inter-arrival EMA
  max_inflight_batches    2      backpressure (0 = off)
  enqueue_deadline_ms     5000.0 as above; also the deadline of requests without one
  tpot_headroom           0.0    TPOT hold (ours; 0 = off; FlexLB has none; we ship 0.9):
                                 the worker's load carries its predicted decode step now
                                 (load.tpot_ms, from the scheduler's decode model) and what
                                 one more request adds (tpot_ms_per_request + per thousand
                                 prompt tokens). While tpot_ms + the head's addition exceeds
                                 tpot_headroom × the head's tpot_target_ms, the worker is
                                 held like under backpressure: nothing leaves until the load
                                 drops or the head's emergency point, where a head with
                                 strict_deadline (a request that set its own SLO under
                                 reject-explicit, or any under reject) is returned in
                                 `unattainable` (the caller refuses it slo_unattainable)
                                 and any other head leaves as "emergency". tpot_ms 0 (an
                                 idle worker, a prefill-only worker: the hold applies to
                                 workers that decode what they prefill, colocated ones) or a
                                 head without a TPOT target never holds.

`queue_wait_ms(now_ns, load)`: the predicted extra wait a request arriving now would see in
this queue, defined so that load.wait_ms + queue_wait_ms is the time until its batch starts
prefill (cost-based routing adds both): fixed-window: max(predicted ms of the batches ahead
of it, time until its batch's window closes - load.wait_ms); slo-budget: predicted ms of the
batches the queue forms now (its slack decides its place, so all of them conservatively;
slo-budget waits only out of a request's slack, so that wait is not counted).
"""

from __future__ import annotations

import bisect
import math
from itertools import islice
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Generic, NamedTuple, Protocol, Self, TypeVar

import msgspec

NS_PER_MS = 1_000_000


class Batchable(Protocol):
    """What a batcher reads of a queued request (the scheduler's QueuedRequest has these)."""

    @property
    def request_id(self) -> str: ...

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def num_cached_tokens(self) -> int: ...  # predicted prefix hit on this worker

    @property
    def kv_tokens(self) -> int: ...  # KV tokens it needs once the engine admits it

    @property
    def enqueued_ns(self) -> int: ...

    @property
    def deadline_ns(self) -> int: ...  # TTFT deadline (arrival + SLO); 0 = none

    @property
    def tpot_target_ms(self) -> float: ...  # its TPOT target; 0 = none

    @property
    def strict_deadline(self) -> bool: ...  # refused rather than served late (slo-budget's TPOT hold)


T = TypeVar("T", bound=Batchable)

PredictFn = Callable[[Sequence[Batchable]], float]  # predicted prefill ms of a batch on this worker


class WorkerLoad(NamedTuple):
    """What the batcher knows of its worker at poll time (a tuple: built once per candidate
    per routing decision, so it must be cheap)."""

    max_batch_tokens: int  # padded-token cap: max prompt len x batch size <= this (0/negative: no cap)
    free_kv_tokens: int  # KV budget for the non-head members of a batch (the head always goes)
    num_inflight_batches: int  # dispatched to the worker and not yet prefill-completed
    wait_ms: float  # predicted ms until the worker is free of its inflight batches
    # The worker's decode step time now (its TPOT) and what one more request adds to it:
    # per request and per thousand tokens of its context (services/core/decode_model.py).
    # tpot_ms 0: unknown or not a decoding worker (nothing is held for TPOT).
    tpot_ms: float = 0.0
    tpot_ms_per_request: float = 0.0
    tpot_ms_per_kilotoken: float = 0.0


@dataclass(frozen=True)
class Closed(Generic[T]):
    """A batch that left the queue."""

    items: list[T]  # the head first, then in the order taken
    reason: str  # the trigger (module docstring): fixed-window full | capacity | threshold | window;
    # slo-budget guard | window | full | capacity | target | emergency
    predicted_ms: float  # predict_ms(items)


@dataclass(frozen=True)
class PollResult(Generic[T]):
    batches: list[Closed[T]]
    expired: list[T]  # waited enqueue_deadline_ms: the caller fails each with queue_timeout
    too_large: list[T]  # alone over the worker's padded-token cap: the caller fails each with too_large
    # slo-budget: held for the worker's TPOT until its TTFT deadline could no longer be met,
    # and `strict_deadline`: the caller refuses each (slo_unattainable)
    unattainable: list[T] = field(default_factory=list)


class FixedWindowParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`fixed-window` parameters; meanings and defaults in the module docstring."""

    batch_size_max: int = 8
    wait_ms: float = 300.0  # FlexLB's default; the shipped default is chosen by measurement
    predicted_ms_threshold: float = 0.0  # 0 = off
    enqueue_deadline_ms: float = 5000.0
    max_inflight_batches: int = 0  # 0 = off
    dispatch_when_capped: bool = True

    def validate(self) -> Self:
        _require(self.batch_size_max >= 1, "fixed-window", "batch_size_max", self.batch_size_max, ">= 1")
        _require_ms(self.wait_ms, "fixed-window", "wait_ms", allow_zero=True)
        _require_ms(self.predicted_ms_threshold, "fixed-window", "predicted_ms_threshold", allow_zero=True)
        _require_ms(self.enqueue_deadline_ms, "fixed-window", "enqueue_deadline_ms", allow_zero=False)
        _require(self.max_inflight_batches >= 0, "fixed-window", "max_inflight_batches", self.max_inflight_batches,
                 ">= 0 (0 = off)")
        return self


class SloBudgetParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`slo-budget` parameters; meanings and defaults in the module docstring."""

    batch_size_max: int = 8
    window_ms: float = 300.0
    guard_ms: float = 40.0
    emergency_guard_ms: float = 150.0
    ema_alpha: float = 0.2
    max_inflight_batches: int = 2  # 0 = off
    enqueue_deadline_ms: float = 5000.0
    tpot_headroom: float = 0.0  # TPOT hold: 0 = off (module docstring)

    def validate(self) -> Self:
        _require(self.batch_size_max >= 1, "slo-budget", "batch_size_max", self.batch_size_max, ">= 1")
        _require(math.isfinite(self.tpot_headroom) and 0.0 <= self.tpot_headroom <= 1.0, "slo-budget",
                 "tpot_headroom", self.tpot_headroom, "in [0, 1] (0 = off)")
        _require_ms(self.window_ms, "slo-budget", "window_ms", allow_zero=True)
        _require_ms(self.guard_ms, "slo-budget", "guard_ms", allow_zero=True)
        _require_ms(self.emergency_guard_ms, "slo-budget", "emergency_guard_ms", allow_zero=True)
        _require(math.isfinite(self.ema_alpha) and 0.0 < self.ema_alpha <= 1.0, "slo-budget", "ema_alpha",
                 self.ema_alpha, "in (0, 1]")
        _require(self.max_inflight_batches >= 0, "slo-budget", "max_inflight_batches", self.max_inflight_batches,
                 ">= 0 (0 = off)")
        _require_ms(self.enqueue_deadline_ms, "slo-budget", "enqueue_deadline_ms", allow_zero=False)
        return self


def _require(ok: bool, batcher: str, field: str, value: object, rule: str) -> None:
    if not ok:
        raise ValueError(f"{batcher}: {field} must be {rule}, got {value!r}")


def _require_ms(value: float, batcher: str, field: str, *, allow_zero: bool) -> None:
    ok = math.isfinite(value) and (value >= 0 if allow_zero else value > 0)
    _require(ok, batcher, field, value, "a finite number >= 0" if allow_zero else "a finite number > 0")


def _ms_to_ns(ms: float) -> int:
    return round(ms * NS_PER_MS)


def tpot_added_ms(load: WorkerLoad, item: Batchable) -> float:
    """What `item` adds to the worker's step time once it runs (its prompt as its context)."""
    return load.tpot_ms_per_request + load.tpot_ms_per_kilotoken * item.kv_tokens / 1000.0


class Batcher(Protocol[T]):
    """The calling contract is in the module docstring."""

    name: str

    def add(self, item: T) -> int: ...

    def take(self, seq: int) -> T | None: ...

    def poll(self, now_ns: int, load: WorkerLoad) -> PollResult[T]: ...

    def next_due_ns(self, now_ns: int, load: WorkerLoad) -> int | None: ...

    def quiet(self, now_ns: int, max_batch_tokens: int) -> bool: ...  # True: a poll now finds nothing (False: poll)

    def queue_wait_ms(self, now_ns: int, load: WorkerLoad) -> float: ...

    def queue_wait(self, now_ns: int, max_batch_tokens: int, free_kv_tokens: int, wait_ms: float) -> float: ...

    # queue_wait of an empty queue is max(0, this − wait_ms) when not None (the scoring loop
    # skips the call for empty queues); None: call queue_wait.
    empty_queue_window_ms: float | None

    def remove(self, predicate: Callable[[T], bool]) -> list[T]: ...

    def drain(self) -> list[T]: ...

    def __len__(self) -> int: ...


# ------------------------------------------------------------------ shared machinery
@dataclass(frozen=True)
class _OwnDispatches:
    """The batches of the last poll, which a load equal to that poll's does not show yet."""

    load: WorkerLoad | None = None  # the load the last poll was given
    num_batches: int = 0
    kv_tokens: int = 0  # of all their members, heads included
    predicted_ms: float = 0.0
    tpot_ms: float = 0.0  # what its members add to the worker's step time

    def effective(self, load: WorkerLoad) -> WorkerLoad:
        if self.num_batches == 0 or load != self.load:
            return load
        return WorkerLoad(
            max_batch_tokens=load.max_batch_tokens,
            free_kv_tokens=load.free_kv_tokens - self.kv_tokens,
            num_inflight_batches=load.num_inflight_batches + self.num_batches,
            wait_ms=load.wait_ms + self.predicted_ms,
            tpot_ms=load.tpot_ms + self.tpot_ms if load.tpot_ms else 0.0,
            tpot_ms_per_request=load.tpot_ms_per_request,
            tpot_ms_per_kilotoken=load.tpot_ms_per_kilotoken,
        )

    def plus(self, items: Sequence[Batchable], predicted_ms: float, load: WorkerLoad) -> _OwnDispatches:
        return _OwnDispatches(self.load, self.num_batches + 1, self.kv_tokens + sum(i.kv_tokens for i in items),
                              self.predicted_ms + predicted_ms, self.tpot_ms + sum(tpot_added_ms(load, i) for i in items))


class _Shape:
    """The growing shape of one batch, for the cap checks."""

    def __init__(self, head: Batchable) -> None:
        self.count = 1
        self.max_prompt_tokens = head.num_prompt_tokens
        self.non_head_kv_tokens = 0

    def misfit(self, item: Batchable, load: WorkerLoad, batch_size_max: int) -> str | None:
        """The cap `item` would break if added: "size" | "padded" | "kv"; None if it fits."""
        if self.count >= batch_size_max:
            return "size"
        cap = load.max_batch_tokens
        if cap > 0 and max(self.max_prompt_tokens, item.num_prompt_tokens) * (self.count + 1) > cap:
            return "padded"
        if self.non_head_kv_tokens + item.kv_tokens > load.free_kv_tokens:
            return "kv"
        return None

    def add(self, item: Batchable) -> None:
        self.count += 1
        self.max_prompt_tokens = max(self.max_prompt_tokens, item.num_prompt_tokens)
        self.non_head_kv_tokens += item.kv_tokens


def _fill(
    entries: Sequence[tuple[int, T]], load: WorkerLoad, batch_size_max: int,
) -> tuple[list[tuple[int, T]], str | None]:
    """Take entries in order while the caps hold; the first always. Returns the members and
    the cap that stopped it ("size" | "padded" | "kv"), None when the entries ran out."""
    members = [entries[0]]
    shape = _Shape(entries[0][1])
    for entry in entries[1:]:
        misfit = shape.misfit(entry[1], load, batch_size_max)
        if misfit is not None:
            return members, misfit
        shape.add(entry[1])
        members.append(entry)
    return members, None


def _split(entries: Sequence[tuple[int, T]], load: WorkerLoad, batch_size_max: int) -> list[list[T]]:
    """The batches `entries` form back to back, each seeing the KV the earlier ones took."""
    batches: list[list[T]] = []
    rest = list(entries)
    free_kv_tokens = load.free_kv_tokens
    while rest:
        members, _ = _fill(rest, WorkerLoad(load.max_batch_tokens, free_kv_tokens, 0, 0.0), batch_size_max)
        batches.append([item for _, item in members])
        free_kv_tokens -= sum(item.kv_tokens for _, item in members)
        rest = rest[len(members):]
    return batches


@dataclass(frozen=True)
class _Plan:
    reason: str | None  # the trigger that holds now; None: none does
    due_ns: int | None  # when none holds: the earliest time one will (None: not before a change)
    members: list[int]  # with a reason, when asked for: the add sequence numbers of the batch


class _QueueBatcher(Generic[T]):
    """Queue, expiry, too_large, accounting and the poll loop; subclasses plan the batches."""

    name = ""

    empty_queue_window_ms: float | None = None  # (see Batcher)

    def __init__(self, predict_ms: PredictFn, enqueue_deadline_ms: float) -> None:
        self._predict_ms = predict_ms
        self._enqueue_deadline_ns = _ms_to_ns(enqueue_deadline_ms)
        self._items: dict[int, T] = {}  # add sequence number -> item; dict order is add order
        self._next_seq = 0
        self._own = _OwnDispatches()
        # queue_wait_ms is read for every candidate of every routing decision: its O(queue)
        # part is cached under (version, caps). The version moves on EVERY mutation of the
        # queue and on invalidate() (the predictor learned), so the cache is never stale
        # (defect 3 of the original); a test pins each invalidation.
        self._version = 0
        self._wait_cache: tuple[tuple, object] | None = None

    def invalidate(self) -> None:
        """Predictions changed (the predictor learned): drop derived caches."""
        self._version += 1

    def _cached(self, load: WorkerLoad, compute: Callable[[], object]) -> object:
        key = (self._version, load.max_batch_tokens, load.free_kv_tokens)
        if self._wait_cache is None or self._wait_cache[0] != key:
            self._wait_cache = (key, compute())
        return self._wait_cache[1]

    def __len__(self) -> int:
        return len(self._items)

    @property
    def items_view(self) -> Mapping[int, T]:
        """The queue (seq -> item), live and read-only by contract: `len()` of it is the
        cheapest queue length for a hot loop. The dict is never replaced."""
        return self._items

    def add(self, item: T) -> int:
        """Queue `item`; returns its sequence number (for `take`)."""
        seq = self._next_seq
        self._items[seq] = item
        self._next_seq += 1
        self._version += 1
        return seq

    def remove(self, predicate: Callable[[T], bool]) -> list[T]:
        """Take out the queued items matching predicate (e.g. a cancelled request), in add order."""
        keys = [seq for seq, item in self._items.items() if predicate(item)]  # predicate errors leave the queue intact
        return self._take(keys)

    def take(self, seq: int) -> T | None:
        """Take out the item `add` numbered `seq` (O(1)); None if it already left."""
        if seq not in self._items:
            return None
        return self._take([seq])[0]

    def _take(self, keys: list[int]) -> list[T]:
        if keys:
            self._version += 1
        return [self._items.pop(seq) for seq in keys]

    def drain(self) -> list[T]:
        """Every queued item, in add order; the queue is empty after. The caller fails each one."""
        items = list(self._items.values())
        self._items.clear()
        self._version += 1
        return items

    def poll(self, now_ns: int, load: WorkerLoad) -> PollResult[T]:
        """All or nothing: if it raises (a broken prediction), the queue is as it was."""
        saved_items, saved_own = dict(self._items), self._own
        values = self._items.values()
        try:
            # (Scans only when one can find something: a poll that changes nothing leaves the
            # version, and so the queue-shape cache, alone.)
            cap = load.max_batch_tokens
            too_large = (self.remove(lambda item: self._is_too_large(item, load))
                         if values and cap > 0 and max(i.num_prompt_tokens for i in values) > cap else [])
            expired = (self.remove(lambda item: now_ns >= self._expiry_ns(item))
                       if values and min(i.enqueued_ns for i in values) + self._enqueue_deadline_ns <= now_ns else [])
            self._own = _OwnDispatches(load=load)
            batches: list[Closed[T]] = []
            unattainable: list[T] = []
            while self._items:
                plan = self._plan(now_ns, self._own.effective(load), with_members=True)
                if plan.reason is None:
                    break
                self._version += 1
                items = [self._items.pop(seq) for seq in plan.members]
                if plan.reason == "unattainable":  # held past its deadline: the caller refuses it
                    unattainable.extend(items)
                    continue
                predicted_ms = self._predict(items)
                self._own = self._own.plus(items, predicted_ms, load)
                batches.append(Closed(items, plan.reason, predicted_ms))
        except Exception as exc:  # a broken prediction: put everything back, then fail loudly
            self._version += 1
            self._items.clear()  # restored in place: the scheduler holds a reference to the dict
            self._items.update(saved_items)
            self._own = saved_own  # nothing taken out is lost
            raise exc
        return PollResult(batches, expired, too_large, unattainable)

    def quiet(self, now_ns: int, max_batch_tokens: int) -> bool:
        """True only when a poll now is sure to find nothing (a cheap check before building the
        load); this algorithm has no such check: poll."""
        return False

    def next_due_ns(self, now_ns: int, load: WorkerLoad) -> int | None:
        if not self._items:
            return None
        if any(self._is_too_large(item, load) for item in self._items.values()):
            return now_ns
        due_ns = min(self._expiry_ns(item) for item in self._items.values())
        plan = self._plan(now_ns, self._own.effective(load), with_members=False)
        if plan.reason is not None:
            return min(due_ns, now_ns)
        return due_ns if plan.due_ns is None else min(due_ns, plan.due_ns)

    # -- helpers for subclasses
    def _plan(self, now_ns: int, load: WorkerLoad, *, with_members: bool) -> _Plan:
        raise NotImplementedError

    def _predict(self, items: Sequence[T]) -> float:
        ms = self._predict_ms(items)
        if not (math.isfinite(ms) and ms >= 0):
            raise ValueError(f"{self.name}: predict_ms returned {ms!r} for a batch of {len(items)}; "
                             "a prediction must be a finite number >= 0")
        return ms

    def _expiry_ns(self, item: T) -> int:
        return item.enqueued_ns + self._enqueue_deadline_ns

    @staticmethod
    def _is_too_large(item: Batchable, load: WorkerLoad) -> bool:
        return 0 < load.max_batch_tokens < item.num_prompt_tokens

    @staticmethod
    def _is_held(load: WorkerLoad, max_inflight_batches: int) -> bool:
        return max_inflight_batches > 0 and load.num_inflight_batches >= max_inflight_batches


# ------------------------------------------------------------------ fixed-window
class FixedWindowBatcher(_QueueBatcher[T]):
    name = "fixed-window"

    def __init__(self, params: FixedWindowParams, predict_ms: PredictFn) -> None:
        self.params = params.validate()
        super().__init__(predict_ms, params.enqueue_deadline_ms)
        self._wait_ns = _ms_to_ns(params.wait_ms)
        self._shape: _QueueShape | None = None  # the queue's batches, for queue_wait_ms (kept incrementally)
        self._batch_size_max = params.batch_size_max
        self._whole_window_ms = 0.0 if params.batch_size_max == 1 else params.wait_ms
        self.empty_queue_window_ms = self._whole_window_ms  # (queue_wait's rule for an empty queue)
        self._quiet: tuple[int, int, int | None] = (-1, 0, None)  # (version, padded cap, quiet until), see quiet()

    def _plan(self, now_ns: int, load: WorkerLoad, *, with_members: bool) -> _Plan:
        p = self.params
        if self._is_held(load, p.max_inflight_batches):
            return _Plan(None, None, [])
        window_due_ns = self._only_window_due_ns(load.max_batch_tokens)
        if window_due_ns is not None and now_ns < window_due_ns:
            return _Plan(None, window_due_ns, [])
        entries = list(islice(self._items.items(), p.batch_size_max + 1))  # all _fill can look at
        members, stop = _fill(entries, load, p.batch_size_max)
        window_due_ns = entries[0][1].enqueued_ns + self._wait_ns
        if len(self._items) >= p.batch_size_max:
            reason: str | None = "full"
        elif p.dispatch_when_capped and stop == "padded":
            reason = "capacity"
        elif p.predicted_ms_threshold > 0 and self._predict([i for _, i in members]) >= p.predicted_ms_threshold:
            reason = "threshold"
        elif now_ns >= window_due_ns:
            reason = "window"
        else:
            return _Plan(None, window_due_ns, [])
        return _Plan(reason, now_ns, [seq for seq, _ in members] if with_members else [])

    def add(self, item: T) -> int:
        fresh = self._shape is not None and self._shape.version == self._version
        seq = super().add(item)
        if fresh:
            try:
                self._shape.extend(((seq, item),))
                self._shape.version = self._version
            except ValueError:  # a broken prediction: drop the shape; queue_wait_ms rebuilds it (and raises there)
                self._shape = None
        return seq

    def _take(self, keys: list[int]) -> list[T]:
        fresh = bool(keys) and self._shape is not None and self._shape.version == self._version
        taken = super()._take(keys)
        if fresh:
            try:
                self._shape.remove(set(keys))
                self._shape.version = self._version
            except ValueError:  # as in add
                self._shape = None
        return taken

    def _only_window_due_ns(self, max_batch_tokens: int) -> int | None:
        """When only the window can fire (not full, no threshold, the padded cap cannot stop a
        batch: longest prompt × queue length within it), the head's window end; else None
        (the full plan decides). The fast path of `_plan` and `quiet`."""
        p, items = self.params, self._items
        n = len(items)
        if not items or n >= p.batch_size_max or p.predicted_ms_threshold > 0:
            return None
        if (max_batch_tokens > 0 and max(i.num_prompt_tokens for i in items.values())
                * (n if p.dispatch_when_capped else 1) > max_batch_tokens):
            return None
        return next(iter(items.values())).enqueued_ns + self._wait_ns

    def quiet(self, now_ns: int, max_batch_tokens: int) -> bool:
        """True when a poll at `now_ns` would find nothing, whatever the rest of the load: only
        a window that has not ended could fire, and nothing expires (a too-large item makes
        the padded check fail). The scheduler asks this of every non-empty batcher on every
        tick before it builds the worker's load; the time bound is cached per queue version
        and padded cap, so a quiet batcher costs a comparison. Like a poll that finds
        nothing, it forgets the last poll's own dispatches (the load shows them by now)."""
        version, cap, until = self._quiet
        if version != self._version or cap != max_batch_tokens:
            due_ns = self._only_window_due_ns(max_batch_tokens)
            if due_ns is not None:
                expiry_ns = min(i.enqueued_ns for i in self._items.values()) + self._enqueue_deadline_ns
                until = due_ns if due_ns < expiry_ns else expiry_ns
            else:
                until = None
            self._quiet = (self._version, max_batch_tokens, until)
        if until is None or now_ns >= until:
            return False
        if self._own.num_batches:
            self._own = _OwnDispatches()  # (with no batches, effective() ignores the load it holds)
        return True

    def poll(self, now_ns: int, load: WorkerLoad) -> PollResult[T]:
        """A poll that can find nothing returns at once (see `quiet`)."""
        if self.quiet(now_ns, load.max_batch_tokens):
            return PollResult([], [], [])
        return super().poll(now_ns, load)

    def queue_wait_ms(self, now_ns: int, load: WorkerLoad) -> float:
        return self.queue_wait(now_ns, load.max_batch_tokens, load.free_kv_tokens, load.wait_ms)

    def queue_wait(self, now_ns: int, max_batch_tokens: int, free_kv_tokens: int, wait_ms: float) -> float:
        """queue_wait_ms with the load's fields as arguments: the routing hot path (once per
        candidate per decision) — O(1) while the queue shape is fresh."""
        sh = self._shape
        if (sh is None or sh.version != self._version or sh.max_batch_tokens != max_batch_tokens
                or not sh.kv_lo <= free_kv_tokens <= sh.kv_hi):
            sh = self._shape = _QueueShape(list(self._items.items()), max_batch_tokens, free_kv_tokens,
                                           self.params.batch_size_max, self._predict)
            sh.version = self._version
        last = sh.last
        if last is None or last.shape.count >= self._batch_size_max:  # a newcomer heads a batch: a whole window
            if last is not None:
                sh.close_predict(last)
            ahead_ms = 0.0 if last is None else last.predicted_ms_before + last.predicted_ms
            window_ms = self._whole_window_ms
        else:  # it joins the last batch
            ahead_ms = last.predicted_ms_before
            if last.shape.count + 1 >= self._batch_size_max:
                window_ms = 0.0  # it fills the batch it joins
            else:
                window_ns = last.entries[0][1].enqueued_ns + self._wait_ns - now_ns
                window_ms = window_ns / NS_PER_MS if window_ns > 0 else 0.0
        window_ms -= wait_ms
        if window_ms > ahead_ms:
            return window_ms
        return ahead_ms if ahead_ms > 0.0 else 0.0


class _PlannedBatch:
    """One batch of a `_QueueShape`, with running totals of the batches before it."""

    __slots__ = ("entries", "shape", "kv_before", "kv_tokens", "predicted_ms", "is_predicted", "kv_break",
                 "predicted_ms_before", "kv_break_before")

    def __init__(self, head: tuple[int, Batchable], before: "_PlannedBatch | None") -> None:
        self.entries = [head]
        self.shape = _Shape(head[1])
        self.kv_tokens = head[1].kv_tokens  # of all its members
        self.predicted_ms = 0.0
        self.is_predicted = False
        self.kv_break = _NO_KV_LIMIT  # free KV from which the entry that closed it would have fit
        if before is None:
            self.kv_before = 0  # KV tokens of every member of the batches before it
            self.predicted_ms_before = 0.0  # Σ predicted ms of the batches before it
            self.kv_break_before = _NO_KV_LIMIT  # min kv_break of the batches before it
        else:
            self.kv_before = before.kv_before + before.kv_tokens
            self.predicted_ms_before = before.predicted_ms_before + before.predicted_ms
            self.kv_break_before = min(before.kv_break_before, before.kv_break)


_NO_KV_LIMIT = 1 << 62


class _QueueShape:
    """The batches a FIFO queue forms back to back (what `_split` computes), for fixed-window's
    queue-wait estimate, kept incrementally: an add extends the last batch or opens one (O(1)
    plus one prediction); a remove re-places the entries from the first batch it touched on
    (O(suffix)). Anything else (a poll, a drain, invalidate, another padded cap) rebuilds it.
    It is exact for every free-KV value in [kv_lo, kv_hi]: the same batches form for all of
    them. kv_lo is the last batch's need (needs never decrease along the queue); kv_hi is
    where the first KV-closed batch would have taken the entry that closed it."""

    __slots__ = ("version", "max_batch_tokens", "free_kv_tokens", "batch_size_max", "batches", "_predict", "last",
                 "kv_lo", "kv_hi")

    def __init__(self, entries: list[tuple[int, Batchable]], max_batch_tokens: int, free_kv_tokens: int,
                 batch_size_max: int, predict: Callable[[Sequence[Batchable]], float]) -> None:
        self.version = -1
        self.max_batch_tokens = max_batch_tokens
        self.free_kv_tokens = free_kv_tokens
        self.batch_size_max = batch_size_max
        self.batches: list[_PlannedBatch] = []
        self._predict = predict
        self.extend(entries)

    def _refresh(self) -> None:
        last = self.last = self.batches[-1] if self.batches else None
        self.kv_lo = 0 if last is None else last.kv_before + last.shape.non_head_kv_tokens
        self.kv_hi = _NO_KV_LIMIT - 1 if last is None else min(last.kv_break_before, last.kv_break) - 1

    def close_predict(self, b: _PlannedBatch) -> None:
        if not b.is_predicted:
            b.predicted_ms = self._predict([item for _, item in b.entries])
            b.is_predicted = True

    def extend(self, entries: Sequence[tuple[int, Batchable]]) -> None:
        """Place entries at the end, by the fill rule of `_fill`."""
        batches = self.batches
        for entry in entries:
            item = entry[1]
            last = batches[-1] if batches else None
            if last is not None:
                shape = last.shape
                if shape.count >= self.batch_size_max:
                    fits = False
                elif (self.max_batch_tokens > 0
                      and max(shape.max_prompt_tokens, item.num_prompt_tokens) * (shape.count + 1) > self.max_batch_tokens):
                    fits = False
                elif shape.non_head_kv_tokens + item.kv_tokens > self.free_kv_tokens - last.kv_before:
                    last.kv_break = last.kv_before + shape.non_head_kv_tokens + item.kv_tokens
                    fits = False
                else:
                    fits = True
                if fits:
                    shape.add(item)
                    last.entries.append(entry)
                    last.kv_tokens += item.kv_tokens
                    last.is_predicted = False
                    continue
                self.close_predict(last)
            batches.append(_PlannedBatch(entry, last))
        self._refresh()  # (the last batch is predicted lazily: a newcomer that joins it does not need it)

    def remove(self, seqs: set[int]) -> None:
        last = self.last
        if last is not None and min(seqs) > last.entries[0][0]:
            # Only non-head members of the last batch: the rest still fits under every cap
            # (fewer members), and no batch comes after it. Rebuild just its totals.
            entries = last.entries = [e for e in last.entries if e[0] not in seqs]
            shape = last.shape = _Shape(entries[0][1])
            kv = entries[0][1].kv_tokens
            for _, item in entries[1:]:
                shape.add(item)
                kv += item.kv_tokens
            last.kv_tokens = kv
            last.is_predicted = False
            self._refresh()
            return
        # Batch heads are in add order: the first touched batch holds the smallest seq.
        first = bisect.bisect_right(self.batches, min(seqs), key=lambda b: b.entries[0][0]) - 1
        if first < 0:  # (cannot happen while fresh: every queued seq is in some batch)
            return
        # Re-place everything from that batch on; extend offers the first of them to the batch
        # before, which may take it now that the head that closed it is gone.
        rest = [e for b in self.batches[first:] for e in b.entries if e[0] not in seqs]
        del self.batches[first:]
        if self.batches:
            self.batches[-1].kv_break = _NO_KV_LIMIT  # what closed it is being re-placed
        self.extend(rest)


# ------------------------------------------------------------------ slo-budget
class SloBudgetBatcher(_QueueBatcher[T]):
    name = "slo-budget"

    def __init__(self, params: SloBudgetParams, predict_ms: PredictFn) -> None:
        self.params = params.validate()
        super().__init__(predict_ms, params.enqueue_deadline_ms)
        self._window_ns = _ms_to_ns(params.window_ms)
        self._guard_ns = _ms_to_ns(params.guard_ms)
        self._emergency_guard_ns = _ms_to_ns(params.emergency_guard_ms)
        self._last_arrival_ns: int | None = None  # latest enqueued_ns seen by add
        self._inter_arrival_ema_ns: float | None = None  # None until two arrivals

    @property
    def inter_arrival_ema_ms(self) -> float | None:
        """The EMA of the gaps between arrivals (enqueued_ns of added items), for explain."""
        return None if self._inter_arrival_ema_ns is None else self._inter_arrival_ema_ns / NS_PER_MS

    def add(self, item: T) -> int:
        seq = super().add(item)
        t_ns = item.enqueued_ns
        if self._last_arrival_ns is not None:
            gap_ns = max(0, t_ns - self._last_arrival_ns)  # out-of-order arrivals count as a burst
            ema = self._inter_arrival_ema_ns
            a = self.params.ema_alpha
            self._inter_arrival_ema_ns = float(gap_ns) if ema is None else a * gap_ns + (1 - a) * ema
            t_ns = max(t_ns, self._last_arrival_ns)
        self._last_arrival_ns = t_ns
        return seq

    def _deadline_ns(self, item: T) -> int:
        """The request's TTFT deadline, or its expiry when that comes first (or it has none)."""
        expiry_ns = self._expiry_ns(item)
        return min(item.deadline_ns, expiry_ns) if item.deadline_ns > 0 else expiry_ns

    def _ordered(self) -> list[tuple[int, T]]:
        """Most urgent first: by deadline - predicted prefill alone (the now- and
        load-independent part of slack), then add order. Derived on every call."""
        keyed = [(self._deadline_ns(item) - _ms_to_ns(self._predict([item])), seq, item)
                 for seq, item in self._items.items()]
        keyed.sort(key=lambda k: (k[0], k[1]))
        return [(seq, item) for _, seq, item in keyed]

    def _plan(self, now_ns: int, load: WorkerLoad, *, with_members: bool) -> _Plan:
        p = self.params
        entries = self._ordered()
        candidate, stop = _fill(entries, load, p.batch_size_max)
        latest_start_ns = (self._deadline_ns(entries[0][1]) - _ms_to_ns(load.wait_ms)
                           - _ms_to_ns(self._predict([i for _, i in candidate])))
        head = entries[0][1]
        tpot_full = (p.tpot_headroom > 0 and load.tpot_ms > 0 and head.tpot_target_ms > 0
                     and load.tpot_ms + tpot_added_ms(load, head) > p.tpot_headroom * head.tpot_target_ms)
        if tpot_full or self._is_held(load, p.max_inflight_batches):
            emergency_due_ns = latest_start_ns - self._emergency_guard_ns
            if now_ns < emergency_due_ns:
                return _Plan(None, emergency_due_ns, [])
            if tpot_full and head.strict_deadline:  # its TTFT or everyone's TPOT: refused
                return _Plan("unattainable", now_ns, [entries[0][0]] if with_members else [])
            reason = "emergency"
        else:
            guard_due_ns = latest_start_ns - self._guard_ns
            window_due_ns = min(item.enqueued_ns for item in self._items.values()) + self._window_ns
            target_due_ns = self._target_due_ns(min(guard_due_ns, window_due_ns), now_ns)
            if now_ns >= guard_due_ns:
                reason = "guard"
            elif now_ns >= window_due_ns:
                reason = "window"
            elif len(candidate) >= p.batch_size_max:
                reason = "full"
            elif stop == "padded":
                reason = "capacity"
            elif now_ns >= target_due_ns:
                reason = "target"
            else:
                return _Plan(None, min(guard_due_ns, window_due_ns, target_due_ns), [])
        return _Plan(reason, now_ns, self._members(entries, now_ns, load) if with_members else [])

    def _target_due_ns(self, stop_waiting_ns: int, now_ns: int) -> int:
        """When the next arrival is no longer expected before `stop_waiting_ns` (X):
        X - t <= max(ema, t - last_arrival), i.e. t >= X - ema or t >= (X + last) / 2."""
        if self._inter_arrival_ema_ns is None or self._last_arrival_ns is None:
            return now_ns  # no history: no arrival expected
        by_ema_ns = stop_waiting_ns - round(self._inter_arrival_ema_ns)
        by_pause_ns = -((-(stop_waiting_ns + self._last_arrival_ns)) // 2)  # ceil
        return min(by_ema_ns, by_pause_ns)

    def _members(self, entries: list[tuple[int, T]], now_ns: int, load: WorkerLoad) -> list[int]:
        """The candidate, cut where the batch would make a member that can still meet its
        deadline miss it (see the module docstring)."""
        wait_ns = _ms_to_ns(load.wait_ms)

        def budget_ns(item: T) -> int | None:  # None: already late, it does not constrain the batch
            budget = self._deadline_ns(item) - now_ns - wait_ns
            return None if _ms_to_ns(self._predict([item])) > budget else budget

        head = entries[0][1]
        members = [head]
        seqs = [entries[0][0]]
        shape = _Shape(head)
        budget = budget_ns(head)
        for seq, item in entries[1:]:
            if shape.misfit(item, load, self.params.batch_size_max) is not None:
                break
            own = budget_ns(item)
            new_budget = own if budget is None else budget if own is None else min(budget, own)
            if new_budget is not None and _ms_to_ns(self._predict([*members, item])) > new_budget:
                break
            shape.add(item)
            members.append(item)
            seqs.append(seq)
            budget = new_budget
        return seqs

    def queue_wait_ms(self, now_ns: int, load: WorkerLoad) -> float:
        # Slack order does not depend on the load (see _ordered), so (version, caps) is the key.
        return self._cached(load, lambda: sum(self._predict(b) for b in _split(self._ordered(), load, self.params.batch_size_max)))

    def queue_wait(self, now_ns: int, max_batch_tokens: int, free_kv_tokens: int, wait_ms: float) -> float:
        return self.queue_wait_ms(now_ns, WorkerLoad(max_batch_tokens, free_kv_tokens, 0, wait_ms))


# ------------------------------------------------------------------ registry
@dataclass(frozen=True)
class BatcherSpec:
    params_type: type[FixedWindowParams] | type[SloBudgetParams]
    factory: Callable[[Any, PredictFn], Batcher[Any]]


BATCHERS: Mapping[str, BatcherSpec] = MappingProxyType({
    "fixed-window": BatcherSpec(FixedWindowParams, FixedWindowBatcher),
    "slo-budget": BatcherSpec(SloBudgetParams, SloBudgetBatcher),
})

# FlexLB's default, kept until a measurement (bench/) says otherwise; changing it is a
# release-note item (FlexLB defect 15: a silently changed default broke deployments).
DEFAULT_BATCHER = "fixed-window"


def _spec(name: str) -> BatcherSpec:
    spec = BATCHERS.get(name)
    if spec is None:
        raise ValueError(f"unknown batcher {name!r}; known: {', '.join(sorted(BATCHERS))}")
    return spec


def default_params(name: str) -> FixedWindowParams | SloBudgetParams:
    """The default parameters of batcher `name` (ValueError for an unknown name)."""
    return _spec(name).params_type().validate()


def build_batcher(
    name: str, params: Mapping[str, Any] | msgspec.Struct | None, predict_ms: PredictFn,
) -> Batcher[Any]:
    """A batcher by name. `params`: a mapping (unknown keys and wrong types are rejected), a
    params struct of that batcher, or None for the defaults. Every error is a ValueError
    naming the batcher and the field."""
    return _spec(name).factory(parse_params(name, params), predict_ms)


def parse_params(name: str, params: Mapping[str, Any] | msgspec.Struct | None) -> FixedWindowParams | SloBudgetParams:
    """Batcher `name`'s validated parameters (build_batcher's rules)."""
    spec = _spec(name)
    parsed: FixedWindowParams | SloBudgetParams
    if params is None:
        parsed = spec.params_type()
    elif isinstance(params, spec.params_type):
        parsed = params
    elif isinstance(params, Mapping):
        try:
            parsed = msgspec.convert(dict(params), spec.params_type)
        except msgspec.ValidationError as e:
            raise ValueError(f"{name}: invalid parameters: {e}") from None
    else:
        raise ValueError(f"{name}: parameters must be a mapping or {spec.params_type.__name__}, "
                         f"got {type(params).__name__}")
    return parsed.validate()
