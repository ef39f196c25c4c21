"""Per-worker circuit breakers (services/core/breaker.py) and how admission reads them: a fake
clock, no I/O."""

from __future__ import annotations

import pytest

from services.core.breaker import CLOSED, HALF_OPEN, OPEN, BreakerParams, Breakers
from services.core.scheduler import Admitted, Rejected
from tests.unit.services.core.test_scheduler import make_scheduler, req

MS = 1_000_000


def fail(b: Breakers, wid: str, rid: str, now: int, code: str = "upstream_error", others_closed: bool = True):
    return b.outcome(wid, rid, False, code, "HTTP 500 from the engine server", now, others_closed)


def test_consecutive_failures_open_it_and_a_success_between_them_resets_the_count():
    b = Breakers(BreakerParams(failures_to_open=3))
    fail(b, "w0", "r1", 0)
    fail(b, "w0", "r2", 0)
    assert b.outcome("w0", "r3", True, "", "", 0, True) is None  # reset
    fail(b, "w0", "r4", 0)
    fail(b, "w0", "r5", 0)
    assert b.get("w0").state == CLOSED
    change = fail(b, "w0", "r6", 0)
    assert (change.from_state, change.to_state) == (CLOSED, OPEN) and change.num_failures == 3
    assert not b.admits("w0", 0) and b.admits("w1", 0)
    assert b.get("w0").last_error.startswith("upstream_error: HTTP 500")


@pytest.mark.parametrize("code", ["upstream_refused", "invalid_request", "cancelled", "timed_out", "too_large"])
def test_failures_the_server_did_not_cause_do_not_count(code):
    b = Breakers(BreakerParams(failures_to_open=2))
    for i in range(5):
        assert fail(b, "w0", f"r{i}", 0, code=code) is None
    assert b.is_closed("w0")


def test_open_then_one_probe_then_closed_on_its_success():
    b = Breakers(BreakerParams(failures_to_open=1, open_ms=1000))
    fail(b, "w0", "r1", 0)
    assert not b.admits("w0", 999 * MS)
    assert b.admits("w0", 1000 * MS)  # the probe is due
    assert b.placed("w0", "probe", 1000 * MS).to_state == HALF_OPEN
    assert not b.admits("w0", 1001 * MS)  # one probe at a time
    change = b.outcome("w0", "probe", True, "", "", 1200 * MS, True)
    assert (change.from_state, change.to_state) == (HALF_OPEN, CLOSED)
    assert b.admits("w0", 1200 * MS) and b.num_not_closed == 0


def test_a_failed_probe_reopens_it_with_the_back_off_doubled_up_to_its_cap():
    b = Breakers(BreakerParams(failures_to_open=1, open_ms=1000, max_open_ms=3000))
    fail(b, "w0", "r1", 0)
    now, waits = 0, []
    for i in range(4):
        br = b.get("w0")
        now = br.opened_ns + int(br.open_ms * MS)
        waits.append(br.open_ms)
        b.placed("w0", f"p{i}", now)
        assert fail(b, "w0", f"p{i}", now + 5 * MS).to_state == OPEN
    assert waits == [1000, 2000, 3000, 3000]
    b.placed("w0", "p9", now + 10_000 * MS)
    b.outcome("w0", "p9", True, "", "", now + 10_001 * MS, True)
    assert b.get("w0").open_ms == 1000  # closed: the back-off starts over


def test_the_last_closed_worker_of_a_pool_does_not_open():
    b = Breakers(BreakerParams(failures_to_open=2))
    for i in range(10):
        assert fail(b, "w0", f"r{i}", 0, others_closed=False) is None
    assert b.is_closed("w0") and b.get("w0").num_failures == 10


def test_a_probe_that_ends_without_an_answer_leaves_the_next_request_to_probe():
    b = Breakers(BreakerParams(failures_to_open=1, open_ms=5000))
    fail(b, "w0", "r1", 0)
    b.placed("w0", "probe", 5000 * MS)
    assert b.ended("someone-else") is None
    change = b.ended("probe")
    assert (change.from_state, change.to_state) == (HALF_OPEN, OPEN)
    assert b.admits("w0", 5001 * MS)  # due at once, no second back-off


def test_off_means_never_open_and_bad_parameters_are_refused():
    b = Breakers(BreakerParams(failures_to_open=0))
    for i in range(20):
        fail(b, "w0", f"r{i}", 0)
    assert b.is_closed("w0")
    with pytest.raises(ValueError, match="failures_to_open"):
        Breakers(BreakerParams(failures_to_open=-1))
    with pytest.raises(ValueError, match="open_ms"):
        Breakers(BreakerParams(open_ms=5000, max_open_ms=1000))


def test_the_last_error_echoed_is_bounded():
    b = Breakers(BreakerParams(failures_to_open=1))
    b.outcome("w0", "r", False, "upstream_error", "x" * 100_000, 0, True)
    assert len(b.get("w0").last_error) <= 200


# ------------------------------------------------------------------ through the scheduler
def test_admission_skips_an_open_worker_and_the_first_request_after_its_back_off_probes_it():
    s = make_scheduler(("w0", "w1", "w2"), breaker=BreakerParams(failures_to_open=2, open_ms=1000))
    for i in range(2):
        assert s.admit(req(f"f{i}"), 0).request.prefill_worker_id is not None
        s.on_outcome(f"f{i}", "w1", False, "upstream_error", "500", 0)
    assert s.breakers.get("w1").state == OPEN
    picks = {s.admit(req(f"r{i}"), 10 * MS).request.prefill_worker_id for i in range(9)}
    assert picks == {"w0", "w2"}
    probes = [s.admit(req(f"p{i}"), 1000 * MS).request.prefill_worker_id for i in range(3)]
    assert probes.count("w1") == 1 and s.breakers.get("w1").state == HALF_OPEN  # round-robin reached it once
    probe_id = f"p{probes.index('w1')}"
    assert s.breakers.get("w1").probe_request_id == probe_id
    assert s.on_outcome(probe_id, "w1", True, "", "", 1100 * MS).to_state == CLOSED
    assert [c.to_state for c in s.breakers.take_changes()] == [OPEN, HALF_OPEN, CLOSED]
    assert s.breakers.take_changes() == []


