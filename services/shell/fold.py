"""Fold: bus events into the core.

Owns: worker status (live subscription, and at start the last report per worker from the
status stream), KV events (and snapshot requests when the index needs a resync), and the
worker lifecycle events (a durable pull consumer: fetched in batches, folded, their ledger
fields released in one Redis call per fetch, then acked), including calibration's
settlements of requests whose terminal event was lost. Calls: the core, the bus, relay
(a finished stream's grace), recovery, upkeep. Called by: the service (subscriptions).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from schemas import messages as m
from schemas.subjects import ALL_STATUS, STATUS_STREAM, kv_snapshot_request_subject
from services.core.admission import DEFAULT_TENANT
from services.shell.ledger import kv_field, prefill_field
from services.shell.recovery import MAX_REASON_CHARS, RETRY_CODES
from services.shell.state import RouterState

if TYPE_CHECKING:
    from services.shell.recovery import Recovery
    from services.shell.relay import Relay
    from services.shell.upkeep import Upkeep

log = logging.getLogger("flexlb.router")

SNAPSHOT_RETRY_NS = 1_000_000_000  # ask a worker for a KV snapshot at most once a second
# Calibration settled a request its worker no longer reports: its terminal event (or, for our own
# client's, its last token chunk) may only be late, not lost. Status reports come at once; the
# event stream is pulled in fetches and lags them under load, and a standby's request sends its
# tokens to that standby, never here. The client's failure waits this long for either to arrive.
SETTLE_GRACE_S = 2.0


class Fold:
    def __init__(self, state: RouterState, relay: "Relay", recovery: "Recovery", upkeep: "Upkeep") -> None:
        self.s = state
        self.relay = relay
        self.recovery = recovery
        self.upkeep = upkeep
        self.settling: set[asyncio.Task] = set()  # requests calibration settled, failed unless they end meanwhile
        self.release_buffer: list[str] = []  # ledger fields to release after the current event batch
        self.snapshot_requested_ns: dict[str, int] = {}  # worker id -> when we last asked for a KV snapshot

    async def load_last_status(self) -> None:
        try:
            info = await self.s.js.stream_info(STATUS_STREAM.name, subjects_filter=ALL_STATUS)
            subjects = sorted((info.state.subjects or {}).keys())
        except Exception as exc:  # no history: the live subscription fills the view
            log.warning("could not read the status stream: %s", exc)
            return
        for subject in subjects:
            try:
                msg = await self.s.js.get_last_msg(STATUS_STREAM.name, subject)
            except Exception as exc:  # e.g. purged meanwhile
                log.warning("could not read the last status on %s: %s", subject, exc)
                continue
            await self.on_status_msg(msg)

    async def on_status_msg(self, msg) -> None:
        try:
            env = m.decode_as(msg.data, m.WorkerStatusReported, m.WorkerRegistered)
        except m.DecodeError as exc:
            await self.s.undecodable("status", msg, exc)
            return
        now = time.time_ns()
        stale_ns = self.s.settings.dead_after_missed_syncs * self.s.settings.liveness_sync_ms * 1_000_000
        stale = now - env.time_ns > stale_ns
        ev = env.payload
        self.s.note_worker_model(ev.worker_id, ev.model or self.s.settings.model_name, ev.lora_adapters)
        if isinstance(ev, m.WorkerStatusReported) and not stale:
            if ev.state == "draining":
                self.s.seen_draining.add(ev.worker_id)
            elif ev.state == "ready":
                self.s.seen_draining.discard(ev.worker_id)
        if self.s.is_other_pool(ev.model):  # another pool's worker: its leader schedules it
            if isinstance(ev, m.WorkerStatusReported) and not stale:
                self.s.max_worker_epoch = max(self.s.max_worker_epoch, ev.fencing_epoch)
            return
        info = self.s.scheduler.on_worker_event(env.payload, min(env.time_ns, now), stale=stale)
        # The epoch a live worker accepts (a fresh report: not the history read at start, nor a
        # worker long gone) is a floor for our next epoch. Above ours, from a worker we have
        # dispatched to (ours, not another cluster's on the same bus), it means we are fenced.
        if isinstance(env.payload, m.WorkerStatusReported) and not stale:
            epoch = env.payload.fencing_epoch
            self.s.max_worker_epoch = max(self.s.max_worker_epoch, epoch)
            if epoch > self.s.fenced_by_epoch and self.s.num_dispatched.get(env.payload.worker_id, 0) > 0:
                self.s.fenced_by_epoch = epoch
                if self.s.is_leader and epoch > self.s.epoch:
                    self.s.fenced.set()
        for worker_id, rid in self.s.scheduler.take_settled():
            await self.settle(worker_id, rid)
        batcher = self.s.scheduler.batchers.get(info.worker_id)
        if self.s.scheduler.fair.waiting or (batcher is not None and len(batcher)):
            # the engines' room may have changed; so may the load a held queue waits on (its TPOT hold)
            self.s.wakeup.set()
        if self.s.settings.prefix_index == "exact" and info.worker_id not in self.s.scheduler.index.workers():
            await self.request_snapshot(info.worker_id, "no KV state for this worker yet", now)
        if self.s.view_ready_after_ms is None and self.s.scheduler.view.readiness()[0]:
            self.s.view_ready_after_ms = round((now - self.s.started_ns) / 1e6, 1)
            log.info("worker view complete %.1f ms after start", self.s.view_ready_after_ms)

    async def settle(self, worker_id: str, request_id: str) -> None:
        """Calibration settled a request: the worker reported it running, then stopped
        reporting it, and no terminal event came (lost). End it once, release its Redis
        entry, and say so."""
        self.s.metrics.ledger_settlements.inc()
        why = f"worker {worker_id} stopped reporting it and no terminal event arrived"
        handle = self.s.handles.get(request_id)
        if handle is not None and not handle.done:
            task = asyncio.create_task(self.fail_unless_ended(handle, why), name=f"settle-{request_id}")
            self.settling.add(task)
            task.add_done_callback(self.settling.discard)
        else:
            self.s.scheduler.on_terminal(request_id)
            await self.upkeep.release_request(request_id)
        log.warning("settled %s: %s", request_id, why)
        await self.s.emit(m.LedgerEntryEvicted(worker_id=worker_id, router_id=self.s.router_id, field=kv_field(request_id),
                                              ttl_s=0.0, reason="calibration"))

    async def fail_unless_ended(self, handle, why: str) -> None:
        """SETTLE_GRACE_S for its terminal event or last token chunk (why: at the constant), then worker_failed."""
        deadline = time.monotonic() + SETTLE_GRACE_S
        while not handle.done and time.monotonic() < deadline and self.s.running:
            await asyncio.sleep(0.05)
        if handle.done:
            log.info("%s ended within %.1f s of its settlement: its terminal event was late, not lost",
                     handle.request_id, SETTLE_GRACE_S)
            return
        await self.recovery.fail_from_router(handle, "worker_failed", why)

    async def request_snapshot(self, worker_id: str, reason: str, now_ns: int) -> None:
        last = self.snapshot_requested_ns.get(worker_id, 0)
        if now_ns - last < SNAPSHOT_RETRY_NS:
            return
        self.snapshot_requested_ns[worker_id] = now_ns
        cmd = m.RequestKvSnapshot(worker_id=worker_id, requester=self.s.router_id, reason=reason)
        try:
            await self.s.nc.publish(kv_snapshot_request_subject(worker_id), m.encode(self.s.envelopes.wrap(cmd, now_ns)))
        except Exception as exc:  # retried on the next status report after SNAPSHOT_RETRY_NS
            log.warning("could not ask %s for a KV snapshot: %s", worker_id, exc)

    async def on_kv_msg(self, msg) -> None:
        try:
            env = m.decode_as(msg.data, m.KvBlocksStored, m.KvBlocksRemoved, m.KvAllCleared, m.KvSnapshot)
        except m.DecodeError as exc:
            await self.s.undecodable("kv", msg, exc)
            return
        if self.s.pool and self.s.is_other_pool(self.s.worker_models.get(env.payload.worker_id, "?")):
            return  # another pool's worker (or one not heard yet: its snapshot comes when it is)
        update = self.s.scheduler.on_kv_event(env.payload)
        self.s.metrics.kv_events.labels(update.status).inc()
        if update.status == "needs_resync":
            await self.request_snapshot(update.worker_id, update.reason, time.time_ns())

    async def events_loop(self) -> None:
        while self.s.running:
            try:
                msgs = await self.s.events_sub.fetch(batch=256, timeout=1.0)
            except asyncio.TimeoutError:
                continue
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # bus outage: wait it out, retry
                self.s.metrics.consumer_errors.labels("events").inc()
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
                    await self.on_worker_event_msg(msg)
                    handled.append(msg)
                except asyncio.CancelledError:
                    raise
                except Exception:  # one bad event must not stop the loop; it is redelivered
                    self.s.metrics.consumer_errors.labels("events").inc()
                    log.exception("handling event on %s failed", msg.subject)
            if self.s.scheduler.breakers.changes:
                await self.recovery.report_breakers()
            fields, self.release_buffer = self.release_buffer, []
            # Redis known away (a call failed since the last rebuild): do not wait on it here;
            # the mirror has applied them and the leader rebuilds Redis from it when it answers.
            # Waiting (a partition costs a socket timeout per call) held every event behind it,
            # and calibration then settled requests whose terminal event was only late.
            if fields and not self.s.ledger_dirty:
                try:
                    n = await self.s.ledger.release(fields)
                    self.s.metrics.ledger_releases.labels("events").inc(n)
                except Exception as exc:  # Redis away: the mirror has applied them; resync later
                    self.upkeep.ledger_failed("release", exc)
            for msg in handled:
                try:
                    await msg.ack()
                except Exception as exc:  # redelivered later; handling is idempotent
                    log.warning("ack failed: %s", exc)

    async def on_worker_event_msg(self, msg) -> None:
        try:
            env = m.decode(msg.data)
        except m.DecodeError as exc:
            await self.s.undecodable("events", msg, exc)
            return
        ev = env.payload
        if isinstance(ev, m.WorkerRegistered):
            self.s.note_worker_model(ev.worker_id, ev.model or self.s.settings.model_name, ev.lora_adapters)
            if not self.s.is_other_pool(ev.model):
                self.s.scheduler.on_worker_event(ev, min(env.time_ns, time.time_ns()))
        elif isinstance(ev, m.BatchStarted):
            self.s.scheduler.on_batch_started(ev.worker_id, ev.batch_id, min(env.time_ns, time.time_ns()))
            for rid in ev.request_ids:
                self.s.records.note(rid, time.time_ns(), "batch_started", batch_id=ev.batch_id, worker_id=ev.worker_id)
        elif isinstance(ev, m.PrefillCompleted):
            batch = self.s.scheduler.on_prefill_completed(ev.worker_id, ev.batch_id, ev.measured_ms, ev.num_cached_tokens)
            if batch is not None:
                error_pct = abs(batch.predicted_ms - ev.measured_ms) / max(ev.measured_ms, 1e-6) * 100
                self.s.metrics.predictor_error_pct.observe(error_pct)
            self.s.metrics.prompt_tokens.inc(ev.num_prompt_tokens)
            self.s.metrics.cached_tokens.inc(ev.num_cached_tokens)
            for rid in ev.request_ids:
                self.s.records.note(rid, time.time_ns(), "prefill_completed", batch_id=ev.batch_id,
                                  measured_ms=ev.measured_ms, predicted_batch_ms=round(batch.predicted_ms, 3) if batch else None)
            self.release_buffer.append(prefill_field(ev.batch_id))
            self.s.wakeup.set()  # a backpressured batcher may dispatch now
        elif isinstance(ev, (m.RequestFinished, m.RequestFailed, m.RequestCancelled, m.RequestTimedOut)):
            await self.on_worker_terminal(ev, env.time_ns)

    async def on_worker_terminal(self, ev, time_ns: int = 0) -> None:
        """A worker's terminal event; `time_ns`: when the worker published it (its envelope):
        with a finished request's first_token_ns, the TPOT it got (the core's calibration)."""
        request_id = ev.request_id
        live_handle = self.s.handles.get(request_id)
        if (live_handle is not None and live_handle.decode_worker_id
                and ev.worker_id not in (live_handle.prefill_worker_id, live_handle.decode_worker_id)):
            # From a worker the request was taken from (declared dead, re-routed): its
            # reservations now belong to the new assignment; count it, apply nothing.
            self.s.metrics.duplicate_terminal.inc()
            log.warning("ignoring %s of %s from %s (re-routed away)", type(ev).__name__, request_id, ev.worker_id)
            return
        self.release_buffer.extend(self.upkeep.fields_to_release(request_id))
        if isinstance(ev, (m.RequestFinished, m.RequestFailed)) and ev.worker_id in self.s.scheduler.view.workers:
            # (its circuit breaker: breaker.py; the event's time, so a replay re-makes each transition)
            self.s.scheduler.on_outcome(request_id, ev.worker_id, isinstance(ev, m.RequestFinished),
                                        getattr(ev, "code", ""), getattr(ev, "message", "")[:MAX_REASON_CHARS],
                                        min(time_ns, time.time_ns()) if time_ns else time.time_ns())
        if isinstance(ev, m.RequestFinished):
            self.s.num_finished[ev.worker_id] = self.s.num_finished.get(ev.worker_id, 0) + 1
            rec = self.s.records.records.get(request_id)  # (its client may have its answer already: no handle)
            if rec is not None:
                tenant = rec.get("tenant", DEFAULT_TENANT)
                self.s.metrics.tenant_tokens.labels(self.s.metrics.tenant(tenant), "input").inc(ev.num_prompt_tokens)
                self.s.metrics.tenant_tokens.labels(self.s.metrics.tenant(tenant), "output").inc(ev.num_output_tokens)
                model = rec.get("admission", {}).get("model")
                if model is not None:
                    self.s.metrics.model_requests.labels(model, "finished").inc()
        self.s.records.note(request_id, time.time_ns(), type(ev).__struct_config__.tag, worker_id=ev.worker_id,
                          **({"code": ev.code} if isinstance(ev, m.RequestFailed) else {}))
        # What it produced settles its tenant's fair-queue charge (a remote request's tokens
        # went to its standby: unknown unless it finished).
        tpot_ms = None
        if isinstance(ev, m.RequestFinished):
            produced = ev.num_output_tokens
            cont = live_handle.continuation if live_handle is not None else None
            own = produced - (cont.output_offset if cont is not None else 0)  # (a continuation's, on this worker)
            if own > 1 and ev.first_token_ns and time_ns > ev.first_token_ns:  # (both the worker's clock)
                tpot_ms = round((time_ns - ev.first_token_ns) / 1e6 / (own - 1), 3)
        else:
            produced = live_handle.next_index if live_handle is not None and not live_handle.remote else None
        ours = self.s.scheduler.on_terminal(request_id, produced, tpot_ms)
        if self.s.scheduler.fair.waiting or self.s.scheduler.queued:
            self.s.wakeup.set()  # room freed: the batch loop releases from the fair queue, or a held queue may go
        if not ours and request_id not in self.s.handles:
            return  # another router's request, or one we forgot across a restart
        self.s.metrics.inflight.set(len(self.s.scheduler.inflight))
        outcome = {m.RequestFinished: "finished", m.RequestFailed: "failed", m.RequestCancelled: "cancelled",
                   m.RequestTimedOut: "timed_out"}[type(ev)]
        code = getattr(ev, "code", None) or ("timed_out" if outcome == "timed_out" else ("cancelled" if outcome == "cancelled" else ""))
        self.s.metrics.requests.labels(outcome, code).inc()
        handle = self.s.handles.get(request_id)
        if handle is None or handle.done:
            return
        if isinstance(ev, m.RequestFinished):
            if handle.remote:  # forwarded by a standby: it relays the tokens, we only account
                self.s.finish_router(handle, "finished", None, "")
            elif handle.next_index < ev.num_output_tokens:
                # Tokens travel on core NATS and may still be in flight: give them a grace period.
                handle.start_grace(asyncio.get_running_loop().create_task(self.relay.grace(handle, ev.num_output_tokens)))
            return
        message = getattr(ev, "message", "") or getattr(ev, "reason", "")
        if isinstance(ev, m.RequestFailed) and ev.worker_id in (handle.prefill_worker_id, handle.decode_worker_id):
            kv = kv_field(request_id)  # released now, not with the fetch: its retry reserves the same field
            if kv in self.release_buffer:
                self.release_buffer.remove(kv)
                await self.upkeep.release_fields([kv])
            if code in RETRY_CODES and await self.recovery.go_on(handle, ev.worker_id, code, message):
                return
            if code in RETRY_CODES:
                code, message = self.recovery.failure(handle, code, message)
        if isinstance(ev, m.RequestTimedOut):
            message = f"past its deadline ({ev.phase}) on worker {ev.worker_id}"
        self.s.finish_router(handle, outcome, code or outcome, message)

