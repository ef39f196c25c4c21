"""The inflight mirror: FlexLB's wait rule, calibration, and no negative reservations."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.core.inflight import DecodeReservation, InflightBatch, InflightLedger

MS = 1_000_000


def batch(bid: str, worker: str = "w", predicted_ms: float = 100.0, n: int = 2) -> InflightBatch:
    return InflightBatch(bid, worker, predicted_ms, [f"{bid}-r{i}" for i in range(n)], [(100, 0)] * n, dispatched_ns=0)


def test_queued_batches_do_not_burn_time_started_ones_do():
    led = InflightLedger()
    led.add_batch(batch("b1", predicted_ms=100))
    led.add_batch(batch("b2", predicted_ms=50))
    assert led.wait_ms("w", 500 * MS) == 150  # nothing started: full prediction, however long ago dispatched
    led.start_batch("w", "b1", 1000 * MS)
    assert led.wait_ms("w", 1040 * MS) == 110
    assert led.wait_ms("w", 2000 * MS) == 0  # never negative
    led.complete_batch("w", "b1")
    assert led.wait_ms("w", 1040 * MS) == 50
    assert led.num_inflight_batches("w") == 1 and led.num_pending_requests("w") == 2


def test_reservations_count_until_the_worker_reports_them_then_never_twice():
    led = InflightLedger()
    led.reserve(DecodeReservation("r1", "d", hard_kv_tokens=100, expected_kv_tokens=300, created_ns=0))
    led.reserve(DecodeReservation("r2", "d", hard_kv_tokens=50, expected_kv_tokens=70, created_ns=0))
    assert led.hidden_kv("d") == (150, 370)
    assert led.calibrate("d", ["r1", "unknown"]) == []  # r1 visible now; r2 never reported: not settled
    assert led.hidden_kv("d") == (50, 70)
    assert led.calibrate("d", ["r1"]) == []  # already visible
    assert led.hidden_kv("d") == (50, 70)
    assert led.release("r1") is not None and led.release("r1") is None
    assert led.hidden_kv("d") == (50, 70)
    led.release("r2")
    assert led.hidden_kv("d") == (0, 0) and led.num_pending_requests("d") == 0


def test_adding_the_same_batch_or_reservation_twice_changes_nothing():
    led = InflightLedger()
    assert led.add_batch(batch("b")) and not led.add_batch(batch("b"))
    r = DecodeReservation("r", "d", 10, 20, 0)
    assert led.reserve(r) and not led.reserve(r)
    assert led.num_pending_requests("w") == 2 and led.hidden_kv("d") == (10, 20)


ops = st.lists(
    st.one_of(
        st.tuples(st.just("reserve"), st.integers(0, 9), st.integers(0, 2), st.integers(1, 500), st.integers(0, 500)),
        st.tuples(st.just("release"), st.integers(0, 9)),
        st.tuples(st.just("calibrate"), st.integers(0, 2), st.lists(st.integers(0, 9), max_size=5)),
        st.tuples(st.just("add_batch"), st.integers(0, 5), st.integers(0, 2)),
        st.tuples(st.just("complete"), st.integers(0, 5), st.integers(0, 2)),
        st.tuples(st.just("remove_worker"), st.integers(0, 2)),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_reservations_and_counts_never_go_negative_and_match_a_recount(steps):
    led = InflightLedger()
    for op in steps:
        if op[0] == "reserve":
            _, r, w, hard, extra = op
            led.reserve(DecodeReservation(f"r{r}", f"w{w}", hard, hard + extra, 0))
        elif op[0] == "release":
            led.release(f"r{op[1]}")
        elif op[0] == "calibrate":
            led.calibrate(f"w{op[1]}", [f"r{i}" for i in op[2]])
        elif op[0] == "add_batch":
            led.add_batch(batch(f"b{op[1]}", f"w{op[2]}"))
        elif op[0] == "complete":
            led.complete_batch(f"w{op[2]}", f"b{op[1]}")
        else:
            led.remove_worker(f"w{op[1]}")
        for wid, w in led.workers.items():
            hidden = [r for r in w.reservations.values() if not r.visible]
            assert w.hidden_hard_kv_tokens == sum(r.hard_kv_tokens for r in hidden) >= 0
            assert w.hidden_expected_kv_tokens == sum(r.expected_kv_tokens for r in hidden) >= 0
            assert w.num_batch_requests == sum(len(b.request_ids) for b in w.batches.values()) >= 0
            assert w.num_visible == sum(r.visible for r in w.reservations.values()) >= 0
            assert w.predicted_ms_total == pytest.approx(sum(b.predicted_ms for b in w.batches.values()))
            assert all(led.request_to_worker[rid] == wid for rid in w.reservations)
        assert set(led.request_to_worker) == {rid for w in led.workers.values() for rid in w.reservations}
