"""Intake: a parsed request in, admitted or rejected out.

Owns: admission (the core's admit, the decision record, route.decided / request.admitted /
request.rejected events), the client handle it returns, a client's cancel, and forwarding:
a standby sends the request to the leader over NATS (SubmitRequest) and follows the
leader's router events for it; the leader admits forwarded requests (on_submit).
Calls: the core, the bus. Called by: the HTTP API, leadership (the submit subscription).
"""

from __future__ import annotations

import itertools
import secrets
import time

from schemas import messages as m
from schemas.subjects import cancel_subject, submit_subject, token_subject
from schemas.tokens import block_hashes
from services.core.scheduler import AdmitRequest, Admitted, Rejected
from services.shell.state import RequestHandle, RouterState, decision_event

FORWARD_TIMEOUT_S = 5.0  # a standby waits this long for the leader to admit a forwarded request


class Intake:
    def __init__(self, state: RouterState) -> None:
        self.s = state
        # Ids this router makes: a random 48-bit prefix per process and a counter (as long as
        # the 96 random bits they replaced; secrets.token_hex per request was 1.5 % of the CPU).
        self._id_prefix = "cmpl-" + secrets.token_hex(6)
        self._id_seq = itertools.count(1)

    def new_request_id(self) -> str:
        return f"{self._id_prefix}{next(self._id_seq):012x}"

    async def submit(
        self, request_id: str, prompt_token_ids: list[int], max_tokens: int, priority: int | None = None,
        slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None, timeout_s: float | None = None,
        sampling: m.Sampling | None = None, stop: list[str] | None = None, chat: m.ChatForward | None = None,
        model: str = "",
    ) -> RequestHandle | Rejected:
        """Admit (or reject) a parsed request; on admission it is queued for batching. A
        standby router forwards it to the leader and relays its tokens and outcome. `model`:
        the one the client named ("": none, the default pool)."""
        if not self.s.is_leader:
            return await self.forward(request_id, prompt_token_ids, max_tokens, priority, slo_ttft_ms, slo_tpot_ms, timeout_s,
                                       sampling, stop=stop or [], chat=chat, model=model)
        return await self.admit_local(request_id, prompt_token_ids, max_tokens, priority, slo_ttft_ms, slo_tpot_ms,
                                       timeout_s, sampling=sampling, stop=stop or [], chat=chat, model=model)

    async def admit_local(
        self, request_id: str, prompt_token_ids: list[int], max_tokens: int, priority: int | None,
        slo_ttft_ms: float | None, slo_tpot_ms: float | None, timeout_s: float | None,
        token_subject_override: str = "", sampling: m.Sampling | None = None, stop: list[str] | None = None,
        chat: m.ChatForward | None = None, model: str = "",
    ) -> RequestHandle | Rejected:
        now = time.time_ns()
        if request_id in self.s.handles:
            return await self.reject(request_id, "duplicate_request", f"request {request_id} is already in flight")
        handle = RequestHandle(request_id, prompt_token_ids, max_tokens, now,
                               timeout_s=timeout_s if timeout_s is not None else self.s.settings.request_timeout_s,
                               token_subject=token_subject_override, remote=bool(token_subject_override),
                               sampling=sampling, stop=stop or [], chat=chat)
        hashes = tuple(block_hashes(prompt_token_ids, self.s.scheduler.block_size_tokens()))
        handle.admit = AdmitRequest(
            request_id=request_id, num_prompt_tokens=len(prompt_token_ids), max_tokens=max_tokens, block_hashes=hashes,
            priority=priority, slo_ttft_ms=slo_ttft_ms, slo_tpot_ms=slo_tpot_ms, payload=handle, model=model,
        )
        decision = self.s.scheduler.admit(handle.admit, now)
        rec = self.s.records.open(request_id, now, num_prompt_tokens=len(prompt_token_ids), max_tokens=max_tokens,
                                decisions=list(decision.decisions))
        self.s.records.note(request_id, now, "arrived")
        for d in decision.decisions:
            await self.s.emit(decision_event(request_id, self.s.router_id, d))
        if isinstance(decision, Rejected):
            rec["admission"] = {"verdict": "rejected", "code": decision.code, "message": decision.message,
                                "predicted_ttft_ms": decision.predicted_ttft_ms, "slo_ttft_ms": decision.slo_ttft_ms}
            return await self.reject(request_id, decision.code, decision.message)
        assert isinstance(decision, Admitted)
        pool = self.s.scheduler.view.resolve_model(model)  # the model whose workers it was routed among
        rec["admission"] = {
            "verdict": "best_effort" if decision.best_effort else "admitted",
            "predicted_ttft_ms": round(decision.predicted_ttft_ms, 3), "slo_ttft_ms": decision.slo_ttft_ms,
            "slo_tpot_ms": decision.slo_tpot_ms, "priority": decision.priority,
            "prefill_worker_id": decision.request.prefill_worker_id, "decode_worker_id": decision.request.decode_worker_id,
            "predicted_cached_tokens": decision.request.num_cached_tokens,
            "model": pool,
        }
        handle.prefill_worker_id = decision.request.prefill_worker_id
        handle.decode_worker_id = decision.request.decode_worker_id
        handle.slo_ttft_ms, handle.slo_tpot_ms = decision.slo_ttft_ms or 0.0, decision.slo_tpot_ms or 0.0
        self.s.handles[request_id] = handle
        self.s.metrics.inflight.set(len(self.s.scheduler.inflight))
        if decision.best_effort:
            self.s.metrics.best_effort.inc()
        await self.s.emit(
            m.RequestAdmitted(
                request_id=request_id, router_id=self.s.router_id, prefill_worker_id=handle.prefill_worker_id,
                decode_worker_id=handle.decode_worker_id, num_prompt_tokens=len(prompt_token_ids), max_tokens=max_tokens,
                policy=decision.policy, reason=decision.prefill_pick.reason,
                predicted_ttft_ms=round(decision.predicted_ttft_ms, 3), slo_ttft_ms=decision.slo_ttft_ms,
                slo_tpot_ms=decision.slo_tpot_ms, priority=decision.priority, best_effort=decision.best_effort,
                num_cached_tokens=decision.request.num_cached_tokens, model=pool,
            )
        )
        self.s.records.note(request_id, now, "admitted", prefill_worker_id=handle.prefill_worker_id,
                          decode_worker_id=handle.decode_worker_id)
        self.s.wakeup.set()
        return handle

    async def forward(self, request_id, prompt_token_ids, max_tokens, priority, slo_ttft_ms, slo_tpot_ms, timeout_s,
                       sampling=None, stop: list[str] | None = None, chat: m.ChatForward | None = None, model: str = ""):
        handle = RequestHandle(request_id, prompt_token_ids, max_tokens, time.time_ns(),
                               timeout_s=timeout_s if timeout_s is not None else self.s.settings.request_timeout_s,
                               stop=stop or [], chat=chat)
        self.s.handles[request_id] = handle
        cmd = m.SubmitRequest(
            request_id=request_id, router_id=self.s.router_id, prompt_token_ids=prompt_token_ids, max_tokens=max_tokens,
            token_subject=token_subject(self.s.router_id, request_id), priority=priority, slo_ttft_ms=slo_ttft_ms,
            slo_tpot_ms=slo_tpot_ms, timeout_s=timeout_s, sampling=sampling, stop=stop or [], chat=chat, model=model,
        )
        try:
            msg = await self.s.nc.request(submit_subject(self.s.settings.cluster), m.encode(self.s.envelopes.wrap(cmd, time.time_ns())),
                                        timeout=FORWARD_TIMEOUT_S)
            reply = m.decode_as(msg.data, m.SubmitReply).payload
        except Exception as exc:  # no leader now (failover in progress) or a broken reply
            self.s.handles.pop(request_id, None)
            self.s.metrics.requests.labels("rejected", "not_ready").inc()
            return Rejected("not_ready", f"no leader router answered ({exc.__class__.__name__}); retry")
        if not reply.admitted:
            self.s.handles.pop(request_id, None)
            return Rejected(reply.code, reply.message)
        # (Relay may have set the decode worker already, from tokens that beat the reply here.)
        handle.prefill_worker_id, handle.decode_worker_id = reply.prefill_worker_id, reply.decode_worker_id
        handle.slo_ttft_ms, handle.slo_tpot_ms = reply.slo_ttft_ms, reply.slo_tpot_ms
        handle.leader_id = reply.router_id
        self.s.metrics.forwarded.inc()
        return handle

    async def hand_over(self, handle: RequestHandle) -> str | None:
        """We stopped leading with this request of our own client admitted and not dispatched:
        forward it to the new leader, as a standby forwards a new one (its tokens come to us,
        our client's stream goes on). None if the leader took it, else why not."""
        rid, adm = handle.request_id, handle.admit
        remaining_s = handle.timeout_s - (time.time_ns() - handle.arrival_ns) / 1e9
        if handle.remote or adm is None or remaining_s <= 0:
            return "not ours to hand over (forwarded to us, or past its deadline)"
        cmd = m.SubmitRequest(
            request_id=rid, router_id=self.s.router_id, prompt_token_ids=handle.prompt_token_ids,
            max_tokens=handle.max_tokens, token_subject=token_subject(self.s.router_id, rid), priority=adm.priority,
            slo_ttft_ms=adm.slo_ttft_ms, slo_tpot_ms=adm.slo_tpot_ms, timeout_s=remaining_s, sampling=handle.sampling,
            stop=handle.stop, chat=handle.chat, model=adm.model,
        )
        try:
            msg = await self.s.nc.request(submit_subject(self.s.settings.cluster),
                                          m.encode(self.s.envelopes.wrap(cmd, time.time_ns())), timeout=FORWARD_TIMEOUT_S)
            reply = m.decode_as(msg.data, m.SubmitReply).payload
        except Exception as exc:  # no leader (yet): the caller fails it retryable
            return f"no leader router answered ({exc.__class__.__name__})"
        if not reply.admitted:
            return f"the leader refused it: {reply.code}: {reply.message}"
        handle.prefill_worker_id, handle.decode_worker_id = reply.prefill_worker_id, reply.decode_worker_id
        handle.slo_ttft_ms, handle.slo_tpot_ms = reply.slo_ttft_ms, reply.slo_tpot_ms
        handle.leader_id = reply.router_id
        self.s.records.note(rid, time.time_ns(), "handed_over", leader=reply.router_id)
        self.s.metrics.forwarded.inc()
        return None

    async def on_submit(self, msg) -> None:
        """Leader: a standby forwarded a request."""
        try:
            cmd = m.decode_as(msg.data, m.SubmitRequest).payload
        except m.DecodeError as exc:
            await self.s.undecodable("submit", msg, exc)
            return
        if not self.s.is_leader:
            reply = m.SubmitReply(request_id=cmd.request_id, router_id=self.s.router_id, admitted=False, code="not_ready",
                                  message="not the leader any more")
        else:
            out = await self.admit_local(cmd.request_id, cmd.prompt_token_ids, cmd.max_tokens, cmd.priority,
                                          cmd.slo_ttft_ms, cmd.slo_tpot_ms, cmd.timeout_s, token_subject_override=cmd.token_subject,
                                          sampling=cmd.sampling, stop=cmd.stop, chat=cmd.chat, model=cmd.model)
            if isinstance(out, Rejected):
                reply = m.SubmitReply(request_id=cmd.request_id, router_id=self.s.router_id, admitted=False,
                                      code=out.code, message=out.message)
            else:
                reply = m.SubmitReply(request_id=cmd.request_id, router_id=self.s.router_id, admitted=True,
                                      prefill_worker_id=out.prefill_worker_id, decode_worker_id=out.decode_worker_id,
                                      slo_ttft_ms=out.slo_ttft_ms, slo_tpot_ms=out.slo_tpot_ms)
        await msg.respond(m.encode(self.s.envelopes.wrap(reply, time.time_ns())))

    async def on_router_event_msg(self, msg) -> None:
        """Standby: the leader's router-side terminal events for requests we forwarded."""
        if self.s.is_leader:
            return
        try:
            ev = m.decode(msg.data).payload
        except m.DecodeError as exc:
            await self.s.undecodable("router_events", msg, exc)
            return
        if isinstance(ev, m.BatchDispatched):
            for rid in ev.request_ids:
                handle = self.s.handles.get(rid)
                if handle is not None:
                    handle.dispatched = True
            return
        if not isinstance(ev, (m.RequestFailed, m.RequestTimedOut, m.RequestCancelled)):
            return
        handle = self.s.handles.get(ev.request_id)
        if handle is None or handle.done:
            return
        code = getattr(ev, "code", None) or ("timed_out" if isinstance(ev, m.RequestTimedOut) else "cancelled")
        self.s.finish_router(handle, "failed", code, getattr(ev, "message", "") or code)

    async def reject(self, request_id: str, code: str, message: str) -> Rejected:
        self.s.metrics.requests.labels("rejected", code).inc()
        self.s.records.note(request_id, time.time_ns(), "rejected", code=code, message=message)
        await self.s.emit(m.RequestRejected(request_id=request_id, router_id=self.s.router_id, code=code, message=message))
        return Rejected(code, message)

    async def cancel(self, handle: RequestHandle, reason: str) -> None:
        """Client gone or timed out: stop the work. The worker reports the terminal event."""
        if handle.done:
            return
        removed = self.s.scheduler.remove_queued(handle.request_id)
        if removed is not None:  # never dispatched: the router owns the terminal event
            self.s.finish_router(handle, "cancelled", "cancelled", reason)
            await self.s.emit(m.RequestCancelled(request_id=handle.request_id, worker_id=self.s.router_id, reason=reason))
            return
        handle.done = True
        self.s.handles.pop(handle.request_id, None)
        for worker in {handle.prefill_worker_id, handle.decode_worker_id}:
            if worker:
                cmd = m.CancelRequest(request_id=handle.request_id, worker_id=worker, reason=reason)
                await self.s.nc.publish(cancel_subject(worker), m.encode(self.s.envelopes.wrap(cmd, time.time_ns())))

