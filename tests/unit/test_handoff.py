"""A leader's planned stop, request by request (leadership.py's module docstring): the stopping
leader hands a standby's undispatched request over in that standby's name and tells it where
it went; the standby does not fail it as stranded while the hand-off mark lives, follows it to
the new leader, and from then on ignores the old leader's word on it. Without a mark (a crash)
stranded forwards fail at once, as before. No servers: a real RouterState and core, a fake
Redis and bus."""

from __future__ import annotations

import asyncio
import types

import pytest
from nats.errors import NoRespondersError

from schemas import messages as m
from schemas.subjects import router_events_subject, token_subject
from services.core.records import AdmitRequest
from services.core.scheduler import Scheduler
from services.settings import RouterSettings
from services.shell.intake import Intake
from services.shell.leadership import ACQUIRE_LUA, HANDOFF_GRACE_S, Leadership
from services.shell.router import HANDOFF_BUDGET_S
from services.shell.state import NOT_LEADER_MESSAGE, RequestHandle, RouterState, Terminal

OLD, NEW, OTHER = "old-leader", "new-leader", "another-router"


class FakeRedis:
    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}

    async def get(self, key: str) -> bytes | None:
        return self.values.get(key)

    async def mget(self, *keys: str) -> list[bytes | None]:
        return [self.values.get(k) for k in keys]


class FakeBus:
    """nc.request answers from a script: an exception to raise, or a reply to send."""

    def __init__(self, *answers) -> None:
        self.answers = list(answers)
        self.sent: list[m.SubmitRequest] = []

    async def request(self, subject, data, timeout):
        self.sent.append(m.decode_as(data, m.SubmitRequest).payload)
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return Msg(NEW, answer)


class Msg:
    """A NATS message as the callbacks get it: `payload` in an envelope from `producer`."""

    def __init__(self, producer: str, payload) -> None:
        self.subject = router_events_subject(producer)
        self.data = m.encode(m.EnvelopeFactory(producer, "boot").wrap(payload, 1))


def make_router(router_id: str = "standby", lease_holder: str = NEW) -> tuple[RouterState, Intake, Leadership]:
    settings = RouterSettings(router_id=router_id, cluster="t")
    s = RouterState(settings, "boot", Scheduler(settings.scheduler_config(), id_prefix=router_id))
    s.redis = FakeRedis()
    intake = Intake(s)
    leadership = Leadership(s, intake)
    s.redis.values[leadership.lease_key("")] = f"{lease_holder}:boot".encode()
    return s, intake, leadership


def make_forward(s: RouterState, rid: str, leader_id: str = OLD, queued: bool = False) -> RequestHandle:
    """A request of our client's that we forwarded to `leader_id` (waiting in its fair queue if `queued`)."""
    handle = RequestHandle(rid, [1, 2, 3], 4, 0, leader_id=leader_id)
    if queued:
        handle.admission = asyncio.get_running_loop().create_future()
    s.handles[rid] = handle
    return handle


def admitted(rid: str, by: str, worker: str = "w1") -> m.RequestAdmitted:
    return m.RequestAdmitted(request_id=rid, router_id=by, prefill_worker_id=worker, decode_worker_id=worker,
                             num_prompt_tokens=3, max_tokens=4)


def reply(rid: str, by: str, code: str = "", worker: str = "") -> m.SubmitReply:
    return m.SubmitReply(request_id=rid, router_id=by, admitted=True, code=code, prefill_worker_id=worker,
                         decode_worker_id=worker)


def failed(rid: str, by: str) -> m.RequestFailed:
    return m.RequestFailed(request_id=rid, worker_id=by, code="not_ready", message="lost the leadership", retryable=True)


@pytest.mark.parametrize("mark, is_failed", [
    (None, True),  # a crash, or a lost lease: nothing will answer it
    (OLD, False),  # its leader stopped and is handing it over (or failing it) itself
    (OTHER, True),  # another router's hand-off says nothing about ours
], ids=["no-mark-crash", "its-leader-handing-off", "another-routers-mark"])
async def test_a_forward_stranded_at_a_gone_leader_fails_at_once_unless_that_leader_is_handing_off(mark, is_failed):
    s, _, leadership = make_router()
    handle = make_forward(s, "r1")
    if mark is not None:
        s.redis.values[leadership.handoff_key("")] = mark.encode()
    await leadership.fail_stranded_forwards("")
    assert handle.done is is_failed
    if is_failed:
        terminal = handle.queue.get_nowait()
        assert (terminal.outcome, terminal.code) == ("failed", "not_ready")


