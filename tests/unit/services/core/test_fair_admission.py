"""The fair queue wired into the scheduler (services/core/admission.py): a pool's room from
its engines' max_num_seqs, offers that bypass it while there is room, releases in the queue's
order as room frees, settlement at the end, cancel and drain, and a journal that replays it."""

from __future__ import annotations

import pytest

from schemas import messages as m
from schemas.messages import WorkerStatusReported
from services.core.admission import FairAdmissionConfig
from services.core.fairness import FairnessParams, Queued, Refused
from services.core.journal import Recorder, replay
from services.core.scheduler import AdmitRequest, Admitted, Rejected, Scheduler, SchedulerConfig

MS = 1_000_000


def worker(worker_id: str, model: str = "", max_num_seqs: int = 2, running: int = 0, role: str = "pd_fusion"):
    return WorkerStatusReported(worker_id=worker_id, role=role, boot_id="b0", block_size_tokens=16, num_kv_blocks=10_000,
                                num_free_kv_blocks=10_000, max_batch_tokens=65536, max_seq_len_tokens=8192, model=model,
                                max_num_seqs=max_num_seqs, num_running_requests=running)


def scheduler(*workers, buffer: int = 0, **params) -> Scheduler:
    cfg = SchedulerConfig(prefill_policy="round-robin", decode_policy="round-robin", model_name="base",
                          slo=SchedulerConfig().slo.__class__(mode="best-effort"),
                          fairness=FairAdmissionConfig(engine_buffer=buffer, params=FairnessParams(**params)))
    s = Scheduler(cfg, id_prefix="r-boot")
    for w in workers:
        s.on_worker_event(w, 0)
    return s


def req(rid: str, tenant: str = "", model: str = "", priority: int | None = None, cls: str = "", max_tokens: int = 4):
    return AdmitRequest(request_id=rid, num_prompt_tokens=10, max_tokens=max_tokens, model=model, tenant=tenant,
                        priority=priority, priority_class=cls)


def test_room_is_each_engines_max_num_seqs_plus_the_buffer_less_what_it_holds():
    s = scheduler(worker("w0", max_num_seqs=3), worker("w1", max_num_seqs=2), buffer=1)
    assert s.pool_room("base") == (3 + 1) + (2 + 1)
    for i in range(4):
        assert isinstance(s.offer(req(f"r{i}"), 0), Admitted)
    assert s.pool_room("base") == 7 - 4


def test_a_worker_without_max_num_seqs_makes_the_room_unknown_and_nothing_is_held():
    s = scheduler(worker("w0", max_num_seqs=1), worker("w1", max_num_seqs=0))
    assert s.pool_room("base") is None
    assert all(isinstance(s.offer(req(f"r{i}"), 0), Admitted) for i in range(20))
    assert s.fair.num_waiting() == 0


def test_work_beyond_the_room_waits_and_is_released_as_requests_end():
    s = scheduler(worker("w0", max_num_seqs=2))
    assert [type(s.offer(req(f"r{i}"), 0)).__name__ for i in range(4)] == ["Admitted", "Admitted", "Queued", "Queued"]
    assert s.release(1 * MS) == []  # no room yet
    s.on_terminal("r0", num_output_tokens=4)
    released = s.release(2 * MS)
    assert [(r.request_id, type(r.outcome).__name__) for r in released] == [("r2", "Admitted")]
    assert "r2" in s.inflight and s.fair.num_waiting() == 1


def test_once_a_queue_forms_a_new_arrival_waits_behind_it_even_if_room_frees():
    s = scheduler(worker("w0", max_num_seqs=1))
    s.offer(req("a"), 0)
    assert isinstance(s.offer(req("b"), 0), Queued)
    s.on_terminal("a", 4)  # room, but b waits: c must not overtake it
    assert isinstance(s.offer(req("c"), 1), Queued)
    assert [r.request_id for r in s.release(2)] == ["b"]


def test_release_order_is_fair_between_tenants_not_first_come():
    s = scheduler(worker("w0", max_num_seqs=1))
    s.offer(req("busy", tenant="noisy"), 0)
    for i in range(6):
        s.offer(req(f"n{i}", tenant="noisy"), i)
    s.offer(req("q0", tenant="quiet"), 10)
    order = []
    for t in range(8):
        running = next(iter(s.inflight))
        s.on_terminal(running, 4)
        order += [r.request_id for r in s.release(100 + t)]
    # The quiet tenant's one request goes second (after one noisy one has been charged), not last.
    assert order[:2] == ["n0", "q0"]


