"""A leader's planned stop, request by request (leadership.py's module docstring): the stopping
leader hands a standby's undispatched request over in that standby's name and tells it where
it went; the standby does not fail it as stranded while the hand-off mark lives, follows it to
the new leader, and from then on ignores the old leader's word on it. Without a mark (a crash)
stranded forwards fail at once, as before.

One router's parts (RouterState, Intake, Leadership, a real core) against the real NATS and
Redis servers of the test session: the other routers are played by this test on the same
bus (a "new leader" answering the submit subject, the old leader's and the new leader's
events published on their router-event subjects) and the lease and hand-off mark are real
Redis keys. Each test has a cluster name of its own."""

from __future__ import annotations

import asyncio
import itertools
import types

import nats
import pytest
from nats.errors import NoRespondersError

from schemas import messages as m
from schemas.subjects import epoch_subject, router_events_subject, submit_subject, token_subject
from services.core.records import AdmitRequest
from services.core.scheduler import Scheduler
from services.settings import RouterSettings
from services.shell.handle import RequestHandle, Terminal
from services.shell.intake import Intake
from services.shell.leadership import HANDOFF_GRACE_S, Leadership
from services.shell.router import HANDOFF_BUDGET_S, redis_client
from services.shell.state import NOT_LEADER_MESSAGE, RouterState

OLD, NEW, OTHER = "old-leader", "new-leader", "another-router"
_clusters = itertools.count()


@pytest.fixture
async def make_router(nats_url, redis_url):
    """A router's parts on the real bus and store; `lease_holder` holds the cluster's lease."""
    made: list[RouterState] = []

    async def make(router_id: str = "standby", lease_holder: str | None = NEW) -> tuple[RouterState, Intake, Leadership]:
        settings = RouterSettings(router_id=router_id, cluster=f"handoff{next(_clusters)}", nats_url=nats_url,
                                  redis_url=redis_url)
        s = RouterState(settings, "boot", Scheduler(settings.scheduler_config(), id_prefix=router_id))
        s.redis = redis_client(settings)
        s.nc = await nats.connect(nats_url)
        made.append(s)
        intake = Intake(s)
        leadership = Leadership(s, intake)
        await s.redis.delete(leadership.lease_key(""), leadership.handoff_key(""), leadership.epoch_key())
        if lease_holder:
            await s.redis.set(leadership.lease_key(""), f"{lease_holder}:boot")
        return s, intake, leadership

    yield make
    for s in made:
        await s.nc.close()
        await s.redis.aclose()


async def deliver(s: RouterState, producer: str, payload) -> object:
    """`payload` published on `producer`'s router-event subject; the message as the bus delivers it."""
    sub = await s.nc.subscribe(router_events_subject(producer))
    await s.nc.publish(router_events_subject(producer), m.encode(m.EnvelopeFactory(producer, "boot").wrap(payload, 1)))
    msg = await sub.next_msg(timeout=5)
    await sub.unsubscribe()
    return msg


class Leader:
    """Another router answering `cluster`'s submit subject from a script of replies (after `late_s`)."""

    def __init__(self, s: RouterState, *answers: m.SubmitReply, late_s: float = 0.0) -> None:
        self.s, self.answers, self.late_s = s, list(answers), late_s
        self.asked: list[m.SubmitRequest] = []
        self.sub = None
        self.task = asyncio.get_running_loop().create_task(self._subscribe())

    async def _subscribe(self) -> None:
        await asyncio.sleep(self.late_s)
        self.sub = await self.s.nc.subscribe(submit_subject(self.s.settings.cluster), cb=self._answer)
        await self.s.nc.flush()

    async def _answer(self, msg) -> None:
        self.asked.append(m.decode_as(msg.data, m.SubmitRequest).payload)
        await msg.respond(m.encode(m.EnvelopeFactory(NEW, "boot").wrap(self.answers.pop(0), 1)))

    async def ready(self) -> "Leader":
        await self.task
        return self


class Listener:
    """Everything published on a subject, decoded."""

    def __init__(self, s: RouterState, subject: str) -> None:
        self.s, self.subject, self.got = s, subject, []

    async def start(self) -> "Listener":
        async def on(msg):
            self.got.append(m.decode(msg.data).payload)

        await self.s.nc.subscribe(self.subject, cb=on)
        await self.s.nc.flush()
        return self

    async def settled(self) -> list:
        await self.s.nc.flush()
        await asyncio.sleep(0.2)  # (what was published before the flush has arrived by then)
        return self.got


