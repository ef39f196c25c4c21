"""The prefill batchers with a fake clock: acceptance cases, triggers, backpressure, expiry,
nothing lost, no busy-wait (hypothesis), slack order, parameter validation."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.core.batchers import (
    BATCHERS,
    DEFAULT_BATCHER,
    Batchable,
    FixedWindowBatcher,
    FixedWindowParams,
    PollResult,
    SloBudgetBatcher,
    SloBudgetParams,
    WorkerLoad,
    build_batcher,
    default_params,
)

MS = 1_000_000


# ------------------------------------------------------------------ builders
@dataclass(frozen=True)
class Req:
    request_id: str
    num_prompt_tokens: int
    enqueued_ns: int = 0
    deadline_ns: int = 0
    kv_tokens: int = 0
    num_cached_tokens: int = 0
    tpot_target_ms: float = 0.0
    strict_deadline: bool = False


def req(rid: str, tokens: int = 10, t_ms: float = 0, deadline_ms: float | None = None, kv: int = 0,
        tpot_ms: float = 0.0, strict: bool = False) -> Req:
    """A request arriving at t_ms; deadline_ms is absolute (None: no SLO); tpot_ms its TPOT
    target (0: none); strict: refused rather than served late."""
    return Req(rid, tokens, round(t_ms * MS), 0 if deadline_ms is None else round(deadline_ms * MS), kv,
               tpot_target_ms=tpot_ms, strict_deadline=strict)


def load(cap: int = 0, free_kv: int = 10**9, inflight: int = 0, wait_ms: float = 0.0, tpot_ms: float = 0.0,
         per_request: float = 0.0, per_kilotoken: float = 0.0) -> WorkerLoad:
    return WorkerLoad(max_batch_tokens=cap, free_kv_tokens=free_kv, num_inflight_batches=inflight, wait_ms=wait_ms,
                      tpot_ms=tpot_ms, tpot_ms_per_request=per_request, tpot_ms_per_kilotoken=per_kilotoken)


class Predictor:
    """ms_per_token x uncached tokens, summed over the batch; `override` pins one request's
    per-token cost (a predictor that learned something)."""

    def __init__(self, ms_per_token: float = 0.1) -> None:
        self.ms_per_token = ms_per_token
        self.override: dict[str, float] = {}

    def __call__(self, batch: Sequence[Batchable]) -> float:
        return sum((i.num_prompt_tokens - i.num_cached_tokens) * self.override.get(i.request_id, self.ms_per_token)
                   for i in batch)


def fixed(predict=None, **params) -> FixedWindowBatcher:
    return FixedWindowBatcher(FixedWindowParams(**params), predict or Predictor())


def slo(predict=None, **params) -> SloBudgetBatcher:
    return SloBudgetBatcher(SloBudgetParams(**params), predict or Predictor())


def ids(items) -> list[str]:
    return [i.request_id for i in items]


def batch_ids(result: PollResult) -> list[list[str]]:
    return [ids(b.items) for b in result.batches]


def add_all(b, *items) -> None:
    for i in items:
        b.add(i)


# ------------------------------------------------------------------ acceptance
def test_padded_cap_100_with_fifo_60_50_30_dispatches_only_the_60_first():
    b = fixed(wait_ms=300)
    add_all(b, req("p60", 60), req("p50", 50), req("p30", 30))
    r = b.poll(0, load(cap=100))
    assert batch_ids(r) == [["p60"]]  # 60 and 50 padded = 2 x 60 = 120 > 100; the 30 may not jump the queue
    assert r.batches[0].reason == "capacity"
    r = b.poll(300 * MS, load(cap=100))
    assert batch_ids(r) == [["p50", "p30"]] and r.batches[0].reason == "window"  # 2 x 50 = 100 fits


def test_padded_cap_without_the_capacity_trigger_waits_the_window_as_flexlb():
    b = fixed(wait_ms=300, dispatch_when_capped=False)
    add_all(b, req("p60", 60), req("p50", 50), req("p30", 30))
    assert batch_ids(b.poll(0, load(cap=100))) == []
    assert batch_ids(b.poll(300 * MS, load(cap=100))) == [["p60"], ["p50", "p30"]]


def test_32_prompts_of_32769_tokens_under_1048576_form_batches_of_31_and_1():
    b = fixed(batch_size_max=32, wait_ms=10)
    add_all(b, *(req(f"r{i}", 32_769) for i in range(32)))
    r = b.poll(10 * MS, load(cap=1_048_576))
    assert [len(c.items) for c in r.batches] == [31, 1]
    assert 31 * 32_769 <= 1_048_576 < 32 * 32_769
    assert [c.reason for c in r.batches] == ["full", "window"]


KV_CASES = [
    # (id, kv tokens of the FIFO items, free KV, expected batches)
    ("head-over-budget-still-goes", [500], 100, [["r0"]]),
    ("head-kv-not-counted-against-members", [500, 100], 100, [["r0", "r1"]]),
    ("member-that-does-not-fit-waits", [500, 80, 30], 100, [["r0", "r1"], ["r2"]]),
    ("members-sum-to-budget", [0, 40, 60, 1], 100, [["r0", "r1", "r2"], ["r3"]]),
    ("no-free-kv-means-singletons", [0, 1, 1], 0, [["r0"], ["r1"], ["r2"]]),
]


@pytest.mark.parametrize("kv,free_kv,expected", [c[1:] for c in KV_CASES], ids=[c[0] for c in KV_CASES])
def test_the_kv_budget_applies_to_non_head_members_only(kv, free_kv, expected):
    b = fixed(wait_ms=0)
    add_all(b, *(req(f"r{i}", 10, kv=k) for i, k in enumerate(kv)))
    assert batch_ids(b.poll(0, load(free_kv=free_kv))) == expected


def test_a_later_batch_of_the_same_poll_sees_the_kv_the_earlier_ones_took():
    b = fixed(wait_ms=0, batch_size_max=2)
    add_all(b, *(req(f"r{i}", 10, kv=40) for i in range(4)))
    # batch 1 takes 80 (head included) of 100; batch 2's member (40) no longer fits the 20 left
    assert batch_ids(b.poll(0, load(free_kv=100))) == [["r0", "r1"], ["r2"], ["r3"]]


# ------------------------------------------------------------------ fixed-window triggers
def test_the_window_closes_when_the_head_has_waited_wait_ms():
    b = fixed(wait_ms=10)
    add_all(b, req("a", t_ms=0), req("b", t_ms=3))
    assert batch_ids(b.poll(9 * MS, load())) == []
    assert b.next_due_ns(9 * MS, load()) == 10 * MS
    r = b.poll(10 * MS, load())
    assert batch_ids(r) == [["a", "b"]] and r.batches[0].reason == "window"
    assert len(b) == 0 and b.next_due_ns(10 * MS, load()) is None


def test_a_full_queue_dispatches_at_once_and_the_rest_waits_its_window():
    b = fixed(wait_ms=1000, batch_size_max=3)
    add_all(b, *(req(f"r{i}", t_ms=i) for i in range(5)))
    assert b.next_due_ns(5 * MS, load()) == 5 * MS  # due now
    r = b.poll(5 * MS, load())
    assert batch_ids(r) == [["r0", "r1", "r2"]] and r.batches[0].reason == "full"
    assert len(b) == 2 and b.next_due_ns(5 * MS, load()) == 3 * MS + 1000 * MS


def test_the_predicted_time_threshold_dispatches_before_the_window():
    b = fixed(wait_ms=1000, predicted_ms_threshold=100)  # 0.1 ms per token
    b.add(req("a", 500))  # 50 ms
    assert batch_ids(b.poll(0, load())) == []
    b.add(req("b", 600))  # 50 + 60 = 110 ms >= 100
    r = b.poll(1 * MS, load())
    assert batch_ids(r) == [["a", "b"]] and r.batches[0].reason == "threshold"
    assert r.batches[0].predicted_ms == pytest.approx(110)


def test_a_batch_closes_at_batch_size_max_even_on_the_window():
    b = fixed(wait_ms=0, batch_size_max=2)
    add_all(b, *(req(f"r{i}") for i in range(3)))
    assert batch_ids(b.poll(0, load())) == [["r0", "r1"], ["r2"]]


# ------------------------------------------------------------------ backpressure
@pytest.mark.parametrize("make,due_ms", [
    (lambda: fixed(wait_ms=10, max_inflight_batches=2), 5000),  # only the expiry can happen
    (lambda: slo(max_inflight_batches=2), 4000 - 1 - 150),  # or the emergency guard: 1 ms prefill
], ids=["fixed-window", "slo-budget"])
def test_backpressure_holds_while_the_worker_is_full_and_releases_when_it_drains(make, due_ms):
    b = make()
    b.add(req("a", deadline_ms=4000))
    busy = load(inflight=2)
    assert batch_ids(b.poll(20 * MS, busy)) == []
    assert b.next_due_ns(20 * MS, busy) == due_ms * MS  # no busy-wait while held
    assert batch_ids(b.poll(21 * MS, load(inflight=1))) == [["a"]]


def test_backpressure_counts_the_batches_of_the_last_poll_until_the_load_shows_them():
    b = fixed(wait_ms=0, batch_size_max=1, max_inflight_batches=1)
    add_all(b, req("a"), req("b"))
    stale = load(inflight=0)
    assert batch_ids(b.poll(0, stale)) == [["a"]]  # a second batch would pass the limit of 1
    assert b.next_due_ns(0, stale) == 5000 * MS  # the stale load does not show "a": still held
    assert b.next_due_ns(0, load(inflight=1)) == 5000 * MS  # the caller recorded "a"
    assert b.next_due_ns(0, load(inflight=0, wait_ms=1.0)) == 0  # a changed load is trusted
    assert batch_ids(b.poll(1 * MS, stale)) == [["b"]]  # poll always trusts its load ("a" done)


# ------------------------------------------------------------------ expiry, too_large, remove, drain
def test_a_request_past_the_enqueue_deadline_expires_even_under_backpressure():
    b = fixed(wait_ms=1000, enqueue_deadline_ms=100, max_inflight_batches=1)
    add_all(b, req("a", t_ms=0), req("b", t_ms=50))
    busy = load(inflight=5)
    assert b.poll(100 * MS - 1, busy).expired == []
    assert b.next_due_ns(100 * MS - 1, busy) == 100 * MS
    r = b.poll(100 * MS, busy)
    assert ids(r.expired) == ["a"] and r.batches == [] and len(b) == 1
    assert b.next_due_ns(100 * MS, busy) == 150 * MS


def test_slo_budget_breaks_backpressure_before_expiry_and_expires_only_when_polled_late():
    b = slo(enqueue_deadline_ms=100, emergency_guard_ms=60, max_inflight_batches=1)
    add_all(b, req("a", 100, t_ms=0, deadline_ms=10_000), req("b", 100, t_ms=50))  # 10 ms prefill each
    busy = load(inflight=5)
    # the expiry (100 ms) caps a's deadline; the batch a+b takes 20 ms; the emergency guard is 60 ms
    assert b.next_due_ns(0, busy) == (100 - 20 - 60) * MS
    r = b.poll(100 * MS, busy)  # polled late: a has expired; b's emergency (150 - 10 - 60 ms) is due
    assert ids(r.expired) == ["a"] and batch_ids(r) == [["b"]] and r.batches[0].reason == "emergency"


def test_a_request_alone_over_the_padded_cap_is_too_large_and_the_queue_moves_on():
    b = fixed(wait_ms=0)
    add_all(b, req("small", 10), req("big", 500), req("small2", 20))
    assert b.next_due_ns(0, load(cap=100)) == 0
    r = b.poll(0, load(cap=100))
    assert ids(r.too_large) == ["big"]
    assert batch_ids(r) == [["small", "small2"]]


def test_a_too_large_request_fails_at_once_even_while_the_window_is_open():
    b = fixed(wait_ms=1000)
    add_all(b, req("small", 10), req("big", 500))
    r = b.poll(0, load(cap=100))
    assert ids(r.too_large) == ["big"] and batch_ids(r) == [] and len(b) == 1
    assert b.next_due_ns(0, load(cap=100)) == 1000 * MS


@pytest.mark.parametrize("make", [fixed, slo], ids=["fixed-window", "slo-budget"])
def test_remove_takes_out_exactly_the_matching_items(make):
    b = make(batch_size_max=8)
    add_all(b, req("a"), req("b"), req("c"))
    assert ids(b.remove(lambda i: i.request_id == "b")) == ["b"]
    assert b.remove(lambda i: i.request_id == "zzz") == []
    assert len(b) == 2 and sorted(ids(b.drain())) == ["a", "c"]


def test_remove_with_a_failing_predicate_leaves_the_queue_intact():
    b = fixed()
    add_all(b, req("a"), req("b"))

    def boom(i):
        if i.request_id == "b":
            raise RuntimeError("boom")
        return True

    with pytest.raises(RuntimeError):
        b.remove(boom)
    assert len(b) == 2


@pytest.mark.parametrize("make", [lambda: fixed(max_inflight_batches=1), lambda: slo()], ids=["fixed-window", "slo-budget"])
def test_drain_returns_every_queued_item_and_leaves_nothing(make):
    b = make()
    add_all(b, *(req(f"r{i}", t_ms=i, deadline_ms=5000) for i in range(5)))
    assert batch_ids(b.poll(0, load(inflight=3))) == []  # held: all five still queued
    assert ids(b.drain()) == ["r0", "r1", "r2", "r3", "r4"]  # nothing lost at shutdown
    assert len(b) == 0 and b.next_due_ns(0, load()) is None
    r = b.poll(10_000 * MS, load())
    assert (r.batches, r.expired, r.too_large) == ([], [], [])


@pytest.mark.parametrize("bad", [math.nan, math.inf, -1.0])
def test_a_broken_prediction_is_an_error_and_loses_nothing(bad):
    predict = Predictor()
    b = fixed(predict=predict, wait_ms=0, batch_size_max=1)
    add_all(b, req("a"), req("b"), req("late", t_ms=-10_000))
    predict.override["b"] = bad  # the first batch ("a") is formed before "b" breaks the poll
    with pytest.raises(ValueError, match="predict_ms"):
        b.poll(0, load())
    assert ids(b.drain()) == ["a", "b", "late"]  # the poll rolled back: no batch, no expiry lost


# ------------------------------------------------------------------ queue_wait_ms
def test_queue_wait_of_fixed_window_counts_the_window_and_the_batches_ahead():
    b = fixed(wait_ms=300, batch_size_max=2)
    assert b.queue_wait_ms(0, load()) == 300  # a newcomer heads its own batch: the whole window
    assert b.queue_wait_ms(0, load(wait_ms=500)) == 0  # the worker is busy longer than the window
    b.add(req("a", 100, t_ms=0))  # 10 ms
    assert b.queue_wait_ms(100 * MS, load()) == 0  # it fills a's batch, which leaves at once
    b.add(req("b", 200, t_ms=100))  # a+b = 30 ms, full
    assert b.queue_wait_ms(100 * MS, load()) == pytest.approx(300)  # behind a full batch: its own window
    assert b.queue_wait_ms(100 * MS, load(wait_ms=290)) == pytest.approx(30)  # the batch ahead dominates


def test_queue_wait_of_slo_budget_is_the_predicted_time_of_the_queued_batches():
    b = slo(batch_size_max=2)
    assert b.queue_wait_ms(0, load()) == 0
    add_all(b, req("a", 100, deadline_ms=900), req("b", 200, deadline_ms=900), req("c", 300, deadline_ms=900))
    assert b.queue_wait_ms(0, load()) == pytest.approx(60)


# ------------------------------------------------------------------ slo-budget
def test_slo_budget_serves_the_most_urgent_first():
    b = slo(batch_size_max=1, max_inflight_batches=0)
    add_all(b, req("loose", 100, deadline_ms=2000), req("none", 100), req("tight", 100, deadline_ms=300))
    assert batch_ids(b.poll(0, load())) == [["tight"], ["loose"], ["none"]]


def test_slack_counts_the_predicted_prefill_not_just_the_deadline():
    b = slo(batch_size_max=1, max_inflight_batches=0)
    # same deadline; the long prompt (100 ms) has less slack than the short one (1 ms)
    add_all(b, req("short", 10, deadline_ms=1000), req("long", 1000, deadline_ms=1000))
    assert batch_ids(b.poll(0, load())) == [["long"], ["short"]]


def test_a_request_with_no_arrival_history_leaves_at_once():
    b = slo()
    b.add(req("a", deadline_ms=1000))
    r = b.poll(0, load())
    assert batch_ids(r) == [["a"]] and r.batches[0].reason == "target"


def two_arrivals_1ms_apart(b: SloBudgetBatcher) -> None:
    """Arrival history without a queue: an EMA of 1 ms, the last arrival at 1 ms."""
    add_all(b, req("h0", t_ms=0, deadline_ms=1), req("h1", t_ms=1, deadline_ms=1))
    b.poll(1 * MS, load())
    assert len(b) == 0 and b.inter_arrival_ema_ms == pytest.approx(1)


def test_a_request_inside_the_guard_leaves_at_once_even_when_arrivals_are_expected():
    b = slo(window_ms=10_000)
    two_arrivals_1ms_apart(b)
    b.add(req("urgent", 100, t_ms=1, deadline_ms=1 + 10 + 40))  # 10 ms prefill, slack 40 = the guard
    r = b.poll(1 * MS, load())
    assert batch_ids(r) == [["urgent"]] and r.batches[0].reason == "guard"


def test_the_guard_counts_the_workers_wait():
    b = slo(window_ms=10_000)
    two_arrivals_1ms_apart(b)
    b.add(req("a", 100, t_ms=1, deadline_ms=500))
    assert batch_ids(b.poll(1 * MS, load(wait_ms=0))) == []
    r = b.poll(1 * MS, load(wait_ms=450))  # 500 - 450 - 10 = 40 ms of slack left: the guard
    assert batch_ids(r) == [["a"]] and r.batches[0].reason == "guard"


def test_slo_budget_waits_while_arrivals_are_expected_and_grows_batches():
    b = slo(batch_size_max=4, window_ms=10_000, max_inflight_batches=0)
    sizes, now = [], 0
    for i in range(16):  # one arrival every 5 ms, each with a second of slack
        now = i * 5 * MS
        b.add(req(f"r{i}", 100, t_ms=i * 5, deadline_ms=i * 5 + 1000))
        r = b.poll(now, load())
        sizes += [len(c.items) for c in r.batches]
        if i >= 2:  # with a history of arrivals, the next is expected well within the slack
            due = b.next_due_ns(now, load())
            assert due is None or due > now
    assert sizes == [1, 4, 4, 4]  # the first leaves alone (no history), then full batches
    fw = fixed(wait_ms=0)
    for i in range(16):
        fw.add(req(f"r{i}", 100, t_ms=i * 5))
        assert [len(c.items) for c in fw.poll(i * 5 * MS, load()).batches] == [1]  # the contrast


def test_a_pause_in_traffic_ends_the_wait_at_its_midpoint():
    b = slo(window_ms=10_000)
    two_arrivals_1ms_apart(b)
    b.add(req("a", 100, t_ms=1, deadline_ms=1001))  # may wait until 1001 - 10 - 40 = 951 ms
    assert batch_ids(b.poll(1 * MS, load())) == []
    due = b.next_due_ns(1 * MS, load())
    assert due == (951 * MS + 1 * MS) // 2  # t - last arrival >= 951 ms - t
    assert batch_ids(b.poll(due - 1, load())) == []
    r = b.poll(due, load())
    assert batch_ids(r) == [["a"]] and r.batches[0].reason == "target"


def test_the_window_bounds_the_wait_of_requests_without_a_deadline():
    b = slo(window_ms=50)
    add_all(b, req("a", t_ms=0), req("b", t_ms=1))
    b.remove(lambda i: True)
    b.add(req("c", t_ms=1))
    assert b.next_due_ns(1 * MS, load()) <= 50 * MS
    r = b.poll(60 * MS, load())  # a late poll: the window has closed
    assert batch_ids(r) == [["c"]] and r.batches[0].reason == "window"


def test_the_head_breaks_backpressure_at_the_emergency_guard():
    b = slo(max_inflight_batches=2, emergency_guard_ms=150, window_ms=10_000)
    b.add(req("a", 100, t_ms=0, deadline_ms=500))  # latest start 490 ms, emergency at 340 ms
    busy = load(inflight=2)
    assert batch_ids(b.poll(339 * MS, busy)) == []
    assert b.next_due_ns(339 * MS, busy) == 340 * MS
    r = b.poll(340 * MS, busy)
    assert batch_ids(r) == [["a"]] and r.batches[0].reason == "emergency"


def test_a_batch_is_cut_where_it_would_make_its_head_late():
    b = slo(window_ms=10_000)
    two_arrivals_1ms_apart(b)
    # head: 10 ms alone, 45 ms budget; with m1 (20 ms) 30 ms fits; with m2 (30 ms more) 60 > 45
    add_all(b, req("head", 100, t_ms=1, deadline_ms=46), req("m1", 200, t_ms=1, deadline_ms=1000),
            req("m2", 300, t_ms=1, deadline_ms=2000))
    r = b.poll(1 * MS, load())
    assert r.batches[0].reason == "guard" and ids(r.batches[0].items) == ["head", "m1"]


def test_a_late_head_takes_a_full_batch_instead_of_going_alone():
    b = slo(window_ms=10_000)
    two_arrivals_1ms_apart(b)
    add_all(b, req("late", 100, t_ms=1, deadline_ms=5), *(req(f"m{i}", 100, t_ms=1) for i in range(3)))
    r = b.poll(1 * MS, load())
    assert batch_ids(r)[0] == ["late", "m0", "m1", "m2"]


def test_slack_order_is_derived_after_removes_and_adds():
    """A sorted cache not invalidated on add/remove would dispatch stale items."""
    predict = Predictor()
    b = slo(predict=predict, batch_size_max=1, max_inflight_batches=0)
    add_all(b, req("a", 100, deadline_ms=900), req("b", 100, deadline_ms=300))
    b.remove(lambda i: i.request_id == "b")
    b.add(req("c", 100, deadline_ms=600))
    b.add(req("d", 100, deadline_ms=100))
    b.remove(lambda i: i.request_id == "d")
    assert [b.queue_wait_ms(0, load())] == [pytest.approx(20)]  # a and c only
    predict.override["a"] = 5.0  # the predictor learned that a takes 500 ms: now the most urgent
    assert batch_ids(b.poll(0, load())) == [["a"], ["c"]]


# ------------------------------------------------------------------ no busy-wait, nothing lost (hypothesis)
loads = st.builds(
    WorkerLoad,
    max_batch_tokens=st.sampled_from([0, 0, 1000, 3000, 10_000]),
    free_kv_tokens=st.integers(-500, 6000),
    num_inflight_batches=st.integers(0, 3),
    wait_ms=st.sampled_from([0.0, 0.0, 5.5, 100.0, 800.0]),
)
ms_values = st.sampled_from([0.0, 1.0, 7.5, 50.0, 300.0, 1200.0])
fixed_params = st.builds(
    FixedWindowParams,
    batch_size_max=st.integers(1, 5),
    wait_ms=ms_values,
    predicted_ms_threshold=st.sampled_from([0.0, 0.0, 20.0, 150.0]),
    enqueue_deadline_ms=st.sampled_from([1.0, 400.0, 2000.0, 5000.0]),
    max_inflight_batches=st.integers(0, 2),
    dispatch_when_capped=st.booleans(),
)
slo_params = st.builds(
    SloBudgetParams,
    batch_size_max=st.integers(1, 5),
    window_ms=ms_values,
    guard_ms=st.sampled_from([0.0, 40.0, 333.3]),
    emergency_guard_ms=st.sampled_from([0.0, 150.0]),
    ema_alpha=st.sampled_from([0.2, 1.0]),
    max_inflight_batches=st.integers(0, 2),
    enqueue_deadline_ms=st.sampled_from([1.0, 400.0, 2000.0, 5000.0]),
)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 4000), st.integers(0, 3000),
                  st.one_of(st.none(), st.integers(-100, 3000))),
        st.tuples(st.just("advance"), st.integers(0, 700 * MS)),
        st.tuples(st.just("poll"), loads),
        st.tuples(st.just("follow"), loads),  # sleep until next_due, then poll: what the shell does
        st.tuples(st.just("remove"), st.integers(0, 40)),
    ),
    max_size=50,
)


class Ledger:
    """Where every added request ended; checks each batch against the caps it was formed under."""

    def __init__(self, b, predict) -> None:
        self.b, self.predict = b, predict
        self.outcomes: Counter[str] = Counter()
        self.added: list[str] = []
        self.dispatched: list[str] = []

    def poll(self, now: int, wl: WorkerLoad) -> bool:
        r = self.b.poll(now, wl)
        due = self.b.next_due_ns(now, wl)
        assert due is None or due > now, f"busy-wait: next_due {due} <= now {now}"
        size_max = self.b.params.batch_size_max
        limit = self.b.params.max_inflight_batches
        if limit > 0:  # backpressure counts the batches of this very poll; only an emergency breaks it
            regular = [c for c in r.batches if c.reason != "emergency"]
            assert len(regular) <= max(0, limit - wl.num_inflight_batches)
        used_kv = 0
        for c in r.batches:
            head, rest = c.items[0], c.items[1:]
            assert 1 <= len(c.items) <= size_max
            if wl.max_batch_tokens > 0:
                assert max(i.num_prompt_tokens for i in c.items) * len(c.items) <= wl.max_batch_tokens
            assert sum(i.kv_tokens for i in rest) <= max(0, wl.free_kv_tokens - used_kv) or not rest
            assert c.predicted_ms == self.predict(c.items)
            used_kv += head.kv_tokens + sum(i.kv_tokens for i in rest)
            self.dispatched += ids(c.items)
        for i in r.too_large:
            assert i.num_prompt_tokens > wl.max_batch_tokens > 0
        for i in r.expired:
            assert now - i.enqueued_ns >= self.b.params.enqueue_deadline_ms * MS - 1
        self.outcomes.update(ids(i for c in r.batches for i in c.items))
        self.outcomes.update(ids(r.expired))
        self.outcomes.update(ids(r.too_large))
        return bool(r.batches or r.expired or r.too_large)


def run_scenario(b, predict, script, end_with_drain: bool) -> Ledger:
    ledger = Ledger(b, predict)
    now, last_load = 0, load()
    for op in script:
        kind = op[0]
        if kind == "add":
            _, tokens, kv, deadline_offset_ms = op
            rid = f"r{len(ledger.added)}"
            deadline_ns = 0 if deadline_offset_ms is None else max(1, now + deadline_offset_ms * MS)
            b.add(Req(rid, tokens, now, deadline_ns, kv))
            ledger.added.append(rid)
        elif kind == "advance":
            now += op[1]
        elif kind == "poll":
            last_load = op[1]
            ledger.poll(now, last_load)
        elif kind == "follow":
            last_load = op[1]
            due = b.next_due_ns(now, last_load)
            if due is not None:
                now = max(now, due)
                ledger.poll(now, last_load)
        else:
            taken = b.remove(lambda i, n=op[1]: int(i.request_id[1:]) % 41 == n)
            ledger.outcomes.update(ids(taken))
    if end_with_drain:
        ledger.outcomes.update(ids(b.drain()))
    else:  # liveness: with the load fixed and no arrivals, following next_due empties the queue
        polls = 0
        while len(b):
            due = b.next_due_ns(now, last_load)
            assert due is not None, "items queued but nothing will ever happen"
            now = max(now, due)
            ledger.poll(now, last_load)
            polls += 1
            assert polls <= 2 * len(ledger.added) + 2, "no progress: the batcher spins"
    assert len(b) == 0
    return ledger


def check_accounting(ledger: Ledger) -> None:
    assert set(ledger.outcomes) == set(ledger.added)
    assert all(n == 1 for n in ledger.outcomes.values()), "an item ended twice"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(params=fixed_params, script=ops, end_with_drain=st.booleans())
def test_fixed_window_never_busy_waits_never_loses_an_item_and_stays_fifo(params, script, end_with_drain):
    predict = Predictor(0.05)
    ledger = run_scenario(FixedWindowBatcher(params, predict), predict, script, end_with_drain)
    check_accounting(ledger)
    order = [int(rid[1:]) for rid in ledger.dispatched]
    assert order == sorted(order), "fixed-window dispatched out of FIFO order"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(params=slo_params, script=ops, end_with_drain=st.booleans())
def test_slo_budget_never_busy_waits_and_never_loses_an_item(params, script, end_with_drain):
    predict = Predictor(0.05)
    check_accounting(run_scenario(SloBudgetBatcher(params, predict), predict, script, end_with_drain))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(params=fixed_params, script=ops)
def test_a_quiet_fixed_window_batcher_is_one_whose_full_poll_finds_nothing(params, script):
    """The scheduler skips polling (and building the load of) a batcher that says it is quiet:
    whenever `quiet` says so, the full algorithm (the poll without its fast path) must find
    nothing to dispatch, expire or refuse, under any load with that padded cap."""
    from services.core.batchers.base import QueueBatcher

    b = FixedWindowBatcher(params, Predictor(0.05))
    now = 0
    for op in script:
        if op[0] == "add":
            b.add(Req(f"r{len(b)}-{now}", op[1], now, 0, op[2]))
        elif op[0] == "advance":
            now += op[1]
        elif op[0] in ("poll", "follow"):
            wl = op[1]
            quiet = b.quiet(now, wl.max_batch_tokens)
            r = QueueBatcher.poll(b, now, wl)
            if quiet:
                assert not (r.batches or r.expired or r.too_large), (now, wl)
        else:
            b.remove(lambda i, n=op[1]: len(i.request_id) % 41 == n)


def test_quiet_holds_until_the_window_or_the_queue_changes():
    b = fixed(Predictor(), batch_size_max=3, wait_ms=10)
    b.add(req("a", 100, t_ms=0))
    assert b.quiet(9 * MS, 0) and not b.quiet(10 * MS, 0)  # the window ends at 10 ms
    assert b.quiet(0, 150) and not b.quiet(0, 50)  # a prompt over the cap: the full poll fails it (too_large)
    b.add(req("b", 100, t_ms=1))
    b.add(req("c", 100, t_ms=2))
    assert not b.quiet(3 * MS, 0)  # full: the full poll dispatches it
    assert batch_ids(b.poll(3 * MS, load())) == [["a", "b", "c"]]
    assert not b.quiet(3 * MS, 0)  # empty: nothing to be quiet about (the scheduler skips it anyway)
    short = fixed(Predictor(), batch_size_max=3, wait_ms=50, enqueue_deadline_ms=1)
    short.add(req("d", 100, t_ms=0))
    assert short.quiet(MS // 2, 0) and not short.quiet(MS, 0)  # it expires before its window ends
    assert [i.request_id for i in short.poll(MS, load()).expired] == ["d"]


# ------------------------------------------------------------------ registry and parameters
def test_the_registry_knows_both_batchers_and_the_default_is_flexlbs():
    assert sorted(BATCHERS) == ["fixed-window", "slo-budget"]
    assert DEFAULT_BATCHER == "fixed-window"  # a default changes only on purpose (services/core/batchers/__init__.py)
    assert default_params("fixed-window") == FixedWindowParams(batch_size_max=8, wait_ms=300.0,
                                                               predicted_ms_threshold=0.0,
                                                               enqueue_deadline_ms=5000.0, max_inflight_batches=0)
    assert default_params("slo-budget") == SloBudgetParams(batch_size_max=8, window_ms=300.0, guard_ms=40.0,
                                                           emergency_guard_ms=150.0, ema_alpha=0.2,
                                                           max_inflight_batches=2, enqueue_deadline_ms=5000.0)


@pytest.mark.parametrize("name,cls", [("fixed-window", FixedWindowBatcher), ("slo-budget", SloBudgetBatcher)])
def test_build_batcher_by_name(name, cls):
    b = build_batcher(name, None, Predictor())
    assert isinstance(b, cls) and b.name == name and b.params == default_params(name)


def test_build_batcher_takes_flexlbs_high_throughput_setting_from_a_mapping():
    b = build_batcher("fixed-window", {"wait_ms": 160, "predicted_ms_threshold": 500, "batch_size_max": 32}, Predictor())
    assert b.params.wait_ms == 160.0 and b.params.batch_size_max == 32


INVALID = [
    # (id, factory, expected text in the error)
    ("fw-size-0", lambda: FixedWindowParams(batch_size_max=0).validate(), "batch_size_max"),
    ("fw-wait-negative", lambda: FixedWindowParams(wait_ms=-1).validate(), "wait_ms"),
    ("fw-wait-nan", lambda: FixedWindowParams(wait_ms=math.nan).validate(), "wait_ms"),
    ("fw-threshold-negative", lambda: FixedWindowParams(predicted_ms_threshold=-5).validate(), "predicted_ms_threshold"),
    ("fw-enqueue-deadline-0", lambda: FixedWindowParams(enqueue_deadline_ms=0).validate(), "enqueue_deadline_ms"),
    ("fw-inflight-negative", lambda: FixedWindowParams(max_inflight_batches=-1).validate(), "max_inflight_batches"),
    ("slo-size-0", lambda: SloBudgetParams(batch_size_max=0).validate(), "batch_size_max"),
    ("slo-window-negative", lambda: SloBudgetParams(window_ms=-1).validate(), "window_ms"),
    ("slo-guard-negative", lambda: SloBudgetParams(guard_ms=-1).validate(), "guard_ms"),
    ("slo-emergency-inf", lambda: SloBudgetParams(emergency_guard_ms=math.inf).validate(), "emergency_guard_ms"),
    ("slo-alpha-0", lambda: SloBudgetParams(ema_alpha=0).validate(), "ema_alpha"),
    ("slo-alpha-above-1", lambda: SloBudgetParams(ema_alpha=1.5).validate(), "ema_alpha"),
    ("slo-inflight-negative", lambda: SloBudgetParams(max_inflight_batches=-1).validate(), "max_inflight_batches"),
    ("slo-enqueue-deadline-0", lambda: SloBudgetParams(enqueue_deadline_ms=0).validate(), "enqueue_deadline_ms"),
    ("unknown-name", lambda: build_batcher("fifo", None, Predictor()), "fixed-window, slo-budget"),
    ("unknown-key", lambda: build_batcher("fixed-window", {"wait_mss": 1}, Predictor()), "wait_mss"),
    ("wrong-type", lambda: build_batcher("fixed-window", {"wait_ms": "soon"}, Predictor()), "wait_ms"),
    ("bool-for-int", lambda: build_batcher("slo-budget", {"batch_size_max": True}, Predictor()), "batch_size_max"),
    ("range-via-build", lambda: build_batcher("slo-budget", {"guard_ms": -1}, Predictor()), "guard_ms"),
    ("other-batchers-params", lambda: build_batcher("slo-budget", FixedWindowParams(), Predictor()), "FixedWindowParams"),
    ("unknown-default", lambda: default_params("fifo"), "fixed-window, slo-budget"),
]


@pytest.mark.parametrize("factory,expected", [c[1:] for c in INVALID], ids=[c[0] for c in INVALID])
def test_invalid_parameters_fail_naming_the_field(factory, expected):
    with pytest.raises(ValueError, match=expected):
        factory()


def test_a_batcher_validates_a_struct_built_by_hand():
    with pytest.raises(ValueError, match="batch_size_max"):
        FixedWindowBatcher(FixedWindowParams(batch_size_max=0), Predictor())


# ------------------------------------------------------------------ the queue-wait cache is never stale
@pytest.mark.parametrize("make", [fixed, slo], ids=["fixed-window", "slo-budget"])
def test_queue_wait_cache_follows_every_mutation_and_invalidate(make):
    predictor = Predictor(ms_per_token=1.0)
    b = make(predictor, batch_size_max=1, wait_ms=0) if make is fixed else make(predictor, batch_size_max=1)
    ld = load()
    b.add(req("a", 100))
    b.add(req("b", 100))
    assert b.queue_wait_ms(0, ld) == 200  # one batch each, both ahead of a newcomer
    assert b.queue_wait_ms(0, ld) == 200  # (served from the cache)
    b.add(req("c", 300))
    assert b.queue_wait_ms(0, ld) == 500
    b.remove(lambda it: it.request_id == "c")
    assert b.queue_wait_ms(0, ld) == 200
    predictor.ms_per_token = 3.0  # the predictor learned: without invalidate the cache would lie
    b.invalidate()
    assert b.queue_wait_ms(0, ld) == 600
    b.drain()
    assert b.queue_wait_ms(0, ld) == 0
    b.add(req("d", 100))
    assert b.queue_wait_ms(0, ld) == 300
    b.poll(10**12, ld)  # everything leaves
    assert len(b) == 0 and b.queue_wait_ms(10**12, ld) == 0


# ------------------------------------------------------------------ incremental queue shape == rebuilt one
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(1, 400), st.integers(0, 600), st.integers(0, 50)),
    st.tuples(st.just("take"), st.integers(0, 60)),
    st.tuples(st.just("remove_many"), st.integers(2, 5)),
), max_size=40), size_max=st.integers(1, 6))
def test_incremental_fixed_window_queue_wait_equals_a_fresh_computation(ops, size_max):
    """queue_wait_ms reads a queue shape kept up to date by add/take/remove; for every cap
    and free-KV value it must equal what a fresh batcher with the same queue computes."""
    def predictor(batch):  # a per-batch base cost: the answer depends on how the queue splits
        return 7.0 + 0.5 * sum(i.num_prompt_tokens for i in batch)

    b = fixed(predictor, batch_size_max=size_max, wait_ms=100)
    seqs: list[int] = []
    n = 0
    for op in ops:
        if op[0] == "add":
            _, tokens, kv, t_ms = op
            seqs.append(b.add(req(f"r{n}", tokens, t_ms=t_ms, kv=kv)))
            n += 1
        elif op[0] == "take" and seqs:
            seq = seqs.pop(op[1] % len(seqs))
            assert b.take(seq) is not None and b.take(seq) is None
        elif op[0] == "remove_many":
            gone = b.remove(lambda it, k=op[1]: int(it.request_id[1:]) % k == 0)
            seqs = [s for s in seqs if s in b._items]
            assert all(int(i.request_id[1:]) % op[1] == 0 for i in gone)
        for cap, free_kv in ((700, 300), (0, 10**9), (0, 500), (0, 10**9), (700, 500), (700, 2000), (700, 300)):
            ld = load(cap=cap, free_kv=free_kv, wait_ms=3.0)
            fresh = fixed(predictor, batch_size_max=size_max, wait_ms=100)
            for item in b._items.values():
                fresh.add(item)
            assert b.queue_wait_ms(20 * MS, ld) == pytest.approx(fresh.queue_wait_ms(20 * MS, ld), abs=1e-9)


def test_taking_a_batch_head_lets_the_next_request_join_the_batch_before():
    """Padded cap 700: [300] [400] [200] -> take the 400 -> [300, 200] (2 x 300 <= 700): the
    estimate must re-split from the batch before the one that lost its head."""
    def predictor(batch):
        return 7.0 + 0.5 * sum(i.num_prompt_tokens for i in batch)

    b = fixed(predictor, batch_size_max=4, wait_ms=100)
    ld = load(cap=700)
    b.add(req("a", 300))
    seq = b.add(req("b", 400))
    b.add(req("c", 200))
    assert b.queue_wait_ms(0, ld) == pytest.approx(7.0 + 150 + 7.0 + 200)  # [300] [400] ahead of [200]
    b.take(seq)
    assert b.queue_wait_ms(0, ld) == pytest.approx(100 - 0)  # one batch [300, 200]: a newcomer joins, waits the window


# ------------------------------------------------------------------ slo-budget: the TPOT hold
def test_tpot_hold_keeps_requests_while_the_worker_would_decode_too_slowly_and_releases_when_it_speeds_up():
    """headroom 0.9 of a 100 ms TPOT target: a worker at 85 ms where one more request adds 2 ms
    (+ 1 ms per thousand tokens of its 1,000-token prompt) would be at 88: it takes it; at 88
    (-> 91) it is held until the load drops, or until the head's emergency point."""
    b = slo(tpot_headroom=0.9, window_ms=0, max_inflight_batches=0, emergency_guard_ms=150)
    b.add(req("a", 1000, t_ms=0, deadline_ms=2000, kv=1000, tpot_ms=100))  # prefill 100 ms: latest start 1900
    busy = load(tpot_ms=88, per_request=2, per_kilotoken=1)
    assert batch_ids(b.poll(0, busy)) == []
    assert b.next_due_ns(0, busy) == (1900 - 150) * MS  # the emergency point, no earlier wake-up
    assert batch_ids(b.poll(500 * MS, load(tpot_ms=85, per_request=2, per_kilotoken=1))) == [["a"]]


