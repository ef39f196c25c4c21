"""The scheduler (pure core) with a fake clock: admission, routing, batching, learning."""

from __future__ import annotations

import pytest

from schemas.messages import KvBlocksStored, WorkerRegistered, WorkerStatusReported
from services.core.scheduler import AdmitRequest, Admitted, Rejected, Scheduler, SchedulerConfig, decision_seed
from services.core.slo import SloParams

MS = 1_000_000


def status(worker_id: str, role: str = "pd_fusion", boot: str = "b0", state: str = "ready", **kw) -> WorkerStatusReported:
    defaults = dict(block_size_tokens=16, num_kv_blocks=10_000, num_free_kv_blocks=10_000, max_batch_tokens=65536,
                    max_seq_len_tokens=8192)
    defaults.update(kw)
    return WorkerStatusReported(worker_id=worker_id, role=role, boot_id=boot, state=state, **defaults)


def make_scheduler(workers=("w0", "w1"), role="pd_fusion", now=0, **cfg) -> Scheduler:
    cfg.setdefault("prefill_policy", "round-robin")
    cfg.setdefault("decode_policy", "round-robin")
    cfg.setdefault("batcher_params", {"wait_ms": 5, "batch_size_max": 8})
    s = Scheduler(SchedulerConfig(**cfg), id_prefix="r-boot")
    for w in workers:
        s.on_worker_event(status(w, role), now)
    return s


def req(rid: str, n: int = 10, max_tokens: int = 4, hashes=(), **kw) -> AdmitRequest:
    return AdmitRequest(request_id=rid, num_prompt_tokens=n, max_tokens=max_tokens, block_hashes=tuple(hashes), **kw)


def test_round_robin_alternates_over_live_workers():
    s = make_scheduler(("w0", "w1", "w2"))
    picks = [s.admit(req(f"r{i}"), 0).request.prefill_worker_id for i in range(6)]
    assert picks == ["w0", "w1", "w2", "w0", "w1", "w2"]


def test_a_rejected_request_does_not_advance_the_policy():
    s = make_scheduler(("w0", "w1"), max_prompt_tokens=100)
    assert s.admit(req("a"), 0).request.prefill_worker_id == "w0"
    assert isinstance(s.admit(req("big", n=1000), 0), Rejected)
    assert s.admit(req("b"), 0).request.prefill_worker_id == "w1"


def test_decisions_are_reproducible_from_the_seed_and_sequence():
    def run(seed):
        s = make_scheduler(("w0", "w1", "w2"), prefill_policy="random", seed=seed)
        out = [s.admit(req(f"r{i}"), 0) for i in range(20)]
        return [(a.request.prefill_worker_id, [d.seed for d in a.decisions]) for a in out]

    assert run(5) == run(5)
    assert run(5) != run(6)
    assert {w for w, _ in run(5)} == {"w0", "w1", "w2"}
    assert decision_seed(5, 1) != decision_seed(5, 2)


@pytest.mark.parametrize(
    "setup,request_,code",
    [
        (dict(workers=()), req("r"), "no_worker"),
        (dict(max_prompt_tokens=100), req("r", n=101), "too_large"),
        (dict(), req("r", n=8000, max_tokens=500), "too_large"),  # beyond every worker's max sequence length
        (dict(max_inflight_requests=1), None, "queue_full"),  # second request over the global cap
        (dict(slo=SloParams(mode="reject")), req("r", n=100, slo_ttft_ms=1.0), "slo_unattainable"),
    ],
    ids=["no-worker", "prompt-over-limit", "over-max-seq-len", "global-cap", "slo-unattainable"],
)
def test_admission_rejects_with_a_code(setup, request_, code):
    s = make_scheduler(**setup)
    if request_ is None:
        assert isinstance(s.admit(req("first"), 0), Admitted)
        request_ = req("second")
    decision = s.admit(request_, 0)
    assert isinstance(decision, Rejected) and decision.code == code, decision


