"""The torch engine's paged KV cache: one preallocated block pool, a block table per
sequence, prefix caching by the router's chained block hashes.

Pool: K and V tensors of shape [layers, blocks, block_size, kv_heads, head_dim], allocated
once. A sequence owns a block table (physical block ids, in token order). Its full prompt
blocks are content-addressed by `schemas.tokens.block_hashes` (each hash chains the previous
one, exactly what the router computes), so the router's exact prefix index works unchanged:

- `allocate(seq, prompt, hashes)` finds the longest prefix of the prompt's full blocks
  already in the cache, pins those (refcount + 1; a pinned block is never evicted) and
  returns how many tokens are cached; the rest of the sequence's blocks are private until
  `register_full_blocks` publishes the prompt blocks it has computed under their hash;
- `free(seq)` unpins its shared blocks and returns its private ones; a cached block whose
  refcount reaches 0 stays cached but becomes evictable, least recently used first;
- a block needed when no block is free evicts the least recently used evictable block
  (a `removed` event); none evictable is `KvFull` (the engine preempts, as vLLM does).

Events (`take_events`): ("stored", [hashes]) when blocks become cached, ("removed",
[hashes]) when cached blocks are evicted, ("cleared", []) on `clear()`, the same three kinds
the sim engine emits, in order. The invariant free + used + evictable = total holds after
every call (`check_invariants`).

`SeqKv` is the model's `KvView` (workers/engines/torch_model.py) for one step's packed batch:
it writes each new token's K/V into its sequence's slots and reads each sequence's whole
K/V back through its block table.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch


class KvFull(Exception):
    """No free block and none evictable."""


@dataclass
class _Seq:
    table: list[int] = field(default_factory=list)  # physical block ids, in token order
    num_tokens: int = 0  # tokens whose K/V are (or are being) written
    num_shared: int = 0  # leading blocks pinned from the cache
    registered: int = 0  # leading blocks published to the cache (shared ones included)
    hashes: list[int] = field(default_factory=list)  # the prompt's full-block hashes


class PagedKvCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: str = "cpu") -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() gives the lowest id
        self._hash_to_block: dict[int, int] = {}
        self._block_to_hash: dict[int, int] = {}
        self._refcount: dict[int, int] = {}  # cached block -> sequences pinning it
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unpinned; LRU first
        self._seqs: dict[str, _Seq] = {}
        self._events: list[tuple[str, list[int]]] = []

    # ------------------------------------------------------------------ counts
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_evictable_blocks(self) -> int:
        return len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free) - len(self._evictable)

    def check_invariants(self) -> None:
        assert self.num_free_blocks + self.num_used_blocks + self.num_evictable_blocks == self.num_blocks
        in_tables = [b for s in self._seqs.values() for b in s.table]
        private = [b for b in in_tables if b not in self._block_to_hash]
        assert len(private) == len(set(private)), "a private block owned twice"
        assert not set(private) & set(self._free) and not set(private) & set(self._evictable)
        for b in self._block_to_hash:  # a cached block: pinned by every sequence whose table has it
            users = in_tables.count(b)
            assert self._refcount.get(b, 0) == users, f"block {b}: refcount {self._refcount.get(b, 0)}, {users} users"
            assert (b in self._evictable) == (users == 0), f"block {b}: evictable is not 'no users'"
        assert len(self._hash_to_block) == len(self._block_to_hash)

    # ------------------------------------------------------------------ blocks
    def _take_block(self) -> int:
        if self._free:
            return self._free.pop()
        if not self._evictable:
            raise KvFull("no free KV block and none evictable")
        block, _ = self._evictable.popitem(last=False)
        h = self._block_to_hash.pop(block)
        del self._hash_to_block[h]
        self._refcount.pop(block, None)
        self._events.append(("removed", [h]))
        return block

    def blocks_needed(self, seq_id: str, num_new_tokens: int) -> int:
        s = self._seqs[seq_id]
        have = len(s.table) * self.block_size
        return max(0, -(-(s.num_tokens + num_new_tokens - have) // self.block_size))

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free) + len(self._evictable)

    def num_cached_prefix_blocks(self, prompt_hashes: list[int]) -> int:
        """How many leading blocks of a prompt are in the cache now."""
        n = 0
        for h in prompt_hashes:
            if h not in self._hash_to_block:
                break
            n += 1
        return n

    def can_start(self, prompt_hashes: list[int], num_hit_blocks: int, num_tokens: int) -> bool:
        """Would `allocate(.., max_hit_blocks=num_hit_blocks)` then `extend` to `num_tokens`
        tokens succeed? (Pinning an evictable hit takes it out of what can be evicted.)"""
        hits = [self._hash_to_block[h] for h in prompt_hashes[:num_hit_blocks]]
        need = max(0, -(-num_tokens // self.block_size) - len(hits))
        return need <= len(self._free) + len(self._evictable) - sum(1 for b in hits if b in self._evictable)

    def cached_hashes(self) -> list[int]:
        return list(self._hash_to_block)

    def allocate(self, seq_id: str, prompt_hashes: list[int], max_hit_blocks: int | None = None) -> int:
        """Start a sequence: pin the longest cached prefix of its full prompt blocks (at most
        `max_hit_blocks`); return the number of cached tokens (a multiple of the block size)."""
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} already has KV")
        s = self._seqs[seq_id] = _Seq(hashes=list(prompt_hashes))
        limit = len(prompt_hashes) if max_hit_blocks is None else max_hit_blocks
        for h in prompt_hashes[:limit]:
            block = self._hash_to_block.get(h)
            if block is None:
                break
            self._pin(block)
            s.table.append(block)
        s.num_shared = s.registered = len(s.table)
        s.num_tokens = len(s.table) * self.block_size
        return s.num_tokens

    def _pin(self, block: int) -> None:
        self._refcount[block] = self._refcount.get(block, 0) + 1
        self._evictable.pop(block, None)

    def extend(self, seq_id: str, num_new_tokens: int) -> list[int]:
        """Room for the next `num_new_tokens` tokens; returns their slots (block × size + offset).
        KvFull leaves the sequence as it was."""
        s = self._seqs[seq_id]
        need = self.blocks_needed(seq_id, num_new_tokens)
        if not self.can_allocate(need):
            raise KvFull(f"{seq_id} needs {need} blocks, {len(self._free) + len(self._evictable)} obtainable")
        for _ in range(need):
            s.table.append(self._take_block())
        start = s.num_tokens
        s.num_tokens += num_new_tokens
        bs = self.block_size
        return [s.table[p // bs] * bs + p % bs for p in range(start, start + num_new_tokens)]

    def register_full_blocks(self, seq_id: str, num_computed_tokens: int) -> None:
        """Publish the prompt blocks whose K/V are now computed under their hashes. A block
        whose hash another sequence published meanwhile stays private (no duplicate entry)."""
        s = self._seqs[seq_id]
        full = min(num_computed_tokens // self.block_size, len(s.hashes))
        stored = []
        for i in range(s.registered, full):
            h, block = s.hashes[i], s.table[i]
            if h in self._hash_to_block:
                continue
            self._hash_to_block[h] = block
            self._block_to_hash[block] = h
            self._refcount[block] = 1
            stored.append(h)
        s.registered = max(s.registered, full)
        if stored:
            self._events.append(("stored", stored))

    def free(self, seq_id: str) -> None:
        """Its private blocks become free; its cached ones, unpinned, evictable tail block
        first (so a prompt's tail is evicted before its head, as in the sim engine)."""
        s = self._seqs.pop(seq_id)
        for block in reversed(s.table):
            if block in self._block_to_hash:  # cached (shared, or published by this sequence)
                self._refcount[block] -= 1
                if self._refcount[block] == 0:
                    self._evictable[block] = None  # most recently used last
            else:
                self._free.append(block)

    def clear(self) -> None:
        """Drop every cached block that nothing pins (an operator's reset)."""
        for block in list(self._evictable):
            h = self._block_to_hash.pop(block)
            del self._hash_to_block[h]
            self._refcount.pop(block, None)
            self._free.append(block)
        self._evictable.clear()
        self._events.append(("cleared", []))

    def take_events(self) -> list[tuple[str, list[int]]]:
        out, self._events = self._events, []
        return out

    def has(self, seq_id: str) -> bool:
        return seq_id in self._seqs

    def export(self, seq_id: str, num_tokens: int) -> torch.Tensor:
        """The K/V of a sequence's first `num_tokens` tokens, [2, layers, tokens, kv_heads,
        head_dim], a copy (the PD hand-off ships it)."""
        table = torch.tensor(self._seqs[seq_id].table, dtype=torch.long, device=self.k.device)
        k = self.k[:, table].reshape(self.k.shape[0], -1, *self.k.shape[3:])[:, :num_tokens]
        v = self.v[:, table].reshape(self.v.shape[0], -1, *self.v.shape[3:])[:, :num_tokens]
        return torch.stack((k, v)).contiguous()

    def write_slots(self, slots: list[int], kv: torch.Tensor) -> None:
        """Store K/V given as [2, layers, len(slots), kv_heads, head_dim] into these slots."""
        flat = torch.tensor(slots, dtype=torch.long, device=self.k.device)
        kv = kv.to(device=self.k.device, dtype=self.k.dtype)
        for layer in range(self.k.shape[0]):
            self.k[layer].view(-1, *self.k.shape[3:])[flat] = kv[0, layer]
            self.v[layer].view(-1, *self.v.shape[3:])[flat] = kv[1, layer]

    def table(self, seq_id: str) -> list[int]:
        return list(self._seqs[seq_id].table)

    def num_tokens(self, seq_id: str) -> int:
        return self._seqs[seq_id].num_tokens


class SeqKv:
    """The model's KvView for one step: sequences `seq_ids`, each with its new tokens' slots."""

    def __init__(self, cache: PagedKvCache, seq_ids: list[str], slots: list[list[int]]) -> None:
        self.cache = cache
        self.seq_ids = seq_ids
        self.flat = torch.tensor([x for s in slots for x in s], dtype=torch.long, device=cache.k.device)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        c = self.cache
        kk = c.k[layer].view(-1, *c.k.shape[3:])
        vv = c.v[layer].view(-1, *c.v.shape[3:])
        kk[self.flat] = k.to(kk.dtype)
        vv[self.flat] = v.to(vv.dtype)

    def read(self, layer: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        c = self.cache
        out = []
        for seq_id in self.seq_ids:
            table = torch.tensor(c.table(seq_id), dtype=torch.long, device=c.k.device)
            n = c.num_tokens(seq_id)
            k = c.k[layer, table].reshape(-1, *c.k.shape[3:])[:n]
            v = c.v[layer, table].reshape(-1, *c.v.shape[3:])[:n]
            out.append((k, v))
        return out
