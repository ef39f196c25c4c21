"""The inflight ledger in Redis: reservations per worker, atomic and idempotent (Lua).

Layout (prefix `flexlb:<cluster>:`):
- `ledger:<worker>` — hash, field -> JSON entry. Fields: `pf:<batch_id>` (a prefill batch
  reserved on its prefill worker) and `kv:<request_id>` (a request's KV on its decode worker).
- `ledger-index` — hash, field -> ledger key, so a release needs only the field: a release
  driven by an event does not need the router's memory (which a restart loses).
- `ledger-expiry` — sorted set of `<ledger key>|<field>` by expiry time (ms), for the TTL
  sweep of issue 5.

`reserve` adds entries with HSETNX (a replayed reserve changes nothing); `release` removes
one field and returns whether it was there (a second release is a no-op that returns 0).
Single-instance Redis is assumed (the scripts touch several keys).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

RESERVE_LUA = """
-- KEYS[1] expiry zset, KEYS[2] index hash, KEYS[3..] ledger keys
-- ARGV[1] expires_at_ms, then (key_offset, field, value) triples; key_offset indexes KEYS
local added = 0
for i = 2, #ARGV, 3 do
  local key = KEYS[tonumber(ARGV[i])]
  local field = ARGV[i + 1]
  if redis.call('HSETNX', key, field, ARGV[i + 2]) == 1 then
    redis.call('HSET', KEYS[2], field, key)
    redis.call('ZADD', KEYS[1], ARGV[1], key .. '|' .. field)
    added = added + 1
  end
end
return added
"""

RELEASE_LUA = """
-- KEYS[1] expiry zset, KEYS[2] index hash; ARGV = fields to release
local removed = 0
for i = 1, #ARGV do
  local key = redis.call('HGET', KEYS[2], ARGV[i])
  if key then
    removed = removed + redis.call('HDEL', key, ARGV[i])
    redis.call('HDEL', KEYS[2], ARGV[i])
    redis.call('ZREM', KEYS[1], key .. '|' .. ARGV[i])
  end
end
return removed
"""


EVICT_LUA = """
-- KEYS[1] expiry zset, KEYS[2] index hash; ARGV[1] = now_ms, ARGV[2] = max entries
-- Removes entries whose TTL passed; returns the evicted "key|field" members.
local members = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[2]))
for _, member in ipairs(members) do
  local sep = string.find(member, '|', 1, true)
  if sep then
    local key = string.sub(member, 1, sep - 1)
    local field = string.sub(member, sep + 1)
    redis.call('HDEL', key, field)
    redis.call('HDEL', KEYS[2], field)
  end
  redis.call('ZREM', KEYS[1], member)
end
return members
"""


@dataclass(frozen=True)
class LedgerEntry:
    worker_id: str
    field: str  # pf:<batch_id> | kv:<request_id>
    value: dict[str, Any]


def prefill_field(batch_id: str) -> str:
    return f"pf:{batch_id}"


def kv_field(request_id: str) -> str:
    return f"kv:{request_id}"


class Ledger:
    def __init__(self, redis, cluster: str, ttl_s: int) -> None:
        self.redis = redis
        self.prefix = f"flexlb:{cluster}:"
        self.ttl_ms = ttl_s * 1000
        self.expiry_key = self.prefix + "ledger-expiry"
        self.index_key = self.prefix + "ledger-index"
        self._reserve = redis.register_script(RESERVE_LUA)
        self._release = redis.register_script(RELEASE_LUA)
        self._evict = redis.register_script(EVICT_LUA)

    def key(self, worker_id: str) -> str:
        return f"{self.prefix}ledger:{worker_id}"

    async def reserve(self, entries: list[LedgerEntry], now_ms: int) -> int:
        keys = [self.expiry_key, self.index_key]
        argv: list[Any] = [now_ms + self.ttl_ms]
        for e in entries:
            k = self.key(e.worker_id)
            if k not in keys:
                keys.append(k)
            argv += [keys.index(k) + 1, e.field, json.dumps(e.value, separators=(",", ":"))]
        return int(await self._reserve(keys=keys, args=argv))

    async def release(self, fields: list[str]) -> int:
        if not fields:
            return 0
        return int(await self._release(keys=[self.expiry_key, self.index_key], args=fields))

    async def evict_expired(self, now_ms: int, max_entries: int = 1000) -> list[tuple[str, str]]:
        """Evict entries past their TTL (nobody confirmed them); returns (worker, field) pairs.
        One script call per chunk; a malformed member is removed without stopping the rest."""
        members = await self._evict(keys=[self.expiry_key, self.index_key], args=[now_ms, max_entries])
        out = []
        for member in members:
            text = member.decode() if isinstance(member, bytes) else member
            key, _, field = text.partition("|")
            out.append((key[len(self.prefix + "ledger:"):], field))
        return out

    async def clear(self) -> int:
        """Delete every ledger key of this cluster (before a rebuild from the router's mirror)."""
        keys = [k async for k in self.redis.scan_iter(match=self.prefix + "ledger:*", count=500)]
        keys += [self.expiry_key, self.index_key]
        return int(await self.redis.delete(*keys))

    async def entries(self) -> list[dict[str, Any]]:
        """Every inflight entry, for the admin API (SCAN: never blocks Redis)."""
        out: list[dict[str, Any]] = []
        async for key in self.redis.scan_iter(match=self.prefix + "ledger:*", count=500):
            k = key.decode() if isinstance(key, bytes) else key
            worker = k[len(self.prefix + "ledger:"):]
            for field, value in (await self.redis.hgetall(k)).items():
                f = field.decode() if isinstance(field, bytes) else field
                out.append({"worker_id": worker, "field": f, **json.loads(value)})
        return out
