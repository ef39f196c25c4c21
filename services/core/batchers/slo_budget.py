"""`slo-budget`: batches ordered by slack that wait for more arrivals only as long as their
most urgent member's TTFT target allows.

slack(item) = deadline − now − predicted prefill of the item alone − load.wait_ms, where
deadline = min(`deadline_ns`, expiry = `enqueued_ns` + `enqueue_deadline_ms`), the expiry
alone when `deadline_ns` is 0 (no target: it still may not outwait the enqueue deadline).
Queue order: by `deadline − predict([item])` (ties: add order), which does not depend on now
or the load; it is derived on every call, never cached, so adds, removes and a re-trained
predictor are seen at once.

The candidate is the batch that would leave now: greedily, in slack order, under the batch
shape (protocol.py). Its head must start prefill by
    latest_start = deadline(head) − load.wait_ms − predict(candidate)
to meet its deadline. It leaves when, checked in this order:
- "guard":    now >= latest_start − `guard_ms` (the head cannot wait any longer);
- "window":   the oldest queued request has waited `window_ms` (bounds the wait of requests
              with loose or no deadlines);
- "full":     the candidate holds `batch_size_max` requests;
- "capacity": the next request in slack order would break the padded-token cap;
- "target":   the next arrival is not expected before we must stop waiting. We may wait until
              X = min(latest_start − guard_ms, oldest + window_ms); the expected gap to the next
              arrival is max(EMA of inter-arrival times, time since the last arrival) (the
              current gap bounds the next one from below, so a pause in traffic ends the wait
              at its midpoint instead of at X). With fewer than two arrivals seen, no arrival is
              expected: dispatch at once.
As the expected gap is >= 0, "target" comes due no later than "guard" and "window": those two
name batches whose limit was already past when the state changed (a tight arrival, a
candidate grown by an arrival, a higher load.wait_ms, a late poll). A healthy worker shows
mostly "target" and "full".

The batch that leaves is the candidate cut at the first member that would make the predicted
batch time exceed the remaining budget (deadline − now − load.wait_ms) of a member that can
still meet its deadline. Members already late do not constrain it: when the head is late the
batch is filled by the caps alone, so an overloaded worker gets full batches instead of a
spiral of singletons.

Backpressure: while the worker has `max_inflight_batches` or more batches inflight, nothing
leaves except on an "emergency": now >= latest_start − `emergency_guard_ms` (a wider margin
than the guard: under backpressure the worker's queue is long and its wait estimate least
reliable). As the deadline is capped by the expiry, a held request breaks through before it
would expire: queue_timeout happens only when the caller polls later than `next_due_ns` asked.

TPOT hold (`tpot_headroom` > 0): the load carries the worker's predicted decode step now
(load.tpot_ms, from the scheduler's decode model) and what one more request adds
(tpot_ms_per_request + tpot_ms_per_kilotoken per thousand prompt tokens). While tpot_ms + the
head's addition exceeds tpot_headroom × the head's `tpot_target_ms`, the worker is held as
under backpressure: nothing leaves until the load drops or the head's emergency point, where
a head with `strict_deadline` (its SLO mode refuses rather than serves late) is returned in
`unattainable` and any other head leaves as "emergency". The caller decides what becomes of an
unattainable head (the scheduler: moved to a worker that can serve it, given way to, or refused
slo_unattainable only when no worker could serve it within `tpot_refuse_ratio` x its TPOT
target; services/core/scheduler.py `_resolve_held`): one it gives back non-strict leaves here
as "emergency" at the next poll. The load's TPOT figures are calibrated by what the worker's
requests actually got (services/core/decode_model.py), so the headroom is a fraction of the
TPOT they will see, not of a step time. tpot_ms 0 (an idle or prefill-only worker) or a head
without a TPOT target never holds.

Stall hold (`stall_hold` > 0): the load also carries, per request the worker is decoding, the
stall it can absorb within its TPOT target and the ms until it is expected to finish
(load.stall_limits: services/core/scheduler.py `_stall_limits`). Where the worker is not held,
the candidate waits while `stall_hold` x (load.wait_ms + its predicted prefill), the stall it
puts on those requests, exceeds what one of them can absorb, until the last such one is
expected to finish, and never past its guard (the hold spends TTFT slack, never the TTFT
target), and only while the worker's TPOT with the head is within `stall_hold_headroom` x the
head's TPOT target (nearer it, the TPOT hold needs that slack). A short answer has almost
none to spare: one long prompt landing in its few steps makes it miss TPOT, and the prompt
loses nothing by starting a few of its steps later.

`queue_wait_ms`: the predicted ms of the batches the queue forms now (a newcomer's slack
decides its place, so all of them, conservatively; its own waiting comes out of its slack
and is not counted).

Parameters (`SloBudgetParams`, defaults):
  batch_size_max          8      requests per batch
  window_ms               300.0  the oldest request waits at most this long
  guard_ms                40.0   slack margin at which the head leaves
  emergency_guard_ms      150.0  slack margin at which the head breaks backpressure
  ema_alpha               0.2    weight of the newest gap in the inter-arrival EMA
  max_inflight_batches    2      backpressure (0 = off)
  enqueue_deadline_ms     5000.0 as fixed-window's; also the deadline of requests without one
  tpot_headroom           0.0    the TPOT hold, in [0, 1] (0 = off)
  tpot_refuse_ratio       0.0    a strict head held to its emergency point that no worker can take
                                 without holding it is served where its TPOT is within this x its
                                 target, refused only beyond (0: refused)
  give_way_tpot_ratio     0.0    ... and only while the TPOT the worker's finished requests
                                 recently got is within this x the target; beyond, refused (0: not
                                 checked)
  give_way_prefill_ratio  0.0    a held head that would be refused is served on its worker anyway
                                 when it is cheap there: its predicted prefill (its uncached part)
                                 within this x its TPOT target (the stall it puts on the worker's
                                 running decodes, in their tokens) ... (0: off)
  give_way_cheap_tpot_ratio 0.0  ... and its TPOT predicted there within this x its target (0: none is)
  stall_hold              0.0    the stall hold: the factor on the stall a batch puts on its worker's
                                 decoding requests (0 = off)
  stall_hold_headroom     1.0    ... only while the worker's TPOT with the head is within this x its
                                 target, in (0, 1]
The router ships window_ms 1000, tpot_headroom 0.9, tpot_refuse_ratio 1.2, give_way_tpot_ratio 0.9,
give_way_prefill_ratio 1.5, give_way_cheap_tpot_ratio 0.95, stall_hold 1.0 and stall_hold_headroom 0.8 (services/settings.py; README,
"Defaults, and the numbers that chose them").
"""