def make_forward(s: RouterState, rid: str, leader_id: str = OLD, queued: bool = False) -> RequestHandle:
    """A request of our client's that we forwarded to `leader_id` (waiting in its fair queue if `queued`)."""
    handle = RequestHandle(m.Request(request_id=rid, prompt_token_ids=[1, 2, 3], max_tokens=4), 0, leader_id=leader_id)
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
async def test_a_forward_stranded_at_a_gone_leader_fails_at_once_unless_that_leader_is_handing_off(
        make_router, mark, is_failed):
    s, _, leadership = await make_router()
    handle = make_forward(s, "r1")
    if mark is not None:
        await s.redis.set(leadership.handoff_key(""), mark)
    await leadership.fail_stranded_forwards("")
    assert handle.done is is_failed
    if is_failed:
        terminal = handle.queue.get_nowait()
        assert (terminal.outcome, terminal.code) == ("failed", "not_ready")


async def test_a_new_leader_fails_its_deferred_forwards_once_the_hand_off_mark_expires(make_router):
    s, _, leadership = await make_router("standby", lease_holder="standby")  # we took the lease
    handle = make_forward(s, "r1")
    await s.redis.set(leadership.handoff_key(""), OLD, px=300)
    await leadership.fail_stranded_forwards("")  # the old leader still hands over
    assert not handle.done and leadership.deferred_stranded
    await asyncio.sleep(0.5)  # it never did (it died mid-stop): the mark expired
    await leadership.fail_stranded_forwards("")
    assert handle.done and not leadership.deferred_stranded


async def test_the_owner_follows_a_request_queued_at_the_old_leader_to_the_new_one(make_router):
    s, intake, leadership = await make_router()
    handle = make_forward(s, "r1", queued=True)
    waited_on = handle.admission  # what the HTTP API awaits
    await intake.on_router_event_msg(await deliver(s, OLD, reply("r1", NEW, code="queued")))  # the old leader's relay
    assert handle.leader_id == NEW and handle.admission is waited_on and not waited_on.done()
    await intake.on_router_event_msg(await deliver(s, OLD, failed("r1", OLD)))  # (the old leader's word counts no more)
    assert not handle.done
    await leadership.fail_stranded_forwards("")  # the new leader holds it: not stranded
    assert not handle.done
    await intake.on_router_event_msg(await deliver(s, NEW, admitted("r1", NEW, worker="w2")))
    assert waited_on.done() and waited_on.result() is None
    assert (handle.prefill_worker_id, handle.decode_worker_id) == ("w2", "w2")


async def test_the_new_leaders_admission_may_come_before_the_old_leaders_relay(make_router):
    s, intake, _ = await make_router()
    handle = make_forward(s, "r1")  # admitted at the old leader (to w1), not dispatched
    handle.prefill_worker_id = handle.decode_worker_id = "w1"
    await intake.on_router_event_msg(await deliver(s, NEW, admitted("r1", NEW, worker="w2")))
    assert handle.leader_id == NEW and handle.decode_worker_id == "w2"
    await intake.on_router_event_msg(await deliver(s, OLD, reply("r1", NEW, code="queued")))  # late: it was queued then
    assert handle.admission is None and handle.decode_worker_id == "w2"


async def test_a_hand_over_that_failed_fails_the_request_retryable_for_its_client(make_router):
    s, intake, _ = await make_router()
    handle = make_forward(s, "r1")
    await intake.on_router_event_msg(await deliver(s, OLD, failed("r1", OLD)))
    assert handle.done and handle.queue.get_nowait() == Terminal("failed", "not_ready", "lost the leadership")


def make_remote(s: RouterState, rid: str) -> RequestHandle:
    """A request a standby forwarded to us, admitted here and not dispatched."""
    request = m.Request(request_id=rid, prompt_token_ids=[1, 2, 3], max_tokens=4, priority=90, slo_ttft_ms=500.0,
                        model="m", tenant="acme", priority_class="critical")
    handle = RequestHandle(request, 0, timeout_s=1e12, token_subject=token_subject("standby", rid), remote=True,
                           forwarded_by="standby")
    handle.admit = AdmitRequest(request_id=rid, num_prompt_tokens=3, max_tokens=4, priority=90, slo_ttft_ms=500.0,
                                payload=handle, model="m", tenant="acme", priority_class="critical")
    s.handles[rid] = handle
    return handle


