"""At-least-once publishing of facts into a JetStream stream, off the caller's path.

Which publishes go through it, and which stay fire-and-forget (core NATS):

- acked (this module): terminal request events (a worker's or the router's finished, failed,
  cancelled, timed-out: the one fact that releases a request's ledger entries and ends its
  record) and the router's core journal (`flexlb replay` needs every record). Dispatch and
  the PD hand-off are acked too, inline (`js.publish`), because the caller must know.
- fire-and-forget: tokens (the client's stream; a lost one is seen by the router as a gap
  and the request fails with a code), status heartbeats (the next one supersedes it in
  200 ms), KV events (sequence-numbered; a gap makes the router ask for a snapshot),
  BatchStarted / PrefillCompleted / decisions (informative; calibration from status reports
  corrects the view without them), fencing-epoch announcements and cancels (repeated or
  bounded by the request's deadline).

A message is published with its envelope's event id as `Nats-Msg-Id` (the stream drops a
duplicate within its 120 s window) and a reply inbox; the caller does not wait. A message
whose ack does not come within `ack_timeout_s` (a node lost, a stream electing its leader, a
frozen server) or that is refused is sent again, with the same id, until `give_up_s` after
its first send (< the duplicate window); only then is it lost, counted and reported to
`on_lost`. On a NATS cluster this is what keeps a terminal event published while the
stream's leader was being replaced.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from schemas.subjects import HDR_MSG_ID

log = logging.getLogger("flexlb.acked")


@dataclass(eq=False)
class _Pending:
    subject: str
    data: bytes
    msg_id: str
    first_at: float
    sent_at: float = 0.0
    tokens: list[str] = field(default_factory=list)  # reply tokens of its sends (any ack will do)
    failed: bool = False


class AckedPublisher:
    """Acks come to one inbox subscription of ours (a token per send), not through nats-py's
    publish_async (a future, a semaphore wait and a JSON parse per message): a terminal event
    per request and the journal's records made that the worker's largest cost on the hot path."""

    def __init__(self, nc: Any, what: str, ack_timeout_s: float = 2.0, give_up_s: float = 60.0,
                 check_interval_s: float = 0.25, on_lost: Callable[[str, str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not 0 < ack_timeout_s < give_up_s < 120:
            raise ValueError(f"need 0 < ack_timeout_s < give_up_s < 120 (the duplicate window), got "
                             f"{ack_timeout_s}, {give_up_s}")
        self.nc = nc
        self.what = what
        self.ack_timeout_s = ack_timeout_s
        self.give_up_s = give_up_s
        self.check_interval_s = check_interval_s
        self.on_lost = on_lost
        self.clock = clock
        self.pending: dict[str, _Pending] = {}  # msg id -> not yet acked
        self.by_token: dict[str, _Pending] = {}
        self.prefix = ""
        self.sub = None
        self.next_token = 0
        self.num_published = 0
        self.num_retried = 0
        self.num_lost = 0

    async def publish(self, subject: str, data: bytes, msg_id: str) -> None:
        """Send now; returns without waiting for the ack (the retry loop sees to it)."""
        p = _Pending(subject, data, msg_id, self.clock())
        self.pending[msg_id] = p
        self.num_published += 1
        await self._send(p)

    async def _send(self, p: _Pending) -> bool:
        if self.sub is None:
            self.prefix = self.nc.new_inbox() + "."
            self.sub = await self.nc.subscribe(self.prefix + "*", cb=self._on_reply)
        p.sent_at = self.clock()
        self.next_token += 1
        token = str(self.next_token)
        p.tokens.append(token)
        self.by_token[token] = p
        try:
            await self.nc.publish(p.subject, p.data, reply=self.prefix + token, headers={HDR_MSG_ID: p.msg_id})
        except asyncio.CancelledError:
            raise
        except Exception:  # the connection refuses writes (closed, buffer full): retried by the loop
            p.failed = True
            return False
        return True

    async def _on_reply(self, msg) -> None:
        p = self.by_token.get(msg.subject[len(self.prefix):])
        if p is None:
            return  # a late ack of a message already acked (or given up)
        status = msg.headers.get("Status") if msg.headers else None
        if status or b'"error"' in msg.data:
            p.failed = True  # no responders (its stream is electing a leader), or refused: retry
            return
        self._done(p)

    def _done(self, p: _Pending) -> None:
        for token in p.tokens:
            self.by_token.pop(token, None)
        if self.pending.get(p.msg_id) is p:
            del self.pending[p.msg_id]

    async def retry_due(self) -> int:
        """One pass: re-send what is refused or unacked for ack_timeout_s, drop (lost) what
        is older than give_up_s. Returns how many were re-sent."""
        now = self.clock()
        resent = 0
        for p in list(self.pending.values()):
            if not (p.failed or now - p.sent_at >= self.ack_timeout_s):
                continue
            if now - p.first_at >= self.give_up_s:
                self._done(p)
                self.num_lost += 1
                log.error("%s %s lost: no ack from the stream in %.0f s", self.what, p.msg_id, self.give_up_s)
                if self.on_lost is not None:
                    self.on_lost(p.subject, p.msg_id)
                continue
            p.failed = False
            self.num_retried += 1
            resent += 1
            if not await self._send(p):
                break  # the bus takes nothing now: the next pass tries again
        return resent

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.check_interval_s)
            try:
                await self.retry_due()
            except asyncio.CancelledError:
                raise
            except Exception:  # a failed pass must not end retries; the next one tries again
                log.exception("%s retry pass failed", self.what)

    async def drain(self, timeout_s: float) -> int:
        """At shutdown: retry until every message is acked or `timeout_s`; returns how many
        are still unacked."""
        deadline = self.clock() + timeout_s
        while self.pending and self.clock() < deadline:
            await asyncio.sleep(min(self.check_interval_s, 0.05))
            await self.retry_due()
        return len(self.pending)


async def publish_until_acked(js: Any, subject: str, data: bytes, msg_id: str, within_s: float = 8.0,
                              attempt_timeout_s: float = 2.0, pause_s: float = 0.2) -> Any:
    """Publish and wait for the stream's ack, inline (the caller must know: a dispatch, a PD
    hand-off), sending again with the same id while the stream cannot take it: no
    responders (its leader is being elected after a node was lost) or no ack in
    `attempt_timeout_s`. The stream's duplicate window makes a repeat harmless. Raises the
    last error once `within_s` has passed without an ack."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            return await js.publish(subject, data, timeout=attempt_timeout_s, headers={HDR_MSG_ID: msg_id})
        except asyncio.CancelledError:
            raise
        except Exception:  # no responders, timeout, a reconnect: again until the deadline
            if time.monotonic() + pause_s >= deadline:
                raise
            await asyncio.sleep(pause_s)
