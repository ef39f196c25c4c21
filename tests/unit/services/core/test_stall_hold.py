"""The stall hold (slo-budget's `stall_hold`): a prefill batch waits, within its TTFT guard,
while the stall it would put on its worker's decoding requests is more than one of them can
absorb within its TPOT target, until that one is expected to finish (services/core/
batchers/slo_budget.py; the limits come from services/core/scheduler.py `_stall_limits`).

A request expected to produce N tokens at its worker's predicted TPOT t has (target - t) x
(N - 1) ms of its TPOT budget to spare; a short answer has almost none, and a prefill that
lands in its few steps makes it miss TPOT (Azure code: two thirds of the requests answer in
fewer than 16 tokens, and every miss of every router there is one of those). The pure core
with a fake clock."""

from __future__ import annotations

import pytest

from schemas.messages import WorkerStatusReported
from services.core.batchers import build_batcher
from services.core.batchers.protocol import WorkerLoad
from services.core.scheduler import AdmitRequest, Admitted, Scheduler, SchedulerConfig
from services.core.slo import SloParams
from tests.unit.services.core.test_batchers import Req

MS = 1_000_000


def predict_ms(batch) -> float:  # noqa: ANN001 - 0.1 ms per uncached prompt token
    return sum(0.1 * (i.num_prompt_tokens - i.num_cached_tokens) for i in batch)


def worker(stall_limits: tuple[tuple[float, float], ...], wait_ms: float = 0.0) -> WorkerLoad:
    return WorkerLoad(max_batch_tokens=0, free_kv_tokens=1 << 40, num_inflight_batches=0, wait_ms=wait_ms,
                      tpot_ms=40.0, stall_limits=stall_limits)


def poll(stall_hold: float, limits: tuple[tuple[float, float], ...], now_ms: float = 0.0, wait_ms: float = 0.0):
    """A 1,000-token prompt (a 100 ms prefill), TTFT deadline at 2 s, queued at 0: (reasons of
    the batches that left, when the batcher asks to be polled again in ms or None)."""
    b = build_batcher("slo-budget", {"window_ms": 0.0, "stall_hold": stall_hold}, predict_ms)
    b.add(Req("a", 1000, 0, 2000 * MS, kv_tokens=1000, tpot_target_ms=100.0))
    load = worker(limits, wait_ms)
    due = b.next_due_ns(round(now_ms * MS), load)
    res = b.poll(round(now_ms * MS), load)
    return [c.reason for c in res.batches], (None if res.batches else due / MS)


def test_a_batch_waits_until_the_request_it_would_break_finishes():
    # One decoding request absorbs 30 ms more and finishes in 250 ms: the 100 ms prefill waits.
    assert poll(1.0, ((30.0, 250.0),)) == ([], 250.0)
    # ... not once it can absorb the whole stall, nor with the hold off.
    assert poll(1.0, ((100.0, 250.0),))[0] == ["window"]
    assert poll(0.0, ((30.0, 250.0),))[0] == ["window"]
    # The latest of the requests it would break decides; one that can take the stall does not.
    assert poll(1.0, ((30.0, 250.0), (50.0, 400.0), (5_000.0, 9_000.0))) == ([], 400.0)
    # The worker's inflight batches stall the same requests first: they count.
    assert poll(1.0, ((150.0, 250.0),))[0] == ["window"]
    assert poll(1.0, ((150.0, 250.0),), wait_ms=60.0) == ([], 250.0)
    # `stall_hold` scales the stall: at 0.5, a 100 ms prefill is a 50 ms one.
    assert poll(0.5, ((60.0, 250.0),))[0] == ["window"]


def test_the_hold_never_costs_a_request_its_ttft_target():
    """Deadline 2 s, prefill 100 ms, guard 40 ms: the head must leave by 1,860 ms. A fragile
    request finishing after that does not keep it past its guard."""
    assert poll(1.0, ((30.0, 5_000.0),)) == ([], 1860.0)
    assert poll(1.0, ((30.0, 5_000.0),), now_ms=1860.0)[0] == ["guard"]


def test_the_stall_hold_stands_aside_for_a_worker_near_its_tpot_target():
    """The worker decodes at 40 ms (poll's load) against a 100 ms target: within a headroom
    of 0.5 the stall hold holds, beyond it (0.35) the batch goes: a worker that close to its
    TPOT target is the TPOT hold's, and its requests need their TTFT slack for it."""
    def held(headroom: float) -> bool:
        b = build_batcher("slo-budget", {"window_ms": 0.0, "stall_hold": 1.0, "stall_hold_headroom": headroom}, predict_ms)
        b.add(Req("a", 1000, 0, 2000 * MS, kv_tokens=1000, tpot_target_ms=100.0))
        return not b.poll(0, worker(((30.0, 250.0),))).batches
    assert held(0.5)
    assert not held(0.35)


