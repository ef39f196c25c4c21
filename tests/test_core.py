"""The pure core with a fake clock and a seeded RNG: view, policies, batcher, admission."""

from __future__ import annotations

import random

import pytest

from schemas.messages import WorkerRegistered, WorkerStatusReported
from services.core.batcher import FixedWindowBatcher, FixedWindowParams
from services.core.policies import UnknownPolicyError, build_policy
from services.core.scheduler import Admitted, QueuedRequest, Rejected, Scheduler, SchedulerConfig

MS = 1_000_000


def status(worker_id: str, role: str = "pd_fusion", boot: str = "b0", state: str = "ready", **kw) -> WorkerStatusReported:
    defaults = dict(block_size_tokens=16, num_kv_blocks=1000, num_free_kv_blocks=1000, max_batch_tokens=4096,
                    max_seq_len_tokens=8192)
    defaults.update(kw)
    return WorkerStatusReported(worker_id=worker_id, role=role, boot_id=boot, state=state, **defaults)


def make_scheduler(workers=("w0", "w1"), role="pd_fusion", now=0, prefill="round-robin", decode="round-robin", **cfg):
    s = Scheduler(SchedulerConfig(**cfg), build_policy("prefill", prefill), build_policy("decode", decode), id_prefix="r-boot")
    for w in workers:
        s.on_worker_event(status(w, role), now)
    return s


def item(rid: str, tokens: int, t_ns: int) -> QueuedRequest:
    return QueuedRequest(rid, tokens, 8, t_ns, "w0", "w0")


# ------------------------------------------------------------------ batcher
def test_window_closes_when_the_head_has_waited_wait_ms():
    b = FixedWindowBatcher(FixedWindowParams(wait_ms=10, batch_size_max=8), max_batch_tokens=10_000)
    b.add(item("a", 10, 0))
    b.add(item("b", 10, 3 * MS))
    assert b.poll(9 * MS) == []
    assert b.next_due_ns() == 10 * MS
    [closed] = b.poll(10 * MS)
    assert [i.request_id for i in closed.items] == ["a", "b"] and closed.reason == "window"
    assert len(b) == 0 and b.next_due_ns() is None


def test_a_full_queue_closes_at_once_and_the_rest_waits():
    b = FixedWindowBatcher(FixedWindowParams(wait_ms=1000, batch_size_max=3), max_batch_tokens=10_000)
    for i in range(5):
        b.add(item(f"r{i}", 10, i))
    assert b.next_due_ns() == 0  # due now
    [closed] = b.poll(5)
    assert [i.request_id for i in closed.items] == ["r0", "r1", "r2"] and closed.reason == "full"
    assert len(b) == 2 and b.next_due_ns() == 3 + 1000 * MS


def test_token_capacity_bounds_a_batch_but_the_head_always_goes():
    b = FixedWindowBatcher(FixedWindowParams(wait_ms=0, batch_size_max=8), max_batch_tokens=100)
    for rid, n in [("big", 500), ("x", 60), ("y", 50), ("z", 30)]:
        b.add(item(rid, n, 0))
    batches = b.poll(0)
    assert [[i.request_id for i in c.items] for c in batches] == [["big"], ["x"], ["y", "z"]]


def test_drain_returns_every_queued_item_so_none_is_lost():
    b = FixedWindowBatcher(FixedWindowParams(wait_ms=50, batch_size_max=8), max_batch_tokens=100)
    for i in range(4):
        b.add(item(f"r{i}", 1, 0))
    assert [i.request_id for i in b.drain()] == ["r0", "r1", "r2", "r3"]
    assert len(b) == 0


def test_batcher_parameters_are_validated():
    with pytest.raises(ValueError):
        FixedWindowParams(wait_ms=-1)
    with pytest.raises(ValueError):
        FixedWindowParams(batch_size_max=0)


# ------------------------------------------------------------------ policies and admission
def test_round_robin_alternates_over_live_workers():
    s = make_scheduler(("w0", "w1", "w2"))
    rng = random.Random(1)
    picks = [s.admit(f"r{i}", 10, 4, 0, rng).prefill_pick.worker_id for i in range(6)]
    assert picks == ["w0", "w1", "w2", "w0", "w1", "w2"]


def test_a_rejected_request_does_not_advance_the_policy():
    s = make_scheduler(("w0", "w1"), max_prompt_tokens=100)
    rng = random.Random(1)
    assert s.admit("a", 10, 4, 0, rng).prefill_pick.worker_id == "w0"
    assert isinstance(s.admit("big", 1000, 4, 0, rng), Rejected)
    assert s.admit("b", 10, 4, 0, rng).prefill_pick.worker_id == "w1"


def test_random_policy_is_reproducible_from_the_seed():
    def run(seed):
        s = make_scheduler(("w0", "w1", "w2"), prefill="random")
        rng = random.Random(seed)
        return [s.admit(f"r{i}", 10, 4, 0, rng).prefill_pick.worker_id for i in range(20)]

    assert run(5) == run(5)
    assert set(run(5)) == {"w0", "w1", "w2"}


