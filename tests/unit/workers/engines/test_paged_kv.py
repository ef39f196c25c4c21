"""The torch engine's paged KV cache: the model reads and writes through block tables with
the same logits as a dense pass; a shared prefix is reused (not recomputed) under the
router's chained block hashes; eviction is least recently used; the block accounting keeps
free + used + evictable = total under random workloads."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.tokens import block_hashes
from workers.engines.paged_kv import KvFull, PagedKvCache, SeqKv
from workers.engines.torch_model import DenseKv, LlamaConfig, build_model

BS = 4
CFG = LlamaConfig(num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=2, intermediate_size=64, max_positions=256)


@pytest.fixture(scope="module")
def model():
    return build_model(CFG, seed=2)


def cache(num_blocks: int = 64) -> PagedKvCache:
    return PagedKvCache(CFG.num_layers, num_blocks, BS, CFG.num_kv_heads, CFG.head_dim)


def dense(model, ids):
    return model(torch.tensor(ids), torch.arange(len(ids)), [len(ids)], DenseKv([len(ids)]))


def step(model, kv: PagedKvCache, batch: list[tuple[str, list[int], int]]) -> torch.Tensor:
    """One packed step: (sequence, new token ids, first position) each."""
    slots = [kv.extend(sid, len(ids)) for sid, ids, _ in batch]
    toks = torch.tensor([t for _, ids, _ in batch for t in ids])
    pos = torch.cat([torch.arange(p, p + len(ids)) for _, ids, p in batch])
    return model(toks, pos, [len(ids) for _, ids, _ in batch], SeqKv(kv, [sid for sid, _, _ in batch], slots))


def ids_of(n, seed):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_a_packed_prefill_then_decode_through_block_tables_equals_a_dense_pass(model):
    kv = cache()
    a, b = ids_of(10, 1), ids_of(7, 2)
    for sid, ids in (("a", a), ("b", b)):
        assert kv.allocate(sid, block_hashes(ids, BS)) == 0
    out = step(model, kv, [("a", a[:9], 0), ("b", b[:6], 0)])  # both prompts but their last token, packed
    assert torch.allclose(out[:9], dense(model, a)[:9], atol=1e-5) and torch.allclose(out[9:], dense(model, b)[:6], atol=1e-5)
    out = step(model, kv, [("a", a[9:], 9), ("b", b[6:], 6)])  # one token each: a decode step
    assert torch.allclose(out[0], dense(model, a)[9], atol=1e-5) and torch.allclose(out[1], dense(model, b)[6], atol=1e-5)
    kv.check_invariants()


def test_a_shared_prefix_is_reused_from_the_cache_not_recomputed(model):
    kv = cache()
    shared = ids_of(8, 3)  # two full blocks
    a, b = shared + ids_of(5, 4), shared + ids_of(6, 5)
    kv.allocate("a", block_hashes(a, BS))
    step(model, kv, [("a", a, 0)])
    kv.register_full_blocks("a", len(a))
    assert kv.take_events() == [("stored", block_hashes(a, BS))]  # 3 full blocks of 13 tokens
    kv.free("a")
    assert kv.num_evictable_blocks == 3 and kv.num_used_blocks == 0
    cached = kv.allocate("b", block_hashes(b, BS))
    assert cached == 8  # the two shared blocks; the third differs
    out = step(model, kv, [("b", b[cached:], cached)])  # only the new tokens are computed
    assert torch.allclose(out, dense(model, b)[cached:], atol=1e-5)
    assert kv.table("b")[:2] == [kv._hash_to_block[h] for h in block_hashes(shared, BS)]
    kv.check_invariants()


def test_eviction_takes_the_least_recently_used_block_and_a_pinned_pool_is_full():
    kv = cache(num_blocks=3)
    for sid, seed in (("x", 1), ("y", 2), ("z", 3)):
        ids = ids_of(BS, seed)
        kv.allocate(sid, block_hashes(ids, BS))
        kv.extend(sid, BS)
        kv.register_full_blocks(sid, BS)
        kv.free(sid)  # x first, so x is the least recently used
    x_hash = block_hashes(ids_of(BS, 1), BS)[0]
    kv.take_events()
    kv.allocate("new", [])
    kv.extend("new", 1)
    assert kv.take_events() == [("removed", [x_hash])]
    kv.allocate("pin", block_hashes(ids_of(BS, 2), BS))  # pins y
    kv.extend("new", BS)  # takes z, the last evictable
    with pytest.raises(KvFull):
        kv.extend("new", BS)
    kv.check_invariants()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["start", "grow", "register", "free", "clear"]), st.integers(0, 5),
                          st.integers(1, 12)), max_size=60))
def test_block_accounting_keeps_its_invariant_under_random_workloads(ops):
    kv = cache(num_blocks=12)
    live: dict[str, list[int]] = {}
    n = 0
    for op, which, size in ops:
        sid = f"s{which}"
        if op == "start" and sid not in live:
            prompt = [t % 3 for t in range(size)] + [which]  # small alphabet: prefixes collide
            live[sid] = prompt
            kv.allocate(sid, block_hashes(prompt, BS))
        elif op == "grow" and sid in live:
            try:
                kv.extend(sid, size)
            except KvFull:
                pass
        elif op == "register" and sid in live:
            kv.register_full_blocks(sid, kv.num_tokens(sid))
        elif op == "free" and sid in live:
            kv.free(sid)
            del live[sid]
        elif op == "clear":
            kv.clear()
        kv.check_invariants()
        n += 1
    for sid in list(live):
        kv.free(sid)
    kv.check_invariants()
    assert kv.num_used_blocks == 0
