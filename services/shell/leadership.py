"""Leadership: one scheduler per cluster, or one per pool.

With `scheduling_pool` set, each router leads one pool (a model's workers): the lease, the
submit subject and the Redis ledger are the pool's, so the leaders of different pools run in
different processes and the fleet's scheduling grows with its pools; a router's core holds
its own pool's workers only (fold.py keeps the others out), and it forwards a request for
another pool to that pool's leader (intake.py). The fencing epoch stays one counter for the
cluster: every lease taken, of any pool, gets a number above all before, and each worker
only ever hears its own pool's leaders.

Owns: the Redis lease (PX TTL, renewed every LEASE_RENEW_S), the fencing epoch it bumps when
it takes the lease and announces to every worker, stepping down (what it queued is handed
over, or fails retryable), failing a standby's forwards stranded at a leader that is gone,
and the bus connection state (a reconnect grants workers a liveness grace). Calls: Redis,
the bus, intake (it subscribes intake.on_submit while leader). Called by: the service, liveness.

A planned stop (SIGTERM: hand_off) loses no request that was not dispatched, a standby's
client's included:
1. The leader stops dispatching (RouterState.handing_off) and taking forwards: it drains its
   submit subscription (what reached it is admitted, to be handed over); a standby's next
   forwards find no leader and are asked again until one answers (RouterState.ask_leader),
   or admitted by that standby if it takes the lease meanwhile.
2. It gives the lease up, leaving in the same script a hand-off mark (handoff_key: its router
   id, for HANDOFF_GRACE_S). A router that sees a forward's leader gone while that leader's
   mark lives does not fail it as stranded: that leader hands it over or fails it itself.
   Without a mark (a crash, a lost lease) they fail at once, as ever. A router taking a
   handed-off lease announces its epoch HANDOFF_FENCE_DELAY_S later (why: at the constant).
3. With work queued, it waits up to HANDOFF_WAIT_S for a standby to take the lease, then
   steps down: every request it admitted and had not dispatched (batchers, fair queue) goes
   to the new leader as a SubmitRequest in its owner's name: our client's with our router id
   and token subject, a standby's with that standby's (handle.forwarded_by), with the
   remaining deadline and the tenant, class, priority, SLOs, model and sampling it came with.
   The new leader's workers stream to the owner: its client's stream goes on.
4. The owner learns where it went from the new leader's SubmitReply, which the old leader
   relays on its router events (an existing message: old readers decode it), or from the
   new leader's request.admitted, whichever comes first; from then on the old leader's word
   on it no longer counts (intake.on_router_event_msg). An owner that is the new leader
   takes it back into its client's handle (intake.on_submit). What the new leader refuses,
   or no leader answers within the stop's budget, fails retryable (request.failed).
No request runs twice: only the old leader, having taken it out of its queues, sends it on,
once; a leader admits an id once (duplicate_request); the owner ignores the old leader once
the new one has it. One an owner still believes at the old leader when the mark expires (a
lost relay, a stop past its budget) fails retryable then.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

import msgspec

from schemas import messages as m
from schemas.subjects import epoch_subject, pool_token, submit_subject, token_subject
from services.shell.handle import RequestHandle
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


# Give the lease up if it is still ours (stopping while leading), leaving the hand-off mark (KEYS[2]).
RELEASE_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
  return redis.call('DEL', KEYS[1])
end
return 0
"""
HANDOFF_WAIT_S = 1.0  # stopping: how long the leader waits for a standby to take the lease it gave up
# The hand-off mark lives this long: past the stop's budget (router.HANDOFF_BUDGET_S), by when
# the old leader has handed over or failed all it held, plus a margin for its events to arrive.
HANDOFF_GRACE_S = 3.0
SUBMIT_DRAIN_S = 0.3  # stopping: at most this long to admit the forwards already delivered to us
HAND_OVER_NO_LEADER_WAIT_S = 0.5  # the lease's new holder may not have subscribed yet: asked again this long
# Taking a handed-off lease (its mark lives): announce our epoch this much later. What the old leader
# dispatched before giving it up may still sit in a worker's command fetch (its 1 s timeout, workers/
# agent.py), refused if fenced now; our own batches, behind those in each worker's stream, fence in-band.
HANDOFF_FENCE_DELAY_S = 1.5


def _text(value: bytes | str | None) -> str:
    return (value.decode() if isinstance(value, bytes) else value) or ""