def test_stall_hold_is_validated():
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="stall_hold"):
            build_batcher("slo-budget", {"stall_hold": bad}, predict_ms)
    for bad in (0.0, 1.5, float("nan")):
        with pytest.raises(ValueError, match="stall_hold_headroom"):
            build_batcher("slo-budget", {"stall_hold_headroom": bad}, predict_ms)


# ------------------------------------------------------------------ through the scheduler
def status(running: int, step_ms: float) -> WorkerStatusReported:
    return WorkerStatusReported(worker_id="w0", role="pd_fusion", boot_id="b0", block_size_tokens=16,
                                num_kv_blocks=100_000, num_free_kv_blocks=90_000, max_batch_tokens=65536,
                                max_seq_len_tokens=40960, num_running_requests=running, recent_step_ms=step_ms)


def make(stall_hold: float) -> Scheduler:
    s = Scheduler(SchedulerConfig(batcher="slo-budget", batcher_params={
        "window_ms": 0, "max_inflight_batches": 0, "stall_hold": stall_hold}, slo=SloParams(mode="reject-explicit")),
        id_prefix="t")
    for t in range(100):
        s.on_worker_event(status(2, 40.0), t * MS)
    return s


def admit(s: Scheduler, request_id: str, max_tokens: int, now_ns: int) -> None:
    res = s.admit(AdmitRequest(request_id=request_id, num_prompt_tokens=3000, max_tokens=max_tokens,
                               slo_ttft_ms=2000.0, slo_tpot_ms=100.0), now_ns)
    assert isinstance(res, Admitted), res


def first_dispatch_ms(s: Scheduler, start_ns: int, until_ns: int) -> tuple[float, str] | None:
    for t in range(start_ns, until_ns, MS):
        res = s.tick(t)
        if res.batches:
            return t / MS, res.batches[0].batch_id
    return None


def test_the_scheduler_knows_what_a_stall_would_cost_each_decoding_request():
    """"a" (3 output tokens) gets its first token at 900 ms (its prefill: 400 ms from 500): it can absorb (100 - t) x 2 ms of
    stall, for 2 x t ms (t the worker's predicted TPOT); a request without a first token or
    of one output token counts for nothing."""
    s = make(1.0)
    admit(s, "a", 3, 500 * MS)
    admit(s, "one", 1, 500 * MS)
    sent = first_dispatch_ms(s, 500 * MS, 600 * MS)
    assert sent is not None
    assert s.load("w0", 550 * MS).stall_limits == ()  # no first token yet
    s.on_batch_started("w0", sent[1], 500 * MS)
    s.on_prefill_completed("w0", sent[1], 400.0, 0)
    load = s.load("w0", 920 * MS)
    t = load.tpot_ms
    assert 0 < t < 100
    (tolerance, left), = load.stall_limits
    assert tolerance == pytest.approx((100.0 - t) * 2)
    assert left == pytest.approx(2 * t - 20.0)
    assert s.load("w0", round((900 + 2 * t + 1) * MS)).stall_limits == ()  # expected done
    s.on_terminal("a")
    assert s.load("w0", 920 * MS).stall_limits == ()


@pytest.mark.parametrize("stall_hold", [1.0, 0.0])
def test_a_long_prompt_waits_for_a_short_answer_to_finish(stall_hold: float):
    """"a" answers in 3 tokens from 900 ms; "b", a 3,000-token prompt whose prefill (~400 ms,
    as "a"'s) is far more than "a" can absorb, arrives at 910 ms: held until "a" is expected done, or sent at
    once with the hold off."""
    s = make(stall_hold)
    admit(s, "a", 3, 500 * MS)
    sent = first_dispatch_ms(s, 500 * MS, 600 * MS)
    assert sent is not None
    s.on_batch_started("w0", sent[1], 500 * MS)
    s.on_prefill_completed("w0", sent[1], 400.0, 0)
    t = s.load("w0", 910 * MS).tpot_ms
    admit(s, "b", 100, 910 * MS)
    when = first_dispatch_ms(s, 910 * MS, 3000 * MS)
    assert when is not None
    if stall_hold:
        assert 900 + 2 * t <= when[0] <= 900 + 2 * t + 1
    else:
        assert when[0] == 910