def test_a_worker_fails_every_request_but_the_pool_never_empties():
    s = make_scheduler(("w0", "w1"), breaker=BreakerParams(failures_to_open=1))
    s.on_outcome("a", "w0", False, "upstream_error", "500", 0)
    s.on_outcome("b", "w1", False, "upstream_error", "500", 0)  # w1 is the last closed one: stays
    assert s.breakers.get("w0").state == OPEN and s.breakers.is_closed("w1")
    assert isinstance(s.admit(req("r"), 1), Admitted)


def test_a_retry_excludes_the_workers_that_failed_it_and_says_so_when_none_is_left():
    s = make_scheduler(("w0", "w1"))
    assert s.admit(req("r", excluded_workers=("w0",)), 0).request.prefill_worker_id == "w1"
    res = s.admit(req("q", excluded_workers=("w0", "w1")), 0)
    assert isinstance(res, Rejected) and res.code == "no_worker" and "failed it before" in res.message


def test_a_probe_cancelled_at_the_router_frees_the_next_probe():
    s = make_scheduler(("w0", "w1"), breaker=BreakerParams(failures_to_open=1, open_ms=1000))
    s.on_outcome("a", "w0", False, "upstream_error", "500", 0)
    picks = [s.admit(req(f"r{i}"), 2000 * MS).request.prefill_worker_id for i in range(2)]
    probe = f"r{picks.index('w0')}"
    assert s.breakers.get("w0").state == HALF_OPEN
    s.on_terminal(probe)  # its client went away before the worker ran it
    assert s.breakers.get("w0").state == OPEN and s.breakers.admits("w0", 2001 * MS)


# ------------------------------------------------------------------ slow workers, shown
def report(s, wid: str, step_ms: float, now: int) -> None:
    from tests.unit.services.core.test_scheduler import status

    s.on_worker_event(status(wid, num_running_requests=8, num_free_kv_blocks=10_000 - 1024, recent_step_ms=step_ms), now)


def test_a_worker_stepping_3x_slower_than_its_peers_is_degraded_and_recovers_when_it_is_not():
    from services.core.scheduler import DEGRADED_RATIO

    s = make_scheduler(("w0", "w1", "w2", "w3"))
    now = 0
    for i in range(120):  # 24 s of reports: the model weighs the newest most, and has learned it
        now += 200 * MS
        for wid in ("w0", "w1", "w2", "w3"):
            report(s, wid, 90.0 if wid == "w3" else 30.0, now)
    ratios = s.step_ratios()
    assert ratios["w3"] >= DEGRADED_RATIO and all(0.8 < ratios[w] < 1.25 for w in ("w0", "w1", "w2")), ratios
    for i in range(300):  # its steps are its peers' again
        now += 200 * MS
        for wid in ("w0", "w1", "w2", "w3"):
            report(s, wid, 30.0, now)
    assert s.step_ratios()["w3"] < 1.25


def test_no_ratio_before_enough_reports_nor_in_a_pool_of_one():
    s = make_scheduler(("w0", "w1"))
    for i in range(5):
        report(s, "w0", 30.0, i * MS)
        report(s, "w1", 300.0, i * MS)
    assert s.step_ratios() == {}
    one = make_scheduler(("w0",))
    for i in range(40):
        report(one, "w0", 30.0, i * MS)
    assert one.step_ratios() == {}


def test_a_batch_whose_members_all_failed_before_its_prefill_leaves_its_worker():
    """A server that fails every request fast reports no prefill for its batches: each leaves
    once its last member has ended, so the worker is not held under backpressure for good."""
    s = make_scheduler(("w0", "w1"), end_unprefilled_batches=True)
    for i in range(4):
        s.admit(req(f"r{i}"), 0)
    batches = s.tick(5 * MS).batches
    on_w0 = next(b for b in batches if b.worker_id == "w0")
    first, second = [i.request_id for i in on_w0.items]
    s.on_outcome(first, "w0", False, "upstream_error", "500", 6 * MS)
    s.on_terminal(first)
    assert s.ledger.num_inflight_batches("w0") == 1  # one member still running
    s.on_terminal(second)
    assert s.ledger.num_inflight_batches("w0") == 0 and s.ledger.wait_ms("w0", 7 * MS) == 0.0
    assert s.ledger.num_inflight_batches("w1") == 1 and not s.ledger.request_to_batch.keys() & {first, second}
    on_w1 = next(b for b in batches if b.worker_id == "w1")
    assert s.on_prefill_completed("w1", on_w1.batch_id, 10.0, 0) is not None  # the normal way out, unchanged
    assert not s.ledger.request_to_batch
    old = make_scheduler(("w0", "w1"))  # a journal recorded before: replayed as it was (kept)
    for i in range(2):
        old.admit(req(f"r{i}"), 0)
    [b0, _] = sorted(old.tick(5 * MS).batches, key=lambda b: b.worker_id)
    for item in b0.items:
        old.on_terminal(item.request_id)
    assert old.ledger.num_inflight_batches("w0") == 1