def waits_at_a_leader(handle: RequestHandle, pool: str) -> bool:
    """A request of ours we forwarded to `pool`'s leader, which has not dispatched it (as far as we heard)."""
    return (bool(handle.leader_id) and handle.leader_pool == pool and handle.is_forward and not handle.done
            and not handle.dispatched and handle.next_index == 0)


class Leadership:
    def __init__(self, state: RouterState, intake: "Intake") -> None:
        self.s = state
        self.intake = intake
        self.deferred_stranded = False  # leader: forwards of ours the old leader is still handing over (hand_off)
        self.fence_after = 0.0  # time.monotonic() before which we do not announce our epoch (HANDOFF_FENCE_DELAY_S)
        self.lease_value = f"{state.router_id}:{state.boot_id}"  # what the lease key holds while it is ours
        self.submit_sub = None  # leader: the subscription to forwarded requests
        self.dispatch_paused = False  # leader whose lease outran its renewal: dispatching nothing

    def lease_key(self, pool: str | None = None) -> str:
        """The scheduling lease of `pool` (None: ours; "": the cluster's one leader's)."""
        pool = self.s.pool if pool is None else pool
        return f"flexlb:{self.s.settings.cluster}:leader" + (f":pool:{pool_token(pool)}" if pool else "")

    def handoff_key(self, pool: str | None = None) -> str:
        """The hand-off mark of `pool`'s lease: the router id of its leader that gave it up at a stop."""
        return self.lease_key(pool) + ":handoff"

    def epoch_key(self) -> str:
        return f"flexlb:{self.s.settings.cluster}:epoch"

    async def fence_loop(self) -> None:
        """A worker accepted a newer leader's epoch (its status says so): we are fenced,
        whatever Redis, maybe unreachable from here, would say. Step down at once, not when a
        lease cycle (blocked on that Redis) learns it."""
        while self.s.running:
            await self.s.fenced.wait()
            self.s.fenced.clear()
            if self.s.is_leader and self.s.fenced_by_epoch > self.s.epoch and not self.s.handing_off:  # (hand_off steps down)
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
        if self.s.handing_off:
            return
        key = self.lease_key()
        ttl_ms = int(LEASE_TTL_S * 1000)
        sent = time.monotonic()
        if self.s.is_leader:
            renewed = int(await self.s.redis.eval(RENEW_LUA, 2, key, self.epoch_key(), self.lease_value, ttl_ms,
                                                  self.s.epoch))
            if not renewed:
                await self.step_down("lease lost")
                return
            self.s.lease_valid_until = sent + LEASE_TTL_S
            self.note_dispatch_paused(False)
            if renewed == 2:
                log.warning("router %s took the lease again (it was gone: Redis restarted or failed over); epoch %d kept",
                            self.s.router_id, self.s.epoch)
            if self.deferred_stranded:
                await self.fail_stranded_forwards(self.s.pool)
            if self.s.pool:
                await self.check_other_pools()
            return
        if await self.s.redis.eval(ACQUIRE_LUA, 1, key, self.lease_value, ttl_ms, f"{self.s.router_id}:"):
            self.s.lease_valid_until = sent + LEASE_TTL_S
            floor = max(self.s.epoch, self.s.max_worker_epoch)
            self.s.epoch = int(await self.s.redis.eval(EPOCH_LUA, 1, self.epoch_key(), floor))
            self.s.is_leader = True
            self.submit_sub = await self.s.nc.subscribe(submit_subject(self.s.settings.cluster, self.s.pool),
                                                          cb=self.intake.on_submit)
            self.s.metrics.leader.set(1)
            log.warning("router %s is the leader (epoch %d)", self.s.router_id, self.s.epoch)
            if handed_off_by := _text(await self.s.redis.get(self.handoff_key())):
                self.fence_after = time.monotonic() + HANDOFF_FENCE_DELAY_S
                log.warning("router %s: %s handed the lease off; epoch %d announced in %.1f s", self.s.router_id,
                            handed_off_by, self.s.epoch, HANDOFF_FENCE_DELAY_S)
            await self.announce_epoch()
            await self.fail_stranded_forwards(self.s.pool)
            await self.check_other_pools()
            return
        await self.fail_stranded_forwards(self.s.pool)
        await self.check_other_pools()

    async def check_other_pools(self) -> None:
        """Requests we forwarded to other pools' leaders: fail those stranded at one that is gone."""
        pools = {h.leader_pool for h in self.s.handles.values() if h.leader_id and h.leader_pool != self.s.pool}
        for pool in sorted(pools):
            await self.fail_stranded_forwards(pool)

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
        if paused and not self.dispatch_paused:
            log.error("router %s: lease not renewed for %.1f s (Redis unreachable): dispatch paused until it is",
                      self.s.router_id, LEASE_TTL_S)
        elif not paused and self.dispatch_paused:
            log.warning("router %s: lease renewed: dispatching again", self.s.router_id)
            self.s.wakeup.set()
        self.dispatch_paused = paused
        self.s.metrics.dispatch_paused.set(1 if paused else 0)

    async def fail_stranded_forwards(self, pool: str) -> None:
        """Requests we forwarded to a leader of `pool` that is gone (another holds its lease),
        and that it never dispatched, were queued in its memory only: nothing will ever answer
        them. Fail them now (retryable) instead of at their deadline, unless that leader gave
        the lease up at a stop less than HANDOFF_GRACE_S ago (its hand-off mark): it hands them
        over or fails them itself (module docstring). One it dispatched is running on a worker
        that streams to us directly and is left alone. (A lost batch.dispatched event makes us
        fail a request that is running: the client retries; its tokens are dropped.)"""
        if pool == self.s.pool:
            self.deferred_stranded = False
        if not any(waits_at_a_leader(h, pool) for h in self.s.handles.values()):
            return
        holder, handing_off = map(_text, await self.s.redis.mget(self.lease_key(pool), self.handoff_key(pool)))
        leader_id = holder.split(":")[0]
        if not leader_id:  # nobody holds it now: asked again at the next cycle
            return
        # (Judged on the handles as they are after the read: one handed over meanwhile has its new leader.)
        for handle in [h for h in self.s.handles.values() if waits_at_a_leader(h, pool) and h.leader_id != leader_id]:
            if handle.leader_id == handing_off:
                self.deferred_stranded = self.deferred_stranded or pool == self.s.pool
                continue
            self.s.metrics.requests.labels("failed", "not_ready").inc()
            self.s.records.note(handle.request_id, time.time_ns(), "failed_by_router", code="not_ready",
                                message=f"leader {handle.leader_id} gone before dispatching it")
            self.s.finish_router(handle, "failed", "not_ready",
                                 f"leader router {handle.leader_id} is gone and had not dispatched it; retry")

    async def hand_off(self) -> None:
        """Stopping while leading (SIGTERM): stop taking forwards, give the lease up (leaving the
        hand-off mark), so a standby takes it at its next cycle (within LEASE_RENEW_S) instead of
        after the TTL; when we hold queued work, wait up to HANDOFF_WAIT_S for it, then step
        down, handing that work to it (module docstring). Without Redis the standby waits out
        the TTL, as after a crash. The caller bounds it (router.HANDOFF_BUDGET_S)."""
        self.s.handing_off = True  # the lease loop must not take it back (its renewal would: "nobody holds it")
        await self.stop_taking_submits()
        try:
            released = int(await asyncio.wait_for(self.s.redis.eval(
                RELEASE_LUA, 2, self.lease_key(), self.handoff_key(), self.lease_value, self.s.router_id,
                int(HANDOFF_GRACE_S * 1000)), 1.0))
        except Exception as exc:  # Redis away: the TTL does it
            log.warning("router %s: could not give the lease up at stop (%s); a standby takes it after its TTL",
                        self.s.router_id, exc.__class__.__name__)
            released = 0
        queued = sum(len(b) for b in self.s.scheduler.batchers.values()) + len(self.s.scheduler.fair.waiting)
        successor, deadline = "", time.monotonic() + HANDOFF_WAIT_S
        if released and queued:  # (nothing to hand over: no need to see the standby take it)
            while time.monotonic() < deadline and not successor:
                holder = _text(await self.s.redis.get(self.lease_key()))
                successor = holder.split(":")[0] if holder and holder != self.lease_value else ""
                if not successor:
                    await asyncio.sleep(0.05)
            log.warning("router %s stopping: %s", self.s.router_id,
                        f"{successor} took the lease" if successor else f"no router took the lease in {HANDOFF_WAIT_S} s")
        await self.step_down("stopping (SIGTERM): leadership handed over" if released else "stopping (SIGTERM)",
                             HAND_OVER_NO_LEADER_WAIT_S if successor else 0.0, standbys_too=bool(released))

    async def stop_taking_submits(self) -> None:
        """Stopping: no more forwards to us. Those already delivered are admitted (and handed
        over with the rest); a standby's next ones find no leader until the next one subscribes."""
        sub, self.submit_sub = self.submit_sub, None
        if sub is None:
            return
        try:
            await asyncio.wait_for(sub.drain(), SUBMIT_DRAIN_S)
        except Exception as exc:  # (a forward left undrained times out at its standby: it fails retryable there)
            log.warning("router %s: draining the submit subscription at stop failed (%s)", self.s.router_id,
                        exc.__class__.__name__)

    async def step_down(self, why: str, no_leader_wait_s: float = 0.0, standbys_too: bool = False) -> None:
        """Stop leading. What we admitted and had not dispatched goes to the new leader
        (hand_over; asked again for up to `no_leader_wait_s` while it does not answer yet), a
        standby's only if `standbys_too` (our hand-off mark is set: else that standby fails it
        as stranded); what is not taken fails retryable (request.failed tells its standby)."""
        log.error("router %s steps down: %s", self.s.router_id, why)
        self.s.is_leader = False
        self.note_dispatch_paused(False)
        self.s.metrics.leader.set(0)
        if self.submit_sub is not None:
            await self.submit_sub.unsubscribe()
            self.submit_sub = None
        admitted = [item.payload for item in self.s.scheduler.drain_queues()]
        handles = admitted + self.intake.take_waiting()
        why_not = await asyncio.gather(*(self.hand_over(h, no_leader_wait_s, standbys_too) for h in handles))
        for handle, why in zip(handles, why_not):
            if why is None:
                continue
            self.s.finish_router(handle, "failed", "not_ready", f"router {self.s.router_id} lost the leadership; {why}")
            await self.s.emit(m.RequestFailed(request_id=handle.request_id, worker_id=self.s.router_id, code="not_ready",
                                             message=f"router lost the leadership before dispatching it; {why}",
                                             retryable=True))
        if handles:
            log.warning("router %s handed %d undispatched requests to the new leader (%d a standby's, %d from its fair "
                        "queue), failed %d", self.s.router_id, why_not.count(None),
                        sum(w is None and h.remote for h, w in zip(handles, why_not)),
                        why_not[len(admitted):].count(None), len(handles) - why_not.count(None))

    async def hand_over(self, handle: RequestHandle, no_leader_wait_s: float, standbys_too: bool) -> str | None:
        """We stopped leading with `handle` admitted and not dispatched: send it to the new leader
        in its owner's name (module docstring, 3 and 4). None if that leader took it, else why not."""
        rid, adm = handle.request_id, handle.admit
        remaining_s = handle.timeout_s - (time.time_ns() - handle.arrival_ns) / 1e9
        if handle.remote and not standbys_too:
            return "a standby's, and no hand-off mark (that standby fails it as stranded)"
        if adm is None or remaining_s <= 0:
            return "past its deadline"
        cmd = m.SubmitRequest.of(msgspec.structs.replace(handle.request, timeout_s=remaining_s),
                                 handle.forwarded_by if handle.remote else self.s.router_id,
                                 handle.token_subject or token_subject(self.s.router_id, rid))
        try:
            reply = await self.s.ask_leader(cmd, self.s.pool, no_leader_wait_s)
        except Exception as exc:  # no leader (yet): the caller fails it retryable
            return f"no leader router answered ({exc.__class__.__name__})"
        if reply is None or not reply.admitted:
            return f"the leader refused it: {reply.code}: {reply.message}" if reply else "we lead again"
        self.s.records.note(rid, time.time_ns(), "handed_over", leader=reply.router_id, queued=reply.code == "queued",
                            owner=cmd.router_id)
        self.s.metrics.forwarded.inc()
        if handle.remote:  # its standby's client: that router follows it to the new leader
            self.s.forget(handle)
            await self.s.emit(reply)
        else:  # our client's: its tokens come to us, its stream goes on
            handle.handed_over(self.s.pool)  # (waits_at_a_leader until its batch.dispatched)
            handle.taken(reply)
        return None

    async def announce_epoch(self) -> None:
        """Tell every worker we schedule for our epoch (each cycle: new workers learn it too),
        once HANDOFF_FENCE_DELAY_S has passed after a handed-off lease was taken."""
        if time.monotonic() < self.fence_after:
            return
        now = time.time_ns()
        for w in self.s.scheduler.view.live():
            cmd = m.FenceEpoch(worker_id=w.worker_id, router_id=self.s.router_id, epoch=self.s.epoch)
            await self.s.nc.publish(epoch_subject(w.worker_id), m.encode(self.s.envelopes.wrap(cmd, now)))


