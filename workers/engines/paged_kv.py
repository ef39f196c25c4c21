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
        owned = [b for s in self._seqs.values() for b in s.table[s.num_shared:]]
        shared = [b for s in self._seqs.values() for b in s.table[:s.num_shared]]
        assert len(owned) == len(set(owned)), "a private block owned twice"
        assert not set(owned) & set(self._free) and not set(owned) & set(self._evictable)
        for b in set(shared):
            assert self._refcount.get(b, 0) == shared.count(b) and b not in self._evictable
        assert all(self._refcount.get(b, 0) == 0 for b in self._evictable)

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

    def allocate(self, seq_id: str, prompt_hashes: list[int]) -> int:
        """Start a sequence: pin the longest cached prefix of its full prompt blocks; return
        the number of cached tokens (a multiple of the block size)."""
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} already has KV")
        s = self._seqs[seq_id] = _Seq(hashes=list(prompt_hashes))
        for h in prompt_hashes:
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
        s = self._seqs.pop(seq_id)
        for block in s.table:
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