def test_a_critical_request_is_released_before_queued_standard_work():
    s = scheduler(worker("w0", max_num_seqs=1))
    s.offer(req("busy"), 0)
    s.offer(req("std", priority=50), 1)
    s.offer(req("crit", cls="critical"), 2)
    s.on_terminal("busy", 4)
    assert [r.request_id for r in s.release(3)] == ["crit"]


def test_refusals_carry_their_code_and_a_bad_class_is_a_value_error():
    s = scheduler(worker("w0", max_num_seqs=1), max_queued_per_tenant=1, max_queue_wait_ms=(1_000.0, 1_000.0, 500.0))
    s.offer(req("busy"), 0)
    assert isinstance(s.offer(req("a", tenant="t"), 0), Queued)
    refused = s.offer(req("b", tenant="t"), 0)
    assert isinstance(refused, Refused) and refused.code == "queue_full"
    expired = s.release(2_000 * MS)
    assert [(r.request_id, r.record.code) for r in expired] == [("a", "queue_timeout")]
    with pytest.raises(ValueError, match="priority class"):
        s.offer(req("c", cls="urgent"), 0)


def test_an_unknown_model_is_answered_by_admission_not_queued():
    s = scheduler(worker("w0", max_num_seqs=1))
    s.offer(req("busy"), 0)
    out = s.offer(req("x", model="gpt-9"), 0)
    assert isinstance(out, Rejected) and out.code == "model_not_found"


def test_each_pool_has_its_own_queue_and_room():
    s = scheduler(worker("a0", "a", max_num_seqs=1), worker("b0", "b", max_num_seqs=1))
    s.offer(req("a-busy", model="a"), 0)
    assert isinstance(s.offer(req("a-wait", model="a"), 0), Queued)
    assert isinstance(s.offer(req("b-now", model="b"), 0), Admitted)  # pool b is not held behind a's queue


def test_cancel_and_drain_take_requests_out_of_the_queue():
    s = scheduler(worker("w0", max_num_seqs=1))
    s.offer(req("busy"), 0)
    for rid in ("x", "y", "z"):
        s.offer(req(rid), 0)
    assert s.cancel_waiting("y", 5) is not None and s.cancel_waiting("y", 5) is None
    assert s.drain_waiting(6) == ["x", "z"]
    assert s.fair.num_waiting() == 0


def test_settlement_charges_the_tokens_a_request_produced():
    s = scheduler(worker("w0", max_num_seqs=1), w_out=2.0)
    s.offer(req("busy"), 0)
    s.offer(req("a", tenant="t", max_tokens=100), 0)
    s.offer(req("b", tenant="u", max_tokens=100), 0)  # keeps the class backlogged: t's counter is kept
    s.on_terminal("busy", 1)
    s.release(1)
    charged = s.fair.queue("base").counters("standard")["t"]
    assert charged == 10 + 2.0 * 100
    s.on_terminal("a", num_output_tokens=7)
    assert s.fair.queue("base").counters("standard")["t"] == 10 + 2.0 * 7
    assert "a" not in s.fair.dispatched


def test_a_journal_of_offers_and_releases_replays_identically():
    envelopes = m.EnvelopeFactory("router-t", "boot1")
    records: list[m.Envelope] = []

    def sink(op, now_ns, args, out):  # through the wire format, as the journal stream carries it
        records.append(m.decode(m.encode(envelopes.wrap(m.CoreRecorded(router_id="router-t", op=op, now_ns=now_ns,
                                                                      args=args, out=out), now_ns))))

    s = Recorder(scheduler(), sink)
    s.on_worker_event(worker("w0", max_num_seqs=2), 0)
    t = 0
    for i in range(30):
        t += MS
        s.offer(req(f"r{i}", tenant=f"t{i % 3}", priority=(20, 50, 80)[i % 3]), t)
        if i % 4 == 3:
            s.on_terminal(sorted(s.inflight)[0], num_output_tokens=i % 5)
            s.release(t)
    s.cancel_waiting(sorted(s.fair.waiting)[0], t)
    ops = {r.payload.op for r in records}
    assert {"offer", "release", "cancel_waiting", "on_terminal"} <= ops
    report = replay(records)
    assert report.errors == [] and report.first_divergence is None
    assert report.decisions > 30 and report.matched == report.decisions
    assert report.scheduler.fair.num_waiting() == s.fair.num_waiting()