def test_tpot_hold_counts_what_the_poll_dispatched_and_next_due_until_the_load_shows_it():
    b = slo(tpot_headroom=0.9, window_ms=0, max_inflight_batches=0, batch_size_max=1)
    add_all(b, req("a", 100, deadline_ms=2000, kv=0, tpot_ms=100), req("b", 100, deadline_ms=2000, kv=0, tpot_ms=100))
    ld = load(tpot_ms=80, per_request=6)  # a: 80 -> 86 fits; b after a: 86 -> 92 does not
    assert batch_ids(b.poll(0, ld)) == [["a"]]  # b held in the same poll: a's 6 ms counted
    assert b.next_due_ns(0, ld) > 0  # and with the same load, no wake-up now (no spin)
    assert batch_ids(b.poll(2 * MS, load(tpot_ms=78, per_request=6))) == [["b"]]  # a newer load: room again


def test_tpot_hold_at_the_emergency_point_serves_a_lenient_request_and_refuses_a_strict_one():
    full = load(tpot_ms=95, per_request=1)
    lenient = slo(tpot_headroom=0.9, window_ms=0, max_inflight_batches=0, emergency_guard_ms=150)
    lenient.add(req("a", 1000, deadline_ms=2000, tpot_ms=100))
    r = lenient.poll(1750 * MS, full)
    assert batch_ids(r) == [["a"]] and r.batches[0].reason == "emergency" and r.unattainable == []
    strict = slo(tpot_headroom=0.9, window_ms=0, max_inflight_batches=0, emergency_guard_ms=150)
    add_all(strict, req("a", 1000, deadline_ms=2000, tpot_ms=100, strict=True),
            req("b", 1000, deadline_ms=9000, tpot_ms=100, strict=True))
    r = strict.poll(1750 * MS, full)
    assert ids(r.unattainable) == ["a"] and r.batches == [] and len(strict) == 1  # b still has slack: still held


@pytest.mark.parametrize("ld,item", [
    (load(tpot_ms=0.0, per_request=50), req("a", 100, deadline_ms=2000, tpot_ms=100)),  # idle worker / no model
    (load(tpot_ms=95, per_request=1), req("a", 100, deadline_ms=2000, tpot_ms=0)),  # the request has no TPOT target
], ids=["idle-worker", "no-target"])
def test_tpot_hold_never_holds_for_an_idle_worker_or_a_request_without_target(ld, item):
    b = slo(tpot_headroom=0.9, window_ms=0, max_inflight_batches=0)
    b.add(item)
    assert batch_ids(b.poll(0, ld)) == [["a"]]


def test_tpot_hold_off_by_default_and_headroom_is_validated():
    b = slo(window_ms=0, max_inflight_batches=0)
    b.add(req("a", 100, deadline_ms=2000, tpot_ms=100, strict=True))
    assert batch_ids(b.poll(0, load(tpot_ms=500, per_request=10))) == [["a"]]
    with pytest.raises(ValueError, match="tpot_headroom"):
        slo(tpot_headroom=1.5)