from __future__ import annotations

import math
from typing import Self

import msgspec

from services.core.batchers.base import (
    NS_PER_MS,
    BatchShape,
    Plan,
    QueueBatcher,
    fill_batch,
    ms_to_ns,
    require,
    require_ms,
    split_batches,
    tpot_added_ms,
)
from services.core.batchers.protocol import HoldParams, PredictFn, T, WorkerLoad


class SloBudgetParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`slo-budget` parameters (meanings: module docstring)."""

    batch_size_max: int = 8
    window_ms: float = 300.0
    guard_ms: float = 40.0
    emergency_guard_ms: float = 150.0
    ema_alpha: float = 0.2
    max_inflight_batches: int = 2  # 0 = off
    enqueue_deadline_ms: float = 5000.0
    tpot_headroom: float = 0.0  # TPOT hold: 0 = off (module docstring)
    # A strict head held to its emergency point and not moved (Scheduler._resolve_held) is served
    # where its TPOT is within this x its target, refused only beyond. 0: refused.
    tpot_refuse_ratio: float = 0.0
    # ... and only while the TPOT the worker's finished requests recently got is within this x
    # the target (0: not checked).
    give_way_tpot_ratio: float = 0.0
    # A head that would be refused is served on its worker when it is cheap there: its predicted
    # prefill within `give_way_prefill_ratio` x its TPOT target (0: off) and its predicted TPOT
    # within `give_way_cheap_tpot_ratio` x its target.
    give_way_prefill_ratio: float = 0.0
    give_way_cheap_tpot_ratio: float = 0.0
    # Stall hold: a batch waits (within its guard) while the stall it would put on the worker's
    # decoding requests exceeds this x what one of them can absorb, until those finish (0 = off).
    stall_hold: float = 0.0
    # ... only while the worker's TPOT with the head is within this x the head's TPOT target.
    stall_hold_headroom: float = 1.0

    def hold(self) -> HoldParams:
        return HoldParams(self.tpot_headroom, self.guard_ms, self.tpot_refuse_ratio, self.give_way_tpot_ratio,
                          self.give_way_prefill_ratio, self.give_way_cheap_tpot_ratio, self.stall_hold)

    def validate(self) -> Self:
        require(self.batch_size_max >= 1, "slo-budget", "batch_size_max", self.batch_size_max, ">= 1")
        require(math.isfinite(self.tpot_headroom) and 0.0 <= self.tpot_headroom <= 1.0, "slo-budget",
                 "tpot_headroom", self.tpot_headroom, "in [0, 1] (0 = off)")
        require(math.isfinite(self.tpot_refuse_ratio) and self.tpot_refuse_ratio >= 0.0, "slo-budget",
                "tpot_refuse_ratio", self.tpot_refuse_ratio, "a finite number >= 0 (0 = refuse)")
        require(math.isfinite(self.give_way_tpot_ratio) and self.give_way_tpot_ratio >= 0.0, "slo-budget",
                "give_way_tpot_ratio", self.give_way_tpot_ratio, "a finite number >= 0 (0 = not checked)")
        require(math.isfinite(self.give_way_prefill_ratio) and self.give_way_prefill_ratio >= 0.0, "slo-budget",
                "give_way_prefill_ratio", self.give_way_prefill_ratio, "a finite number >= 0 (0 = off)")
        require(math.isfinite(self.give_way_cheap_tpot_ratio) and self.give_way_cheap_tpot_ratio >= 0.0, "slo-budget",
                "give_way_cheap_tpot_ratio", self.give_way_cheap_tpot_ratio, "a finite number >= 0 (0: none is served)")
        require(math.isfinite(self.stall_hold) and self.stall_hold >= 0.0, "slo-budget",
                "stall_hold", self.stall_hold, "a finite number >= 0 (0 = off)")
        require(math.isfinite(self.stall_hold_headroom) and 0.0 < self.stall_hold_headroom <= 1.0, "slo-budget",
                "stall_hold_headroom", self.stall_hold_headroom, "in (0, 1]")
        require_ms(self.window_ms, "slo-budget", "window_ms", allow_zero=True)
        require_ms(self.guard_ms, "slo-budget", "guard_ms", allow_zero=True)
        require_ms(self.emergency_guard_ms, "slo-budget", "emergency_guard_ms", allow_zero=True)
        require(math.isfinite(self.ema_alpha) and 0.0 < self.ema_alpha <= 1.0, "slo-budget", "ema_alpha",
                 self.ema_alpha, "in (0, 1]")
        require(self.max_inflight_batches >= 0, "slo-budget", "max_inflight_batches", self.max_inflight_batches,
                 ">= 0 (0 = off)")
        require_ms(self.enqueue_deadline_ms, "slo-budget", "enqueue_deadline_ms", allow_zero=False)
        return self



class SloBudgetBatcher(QueueBatcher[T]):
    name = "slo-budget"

    def __init__(self, params: SloBudgetParams, predict_ms: PredictFn) -> None:
        self.params = params.validate()
        super().__init__(predict_ms, params.enqueue_deadline_ms)
        self._window_ns = ms_to_ns(params.window_ms)
        self._guard_ns = ms_to_ns(params.guard_ms)
        self._emergency_guard_ns = ms_to_ns(params.emergency_guard_ms)
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
        keyed = [(self._deadline_ns(item) - ms_to_ns(self._predict([item])), seq, item)
                 for seq, item in self._items.items()]
        keyed.sort(key=lambda k: (k[0], k[1]))
        return [(seq, item) for _, seq, item in keyed]

    def _plan(self, now_ns: int, load: WorkerLoad, *, with_members: bool) -> Plan:
        p = self.params
        entries = self._ordered()
        candidate, stop = fill_batch(entries, load, p.batch_size_max)
        candidate_ms = self._predict([i for _, i in candidate])
        latest_start_ns = self._deadline_ns(entries[0][1]) - ms_to_ns(load.wait_ms) - ms_to_ns(candidate_ms)
        head = entries[0][1]
        head_tpot_ms = load.tpot_ms + tpot_added_ms(load, head)  # the worker's TPOT with the head
        tpot_full = (p.tpot_headroom > 0 and load.tpot_ms > 0 and head.tpot_target_ms > 0
                     and head_tpot_ms > p.tpot_headroom * head.tpot_target_ms)
        if tpot_full or self._is_held(load, p.max_inflight_batches):
            emergency_due_ns = latest_start_ns - self._emergency_guard_ns
            if now_ns < emergency_due_ns:
                return Plan(None, emergency_due_ns, [])
            if tpot_full and head.strict_deadline:  # its TTFT or everyone's TPOT: refused
                return Plan("unattainable", now_ns, [entries[0][0]] if with_members else [])
            reason = "emergency"
        else:
            guard_due_ns = latest_start_ns - self._guard_ns
            if (p.stall_hold > 0 and load.stall_limits and now_ns < guard_due_ns
                    and head_tpot_ms <= p.stall_hold_headroom * head.tpot_target_ms):  # the stall hold
                stall_ms = p.stall_hold * (load.wait_ms + candidate_ms)
                clear_ms = max((left for tolerance, left in load.stall_limits if tolerance < stall_ms), default=0.0)
                if clear_ms > 0:
                    return Plan(None, min(guard_due_ns, now_ns + ms_to_ns(clear_ms)), [])
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
                return Plan(None, min(guard_due_ns, window_due_ns, target_due_ns), [])
        return Plan(reason, now_ns, self._members(entries, now_ns, load) if with_members else [])

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
        wait_ns = ms_to_ns(load.wait_ms)

        def budget_ns(item: T) -> int | None:  # None: already late, it does not constrain the batch
            budget = self._deadline_ns(item) - now_ns - wait_ns
            return None if ms_to_ns(self._predict([item])) > budget else budget

        head = entries[0][1]
        members = [head]
        seqs = [entries[0][0]]
        shape = BatchShape(head)
        budget = budget_ns(head)
        for seq, item in entries[1:]:
            if shape.misfit(item, load, self.params.batch_size_max) is not None:
                break
            own = budget_ns(item)
            new_budget = own if budget is None else budget if own is None else min(budget, own)
            if new_budget is not None and ms_to_ns(self._predict([*members, item])) > new_budget:
                break
            shape.add(item)
            members.append(item)
            seqs.append(seq)
            budget = new_budget
        return seqs

    def queue_wait_ms(self, now_ns: int, load: WorkerLoad) -> float:
        # Slack order does not depend on the load (see _ordered), so (version, caps) is the key.
        return self._cached(load, lambda: sum(self._predict(b) for b in split_batches(self._ordered(), load, self.params.batch_size_max)))

    def queue_wait(self, now_ns: int, max_batch_tokens: int, free_kv_tokens: int, wait_ms: float) -> float:
        return self.queue_wait_ms(now_ns, WorkerLoad(max_batch_tokens, free_kv_tokens, 0, wait_ms))