def test_an_unattainable_slo_is_admitted_as_best_effort_in_best_effort_mode():
    s = make_scheduler(slo=SloParams(mode="best-effort"))
    a = s.admit(req("r", n=100, slo_ttft_ms=1.0), 0)
    assert isinstance(a, Admitted) and a.best_effort and a.predicted_ttft_ms > 1.0
    b = s.admit(req("q", n=100), 0)
    assert not b.best_effort and b.slo_ttft_ms == 150.0  # <=256 tokens, priority 50


def test_a_request_marked_best_effort_is_served_late_rather_than_refused_in_any_mode():
    """AdmitRequest.best_effort (what-if's "serve this one" re-runs): admitted where its twin is
    refused, its deadline not strict; it keeps its own targets."""
    for mode in ("reject", "reject-explicit", "shed"):
        s = make_scheduler(slo=SloParams(mode=mode))
        assert isinstance(s.admit(req("r", n=100, slo_ttft_ms=1.0), 0), Rejected)
        a = s.admit(req("q", n=100, slo_ttft_ms=1.0, best_effort=True), 0)
        assert isinstance(a, Admitted) and a.best_effort and a.slo_ttft_ms == 1.0
        assert not a.request.strict_deadline


def test_duplicate_inflight_request_id_is_rejected_and_terminal_forgets_it():
    s = make_scheduler()
    assert isinstance(s.admit(req("r"), 0), Admitted)
    d = s.admit(req("r"), 0)
    assert isinstance(d, Rejected) and d.code == "duplicate_request"
    assert s.on_terminal("r") and not s.on_terminal("r")


def test_per_worker_queue_bound_gives_queue_full():
    s = make_scheduler(("w0",), max_queue_per_worker=2)
    assert all(isinstance(s.admit(req(f"r{i}"), 0), Admitted) for i in range(2))
    d = s.admit(req("r9"), 0)
    assert isinstance(d, Rejected) and d.code == "queue_full"


def test_missed_heartbeats_accumulate_across_sync_cycles_to_dead_then_expired():
    # The missed-sync counter lives across cycles (recreated every cycle, nothing would ever die).
    s = make_scheduler(("w0", "w1"), dead_after_missed_syncs=3, expire_after_ms=10_000)
    s.sync(0)  # the cycle that saw both initial reports
    states = []
    for cycle in range(1, 5):
        s.on_worker_event(status("w1"), cycle * 500 * MS)  # w1 keeps reporting, w0 is silent
        res = s.sync(cycle * 500 * MS)
        states.append((s.view.workers["w0"].liveness, s.view.workers["w0"].num_missed_syncs, res.dead))
    assert states == [("suspect", 1, []), ("suspect", 2, []), ("dead", 3, ["w0"]), ("dead", 4, [])]
    assert s.admit(req("r"), 2000 * MS).request.prefill_worker_id == "w1"
    assert s.view.readiness() == (True, "ok")
    s.on_worker_event(status("w0"), 2100 * MS)  # it came back before expiring
    assert s.view.workers["w0"].liveness == "ready" and s.view.workers["w0"].num_missed_syncs == 0


def test_a_suspect_worker_still_gets_work_a_dead_one_does_not():
    s = make_scheduler(("w0",), dead_after_missed_syncs=2)
    s.sync(0)
    s.sync(500 * MS)
    assert s.view.workers["w0"].liveness == "suspect"
    assert isinstance(s.admit(req("a"), 500 * MS), Admitted)
    res = s.sync(1000 * MS)
    assert res.dead == ["w0"] and [i.request_id for i in res.orphans] == ["a"]  # queued for it: handed back
    assert "a" not in s.inflight
    d = s.admit(req("b"), 1000 * MS)
    assert isinstance(d, Rejected) and d.code == "no_worker"
    assert s.view.readiness() == (False, "no live worker for role pd_fusion: w0 dead (no status for 2 liveness cycles)")


