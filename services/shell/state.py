"""What the parts of one router share (RouterState), the decision records the admin API shows,
and the batches in flight.

RouterState holds the router's identity, its connections (NATS, JetStream, Redis, the Redis
ledger), the core (the Scheduler, wrapped by the journal's Recorder), the live request
handles, the batches in flight, leadership facts (is_leader, epoch) and the counters the
admin views show. Each field has one owner, the part that writes it (OWNERS: a unit test
reads every module under services/ and fails on a write from any other part); the others
read it. What only one part reads lives in that part, not here. Besides its owner's, a
field is written only by the leaf actions defined here, which any part may call: publish a
router event (emit), dead-letter an undecodable message, give a client its terminal outcome
once (finish_router), forget a request handed to another router (forget), and ask a leader
to take a request (ask_leader: intake's forwards, leadership's hand-overs). `wakeup` and
`fenced` are signals: any part sets them, the one that waits on them clears them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from typing import Any

from nats.errors import NoRespondersError

from schemas import messages as m
from schemas.acked import AckedPublisher
from schemas.subjects import JOURNAL_PREFIX, router_events_subject, submit_subject
from services.core.admission import DEFAULT_TENANT
from services.core.journal import Recorder
from services.core.scheduler import Rejected, RouteDecision, Scheduler
from services.settings import RouterSettings
from services.shell.bus import dead_letter
from services.shell.handle import RequestHandle, Terminal
from services.shell.ledger import Ledger
from services.shell.metrics import RouterMetrics

log = logging.getLogger("flexlb.router")

RECENT_RECORDS_MAX = 10_000  # requests whose decision record /admin/requests/{id} can show
FORWARD_TIMEOUT_S = 5.0  # a standby waits this long for the leader to admit a forwarded request
FORWARD_RETRY_S = 0.05  # no leader answered: asked again this often (ask_leader)
NOT_LEADER_MESSAGE = "not the leader any more"  # a SubmitReply's, from a router that stepped down


class RequestRecords:
    """Decision records of live and recent requests, for GET /admin/requests/{id}: the
    admission verdict, the routing decisions with every candidate's score card, the batch,
    and a timeline of what happened, in ms since arrival. Bounded: oldest forgotten first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.records: OrderedDict[str, dict[str, Any]] = OrderedDict()

    def open(self, request_id: str, arrival_ns: int, **fields: Any) -> dict[str, Any]:
        rec = {"request_id": request_id, "found": True, "source": "live", "arrival_ns": arrival_ns, "timeline": [], **fields}
        self.records[request_id] = rec
        self.records.move_to_end(request_id)
        while len(self.records) > self.capacity:
            self.records.popitem(last=False)
        return rec

    def note(self, request_id: str, now_ns: int, what: str, **detail: Any) -> None:
        rec = self.records.get(request_id)
        if rec is not None:
            # The shape of `flexlb explain --json` (t_ms, source, what), plus "event" (the lifecycle event it came from).
            rec["timeline"].append({"t_ms": round((now_ns - rec["arrival_ns"]) / 1e6, 3), "source": "router", "what": what,
                                    "event": what, **detail})

    def get(self, request_id: str) -> dict[str, Any] | None:
        rec = self.records.get(request_id)
        if rec is not None and rec.get("decisions") and not isinstance(rec["decisions"][0], dict):
            # Kept as the core's RouteDecisions until someone asks (most records are never read).
            rec["decisions"] = [decision_view(d) for d in rec["decisions"]]
        return rec


def decision_view(d: RouteDecision) -> dict[str, Any]:
    return {
        "stage": d.stage, "policy": d.policy, "decision_seq": d.decision_seq, "seed": d.seed,
        "picked": d.pick.worker_id, "reason": d.pick.reason,
        "candidates": [
            {"worker_id": s.worker_id, "score": s.score, "components": s.components, "filtered_by": s.filtered_by}
            for s in d.pick.scores
        ],
    }


def decision_event(request_id: str, router_id: str, d: RouteDecision) -> m.RouteDecided:
    return m.RouteDecided(
        request_id=request_id, router_id=router_id, decision_seq=d.decision_seq, seed=d.seed, stage=d.stage,
        policy=d.policy, picked_worker_id=d.pick.worker_id, reason=d.pick.reason,
        candidates=[m.CandidateScore(worker_id=s.worker_id, score=float(s.score), components=s.components,
                                     filtered_by=s.filtered_by) for s in d.pick.scores],
    )


