"""The batcher contract: when does a prefill worker's queue of admitted requests become a batch?

One batcher per prefill worker holds the requests routed to it until they leave, each
exactly once: as a batch (`poll` -> `PollResult.batches`), failed (`expired` -> the caller's
`queue_timeout`, `too_large` -> `too_large`, slo-budget's `unattainable` ->
`slo_unattainable`), taken out (`take`/`remove`, e.g. a cancel) or handed back (`drain`, at
shutdown or worker expiry: the caller fails each one). Items are never taken out "to look at".
The algorithms (fixed_window.py, slo_budget.py) decide only when a batch leaves and who is in it.

Batch shape (every algorithm). Members are taken while
- count <= `batch_size_max`;
- padded tokens: max(num_prompt_tokens) × count <= load.max_batch_tokens (0 or negative: no cap);
- KV: the kv_tokens of the members other than the head sum to <= load.free_kv_tokens. The
  head always goes (an engine admits one request even without room), so a large request
  never blocks the queue on KV.
A request whose prompt alone exceeds load.max_batch_tokens can never be dispatched: `poll`
fails it as too_large wherever it is in the queue. Several batches may leave in one poll;
each later one sees the KV, inflight count and wait of the earlier ones (free_kv − their
kv_tokens, inflight + 1 each, wait_ms + their predicted time).

Expiry. A request that has waited `enqueue_deadline_ms` (now >= enqueued_ns +
enqueue_deadline_ms) is returned in `expired`, wherever it is in the queue, backpressure or
not. `deadline_ns` (the TTFT target) alone never expires a request: a late answer beats an
error.

Calling contract
- `add(item)`, then `poll(now_ns, load)` whenever `next_due_ns(now_ns, load)` <= now, after
  each add and whenever the load changes. `load` is the worker as the caller knows it,
  including the batches it has dispatched (inflight count, wait_ms, free KV).
- Until the caller's load shows the batches of the last poll (while `next_due_ns` gets a load
  equal to the one that poll got) the batcher counts them itself, so a stale load cannot
  make it dispatch past its backpressure limit or misjudge slack. `poll` trusts its load.
- No busy-wait: right after `poll(now, load)`, `next_due_ns(now, load)` is None or > now,
  and at the time it names a poll makes progress. (A caller that never reports its
  dispatches may see one poll find nothing, as poll trusts the load it is given; the next
  `next_due_ns` is then later, never a spin.) None means an empty queue; a queue held by
  backpressure still names its next expiry (slo-budget: its next emergency).
- `quiet(now_ns, max_batch_tokens)`: True only when a poll now is sure to find nothing (a
  cheap check before the caller builds the load); False means "poll".
- `invalidate()`: the predictions changed (the worker's predictor learned): the batcher
  drops what it derived from them. `items_view`: the queue (seq -> item), live and
  read-only, for the caller's hot loops.
- `predict_ms` must be deterministic between two calls that do not retrain it; a NaN,
  infinite or negative prediction raises ValueError (no silent clamping), and a poll that
  raises leaves the queue as it was.
- Cost per call: O(n) for fixed-window, O(n log n) and n predictions for slo-budget
  (n <= the per-worker queue bound, `SchedulerConfig.max_queue_per_worker`, 1,024).

`queue_wait_ms(now_ns, load)`: the predicted extra wait of a request arriving now, defined so
that load.wait_ms + queue_wait_ms is the time until its batch starts prefill (cost-based
routing adds both). `queue_wait` is the same with the load's fields as arguments (the
routing hot path), and `empty_queue_window_ms` lets the caller skip it for an empty queue.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, NamedTuple, Protocol, TypeVar


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


class HoldParams(NamedTuple):
    """What the scheduler reads of a batcher's TPOT hold (slo-budget's; every field 0: none,
    fixed-window's): the hold's headroom, a moved request's TTFT margin (the batcher's guard),
    how a held head is resolved (services/core/scheduler.py `_resolve_held`), and whether the
    load carries the stall limits."""

    tpot_headroom: float = 0.0
    guard_ms: float = 0.0
    tpot_refuse_ratio: float = 0.0
    give_way_tpot_ratio: float = 0.0
    give_way_prefill_ratio: float = 0.0
    give_way_cheap_tpot_ratio: float = 0.0
    stall_hold: float = 0.0


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
    # Its decoding requests' tolerance to a prefill stall now: (ms of stall one can absorb
    # within its TPOT target, ms until it finishes), one pair per request (slo-budget's stall hold).
    stall_limits: tuple[tuple[float, float], ...] = ()


@dataclass(frozen=True)
class Closed(Generic[T]):
    """A batch that left the queue."""

    items: list[T]  # the head first, then in the order taken
    reason: str  # the trigger (fixed_window.py, slo_budget.py): fixed-window full | capacity | threshold | window;
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



class Batcher(Protocol[T]):
    """One prefill worker's queue (calling contract: module docstring)."""

    name: str  # its kebab-case registry name

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

    def remove(self, predicate: Callable[[T], bool]) -> list[T]: ...  # the matching items, in add order

    def invalidate(self) -> None: ...  # predictions changed (the predictor learned): drop derived caches

    @property
    def items_view(self) -> Mapping[int, T]: ...  # the queue, seq -> item: live, read-only by contract

    def drain(self) -> list[T]: ...  # every queued item, in add order; the queue is empty after

    def __len__(self) -> int: ...