def test_an_expired_worker_is_removed_from_every_structure():
    s = make_scheduler(("w0", "w1"), expire_after_ms=2000, prefill_policy="cost-based")
    s.on_kv_event(KvBlocksStored(worker_id="w0", boot_id="b0", kv_seq=1, block_hashes=[1, 2, 3]))
    for i in range(4):
        s.admit(req(f"r{i}", hashes=[1, 2, 3]), 0)
    s.tick(10 * MS)
    assert "w0" in s.batchers and "w0" in s.predictors and "w0" in s.ledger.workers
    for cycle in range(1, 6):
        s.on_worker_event(status("w1"), cycle * 500 * MS)
        s.sync(cycle * 500 * MS)
    assert "w0" not in s.view.workers and "w0" not in s.batchers and "w0" not in s.predictors
    assert "w0" not in s.ledger.workers and "w0" not in s.index.workers()


def test_a_stale_report_replayed_at_router_start_is_no_sign_of_life():
    s = make_scheduler(())
    s.on_worker_event(status("ghost"), 0, stale=True)
    assert s.view.workers["ghost"].liveness == "dead"
    assert s.admit(req("r"), 0).code == "no_worker"
    s.on_worker_event(status("ghost"), 1)  # a fresh report: alive after all
    assert isinstance(s.admit(req("r"), 1), Admitted)


def test_draining_worker_gets_no_new_work():
    s = make_scheduler(("w0", "w1"))
    s.on_worker_event(status("w0", state="draining"), 0)
    assert {s.admit(req(f"r{i}"), 0).request.prefill_worker_id for i in range(4)} == {"w1"}


def test_disaggregated_mode_picks_decode_first_then_prefill():
    s = make_scheduler(("p0", "p1"), role="prefill")
    for w in ("d0", "d1"):
        s.on_worker_event(status(w, "decode"), 0)
    out = [s.admit(req(f"r{i}"), 0) for i in range(4)]
    assert [(a.request.prefill_worker_id, a.request.decode_worker_id) for a in out] == [
        ("p0", "d0"), ("p1", "d1"), ("p0", "d0"), ("p1", "d1")
    ]
    assert [d.stage for d in out[0].decisions] == ["decode", "prefill"]
    assert s.view.roles_in_use() == {"prefill", "decode"}


def test_pd_mode_without_decode_workers_is_not_ready_and_rejects():
    s = make_scheduler(("p0",), role="prefill")
    assert s.view.readiness() == (False, "no live worker for role decode")
    assert s.admit(req("r"), 0).code == "no_worker"


def test_tick_closes_due_batches_with_unique_ids_and_tracks_them_inflight():
    s = make_scheduler(("w0", "w1"))
    for i in range(4):
        s.admit(req(f"r{i}"), 0)
    assert s.tick(4 * MS).batches == []
    assert s.next_due_ns(4 * MS) == 5 * MS
    batches = s.tick(5 * MS).batches
    assert sorted((b.worker_id, [i.request_id for i in b.items]) for b in batches) == [
        ("w0", ["r0", "r2"]), ("w1", ["r1", "r3"])
    ]
    assert len({b.batch_id for b in batches}) == 2 and all(b.batch_id.startswith("r-boot-") for b in batches)
    assert s.ledger.num_inflight_batches("w0") == 1 and s.ledger.num_pending_requests("w0") == 4  # 2 batch + 2 KV


def test_queued_past_the_enqueue_deadline_times_out():
    s = make_scheduler(("w0",), batcher_params={"wait_ms": 10, "max_inflight_batches": 1, "enqueue_deadline_ms": 100})
    s.admit(req("a"), 0)
    assert len(s.tick(10 * MS).batches) == 1  # a goes; the worker now has 1 inflight batch
    s.admit(req("b"), 20 * MS)
    assert s.tick(50 * MS).batches == []  # backpressure holds b
    res = s.tick(121 * MS)
    assert [(f.item.request_id, f.code) for f in res.failures] == [("b", "queue_timeout")]
    assert "b" not in s.inflight


