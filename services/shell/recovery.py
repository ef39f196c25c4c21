"""Recovery: what happens to requests when a worker dies, is removed, or fails them.

Owns: a dead worker's recovery (its queued commands purged,
its not-started batches re-routed once, its started requests failed retryable), re-routes,
retries (a request a worker failed before any of its tokens reached the client is routed
again, excluding the workers that failed it, up to `retry_limit` times: `retry`), reporting
the circuit breakers' transitions (events, metrics, log), router-side failures, and
withdrawing a request from workers. Calls: the core, the bus, upkeep. Called by: liveness,
fold, dispatch, admin.

A retry keeps the request's TTFT deadline (its target less the time already spent) and is
admitted best effort: never refused for its SLO, since its client is already waiting. Codes
retried (`RETRY_CODES`): the server's failures and refusals (upstream_error, upstream_refused,
worker_failed, dispatch_failed, not_ready, internal); never what the client caused, a
deadline, or a cancel. Never once a token was relayed: then the tokens the client has would
be generated twice.

Migration (`migrate`): a request whose worker dies, is removed, or fails it after some of its
tokens reached the client goes on elsewhere as a continuation: its prompt plus the token ids
already relayed, the rest of its max_tokens, from that output index (schemas ForEngine
output_offset, so the engine draws the same tokens a greedy or seeded request would have). It
is admitted like any request (the cost-based policy sees which worker holds its prompt's
prefix; a disaggregated pool prefills it again, then decodes), best effort, excluding the
worker it left, at most `migration_limit` times (past it: migration_limit_exceeded). The
client's stream goes on on the same connection: the new worker's tokens start at the index the
client is at. Only when every token sent came with its id (an engine server that streams text
only: it fails as before, and /admin/workers shows `token_ids` false in its signals). A
request that had sent nothing yet is retried instead (`retry`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING

import msgspec

from schemas import messages as m
from schemas.errors import error_code
from schemas.subjects import DISPATCH_STREAM, cancel_subject, dispatch_subject
from schemas.tokens import block_hashes
from services.core.scheduler import Admitted
from services.shell.handle import RequestHandle
from services.shell.state import RouterState, decision_event

if TYPE_CHECKING:
    from services.shell.upkeep import Upkeep

log = logging.getLogger("flexlb.router")

MAX_REROUTES = 1  # a request whose worker died is re-routed at most this many times
RETRY_CODES = frozenset({"upstream_error", "upstream_refused", "worker_failed", "dispatch_failed", "not_ready", "internal"})
MAX_REASON_CHARS = 200  # a breaker transition's reason, as logged and in its event


class Recovery:
    def __init__(self, state: RouterState, upkeep: "Upkeep") -> None:
        self.s = state
        self.upkeep = upkeep

    async def recover_dead_worker(self, worker_id: str, verdict: str) -> None:
        """A worker died: purge its queued commands, re-route what it had not started, and
        migrate (or retry, before its first token) what it had started, failing retryable only
        what cannot go on, so no admitted request waits for a dead worker."""
        purged = 0
        try:
            info = await self.s.js.stream_info(DISPATCH_STREAM.name, subjects_filter=dispatch_subject(worker_id))
            purged = (info.state.subjects or {}).get(dispatch_subject(worker_id), 0)
            await self.s.js.purge_stream(DISPATCH_STREAM.name, subject=dispatch_subject(worker_id))
        except Exception as exc:  # it may come back and run them: it is fenced by batch dedupe + token fencing
            log.error("could not purge dispatch commands of dead worker %s: %s", worker_id, exc)
        started: set[str] = set()
        not_started: list[tuple[str, str]] = []  # (request id, its batch here)
        inflight = self.s.scheduler.ledger.workers.get(worker_id)
        for batch_id, batch in list(inflight.batches.items()) if inflight else []:
            if batch.started_ns is None:
                self.s.scheduler.forget_batch(worker_id, batch_id)
                not_started.extend((rid, batch_id) for rid in batch.request_ids)
            else:
                started.update(batch.request_ids)
        rerouted = failed = moved = 0
        for rid, batch_id in not_started:
            handle = self.s.handles.get(rid)
            if handle is not None and not handle.done:
                # In case it is a zombie. Of this batch only: the re-route may pick it again.
                await self.withdraw(rid, {worker_id}, f"worker declared {verdict}", batch_id)
                await self.upkeep.release_request(rid)
                rerouted += await self.reroute(handle, f"worker {worker_id} {verdict} before starting its batch")
        for rid, handle in list(self.s.handles.items()):
            if handle.done or rid in not_started:
                continue
            # Started there (prefill running), or decoding there. A request whose prefill
            # finished there and was handed to a live decode worker is unaffected.
            if handle.decode_worker_id == worker_id or rid in started:
                why = f"worker {worker_id} {verdict} while running it"
                await self.withdraw(rid, {handle.prefill_worker_id, handle.decode_worker_id}, f"worker declared {verdict}",
                                    handle.batch_id)
                if await self.go_on(handle, worker_id, "worker_failed", why):
                    moved += 1
                    continue
                failed += 1
                await self.fail_from_router(handle, *self.failure(handle, "worker_failed", why))
        self.records_liveness(worker_id, verdict)
        await self.s.emit(m.WorkerLivenessChanged(
            worker_id=worker_id, router_id=self.s.router_id, liveness=verdict,
            num_missed_syncs=self.s.settings.dead_after_missed_syncs, num_rerouted=rerouted, num_failed=failed,
            num_purged_commands=purged, num_migrated=moved,
        ))
        log.warning("worker %s %s: re-routed %d, migrated or retried %d, failed %d, purged %d commands", worker_id, verdict,
                    rerouted, moved, failed, purged)

    def records_liveness(self, worker_id: str, verdict: str) -> None:
        now = time.time_ns()
        for rid, handle in self.s.handles.items():
            if worker_id in (handle.prefill_worker_id, handle.decode_worker_id):
                self.s.records.note(rid, now, f"worker_{verdict}", worker_id=worker_id)

    async def reroute(self, handle: RequestHandle | None, why: str, fail_code: str = "worker_failed",
                      counts: bool = True) -> int:
        """Re-admit a request whose worker died (once); else fail it retryable. 1 if re-routed.
        `counts`: whether this re-admission uses up the request's re-route (a batch that was
        never sent, because our lease lapsed, does not)."""
        if handle is None or handle.done:
            return 0
        rid = handle.request_id
        self.s.scheduler.on_terminal(rid)
        old = (handle.prefill_worker_id, handle.decode_worker_id)
        if (handle.num_reroutes < MAX_REROUTES or not counts) and handle.admit is not None:
            decision = self.s.scheduler.admit(handle.admit, time.time_ns())
            if isinstance(decision, Admitted):
                handle.rerouted(decision.request.prefill_worker_id, decision.request.decode_worker_id, counts)
                for d in decision.decisions:
                    await self.s.emit(decision_event(rid, self.s.router_id, d))
                self.s.records.note(rid, time.time_ns(), "rerouted", reason=why, from_workers=list(old),
                                  prefill_worker_id=handle.prefill_worker_id, decode_worker_id=handle.decode_worker_id)
                self.s.metrics.reroutes.inc()
                self.s.wakeup.set()
                return 1
            why = f"{why}; re-route rejected: {decision.code}: {decision.message}"
        await self.fail_from_router(handle, fail_code, why, already_forgotten=True)
        return 0

    async def retry(self, handle: RequestHandle | None, worker_id: str, code: str, message: str) -> bool:
        """A worker failed the request before any of its tokens reached the client: route it
        again excluding the workers that failed it (module docstring). True if re-admitted;
        False: the caller fails it as reported (no retry left, or none possible)."""
        s = self.s
        if (handle is None or handle.done or handle.remote or handle.admit is None or handle.next_index > 0
                or code not in RETRY_CODES or handle.num_retries >= s.settings.retry_limit):
            return False
        now = time.time_ns()
        spent_ms = (now - handle.arrival_ns) / 1e6
        if spent_ms >= handle.timeout_s * 1000:
            return False
        rid = handle.request_id
        excluded = tuple(sorted({*handle.admit.excluded_workers, worker_id}))
        admit = dataclasses.replace(handle.admit, excluded_workers=excluded, best_effort=True, slo_ttft_ms=(
            max(1.0, handle.slo_ttft_ms - spent_ms) if handle.slo_ttft_ms > 0 else handle.admit.slo_ttft_ms))
        await self.upkeep.release_request(rid)  # (already released by the failure's fold: a no-op then)
        s.scheduler.on_terminal(rid)
        decision = s.scheduler.admit(admit, now)
        if not isinstance(decision, Admitted):
            s.records.note(rid, now, "retry_rejected", code=decision.code, message=decision.message[:MAX_REASON_CHARS])
            return False
        handle.retried(admit, decision.request.prefill_worker_id, decision.request.decode_worker_id)
        for d in decision.decisions:
            await s.emit(decision_event(rid, s.router_id, d))
        s.records.note(rid, now, "retried", code=code, from_worker=worker_id, attempt=handle.num_retries,
                       prefill_worker_id=handle.prefill_worker_id, decode_worker_id=handle.decode_worker_id)
        s.metrics.retries.labels(code).inc()
        await s.emit(m.RequestRetried(request_id=rid, router_id=s.router_id, from_worker_id=worker_id,
                                      to_worker_id=handle.prefill_worker_id, code=code, attempt=handle.num_retries))
        s.wakeup.set()
        return True

    async def go_on(self, handle: RequestHandle, worker_id: str, code: str, why: str) -> bool:
        """A worker it ran on died or failed it: retried if its client has no token yet, else
        migrated. True if it goes on; False: the caller fails it (`failure` says with what)."""
        if handle.next_index == 0:
            return await self.retry(handle, worker_id, code, why)
        return await self.migrate(handle, worker_id, why)

    def failure(self, handle: RequestHandle, code: str, message: str) -> tuple[str, str]:
        """The code and message of a request that could not go on: its migrations used up, or
        the reason it could not migrate, said."""
        if handle.next_index > 0 and handle.num_migrations >= self.s.settings.migration_limit > 0:
            return "migration_limit_exceeded", (f"{message}; migrated {handle.num_migrations} times already "
                                                f"(--migration-limit {self.s.settings.migration_limit})")
        if handle.next_index > 0 and not handle.ids_known and self.s.settings.migration_limit > 0:
            return code, f"{message}; not migrated: its engine server streams text without token ids"
        return code, message

    async def migrate(self, handle: RequestHandle | None, worker_id: str, why: str) -> bool:
        """Its worker died or failed it after `handle.next_index` tokens reached its client: go
        on elsewhere as a continuation (module docstring). True if re-admitted."""
        s = self.s
        if (handle is None or handle.done or handle.remote or handle.admit is None or not handle.ids_known
                or handle.num_migrations >= s.settings.migration_limit):
            return False
        sent = handle.next_index
        left = handle.max_tokens - sent
        if left <= 0 or len(handle.output_ids) != sent:
            return False
        now = time.time_ns()
        rid = handle.request_id
        prompt = [*handle.prompt_token_ids, *handle.output_ids]
        continuation = msgspec.structs.replace(handle.request, prompt_token_ids=prompt, max_tokens=left, output_offset=sent,
                                               prompt_text="")  # (the ids: they hold the output so far)
        admit = dataclasses.replace(
            handle.admit, num_prompt_tokens=len(prompt), max_tokens=left, best_effort=True,
            block_hashes=tuple(block_hashes(prompt, s.scheduler.block_size_tokens())),
            excluded_workers=tuple(sorted({*handle.admit.excluded_workers, worker_id})))
        await self.upkeep.release_request(rid)
        s.scheduler.on_terminal(rid)
        decision = s.scheduler.admit(admit, now)
        if not isinstance(decision, Admitted):
            s.records.note(rid, now, "migration_rejected", code=decision.code, message=decision.message[:MAX_REASON_CHARS])
            return False
        handle.migrated(admit, continuation, decision.request.prefill_worker_id, decision.request.decode_worker_id)
        for d in decision.decisions:
            await s.emit(decision_event(rid, s.router_id, d))
        s.records.note(rid, now, "migrated", reason=why[:MAX_REASON_CHARS], from_worker=worker_id, tokens_carried=sent,
                       attempt=handle.num_migrations, prefill_worker_id=handle.prefill_worker_id,
                       decode_worker_id=handle.decode_worker_id)
        s.metrics.migrations.inc()
        await s.emit(m.RequestMigrated(request_id=rid, router_id=s.router_id, from_worker_id=worker_id,
                                       to_worker_id=handle.decode_worker_id, num_tokens_carried=sent,
                                       reason=why[:MAX_REASON_CHARS], attempt=handle.num_migrations))
        s.wakeup.set()
        return True

    async def report_breakers(self) -> None:
        """The circuit breakers' transitions since the last call: an event, a metric and a log
        line each (the gauge is read at scrape time)."""
        for c in self.s.scheduler.breakers.take_changes():
            reason = c.reason[:MAX_REASON_CHARS]
            self.s.metrics.breaker_transitions.labels(c.to_state).inc()
            (log.warning if c.to_state == "open" else log.info)(
                "worker %s circuit breaker %s -> %s: %s", c.worker_id, c.from_state, c.to_state, reason)
            await self.s.emit(m.WorkerBreakerChanged(worker_id=c.worker_id, router_id=self.s.router_id,
                                                     from_state=c.from_state, to_state=c.to_state, reason=reason,
                                                     open_ms=c.open_ms, num_failures=c.num_failures))

    async def fail_from_router(self, handle: RequestHandle, code: str, message: str, already_forgotten: bool = False) -> None:
        rid = handle.request_id
        if not already_forgotten:
            self.s.scheduler.on_terminal(rid)
        await self.upkeep.release_request(rid)
        self.s.metrics.requests.labels("failed", code).inc()
        self.s.records.note(rid, time.time_ns(), "failed_by_router", code=code, message=message)
        self.s.finish_router(handle, "failed", code, message)
        await self.s.emit(m.RequestFailed(request_id=rid, worker_id=self.s.router_id, code=code, message=message,
                                         retryable=error_code(code).retryable))
        self.s.metrics.inflight.set(len(self.s.scheduler.inflight))

    async def withdraw(self, request_id: str, worker_ids: set[str], reason: str, batch_id: str) -> None:
        """Tell workers to drop the copy of a request that came in `batch_id` (the router has
        ended it, or moved it: a later dispatch of it in another batch still runs). Best
        effort, core NATS."""
        now = time.time_ns()
        for worker_id in worker_ids:
            if not worker_id:
                continue
            cmd = m.CancelRequest(request_id=request_id, worker_id=worker_id, reason=reason, withdraw=True,
                                  batch_id=batch_id)
            try:
                await self.s.nc.publish(cancel_subject(worker_id), m.encode(self.s.envelopes.wrap(cmd, now)))
            except Exception as exc:  # the bus is away: the worker's own deadline still bounds it
                log.warning("could not withdraw %s from %s: %s", request_id, worker_id, exc)