@pytest.mark.parametrize(
    "setup,args,code",
    [
        (dict(workers=()), ("r", 10, 4), "no_worker"),
        (dict(max_prompt_tokens=100), ("r", 101, 4), "too_large"),
        (dict(), ("r", 8000, 500), "too_large"),  # beyond every worker's max sequence length
        (dict(max_inflight_requests=0), ("r", 10, 4), "queue_full"),
    ],
    ids=["no-worker", "prompt-over-limit", "over-max-seq-len", "global-cap"],
)
def test_admission_rejects_with_a_code(setup, args, code):
    s = make_scheduler(**setup)
    decision = s.admit(*args, now_ns=0, rng=random.Random(0))
    assert isinstance(decision, Rejected) and decision.code == code, decision


def test_duplicate_inflight_request_id_is_rejected():
    s = make_scheduler()
    assert isinstance(s.admit("r", 10, 4, 0, random.Random(0)), Admitted)
    d = s.admit("r", 10, 4, 0, random.Random(0))
    assert isinstance(d, Rejected) and d.code == "duplicate_request"
    assert s.on_terminal("r") and not s.on_terminal("r")


def test_per_worker_queue_bound_gives_queue_full():
    s = make_scheduler(("w0",), max_queue_per_worker=2)
    rng = random.Random(0)
    assert all(isinstance(s.admit(f"r{i}", 10, 4, 0, rng), Admitted) for i in range(2))
    d = s.admit("r9", 10, 4, 0, rng)
    assert isinstance(d, Rejected) and d.code == "queue_full"


def test_a_silent_worker_stops_receiving_work_and_readiness_says_why():
    s = make_scheduler(("w0", "w1"), worker_timeout_ms=1000)
    s.on_worker_event(status("w1"), 900 * MS)  # w1 keeps reporting, w0 went silent at t=0
    d = s.admit("r", 10, 4, 1500 * MS, random.Random(0))
    assert d.prefill_pick.worker_id == "w1"
    assert s.view.readiness(1500 * MS, s.timeout_ns) == (True, "ok")
    assert s.view.readiness(3000 * MS, s.timeout_ns) == (False, "no live worker for role pd_fusion")


def test_draining_worker_gets_no_new_work():
    s = make_scheduler(("w0", "w1"))
    s.on_worker_event(status("w0", state="draining"), 0)
    rng = random.Random(0)
    assert {s.admit(f"r{i}", 10, 4, 0, rng).prefill_pick.worker_id for i in range(4)} == {"w1"}


def test_disaggregated_mode_picks_a_prefill_and_a_decode_worker():
    s = make_scheduler(("p0", "p1"), role="prefill")
    for w in ("d0", "d1"):
        s.on_worker_event(status(w, "decode"), 0)
    rng = random.Random(0)
    picks = [(d.prefill_pick.worker_id, d.decode_pick.worker_id) for d in (s.admit(f"r{i}", 10, 4, 0, rng) for i in range(4))]
    assert picks == [("p0", "d0"), ("p1", "d1"), ("p0", "d0"), ("p1", "d1")]
    assert s.view.roles_in_use() == {"prefill", "decode"}
    assert s.view.readiness(0, s.timeout_ns) == (True, "ok")


def test_pd_mode_without_decode_workers_is_not_ready():
    s = make_scheduler(("p0",), role="prefill")
    assert s.view.readiness(0, s.timeout_ns) == (False, "no live worker for role decode")
    assert s.admit("r", 10, 4, 0, random.Random(0)).code == "no_worker"


def test_tick_closes_due_batches_with_unique_ids_per_worker():
    s = make_scheduler(("w0", "w1"), batcher=FixedWindowParams(wait_ms=5, batch_size_max=8))
    rng = random.Random(0)
    for i in range(4):
        s.admit(f"r{i}", 10, 4, 0, rng)
    assert s.tick(4 * MS) == []
    assert s.next_due_ns() == 5 * MS
    batches = s.tick(5 * MS)
    assert sorted((b.worker_id, [i.request_id for i in b.items]) for b in batches) == [
        ("w0", ["r0", "r2"]), ("w1", ["r1", "r3"])
    ]
    assert len({b.batch_id for b in batches}) == 2 and all(b.batch_id.startswith("r-boot-") for b in batches)


def test_a_restarted_worker_is_counted_and_keeps_its_place():
    s = make_scheduler(("w0",))
    s.on_worker_event(status("w0", boot="b1"), 10)
    assert s.view.workers["w0"].num_restarts == 1
    s.on_worker_event(WorkerRegistered(worker_id="w0", role="pd_fusion", boot_id="b2", engine="sim", pid=1, host="h",
                                       block_size_tokens=16, num_kv_blocks=10, max_batch_tokens=64,
                                       max_seq_len_tokens=128, heartbeat_interval_ms=200), 20)
    assert s.view.workers["w0"].num_restarts == 2


def test_drain_queues_empties_batchers_and_inflight():
    s = make_scheduler()
    rng = random.Random(0)
    for i in range(3):
        s.admit(f"r{i}", 10, 4, 0, rng)
    drained = s.drain_queues()
    assert sorted(i.request_id for i in drained) == ["r0", "r1", "r2"]
    assert s.inflight == set() and s.next_due_ns() is None


def test_unknown_policy_names_fail_with_the_known_ones():
    with pytest.raises(UnknownPolicyError, match="known: random, round-robin"):
        build_policy("prefill", "best-ever")