def test_wait_estimate_learns_from_batch_started_and_prefill_completed():
    s = make_scheduler(("w0",))
    s.admit(req("a", n=1000), 0)
    [b] = s.tick(5 * MS).batches
    assert s.ledger.wait_ms("w0", 6 * MS) == pytest.approx(b.predicted_ms)
    s.on_batch_started("w0", b.batch_id, 10 * MS)
    assert s.ledger.wait_ms("w0", 40 * MS) == pytest.approx(b.predicted_ms - 30)
    before = s.predictors["w0"].num_observations
    assert s.on_prefill_completed("w0", b.batch_id, measured_ms=200.0, num_cached_tokens=0) is not None
    assert s.predictors["w0"].num_observations == before + 1
    assert s.ledger.wait_ms("w0", 40 * MS) == 0


def test_cost_based_follows_the_prefix_cache_reported_by_kv_events():
    s = make_scheduler(("w0", "w1", "w2"), prefill_policy="cost-based")
    hashes = list(range(100, 164))  # a 1,024-token prompt in 16-token blocks
    s.on_kv_event(KvBlocksStored(worker_id="w2", boot_id="b0", kv_seq=1, block_hashes=hashes))
    a = s.admit(req("r", n=1024, hashes=hashes), 0)
    assert a.request.prefill_worker_id == "w2"
    assert a.request.num_cached_tokens == 1024 - 16  # full hit: the last block is recomputed
    card = {c["worker_id"] if isinstance(c, dict) else c.worker_id: c for c in a.prefill_pick.scores}
    assert card["w2"].score > card["w0"].score  # (higher is better: the least cost over its own)


def test_kv_aware_decode_skips_a_worker_without_room():
    s = make_scheduler(("p0",), role="prefill", decode_policy="kv-aware")
    s.on_worker_event(status("d0", "decode", num_free_kv_blocks=1), 0)
    s.on_worker_event(status("d1", "decode"), 0)
    for i in range(10):
        assert s.admit(req(f"r{i}", n=200), 0).request.decode_worker_id == "d1"


def test_a_restarted_worker_is_counted():
    s = make_scheduler(("w0",))
    s.on_worker_event(status("w0", boot="b1"), 10)
    assert s.view.workers["w0"].num_restarts == 1
    s.on_worker_event(WorkerRegistered(worker_id="w0", role="pd_fusion", boot_id="b2", engine="sim", pid=1, host="h",
                                       block_size_tokens=16, num_kv_blocks=10, max_batch_tokens=64,
                                       max_seq_len_tokens=128, heartbeat_interval_ms=200), 20)
    assert s.view.workers["w0"].num_restarts == 2


def test_drain_queues_empties_batchers_inflight_and_reservations():
    s = make_scheduler()
    for i in range(3):
        s.admit(req(f"r{i}"), 0)
    drained = s.drain_queues()
    assert sorted(i.request_id for i in drained) == ["r0", "r1", "r2"]
    assert s.inflight == set() and s.next_due_ns(0) is None
    assert all(s.ledger.num_pending_requests(w) == 0 for w in ("w0", "w1"))


def test_bad_configuration_fails_at_construction():
    with pytest.raises(ValueError, match="unknown prefill policy"):
        make_scheduler(prefill_policy="best-ever")
    with pytest.raises(ValueError):
        make_scheduler(batcher="magic")
    with pytest.raises(ValueError, match="prefix_index"):
        make_scheduler(prefix_index="fuzzy")


def test_a_prompt_beyond_every_workers_batch_capacity_is_rejected_at_arrival_not_after_queueing():
    s = make_scheduler(("w0",))
    s.on_worker_event(status("w0", max_batch_tokens=1000), 0)
    d = s.admit(req("big", n=1001), 0)
    assert isinstance(d, Rejected) and d.code == "too_large" and "batch capacity" in d.message
    assert isinstance(s.admit(req("ok", n=1000), 0), Admitted)


