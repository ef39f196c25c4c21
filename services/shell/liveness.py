"""Liveness: the router's periodic cycle over its worker view.

Owns: the liveness loop. Each liveness interval the core's sync judges every worker (dead or
expired, from missed heartbeats); the leader then
recovers dead and expired workers, re-routes requests orphaned before dispatch, refreshes
drain flags and reports drained workers, probes the Redis ledger (rebuilt after an outage)
and re-announces its fencing epoch. A standby only refreshes its view and drain flags.
While the router itself is cut off from the bus (or just reconnected) nobody is judged; so
too while its NATS server does not answer a ping within BUS_PROBE_TIMEOUT_S with the
connection still open (a frozen or overloaded server, a partition): every worker falls
silent at once then, and that is the bus, not the workers. After the bus answers again the
workers get a full detection window to be heard (their heartbeats were queued behind it).
A real worker death during a bus freeze is therefore found up to the freeze's length later.
Calls: the core, recovery, admin, upkeep, leadership. Called by: the service.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from services.shell.state import RouterState

if TYPE_CHECKING:
    from services.shell.admin import Admin
    from services.shell.leadership import Leadership
    from services.shell.recovery import Recovery
    from services.shell.upkeep import Upkeep

log = logging.getLogger("flexlb.router")

# A ping to our NATS server unanswered this long means the bus is silent, not the workers.
# Generous: a busy server on a loaded machine answers in milliseconds; this is about a
# server that does not answer at all.
BUS_PROBE_TIMEOUT_S = 1.0


class Liveness:
    def __init__(self, state: RouterState, recovery: "Recovery", admin: "Admin", upkeep: "Upkeep",
                 leadership: "Leadership") -> None:
        self.s = state
        self.recovery = recovery
        self.admin = admin
        self.upkeep = upkeep
        self.leadership = leadership
        self.grace_cycles = 0  # liveness cycles to skip (after our own bus outage)
        self.probe_sub = None  # our own inbox: a probe published there comes back if the bus works
        self.probe_subject = ""
        self.probe_seq = 0
        self.probe_back = asyncio.Event()

    def note_bus_state(self, state: str) -> None:
        self.s.bus_state = state
        if state == "reconnected":
            # Heartbeats we missed while we were cut off are our fault, not the workers':
            # give them a full detection window to be heard again before counting misses.
            self.grace_cycles = self.s.settings.dead_after_missed_syncs + 1

    async def on_bus_state(self, state: str) -> None:
        """The NATS client's callback (services/shell/bus.py connect)."""
        self.note_bus_state(state)

    async def liveness_loop(self) -> None:
        interval = self.s.settings.liveness_sync_ms / 1000
        while self.s.running:
            await asyncio.sleep(interval)
            if self.s.nc is None or not self.s.nc.is_connected:
                continue  # we cannot hear anyone: no worker missed anything
            if not await self._bus_answers():
                continue
            if self.grace_cycles > 0:
                self.grace_cycles -= 1
                continue
            try:
                result = self.s.scheduler.sync(time.time_ns())
                if not self.s.is_leader:  # a standby keeps its view; recovery is the leader's
                    await self.admin.refresh_drain_flags()
                    continue
                for worker_id in result.dead:
                    w = self.s.scheduler.view.workers.get(worker_id)
                    # Silent after saying it stops (SIGTERM, drained or not): stopped, not dead.
                    await self.recovery.recover_dead_worker(worker_id, "stopped" if w is not None and w.state == "stopping"
                                                            else "dead")
                for worker_id in result.expired:
                    await self.recovery.recover_dead_worker(worker_id, "expired")
                for item in result.orphans:
                    await self.recovery.reroute(item.payload, "its worker died before dispatch")
                await self.admin.refresh_drain_flags()
                await self.admin.report_drained()
                await self.upkeep.check_ledger_store()
                await self.leadership.announce_epoch()
            except asyncio.CancelledError:
                raise
            except Exception:  # a failed cycle must not stop liveness; the next one retries
                self.s.metrics.consumer_errors.labels("liveness").inc()
                log.exception("liveness cycle failed")

    async def _bus_answers(self) -> bool:
        """Whether our NATS server answers: a probe we publish to an inbox of our own comes
        back within BUS_PROBE_TIMEOUT_S. (Not nc.flush(timeout): nats-py leaves a timed-out
        ping's future queued, and the late PONG then breaks its read loop.)"""
        s = self.s
        try:
            if self.probe_sub is None:
                self.probe_subject = s.nc.new_inbox()
                self.probe_sub = await s.nc.subscribe(self.probe_subject, cb=self._on_probe)
            self.probe_seq += 1
            self.probe_back.clear()
            await s.nc.publish(self.probe_subject, str(self.probe_seq).encode())
            await asyncio.wait_for(self.probe_back.wait(), BUS_PROBE_TIMEOUT_S)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the probe did not come back (or could not go): silent either way
            s.metrics.bus_silent_cycles.inc()
            if not s.bus_silent_since_ns:
                s.bus_silent_since_ns = time.time_ns()
                log.warning("NATS server does not answer (%s): judging no worker until it does", type(exc).__name__)
            return False
        if s.bus_silent_since_ns:
            silent_s = (time.time_ns() - s.bus_silent_since_ns) / 1e9
            s.bus_silent_since_ns = 0
            self.grace_cycles = s.settings.dead_after_missed_syncs + 1
            log.warning("NATS server answers again after %.1f s silent: workers get a full detection window", silent_s)
        return True

    async def _on_probe(self, msg) -> None:
        if msg.data == str(self.probe_seq).encode():  # a late one from an earlier cycle is not this one
            self.probe_back.set()
