"""Prefix index: which worker holds which KV block, and how many leading blocks of a prompt it can reuse.

A prompt is cut into blocks whose hashes chain (`schemas.tokens.block_hashes`): block i's hash
depends on every token before it, so a worker can reuse the first k blocks of a prompt exactly
when it holds the prompt's first k hashes. The match of a worker is therefore the number of
LEADING hashes it holds; a worker holding blocks 0, 1 and 3 matches 2.

`cached_tokens(matched, block_size, prompt)` turns a match into FlexLB's predicted hit: matched ×
block size, and a hit reaching the whole prompt is cut to prompt − block size, because the
engine always computes the last block itself (it needs the last position's logits). Never
negative.

Two indexes, one query shape — `match(block_hashes) -> {worker id: leading blocks}`, holding only
workers with at least one leading block:

`PrefixIndex` (exact) folds the workers' KV events (`KvBlocksStored`, `KvBlocksRemoved`,
`KvAllCleared`, `KvSnapshot`). `apply(event) -> IndexUpdate` says what happened:
"applied", "stale" (ignored: an old sequence number or an old boot) or "needs_resync" (the
caller should send `RequestKvSnapshot`). Per worker it keeps the current `boot_id`, the highest
`kv_seq` seen from that boot, an awaiting-resync flag and the worker's set of block hashes.
Rules, per event of worker w:
- First event ever seen from w: a snapshot, or `kv_seq` 1, is applied; anything else means we
  joined late (a router restart, a consumer started mid-stream): needs_resync.
- A `boot_id` never seen for w is a restart: w's blocks are dropped, the old boot is retired,
  and the event is treated like a first event. An event of a retired boot is stale (a
  redelivery from before the restart). Boot ids are opaque, so "older" means "retired here";
  the last `max_retired_boots_per_worker` (default 64) retired boots are remembered.
- Same boot, non-snapshot, in sync: `kv_seq` = last + 1 is applied; `kv_seq` <= last is a
  duplicate (stale, no change); `kv_seq` > last + 1 is a gap: needs_resync, and the worker's
  blocks stay as they were (still a useful approximation) until the snapshot comes.
- Same boot, non-snapshot, awaiting resync: ignored, status needs_resync again with reason
  "awaiting snapshot: <why>", so the caller can re-ask if its request or the snapshot was
  lost. The caller must rate-limit its `RequestKvSnapshot`s per worker (e.g. once per
  heartbeat interval): every ignored event reports needs_resync.
- Same boot, snapshot at `kv_seq` S: stale if S is below the highest `kv_seq` seen from this
  boot (it misses events we know happened, including ones ignored while awaiting); otherwise it
  replaces w's block set wholesale, the last `kv_seq` becomes S and the awaiting flag clears.
  A snapshot at S = last (in sync) is applied and changes nothing if we were right.
- `KvAllCleared` drops every block of w, under the same sequence rules.
Assumption: a snapshot travels in order with the worker's KV events (it is stamped with the
last `kv_seq` the worker published, and takes no sequence number of its own). If it overtook
events, the next event after it reads as a gap and asks for another snapshot: self-healing.
A worker awaiting resync still matches with the blocks we last knew of; filter with
`needs_resync(w)` if that approximation is unwanted. Events arriving after `remove_worker(w)`
bring w back (filter by liveness upstream). Should a redelivery from a boot never seen here
ever take over, `boot_id(w)` disagrees with the boot in w's heartbeats: `remove_worker(w)`
then resyncs w from its next event.
Malformed sequence numbers (`kv_seq` < 1 on an event, < 0 on a snapshot) raise ValueError.

Invariants: `hash_to_worker_ids[h]` contains w iff h is in w's block set; no empty sets are kept;
when w is not awaiting resync, its block set is w's true cache content after event `kv_seq`.

`ApproximatePrefixIndex` is for engines that publish no KV events: it learns from the router's
own decisions. `record(w, block_hashes, now_ns)` after a request is routed to w says "w will hold
these blocks"; an entry lives until `ttl_ms` (default 120,000) after its last record. Each
worker keeps at most `max_blocks_per_worker` entries (default 1,000,000) in least recently
recorded order; over capacity, the least recent entry goes. One record inserts the prompt's
blocks in reverse, so a prompt's leading blocks (shared by the most prompts and useless without
each other) are the most recent and go last. A worker's entries are kept in time order, so
its least recent entry is its oldest: a `record` whose `now_ns` is before that worker's latest
record (a wall clock stepped back) is stamped with the latest instead — its entries live at
most the size of the step longer — and counted in `num_clock_regressions`. Expiry is lazy:
`match` ignores expired entries without deleting them (a query does not mutate) and checks
entry times only for a worker whose oldest entry has expired; `record(w, ...)` pops w's
expired entries from the old end; `expire(now_ns)` does the same for every worker, at
O(workers + expired entries), for the caller to run now and then.

Cost: `match` walks the prompt's hashes while some candidate worker still holds the next one:
O(matched blocks × workers holding them); while every candidate holds the next block a subset
test suffices and nothing is allocated (~11 µs for 64 blocks held by 16 workers on one core).
Updates are O(blocks in the event) (a snapshot: O(old + new blocks of that worker)).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from itertools import islice
from typing import Literal, Sequence, Union

from schemas.messages import KvAllCleared, KvBlocksRemoved, KvBlocksStored, KvSnapshot

KvEvent = Union[KvBlocksStored, KvBlocksRemoved, KvAllCleared, KvSnapshot]
IndexStatus = Literal["applied", "stale", "needs_resync"]

APPLIED: IndexStatus = "applied"
STALE: IndexStatus = "stale"
NEEDS_RESYNC: IndexStatus = "needs_resync"


def cached_tokens(num_matched_blocks: int, block_size_tokens: int, num_prompt_tokens: int) -> int:
    """FlexLB's rule: hit = matched × block size; a hit reaching the whole prompt is cut to
    prompt − block size (the last block is always computed); never negative."""
    if block_size_tokens <= 0:
        raise ValueError(f"block_size_tokens must be positive, got {block_size_tokens}")
    if num_matched_blocks < 0 or num_prompt_tokens < 0:
        raise ValueError(
            f"negative input: num_matched_blocks={num_matched_blocks}, num_prompt_tokens={num_prompt_tokens}"
        )
    hit_tokens = num_matched_blocks * block_size_tokens
    if hit_tokens >= num_prompt_tokens:
        hit_tokens = num_prompt_tokens - block_size_tokens
    return max(hit_tokens, 0)


@dataclass(frozen=True)
class IndexUpdate:
    """What `PrefixIndex.apply` did with one event."""

    status: IndexStatus  # "applied" | "stale" (ignored: old kv_seq or retired boot) | "needs_resync"
    worker_id: str
    reason: str = ""  # why stale / needs_resync, e.g. "gap: expected kv_seq 4, got 6"


@dataclass
class _WorkerKv:
    """The index's belief about one worker's prefix cache."""

    boot_id: str
    kv_seq: int = 0  # highest kv_seq seen from this boot; when in sync, the last one applied
    is_awaiting_resync: bool = False
    resync_reason: str = ""  # why we are awaiting a snapshot
    block_hashes: set[int] = field(default_factory=set)
    retired_boot_ids: dict[str, None] = field(default_factory=dict)  # insertion-ordered set, oldest first



_EMPTY: frozenset[str] = frozenset()


def _match_leading(hash_to_worker_ids: dict[int, set[str]], block_hashes: Sequence[int]) -> dict[str, int]:
    """Worker id -> number of leading blocks it holds. Start from the holders of block 0 and
    drop each worker at the first block it misses; while every candidate holds the next block
    (the common case) a subset test suffices and nothing is allocated."""
    if not block_hashes:
        return {}
    alive = hash_to_worker_ids.get(block_hashes[0])  # never mutated: intersections make new sets
    if not alive:
        return {}
    result: dict[str, int] = {}
    depth = 1
    for h in islice(block_hashes, 1, None):
        holders = hash_to_worker_ids.get(h, _EMPTY)
        if alive <= holders:
            depth += 1
            continue
        nxt = alive & holders
        if not nxt:
            break
        for worker_id in alive - nxt:
            result[worker_id] = depth
        alive = nxt
        depth += 1
    for worker_id in alive:
        result[worker_id] = depth
    return result


def held_prefix_end(held: set[int], block_hashes: Sequence[int], hi: int) -> int:
    """Binary search for the number of leading blocks in `held`, given that block 0 is held,
    that no more than `hi` are, and that the held ones form a prefix (callers prove or know
    it): the largest lo in [1, hi] with block lo-1 held."""
    lo = 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if block_hashes[mid - 1] in held:
            lo = mid
        else:
            hi = mid - 1
    return lo


class PrefixIndex:
    """Exact index fed by KV events (rules in the module docstring)."""

    def __init__(self, max_retired_boots_per_worker: int = 64) -> None:
        if max_retired_boots_per_worker < 0:
            raise ValueError(f"max_retired_boots_per_worker must be >= 0, got {max_retired_boots_per_worker}")
        self.max_retired_boots_per_worker = max_retired_boots_per_worker
        self._workers: dict[str, _WorkerKv] = {}  # worker id -> belief
        # No global hash -> workers map: a match needs only the holders of the prompt's first
        # block (one set probe per worker), and applying a KV event is then one C-level set
        # update instead of a Python loop over its blocks (prompts of 10k tokens store ~600
        # blocks per event) — and half the memory.
        self.block_counts: dict[str, int] = {}  # worker id -> num_blocks(worker id), kept by apply (read-only)

    # ------------------------------------------------------------------ events
    def apply(self, event: KvEvent) -> IndexUpdate:
        update = self._apply(event)
        state = self._workers.get(event.worker_id)
        if state is not None:
            self.block_counts[event.worker_id] = len(state.block_hashes)
        return update

    def _apply(self, event: KvEvent) -> IndexUpdate:
        is_snapshot = isinstance(event, KvSnapshot)
        if event.kv_seq < (0 if is_snapshot else 1):
            raise ValueError(f"malformed {type(event).__name__} from {event.worker_id}: kv_seq {event.kv_seq}")
        worker_id = event.worker_id
        state = self._workers.get(worker_id)
        if state is None:
            state = _WorkerKv(boot_id=event.boot_id)
            self._workers[worker_id] = state
            return self._start_boot(state, event, "first event")
        if event.boot_id != state.boot_id:
            if event.boot_id in state.retired_boot_ids:
                return IndexUpdate(STALE, worker_id, f"event of retired boot {event.boot_id} (now {state.boot_id})")
            context = f"restart: boot {state.boot_id} -> {event.boot_id}"
            self._clear_blocks(worker_id, state)
            state.retired_boot_ids[state.boot_id] = None
            while len(state.retired_boot_ids) > self.max_retired_boots_per_worker:
                del state.retired_boot_ids[next(iter(state.retired_boot_ids))]
            state.boot_id = event.boot_id
            state.kv_seq = 0
            state.is_awaiting_resync = False
            state.resync_reason = ""
            return self._start_boot(state, event, context)
        if is_snapshot:
            if event.kv_seq < state.kv_seq:
                reason = f"snapshot at kv_seq {event.kv_seq} is older than kv_seq {state.kv_seq} already seen"
                return IndexUpdate(STALE, worker_id, reason)
            self._apply_snapshot(state, event)
            return IndexUpdate(APPLIED, worker_id)
        if state.is_awaiting_resync:
            state.kv_seq = max(state.kv_seq, event.kv_seq)
            return IndexUpdate(NEEDS_RESYNC, worker_id, f"awaiting snapshot: {state.resync_reason}")
        expected = state.kv_seq + 1
        if event.kv_seq < expected:
            return IndexUpdate(STALE, worker_id, f"duplicate: expected kv_seq {expected}, got {event.kv_seq}")
        if event.kv_seq > expected:
            return self._await_resync(state, event, f"gap: expected kv_seq {expected}, got {event.kv_seq}")
        self._apply_change(worker_id, state, event)
        state.kv_seq = event.kv_seq
        return IndexUpdate(APPLIED, worker_id)

    def remove_worker(self, worker_id: str) -> None:
        """The worker expired: forget its blocks, boots and sequence numbers."""
        state = self._workers.pop(worker_id, None)
        self.block_counts.pop(worker_id, None)
        if state is not None:
            self._clear_blocks(worker_id, state)

    # ------------------------------------------------------------------ queries
    def match(self, block_hashes: Sequence[int]) -> dict[str, int]:
        """Worker id -> number of leading blocks of the prompt it holds (only workers with >= 1).
        Per holder of the first block, in its own block set (the shared walk in
        `_match_leading` gives the same answer; the property tests compare both with a naive
        model)."""
        if not block_hashes:
            return {}
        first = block_hashes[0]
        holders = [w for w, st in self._workers.items() if first in st.block_hashes]
        if not holders:
            return {}
        out: dict[str, int] = {}
        n = len(block_hashes)
        for worker_id in holders:
            held = self._workers[worker_id].block_hashes
            # Engines evict from the tail of a cached chain, so the held blocks of a prompt
            # are almost always a prefix: binary-search its end, then prove it (every block
            # before it held — one C-level superset test — and the next one not). A set that
            # is not prefix-closed fails the proof and gets the plain walk.
            lo = held_prefix_end(held, block_hashes, n)
            if not ((lo == n or block_hashes[lo] not in held) and held.issuperset(block_hashes[:lo])):
                lo = 1
                while lo < n and block_hashes[lo] in held:
                    lo += 1
            out[worker_id] = lo
        return out

    def num_blocks(self, worker_id: str) -> int:
        state = self._workers.get(worker_id)
        return 0 if state is None else len(state.block_hashes)

    def workers(self) -> set[str]:
        """Every worker the index has heard from (and not removed), with or without blocks."""
        return set(self._workers)

    def needs_resync(self, worker_id: str) -> bool:
        """True while the worker's blocks are a stale approximation awaiting a snapshot."""
        state = self._workers.get(worker_id)
        return state is not None and state.is_awaiting_resync

    def boot_id(self, worker_id: str) -> str | None:
        """The boot the index follows for this worker (compare with its heartbeats)."""
        state = self._workers.get(worker_id)
        return None if state is None else state.boot_id

    # ------------------------------------------------------------------ internals
    def _start_boot(self, state: _WorkerKv, event: KvEvent, context: str) -> IndexUpdate:
        """First event of a boot as far as we know: a snapshot or kv_seq 1 starts it, else resync."""
        if isinstance(event, KvSnapshot):
            self._apply_snapshot(state, event)
            return IndexUpdate(APPLIED, event.worker_id, context)
        if event.kv_seq == 1:
            self._apply_change(event.worker_id, state, event)
            state.kv_seq = 1
            return IndexUpdate(APPLIED, event.worker_id, context)
        return self._await_resync(state, event, f"{context}: expected kv_seq 1 or a snapshot, got {event.kv_seq}")

    def _await_resync(self, state: _WorkerKv, event: KvEvent, reason: str) -> IndexUpdate:
        state.is_awaiting_resync = True
        state.resync_reason = reason
        state.kv_seq = max(state.kv_seq, event.kv_seq)
        return IndexUpdate(NEEDS_RESYNC, event.worker_id, reason)

    def _apply_snapshot(self, state: _WorkerKv, event: KvSnapshot) -> None:
        state.block_hashes = set(event.block_hashes)
        state.kv_seq = event.kv_seq
        state.is_awaiting_resync = False
        state.resync_reason = ""

    def _apply_change(self, worker_id: str, state: _WorkerKv, event: KvEvent) -> None:
        if isinstance(event, KvBlocksStored):
            state.block_hashes.update(event.block_hashes)
        elif isinstance(event, KvBlocksRemoved):
            state.block_hashes.difference_update(event.block_hashes)
        elif isinstance(event, KvAllCleared):
            self._clear_blocks(worker_id, state)
        else:
            raise TypeError(f"not a KV change event: {type(event).__name__}")

    def _clear_blocks(self, worker_id: str, state: _WorkerKv) -> None:
        state.block_hashes = set()



