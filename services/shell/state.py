"""What the parts of one router share, and the request handle the HTTP API reads.

RouterState holds the router's identity, its connections (NATS, JetStream, Redis, the Redis
ledger), the core (the Scheduler, wrapped by the journal's Recorder), the live request
handles and batch membership, leadership facts (is_leader, epoch) and the counters the admin
views show. It owns no behaviour beyond four leaf actions the parts need: publish a router
event (emit), dead-letter an undecodable message, give a client its terminal outcome once
(finish_router), and ask a leader to take a request (ask_leader: intake's forwards,
leadership's hand-overs). Each part (intake, dispatch, fold, relay, leadership,
liveness, recovery, upkeep, admin, journal) holds this one object and reads and writes
these fields; none keeps a copy.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

from nats.errors import NoRespondersError

from schemas import messages as m
from schemas.acked import AckedPublisher
from schemas.subjects import JOURNAL_PREFIX, router_events_subject, submit_subject
from services.core.journal import Recorder
from services.core.scheduler import AdmitRequest, Rejected, RouteDecision, Scheduler
from services.settings import RouterSettings
from services.shell.bus import dead_letter
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


@dataclass(frozen=True)
class Terminal:
    """The end of a request's stream, as the client sees it."""

    outcome: str  # finished | failed | cancelled | timed_out | rejected
    code: str | None = None
    message: str = ""
    finish_reason: str | None = None


class Inbox:
    """A request's outbox to its one client reader: token chunks and, last, its Terminal.

    asyncio.Queue's shape (put_nowait, get, get_nowait, empty, qsize) for exactly one reader,
    which is all a handle has; an asyncio.Queue per request was ~2 % of the router's CPU at
    3,000 requests/s (bench/README.md, "hotpath.py"). Unbounded: the relay bounds it
    (token_buffer_max). Beyond a queue's: `peek`, and `wait` / `wake`, so that a stream
    waits for its first item or its dispatch on the one future its reader already has
    (RequestHandle.mark_dispatched), with no task or event of its own."""

    __slots__ = ("_items", "_waiter", "_wakeable")

    def __init__(self) -> None:
        self._items: deque = deque()
        self._waiter: asyncio.Future | None = None
        self._wakeable = False  # the waiter is wait()'s: wake() resolves it (get()'s waits for an item)

    def put_nowait(self, item: Any) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def empty(self) -> bool:
        return not self._items

    def qsize(self) -> int:
        return len(self._items)

    def get_nowait(self) -> Any:
        if not self._items:
            raise asyncio.QueueEmpty
        return self._items.popleft()

    def peek(self) -> Any:
        """The next item, left in place (None when there is none)."""
        return self._items[0] if self._items else None

    async def get(self) -> Any:
        while not self._items:  # (wait() inlined: this is every token chunk's path)
            if self._waiter is not None:
                raise RuntimeError("an Inbox has one reader")
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.popleft()

    async def wait(self) -> None:
        """Until an item is put, or wake() is called (returns at once if one is queued)."""
        if self._items:
            return
        if self._waiter is not None:
            raise RuntimeError("an Inbox has one reader")
        self._waiter = asyncio.get_running_loop().create_future()
        self._wakeable = True
        try:
            await self._waiter
        finally:
            self._waiter = None
            self._wakeable = False

    def wake(self) -> None:
        """Wake the reader waiting in wait() without an item: something else it waits on
        changed (RequestHandle.mark_dispatched). A reader in get(), or none, is left alone."""
        if self._wakeable and not self._waiter.done():
            self._waiter.set_result(None)


@dataclass
class RequestHandle:
    request: m.Request  # what the client asked, whole (schemas/messages.py): its fields are read through it
    arrival_ns: int
    queue: Inbox = field(default_factory=Inbox)  # TokensGenerated | Terminal
    next_index: int = 0  # index of the next output token we expect
    num_buffered: int = 0  # token chunks queued and not yet read by the client
    prefill_worker_id: str = ""
    decode_worker_id: str = ""
    batch_id: str = ""
    done: bool = False  # the client has been given its terminal outcome
    first_token_ns: int = 0
    grace_task: asyncio.Task | None = None
    admit: AdmitRequest | None = None  # what it was admitted with, for a re-route
    num_reroutes: int = 0
    timeout_s: float = 600.0  # its deadline, from arrival
    token_subject: str = ""  # where its tokens go (this router's, or a forwarding standby's)
    remote: bool = False  # forwarded by a standby: no local client reads this handle
    forwarded_by: str = ""  # remote: the router that forwarded it (its client's), SubmitRequest.router_id
    leader_id: str = ""  # standby: the leader that admitted it (we forwarded it there)
    leader_pool: str = ""  # the pool whose leader that is ("": the cluster's one leader)
    # A batch holding it was dispatched (the acked publish: Dispatcher.dispatch), here or, forwarded,
    # by its leader (its batch.dispatched event): its client's stream may start (mark_dispatched).
    dispatched: bool = False
    ahead: dict[int, Any] = field(default_factory=dict)  # chunks past a gap, by start index (relay)
    resend_task: asyncio.Task | None = None  # the gap's deadline while a resend is awaited
    slo_ttft_ms: float = 0.0  # the targets it was admitted with (0: unknown); flexlb_slo_requests_total
    slo_tpot_ms: float = 0.0
    # Set while it waits in the fair queue (the leader's, or the leader's a standby forwarded it
    # to): resolved None when admitted, or with the Rejected that refused it.
    admission: asyncio.Future | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.request.prompt_token_ids

    @property
    def max_tokens(self) -> int:
        return self.request.max_tokens

    @property
    def stop(self) -> list[str]:
        return self.request.stop  # OpenAI stop strings (the API cuts the text at the first)

    @property
    def chat(self) -> m.ChatForward | None:
        return self.request.chat

    @property
    def sampling(self) -> m.Sampling | None:
        return self.request.sampling  # how its tokens are drawn (None: greedy)

    @property
    def tenant(self) -> str:
        return self.request.tenant  # ("": the default tenant)

    def mark_dispatched(self) -> None:
        """Its batch went (module docstring of services/api.py: a stream's response starts at
        its dispatch or its first item, whichever comes first): wake its client's reader."""
        self.dispatched = True
        self.queue.wake()

    @property
    def is_forward(self) -> bool:
        """Ours, scheduled by another router: forwarded to a leader (or handed over to a new one
        when we stopped leading). A local request has `admit` set and no leader; a remote one is a standby's."""
        return not self.remote and (bool(self.leader_id) or self.admit is None)