def test_a_prefix_being_prefilled_attracts_the_next_request_with_it():
    s = make_scheduler(("w0", "w1", "w2", "w3"), prefill_policy="cost-based")
    hashes = list(range(500, 564))
    first = s.admit(req("a", n=1024, hashes=hashes), 0)
    # No KV event yet (a is still queued), but the next request with the same prefix follows it.
    second = s.admit(req("b", n=1024, hashes=hashes), 1 * MS)
    assert second.request.prefill_worker_id == first.request.prefill_worker_id
    assert second.request.num_cached_tokens == 1024 - 16
    # ... and stops doing so once the pending entry expired without confirmation.
    s2 = make_scheduler(("w0", "w1"), prefill_policy="cost-based", pending_prefix_ttl_ms=10)
    s2.admit(req("a", n=1024, hashes=hashes), 0)
    assert s2.admit(req("b", n=1024, hashes=hashes), 20 * MS).request.num_cached_tokens == 0


def test_pending_counts_each_request_once_plus_unknown_engine_tasks():
    """FlexLB's pending = our requests on the worker + engine tasks we don't know. A request
    routed to a colocated worker is queued AND holds a decode reservation there: one request."""
    s = make_scheduler(workers=("w0",), prefill_policy="round-robin")
    for i in range(3):
        assert isinstance(s.admit(req(f"r{i}", n=100), 1), Admitted)
    cand = s._prefill_candidates(s.view.live(), req("probe", n=100), 2)[0]
    assert cand.num_pending == 3
    # The worker reports r0 running (visible) plus two tasks we never sent (e.g. from before a restart).
    s.on_worker_event(status("w0", num_running_requests=3, running_request_ids=["r0"]), 3)
    cand = s._prefill_candidates(s.view.live(), req("probe", n=100), 4)[0]
    assert cand.num_pending == 3 + 2
    s.on_terminal("r0")
    cand = s._prefill_candidates(s.view.live(), req("probe", n=100), 5)[0]
    assert cand.num_pending == 2 + 3 - 0  # r1, r2 ours; 3 reported running, none visible any more: 3 unknown


def test_calibration_settles_a_running_request_the_worker_stops_reporting():
    """Status reports are authoritative: a request the worker reported running and then
    leaves out of 2 consecutive reports is settled (its terminal event was lost); one it
    never reported is not (its dispatch may still be on the way), nor one back in time."""
    s = make_scheduler(workers=("w0",))
    for rid in ("lost", "kept", "unseen"):
        assert isinstance(s.admit(req(rid, n=100), 1), Admitted)
    s.on_worker_event(status("w0", num_running_requests=2, running_request_ids=["lost", "kept"]), 2)
    assert s.take_settled() == []
    s.on_worker_event(status("w0", num_running_requests=1, running_request_ids=["kept"]), 3)
    assert s.take_settled() == []  # one report without it: maybe its terminal event is on the way
    s.on_worker_event(status("w0", num_running_requests=1, running_request_ids=["kept", "lost"]), 4)
    s.on_worker_event(status("w0", num_running_requests=1, running_request_ids=["kept"]), 5)
    assert s.take_settled() == []  # the count restarted when it was reported again
    s.on_worker_event(status("w0", num_running_requests=1, running_request_ids=["kept"]), 6)
    assert s.take_settled() == [("w0", "lost")] and s.take_settled() == []
    assert s.ledger.request_to_worker.keys() == {"kept", "unseen"}
    w = s.ledger.workers["w0"]
    assert w.num_visible == 1 and w.hidden_hard_kv_tokens == 100  # only "unseen" is still hidden
    # A stale report (replayed at a router restart) is no evidence either way.
    s.on_worker_event(status("w0", running_request_ids=[]), 7, stale=True)
    s.on_worker_event(status("w0", running_request_ids=[]), 8, stale=True)
    assert s.take_settled() == []


