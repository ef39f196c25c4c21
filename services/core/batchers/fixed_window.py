"""`fixed-window`: FIFO batches that leave when full, capped, over a predicted time, or when the
head has waited a window. The core's default batcher (SchedulerConfig.batcher).

Queue order: `add` order. A batch takes requests FIFO while it keeps the batch shape
(protocol.py) and stops at the first one that does not fit (no skipping). It leaves when,
checked in this order:
- "full":      the queue holds `batch_size_max` requests;
- "capacity":  the next request in FIFO order would break the worker's padded-token cap, so
               waiting cannot grow the batch (`dispatch_when_capped`; off: wait for the window);
- "threshold": the predicted time of the batch that would leave now reaches
               `predicted_ms_threshold` (when > 0);
- "window":    the head has waited `wait_ms`.
Backpressure: while the worker has `max_inflight_batches` or more batches inflight (when > 0),
nothing leaves; expiry still applies.

`queue_wait_ms`: max(predicted ms of the batches ahead of a newcomer, time until the window of
the batch it would join closes − load.wait_ms); a newcomer that fills its batch waits no
window. The batches the queue forms are kept incrementally (`_QueueShape`), so the routing hot
path pays O(1) per candidate while the queue is unchanged.

Parameters (`FixedWindowParams`, defaults; FlexLB's):
  batch_size_max          8      requests per batch, and the "full" trigger
  wait_ms                 300.0  window: the head waits at most this long
  predicted_ms_threshold  0.0    dispatch when the batch's predicted prefill ms reaches it (0 = off)
  enqueue_deadline_ms     5000.0 a request waiting longer is expired (queue_timeout)
  max_inflight_batches    0      backpressure: hold while the worker has >= N inflight batches (0 = off)
  dispatch_when_capped    True   the "capacity" trigger
The router ships other values (services/settings.py; README, "Defaults, and the numbers that
chose them").
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from itertools import islice
from typing import Self

import msgspec

from services.core.batchers.base import (
    NS_PER_MS,
    BatchShape,
    OwnDispatches,
    Plan,
    QueueBatcher,
    fill_batch,
    ms_to_ns,
    require,
    require_ms,
)
from services.core.batchers.protocol import Batchable, HoldParams, PollResult, PredictFn, T, WorkerLoad


class FixedWindowParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`fixed-window` parameters (meanings: module docstring)."""

    batch_size_max: int = 8
    wait_ms: float = 300.0
    predicted_ms_threshold: float = 0.0  # 0 = off
    enqueue_deadline_ms: float = 5000.0
    max_inflight_batches: int = 0  # 0 = off
    dispatch_when_capped: bool = True

    def hold(self) -> HoldParams:
        return HoldParams()  # no TPOT hold

    def validate(self) -> Self:
        require(self.batch_size_max >= 1, "fixed-window", "batch_size_max", self.batch_size_max, ">= 1")
        require_ms(self.wait_ms, "fixed-window", "wait_ms", allow_zero=True)
        require_ms(self.predicted_ms_threshold, "fixed-window", "predicted_ms_threshold", allow_zero=True)
        require_ms(self.enqueue_deadline_ms, "fixed-window", "enqueue_deadline_ms", allow_zero=False)
        require(self.max_inflight_batches >= 0, "fixed-window", "max_inflight_batches", self.max_inflight_batches,
                 ">= 0 (0 = off)")
        return self



class FixedWindowBatcher(QueueBatcher[T]):
    name = "fixed-window"

    def __init__(self, params: FixedWindowParams, predict_ms: PredictFn) -> None:
        self.params = params.validate()
        super().__init__(predict_ms, params.enqueue_deadline_ms)
        self._wait_ns = ms_to_ns(params.wait_ms)
        self._shape: _QueueShape | None = None  # the queue's batches, for queue_wait_ms (kept incrementally)
        self._batch_size_max = params.batch_size_max
        self._whole_window_ms = 0.0 if params.batch_size_max == 1 else params.wait_ms
        self.empty_queue_window_ms = self._whole_window_ms  # (queue_wait's rule for an empty queue)
        self._quiet: tuple[int, int, int | None] = (-1, 0, None)  # (version, padded cap, quiet until), see quiet()

    def _plan(self, now_ns: int, load: WorkerLoad, *, with_members: bool) -> Plan:
        p = self.params
        if self._is_held(load, p.max_inflight_batches):
            return Plan(None, None, [])
        window_due_ns = self._only_window_due_ns(load.max_batch_tokens)
        if window_due_ns is not None and now_ns < window_due_ns:
            return Plan(None, window_due_ns, [])
        entries = list(islice(self._items.items(), p.batch_size_max + 1))  # all fill_batch can look at
        members, stop = fill_batch(entries, load, p.batch_size_max)
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
            return Plan(None, window_due_ns, [])
        return Plan(reason, now_ns, [seq for seq, _ in members] if with_members else [])

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
            self._own = OwnDispatches()  # (with no batches, effective() ignores the load it holds)
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
        self.shape = BatchShape(head[1])
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
    """The batches a FIFO queue forms back to back (what `split_batches` computes), for fixed-window's
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
        """Place entries at the end, by the fill rule of `fill_batch`."""
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
            shape = last.shape = BatchShape(entries[0][1])
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

