"""Leadership: one scheduler per cluster, or one per pool.

With `scheduling_pool` set, each router leads one pool (a model's workers): the lease, the
submit subject and the Redis ledger are the pool's, so the leaders of different pools run in
different processes and the fleet's scheduling grows with its pools; a router's core holds
its own pool's workers only (fold.py keeps the others out), and it forwards a request for
another pool to that pool's leader (intake.py). The fencing epoch stays one counter for the
cluster: every lease taken, of any pool, gets a number above all before, and each worker
only ever hears its own pool's leaders.

Owns: the Redis lease (PX TTL, renewed every LEASE_RENEW_S), the fencing epoch it bumps when
it takes the lease and announces to every worker, stepping down (queued requests fail
retryable), failing a standby's forwards stranded at a leader that is gone, and the bus
connection state (a reconnect grants workers a liveness grace). Calls: Redis, the bus,
intake (it subscribes intake.on_submit while leader). Called by: the service, liveness.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from schemas import messages as m
from schemas.subjects import epoch_subject, pool_token, submit_subject
from services.shell.state import RouterState

if TYPE_CHECKING:
    from services.shell.intake import Intake

log = logging.getLogger("flexlb.router")

# Take the lease if it is free, or held by an earlier incarnation of this same router id
# (router ids are unique per process: that incarnation is dead, no need to wait out its TTL).
ACQUIRE_LUA = """
local cur = redis.call('GET', KEYS[1])
if (not cur) or string.sub(cur, 1, string.len(ARGV[3])) == ARGV[3] then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
"""
LEASE_RENEW_S = 0.5  # renew (leader) / try to take (standby) this often
LEASE_TTL_S = 2.0  # the leader's lease; a standby takes over at most this long after it dies
PAUSE_STEP_DOWN_S = 10.0  # a leader paused this long past its lease (Redis away) steps down
# Renew: 1 if it was ours. 2 if nobody holds it (Redis restarted empty, or Sentinel promoted
# a replica that missed it) and no router took an epoch above ours meanwhile: we take it again
# and keep our epoch (restoring the counter if it was lost), so dispatches already queued for
# the workers stay valid. 0 if another router holds it, or led since (a higher epoch): we lost it.
RENEW_LUA = """
local cur = redis.call('GET', KEYS[1])
if cur == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
if cur then
  return 0
end
local e = tonumber(redis.call('GET', KEYS[2]) or '0')
if e > tonumber(ARGV[3]) then
  return 0
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
redis.call('SET', KEYS[2], ARGV[3])
return 2
"""
# A new epoch, above every epoch known to have been used: the counter's (which a replica
# promoted by Sentinel may have missed the last increments of: replication is asynchronous),
# ours, and the highest any worker reports accepting.
EPOCH_LUA = """
local e = redis.call('INCR', KEYS[1])
local floor = tonumber(ARGV[1])
if e <= floor then
  e = floor + 1
  redis.call('SET', KEYS[1], e)