async def test_a_new_leader_fails_its_deferred_forwards_once_the_hand_off_mark_expires():
    s, _, leadership = make_router("standby", lease_holder="standby")  # we took the lease
    handle = make_forward(s, "r1")
    s.redis.values[leadership.handoff_key("")] = OLD.encode()
    await leadership.fail_stranded_forwards("")  # the old leader still hands over
    assert not handle.done and leadership.deferred_stranded
    del s.redis.values[leadership.handoff_key("")]  # it never did (it died mid-stop): the mark expired
    await leadership.fail_stranded_forwards("")
    assert handle.done and not leadership.deferred_stranded


async def test_the_owner_follows_a_request_queued_at_the_old_leader_to_the_new_one():
    s, intake, leadership = make_router()
    handle = make_forward(s, "r1", queued=True)
    waited_on = handle.admission  # what the HTTP API awaits
    await intake.on_router_event_msg(Msg(OLD, reply("r1", NEW, code="queued")))  # the old leader's relay
    assert handle.leader_id == NEW and handle.admission is waited_on and not waited_on.done()
    await intake.on_router_event_msg(Msg(OLD, failed("r1", OLD)))  # (the old leader's word counts no more)
    assert not handle.done
    await leadership.fail_stranded_forwards("")  # the new leader holds it: not stranded
    assert not handle.done
    await intake.on_router_event_msg(Msg(NEW, admitted("r1", NEW, worker="w2")))
    assert waited_on.done() and waited_on.result() is None
    assert (handle.prefill_worker_id, handle.decode_worker_id) == ("w2", "w2")


async def test_the_new_leaders_admission_may_come_before_the_old_leaders_relay():
    s, intake, _ = make_router()
    handle = make_forward(s, "r1")  # admitted at the old leader (to w1), not dispatched
    handle.prefill_worker_id = handle.decode_worker_id = "w1"
    await intake.on_router_event_msg(Msg(NEW, admitted("r1", NEW, worker="w2")))
    assert handle.leader_id == NEW and handle.decode_worker_id == "w2"
    await intake.on_router_event_msg(Msg(OLD, reply("r1", NEW, code="queued")))  # late: it was queued then
    assert handle.admission is None and handle.decode_worker_id == "w2"


async def test_a_hand_over_that_failed_fails_the_request_retryable_for_its_client():
    s, intake, _ = make_router()
    handle = make_forward(s, "r1")
    await intake.on_router_event_msg(Msg(OLD, failed("r1", OLD)))
    assert handle.done and handle.queue.get_nowait() == Terminal("failed", "not_ready", "lost the leadership")


def make_remote(s: RouterState, rid: str) -> RequestHandle:
    """A request a standby forwarded to us, admitted here and not dispatched."""
    handle = RequestHandle(rid, [1, 2, 3], 4, 0, timeout_s=1e12, token_subject=token_subject("standby", rid),
                           remote=True, forwarded_by="standby", tenant="acme", priority_class="critical")
    handle.admit = AdmitRequest(request_id=rid, num_prompt_tokens=3, max_tokens=4, priority=90, slo_ttft_ms=500.0,
                                payload=handle, model="m", tenant="acme", priority_class="critical")
    s.handles[rid] = handle
    return handle


def capture_emits(s: RouterState) -> list:
    emitted = []

    async def emit(payload):
        emitted.append(payload)

    s.emit = emit
    return emitted