# --------------------------------------------------------------------------- shed mode
def test_shed_refuses_an_unattainable_ttft_and_admits_an_attainable_one():
    s = make_scheduler(("w0",), slo=SloParams(mode="shed"))
    hopeless = s.admit(req("hopeless", n=100, slo_ttft_ms=1.0), 0)
    assert isinstance(hopeless, Rejected) and hopeless.code == "slo_unattainable" and "TTFT" in hopeless.message
    assert isinstance(s.admit(req("fine", n=100, slo_ttft_ms=60_000), 0), Admitted)


def test_shed_refuses_new_work_while_the_workers_steps_exceed_the_tpot_guard():
    s = make_scheduler(("w0",), slo=SloParams(mode="shed", tpot_guard=0.9))
    s.on_worker_event(status("w0", recent_step_ms=95.0), 0)  # above 0.9 x 100 ms
    slow = s.admit(req("slow", slo_tpot_ms=100.0), 0)
    assert isinstance(slow, Rejected) and slow.code == "slo_unattainable" and "TPOT" in slow.message
    # a looser target, or a faster worker, admits
    assert isinstance(s.admit(req("loose", slo_tpot_ms=200.0), 0), Admitted)
    s.on_worker_event(status("w0", recent_step_ms=60.0), 0)
    assert isinstance(s.admit(req("fast", slo_tpot_ms=100.0), 0), Admitted)
    # best-effort ignores the step time
    b = make_scheduler(("w0",), slo=SloParams(mode="best-effort"))
    b.on_worker_event(status("w0", recent_step_ms=500.0), 0)
    assert isinstance(b.admit(req("any", slo_tpot_ms=100.0), 0), Admitted)


def test_shed_with_bucket_targets_refuses_load_induced_misses_but_admits_inherently_slow_prompts():
    s = make_scheduler(("w0",), slo=SloParams(mode="shed"), max_prompt_tokens=8000)
    # 7,000 tokens at priority 70: its prefill alone (~0.66 s) exceeds its 1,200 x 0.5 ms
    # bucket target: the bucket is wrong for it, not the load
    slow = s.admit(req("slow-prompt", n=7000, max_tokens=1, priority=70), 0)
    assert isinstance(slow, Admitted) and slow.best_effort
    assert [b.worker_id for b in s.tick(10 * MS).batches] == ["w0"]  # dispatched: w0 now has ~0.66 s to go
    # 100 tokens (150 ms bucket) would fit alone, but behind the big one it cannot: shed
    behind = s.admit(req("behind", n=100), 10 * MS)
    assert isinstance(behind, Rejected) and behind.code == "slo_unattainable", behind
    assert isinstance(make_scheduler(("w0",), max_prompt_tokens=8000).admit(req("x", n=7000), 0), Admitted)


def test_the_default_refuses_only_requests_that_set_an_unattainable_ttft_themselves():
    s = make_scheduler(("w0",), max_prompt_tokens=8000)
    assert s.config.slo.mode == "reject-explicit"
    hopeless = s.admit(req("hopeless", n=100, slo_ttft_ms=1.0), 0)
    assert isinstance(hopeless, Rejected) and hopeless.code == "slo_unattainable"
    # bucket targets: admitted best-effort, whether the prompt is inherently slow ...
    slow = s.admit(req("slow-prompt", n=7000, max_tokens=1, priority=70), 0)
    assert isinstance(slow, Admitted) and slow.best_effort
    assert [b.worker_id for b in s.tick(10 * MS).batches] == ["w0"]
    # ... or queued behind it (shed would refuse this one)
    behind = s.admit(req("behind", n=100), 10 * MS)
    assert isinstance(behind, Admitted) and behind.best_effort


