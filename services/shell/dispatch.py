"""Dispatch: formed batches to workers.

Owns: the batch loop (sleeps until the core's next batch window or a wake-up, ticks the
core), a queued request the batcher gave up on, and one batch's dispatch: Redis ledger
reservation, then the acked JetStream publish with the batch id as Nats-Msg-Id; an
uncertain publish rolls back and fails its requests retryable. Calls: the core, Redis,
the bus, recovery (withdraw), upkeep (ledger failures). Called by: the service.

Lanes. The batch loop never waits on a publish: each formed batch goes to its worker's lane,
one task per worker that sends that worker's batches one at a time, in the order the core
formed them. A publish can take seconds (a NATS cluster electing a stream's new leader after
losing a node refuses every publish until then, and `publish_until_acked` retries for up to
8 s); while one worker's lane waits, the core keeps ticking, so the queues' emergency points
are honoured (a held request leaves as "emergency" and waits in the lane) instead of every
queued request expiring `queue_timeout` at the first tick after the publish returned, and
other workers' batches are not held up behind it. A router that stops fails what is still in
its lanes `not_ready` (retryable), as it does what is still queued.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Awaitable, Callable

from schemas import messages as m
from schemas.acked import publish_until_acked
from schemas.subjects import dispatch_subject, token_batch_subject, token_subject
from services.core.scheduler import FormedBatch, Moved, QueueFailure
from services.shell.handle import RequestHandle
from services.shell.ledger import LedgerEntry, kv_field, prefill_field
from services.shell.state import RouterState, decision_event

if TYPE_CHECKING:
    from services.shell.recovery import Recovery
    from services.shell.upkeep import Upkeep

log = logging.getLogger("flexlb.router")

PAUSED_POLL_S = 0.05
# While requests wait in the fair queue, the batch loop looks this often at least (their
# expiry; room a status report gave): terminal events and reports wake it sooner.
FAIR_POLL_NS = 50_000_000  # a leader whose lease lapsed looks this often whether it may dispatch again
EXPECTED_DECODE_CAP_TOKENS = 1000  # expected KV = prompt + min(max_tokens, 1000), as FlexLB


class Dispatcher:
    def __init__(self, state: RouterState, recovery: "Recovery", upkeep: "Upkeep",
                 release: Callable[[], Awaitable[None]]) -> None:
        self.s = state
        self.recovery = recovery
        self.upkeep = upkeep
        self.release = release  # intake's: admit what the fair queue lets go now
        self.lanes: dict[str, asyncio.Queue[FormedBatch]] = {}  # worker id -> batches formed, not yet sent
        self.lane_tasks: dict[str, asyncio.Task] = {}

    def send(self, batch: FormedBatch) -> None:
        """Hand a formed batch to its worker's lane (module docstring): sent after the batches
        formed for that worker before it, without holding up the batch loop."""
        lane = self.lanes.get(batch.worker_id)
        if lane is None:
            lane = self.lanes[batch.worker_id] = asyncio.Queue()
            self.lane_tasks[batch.worker_id] = asyncio.create_task(self._lane(lane), name=f"dispatch-{batch.worker_id}")
        lane.put_nowait(batch)

    async def _lane(self, lane: "asyncio.Queue[FormedBatch]") -> None:
        while True:
            batch = await lane.get()
            try:
                await self.dispatch(batch)
            except Exception:  # one failed dispatch must not stop the others
                log.exception("dispatch of %s failed", batch.batch_id)

    async def close_lanes(self) -> None:
        """Stopping: cancel the lanes; what they had not begun to send fails not_ready (retryable)."""
        for task in self.lane_tasks.values():
            task.cancel()
        await asyncio.gather(*self.lane_tasks.values(), return_exceptions=True)
        for lane in self.lanes.values():
            while not lane.empty():
                batch = lane.get_nowait()
                for item in batch.items:
                    self.s.finish_router(item.payload, "failed", "not_ready", "router shutting down before sending its batch; retry")

    async def batch_loop(self) -> None:
        while self.s.running:
            due = self.s.scheduler.next_due_ns(time.time_ns())
            if self.s.scheduler.fair.waiting:  # while work waits, its expiry and the engines' room are polled
                poll = time.time_ns() + FAIR_POLL_NS
                due = poll if due is None else min(due, poll)
            self.s.wakeup.clear()
            if due is None:
                await self.s.wakeup.wait()
            else:
                delay_s = (due - time.time_ns()) / 1e9
                if delay_s > 0:
                    try:
                        await asyncio.wait_for(self.s.wakeup.wait(), delay_s)
                    except asyncio.TimeoutError:
                        pass  # the earliest batch window elapsed: poll below
            if self.s.is_leader and not self.s.may_dispatch():
                # Our lease outran its renewal (Redis unreachable): a standby may hold it now.
                # Form no batch; the queue waits for the lease cycle to say whose it is.
                await asyncio.sleep(PAUSED_POLL_S)
                continue
            try:
                await self.release()
            except Exception:  # the queue keeps its work; the next wake-up tries again
                self.s.metrics.consumer_errors.labels("fair_queue").inc()
                log.exception("releasing from the fair queue failed")
            result = self.s.scheduler.tick(time.time_ns())
            while self.s.scheduler.poll_errors:
                self.s.metrics.consumer_errors.labels("batcher").inc()
                log.error("batcher poll failed (queue kept, retried next tick): %s", self.s.scheduler.poll_errors.pop())
            for moved in result.moves:
                await self.moved(moved)
            for failure in result.failures:
                await self.fail_queued(failure)
            for batch in result.batches:
                self.send(batch)

    async def moved(self, mv: Moved) -> None:
        """A request the TPOT hold kept on one worker went to another (core: Scheduler._resolve_held):
        its handle follows (the relay takes its tokens from its decode worker only), and the
        decision is an event and a line of its record, as an admission's are."""
        item = mv.item
        handle: RequestHandle = item.payload
        handle.place(item.prefill_worker_id, item.decode_worker_id)
        self.s.metrics.hold_moves.inc()
        self.s.records.note(item.request_id, time.time_ns(), "moved", from_worker_id=mv.from_worker_id,
                            worker_id=item.prefill_worker_id, reason=mv.decision.pick.reason)
        await self.s.emit(decision_event(item.request_id, self.s.router_id, mv.decision))

    async def fail_queued(self, failure: QueueFailure) -> None:
        """A queued request the batcher gave up on: the router owns its terminal event."""
        item = failure.item
        self.s.metrics.requests.labels("timed_out" if failure.code == "queue_timeout" else "failed", failure.code).inc()
        self.s.records.note(item.request_id, time.time_ns(), "queue_failure", code=failure.code, message=failure.message)
        self.s.finish_router(item.payload, "failed", failure.code, failure.message)
        if failure.code == "queue_timeout":
            await self.s.emit(m.RequestTimedOut(request_id=item.request_id, worker_id=self.s.router_id, phase="queued"))
        else:
            await self.s.emit(m.RequestFailed(request_id=item.request_id, worker_id=self.s.router_id, code=failure.code,
                                             message=failure.message))

    async def dispatch(self, batch: FormedBatch) -> None:
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
            handle.batched(batch.batch_id)
            requests.append(m.BatchRequest(
                **m.engine_part(handle.for_engine), request_id=item.request_id, decode_worker_id=item.decode_worker_id,
                token_subject=handle.token_subject or token_subject(self.s.router_id, item.request_id),
                deadline_ns=handle.arrival_ns + int(handle.timeout_s * 1e9), lora_adapter=item.lora_adapter,
                # Our own clients' tokens may come coalesced (TokensBatch, relay.py); a standby's
                # (token_subject set) one chunk a message, which every router version reads.
                token_batch_subject="" if handle.token_subject else token_batch_subject(self.s.router_id),
            ))
            entries.append(LedgerEntry(item.decode_worker_id, kv_field(item.request_id), {
                "kind": "decode", "request_id": item.request_id, "batch_id": batch.batch_id,
                "hard_kv_tokens": item.num_prompt_tokens,
                "expected_kv_tokens": item.num_prompt_tokens + min(item.max_tokens, EXPECTED_DECODE_CAP_TOKENS),
                "created_ms": now // 1_000_000,
            }))
        self.s.batches.open(batch.batch_id, [i.request_id for i in batch.items])
        cmd = m.DispatchBatch(
            batch_id=batch.batch_id, router_id=self.s.router_id, worker_id=batch.worker_id, epoch=self.s.epoch, requests=requests
        )
        if not self.s.ledger_dirty:  # (known away: the rebuild from the mirror will carry it)
            try:
                await self.s.ledger.reserve(entries, now // 1_000_000)
            except Exception as exc:  # Redis away: the in-memory mirror keeps scheduling; resync later
                self.upkeep.ledger_failed("reserve", exc)
        if not self.s.is_leader:  # we stepped down meanwhile: the new leader has its own queue
            await self.fail_batch(batch, entries, "not_ready", f"router {self.s.router_id} lost the leadership "
                                  "before sending its batch; retry", sent=False)
            return
        if not self.s.may_dispatch():  # the lease lapsed while Redis took the reservation
            await self.requeue_batch(batch, entries)
            return
        try:
            # Until acked, for up to 8 s: on a NATS cluster that lost the stream leader's node
            # every publish is refused until a new leader is elected (seconds), and each of
            # those batches failed dispatch_failed before.
            await publish_until_acked(self.s.js, dispatch_subject(batch.worker_id),
                                      m.encode(self.s.envelopes.wrap(cmd, now)), batch.batch_id)
        except Exception as exc:  # roll back the reservation and fail the batch visibly
            self.s.metrics.dispatch_failures.inc()
            log.error("dispatch of batch %s to %s failed: %s", batch.batch_id, batch.worker_id, exc)
            await self.fail_batch(batch, entries, "dispatch_failed", f"dispatch to {batch.worker_id} failed: {exc}", sent=True)
            return
        for item in batch.items:  # the stream holds it: its client's response may start now (services/api.py)
            item.payload.mark_dispatched()
        dispatch_ms = round((time.time_ns() - now) / 1e6, 3)  # ledger reservation + the publish's ack
        self.s.metrics.batches.labels(batch.reason).inc()
        self.s.metrics.batch_size.observe(len(batch.items))
        self.s.num_dispatched[batch.worker_id] = self.s.num_dispatched.get(batch.worker_id, 0) + len(batch.items)
        for item in batch.items:
            self.s.records.note(item.request_id, now, "batch_dispatched", batch_id=batch.batch_id, worker_id=batch.worker_id,
                              batch_size=len(batch.items), close_reason=batch.reason,
                              predicted_batch_ms=round(batch.predicted_ms, 3), dispatch_ms=dispatch_ms)
        await self.s.emit(m.BatchDispatched(
            batch_id=batch.batch_id, router_id=self.s.router_id, worker_id=batch.worker_id, epoch=self.s.epoch,
            request_ids=[i.request_id for i in batch.items], num_prompt_tokens=batch.num_prompt_tokens, reason=batch.reason,
        ))


    async def requeue_batch(self, batch: FormedBatch, entries: list) -> None:
        """Our lease lapsed between forming the batch and sending it: it never went. Its
        requests go back into our queue (re-admitted: a re-route), where they wait for the
        lease cycle's verdict: dispatched once it is renewed, handed to the new leader if we
        are fenced. (Not counted as a re-route: the batch never reached a worker.)"""
        if not self.s.ledger_dirty:
            try:
                await self.s.ledger.release([e.field for e in entries])
            except Exception as exc:  # Redis away: the rebuild from the mirror leaves them out
                self.upkeep.ledger_failed("release", exc)
        self.s.batches.close(batch.batch_id, [i.request_id for i in batch.items])
        self.s.scheduler.rollback(batch)
        for item in batch.items:
            await self.recovery.reroute(item.payload, "the scheduling lease lapsed before its batch was sent",
                                        fail_code="not_ready", counts=False)

    async def fail_batch(self, batch: FormedBatch, entries: list, code: str, message: str, sent: bool) -> None:
        """A batch that did not go: roll back its reservations and fail its requests (retryable).
        `sent`: the publish was tried, so the command may have been stored without its ack
        reaching us; its requests are withdrawn, and if it does arrive the worker drops them."""
        if sent:
            for item in batch.items:
                await self.recovery.withdraw(item.request_id, {batch.worker_id, item.decode_worker_id}, "dispatch uncertain",
                                             batch.batch_id)
        try:
            await self.s.ledger.release([e.field for e in entries])
        except Exception as rel_exc:  # Redis down too: the TTL sweep evicts them later
            log.error("rollback of batch %s reservations failed: %s", batch.batch_id, rel_exc)
        self.s.batches.close(batch.batch_id, [i.request_id for i in batch.items])
        self.s.scheduler.rollback(batch)
        for item in batch.items:
            self.s.metrics.requests.labels("failed", code).inc()
            self.s.finish_router(item.payload, "failed", code, message)
            await self.s.emit(m.RequestFailed(request_id=item.request_id, worker_id=self.s.router_id, code=code,
                                             message=message, retryable=True))
