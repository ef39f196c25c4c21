"""Relay: token chunks to clients.

Owns: the token subscriptions' handlers (a request's own subject: one TokensGenerated a
message; this router's own subject: a TokensBatch, many requests' chunks from one worker in
one message, each taken as if it had come alone), ordering by start index, the per-client
buffer bound, first-token time, gaps (chunks past a missing one are held and the worker is
asked to publish the missing ones again: token chunks travel on core NATS, and those in
flight when the router's NATS node is lost are gone; a gap not filled in RESEND_WAIT_S fails
the request), a broken stream (the client is told, the workers cancel), and the grace
period for tokens still in flight after a worker's request.finished (then one resend is
asked for).
Calls: the bus (cancels, resends). Called by: the service (subscription), fold.
"""

from __future__ import annotations

import asyncio
import time

from schemas import messages as m
from schemas.subjects import cancel_subject, resend_subject, token_subject
from services.shell.handle import RequestHandle
from services.shell.state import RouterState

RESEND_WAIT_S = 1.0  # a token gap not filled by the worker's resend within this fails the request


class Relay:
    def __init__(self, state: RouterState) -> None:
        self.s = state

    async def on_token_msg(self, msg) -> None:
        """One request's chunk, on its own subject (a worker given no batch subject, a resend)."""
        try:
            env = m.decode_as(msg.data, m.TokensGenerated)
        except m.DecodeError as exc:
            await self.s.undecodable("tokens", msg, exc)
            return
        self.on_chunk(env.payload)

    async def on_token_batch_msg(self, msg) -> None:
        """Chunks of many requests from one worker, on this router's own token subject
        (TokensBatch): each is taken as if it had come alone, in the order they are listed."""
        try:
            env = m.decode_as(msg.data, m.TokensBatch)
        except m.DecodeError as exc:
            await self.s.undecodable("tokens", msg, exc)
            return
        for chunk in env.payload.chunks:
            self.on_chunk(chunk)

    def on_chunk(self, chunk: m.TokensGenerated) -> None:
        handle = self.s.handles.get(chunk.request_id)
        if handle is not None and not handle.decode_worker_id and not handle.done:
            # Forwarded, and the leader's reply (which names the workers) is still on its way:
            # an instant engine can stream before it arrives. The worker streaming is its worker.
            handle.streamed_by(chunk.worker_id)
        if handle is None or handle.done or chunk.worker_id != handle.decode_worker_id:
            # Not ours, finished, or from a worker the request was taken away from (re-routed).
            self.s.metrics.orphan_tokens.inc()
            return
        if handle.ahead and any(c.worker_id != handle.decode_worker_id for c in handle.ahead.values()):
            # chunks past a gap from a worker it was taken from (migrated): the new one regenerates them
            handle.ahead = {i: c for i, c in handle.ahead.items() if c.worker_id == handle.decode_worker_id}
        if chunk.start_index < handle.next_index:
            return  # a copy of one we have (a resend overlapping what did arrive)
        if chunk.start_index > handle.next_index:
            self.hold_ahead(handle, chunk)
            return
        self.accept(handle, chunk)
        while handle.ahead and not handle.done and handle.next_index in handle.ahead:
            self.accept(handle, handle.ahead.pop(handle.next_index))
        if not handle.ahead and handle.resend_task is not None:
            handle.resend_task.cancel()
            handle.resend_task = None

    def hold_ahead(self, handle: RequestHandle, chunk: m.TokensGenerated) -> None:
        """A chunk beyond the next expected one: some were lost on the way (a NATS node was
        lost with them in flight). Keep it, ask the worker for the missing ones again, and
        fail the request only if they do not come within RESEND_WAIT_S."""
        handle.ahead[chunk.start_index] = chunk
        if len(handle.ahead) > self.s.settings.token_buffer_max:
            self.fail_client(handle, "worker_failed", f"token stream gap at index {handle.next_index}: "
                                                      f"{len(handle.ahead)} later chunks held, the missing ones never came")
            return
        if handle.resend_task is None:
            self.s.metrics.token_resends.inc()
            self.request_resend(handle, chunk.worker_id)
            handle.resend_task = asyncio.get_running_loop().create_task(self.resend_deadline(handle, chunk.start_index))

    def request_resend(self, handle: RequestHandle, worker_id: str) -> None:
        cmd = m.ResendTokens(request_id=handle.request_id, worker_id=worker_id, from_index=handle.next_index,
                             token_subject=handle.token_subject or token_subject(self.s.router_id, handle.request_id))
        asyncio.get_running_loop().create_task(
            self.s.nc.publish(resend_subject(worker_id), m.encode(self.s.envelopes.wrap(cmd, time.time_ns()))))

    async def resend_deadline(self, handle: RequestHandle, got: int) -> None:
        await asyncio.sleep(RESEND_WAIT_S)
        handle.resend_task = None
        if handle.ahead and not handle.done:
            self.fail_client(handle, "worker_failed", f"token stream gap: expected index {handle.next_index}, got {got}; "
                                                      f"the worker's resend did not fill it within {RESEND_WAIT_S} s")

    def accept(self, handle: RequestHandle, chunk: m.TokensGenerated) -> None:
        if handle.queue.qsize() >= self.s.settings.token_buffer_max:  # (what its client has not read yet)
            self.s.metrics.stream_overflow.inc()
            self.fail_client(handle, "stream_overflow", f"token buffer of {self.s.settings.token_buffer_max} chunks is full")
            return
        if handle.next_index == 0:
            handle.first_token_ns = time.time_ns()
            self.s.metrics.ttft.observe((handle.first_token_ns - handle.arrival_ns) / 1e9)
            self.s.records.note(handle.request_id, handle.first_token_ns, "first_token", worker_id=chunk.worker_id)
        handle.next_index += chunk.num_chunk_tokens
        if handle.ids_known:  # (what a migration continues from: services/shell/recovery.py)
            if len(chunk.token_ids) == chunk.num_chunk_tokens:
                handle.output_ids.extend(chunk.token_ids)
            else:
                handle.ids_known = False
                handle.output_ids = []
        handle.queue.put_nowait(chunk)
        if chunk.finish_reason is not None:
            self.observe_finished(handle, time.time_ns())
            self.s.finish_router(handle, "finished", None, "", chunk.finish_reason)

    def observe_finished(self, handle: RequestHandle, now_ns: int) -> None:
        """A request's last token reached its client: its TPOT, and whether it met both SLOs
        (as the client saw them: TTFT from arrival here, TPOT over the tokens after the first)."""
        ttft_ms = (handle.first_token_ns - handle.arrival_ns) / 1e6
        tpot_ms = (now_ns - handle.first_token_ns) / 1e6 / (handle.next_index - 1) if handle.next_index > 1 else 0.0
        if handle.next_index > 1:
            self.s.metrics.tpot.observe(tpot_ms / 1e3)
        if handle.slo_ttft_ms and handle.slo_tpot_ms:
            missed = [n for n, v, t in (("ttft", ttft_ms, handle.slo_ttft_ms), ("tpot", tpot_ms, handle.slo_tpot_ms)) if v > t]
            self.s.metrics.slo_requests.labels("met" if not missed else "_".join(missed) + "_missed").inc()

    def fail_client(self, handle: RequestHandle, code: str, message: str) -> None:
        """The client's stream is broken: tell the client now, stop the work on the worker."""
        self.s.finish_router(handle, "failed", code, message)
        for worker in {handle.prefill_worker_id, handle.decode_worker_id}:
            cmd = m.CancelRequest(request_id=handle.request_id, worker_id=worker, reason=f"{code}: {message}")
            asyncio.get_running_loop().create_task(
                self.s.nc.publish(cancel_subject(worker), m.encode(self.s.envelopes.wrap(cmd, time.time_ns())))
            )

    async def grace(self, handle: RequestHandle, expected: int) -> None:
        await asyncio.sleep(self.s.settings.finish_grace_ms / 1000)
        if not handle.done and handle.decode_worker_id:  # the last chunks were lost: ask for them once
            self.s.metrics.token_resends.inc()
            self.request_resend(handle, handle.decode_worker_id)
            await asyncio.sleep(max(RESEND_WAIT_S, self.s.settings.finish_grace_ms / 1000))
        if not handle.done:
            self.s.finish_router(
                handle, "failed", "worker_failed",
                f"worker finished with {expected} tokens but only {handle.next_index} reached the router",
            )

