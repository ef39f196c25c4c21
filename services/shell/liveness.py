"""Liveness: the router's periodic cycle over its worker view.

Owns: the liveness loop. Each liveness interval the core's sync judges every worker (dead or
expired, from missed heartbeats); the leader then
recovers dead and expired workers, re-routes requests orphaned before dispatch, refreshes
drain flags and reports drained workers, probes the Redis ledger (rebuilt after an outage)
and re-announces its fencing epoch. A standby only refreshes its view and drain flags.
While the router itself is cut off from the bus (or just reconnected) nobody is judged.
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


class Liveness:
    def __init__(self, state: RouterState, recovery: "Recovery", admin: "Admin", upkeep: "Upkeep",
                 leadership: "Leadership") -> None:
        self.s = state
        self.recovery = recovery
        self.admin = admin
        self.upkeep = upkeep
        self.leadership = leadership

    async def liveness_loop(self) -> None:
        interval = self.s.settings.liveness_sync_ms / 1000
        while self.s.running:
            await asyncio.sleep(interval)
            if self.s.nc is None or not self.s.nc.is_connected:
                continue  # we cannot hear anyone: no worker missed anything
            if self.s.liveness_grace_cycles > 0:
                self.s.liveness_grace_cycles -= 1
                continue
            try:
                result = self.s.scheduler.sync(time.time_ns())
                if not self.s.is_leader:  # a standby keeps its view; recovery is the leader's
                    await self.admin.refresh_drain_flags()
                    continue
                for worker_id in result.dead:
                    await self.recovery.recover_dead_worker(worker_id, "dead")
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
