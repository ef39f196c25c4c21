"""Intake: a parsed request in, admitted or rejected out.

Owns: admission (the core's admit, the decision record, route.decided / request.admitted /
request.rejected events), the client handle it returns, a client's cancel, and forwarding:
a standby sends the request to the leader over NATS (SubmitRequest) and follows the
leader's router events for it; the leader admits forwarded requests (on_submit). While no
leader answers (a hand-off or failover) a forward is asked again (ask_leader). A stopping
leader's hand-over (leadership.py) is taken back into the client's own handle (on_submit) or
followed to the new leader (on_router_event_msg).
Calls: the core, the bus. Called by: the HTTP API, leadership (the submit subscription).
"""

from __future__ import annotations

import logging
import os
import time

from schemas import messages as m
from schemas.subjects import cancel_subject, router_events_subject, token_subject
from schemas.tokens import block_hashes
from services.core.admission import DEFAULT_TENANT, priority_class_of
from services.core.fairness import CLASSES, Dispatched, Queued, Refused
from services.core.scheduler import AdmitRequest, Admitted, Rejected
from services.shell.handle import RequestHandle
from services.shell.state import NOT_LEADER_MESSAGE, RouterState, decision_event

log = logging.getLogger("flexlb.router")

# A forward no leader answers (none subscribed, or one stepping down replied) is asked again for up
# to this long (RouterState.ask_leader): a lease TTL and a cycle (leadership.py), the longest a failover takes.
FORWARD_NO_LEADER_WAIT_S = 3.0


ID_RANDOM_BATCH = 4096  # request ids made from one os.urandom read