def test_the_shed_tpot_guard_is_off_by_default_and_reads_the_decoding_worker_in_pd():
    s = make_scheduler(("w0",), slo=SloParams(mode="shed"))
    s.on_worker_event(status("w0", recent_step_ms=500.0), 0)
    assert isinstance(s.admit(req("guard-off", slo_tpot_ms=100.0), 0), Admitted)
    pd = Scheduler(SchedulerConfig(prefill_policy="round-robin", decode_policy="round-robin",
                                   slo=SloParams(mode="shed", tpot_guard=0.9)), id_prefix="r-boot")
    pd.on_worker_event(status("p0", "prefill", recent_step_ms=400.0), 0)  # prefill chunks: nobody decodes there
    pd.on_worker_event(status("d0", "decode", recent_step_ms=40.0), 0)
    assert isinstance(pd.admit(req("ok", slo_ttft_ms=60_000, slo_tpot_ms=100.0), 0), Admitted)
    pd.on_worker_event(status("d0", "decode", recent_step_ms=95.0), 0)
    refused = pd.admit(req("refused", slo_ttft_ms=60_000, slo_tpot_ms=100.0), 0)
    assert isinstance(refused, Rejected) and "d0" in refused.message and "TPOT" in refused.message


def test_kv_held_only_by_the_prefix_cache_counts_as_available_for_decode_placement():
    # A decode worker whose free blocks ran out but whose blocks are almost all evictable
    # cache (finished requests' prompts) takes new work: the engine evicts on demand.
    pd = Scheduler(SchedulerConfig(prefill_policy="round-robin"), id_prefix="r-boot")  # decode: kv-aware (default)
    pd.on_worker_event(status("p0", "prefill"), 0)
    pd.on_worker_event(status("d0", "decode", num_free_kv_blocks=100, num_cached_kv_blocks=9_800), 0)
    a = pd.admit(req("r", n=160, slo_ttft_ms=60_000), 0)
    assert isinstance(a, Admitted) and a.request.decode_worker_id == "d0"
    # without the cache those 9,800 blocks are used: 98 % > max_kv_usage 0.9, so gated
    full = Scheduler(SchedulerConfig(prefill_policy="round-robin"), id_prefix="r-boot")  # decode: kv-aware (default)
    full.on_worker_event(status("p0", "prefill"), 0)
    full.on_worker_event(status("d0", "decode", num_free_kv_blocks=100), 0)
    refused = full.admit(req("r", n=160, slo_ttft_ms=60_000), 0)
    assert isinstance(refused, Rejected) and refused.code == "no_worker", refused


def test_the_gates_and_expected_output_are_the_policies_parameters_as_the_settings_give_them():
    """cost-based's pending_gate_* and kv-aware's max_kv_usage / kv_usage_hysteresis /
    expected_output_cap act where the README says (they were once validated but ignored)."""
    from services.settings import RouterSettings

    def pick_after(gate_high: int) -> str:
        cfg = RouterSettings(prefill_policy="cost-based", prefill_policy_params={"pending_gate_high": gate_high},
                             batcher="fixed-window", batcher_params={"wait_ms": 1000, "batch_size_max": 64}).scheduler_config()
        s = Scheduler(cfg, id_prefix="r-boot")
        s.on_worker_event(status("w0", num_running_requests=5), 0)
        s.on_worker_event(status("w1", num_running_requests=3), 0)
        hashes = tuple(range(1, 201))  # 3,200 tokens, every block cached on w0: much cheaper there
        s.on_kv_event(KvBlocksStored(worker_id="w0", boot_id="b0", kv_seq=1, block_hashes=list(hashes)))
        a = s.admit(req("x", n=3200, hashes=hashes), 0)
        assert isinstance(a, Admitted)
        return a.request.prefill_worker_id

    assert pick_after(64) == "w0"  # the prefix hit
    assert pick_after(5) == "w1"  # w0's 5 pending close its gate at 5

    def decode_pick(params: dict) -> Admitted | Rejected:
        cfg = RouterSettings(prefill_policy="round-robin", decode_policy="kv-aware",
                             decode_policy_params=params).scheduler_config()
        s = Scheduler(cfg, id_prefix="r-boot")
        s.on_worker_event(status("p0", "prefill"), 0)
        s.on_worker_event(status("d0", "decode", num_free_kv_blocks=2_000), 0)  # 80 % used
        return s.admit(req("y", n=160, slo_ttft_ms=60_000), 0)

    assert isinstance(decode_pick({}), Admitted)
    assert isinstance(refused := decode_pick({"max_kv_usage": 0.75}), Rejected) and refused.code == "no_worker"

    def expected_kv(cap: int) -> int:
        cfg = RouterSettings(decode_policy_params={"expected_output_cap": cap}).scheduler_config()
        s = Scheduler(cfg, id_prefix="r-boot")
        s.on_worker_event(status("w0"), 0)
        assert isinstance(s.admit(req("z", n=100, max_tokens=500), 0), Admitted)
        return s.ledger.worker("w0").reservations["z"].expected_kv_tokens

    assert (expected_kv(1000), expected_kv(50)) == (600, 150)