async def test_the_stopping_leader_hands_a_standbys_request_over_in_that_standbys_name_and_tells_it(make_router):
    s, _, leadership = await make_router(OLD)
    handle = make_remote(s, "r1")
    events = await Listener(s, router_events_subject(OLD)).start()
    new_leader = Leader(s, reply("r1", NEW, code="queued"), late_s=0.2)  # it subscribes a moment late
    assert await leadership.hand_over(handle, no_leader_wait_s=2.0, standbys_too=True) is None
    [cmd] = (await new_leader.ready()).asked
    assert (cmd.router_id, cmd.token_subject) == ("standby", token_subject("standby", "r1"))
    assert (cmd.tenant, cmd.priority_class, cmd.priority, cmd.slo_ttft_ms, cmd.model) == ("acme", "critical", 90, 500.0, "m")
    assert await events.settled() == [reply("r1", NEW, code="queued")]  # relayed: the standby follows it there
    assert "r1" not in s.handles and handle.done


async def test_a_leader_that_lost_its_lease_fails_a_standbys_request_and_hands_over_none(make_router):
    """No hand-off mark (the lease lost, fenced): that standby fails it as stranded when it sees the
    lease move, so a copy handed over would run with nobody waiting for it."""
    s, _, leadership = await make_router(OLD)
    s.is_leader = True
    handle = make_remote(s, "r1")
    leadership.intake.take_waiting = lambda: [handle]  # (it waited in our fair queue)
    events = await Listener(s, router_events_subject(OLD)).start()
    new_leader = await Leader(s).ready()  # (asked nothing)
    await leadership.step_down("lease lost")
    assert new_leader.asked == [] and handle.done
    assert [(type(e), e.code, e.retryable) for e in await events.settled()] == [(m.RequestFailed, "not_ready", True)]


async def test_a_forward_waits_for_a_leader_to_answer_and_is_admitted_here_if_we_take_the_lease(make_router):
    s, _, _ = await make_router()
    cmd = m.SubmitRequest(request_id="r1", router_id="standby", prompt_token_ids=[1], max_tokens=1, token_subject="x")
    with pytest.raises(NoRespondersError):  # no wait asked for: the first silence is the answer
        await s.ask_leader(cmd, "", 0.0)
    task = asyncio.get_running_loop().create_task(s.ask_leader(cmd, "", 2.0))
    await asyncio.sleep(0.2)
    assert not task.done()  # asked again while nobody answers
    s.is_leader = True  # we took the lease meanwhile
    assert await task is None
    s.is_leader = False
    not_leader = m.SubmitReply(request_id="r1", router_id=OLD, admitted=False, code="not_ready", message=NOT_LEADER_MESSAGE)
    leader = Leader(s, not_leader, reply("r1", NEW), late_s=0.2)  # none, then one stepping down, then the new one
    assert (await s.ask_leader(cmd, "", 2.0)).router_id == NEW
    assert len((await leader.ready()).asked) == 2


@pytest.mark.parametrize("mark, announced_at_once", [(OLD, False), (None, True)], ids=["handed-off", "crash"])
async def test_a_router_taking_a_handed_off_lease_announces_its_epoch_after_the_old_leaders_last_batches(
        make_router, mark, announced_at_once):
    """What the old leader dispatched before giving the lease up may still be in a worker's
    command fetch: fenced at once, it would be refused as stale. After a crash: at once."""
    s, _, leadership = await make_router("standby", lease_holder=None)  # the lease is free
    if mark is not None:
        await s.redis.set(leadership.handoff_key(""), mark)
    fences = await Listener(s, epoch_subject("w1")).start()
    s.scheduler.view.live = lambda: [types.SimpleNamespace(worker_id="w1")]  # (one live worker in the core's view)
    await leadership.lease_cycle()
    assert s.is_leader and s.epoch >= 1
    assert bool(await fences.settled()) is announced_at_once
    leadership.fence_after = 0.0  # (HANDOFF_FENCE_DELAY_S later: the liveness cycle announces it)
    await leadership.announce_epoch()
    assert (await fences.settled())[-1].epoch == s.epoch
    await leadership.submit_sub.unsubscribe()


def test_the_hand_off_mark_outlives_the_stop_budget():
    assert HANDOFF_GRACE_S > HANDOFF_BUDGET_S