class Intake:
    def __init__(self, state: RouterState) -> None:
        self.s = state
        # Ids this router makes: 96 random bits each, from os.urandom read ID_RANDOM_BATCH ids at
        # a time (secrets.token_hex per request was 1.5 % of the CPU). Not a counter: a client
        # that could guess the next id could send its own request under it first, and the
        # victim's would be refused duplicate_request.
        self._id_random = b""
        self._id_at = 0

    def new_request_id(self) -> str:
        at = self._id_at
        if at >= len(self._id_random):
            self._id_random, at = os.urandom(12 * ID_RANDOM_BATCH), 0
        self._id_at = at + 12
        return "cmpl-" + self._id_random[at:at + 12].hex()

    async def submit(self, request: m.Request) -> RequestHandle | Rejected:
        """Admit (or reject) a parsed request; on admission it is queued for batching. A
        standby router forwards it to the leader and relays its tokens and outcome. Its
        `model` ("": none, the default pool) picks the pool; `tenant`, `priority_class`: its
        place in the fair queue. A handle whose `admission` future is set waits in the fair
        queue: the caller awaits it (None: admitted; a Rejected: refused while waiting)."""
        to_pool = self.s.pool
        if self.s.pool:  # a router leading one pool: another pool's requests go to that pool's leader
            to_pool = self.s.pool_of_model(request.model) or self.s.pool
        if not self.s.is_leader or to_pool != self.s.pool:
            out = await self.forward(request, to_pool)
            if out is not None:  # (None: no leader answered until we took the lease: admitted here)
                return out
        return await self.admit_local(request)

    async def admit_local(self, request: m.Request, token_subject_override: str = "", forwarded_by: str = "",
                          mine: RequestHandle | None = None) -> RequestHandle | Rejected:
        """Admit here. A standby's request (`forwarded_by`) streams to `token_subject_override`;
        `mine`: one we forwarded, handed back now that we lead: admitted into its client's handle."""
        request_id = request.request_id
        now = time.time_ns()
        if self.s.handles.get(request_id, mine) is not mine:  # (another handle of that id is live)
            return await self.reject(request_id, "duplicate_request", f"request {request_id} is already in flight")
        handle = mine or RequestHandle(
            request, now, timeout_s=self._timeout_s(request), token_subject=token_subject_override,
            remote=bool(token_subject_override), forwarded_by=forwarded_by)
        prompt = request.prompt_token_ids
        hashes = tuple(block_hashes(prompt, self.s.scheduler.block_size_tokens()))
        handle.admit_here(AdmitRequest(
            request_id=request_id, num_prompt_tokens=len(prompt), max_tokens=request.max_tokens, block_hashes=hashes,
            priority=request.priority, slo_ttft_ms=request.slo_ttft_ms, slo_tpot_ms=request.slo_tpot_ms, payload=handle,
            model=request.model, tenant=request.tenant, priority_class=request.priority_class,
            engine_fields=tuple(sorted(request.extra_body)) if request.extra_body else (),
            embeddings=request.embed is not None,
        ))
        try:
            decision = (self.s.scheduler.offer(handle.admit, now) if self.s.settings.fair_queue
                        else self.s.scheduler.admit(handle.admit, now))
        except ValueError as exc:  # a bad priority class (the API checks it; a forwarded one is checked here)
            return await self.reject(request_id, "invalid_request", str(exc))
        rec = self.s.records.open(request_id, now, num_prompt_tokens=len(prompt), max_tokens=request.max_tokens,
                                  decisions=list(getattr(decision, "decisions", ())), tenant=request.tenant or DEFAULT_TENANT,
                                  priority_class=priority_class_of(handle.admit),
                                  **({"priority_class_asked": request.priority_class_asked}
                                     if request.priority_class_asked else {}))
        self.s.records.note(request_id, now, "arrived")
        if isinstance(decision, Queued):
            await self._queued(handle, decision, now)
            return handle
        if isinstance(decision, Refused):
            self.s.metrics.fair_requests.labels(decision.priority_class, decision.code).inc()
            self.s.metrics.tenant_requests.labels(self.s.metrics.tenant(decision.tenant), decision.code).inc()
            rec["admission"] = {"verdict": "refused", "code": decision.code, "message": decision.reason}
            return await self.reject(request_id, decision.code, decision.reason, decision.retry_after_ms)
        return await self._admission(handle, decision, now, rec)

    async def _admission(self, handle: RequestHandle, decision: Admitted | Rejected, now: int,
                         rec: dict | None) -> RequestHandle | Rejected:
        """What admission decided, at arrival or on release from the fair queue: events,
        records, and (admitted) the handle joins the live ones, its batch to be formed."""
        request_id = handle.request_id
        for d in decision.decisions:
            await self.s.emit(decision_event(request_id, self.s.router_id, d))
        if isinstance(decision, Rejected):
            if rec is not None:
                rec["admission"] = {"verdict": "rejected", "code": decision.code, "message": decision.message,
                                    "predicted_ttft_ms": decision.predicted_ttft_ms, "slo_ttft_ms": decision.slo_ttft_ms}
            self.s.metrics.tenant_requests.labels(self.s.metrics.tenant(handle.tenant or DEFAULT_TENANT), decision.code).inc()
            pool = self.s.scheduler.view.pool_of(handle.admit.model)
            self.s.metrics.model_requests.labels(self.s.metrics.model(pool), decision.code).inc()
            return await self.reject(request_id, decision.code, decision.message)
        assert isinstance(decision, Admitted)
        pool = self.s.scheduler.view.pool_of(handle.admit.model) or ""  # the model whose workers it was routed among
        if rec is not None:
            rec["admission"] = {
                "verdict": "best_effort" if decision.best_effort else "admitted",
                "predicted_ttft_ms": round(decision.predicted_ttft_ms, 3), "slo_ttft_ms": decision.slo_ttft_ms,
                "slo_tpot_ms": decision.slo_tpot_ms, "priority": decision.priority,
                "prefill_worker_id": decision.request.prefill_worker_id, "decode_worker_id": decision.request.decode_worker_id,
                "predicted_cached_tokens": decision.request.num_cached_tokens,
                "model": pool,
            }
        handle.place(decision.request.prefill_worker_id, decision.request.decode_worker_id,
                     decision.slo_ttft_ms or 0.0, decision.slo_tpot_ms or 0.0)
        self.s.handles[request_id] = handle
        self.s.metrics.inflight.set(len(self.s.scheduler.inflight))
        if decision.best_effort:
            self.s.metrics.best_effort.inc()
        self.s.metrics.tenant_requests.labels(self.s.metrics.tenant(handle.tenant or DEFAULT_TENANT), "admitted").inc()
        self.s.metrics.model_requests.labels(pool, "admitted").inc()
        await self.s.emit(
            m.RequestAdmitted(
                request_id=request_id, router_id=self.s.router_id, prefill_worker_id=handle.prefill_worker_id,
                decode_worker_id=handle.decode_worker_id, num_prompt_tokens=len(handle.prompt_token_ids),
                max_tokens=handle.max_tokens, policy=decision.policy, reason=decision.prefill_pick.reason,
                predicted_ttft_ms=round(decision.predicted_ttft_ms, 3), slo_ttft_ms=decision.slo_ttft_ms,
                slo_tpot_ms=decision.slo_tpot_ms, priority=decision.priority, best_effort=decision.best_effort,
                num_cached_tokens=decision.request.num_cached_tokens, model=pool,
                tenant=handle.request.tenant, priority_class=priority_class_of(handle.admit),
                priority_class_asked=handle.request.priority_class_asked,
            )
        )
        self.s.records.note(request_id, now, "admitted", prefill_worker_id=handle.prefill_worker_id,
                            decode_worker_id=handle.decode_worker_id)
        self.s.wakeup.set()
        return handle

    # ---------------------------------------------------------------- the fair queue
    async def _queued(self, handle: RequestHandle, q: Queued, now: int) -> None:
        """It waits in the fair queue: its client (or forwarding standby) waits for the release."""
        rid = handle.request_id
        self.s.records.note(rid, now, "queued", tenant=q.tenant, priority_class=q.priority_class,
                            num_queued_in_class=q.num_queued_in_class)
        handle.wait_for_admission()
        self.s.handles[rid] = handle
        self.s.metrics.fair_requests.labels(q.priority_class, "queued").inc()
        self.s.metrics.tenant_requests.labels(self.s.metrics.tenant(q.tenant), "queued").inc()
        if q.evicted is not None:
            await self._refuse_waiting(q.evicted)
        self._count_waiting()

    def _count_waiting(self) -> None:
        fair = self.s.scheduler.fair
        for c in CLASSES:
            self.s.metrics.fair_waiting.labels(c).set(sum(q.num_queued(c) for q in fair.queues.values()))

    async def _refuse_waiting(self, r: Refused) -> None:
        """A queued request refused while it waited (expired, or evicted by a higher class)."""
        self.s.metrics.fair_requests.labels(r.priority_class, r.code).inc()
        self.s.metrics.tenant_requests.labels(self.s.metrics.tenant(r.tenant), r.code).inc()
        handle = self.s.handles.pop(r.request_id, None)
        rej = await self.reject(r.request_id, r.code, r.reason, r.retry_after_ms)
        if handle is not None:
            handle.end()
            handle.admission_over(rej)

    def take_waiting(self) -> list[RequestHandle]:
        """Every request in the fair queue, taken out (leadership lost, or the router stops):
        their handles, oldest first; the caller hands them over or ends them."""
        out = [h for rid in self.s.scheduler.drain_waiting(time.time_ns()) if (h := self.s.handles.get(rid)) is not None]
        self._count_waiting()
        return out

    async def release(self) -> None:
        """Admit what the fair queue lets go now: the batch loop calls it whenever it wakes
        (a terminal event, a worker's status, a new arrival, or its poll while work waits)."""
        if not self.s.scheduler.fair.waiting or not self.s.may_dispatch():
            return
        now = time.time_ns()
        for r in self.s.scheduler.release(now):
            if isinstance(r.record, Refused):
                await self._refuse_waiting(r.record)
                continue
            d: Dispatched = r.record
            rid = d.request_id
            self.s.metrics.fair_requests.labels(d.priority_class, "released" if d.reason == "priority" else "starvation").inc()
            self.s.metrics.fair_wait.labels(d.priority_class).observe(d.waited_ns / 1e9)
            self.s.metrics.tenant_cost.labels(d.tenant).inc(d.cost_tokens)
            self.s.records.note(rid, now, "released", reason=d.reason, waited_ms=round(d.waited_ns / 1e6, 3),
                                tenant=d.tenant, counter=round(d.counter_after, 3))
            handle = self.s.handles.get(rid)
            if handle is None or handle.done:  # (cancelled waiters leave the queue: not expected)
                log.error("released %s from the fair queue with no client waiting: ended", rid)
                self.s.scheduler.on_terminal(rid)
                continue
            rec = self.s.records.records.get(rid)
            if rec is not None:
                rec["decisions"] = list(r.outcome.decisions)
            out = await self._admission(handle, r.outcome, now, rec)
            if isinstance(out, Rejected):
                self.s.handles.pop(rid, None)
                handle.end()
            handle.admission_over(out if isinstance(out, Rejected) else None)
        self._count_waiting()

    def _timeout_s(self, request: m.Request) -> float:
        return request.timeout_s if request.timeout_s is not None else self.s.settings.request_timeout_s

    async def forward(self, request: m.Request, to_pool: str = "") -> RequestHandle | Rejected | None:
        """To the leader of `to_pool` ("": the cluster's one leader) over NATS request-reply;
        None if no leader answered until we took the lease (the caller admits it here)."""
        request_id = request.request_id
        handle = RequestHandle(request, time.time_ns(), timeout_s=self._timeout_s(request), leader_pool=to_pool)
        self.s.handles[request_id] = handle
        cmd = m.SubmitRequest.of(request, self.s.router_id, token_subject(self.s.router_id, request_id))
        try:
            reply = await self.s.ask_leader(cmd, to_pool, min(FORWARD_NO_LEADER_WAIT_S, handle.timeout_s))
        except Exception as exc:  # no leader now (failover in progress) or a broken reply
            self.s.handles.pop(request_id, None)
            self.s.metrics.requests.labels("rejected", "not_ready").inc()
            whose = f"pool {to_pool!r}'s leader router" if to_pool else "leader router"
            return Rejected("not_ready", f"no {whose} answered ({exc.__class__.__name__}); retry")
        if reply is None:  # we took the lease meanwhile: the caller admits it here
            self.s.handles.pop(request_id, None)
            return None
        if handle.admit is not None:  # the leader stopped and handed it back to us (we lead now): on_submit
            return handle
        if not reply.admitted:
            self.s.handles.pop(request_id, None)
            return Rejected(reply.code, reply.message)
        handle.taken(reply)
        self.s.metrics.forwarded.inc()
        return handle

    async def on_submit(self, msg) -> None:
        """Leader: a standby forwarded a request, or the leader before us hands one over."""
        try:
            env = m.decode_as(msg.data, m.SubmitRequest)
        except m.DecodeError as exc:
            await self.s.undecodable("submit", msg, exc)
            return
        cmd: m.SubmitRequest = env.payload
        mine = self.s.handles.get(cmd.request_id) if cmd.router_id == self.s.router_id else None
        mine = mine if mine is not None and mine.is_forward and mine.leader_id in ("", env.producer) else None  # (else: a duplicate)
        out: RequestHandle | Rejected = Rejected("not_ready", NOT_LEADER_MESSAGE)
        if self.s.is_leader:
            out = await self.admit_local(cmd, token_subject_override="" if mine else cmd.token_subject,
                                         forwarded_by=cmd.router_id, mine=mine)
            if mine is not None:  # ours again: its client (awaiting its admission, or its stream) goes on here
                self.s.records.note(cmd.request_id, time.time_ns(), "handed_back", by=env.producer)
                if isinstance(out, Rejected):
                    self.s.finish_router(mine, "rejected", out.code, out.message)
                elif cmd.request_id not in self.s.scheduler.fair.waiting and mine.admission and not mine.admission.done():
                    mine.admission.set_result(None)
        if isinstance(out, Rejected):
            reply = m.SubmitReply(request_id=cmd.request_id, router_id=self.s.router_id, admitted=False, code=out.code,
                                  message=out.message)
        elif out.admission is not None and not out.admission.done():  # in our fair queue: admission comes as an event
            reply = m.SubmitReply(request_id=cmd.request_id, router_id=self.s.router_id, admitted=True, code="queued")
        else:
            reply = m.SubmitReply(request_id=cmd.request_id, router_id=self.s.router_id, admitted=True,
                                  prefill_worker_id=out.prefill_worker_id, decode_worker_id=out.decode_worker_id,
                                  slo_ttft_ms=out.slo_ttft_ms, slo_tpot_ms=out.slo_tpot_ms)
        await msg.respond(m.encode(self.s.envelopes.wrap(reply, time.time_ns())))

    async def on_router_event_msg(self, msg) -> None:
        """Other routers' events about requests we forwarded (a standby's; a pool leader's, to
        another pool's; a new leader's, to the one before): dispatched, admitted out of a fair
        queue, refused or failed there, handed over. (Our own, most of a leader's, not decoded.)"""
        if msg.subject == router_events_subject(self.s.router_id):
            return
        try:
            env = m.decode(msg.data)
        except m.DecodeError as exc:
            await self.s.undecodable("router_events", msg, exc)
            return
        ev = env.payload
        if isinstance(ev, m.CancelRequest):  # a standby's client went away or timed out: stop our copy of its request
            theirs = self.s.handles.get(ev.request_id)
            if theirs is not None and theirs.remote and theirs.forwarded_by == env.producer and not theirs.done:
                await self.cancel(theirs, f"{ev.reason[:200]} (at router {env.producer})")
            return
        if isinstance(ev, m.BatchDispatched):
            for rid in ev.request_ids:
                handle = self.s.handles.get(rid)
                if handle is not None and handle.is_forward:
                    handle.mark_dispatched()  # (its client's response may start: services/api.py)
            return
        handle = self.s.handles.get(getattr(ev, "request_id", ""))
        if handle is None or handle.done or not handle.is_forward:
            return
        queued = handle.admission is not None and not handle.admission.done()  # in its leader's fair queue
        if isinstance(ev, m.SubmitReply):  # our leader stopped and handed it over: the new leader's answer
            if ev.admitted and handle.leader_id == env.producer and ev.router_id != self.s.router_id:
                handle.taken(ev)
        elif isinstance(ev, m.RequestAdmitted):  # out of a fair queue, by the leader it was handed to, or before the reply
            if queued or (handle.leader_id != ev.router_id and not handle.dispatched):
                handle.taken(m.SubmitReply(
                    request_id=ev.request_id, router_id=ev.router_id, admitted=True, prefill_worker_id=ev.prefill_worker_id,
                    decode_worker_id=ev.decode_worker_id, slo_ttft_ms=ev.slo_ttft_ms or 0.0, slo_tpot_ms=ev.slo_tpot_ms or 0.0))
        elif isinstance(ev, m.RequestRejected):  # refused while in its leader's fair queue
            if queued or handle.leader_id == ev.router_id:
                self.s.finish_router(handle, "rejected", ev.code, ev.message)
        elif isinstance(ev, (m.RequestFailed, m.RequestTimedOut, m.RequestCancelled)):
            if handle.leader_id in ("", env.producer):  # (not from a leader that handed it over since)
                code = getattr(ev, "code", None) or ("timed_out" if isinstance(ev, m.RequestTimedOut) else "cancelled")
                self.s.finish_router(handle, "failed", code, getattr(ev, "message", "") or code)

    async def reject(self, request_id: str, code: str, message: str, retry_after_ms: int = 0) -> Rejected:
        self.s.metrics.requests.labels("rejected", code).inc()
        self.s.records.note(request_id, time.time_ns(), "rejected", code=code, message=message)
        await self.s.emit(m.RequestRejected(request_id=request_id, router_id=self.s.router_id, code=code, message=message))
        return Rejected(code, message, retry_after_ms=retry_after_ms)

    async def cancel(self, handle: RequestHandle, reason: str) -> None:
        """Client gone or timed out: stop the work. The worker reports the terminal event. A
        forward's leader is told too (on our router events: wherever it holds the request, its
        fair queue, a batch window or a worker, it stops it there)."""
        if handle.done:
            return
        if handle.is_forward:
            cmd = m.CancelRequest(request_id=handle.request_id, worker_id=handle.leader_id, reason=reason)
            await self.s.nc.publish(router_events_subject(self.s.router_id), m.encode(self.s.envelopes.wrap(cmd, time.time_ns())))
        if handle.admission is not None and not handle.admission.done():  # waiting in the fair queue
            if self.s.is_leader and self.s.scheduler.cancel_waiting(handle.request_id, time.time_ns()) is not None:
                self.s.metrics.fair_requests.labels(priority_class_of(handle.admit), "cancelled").inc()
                self._count_waiting()
                self.s.finish_router(handle, "cancelled", "cancelled", reason)
                await self.s.emit(m.RequestCancelled(request_id=handle.request_id, worker_id=self.s.router_id, reason=reason))
                return
        removed = self.s.scheduler.remove_queued(handle.request_id)
        if removed is not None:  # never dispatched: the router owns the terminal event
            self.s.finish_router(handle, "cancelled", "cancelled", reason)
            await self.s.emit(m.RequestCancelled(request_id=handle.request_id, worker_id=self.s.router_id, reason=reason))
            return
        handle.end()
        self.s.handles.pop(handle.request_id, None)
        for worker in {handle.prefill_worker_id, handle.decode_worker_id}:
            if worker:
                cmd = m.CancelRequest(request_id=handle.request_id, worker_id=worker, reason=reason)
                await self.s.nc.publish(cancel_subject(worker), m.encode(self.s.envelopes.wrap(cmd, time.time_ns())))

