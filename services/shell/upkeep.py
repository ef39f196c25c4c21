"""Upkeep: the Redis ledger kept equal to the core's in-memory mirror.

Owns: which ledger fields a finished request frees, releases, the TTL sweep of entries nobody
confirmed, and Redis outages: a failed write marks the ledger dirty, and when Redis answers
again (or restarted, its run id changed) it is rebuilt from the mirror. Calls: Redis, the
bus (eviction events). Called by: fold, dispatch, recovery, the service.
"""

from __future__ import annotations

import asyncio
import logging
import time

from schemas import messages as m
from services.shell.ledger import LedgerEntry, kv_field, prefill_field
from services.shell.state import RouterState

log = logging.getLogger("flexlb.router")


class Upkeep:
    def __init__(self, state: RouterState) -> None:
        self.s = state
        self.redis_run_id: str | None = None  # the Redis server's run id when we last saw it (a restart changes it)

    def fields_to_release(self, request_id: str) -> list[str]:
        """The request's ledger fields: its KV reservation, and its batch's prefill entry once
        every member of that batch has ended."""
        fields = [kv_field(request_id)]
        batch_id = self.s.batches.member_ended(request_id)
        if batch_id is not None:
            fields.append(prefill_field(batch_id))
        return fields

    async def release_request(self, request_id: str) -> None:
        await self.release_fields(self.fields_to_release(request_id))

    async def release_fields(self, fields: list[str]) -> None:
        if self.s.ledger_dirty:
            return  # Redis known away: the rebuild from the mirror leaves these out
        try:
            await self.s.ledger.release(fields)
        except Exception as exc:  # Redis away: the TTL sweep evicts them
            log.error("ledger release of %s failed: %s", fields, exc)

    async def sweep_loop(self) -> None:
        """Evict ledger entries nobody confirmed within `ledger_ttl_s` (a lost terminal event,
        a router that died mid-dispatch): an event and a metric each; a failing sweep is
        logged and retried next time, it never stops the loop."""
        while self.s.running:
            await asyncio.sleep(self.s.settings.ledger_sweep_s)
            try:
                while True:
                    evicted = await self.s.ledger.evict_expired(time.time_ns() // 1_000_000)
                    for worker_id, fld in evicted:
                        self.s.metrics.ledger_evictions.inc()
                        await self.s.emit(m.LedgerEntryEvicted(worker_id=worker_id, router_id=self.s.router_id, field=fld,
                                                              ttl_s=float(self.s.settings.ledger_ttl_s)))
                    if len(evicted) < 1000:
                        break
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis away: the next sweep retries
                self.s.metrics.consumer_errors.labels("ledger_sweep").inc()
                log.warning("ledger TTL sweep failed: %s", exc)

    def ledger_failed(self, op: str, exc: Exception) -> None:
        self.s.metrics.consumer_errors.labels("ledger").inc()
        if not self.s.ledger_dirty:
            log.error("ledger %s failed (%s); scheduling from memory until Redis answers", op, exc)
        self.s.ledger_dirty = True

    async def check_ledger_store(self) -> None:
        """Detect a Redis restart (its run id changes: these servers keep nothing on disk) or
        the end of an outage, and rebuild the Redis ledger from the in-memory mirror."""
        try:
            run_id = (await self.s.redis.info("server")).get("run_id")
        except Exception as exc:  # still away
            self.ledger_failed("probe", exc)
            return
        if self.redis_run_id is not None and run_id != self.redis_run_id:
            log.warning("redis restarted (run id changed): rebuilding the ledger")
            self.s.ledger_dirty = True
        self.redis_run_id = run_id
        if self.s.ledger_dirty:
            await self.resync_ledger()

    async def resync_ledger(self) -> None:
        now_ms = time.time_ns() // 1_000_000
        entries: list[LedgerEntry] = []
        for worker_id, w in self.s.scheduler.ledger.workers.items():
            for b in w.batches.values():
                entries.append(LedgerEntry(worker_id, prefill_field(b.batch_id), {
                    "kind": "prefill", "batch_id": b.batch_id, "request_ids": b.request_ids,
                    "num_prompt_tokens": sum(n for n, _ in b.members), "created_ms": b.dispatched_ns // 1_000_000,
                    "resynced": True,
                }))
            for r in w.reservations.values():
                entries.append(LedgerEntry(worker_id, kv_field(r.request_id), {
                    "kind": "decode", "request_id": r.request_id, "hard_kv_tokens": r.hard_kv_tokens,
                    "expected_kv_tokens": r.expected_kv_tokens, "created_ms": r.created_ns // 1_000_000, "resynced": True,
                }))
        try:
            await self.s.ledger.clear()
            if entries:
                await self.s.ledger.reserve(entries, now_ms)
        except Exception as exc:
            self.ledger_failed("resync", exc)
            return
        self.s.ledger_dirty = False
        self.s.metrics.ledger_resyncs.inc()
        log.info("ledger rebuilt in redis from memory: %d entries", len(entries))