def test_fields_only_an_openai_engine_honours_route_to_such_workers_or_are_refused_naming_them():
    """AdmitRequest.engine_fields (a body's logprobs, response_format, unknown fields): only a
    worker whose engine takes OpenAI bodies (signals.protocol openai) may run it; a pool of
    FlexLB's own engines refuses it, 400 invalid_request naming the fields."""
    from schemas.messages import EngineSignals

    native = make_scheduler(("w0", "w1"))
    r = native.admit(req("a", engine_fields=("logprobs", "response_format")), 0)
    assert isinstance(r, Rejected) and r.code == "invalid_request"
    assert "logprobs, response_format" in r.message and "--engine openai" in r.message
    assert isinstance(native.admit(req("b"), 0), Admitted)  # (a request without them runs anywhere)

    mixed = make_scheduler(("w0",))
    mixed.on_worker_event(status("w1", signals=EngineSignals(protocol="openai", metrics="vllm")), 0)
    mixed.on_worker_event(status("w2", signals=EngineSignals(protocol="sglang", metrics="sglang")), 0)
    picks = {mixed.admit(req(f"r{i}", engine_fields=("logprobs",)), 0).request.prefill_worker_id for i in range(6)}
    assert picks == {"w1"}
    assert {mixed.admit(req(f"p{i}"), 0).request.prefill_worker_id for i in range(6)} == {"w0", "w1", "w2"}


def test_an_embeddings_request_goes_only_to_workers_whose_server_serves_embeddings_or_is_refused_saying_so():
    """AdmitRequest.embeddings (POST /v1/embeddings): only workers whose engine server answers
    /v1/embeddings (signals.embeddings) are candidates; none: 400 invalid_request saying so.
    The journal keeps the flag, so a replay routes it the same way."""
    from schemas.messages import EngineSignals
    from services.core.journal import _request_out, request_from_builtins

    native = make_scheduler(("w0", "w1"))
    r = native.admit(req("a", embeddings=True), 0)
    assert isinstance(r, Rejected) and r.code == "invalid_request" and "no live worker serves embeddings" in r.message

    mixed = make_scheduler(("w0",))
    mixed.on_worker_event(status("w1", signals=EngineSignals(protocol="openai", metrics="none", embeddings=True)), 0)
    mixed.on_worker_event(status("w2", signals=EngineSignals(protocol="openai", metrics="vllm")), 0)
    picks = {mixed.admit(req(f"e{i}", embeddings=True), 0).request.prefill_worker_id for i in range(6)}
    assert picks == {"w1"}
    assert {mixed.admit(req(f"g{i}"), 0).request.prefill_worker_id for i in range(6)} == {"w0", "w1", "w2"}
    back = request_from_builtins(_request_out(req("j", embeddings=True)))
    assert back.embeddings and not request_from_builtins(_request_out(req("k"))).embeddings
