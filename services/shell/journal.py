"""The core journal: every call into the core, recorded (services/core/journal.py Recorder) and
published in call order to FLEXLB_JOURNAL, so `flexlb replay` re-runs the scheduler exactly.

Owns: the queue of records not yet published and their gap-free envelope sequence (its own,
`<boot>.journal`). Calls: the bus (acked publishes, re-sent until the stream has them:
schemas/acked.py). Called by: the Recorder
(record, synchronously, in the core's call order) and the service (the loop; a last flush at
stop). The journal exists before the router's state, because the Recorder wrapping the core
is given its sink at construction; attach() hands it the state once that exists.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque

from schemas import messages as m
from schemas.subjects import journal_subject
from services.shell.state import RouterState

log = logging.getLogger("flexlb.router")


class Journal:
    def __init__(self, router_id: str, boot_id: str) -> None:
        self.router_id = router_id
        self.queue: deque[tuple[str, bytes]] = deque()  # (event id, core.recorded event) not yet published, in call order
        self.wakeup = asyncio.Event()
        self.envelopes = m.EnvelopeFactory(router_id, f"{boot_id}.journal")  # gap-free seq of its own
        self.s: RouterState | None = None

    def attach(self, state: RouterState) -> None:
        self.s = state

    def record(self, op: str, now_ns: int, args: dict, out: dict) -> None:
        """The Recorder's sink: called synchronously, in the core's call order."""
        rec = m.CoreRecorded(router_id=self.router_id, op=op, now_ns=now_ns, args=args, out=out)
        env = self.envelopes.wrap(rec, time.time_ns())
        self.queue.append((env.event_id, m.encode(env)))
        self.wakeup.set()

    async def loop(self) -> None:
        while self.s.running:
            await self.wakeup.wait()
            self.wakeup.clear()
            await self.flush()

    async def flush(self) -> None:
        """Publish queued records in order into FLEXLB_JOURNAL, acked: one the stream does not
        ack is re-sent (same id, deduplicated) until it does. Only one still unacked after
        the publisher's give_up_s is lost: counted (journal_lost), and replay reports the gap."""
        subject = journal_subject(self.router_id)
        while self.queue:
            event_id, data = self.queue.popleft()
            await self.s.acked.publish(subject, data, event_id)
            self.s.metrics.journal_records.inc()