class ApproximatePrefixIndex:
    """For engines that publish no KV events: learns from the router's own routing decisions.

    `record(worker_id, block_hashes, now_ns)` after a request is routed to that worker (its
    prompt's blocks will be cached there); entries expire `ttl_ms` after their last record;
    `match(block_hashes, now_ns)` -> {worker id: leading live blocks}; at most
    `max_blocks_per_worker` entries per worker, least recently recorded evicted first."""

    def __init__(self, ttl_ms: float = 120_000, max_blocks_per_worker: int = 1_000_000) -> None:
        if not ttl_ms > 0:
            raise ValueError(f"ttl_ms must be positive, got {ttl_ms}")
        if max_blocks_per_worker < 1:
            raise ValueError(f"max_blocks_per_worker must be >= 1, got {max_blocks_per_worker}")
        self.ttl_ns = int(ttl_ms * 1_000_000)
        self.max_blocks_per_worker = max_blocks_per_worker
        # worker id -> block hash -> time of its last record (ns), least recently recorded first
        self._worker_to_entries: dict[str, OrderedDict[int, int]] = {}
        self._hash_to_worker_ids: dict[int, set[str]] = {}  # block hash -> workers with an entry (never empty)
        self.num_clock_regressions = 0  # records stamped later than their now_ns (export it as a metric)

    def record(self, worker_id: str, block_hashes: Sequence[int], now_ns: int) -> None:
        """The request with these block hashes was routed to this worker at `now_ns`."""
        entries = self._worker_to_entries.get(worker_id)
        if entries is None:
            entries = self._worker_to_entries[worker_id] = OrderedDict()
        elif entries:
            latest_ns = next(reversed(entries.values()))
            if now_ns < latest_ns:  # the clock went back: keep the entries in time order
                self.num_clock_regressions += 1
                now_ns = latest_ns
        self._sweep(worker_id, entries, now_ns)
        for h in reversed(block_hashes):  # leading blocks end up most recent: evicted last
            if h in entries:
                entries.move_to_end(h)
            else:
                self._hash_to_worker_ids.setdefault(h, set()).add(worker_id)
            entries[h] = now_ns
        while len(entries) > self.max_blocks_per_worker:
            h, _ = entries.popitem(last=False)
            self._unlink(h, worker_id)

    def match(self, block_hashes: Sequence[int], now_ns: int) -> dict[str, int]:
        """Worker id -> number of leading blocks with a live entry (only workers with >= 1)."""
        result = _match_leading(self._hash_to_worker_ids, block_hashes)  # live or not yet swept
        oldest_live_ns = now_ns - self.ttl_ns  # an entry is live iff recorded after this
        for worker_id, depth in list(result.items()):
            entries = self._worker_to_entries[worker_id]
            if next(iter(entries.values())) > oldest_live_ns:
                continue  # its least recent entry is live, so all of them are
            num_live = 0
            while num_live < depth and entries[block_hashes[num_live]] > oldest_live_ns:
                num_live += 1
            if num_live:
                result[worker_id] = num_live
            else:
                del result[worker_id]
        return result

    def expire(self, now_ns: int) -> None:
        """Drop expired entries of every worker: O(workers + expired entries)."""
        for worker_id in list(self._worker_to_entries):
            entries = self._worker_to_entries[worker_id]
            self._sweep(worker_id, entries, now_ns)
            if not entries:
                del self._worker_to_entries[worker_id]

    def remove_worker(self, worker_id: str) -> None:
        entries = self._worker_to_entries.pop(worker_id, None)
        if entries is not None:
            for h in entries:
                self._unlink(h, worker_id)

    def num_blocks(self, worker_id: str) -> int:
        """Entries stored for the worker, including expired ones not swept yet (memory, not hits)."""
        entries = self._worker_to_entries.get(worker_id)
        return 0 if entries is None else len(entries)

    def workers(self) -> set[str]:
        return set(self._worker_to_entries)

    def _sweep(self, worker_id: str, entries: OrderedDict[int, int], now_ns: int) -> None:
        oldest_live_ns = now_ns - self.ttl_ns
        while entries:
            h, recorded_ns = next(iter(entries.items()))
            if recorded_ns > oldest_live_ns:
                break
            del entries[h]
            self._unlink(h, worker_id)

    def _unlink(self, h: int, worker_id: str) -> None:
        holders = self._hash_to_worker_ids.get(h)
        if holders is None:
            return
        holders.discard(worker_id)
        if not holders:
            del self._hash_to_worker_ids[h]
