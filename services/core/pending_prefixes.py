"""Pending prefixes: prompts routed to a worker whose KV events have not confirmed them yet.

In exact prefix-index mode (`SchedulerConfig.prefix_index = "exact"`) a worker's blocks are
known from its KV events, which arrive only after its prefill. Requests that arrive meanwhile
with the same prefix would look like misses everywhere and be spread over the fleet (measured
in bench/TRACE.md, "What the numbers say"). So the scheduler records every routed prompt
here and, in `_matches`, takes per worker the longer of the exact and the pending match.

Algorithm. Per worker, time buckets of a tenth of the ttl: a prompt's block hashes go into
the worker's current bucket (one C-level set update per admission, the router's hot path on
long prompts), a bucket lives for ten bucket widths (entries last between 0.9 and 1.0 of the
ttl), and expiry drops whole buckets. Each bucket holds whole leading runs of chained
prompts, so a worker's live blocks of one chain are a prefix: `match` finds its length by
binary search over the live buckets. Block hashes are chained (a block's hash covers every
token before it), so a prompt's first block is only ever some prompt's first block: `firsts`
maps it to the workers that were sent one, with the newest bucket, and a match visits those
workers alone instead of probing every worker's buckets. A clock that steps back never
revives a bucket an `expire` dropped, nor moves a first block to an older bucket.

Parameters
- `ttl_ms`: how long a routed prompt counts as cached (`SchedulerConfig.pending_prefix_ttl_ms`,
  default 30,000; 0 turns the index off: the scheduler then neither records nor matches).
- `NUM_BUCKETS` = 10: buckets per ttl (the expiry granularity).

Calls: `record(worker, block_hashes, now_ns)` at admission, `match(block_hashes, now_ns)` per
decision, `expire(now_ns)` now and then (the scheduler: once a second of its ticks),
`remove_worker(worker)` when the worker goes. Pure: time is the caller's `now_ns`.
"""

from __future__ import annotations

from services.core.prefix_index import held_prefix_end


class PendingPrefixes:
    """Per worker, the block hashes of the prompts routed to it within the ttl (module docstring)."""

    NUM_BUCKETS = 10

    def __init__(self, ttl_ms: float) -> None:
        self.ttl_ns = int(ttl_ms * 1e6)
        self.bucket_ns = max(self.ttl_ns // self.NUM_BUCKETS, 1)
        self.worker_buckets: dict[str, list[tuple[int, set[int]]]] = {}  # worker -> (bucket no., hashes), oldest first
        self.firsts: dict[int, dict[str, int]] = {}  # first block -> {worker: newest bucket no. holding it}
        self._firsts_swept_bucket = 0  # oldest live bucket at the last sweep of `firsts`
        self._oldest_kept = -(1 << 62)  # buckets below this were dropped by an expire (kept monotonic)

    def record(self, worker_id: str, block_hashes: tuple[int, ...], now_ns: int) -> None:
        """Remember the prompt on the worker for (about) the ttl. Already in the current
        bucket (its last block is): nothing to write."""
        bucket = now_ns // self.bucket_ns
        holders = self.firsts.get(block_hashes[0])
        if holders is None:
            self.firsts[block_hashes[0]] = {worker_id: bucket}
        elif holders.get(worker_id, bucket) <= bucket:  # (a clock step back keeps the newer bucket)
            holders[worker_id] = bucket
        buckets = self.worker_buckets.get(worker_id)
        if buckets is None:
            buckets = self.worker_buckets[worker_id] = []
        if buckets and buckets[-1][0] == bucket:
            current = buckets[-1][1]
            if block_hashes[-1] not in current:
                current.update(block_hashes)
        else:
            buckets.append((bucket, set(block_hashes)))

    def match(self, block_hashes: tuple[int, ...], now_ns: int) -> dict[str, int]:
        """Leading blocks per worker, by binary search over its live buckets."""
        holders = self.firsts.get(block_hashes[0])
        if not holders:
            return {}
        oldest_live = now_ns // self.bucket_ns - self.NUM_BUCKETS + 1
        # The first block is in a live bucket iff the newest bucket it went into is live and
        # kept (a clock step back can make a dropped bucket "live" again).
        first_floor = oldest_live if oldest_live > self._oldest_kept else self._oldest_kept
        last = block_hashes[-1]
        n = len(block_hashes)
        out: dict[str, int] = {}
        worker_buckets = self.worker_buckets
        for worker_id, newest in holders.items():
            if newest < first_floor:
                continue
            buckets = worker_buckets.get(worker_id)
            if buckets is None:  # (expired whole; `firsts` is swept later)
                continue
            if len(buckets) == 1:  # one bucket: plain set probes
                held = buckets[0][1]
                if last in held:
                    out[worker_id] = n
                    continue
                out[worker_id] = held_prefix_end(held, block_hashes, n - 1)  # (block n-1 is not held)
                continue
            live = [hs for b, hs in reversed(buckets) if b >= oldest_live]  # newest first: hits end a probe sooner
            for hs in live:  # the whole prompt (the common case of a repeated one)
                if last in hs:
                    out[worker_id] = n
                    break
            else:
                lo, hi = 1, n - 1  # block lo-1 is held, block n-1 is not; find the longest held prefix
                while lo < hi:
                    mid = (lo + hi + 1) // 2
                    h = block_hashes[mid - 1]
                    for hs in live:
                        if h in hs:
                            lo = mid
                            break
                    else:
                        hi = mid - 1
                out[worker_id] = lo
        return out

    def expire(self, now_ns: int) -> None:
        oldest_live = now_ns // self.bucket_ns - self.NUM_BUCKETS + 1
        if oldest_live > self._oldest_kept:
            self._oldest_kept = oldest_live
        for worker_id, buckets in list(self.worker_buckets.items()):
            keep = [x for x in buckets if x[0] >= oldest_live]
            if keep:
                self.worker_buckets[worker_id] = keep
            else:
                del self.worker_buckets[worker_id]
        # The first-block map is swept once a ttl (a stale entry is skipped by `match`, so it
        # only costs memory meanwhile): sweeping it every second cost more than the matches.
        if not self.worker_buckets:
            self.firsts.clear()
            self._firsts_swept_bucket = oldest_live
        elif oldest_live - self._firsts_swept_bucket >= self.NUM_BUCKETS:
            self._firsts_swept_bucket = oldest_live
            for first, holders in list(self.firsts.items()):
                if any(b < oldest_live for b in holders.values()):
                    holders = {w: b for w, b in holders.items() if b >= oldest_live}
                    if holders:
                        self.firsts[first] = holders
                    else:
                        del self.firsts[first]

    def num_entries(self) -> dict[str, int]:
        """Distinct block entries kept per worker, for tests and metrics."""
        return {w: len(set().union(*(hs for _, hs in buckets))) for w, buckets in self.worker_buckets.items()}

    def remove_worker(self, worker_id: str) -> None:
        self.worker_buckets.pop(worker_id, None)
        for first, holders in list(self.firsts.items()):
            if holders.pop(worker_id, None) is not None and not holders:
                del self.firsts[first]