async def test_the_stopping_leader_hands_a_standbys_request_over_in_that_standbys_name_and_tells_it():
    s, _, leadership = make_router(OLD)
    handle = make_remote(s, "r1")
    s.nc = FakeBus(NoRespondersError(), reply("r1", NEW, code="queued"))  # the new leader subscribes a moment late
    emitted = capture_emits(s)
    assert await leadership.hand_over(handle, no_leader_wait_s=1.0, standbys_too=True) is None
    cmd = s.nc.sent[-1]
    assert (cmd.router_id, cmd.token_subject) == ("standby", token_subject("standby", "r1"))
    assert (cmd.tenant, cmd.priority_class, cmd.priority, cmd.slo_ttft_ms, cmd.model) == ("acme", "critical", 90, 500.0, "m")
    assert emitted == [reply("r1", NEW, code="queued")]  # relayed: the standby follows it there
    assert "r1" not in s.handles and handle.done


async def test_a_leader_that_lost_its_lease_fails_a_standbys_request_and_hands_over_none():
    """No hand-off mark (the lease lost, fenced): that standby fails it as stranded when it sees the
    lease move, so a copy handed over would run with nobody waiting for it."""
    s, _, leadership = make_router(OLD)
    s.is_leader = True
    handle = make_remote(s, "r1")
    leadership.intake.take_waiting = lambda: [handle]  # (it waited in our fair queue)
    s.nc = FakeBus()  # (asked nothing)
    emitted = capture_emits(s)
    await leadership.step_down("lease lost")
    assert s.nc.sent == [] and handle.done
    assert [(type(e), e.code, e.retryable) for e in emitted] == [(m.RequestFailed, "not_ready", True)]


async def test_a_forward_waits_for_a_leader_to_answer_and_is_admitted_here_if_we_take_the_lease():
    s, _, _ = make_router()
    cmd = m.SubmitRequest(request_id="r1", router_id="standby", prompt_token_ids=[1], max_tokens=1, token_subject="x")
    not_leader = m.SubmitReply(request_id="r1", router_id=OLD, admitted=False, code="not_ready", message=NOT_LEADER_MESSAGE)
    s.nc = FakeBus(NoRespondersError(), not_leader, reply("r1", NEW))
    assert (await s.ask_leader(cmd, "", 1.0)).router_id == NEW
    s.nc = FakeBus(NoRespondersError())
    with pytest.raises(NoRespondersError):  # no wait asked for: the first silence is the answer
        await s.ask_leader(cmd, "", 0.0)
    s.nc = FakeBus(NoRespondersError(), NoRespondersError())
    task = asyncio.get_running_loop().create_task(s.ask_leader(cmd, "", 1.0))
    await asyncio.sleep(0)
    s.is_leader = True  # we took the lease meanwhile
    assert await task is None


@pytest.mark.parametrize("mark, announced_at_once", [(OLD, False), (None, True)], ids=["handed-off", "crash"])
async def test_a_router_taking_a_handed_off_lease_announces_its_epoch_after_the_old_leaders_last_batches(
        mark, announced_at_once):
    """What the old leader dispatched before giving the lease up may still be in a worker's
    command fetch: fenced at once, it would be refused as stale. After a crash: at once."""
    s, _, leadership = make_router("standby", lease_holder="")
    del s.redis.values[leadership.lease_key("")]  # free
    if mark is not None:
        s.redis.values[leadership.handoff_key("")] = mark.encode()
    fences: list[m.FenceEpoch] = []

    async def evaluate(script, *args):
        return 1 if script == ACQUIRE_LUA else 7  # taken; epoch 7

    class Bus:
        async def subscribe(self, subject, cb):
            return object()

        async def publish(self, subject, data):
            fences.append(m.decode_as(data, m.FenceEpoch).payload)

    s.redis.eval, s.nc = evaluate, Bus()
    s.scheduler.view.live = lambda: [types.SimpleNamespace(worker_id="w1")]
    await leadership.lease_cycle()
    assert s.is_leader and s.epoch == 7
    assert bool(fences) is announced_at_once
    leadership.fence_after = 0.0  # (HANDOFF_FENCE_DELAY_S later: the liveness cycle announces it)
    await leadership.announce_epoch()
    assert fences[-1].epoch == 7


def test_the_hand_off_mark_outlives_the_stop_budget():
    assert HANDOFF_GRACE_S > HANDOFF_BUDGET_S