class Batches:
    """The batches in flight and their members (owner: dispatch, which opens and closes them;
    a member's end is counted by upkeep through member_ended, when its ledger fields go)."""

    __slots__ = ("_pending", "_batch_of")

    def __init__(self) -> None:
        self._pending: dict[str, set[str]] = {}  # batch id -> member request ids without terminal event
        self._batch_of: dict[str, str] = {}  # request id -> batch id

    def open(self, batch_id: str, request_ids: list[str]) -> None:
        self._pending[batch_id] = set(request_ids)
        for rid in request_ids:
            self._batch_of[rid] = batch_id

    def close(self, batch_id: str, request_ids: list[str]) -> None:
        """A batch that did not go (requeued, failed): forgotten with its members."""
        self._pending.pop(batch_id, None)
        for rid in request_ids:
            self._batch_of.pop(rid, None)

    def member_ended(self, request_id: str) -> str | None:
        """`request_id` ended: the id of its batch if it was that batch's last member, else None."""
        batch_id = self._batch_of.pop(request_id, None)
        if batch_id is None:
            return None
        pending = self._pending.get(batch_id)
        if pending is None:
            return None
        pending.discard(request_id)
        if pending:
            return None
        del self._pending[batch_id]
        return batch_id

    def __len__(self) -> int:
        return len(self._pending)