end
return e
"""


# Give the lease up only if it is still ours (stopping while leading).
RELEASE_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""
HANDOFF_WAIT_S = 1.0  # stopping: how long the leader waits for a standby to take the lease it gave up


class Leadership:
    def __init__(self, state: RouterState, intake: "Intake") -> None:
        self.s = state
        self.intake = intake
        self.handing_off = False  # stopping: the lease was given up (hand_off); never renewed or taken again

    def lease_key(self, pool: str | None = None) -> str:
        """The scheduling lease of `pool` (None: ours; "": the cluster's one leader's)."""
        pool = self.s.pool if pool is None else pool
        return f"flexlb:{self.s.settings.cluster}:leader" + (f":pool:{pool_token(pool)}" if pool else "")

    def epoch_key(self) -> str:
        return f"flexlb:{self.s.settings.cluster}:epoch"

    async def fence_loop(self) -> None:
        """A worker accepted a newer leader's epoch (its status says so): we are fenced,
        whatever Redis, maybe unreachable from here, would say. Step down at once, not when a
        lease cycle (blocked on that Redis) learns it."""
        while self.s.running:
            await self.s.fenced.wait()
            self.s.fenced.clear()
            if self.s.is_leader and self.s.fenced_by_epoch > self.s.epoch:
                await self.step_down(f"fenced: a worker of ours accepted epoch {self.s.fenced_by_epoch} > ours {self.s.epoch}")

    async def lease_loop(self) -> None:
        while self.s.running:
            await asyncio.sleep(LEASE_RENEW_S)
            try:
                await self.lease_cycle()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis away: a leader keeps its lease until it expires
                await self.lease_unrenewed(exc)

    async def lease_cycle(self) -> None:
        """Hold or take the scheduling lease (Redis, PX TTL). Taking it bumps the fencing epoch,
        announced to every worker, so the previous leader's commands are refused."""
        if self.handing_off:
            return
        key = self.lease_key()
        ttl_ms = int(LEASE_TTL_S * 1000)
        sent = time.monotonic()
        if self.s.is_leader:
            renewed = int(await self.s.redis.eval(RENEW_LUA, 2, key, self.epoch_key(), self.s.lease_value, ttl_ms,
                                                  self.s.epoch))
            if not renewed:
                await self.step_down("lease lost")
                return
            self.s.lease_valid_until = sent + LEASE_TTL_S
            self.note_dispatch_paused(False)
            if renewed == 2:
                log.warning("router %s took the lease again (it was gone: Redis restarted or failed over); epoch %d kept",
                            self.s.router_id, self.s.epoch)
            if self.s.pool:
                await self.check_other_pools()
            return
        if await self.s.redis.eval(ACQUIRE_LUA, 1, key, self.s.lease_value, ttl_ms, f"{self.s.router_id}:"):
            self.s.lease_valid_until = sent + LEASE_TTL_S
            floor = max(self.s.epoch, self.s.max_worker_epoch)
            self.s.epoch = int(await self.s.redis.eval(EPOCH_LUA, 1, self.epoch_key(), floor))
            self.s.is_leader = True
            self.s.submit_sub = await self.s.nc.subscribe(submit_subject(self.s.settings.cluster, self.s.pool),
                                                          cb=self.intake.on_submit)
            self.s.metrics.leader.set(1)
            log.warning("router %s is the leader (epoch %d)", self.s.router_id, self.s.epoch)
            await self.announce_epoch()
            await self.fail_stranded_forwards(self.s.router_id, self.s.pool)
            await self.check_other_pools()
            return
        holder = await self.s.redis.get(key)
        if holder:
            await self.fail_stranded_forwards((holder.decode() if isinstance(holder, bytes) else holder).split(":")[0],
                                              self.s.pool)
        await self.check_other_pools()

    async def check_other_pools(self) -> None:
        """Requests we forwarded to other pools' leaders: fail those stranded at one that is gone."""
        pools = {h.leader_pool for h in self.s.handles.values() if h.leader_id and h.leader_pool != self.s.pool}
        for pool in sorted(pools):
            holder = await self.s.redis.get(self.lease_key(pool))
            if holder:
                await self.fail_stranded_forwards((holder.decode() if isinstance(holder, bytes) else holder).split(":")[0],
                                                  pool)

    async def lease_unrenewed(self, exc: Exception) -> None:
        """A lease cycle failed (Redis unreachable). Past the lease's TTL the leader stops
        dispatching (a standby may hold it by now); it stays leader, holding its queue, until
        Redis answers and says whose the lease is, or PAUSE_STEP_DOWN_S more have passed:
        then it steps down, and what it queued fails retryable instead of waiting on."""
        self.s.metrics.consumer_errors.labels("lease").inc()
        log.warning("lease cycle failed: %s", exc)
        if self.s.is_leader and time.monotonic() >= self.s.lease_valid_until:
            self.note_dispatch_paused(True)
            if time.monotonic() >= self.s.lease_valid_until + PAUSE_STEP_DOWN_S:
                await self.step_down(f"Redis unreachable for over {LEASE_TTL_S + PAUSE_STEP_DOWN_S:.0f} s")

    def note_dispatch_paused(self, paused: bool) -> None:
        if paused and not self.s.dispatch_paused:
            log.error("router %s: lease not renewed for %.1f s (Redis unreachable): dispatch paused until it is",
                      self.s.router_id, LEASE_TTL_S)
        elif not paused and self.s.dispatch_paused:
            log.warning("router %s: lease renewed: dispatching again", self.s.router_id)
            self.s.wakeup.set()
        self.s.dispatch_paused = paused
        self.s.metrics.dispatch_paused.set(1 if paused else 0)

    async def fail_stranded_forwards(self, leader_id: str, pool: str) -> None:
        """Standby: requests we forwarded to a leader that is gone, and that it never
        dispatched, were queued in its memory only: nothing will ever answer them. Fail them
        now (retryable) instead of at their deadline. One it dispatched is running on a worker
        that streams to us directly and is left alone. (A lost batch.dispatched event makes
        us fail a request that is running: the client retries; its tokens are dropped.)"""
        for handle in list(self.s.handles.values()):
            if (handle.leader_id and handle.leader_pool == pool and handle.leader_id != leader_id and not handle.remote
                    and not handle.done
                    and not handle.dispatched and handle.next_index == 0):
                self.s.metrics.requests.labels("failed", "not_ready").inc()
                self.s.records.note(handle.request_id, time.time_ns(), "failed_by_router", code="not_ready",
                                  message=f"leader {handle.leader_id} gone before dispatching it")
                self.s.finish_router(handle, "failed", "not_ready",
                                    f"leader router {handle.leader_id} is gone and had not dispatched it; retry")

    async def hand_off(self) -> None:
        """Stopping while leading (SIGTERM): give the lease up now, so a standby takes it at its
        next cycle (within LEASE_RENEW_S) instead of after the TTL; when we hold queued work,
        wait up to HANDOFF_WAIT_S for it, then step down, handing that work to it. Without Redis the standby waits
        out the TTL, as after a crash."""
        self.handing_off = True  # the lease loop must not take it back (its renewal would: "nobody holds it")
        try:
            released = int(await asyncio.wait_for(
                self.s.redis.eval(RELEASE_LUA, 1, self.lease_key(), self.s.lease_value), 1.0))
        except Exception as exc:  # Redis away: the TTL does it
            log.warning("router %s: could not give the lease up at stop (%s); a standby takes it after its TTL",
                        self.s.router_id, exc.__class__.__name__)
            released = 0
        queued = sum(len(b) for b in self.s.scheduler.batchers.values()) + len(self.s.scheduler.fair.waiting)
        if released and queued:  # (nothing to hand over: no need to see the standby take it)
            deadline = time.monotonic() + HANDOFF_WAIT_S
            while time.monotonic() < deadline:
                holder = await self.s.redis.get(self.lease_key())
                if holder and (holder.decode() if isinstance(holder, bytes) else holder) != self.s.lease_value:
                    log.warning("router %s stopping: %s took the lease", self.s.router_id,
                                (holder.decode() if isinstance(holder, bytes) else holder).split(":")[0])
                    break
                await asyncio.sleep(0.05)
        await self.step_down("stopping (SIGTERM): leadership handed over" if released else "stopping (SIGTERM)")

    async def step_down(self, why: str) -> None:
        log.error("router %s steps down: %s", self.s.router_id, why)
        self.s.is_leader = False
        self.note_dispatch_paused(False)
        self.s.metrics.leader.set(0)
        if self.s.submit_sub is not None:
            await self.s.submit_sub.unsubscribe()
            self.s.submit_sub = None
        # Not dispatched: our own clients' requests go to the new leader (if one answers); the
        # rest fail retryable (a forwarder fails its own when it sees the lease change hands).
        items = self.s.scheduler.drain_queues()
        why_not = await asyncio.gather(*(self.intake.hand_over(item.payload) for item in items))
        for item, why in zip(items, why_not):
            if why is None:
                continue
            self.s.finish_router(item.payload, "failed", "not_ready", f"router {self.s.router_id} lost the leadership; {why}")
            await self.s.emit(m.RequestFailed(request_id=item.request_id, worker_id=self.s.router_id, code="not_ready",
                                             message=f"router lost the leadership before dispatch; {why}", retryable=True))
        if items:
            log.warning("router %s handed %d queued requests to the new leader, failed %d", self.s.router_id,
                        sum(w is None for w in why_not), sum(w is not None for w in why_not))
        # The same for what waited in our fair queue (a standby's requests fail: it forwards them again).
        waiting = self.intake.take_waiting()
        why_not = await asyncio.gather(*(self.intake.hand_over(h) for h in waiting))
        for handle, why in zip(waiting, why_not):
            if why is None:
                continue
            self.s.finish_router(handle, "failed", "not_ready", f"router {self.s.router_id} lost the leadership; {why}")
            await self.s.emit(m.RequestFailed(request_id=handle.request_id, worker_id=self.s.router_id, code="not_ready",
                                             message=f"router lost the leadership before admitting it; {why}",
                                             retryable=True))

    async def announce_epoch(self) -> None:
        """Tell every worker we schedule for our epoch (each cycle: new workers learn it too)."""
        now = time.time_ns()
        for w in self.s.scheduler.view.live():
            cmd = m.FenceEpoch(worker_id=w.worker_id, router_id=self.s.router_id, epoch=self.s.epoch)
            await self.s.nc.publish(epoch_subject(w.worker_id), m.encode(self.s.envelopes.wrap(cmd, now)))

    async def on_bus_state(self, state: str) -> None:
        self.s.bus_state = state
        if state == "reconnected":
            # Heartbeats we missed while we were cut off are our fault, not the workers':
            # give them a full detection window to be heard again before counting misses.
            self.s.liveness_grace_cycles = self.s.settings.dead_after_missed_syncs + 1

