"""What the batchers share: the queue, the poll loop and the batch-shape rules (protocol.py).

`QueueBatcher` keeps the queue (add sequence number -> item, in add order), expires and
refuses items, counts its own dispatches until the caller's load shows them
(`OwnDispatches`), and runs the poll loop: it asks the algorithm's `_plan(now, load)` for
the next batch until none is due. A poll is all or nothing: if a prediction raises, the queue
is restored and the error propagates. `queue_wait_ms` results are cached under a version
that moves on every queue mutation and on `invalidate()`, so a cached value is never stale.
`BatchShape`, `fill_batch` and `split_batches` apply the shape caps; `require`/`require_ms`
validate parameters, naming the batcher and the field.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic

from services.core.batchers.protocol import Batchable, Closed, PollResult, PredictFn, T, WorkerLoad

NS_PER_MS = 1_000_000


def require(ok: bool, batcher: str, field: str, value: object, rule: str) -> None:
    if not ok:
        raise ValueError(f"{batcher}: {field} must be {rule}, got {value!r}")


def require_ms(value: float, batcher: str, field: str, *, allow_zero: bool) -> None:
    ok = math.isfinite(value) and (value >= 0 if allow_zero else value > 0)
    require(ok, batcher, field, value, "a finite number >= 0" if allow_zero else "a finite number > 0")


def ms_to_ns(ms: float) -> int:
    return round(ms * NS_PER_MS)


def tpot_added_ms(load: WorkerLoad, item: Batchable) -> float:
    """What `item` adds to the worker's step time once it runs (its prompt as its context)."""
    return load.tpot_ms_per_request + load.tpot_ms_per_kilotoken * item.kv_tokens / 1000.0



@dataclass(frozen=True)
class OwnDispatches:
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
            stall_limits=load.stall_limits,
        )

    def plus(self, items: Sequence[Batchable], predicted_ms: float, load: WorkerLoad) -> OwnDispatches:
        return OwnDispatches(self.load, self.num_batches + 1, self.kv_tokens + sum(i.kv_tokens for i in items),
                              self.predicted_ms + predicted_ms, self.tpot_ms + sum(tpot_added_ms(load, i) for i in items))


class BatchShape:
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


def fill_batch(
    entries: Sequence[tuple[int, T]], load: WorkerLoad, batch_size_max: int,
) -> tuple[list[tuple[int, T]], str | None]:
    """Take entries in order while the caps hold; the first always. Returns the members and
    the cap that stopped it ("size" | "padded" | "kv"), None when the entries ran out."""
    members = [entries[0]]
    shape = BatchShape(entries[0][1])
    for entry in entries[1:]:
        misfit = shape.misfit(entry[1], load, batch_size_max)
        if misfit is not None:
            return members, misfit
        shape.add(entry[1])
        members.append(entry)
    return members, None


def split_batches(entries: Sequence[tuple[int, T]], load: WorkerLoad, batch_size_max: int) -> list[list[T]]:
    """The batches `entries` form back to back, each seeing the KV the earlier ones took."""
    batches: list[list[T]] = []
    rest = list(entries)
    free_kv_tokens = load.free_kv_tokens
    while rest:
        members, _ = fill_batch(rest, WorkerLoad(load.max_batch_tokens, free_kv_tokens, 0, 0.0), batch_size_max)
        batches.append([item for _, item in members])
        free_kv_tokens -= sum(item.kv_tokens for _, item in members)
        rest = rest[len(members):]
    return batches


@dataclass(frozen=True)
class Plan:
    reason: str | None  # the trigger that holds now; None: none does
    due_ns: int | None  # when none holds: the earliest time one will (None: not before a change)
    members: list[int]  # with a reason, when asked for: the add sequence numbers of the batch


class QueueBatcher(Generic[T]):
    """Queue, expiry, too_large, accounting and the poll loop; subclasses plan the batches."""

    name = ""

    empty_queue_window_ms: float | None = None  # (see Batcher)

    def __init__(self, predict_ms: PredictFn, enqueue_deadline_ms: float) -> None:
        self._predict_ms = predict_ms
        self._enqueue_deadline_ns = ms_to_ns(enqueue_deadline_ms)
        self._items: dict[int, T] = {}  # add sequence number -> item; dict order is add order
        self._next_seq = 0
        self._own = OwnDispatches()
        # queue_wait_ms is read for every candidate of every routing decision: its O(queue)
        # part is cached under (version, caps). The version moves on EVERY mutation of the
        # queue and on invalidate() (the predictor learned), so the cache is never stale;
        # tests/unit/services/core/test_batchers.py pins each invalidation.
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
            self._own = OwnDispatches(load=load)
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
    def _plan(self, now_ns: int, load: WorkerLoad, *, with_members: bool) -> Plan:
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