class RouterState:
    """One router's shared facts (module docstring). Built by RouterService, which wires the
    connections in at start()."""

    def __init__(self, settings: RouterSettings, boot_id: str, scheduler: Scheduler | Recorder) -> None:
        # Set here, never rebound: identity, the core, the records, the batches, signals.
        self.settings = settings
        self.router_id = settings.router_id
        self.boot_id = boot_id
        self.pool = settings.scheduling_pool  # the one pool this router leads ("": all)
        self.metrics = RouterMetrics(frozenset({DEFAULT_TENANT, *settings.tenant_api_keys.values(),
                                                *settings.tenant_weights, *settings.tenant_classes}))
        self.scheduler: Scheduler | Recorder = scheduler
        self.records = RequestRecords(RECENT_RECORDS_MAX)
        self.envelopes = m.EnvelopeFactory(self.router_id, self.boot_id)
        self.batches = Batches()
        self.wakeup = asyncio.Event()  # the batch loop has something to look at
        self.fenced = asyncio.Event()  # set when fenced_by_epoch exceeds our epoch: leadership steps down
        # router (RouterService.start / stop): the connections, and whether we run
        self.nc = None
        self.js = None
        self.acked: AckedPublisher | None = None  # terminal events and the journal: re-sent until the stream acks
        self.redis = None
        self.ledger: Ledger | None = None
        self.events_sub = None  # the durable pull consumer of worker events (fold)
        self.started_ns = 0
        self.running = False
        # intake: request id -> handle, until the client is answered (finish_router, forget)
        self.handles: dict[str, RequestHandle] = {}
        # leadership
        self.is_leader = False  # holds the Redis lease: schedules and dispatches
        self.epoch = 0  # fencing epoch: a Redis counter bumped at every router start (see start())
        # time.monotonic() until which our lease surely holds (its TTL, counted from before the
        # renewal was sent). Past it, unrenewed (Redis unreachable), we dispatch nothing: a
        # standby that reaches Redis may hold the lease by then.
        self.lease_valid_until = 0.0
        # Stopping while leading (leadership.hand_off): the lease was given up, never renewed or
        # taken again; nothing more is dispatched (what is queued goes to the new leader).
        self.handing_off = False
        # liveness
        self.bus_state = "disconnected"
        self.bus_silent_since_ns = 0  # our NATS server stopped answering pings then (0: it answers)
        # fold: what the workers' events said
        self.view_ready_after_ms: float | None = None  # start -> first complete worker view
        self.num_finished: dict[str, int] = {}  # worker id -> requests finished on it
        self.seen_draining: set[str] = set()  # workers that reported draining themselves (told to stop), until ready again
        self.max_worker_epoch = 0  # the highest epoch any worker reports accepting (status)
        self.fenced_by_epoch = 0  # the highest of those from workers we dispatched to
        self.worker_models: dict[str, str] = {}  # worker id -> its model, every pool's (note_worker_model)
        self.adapter_models: dict[str, str] = {}  # LoRA adapter -> its parent model
        # dispatch
        self.num_dispatched: dict[str, int] = {}  # worker id -> requests dispatched to it
        # upkeep
        self.ledger_dirty = False  # Redis missed writes (outage/restart): rebuild it from the mirror

    # ---------------------------------------------------------------- pools (scheduling_pool)
    def note_worker_model(self, worker_id: str, model: str, adapters: list[str]) -> None:
        """Every worker's model and adapters, of every pool: where a request's model is led."""
        self.worker_models[worker_id] = model
        for a in adapters:
            self.adapter_models[a] = model

    def pool_of_model(self, model: str) -> str | None:
        """The pool (model) whose leader schedules a request naming `model` ("": the default);
        None if no worker has reported it (any router answers: model_not_found)."""
        name = model or self.settings.model_name
        if name in self.adapter_models and name not in self.worker_models.values():
            return self.adapter_models[name]
        return name if name in self.worker_models.values() else None

    def is_other_pool(self, model: str) -> bool:
        """A router leading one pool keeps the workers of the others out of its core."""
        return bool(self.pool) and (model or self.settings.model_name) != self.pool

    def may_dispatch(self) -> bool:
        """Leader, the lease surely still ours, no worker has accepted a newer epoch, and not
        stopping (a stopping leader hands its queue over instead: leadership.hand_off)."""
        return (self.running and self.is_leader and not self.handing_off and time.monotonic() < self.lease_valid_until
                and self.fenced_by_epoch <= self.epoch)

    def acked_lost(self, subject: str, msg_id: str) -> None:
        """An acked publish given up on (no ack for give_up_s): counted where an operator looks."""
        if subject.startswith(JOURNAL_PREFIX):
            self.metrics.journal_lost.inc()
        else:
            self.metrics.consumer_errors.labels("emit").inc()

    async def emit(self, payload: Any) -> None:
        env = self.envelopes.wrap(payload, time.time_ns())
        try:
            if self.acked is not None and isinstance(payload, m.TERMINAL_TYPES):  # a fact: the stream must have it
                await self.acked.publish(router_events_subject(self.router_id), m.encode(env), env.event_id)
                return
            await self.nc.publish(router_events_subject(self.router_id), m.encode(env))
        except Exception as exc:  # the record is lost only if the bus is gone; say so loudly
            self.metrics.consumer_errors.labels("emit").inc()
            log.error("could not publish %s: %s", type(payload).__name__, exc)

    async def undecodable(self, source: str, msg, exc: Exception) -> None:
        self.metrics.undecodable.labels(source).inc()
        log.warning("undecodable message on %s: %s", msg.subject, exc)
        try:
            await dead_letter(self.nc, self.router_id, msg.subject, msg.data, str(exc))
        except Exception as dlq_exc:  # the bus is down: the message is lost; say so
            log.error("could not dead-letter a message from %s: %s", msg.subject, dlq_exc)

    async def ask_leader(self, cmd: m.SubmitRequest, pool: str, no_leader_wait_s: float) -> m.SubmitReply | None:
        """`cmd` to `pool`'s leader ("": the cluster's one leader); its reply. While none answers
        (none subscribed, or one stepping down replied: a hand-off or failover in progress), asked
        again every FORWARD_RETRY_S for up to `no_leader_wait_s`; None if we took that lease
        meanwhile (the caller admits it here). Raises what the last try raised."""
        deadline = time.monotonic() + no_leader_wait_s
        while True:
            try:
                msg = await self.nc.request(submit_subject(self.settings.cluster, pool),
                                            m.encode(self.envelopes.wrap(cmd, time.time_ns())), timeout=FORWARD_TIMEOUT_S)
                reply = m.decode_as(msg.data, m.SubmitReply).payload
                if reply.admitted or reply.message != NOT_LEADER_MESSAGE or time.monotonic() >= deadline:
                    return reply
            except NoRespondersError:
                if time.monotonic() >= deadline:
                    raise
            await asyncio.sleep(FORWARD_RETRY_S)
            if self.is_leader and pool == self.pool:
                return None

    def finish_router(self, handle: RequestHandle | None, outcome: str, code: str | None, message: str,
                      finish_reason: str | None = None) -> None:
        """Give the client its terminal outcome (once)."""
        if handle is None:
            return
        if handle.done:
            self.metrics.duplicate_terminal.inc()
            return
        handle.end()
        self.handles.pop(handle.request_id, None)
        if handle.grace_task is not None:
            handle.grace_task.cancel()
        handle.queue.put_nowait(Terminal(outcome, code, message, finish_reason))
        handle.admission_over(Rejected(code or outcome, message))  # (it ended while in a fair queue)

    def forget(self, handle: RequestHandle) -> None:
        """A request another router now answers for (a standby's, handed over to a new leader
        that its standby follows): no terminal outcome of ours."""
        handle.end()
        self.handles.pop(handle.request_id, None)


# The part (a module of services/shell/) that writes each RouterState field; the leaf actions
# above aside, no other part does (tests/unit/services/shell/test_state.py). The fields set
# once in __init__ and never rebound are not listed; `wakeup` and `fenced` are SIGNALS.
OWNERS = {
    **dict.fromkeys(("nc", "js", "acked", "redis", "ledger", "events_sub", "started_ns", "running"), "router"),
    "handles": "intake",
    **dict.fromkeys(("is_leader", "epoch", "lease_valid_until", "handing_off"), "leadership"),
    **dict.fromkeys(("bus_state", "bus_silent_since_ns"), "liveness"),
    **dict.fromkeys(("view_ready_after_ms", "num_finished", "seen_draining", "max_worker_epoch", "fenced_by_epoch",
                     "worker_models", "adapter_models"), "fold"),
    "num_dispatched": "dispatch",
    "ledger_dirty": "upkeep",
}
SIGNALS = {"wakeup": "dispatch", "fenced": "leadership"}  # any part sets; the waiter (owner) clears
