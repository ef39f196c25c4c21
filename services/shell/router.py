"""The router process: wires the pure core to NATS, Redis and the HTTP API.

Inputs
- `flexlb.evt.status.>` — an ordered JetStream consumer that starts from the last report of
  every worker (DeliverLastPerSubject), so a restarted router rebuilds its worker view from
  one heartbeat interval of history. A report's time is min(producer time, receive time),
  so a dead worker's last report does not look fresh after a restart.
- `flexlb.evt.req.>` — worker lifecycle events, a durable pull consumer named after the
  router id: a restarted router resumes where it stopped and releases ledger entries for
  requests that finished while it was down.
- `flexlb.tok.<router>.*` — token chunks (core NATS), relayed to clients.

Outputs
- one `DispatchBatch` per batch, JetStream-published with the batch id as `Nats-Msg-Id`
  (the server dedupes a retried publish; workers dedupe a redelivery);
- router events (admitted, rejected, batch dispatched, router-side failures) on
  `flexlb.evt.router.<router>`, published without waiting for acks (they are a record,
  not a command).

Per batch, the hot path costs one Redis script call (reserve) and one acked JetStream
publish; per request, two event publishes (route.decided, request.admitted). Ledger
releases (prefill.completed, terminal events) are gathered per fetched batch of worker
events and sent as one script call per fetch (bench/README.md has the measured counts).

Undecodable messages on any subject are counted and republished to `flexlb.dlq.<router>`
with the reason; consumers keep running.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import msgspec
import redis.asyncio as aioredis
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from schemas import messages as m
from schemas.errors import ErrorBody, error_code
from schemas.subjects import (
    ALL_STREAMS,
    JOURNAL_STREAM,
    DISPATCH_STREAM,
    STATUS_STREAM,
    ALL_KV_EVENTS,
    ALL_STATUS,
    ALL_WORKER_EVENTS,
    EVENTS_STREAM,
    HDR_MSG_ID,
    all_tokens_subject,
    cancel_subject,
    ALL_ROUTER_EVENTS,
    dispatch_subject,
    epoch_subject,
    journal_subject,
    submit_subject,
    kv_snapshot_request_subject,
    router_events_consumer,
    router_events_subject,
    token_subject,
)
from schemas.tokens import block_hashes
from services.core.journal import Recorder
from services.core.scheduler import AdmitRequest, Admitted, FormedBatch, QueueFailure, Rejected, RouteDecision, Scheduler
from services.settings import RouterSettings
from services.shell.bus import connect, dead_letter, ensure_streams
from services.shell.ledger import Ledger, LedgerEntry, kv_field, prefill_field
from services.shell.metrics import RouterMetrics

log = logging.getLogger("flexlb.router")

EXPECTED_DECODE_CAP_TOKENS = 1000  # expected KV = prompt + min(max_tokens, 1000), as FlexLB
RECENT_RECORDS_MAX = 10_000  # requests whose decision record /admin/requests/{id} can show
# An event fetched by a router that then died is redelivered after this long (to its
# restarted self): short, so the ledger entries it releases do not linger.
EVENTS_ACK_WAIT_S = 5.0
MAX_REROUTES = 1  # a request whose worker died is re-routed at most this many times
LEASE_TTL_S = 2.0  # the leader's lease; a standby takes over at most this long after it dies
LEASE_RENEW_S = 0.5  # renew (leader) / try to take (standby) this often
FORWARD_TIMEOUT_S = 5.0  # a standby waits this long for the leader to admit a forwarded request
RENEW_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""
# Take the lease if it is free, or held by an earlier incarnation of this same router id
# (router ids are unique per process: that incarnation is dead, no need to wait out its TTL).
ACQUIRE_LUA = """
local cur = redis.call('GET', KEYS[1])
if (not cur) or string.sub(cur, 1, string.len(ARGV[3])) == ARGV[3] then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
"""
SNAPSHOT_RETRY_NS = 1_000_000_000  # ask a worker for a KV snapshot at most once a second


class RequestRecords:
    """Decision records of live and recent requests, for GET /admin/requests/{id}: the
    admission verdict, the routing decisions with every candidate's score card, the batch,
    and a timeline of what happened, in ms since arrival. Bounded: oldest forgotten first."""

    def __init__(self, capacity: int) -> None:
        from collections import OrderedDict

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
            # The shape of `flexlb explain --json` (t_ms, source, what), plus "event" as before.
            rec["timeline"].append({"t_ms": round((now_ns - rec["arrival_ns"]) / 1e6, 3), "source": "router", "what": what,
                                    "event": what, **detail})

    def get(self, request_id: str) -> dict[str, Any] | None:
        return self.records.get(request_id)


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


@dataclass
class RequestHandle:
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    arrival_ns: int
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)  # TokensGenerated | Terminal
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
    leader_id: str = ""  # standby: the leader that admitted it (we forwarded it there)
    dispatched: bool = False  # standby: the leader's batch.dispatched listed it
    sampling: m.Sampling | None = None  # how its tokens are drawn (None: greedy)


class RouterService:
    def __init__(self, settings: RouterSettings) -> None:
        self.settings = settings
        self.router_id = settings.router_id
        self.boot_id = secrets.token_hex(4)
        self.metrics = RouterMetrics()
        self.journal_queue: deque[bytes] = deque()  # core.recorded events not yet published, in call order
        self.journal_wakeup = asyncio.Event()
        self.journal_envelopes = m.EnvelopeFactory(self.router_id, f"{self.boot_id}.journal")  # gap-free seq of its own
        core = Scheduler(settings.scheduler_config(), id_prefix=f"{self.router_id}-{self.boot_id}")
        self.scheduler = Recorder(core, self._journal) if settings.journal else core
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
        self.redis = None
        self.ledger: Ledger | None = None
        self.tasks: list[asyncio.Task] = []
        self.started_ns = 0
        self.running = False
        self.bus_state = "disconnected"
        self.view_ready_after_ms: float | None = None  # start -> first complete worker view
        self.num_dispatched: dict[str, int] = {}  # worker id -> requests dispatched to it
        self.num_finished: dict[str, int] = {}  # worker id -> requests finished on it
        self.reported_drained: set[str] = set()  # draining workers whose "drained" event went out
        self.release_buffer: list[str] = []  # ledger fields to release after the current event batch
        self.liveness_grace_cycles = 0  # liveness cycles to skip (after our own bus outage)
        self.is_leader = False  # holds the Redis lease: schedules and dispatches
        self.lease_value = f"{self.router_id}:{self.boot_id}"
        self.submit_sub = None
        self.ledger_dirty = False  # Redis missed writes (outage/restart): rebuild it from the mirror
        self.redis_run_id: str | None = None

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        self.started_ns = time.time_ns()
        self.nc = await connect(self.settings.nats_url, f"flexlb-router-{self.router_id}", self._on_bus_state)
        self.bus_state = "connected"
        self.js = self.nc.jetstream()
        await ensure_streams(self.js, self._stream_specs())
        self.redis = aioredis.from_url(self.settings.redis_url, socket_timeout=2, socket_connect_timeout=1)
        self.ledger = Ledger(self.redis, self.settings.cluster, self.settings.ledger_ttl_s)
        await self._refresh_drain_flags()
        self.running = True
        await self._lease_cycle()
        await self.nc.subscribe(all_tokens_subject(self.router_id), cb=self._on_token_msg)
        await self.nc.subscribe(ALL_ROUTER_EVENTS, cb=self._on_router_event_msg)
        # Live status and KV events arrive on plain subscriptions, which nats-py re-creates
        # on every reconnect (an ephemeral JetStream consumer did not survive a server
        # restart, and the router then heard no heartbeat ever again). The streams still
        # record them for replay; at start the last report of every worker is read from the
        # status stream, so a restarted router has its view within one round trip.
        if self.settings.prefix_index == "exact":
            await self.nc.subscribe(ALL_KV_EVENTS, cb=self._on_kv_msg)
        await self.nc.subscribe(ALL_STATUS, cb=self._on_status_msg)
        await self._load_last_status()
        self.events_sub = await self.js.pull_subscribe(
            ALL_WORKER_EVENTS,
            durable=router_events_consumer(self.router_id),
            stream=EVENTS_STREAM.name,
            config=ConsumerConfig(deliver_policy=DeliverPolicy.NEW, ack_policy=AckPolicy.EXPLICIT, ack_wait=EVENTS_ACK_WAIT_S, max_ack_pending=20000),
        )
        self.tasks = [
            asyncio.create_task(self._events_loop(), name="events"),
            asyncio.create_task(self._batch_loop(), name="batches"),
            asyncio.create_task(self._liveness_loop(), name="liveness"),
            asyncio.create_task(self._sweep_loop(), name="ledger-sweep"),
            asyncio.create_task(self._lease_loop(), name="lease"),
            asyncio.create_task(self._journal_loop(), name="journal"),
        ]
        log.info("router %s (boot %s) started", self.router_id, self.boot_id)

    async def stop(self) -> None:
        self.running = False
        self.wakeup.set()
        for item in self.scheduler.drain_queues():
            self._finish_router(item.payload, "failed", "no_worker", "router shutting down before dispatch")
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        if self.nc is not None:
            await self._flush_journal()
            try:
                await asyncio.wait_for(self.nc.drain(), 3.0)
            except Exception as exc:  # bus gone at shutdown: close without draining, say so
                log.warning("nats drain on stop failed (%s); closing", exc.__class__.__name__)
                await self.nc.close()
        if self.redis is not None:
            await self.redis.aclose()

    async def _load_last_status(self) -> None:
        try:
            info = await self.js.stream_info(STATUS_STREAM.name, subjects_filter=ALL_STATUS)
            subjects = sorted((info.state.subjects or {}).keys())
        except Exception as exc:  # no history: the live subscription fills the view
            log.warning("could not read the status stream: %s", exc)
            return
        for subject in subjects:
            try:
                msg = await self.js.get_last_msg(STATUS_STREAM.name, subject)
            except Exception as exc:  # e.g. purged meanwhile
                log.warning("could not read the last status on %s: %s", subject, exc)
                continue
            await self._on_status_msg(msg)

    async def _on_bus_state(self, state: str) -> None:
        self.bus_state = state
        if state == "reconnected":
            # Heartbeats we missed while we were cut off are our fault, not the workers':
            # give them a full detection window to be heard again before counting misses.
            self.liveness_grace_cycles = self.settings.dead_after_missed_syncs + 1

    # ------------------------------------------------------------------ health
    async def readiness(self) -> tuple[bool, str]:
        if self.nc is None or not self.nc.is_connected:
            return False, "nats not connected"
        try:
            await asyncio.wait_for(self.redis.ping(), 1.0)
            if not self.is_leader and not await self.redis.exists(self._lease_key()):
                return False, "no leader router holds the scheduling lease (failover in progress)"
        except Exception as exc:  # any failure of the ping is a "not ready" with its reason
            return False, f"redis not answering: {exc.__class__.__name__}: {exc}"
        return self.scheduler.view.readiness(time.time_ns(), self.scheduler.timeout_ns)

    # ------------------------------------------------------------------ the core journal
    def _stream_specs(self) -> tuple:
        st = self.settings
        return tuple(
            msgspec.structs.replace(spec, max_age_s=st.events_max_age_s, max_bytes=st.events_max_bytes)
            if spec.name == EVENTS_STREAM.name else
            msgspec.structs.replace(spec, max_age_s=st.journal_max_age_s, max_bytes=st.journal_max_bytes)
            if spec.name == JOURNAL_STREAM.name else spec
            for spec in ALL_STREAMS
        )

    def _journal(self, op: str, now_ns: int, args: dict, out: dict) -> None:
        """The Recorder's sink: called synchronously, in the core's call order."""
        rec = m.CoreRecorded(router_id=self.router_id, op=op, now_ns=now_ns, args=args, out=out)
        self.journal_queue.append(m.encode(self.journal_envelopes.wrap(rec, time.time_ns())))
        self.journal_wakeup.set()

    async def _journal_loop(self) -> None:
        while self.running:
            await self.journal_wakeup.wait()
            self.journal_wakeup.clear()
            await self._flush_journal()

    async def _flush_journal(self) -> None:
        """Publish queued records in order (fire-and-forget into FLEXLB_JOURNAL, like events).
        A record the bus refuses is lost and counted; replay sees the seq gap and says so."""
        subject = journal_subject(self.router_id)
        while self.journal_queue:
            data = self.journal_queue.popleft()
            try:
                await self.nc.publish(subject, data)
                self.metrics.journal_records.inc()
            except Exception as exc:  # bus gone: the record is lost; counted, and replay reports the gap
                self.metrics.journal_lost.inc()
                log.error("journal record lost: %s", exc)

    # ------------------------------------------------------------------ events out
    async def _emit(self, payload: Any) -> None:
        env = self.envelopes.wrap(payload, time.time_ns())
        try:
            await self.nc.publish(router_events_subject(self.router_id), m.encode(env))
        except Exception as exc:  # the record is lost only if the bus is gone; say so loudly
            self.metrics.consumer_errors.labels("emit").inc()
            log.error("could not publish %s: %s", type(payload).__name__, exc)

    # ------------------------------------------------------------------ requests
    def new_request_id(self) -> str:
        return "cmpl-" + secrets.token_hex(12)

    async def submit(
        self, request_id: str, prompt_token_ids: list[int], max_tokens: int, priority: int | None = None,
        slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None, timeout_s: float | None = None,
        sampling: m.Sampling | None = None,
    ) -> RequestHandle | Rejected:
        """Admit (or reject) a parsed request; on admission it is queued for batching. A
        standby router forwards it to the leader and relays its tokens and outcome."""
        if not self.is_leader:
            return await self._forward(request_id, prompt_token_ids, max_tokens, priority, slo_ttft_ms, slo_tpot_ms, timeout_s,
                                       sampling)
        return await self._admit_local(request_id, prompt_token_ids, max_tokens, priority, slo_ttft_ms, slo_tpot_ms,
                                       timeout_s, sampling=sampling)

    async def _admit_local(
        self, request_id: str, prompt_token_ids: list[int], max_tokens: int, priority: int | None,
        slo_ttft_ms: float | None, slo_tpot_ms: float | None, timeout_s: float | None,
        token_subject_override: str = "", sampling: m.Sampling | None = None,
    ) -> RequestHandle | Rejected:
        now = time.time_ns()
        if request_id in self.handles:
            return await self.reject(request_id, "duplicate_request", f"request {request_id} is already in flight")
        handle = RequestHandle(request_id, prompt_token_ids, max_tokens, now,
                               timeout_s=timeout_s if timeout_s is not None else self.settings.request_timeout_s,
                               token_subject=token_subject_override, remote=bool(token_subject_override),
                               sampling=sampling)
        hashes = tuple(block_hashes(prompt_token_ids, self.scheduler.block_size_tokens()))
        handle.admit = AdmitRequest(
            request_id=request_id, num_prompt_tokens=len(prompt_token_ids), max_tokens=max_tokens, block_hashes=hashes,
            priority=priority, slo_ttft_ms=slo_ttft_ms, slo_tpot_ms=slo_tpot_ms, payload=handle,
        )
        decision = self.scheduler.admit(handle.admit, now)
        rec = self.records.open(request_id, now, num_prompt_tokens=len(prompt_token_ids), max_tokens=max_tokens,
                                decisions=[decision_view(d) for d in decision.decisions])
        self.records.note(request_id, now, "arrived")
        for d in decision.decisions:
            await self._emit(decision_event(request_id, self.router_id, d))
        if isinstance(decision, Rejected):
            rec["admission"] = {"verdict": "rejected", "code": decision.code, "message": decision.message,
                                "predicted_ttft_ms": decision.predicted_ttft_ms, "slo_ttft_ms": decision.slo_ttft_ms}
            return await self.reject(request_id, decision.code, decision.message)
        assert isinstance(decision, Admitted)
        rec["admission"] = {
            "verdict": "best_effort" if decision.best_effort else "admitted",
            "predicted_ttft_ms": round(decision.predicted_ttft_ms, 3), "slo_ttft_ms": decision.slo_ttft_ms,
            "slo_tpot_ms": decision.slo_tpot_ms, "priority": decision.priority,
            "prefill_worker_id": decision.request.prefill_worker_id, "decode_worker_id": decision.request.decode_worker_id,
            "predicted_cached_tokens": decision.request.num_cached_tokens,
        }
        handle.prefill_worker_id = decision.request.prefill_worker_id
        handle.decode_worker_id = decision.request.decode_worker_id
        self.handles[request_id] = handle
        self.metrics.inflight.set(len(self.scheduler.inflight))
        if decision.best_effort:
            self.metrics.best_effort.inc()
        await self._emit(
            m.RequestAdmitted(
                request_id=request_id, router_id=self.router_id, prefill_worker_id=handle.prefill_worker_id,
                decode_worker_id=handle.decode_worker_id, num_prompt_tokens=len(prompt_token_ids), max_tokens=max_tokens,
                policy=decision.policy, reason=decision.prefill_pick.reason,
                predicted_ttft_ms=round(decision.predicted_ttft_ms, 3), slo_ttft_ms=decision.slo_ttft_ms,
                slo_tpot_ms=decision.slo_tpot_ms, priority=decision.priority, best_effort=decision.best_effort,
                num_cached_tokens=decision.request.num_cached_tokens,
            )
        )
        self.records.note(request_id, now, "admitted", prefill_worker_id=handle.prefill_worker_id,
                          decode_worker_id=handle.decode_worker_id)
        self.wakeup.set()
        return handle

    # ------------------------------------------------------------------ leadership
    def _lease_key(self) -> str:
        return f"flexlb:{self.settings.cluster}:leader"

    async def _lease_loop(self) -> None:
        while self.running:
            await asyncio.sleep(LEASE_RENEW_S)
            try:
                await self._lease_cycle()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis away: a leader keeps its lease until it expires
                self.metrics.consumer_errors.labels("lease").inc()
                log.warning("lease cycle failed: %s", exc)

    async def _lease_cycle(self) -> None:
        """Hold or take the scheduling lease (Redis, PX TTL). Taking it bumps the fencing epoch,
        announced to every worker, so the previous leader's commands are refused."""
        key = self._lease_key()
        ttl_ms = int(LEASE_TTL_S * 1000)
        if self.is_leader:
            renewed = await self.redis.eval(RENEW_LUA, 1, key, self.lease_value, ttl_ms)
            if not renewed:
                await self._step_down("lease lost")
            return
        if await self.redis.eval(ACQUIRE_LUA, 1, key, self.lease_value, ttl_ms, f"{self.router_id}:"):
            self.epoch = int(await self.redis.incr(f"flexlb:{self.settings.cluster}:epoch"))
            self.is_leader = True
            self.submit_sub = await self.nc.subscribe(submit_subject(self.settings.cluster), cb=self._on_submit)
            self.metrics.leader.set(1)
            log.warning("router %s is the leader (epoch %d)", self.router_id, self.epoch)
            await self._announce_epoch()
            await self._fail_stranded_forwards(self.router_id)
            return
        holder = await self.redis.get(key)
        if holder:
            await self._fail_stranded_forwards((holder.decode() if isinstance(holder, bytes) else holder).split(":")[0])

    async def _fail_stranded_forwards(self, leader_id: str) -> None:
        """Standby: requests we forwarded to a leader that is gone, and that it never
        dispatched, were queued in its memory only: nothing will ever answer them. Fail them
        now (retryable) instead of at their deadline. One it dispatched is running on a worker
        that streams to us directly and is left alone. (A lost batch.dispatched event makes
        us fail a request that is running: the client retries; its tokens are dropped.)"""
        for handle in list(self.handles.values()):
            if (handle.leader_id and handle.leader_id != leader_id and not handle.remote and not handle.done
                    and not handle.dispatched and handle.next_index == 0):
                self.metrics.requests.labels("failed", "not_ready").inc()
                self.records.note(handle.request_id, time.time_ns(), "failed_by_router", code="not_ready",
                                  message=f"leader {handle.leader_id} gone before dispatching it")
                self._finish_router(handle, "failed", "not_ready",
                                    f"leader router {handle.leader_id} is gone and had not dispatched it; retry")

    async def _step_down(self, why: str) -> None:
        log.error("router %s steps down: %s", self.router_id, why)
        self.is_leader = False
        self.metrics.leader.set(0)
        if self.submit_sub is not None:
            await self.submit_sub.unsubscribe()
            self.submit_sub = None
        for item in self.scheduler.drain_queues():  # not dispatched: the client may retry elsewhere
            self._finish_router(item.payload, "failed", "not_ready", f"router {self.router_id} lost the leadership")
            await self._emit(m.RequestFailed(request_id=item.request_id, worker_id=self.router_id, code="not_ready",
                                             message="router lost the leadership before dispatch", retryable=True))

    async def _forward(self, request_id, prompt_token_ids, max_tokens, priority, slo_ttft_ms, slo_tpot_ms, timeout_s,
                       sampling=None):
        handle = RequestHandle(request_id, prompt_token_ids, max_tokens, time.time_ns(),
                               timeout_s=timeout_s if timeout_s is not None else self.settings.request_timeout_s)
        self.handles[request_id] = handle
        cmd = m.SubmitRequest(
            request_id=request_id, router_id=self.router_id, prompt_token_ids=prompt_token_ids, max_tokens=max_tokens,
            token_subject=token_subject(self.router_id, request_id), priority=priority, slo_ttft_ms=slo_ttft_ms,
            slo_tpot_ms=slo_tpot_ms, timeout_s=timeout_s, sampling=sampling,
        )
        try:
            msg = await self.nc.request(submit_subject(self.settings.cluster), m.encode(self.envelopes.wrap(cmd, time.time_ns())),
                                        timeout=FORWARD_TIMEOUT_S)
            reply = m.decode_as(msg.data, m.SubmitReply).payload
        except Exception as exc:  # no leader now (failover in progress) or a broken reply
            self.handles.pop(request_id, None)
            self.metrics.requests.labels("rejected", "not_ready").inc()
            return Rejected("not_ready", f"no leader router answered ({exc.__class__.__name__}); retry")
        if not reply.admitted:
            self.handles.pop(request_id, None)
            return Rejected(reply.code, reply.message)
        handle.prefill_worker_id, handle.decode_worker_id = reply.prefill_worker_id, reply.decode_worker_id
        handle.leader_id = reply.router_id
        self.metrics.forwarded.inc()
        return handle

    async def _on_submit(self, msg) -> None:
        """Leader: a standby forwarded a request."""
        try:
            cmd = m.decode_as(msg.data, m.SubmitRequest).payload
        except m.DecodeError as exc:
            await self._undecodable("submit", msg, exc)
            return
        if not self.is_leader:
            reply = m.SubmitReply(request_id=cmd.request_id, router_id=self.router_id, admitted=False, code="not_ready",
                                  message="not the leader any more")
        else:
            out = await self._admit_local(cmd.request_id, cmd.prompt_token_ids, cmd.max_tokens, cmd.priority,
                                          cmd.slo_ttft_ms, cmd.slo_tpot_ms, cmd.timeout_s, token_subject_override=cmd.token_subject,
                                          sampling=cmd.sampling)
            if isinstance(out, Rejected):
                reply = m.SubmitReply(request_id=cmd.request_id, router_id=self.router_id, admitted=False,
                                      code=out.code, message=out.message)
            else:
                reply = m.SubmitReply(request_id=cmd.request_id, router_id=self.router_id, admitted=True,
                                      prefill_worker_id=out.prefill_worker_id, decode_worker_id=out.decode_worker_id)
        await msg.respond(m.encode(self.envelopes.wrap(reply, time.time_ns())))

    async def _on_router_event_msg(self, msg) -> None:
        """Standby: the leader's router-side terminal events for requests we forwarded."""
        if self.is_leader:
            return
        try:
            ev = m.decode(msg.data).payload
        except m.DecodeError as exc:
            await self._undecodable("router_events", msg, exc)
            return
        if isinstance(ev, m.BatchDispatched):
            for rid in ev.request_ids:
                handle = self.handles.get(rid)
                if handle is not None:
                    handle.dispatched = True
            return
        if not isinstance(ev, (m.RequestFailed, m.RequestTimedOut, m.RequestCancelled)):
            return
        handle = self.handles.get(ev.request_id)
        if handle is None or handle.done:
            return
        code = getattr(ev, "code", None) or ("timed_out" if isinstance(ev, m.RequestTimedOut) else "cancelled")
        self._finish_router(handle, "failed", code, getattr(ev, "message", "") or code)

    async def reject(self, request_id: str, code: str, message: str) -> Rejected:
        self.metrics.requests.labels("rejected", code).inc()
        self.records.note(request_id, time.time_ns(), "rejected", code=code, message=message)
        await self._emit(m.RequestRejected(request_id=request_id, router_id=self.router_id, code=code, message=message))
        return Rejected(code, message)

    async def cancel(self, handle: RequestHandle, reason: str) -> None:
        """Client gone or timed out: stop the work. The worker reports the terminal event."""
        if handle.done:
            return
        removed = self.scheduler.remove_queued(handle.request_id)
        if removed is not None:  # never dispatched: the router owns the terminal event
            self._finish_router(handle, "cancelled", "cancelled", reason)
            await self._emit(m.RequestCancelled(request_id=handle.request_id, worker_id=self.router_id, reason=reason))
            return
        handle.done = True
        self.handles.pop(handle.request_id, None)
        for worker in {handle.prefill_worker_id, handle.decode_worker_id}:
            if worker:
                cmd = m.CancelRequest(request_id=handle.request_id, worker_id=worker, reason=reason)
                await self.nc.publish(cancel_subject(worker), m.encode(self.envelopes.wrap(cmd, time.time_ns())))

    def _finish_router(self, handle: RequestHandle | None, outcome: str, code: str | None, message: str) -> None:
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

    # ------------------------------------------------------------------ batching and dispatch
    async def _batch_loop(self) -> None:
        while self.running:
            due = self.scheduler.next_due_ns(time.time_ns())
            self.wakeup.clear()
            if due is None:
                await self.wakeup.wait()
            else:
                delay_s = (due - time.time_ns()) / 1e9
                if delay_s > 0:
                    try:
                        await asyncio.wait_for(self.wakeup.wait(), delay_s)
                    except asyncio.TimeoutError:
                        pass  # the earliest batch window elapsed: poll below
            result = self.scheduler.tick(time.time_ns())
            while self.scheduler.poll_errors:
                self.metrics.consumer_errors.labels("batcher").inc()
                log.error("batcher poll failed (queue kept, retried next tick): %s", self.scheduler.poll_errors.pop())
            for failure in result.failures:
                await self._fail_queued(failure)
            for batch in result.batches:
                try:
                    await self._dispatch(batch)
                except Exception:  # one failed dispatch must not stop the others
                    log.exception("dispatch of %s failed", batch.batch_id)

    async def _fail_queued(self, failure: QueueFailure) -> None:
        """A queued request the batcher gave up on: the router owns its terminal event."""
        item = failure.item
        self.metrics.requests.labels("timed_out" if failure.code == "queue_timeout" else "failed", failure.code).inc()
        self.records.note(item.request_id, time.time_ns(), "queue_failure", code=failure.code, message=failure.message)
        self._finish_router(item.payload, "failed", failure.code, failure.message)
        if failure.code == "queue_timeout":
            await self._emit(m.RequestTimedOut(request_id=item.request_id, worker_id=self.router_id, phase="queued"))
        else:
            await self._emit(m.RequestFailed(request_id=item.request_id, worker_id=self.router_id, code=failure.code,
                                             message=failure.message))

    async def _dispatch(self, batch: FormedBatch) -> None:
        now = time.time_ns()
        requests: list[m.BatchRequest] = []
        entries = [
            LedgerEntry(batch.worker_id, prefill_field(batch.batch_id), {
                "kind": "prefill", "batch_id": batch.batch_id, "request_ids": [i.request_id for i in batch.items],
                "num_prompt_tokens": batch.num_prompt_tokens, "created_ms": now // 1_000_000,
            })
        ]
        for item in batch.items:
            handle: RequestHandle = item.payload
            handle.batch_id = batch.batch_id
            self.request_batch[item.request_id] = batch.batch_id
            requests.append(m.BatchRequest(
                request_id=item.request_id, prompt_token_ids=handle.prompt_token_ids, max_tokens=item.max_tokens,
                decode_worker_id=item.decode_worker_id,
                token_subject=handle.token_subject or token_subject(self.router_id, item.request_id),
                deadline_ns=handle.arrival_ns + int(handle.timeout_s * 1e9), sampling=handle.sampling,
            ))
            entries.append(LedgerEntry(item.decode_worker_id, kv_field(item.request_id), {
                "kind": "decode", "request_id": item.request_id, "batch_id": batch.batch_id,
                "hard_kv_tokens": item.num_prompt_tokens,
                "expected_kv_tokens": item.num_prompt_tokens + min(item.max_tokens, EXPECTED_DECODE_CAP_TOKENS),
                "created_ms": now // 1_000_000,
            }))
        self.batch_pending[batch.batch_id] = {i.request_id for i in batch.items}
        cmd = m.DispatchBatch(
            batch_id=batch.batch_id, router_id=self.router_id, worker_id=batch.worker_id, epoch=self.epoch, requests=requests
        )
        try:
            await self.ledger.reserve(entries, now // 1_000_000)
        except Exception as exc:  # Redis away: the in-memory mirror keeps scheduling; resync later
            self._ledger_failed("reserve", exc)
        try:
            await self.js.publish(
                dispatch_subject(batch.worker_id), m.encode(self.envelopes.wrap(cmd, now)),
                headers={HDR_MSG_ID: batch.batch_id}, timeout=5,
            )
        except Exception as exc:  # roll back the reservation and fail the batch visibly
            self.metrics.dispatch_failures.inc()
            log.error("dispatch of batch %s to %s failed: %s", batch.batch_id, batch.worker_id, exc)
            # Uncertain: the command may have been stored without its ack reaching us. Withdraw
            # its requests, so that if it does arrive the worker drops them silently.
            for item in batch.items:
                await self._withdraw(item.request_id, {batch.worker_id, item.decode_worker_id}, "dispatch uncertain")
            try:
                await self.ledger.release([e.field for e in entries])
            except Exception as rel_exc:  # Redis down too: the TTL sweep evicts them later
                log.error("rollback of batch %s reservations failed: %s", batch.batch_id, rel_exc)
            self.batch_pending.pop(batch.batch_id, None)
            self.scheduler.rollback(batch)
            for item in batch.items:
                self.request_batch.pop(item.request_id, None)
                self.metrics.requests.labels("failed", "dispatch_failed").inc()
                self._finish_router(item.payload, "failed", "dispatch_failed", f"dispatch to {batch.worker_id} failed: {exc}")
                await self._emit(m.RequestFailed(
                    request_id=item.request_id, worker_id=self.router_id, code="dispatch_failed",
                    message=str(exc), retryable=True,
                ))
            return
        self.metrics.batches.labels(batch.reason).inc()
        self.metrics.batch_size.observe(len(batch.items))
        self.num_dispatched[batch.worker_id] = self.num_dispatched.get(batch.worker_id, 0) + len(batch.items)
        for item in batch.items:
            self.records.note(item.request_id, now, "batch_dispatched", batch_id=batch.batch_id, worker_id=batch.worker_id,
                              batch_size=len(batch.items), close_reason=batch.reason,
                              predicted_batch_ms=round(batch.predicted_ms, 3))
        await self._emit(m.BatchDispatched(
            batch_id=batch.batch_id, router_id=self.router_id, worker_id=batch.worker_id, epoch=self.epoch,
            request_ids=[i.request_id for i in batch.items], num_prompt_tokens=batch.num_prompt_tokens, reason=batch.reason,
        ))

    # ------------------------------------------------------------------ inputs
    async def _undecodable(self, source: str, msg, exc: Exception) -> None:
        self.metrics.undecodable.labels(source).inc()
        log.warning("undecodable message on %s: %s", msg.subject, exc)
        try:
            await dead_letter(self.nc, self.router_id, msg.subject, msg.data, str(exc))
        except Exception as dlq_exc:  # the bus is down: the message is lost; say so
            log.error("could not dead-letter a message from %s: %s", msg.subject, dlq_exc)

    async def _on_status_msg(self, msg) -> None:
        try:
            env = m.decode_as(msg.data, m.WorkerStatusReported, m.WorkerRegistered)
        except m.DecodeError as exc:
            await self._undecodable("status", msg, exc)
            return
        now = time.time_ns()
        stale_ns = self.settings.dead_after_missed_syncs * self.settings.liveness_sync_ms * 1_000_000
        info = self.scheduler.on_worker_event(env.payload, min(env.time_ns, now), stale=now - env.time_ns > stale_ns)
        for worker_id, rid in self.scheduler.take_settled():
            await self._settle(worker_id, rid)
        if self.settings.prefix_index == "exact" and info.worker_id not in self.scheduler.index.workers():
            await self._request_snapshot(info.worker_id, "no KV state for this worker yet", now)
        if self.view_ready_after_ms is None and self.scheduler.view.readiness(now, self.scheduler.timeout_ns)[0]:
            self.view_ready_after_ms = round((now - self.started_ns) / 1e6, 1)
            log.info("worker view complete %.1f ms after start", self.view_ready_after_ms)

    async def _settle(self, worker_id: str, request_id: str) -> None:
        """Calibration settled a request: the worker reported it running, then stopped
        reporting it, and no terminal event came (lost). End it once, release its Redis
        entry, and say so."""
        self.metrics.ledger_settlements.inc()
        why = f"worker {worker_id} stopped reporting it and no terminal event arrived"
        handle = self.handles.get(request_id)
        if handle is not None and not handle.done:
            await self._fail_from_router(handle, "worker_failed", why)
        else:
            self.scheduler.on_terminal(request_id)
            await self._release_request(request_id)
        log.warning("settled %s: %s", request_id, why)
        await self._emit(m.LedgerEntryEvicted(worker_id=worker_id, router_id=self.router_id, field=kv_field(request_id),
                                              ttl_s=0.0, reason="calibration"))

    async def _request_snapshot(self, worker_id: str, reason: str, now_ns: int) -> None:
        last = self.snapshot_requested_ns.get(worker_id, 0)
        if now_ns - last < SNAPSHOT_RETRY_NS:
            return
        self.snapshot_requested_ns[worker_id] = now_ns
        cmd = m.RequestKvSnapshot(worker_id=worker_id, requester=self.router_id, reason=reason)
        try:
            await self.nc.publish(kv_snapshot_request_subject(worker_id), m.encode(self.envelopes.wrap(cmd, now_ns)))
        except Exception as exc:  # retried on the next status report after SNAPSHOT_RETRY_NS
            log.warning("could not ask %s for a KV snapshot: %s", worker_id, exc)

    async def _on_kv_msg(self, msg) -> None:
        try:
            env = m.decode_as(msg.data, m.KvBlocksStored, m.KvBlocksRemoved, m.KvAllCleared, m.KvSnapshot)
        except m.DecodeError as exc:
            await self._undecodable("kv", msg, exc)
            return
        update = self.scheduler.on_kv_event(env.payload)
        self.metrics.kv_events.labels(update.status).inc()
        if update.status == "needs_resync":
            await self._request_snapshot(update.worker_id, update.reason, time.time_ns())

    async def _on_token_msg(self, msg) -> None:
        try:
            env = m.decode_as(msg.data, m.TokensGenerated)
        except m.DecodeError as exc:
            await self._undecodable("tokens", msg, exc)
            return
        chunk: m.TokensGenerated = env.payload
        handle = self.handles.get(chunk.request_id)
        if handle is None or handle.done or chunk.worker_id != handle.decode_worker_id:
            # Not ours, finished, or from a worker the request was taken away from (re-routed).
            self.metrics.orphan_tokens.inc()
            return
        if chunk.start_index != handle.next_index:
            self._fail_client(handle, "worker_failed", f"token stream gap: expected index {handle.next_index}, got {chunk.start_index}")
            return
        if handle.num_buffered >= self.settings.token_buffer_max:
            self.metrics.stream_overflow.inc()
            self._fail_client(handle, "stream_overflow", f"token buffer of {self.settings.token_buffer_max} chunks is full")
            return
        if handle.next_index == 0:
            handle.first_token_ns = time.time_ns()
            self.metrics.ttft.observe((handle.first_token_ns - handle.arrival_ns) / 1e9)
            self.records.note(handle.request_id, handle.first_token_ns, "first_token", worker_id=chunk.worker_id)
        handle.next_index += len(chunk.token_ids)
        handle.num_buffered += 1
        handle.queue.put_nowait(chunk)
        if chunk.finish_reason is not None:
            handle.done = True
            self.handles.pop(handle.request_id, None)
            if handle.grace_task is not None:
                handle.grace_task.cancel()
            handle.queue.put_nowait(Terminal("finished", finish_reason=chunk.finish_reason))

    def _fail_client(self, handle: RequestHandle, code: str, message: str) -> None:
        """The client's stream is broken: tell the client now, stop the work on the worker."""
        self._finish_router(handle, "failed", code, message)
        for worker in {handle.prefill_worker_id, handle.decode_worker_id}:
            cmd = m.CancelRequest(request_id=handle.request_id, worker_id=worker, reason=f"{code}: {message}")
            asyncio.get_running_loop().create_task(
                self.nc.publish(cancel_subject(worker), m.encode(self.envelopes.wrap(cmd, time.time_ns())))
            )

    async def _events_loop(self) -> None:
        while self.running:
            try:
                msgs = await self.events_sub.fetch(batch=256, timeout=1.0)
            except asyncio.TimeoutError:
                continue
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # bus outage: wait it out, retry
                self.metrics.consumer_errors.labels("events").inc()
                log.warning("events fetch failed: %s", exc)
                await asyncio.sleep(0.5)
                continue
            # Fold the whole fetched batch, then release its ledger fields in ONE script call,
            # then ack: one Redis round trip per fetch, not per event (under load, per-event
            # round trips left the router seconds behind its workers). If Redis is away the
            # in-memory mirror has applied the events anyway; the Redis ledger is rebuilt
            # from it when Redis answers again (_resync_ledger).
            handled = []
            for msg in msgs:
                try:
                    await self._on_worker_event_msg(msg)
                    handled.append(msg)
                except asyncio.CancelledError:
                    raise
                except Exception:  # one bad event must not stop the loop; it is redelivered
                    self.metrics.consumer_errors.labels("events").inc()
                    log.exception("handling event on %s failed", msg.subject)
            fields, self.release_buffer = self.release_buffer, []
            if fields:
                try:
                    n = await self.ledger.release(fields)
                    self.metrics.ledger_releases.labels("events").inc(n)
                except Exception as exc:  # Redis away: the mirror has applied them; resync later
                    self._ledger_failed("release", exc)
            for msg in handled:
                try:
                    await msg.ack()
                except Exception as exc:  # redelivered later; handling is idempotent
                    log.warning("ack failed: %s", exc)

    async def _on_worker_event_msg(self, msg) -> None:
        try:
            env = m.decode(msg.data)
        except m.DecodeError as exc:
            await self._undecodable("events", msg, exc)
            return
        ev = env.payload
        if isinstance(ev, m.WorkerRegistered):
            self.scheduler.on_worker_event(ev, min(env.time_ns, time.time_ns()))
        elif isinstance(ev, m.BatchStarted):
            self.scheduler.on_batch_started(ev.worker_id, ev.batch_id, min(env.time_ns, time.time_ns()))
            for rid in ev.request_ids:
                self.records.note(rid, time.time_ns(), "batch_started", batch_id=ev.batch_id, worker_id=ev.worker_id)
        elif isinstance(ev, m.PrefillCompleted):
            batch = self.scheduler.on_prefill_completed(ev.worker_id, ev.batch_id, ev.measured_ms, ev.num_cached_tokens)
            if batch is not None:
                error_pct = abs(batch.predicted_ms - ev.measured_ms) / max(ev.measured_ms, 1e-6) * 100
                self.metrics.predictor_error_pct.observe(error_pct)
            self.metrics.prompt_tokens.inc(ev.num_prompt_tokens)
            self.metrics.cached_tokens.inc(ev.num_cached_tokens)
            for rid in ev.request_ids:
                self.records.note(rid, time.time_ns(), "prefill_completed", batch_id=ev.batch_id,
                                  measured_ms=ev.measured_ms, predicted_batch_ms=round(batch.predicted_ms, 3) if batch else None)
            self.release_buffer.append(prefill_field(ev.batch_id))
            self.wakeup.set()  # a backpressured batcher may dispatch now
        elif isinstance(ev, (m.RequestFinished, m.RequestFailed, m.RequestCancelled, m.RequestTimedOut)):
            await self._on_worker_terminal(ev)

    async def _on_worker_terminal(self, ev) -> None:
        request_id = ev.request_id
        live_handle = self.handles.get(request_id)
        if live_handle is not None and ev.worker_id not in (live_handle.prefill_worker_id, live_handle.decode_worker_id):
            # From a worker the request was taken from (declared dead, re-routed): its
            # reservations now belong to the new assignment; count it, apply nothing.
            self.metrics.duplicate_terminal.inc()
            log.warning("ignoring %s of %s from %s (re-routed away)", type(ev).__name__, request_id, ev.worker_id)
            return
        self.release_buffer.extend(self._fields_to_release(request_id))
        if isinstance(ev, m.RequestFinished):
            self.num_finished[ev.worker_id] = self.num_finished.get(ev.worker_id, 0) + 1
        self.records.note(request_id, time.time_ns(), type(ev).__struct_config__.tag, worker_id=ev.worker_id,
                          **({"code": ev.code} if isinstance(ev, m.RequestFailed) else {}))
        ours = self.scheduler.on_terminal(request_id)
        if not ours and request_id not in self.handles:
            return  # another router's request, or one we forgot across a restart
        self.metrics.inflight.set(len(self.scheduler.inflight))
        outcome = {m.RequestFinished: "finished", m.RequestFailed: "failed", m.RequestCancelled: "cancelled", m.RequestTimedOut: "timed_out"}[type(ev)]
        code = getattr(ev, "code", None) or ("timed_out" if outcome == "timed_out" else ("cancelled" if outcome == "cancelled" else ""))
        self.metrics.requests.labels(outcome, code).inc()
        handle = self.handles.get(request_id)
        if handle is None or handle.done:
            return
        if isinstance(ev, m.RequestFinished):
            if handle.remote:  # forwarded by a standby: it relays the tokens, we only account
                self._finish_router(handle, "finished", None, "")
            elif handle.next_index < ev.num_output_tokens:
                # Tokens travel on core NATS and may still be in flight: give them a grace period.
                handle.grace_task = asyncio.get_running_loop().create_task(self._grace(handle, ev.num_output_tokens))
            return
        message = getattr(ev, "message", "") or getattr(ev, "reason", "")
        if isinstance(ev, m.RequestTimedOut):
            message = f"past its deadline ({ev.phase}) on worker {ev.worker_id}"
        self._finish_router(handle, outcome, code or outcome, message)

    async def _grace(self, handle: RequestHandle, expected: int) -> None:
        await asyncio.sleep(self.settings.finish_grace_ms / 1000)
        if not handle.done:
            self._finish_router(
                handle, "failed", "worker_failed",
                f"worker finished with {expected} tokens but only {handle.next_index} reached the router",
            )

    # ------------------------------------------------------------------ liveness and recovery
    async def _liveness_loop(self) -> None:
        interval = self.settings.liveness_sync_ms / 1000
        while self.running:
            await asyncio.sleep(interval)
            if self.nc is None or not self.nc.is_connected:
                continue  # we cannot hear anyone: no worker missed anything
            if self.liveness_grace_cycles > 0:
                self.liveness_grace_cycles -= 1
                continue
            try:
                result = self.scheduler.sync(time.time_ns())
                if not self.is_leader:  # a standby keeps its view; recovery is the leader's
                    await self._refresh_drain_flags()
                    continue
                for worker_id in result.dead:
                    await self._recover_dead_worker(worker_id, "dead")
                for worker_id in result.expired:
                    await self._recover_dead_worker(worker_id, "expired")
                for item in result.orphans:
                    await self._reroute(item.payload, "its worker died before dispatch")
                await self._refresh_drain_flags()
                await self._report_drained()
                await self._check_ledger_store()
                await self._announce_epoch()
            except asyncio.CancelledError:
                raise
            except Exception:  # a failed cycle must not stop liveness; the next one retries
                self.metrics.consumer_errors.labels("liveness").inc()
                log.exception("liveness cycle failed")

    async def _recover_dead_worker(self, worker_id: str, verdict: str) -> None:
        """A worker died: purge its queued commands, re-route what it had not started, fail
        (retryable) what it had, so no admitted request waits for a dead worker."""
        purged = 0
        try:
            info = await self.js.stream_info(DISPATCH_STREAM.name, subjects_filter=dispatch_subject(worker_id))
            purged = (info.state.subjects or {}).get(dispatch_subject(worker_id), 0)
            await self.js.purge_stream(DISPATCH_STREAM.name, subject=dispatch_subject(worker_id))
        except Exception as exc:  # it may come back and run them: it is fenced by batch dedupe + token fencing
            log.error("could not purge dispatch commands of dead worker %s: %s", worker_id, exc)
        started: set[str] = set()
        not_started: list[str] = []
        inflight = self.scheduler.ledger.workers.get(worker_id)
        for batch_id, batch in list(inflight.batches.items()) if inflight else []:
            if batch.started_ns is None:
                self.scheduler.forget_batch(worker_id, batch_id)
                not_started.extend(batch.request_ids)
            else:
                started.update(batch.request_ids)
        rerouted = failed = 0
        for rid in not_started:
            handle = self.handles.get(rid)
            if handle is not None and not handle.done:
                await self._withdraw(rid, {worker_id}, f"worker declared {verdict}")  # in case it is a zombie
                await self._release_request(rid)
                rerouted += await self._reroute(handle, f"worker {worker_id} {verdict} before starting its batch")
        for rid, handle in list(self.handles.items()):
            if handle.done or rid in not_started:
                continue
            # Started there (prefill running), or decoding there. A request whose prefill
            # finished there and was handed to a live decode worker is unaffected.
            if handle.decode_worker_id == worker_id or rid in started:
                failed += 1
                await self._withdraw(rid, {handle.prefill_worker_id, handle.decode_worker_id}, f"worker declared {verdict}")
                await self._fail_from_router(handle, "worker_failed", f"worker {worker_id} {verdict} while running it")
        self.records_liveness(worker_id, verdict)
        await self._emit(m.WorkerLivenessChanged(
            worker_id=worker_id, router_id=self.router_id, liveness=verdict,
            num_missed_syncs=self.settings.dead_after_missed_syncs, num_rerouted=rerouted, num_failed=failed,
            num_purged_commands=purged,
        ))
        log.warning("worker %s %s: re-routed %d, failed %d, purged %d commands", worker_id, verdict, rerouted, failed, purged)

    def records_liveness(self, worker_id: str, verdict: str) -> None:
        now = time.time_ns()
        for rid, handle in self.handles.items():
            if worker_id in (handle.prefill_worker_id, handle.decode_worker_id):
                self.records.note(rid, now, f"worker_{verdict}", worker_id=worker_id)

    def _fields_to_release(self, request_id: str) -> list[str]:
        """The request's ledger fields: its KV reservation, and its batch's prefill entry once
        every member of that batch has ended."""
        fields = [kv_field(request_id)]
        batch_id = self.request_batch.pop(request_id, None)
        if batch_id is not None:
            pending = self.batch_pending.get(batch_id)
            if pending is not None:
                pending.discard(request_id)
                if not pending:
                    del self.batch_pending[batch_id]
                    fields.append(prefill_field(batch_id))
        return fields

    async def _withdraw(self, request_id: str, worker_ids: set[str], reason: str) -> None:
        """Tell workers to drop a request the router has ended (best effort, core NATS)."""
        now = time.time_ns()
        for worker_id in worker_ids:
            if not worker_id:
                continue
            cmd = m.CancelRequest(request_id=request_id, worker_id=worker_id, reason=reason, withdraw=True)
            try:
                await self.nc.publish(cancel_subject(worker_id), m.encode(self.envelopes.wrap(cmd, now)))
            except Exception as exc:  # the bus is away: the worker's own deadline still bounds it
                log.warning("could not withdraw %s from %s: %s", request_id, worker_id, exc)

    async def _release_request(self, request_id: str) -> None:
        fields = self._fields_to_release(request_id)
        try:
            await self.ledger.release(fields)
        except Exception as exc:  # Redis away: the TTL sweep evicts them
            log.error("ledger release of %s failed: %s", request_id, exc)

    async def _reroute(self, handle: RequestHandle | None, why: str) -> int:
        """Re-admit a request whose worker died (once); else fail it retryable. 1 if re-routed."""
        if handle is None or handle.done:
            return 0
        rid = handle.request_id
        self.scheduler.on_terminal(rid)
        old = (handle.prefill_worker_id, handle.decode_worker_id)
        if handle.num_reroutes < MAX_REROUTES and handle.admit is not None:
            handle.num_reroutes += 1
            decision = self.scheduler.admit(handle.admit, time.time_ns())
            if isinstance(decision, Admitted):
                handle.prefill_worker_id = decision.request.prefill_worker_id
                handle.decode_worker_id = decision.request.decode_worker_id
                handle.batch_id = ""
                for d in decision.decisions:
                    await self._emit(decision_event(rid, self.router_id, d))
                self.records.note(rid, time.time_ns(), "rerouted", reason=why, from_workers=list(old),
                                  prefill_worker_id=handle.prefill_worker_id, decode_worker_id=handle.decode_worker_id)
                self.metrics.reroutes.inc()
                self.wakeup.set()
                return 1
            why = f"{why}; re-route rejected: {decision.code}: {decision.message}"
        await self._fail_from_router(handle, "worker_failed", why, already_forgotten=True)
        return 0

    async def _fail_from_router(self, handle: RequestHandle, code: str, message: str, already_forgotten: bool = False) -> None:
        rid = handle.request_id
        if not already_forgotten:
            self.scheduler.on_terminal(rid)
        await self._release_request(rid)
        self.metrics.requests.labels("failed", code).inc()
        self.records.note(rid, time.time_ns(), "failed_by_router", code=code, message=message)
        self._finish_router(handle, "failed", code, message)
        await self._emit(m.RequestFailed(request_id=rid, worker_id=self.router_id, code=code, message=message,
                                         retryable=error_code(code).retryable))
        self.metrics.inflight.set(len(self.scheduler.inflight))

    # ------------------------------------------------------------------ ledger TTL sweep
    async def _sweep_loop(self) -> None:
        """Evict ledger entries nobody confirmed within `ledger_ttl_s` (a lost terminal event,
        a router that died mid-dispatch): an event and a metric each; a failing sweep is
        logged and retried next time, it never stops the loop."""
        while self.running:
            await asyncio.sleep(self.settings.ledger_sweep_s)
            try:
                while True:
                    evicted = await self.ledger.evict_expired(time.time_ns() // 1_000_000)
                    for worker_id, fld in evicted:
                        self.metrics.ledger_evictions.inc()
                        await self._emit(m.LedgerEntryEvicted(worker_id=worker_id, router_id=self.router_id, field=fld,
                                                              ttl_s=float(self.settings.ledger_ttl_s)))
                    if len(evicted) < 1000:
                        break
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis away: the next sweep retries
                self.metrics.consumer_errors.labels("ledger_sweep").inc()
                log.warning("ledger TTL sweep failed: %s", exc)

    async def _announce_epoch(self) -> None:
        """Tell every worker we schedule for our epoch (each cycle: new workers learn it too)."""
        now = time.time_ns()
        for w in self.scheduler.view.live():
            cmd = m.FenceEpoch(worker_id=w.worker_id, router_id=self.router_id, epoch=self.epoch)
            await self.nc.publish(epoch_subject(w.worker_id), m.encode(self.envelopes.wrap(cmd, now)))

    # ------------------------------------------------------------------ Redis outages
    def _ledger_failed(self, op: str, exc: Exception) -> None:
        self.metrics.consumer_errors.labels("ledger").inc()
        if not self.ledger_dirty:
            log.error("ledger %s failed (%s); scheduling from memory until Redis answers", op, exc)
        self.ledger_dirty = True

    async def _check_ledger_store(self) -> None:
        """Detect a Redis restart (its run id changes: these servers keep nothing on disk) or
        the end of an outage, and rebuild the Redis ledger from the in-memory mirror."""
        try:
            run_id = (await self.redis.info("server")).get("run_id")
        except Exception as exc:  # still away
            self._ledger_failed("probe", exc)
            return
        if self.redis_run_id is not None and run_id != self.redis_run_id:
            log.warning("redis restarted (run id changed): rebuilding the ledger")
            self.ledger_dirty = True
        self.redis_run_id = run_id
        if self.ledger_dirty:
            await self._resync_ledger()

    async def _resync_ledger(self) -> None:
        now_ms = time.time_ns() // 1_000_000
        entries: list[LedgerEntry] = []
        for worker_id, w in self.scheduler.ledger.workers.items():
            for b in w.batches.values():
                entries.append(LedgerEntry(worker_id, prefill_field(b.batch_id), {
                    "kind": "prefill", "batch_id": b.batch_id, "request_ids": b.request_ids,
                    "num_prompt_tokens": sum(n for n, _ in b.members), "created_ms": b.dispatched_ns // 1_000_000,
                    "resynced": True,
                }))
            for r in w.reservations.values():
                entries.append(LedgerEntry(worker_id, kv_field(r.request_id), {
                    "kind": "decode", "request_id": r.request_id, "hard_kv_tokens": r.hard_kv_tokens,
                    "expected_kv_tokens": r.expected_kv_tokens, "created_ms": r.created_ns // 1_000_000, "resynced": True,
                }))
        try:
            await self.ledger.clear()
            if entries:
                await self.ledger.reserve(entries, now_ms)
        except Exception as exc:
            self._ledger_failed("resync", exc)
            return
        self.ledger_dirty = False
        self.metrics.ledger_resyncs.inc()
        log.info("ledger rebuilt in redis from memory: %d entries", len(entries))

    # ------------------------------------------------------------------ operator actions
    def _drain_key(self, worker_id: str) -> str:
        return f"flexlb:{self.settings.cluster}:drain:{worker_id}"

    async def _refresh_drain_flags(self) -> None:
        """Drain flags live in Redis, so every router replica (and a restarted one) honours them."""
        prefix = f"flexlb:{self.settings.cluster}:drain:"
        try:
            flags = {k.decode()[len(prefix):] if isinstance(k, bytes) else k[len(prefix):]
                     async for k in self.redis.scan_iter(match=prefix + "*", count=500)}
        except Exception as exc:  # Redis away: keep the flags we have
            log.warning("could not read drain flags: %s", exc)
            return
        self.scheduler.set_drain_flags(flags)
        self.reported_drained &= flags

    async def _report_drained(self) -> None:
        for worker_id in sorted(self.scheduler.view.drain_flags - self.reported_drained):
            if worker_id in self.scheduler.view.workers and self.scheduler.holds_work(worker_id) == 0:
                self.reported_drained.add(worker_id)
                await self._emit(m.WorkerDrainChanged(worker_id=worker_id, router_id=self.router_id, action="drained"))
                log.info("worker %s drained", worker_id)

    def worker_state(self, worker_id: str) -> str:
        w = self.scheduler.view.workers.get(worker_id)
        if w is None:
            return "unknown"
        if w.draining:
            return "drained" if worker_id in self.reported_drained else "draining"
        return w.state if w.liveness in ("ready", "suspect") else w.liveness

    async def drain(self, worker_id: str, by: str) -> dict[str, Any]:
        await self.redis.set(self._drain_key(worker_id), by or "admin")
        await self._refresh_drain_flags()
        await self._emit(m.WorkerDrainChanged(worker_id=worker_id, router_id=self.router_id, action="drain", by=by))
        await self._report_drained()
        return {"worker_id": worker_id, "state": self.worker_state(worker_id)}

    async def undrain(self, worker_id: str, by: str) -> dict[str, Any]:
        await self.redis.delete(self._drain_key(worker_id))
        await self._refresh_drain_flags()
        await self._emit(m.WorkerDrainChanged(worker_id=worker_id, router_id=self.router_id, action="undrain", by=by))
        self.wakeup.set()
        return {"worker_id": worker_id, "state": self.worker_state(worker_id)}

    async def remove(self, worker_id: str, force: bool, by: str) -> tuple[bool, dict[str, Any]]:
        """Forget a worker. Refused while it holds work, unless forced: then its requests are
        re-routed (not started) or failed retryable (started), as for a dead worker."""
        if worker_id not in self.scheduler.view.workers:
            return False, {"code": "not_found", "message": f"no worker {worker_id}"}
        held = self.scheduler.holds_work(worker_id)
        if held and not force:
            return False, {"code": "conflict", "message": f"worker {worker_id} holds {held} requests; drain it first or force"}
        moved = 0
        self.scheduler.mark_dead(worker_id)  # re-routes must go elsewhere
        if held:
            await self._recover_dead_worker(worker_id, "removed")
            moved = held
        for item in self.scheduler.remove_worker(worker_id):
            moved += 1
            await self._reroute(item.payload, f"worker {worker_id} removed by an operator")
        await self.redis.delete(self._drain_key(worker_id))
        await self._refresh_drain_flags()
        await self._emit(m.WorkerDrainChanged(worker_id=worker_id, router_id=self.router_id, action="removed", by=by,
                                              num_requests_moved=moved))
        return True, {"worker_id": worker_id, "removed": True, "num_requests_moved": moved}

    # ------------------------------------------------------------------ admin views
    def workers_view(self) -> list[dict[str, Any]]:
        now = time.time_ns()
        out = []
        for w in sorted(self.scheduler.view.workers.values(), key=lambda w: w.worker_id):
            live = w.is_live(now, self.scheduler.timeout_ns)
            out.append({
                "id": w.worker_id, "role": w.role,
                "live": live, "liveness": w.liveness, "num_missed_syncs": w.num_missed_syncs,
                "draining": w.draining, "state": self.worker_state(w.worker_id), "reported_state": w.state,
                "num_dispatched": self.num_dispatched.get(w.worker_id, 0),
                "num_finished": self.num_finished.get(w.worker_id, 0),
                "num_held": self.scheduler.holds_work(w.worker_id), "pid": w.pid, "host": w.host, "engine": w.engine, "boot_id": w.boot_id,
                "last_heartbeat_ns": w.last_heartbeat_ns,
                "last_heartbeat_age_ms": round((now - w.last_heartbeat_ns) / 1e6, 1),
                "num_kv_blocks": w.num_kv_blocks, "num_free_kv_blocks": w.num_free_kv_blocks,
                "num_running_requests": w.num_running_requests, "num_queued_batches": w.num_queued_batches,
                "num_queued_at_router": len(self.scheduler.batchers[w.worker_id]) if w.worker_id in self.scheduler.batchers else 0,
                "num_restarts": w.num_restarts,
            })
        return out


def error_for(code: str, message: str) -> tuple[int, bytes]:
    import msgspec

    return error_code(code).http_status, msgspec.json.encode(ErrorBody.of(code, message))