class RouterState:
    """One router's shared facts (module docstring). Built by RouterService, which wires the
    connections in at start()."""

    def __init__(self, settings: RouterSettings, boot_id: str, scheduler: Scheduler | Recorder) -> None:
        self.settings = settings
        self.router_id = settings.router_id
        self.boot_id = boot_id
        self.metrics = RouterMetrics()
        self.scheduler: Scheduler | Recorder = scheduler
        self.records = RequestRecords(RECENT_RECORDS_MAX)
        self.snapshot_requested_ns: dict[str, int] = {}  # worker id -> when we last asked for a KV snapshot
        self.envelopes = m.EnvelopeFactory(self.router_id, self.boot_id)
        self.handles: dict[str, RequestHandle] = {}  # request id -> handle, until the client is answered
        self.batch_pending: dict[str, set[str]] = {}  # batch id -> member request ids without terminal event
        self.request_batch: dict[str, str] = {}  # request id -> batch id
        self.epoch = 0  # fencing epoch: a Redis counter bumped at every router start (see start())
        self.wakeup = asyncio.Event()
        self.nc = None
        self.js = None
        self.acked: AckedPublisher | None = None  # terminal events and the journal: re-sent until the stream acks
        self.redis = None
        self.ledger: Ledger | None = None
        self.events_sub = None  # the durable pull consumer of worker events (fold)
        self.started_ns = 0
        self.running = False
        self.bus_state = "disconnected"
        self.view_ready_after_ms: float | None = None  # start -> first complete worker view
        self.num_dispatched: dict[str, int] = {}  # worker id -> requests dispatched to it
        self.num_finished: dict[str, int] = {}  # worker id -> requests finished on it
        self.reported_drained: set[str] = set()  # draining workers whose "drained" event went out
        self.seen_draining: set[str] = set()  # workers that reported draining themselves (told to stop), until ready again
        self.release_buffer: list[str] = []  # ledger fields to release after the current event batch
        self.liveness_grace_cycles = 0  # liveness cycles to skip (after our own bus outage)
        self.bus_silent_since_ns = 0  # our NATS server stopped answering pings then (0: it answers)
        self.is_leader = False  # holds the Redis lease: schedules and dispatches
        # time.monotonic() until which our lease surely holds (its TTL, counted from before the
        # renewal was sent). Past it, unrenewed (Redis unreachable), we dispatch nothing: a
        # standby that reaches Redis may hold the lease by then.
        self.lease_valid_until = 0.0
        self.dispatch_paused = False  # leader whose lease outran its renewal: dispatching nothing
        # Stopping while leading (leadership.hand_off): the lease was given up, never renewed or
        # taken again; nothing more is dispatched (what is queued goes to the new leader).
        self.handing_off = False
        self.max_worker_epoch = 0  # the highest epoch any worker reports accepting (status)
        self.fenced_by_epoch = 0  # the highest of those from workers we dispatched to
        self.fenced = asyncio.Event()  # set when that exceeds ours: leadership steps down
        self.lease_value = f"{self.router_id}:{self.boot_id}"
        self.submit_sub = None
        self.ledger_dirty = False  # Redis missed writes (outage/restart): rebuild it from the mirror
        self.redis_run_id: str | None = None
        self.pool = settings.scheduling_pool  # the one pool this router leads ("": all)
        self.worker_models: dict[str, str] = {}  # worker id -> its model, every pool's (note_worker_model)
        self.adapter_models: dict[str, str] = {}  # LoRA adapter -> its parent model

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

    def finish_router(self, handle: RequestHandle | None, outcome: str, code: str | None, message: str) -> None:
        """Give the client its terminal outcome (once)."""
        if handle is None:
            return
        if handle.done:
            self.metrics.duplicate_terminal.inc()
            return
        handle.done = True
        self.handles.pop(handle.request_id, None)
        if handle.grace_task is not None:
            handle.grace_task.cancel()
        handle.queue.put_nowait(Terminal(outcome, code, message))
        if handle.admission is not None and not handle.admission.done():  # it ended while in a fair queue
            handle.admission.set_result(Rejected(code or outcome, message))
