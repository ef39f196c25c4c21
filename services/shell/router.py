"""The router process: wires the pure core to NATS, Redis and the HTTP API.

Inputs
- `flexlb.evt.status.>` — an ordered JetStream consumer that starts from the last report of
  every worker (DeliverLastPerSubject), so a restarted router rebuilds its worker view from
  one heartbeat interval of history. A report's time is min(producer time, receive time),
  so a dead worker's last report does not look fresh after a restart.
- `flexlb.evt.req.>` — worker lifecycle events, a durable pull consumer named after the
  router id: a restarted router resumes where it stopped and releases ledger entries for
  requests that finished while it was down.
- `flexlb.tok.<router>.*` — token chunks (core NATS), relayed to clients; `flexlb.tok.<router>`
  the same, many requests' in one message (TokensBatch).

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

The parts, one module and one class each, sharing one RouterState (services/shell/state.py,
where OWNERS names the part that writes each of its fields) and the live requests' handles
(services/shell/handle.py):

| part | module | owns |
|---|---|---|
| intake | intake.py | admission, the client handle, cancel, forwarding standby → leader |
| dispatch | dispatch.py | the batch loop; batch → Redis ledger → JetStream |
| fold | fold.py | status, KV and lifecycle events → the core; ledger releases per fetch |
| relay | relay.py | token chunks → clients; broken streams; the finish grace |
| leadership | leadership.py | the Redis lease, the fencing epoch, stepping down |
| liveness | liveness.py | the periodic cycle: dead workers, orphans, drain, ledger probe, epoch; the bus's state |
| recovery | recovery.py | a dead or removed worker's requests: re-route once or fail retryable |
| upkeep | upkeep.py | the Redis ledger kept equal to the core's mirror: release, sweep, resync |
| admin | admin.py | drain / undrain / remove, the workers view |
| journal | journal.py | the core's recorded calls → FLEXLB_JOURNAL, in order |

This module only builds them, starts and stops them, and is the one face the HTTP API
(services/api.py) talks to. Calls go one way: admin → recovery → upkeep; liveness →
recovery, admin, upkeep, leadership; fold → relay, recovery, upkeep; dispatch → recovery,
upkeep; leadership → intake; every part → state and handle. tests/unit/test_layering.py
checks it.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from typing import Any

import msgspec
import redis.asyncio as aioredis
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from schemas import messages as m
from schemas.acked import AckedPublisher
from schemas.subjects import (
    ALL_KV_EVENTS,
    ALL_ROUTER_EVENTS,
    ALL_STATUS,
    ALL_STREAMS,
    ALL_WORKER_EVENTS,
    EVENTS_STREAM,
    JOURNAL_STREAM,
    all_tokens_subject,
    nats_servers,
    pool_token,
    router_events_consumer,
    token_batch_subject,
)
from services.core.breaker import STATE_VALUES
from services.core.journal import Recorder
from services.core.scheduler import Rejected, Scheduler
from services.settings import RouterSettings, sentinel_addresses
from services.shell.admin import Admin
from services.shell.bus import connect, ensure_streams
from services.shell.dispatch import Dispatcher
from services.shell.fold import Fold
from services.shell.handle import RequestHandle, Terminal
from services.shell.intake import Intake
from services.shell.journal import Journal
from services.shell.leadership import Leadership
from services.shell.ledger import Ledger
from services.shell.liveness import Liveness
from services.shell.recovery import Recovery
from services.shell.relay import Relay
from services.shell.state import RouterState
from services.shell.upkeep import Upkeep

__all__ = ["RequestHandle", "RouterService", "Terminal"]

log = logging.getLogger("flexlb.router")
# Stopping while leading: at most this long to give the lease up, see a standby take it and
# hand it what we queued (ROUTER_STOP_S, 4.5 s, bounds the whole stop).
HANDOFF_BUDGET_S = 2.0

# An event fetched by a router that then died is redelivered after this long (to its
# restarted self): short, so the ledger entries it releases do not linger.
EVENTS_ACK_WAIT_S = 5.0


class RouterService:
    """One router process: its state and parts, their start and stop, and the API's face."""

    def __init__(self, settings: RouterSettings) -> None:
        boot_id = secrets.token_hex(4)
        self.journal = Journal(settings.router_id, boot_id)
        core = Scheduler(settings.scheduler_config(), id_prefix=f"{settings.router_id}-{boot_id}")
        scheduler = Recorder(core, self.journal.record) if settings.journal else core
        self.s = s = RouterState(settings, boot_id, scheduler)
        self.journal.attach(s)
        self.intake = Intake(s)
        self.leadership = Leadership(s, self.intake)
        self.upkeep = Upkeep(s)
        self.recovery = Recovery(s, self.upkeep)
        self.admin = Admin(s, self.recovery)
        self.relay = Relay(s)
        self.fold = Fold(s, self.relay, self.recovery, self.upkeep)
        self.dispatcher = Dispatcher(s, self.recovery, self.upkeep, self.intake.release)
        self.liveness = Liveness(s, self.recovery, self.admin, self.upkeep, self.leadership)
        self.tasks: list[asyncio.Task] = []

    # ------------------------------------------------------------------ what the API reads
    settings = property(lambda self: self.s.settings)
    router_id = property(lambda self: self.s.router_id)
    boot_id = property(lambda self: self.s.boot_id)
    epoch = property(lambda self: self.s.epoch)
    is_leader = property(lambda self: self.s.is_leader)
    running = property(lambda self: self.s.running)
    metrics = property(lambda self: self.s.metrics)
    records = property(lambda self: self.s.records)
    ledger = property(lambda self: self.s.ledger)
    view_ready_after_ms = property(lambda self: self.s.view_ready_after_ms)

    @property
    def nats_server(self) -> str | None:
        """The NATS server this router is connected to now (one of a cluster's), or None."""
        nc = self.s.nc
        if nc is None or not nc.is_connected or nc.connected_url is None:
            return None
        return f"nats://{nc.connected_url.hostname}:{nc.connected_url.port}"

    def new_request_id(self) -> str:
        return self.intake.new_request_id()

    async def submit(self, request: m.Request) -> RequestHandle | Rejected:
        return await self.intake.submit(request)

    async def reject(self, request_id: str, code: str, message: str) -> Rejected:
        return await self.intake.reject(request_id, code, message)

    async def cancel(self, handle: RequestHandle, reason: str) -> None:
        await self.intake.cancel(handle, reason)

    async def drain(self, worker_id: str, by: str) -> dict[str, Any]:
        return await self.admin.drain(worker_id, by)

    async def undrain(self, worker_id: str, by: str) -> dict[str, Any]:
        return await self.admin.undrain(worker_id, by)

    async def remove(self, worker_id: str, force: bool, by: str) -> tuple[bool, dict[str, Any]]:
        return await self.admin.remove(worker_id, force, by)

    def workers_view(self) -> list[dict[str, Any]]:
        return self.admin.workers_view()

    def models(self) -> dict[str, list[str]]:
        """Every model the view has (and the default), each with its workers' LoRA adapters."""
        models = self.s.scheduler.view.models()
        if self.s.pool:  # the other pools' models too (their workers stay out of our core)
            for worker_id, model in self.s.worker_models.items():
                models.setdefault(model, [])
            for adapter, parent in self.s.adapter_models.items():
                if adapter not in models.get(parent, []):
                    models[parent] = sorted([*models.get(parent, []), adapter])
        return dict(sorted(models.items()))

    def refresh_gauges(self) -> None:
        """Gauges read from the view at scrape time (a worker gone from the view leaves them)."""
        mx, view = self.s.metrics, self.admin.workers_view()
        for g in (mx.worker_live, mx.worker_kv_used, mx.worker_queued, mx.worker_held, mx.worker_tpot, mx.decode_model_error,
                  mx.worker_breaker, mx.worker_degraded, mx.worker_step_ratio):
            g.clear()
        for w in view:
            mx.worker_live.labels(w["id"]).set(1 if w["live"] else 0)
            used = 1 - w["num_free_kv_blocks"] / w["num_kv_blocks"] if w["num_kv_blocks"] else 0.0
            mx.worker_kv_used.labels(w["id"]).set(round(used, 4))
            mx.worker_queued.labels(w["id"]).set(w["num_queued_at_router"])
            mx.worker_held.labels(w["id"]).set(w["num_held"])
            mx.worker_breaker.labels(w["id"]).set(STATE_VALUES[w["breaker"]["state"]])
            if w["step_ratio"] is not None:
                mx.worker_step_ratio.labels(w["id"]).set(w["step_ratio"])
                mx.worker_degraded.labels(w["id"]).set(1 if w["degraded"] else 0)
            if "decode_model" in w:
                mx.worker_tpot.labels(w["id"]).set(w["predicted_tpot_ms"] or 0.0)
                mx.decode_model_error.labels(w["id"]).set(w["decode_model"]["mean_abs_pct_error"])
        mx.queue_depth.set(sum(w["num_queued_at_router"] for w in view))
        ledger = self.s.scheduler.ledger
        mx.ledger_entries.set(sum(len(w.batches) + len(w.reservations) for w in ledger.workers.values()))
        mx.epoch.set(self.s.epoch)

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        s = self.s
        s.started_ns = time.time_ns()
        s.nc = await connect(nats_servers(s.settings.nats_url), f"flexlb-router-{s.router_id}", self.liveness.on_bus_state)
        self.liveness.note_bus_state("connected")
        s.js = s.nc.jetstream()
        s.acked = AckedPublisher(s.nc, f"router {s.router_id} fact", on_lost=s.acked_lost)
        await ensure_streams(s.js, self._stream_specs(), s.settings.nats_replicas)
        s.redis = redis_client(s.settings)
        # A pool's leader keeps its ledger apart (its rebuild from memory clears only its own).
        namespace = s.settings.cluster + (f":pool:{pool_token(s.pool)}" if s.pool else "")
        s.ledger = Ledger(s.redis, namespace, s.settings.ledger_ttl_s)
        await self.admin.refresh_drain_flags()
        s.running = True
        await self.leadership.lease_cycle()
        await s.nc.subscribe(all_tokens_subject(s.router_id), cb=self.relay.on_token_msg)
        await s.nc.subscribe(token_batch_subject(s.router_id), cb=self.relay.on_token_batch_msg)
        await s.nc.subscribe(ALL_ROUTER_EVENTS, cb=self.intake.on_router_event_msg)
        # Live status and KV events arrive on plain subscriptions, which nats-py re-creates
        # on every reconnect (an ephemeral JetStream consumer did not survive a server
        # restart, and the router then heard no heartbeat ever again). The streams still
        # record them for replay; at start the last report of every worker is read from the
        # status stream, so a restarted router has its view within one round trip.
        if s.settings.prefix_index == "exact":
            await s.nc.subscribe(ALL_KV_EVENTS, cb=self.fold.on_kv_msg)
        await s.nc.subscribe(ALL_STATUS, cb=self.fold.on_status_msg)
        await self.fold.load_last_status()
        s.events_sub = await s.js.pull_subscribe(
            ALL_WORKER_EVENTS,
            durable=router_events_consumer(s.router_id),
            stream=EVENTS_STREAM.name,
            config=ConsumerConfig(deliver_policy=DeliverPolicy.NEW, ack_policy=AckPolicy.EXPLICIT, ack_wait=EVENTS_ACK_WAIT_S, max_ack_pending=20000),
        )
        self.tasks = [
            asyncio.create_task(self.fold.events_loop(), name="events"),
            asyncio.create_task(self.dispatcher.batch_loop(), name="batches"),
            asyncio.create_task(self.liveness.liveness_loop(), name="liveness"),
            asyncio.create_task(self.upkeep.sweep_loop(), name="ledger-sweep"),
            asyncio.create_task(self.leadership.lease_loop(), name="lease"),
            asyncio.create_task(self.leadership.fence_loop(), name="fence"),
            asyncio.create_task(self.journal.loop(), name="journal"),
            asyncio.create_task(s.acked.run(), name="acked"),
        ]
        log.info("router %s (boot %s) started", s.router_id, s.boot_id)

    async def hand_off(self) -> None:
        """Stopping: when leading, give leadership (and what we queued) to a standby now,
        bounded by HANDOFF_BUDGET_S; a no-op otherwise. The process calls it on SIGTERM before
        it drains its open streams (which it relays as a standby would), and stop() again."""
        s = self.s
        if s.is_leader and s.redis is not None and s.nc is not None and s.nc.is_connected:
            try:  # bounded: the process must exit within ROUTER_STOP_S whatever it was doing
                await asyncio.wait_for(self.leadership.hand_off(), HANDOFF_BUDGET_S)
            except asyncio.TimeoutError:
                log.error("router %s: handing leadership over took over %.1f s; stopping anyway", s.router_id,
                          HANDOFF_BUDGET_S)

    async def stop(self) -> None:
        s = self.s
        s.running = False
        s.wakeup.set()
        await self.hand_off()
        for item in s.scheduler.drain_queues():
            s.finish_router(item.payload, "failed", "no_worker", "router shutting down before dispatch")
        for handle in self.intake.take_waiting():
            s.finish_router(handle, "failed", "not_ready", "router shutting down before admitting it; retry")
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.dispatcher.close_lanes()
        if s.nc is not None:
            await self.journal.flush()
            if unacked := await s.acked.drain(2.0):
                log.error("%d journal records / terminal events unacked at stop", unacked)
            if s.events_sub is not None:
                # nats-py never marks a pull subscription's messages done, so a drain that
                # includes it waits out its whole limit: let it go first.
                try:
                    await asyncio.wait_for(s.events_sub.unsubscribe(), 1.0)
                except Exception as exc:  # the bus is gone: the drain below says so too
                    log.warning("unsubscribing the event consumer on stop failed (%s)", exc.__class__.__name__)
            try:
                if not s.nc.is_connected:
                    raise ConnectionError("not connected")
                await asyncio.wait_for(s.nc.drain(), 3.0)
            except Exception as exc:  # bus gone at shutdown: close without draining, say so
                log.warning("nats drain on stop failed (%s); closing", exc.__class__.__name__)
                try:
                    await asyncio.wait_for(s.nc.close(), 1.0)
                except Exception as close_exc:  # nothing left to close cleanly: the process is ending
                    log.warning("nats close on stop failed (%s)", close_exc.__class__.__name__)
        if s.redis is not None:
            await s.redis.aclose()

    # ------------------------------------------------------------------ health
    async def pool_readiness(self, model: str) -> tuple[bool | None, str]:
        """Whether the pool `model` names can serve now (None: no such model)."""
        s = self.s
        view = s.scheduler.view
        pool = view.pool_of(model)
        if pool is None and s.pool:
            other = s.pool_of_model(model)
            if other is not None and other != s.pool:  # led elsewhere: its leader must hold its lease
                if await s.redis.exists(self.leadership.lease_key(other)):
                    return True, f"pool {other!r} has a leader router"
                return False, f"no leader router holds pool {other!r}'s lease (failover in progress?)"
        if pool is None:
            return None, f"model {model!r} is not served here"
        live = view.routable(pool).num_live
        if not live:
            return False, f"no live worker serves model {pool!r}"
        return True, f"{live} live worker(s) serve model {pool!r}"

    async def readiness(self) -> tuple[bool, str]:
        s = self.s
        if s.nc is None or not s.nc.is_connected:
            return False, "nats not connected"
        if s.bus_silent_since_ns:
            return False, f"nats server not answering pings for {(time.time_ns() - s.bus_silent_since_ns) / 1e9:.1f} s"
        try:
            await asyncio.wait_for(s.redis.ping(), 1.0)
            if not s.is_leader and not await s.redis.exists(self.leadership.lease_key()):
                return False, "no leader router holds the scheduling lease (failover in progress)"
        except Exception as exc:  # any failure of the ping is a "not ready" with its reason
            return False, f"redis not answering: {exc.__class__.__name__}: {exc}"
        return s.scheduler.view.readiness()

    def _stream_specs(self) -> tuple:
        st = self.s.settings
        return tuple(
            msgspec.structs.replace(spec, max_age_s=st.events_max_age_s, max_bytes=st.events_max_bytes)
            if spec.name == EVENTS_STREAM.name else
            msgspec.structs.replace(spec, max_age_s=st.journal_max_age_s, max_bytes=st.journal_max_bytes)
            if spec.name == JOURNAL_STREAM.name else spec
            for spec in ALL_STREAMS
        )


def redis_client(settings: RouterSettings):
    """The router's Redis: `redis_url` directly, or the primary Sentinel names for
    `redis_master_name` (each new connection asks the sentinels, so after a failover the
    next call reaches the promoted replica; a call on a demoted primary fails and reconnects)."""
    kwargs = {"socket_timeout": 2, "socket_connect_timeout": 1}
    if not settings.redis_sentinels:
        return aioredis.from_url(settings.redis_url, **kwargs)
    from urllib.parse import urlparse

    from redis.asyncio.sentinel import Sentinel

    url = urlparse(settings.redis_url)
    db = int(url.path.lstrip("/") or 0)
    sentinel = Sentinel(sentinel_addresses(settings.redis_sentinels), sentinel_kwargs={
        "socket_timeout": 1, "socket_connect_timeout": 1,
        **({"password": url.password} if url.password else {})})  # (sentinels of `flexlb up` share the password)
    return sentinel.master_for(settings.redis_master_name, db=db, password=url.password, **kwargs)
