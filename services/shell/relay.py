"""Relay: token chunks to clients.

Owns: the token subscription's handler (ordering by start index, the per-client buffer
bound, first-token time), a broken stream (the client is told, the workers cancel), and
the grace period for tokens still in flight after a worker's request.finished.
Calls: the bus (cancels). Called by: the service (subscription), fold.
"""

from __future__ import annotations

import asyncio
import time

from schemas import messages as m
from schemas.subjects import cancel_subject
from services.shell.state import RequestHandle, RouterState, Terminal


class Relay:
    def __init__(self, state: RouterState) -> None:
        self.s = state

    async def on_token_msg(self, msg) -> None:
        try:
            env = m.decode_as(msg.data, m.TokensGenerated)
        except m.DecodeError as exc:
            await self.s.undecodable("tokens", msg, exc)
            return
        chunk: m.TokensGenerated = env.payload
        handle = self.s.handles.get(chunk.request_id)
        if handle is not None and not handle.decode_worker_id and not handle.done:
            # Forwarded, and the leader's reply (which names the workers) is still on its way:
            # an instant engine can stream before it arrives. The worker streaming is its worker.
            handle.decode_worker_id = chunk.worker_id
        if handle is None or handle.done or chunk.worker_id != handle.decode_worker_id:
            # Not ours, finished, or from a worker the request was taken away from (re-routed).
            self.s.metrics.orphan_tokens.inc()
            return
        if chunk.start_index != handle.next_index:
            self.fail_client(handle, "worker_failed", f"token stream gap: expected index {handle.next_index}, got {chunk.start_index}")
            return
        if handle.num_buffered >= self.s.settings.token_buffer_max:
            self.s.metrics.stream_overflow.inc()
            self.fail_client(handle, "stream_overflow", f"token buffer of {self.s.settings.token_buffer_max} chunks is full")
            return
        if handle.next_index == 0:
            handle.first_token_ns = time.time_ns()
            self.s.metrics.ttft.observe((handle.first_token_ns - handle.arrival_ns) / 1e9)
            self.s.records.note(handle.request_id, handle.first_token_ns, "first_token", worker_id=chunk.worker_id)
        handle.next_index += len(chunk.token_ids)
        handle.num_buffered += 1
        handle.queue.put_nowait(chunk)
        if chunk.finish_reason is not None:
            handle.done = True
            self.s.handles.pop(handle.request_id, None)
            if handle.grace_task is not None:
                handle.grace_task.cancel()
            handle.queue.put_nowait(Terminal("finished", finish_reason=chunk.finish_reason))

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
        if not handle.done:
            self.s.finish_router(
                handle, "failed", "worker_failed",
                f"worker finished with {expected} tokens but only {handle.next_index} reached the router",
            )

