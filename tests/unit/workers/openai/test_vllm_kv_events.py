"""vLLM's KV event wire format, pinned by frames encoded by hand from vLLM's struct layouts
(array_like, tagged by class name; and the newer tagged maps), and its translation into
FlexLB's chained hashes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.tokens import block_hashes
from workers.openai.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    VllmEventError,
    VllmKvTranslator,
    decode_frame,
)


def fixstr(s: str) -> bytes:
    assert len(s) < 32
    return bytes([0xA0 | len(s)]) + s.encode()


# msgpack, by hand: [1.5, [BlockStored, BlockRemoved, AllBlocksCleared]]
GOLDEN_PAYLOAD = (
    b"\x92" + b"\xcb\x3f\xf8\x00\x00\x00\x00\x00\x00"  # array(2), float64 1.5
    + b"\x93"  # three events
    + b"\x97" + fixstr("BlockStored") + b"\x92\x6f\xcc\xde" + b"\xc0"  # hashes [111, 222], parent None
    + b"\x98" + bytes(range(1, 9)) + b"\x04" + b"\xc0\xc0"  # token ids 1..8, block size 4, lora None, medium None
    + b"\x93" + fixstr("BlockRemoved") + b"\x91\x6f" + fixstr("GPU")  # [111], medium "GPU"
    + b"\x91" + b"\xb0" + b"AllBlocksCleared"
)


def test_a_golden_vllm_frame_decodes_field_for_field():
    topic, seq, batch = decode_frame([b"kv", (7).to_bytes(8, "big"), GOLDEN_PAYLOAD])
    assert (topic, seq, batch.ts, batch.data_parallel_rank) == ("kv", 7, 1.5, None)
    stored, removed, cleared = batch.events
    assert stored == BlockStored(block_hashes=[111, 222], parent_block_hash=None, token_ids=list(range(1, 9)), block_size=4)
    assert removed == BlockRemoved(block_hashes=[111], medium="GPU")
    assert isinstance(cleared, AllBlocksCleared)


@pytest.mark.parametrize("parts,fragment", [
    ([b"kv", b"\x00" * 8], "3 parts"),
    ([b"kv", b"\x00" * 4, GOLDEN_PAYLOAD], "8 bytes"),
    ([b"kv", b"\x00" * 8, b"\x92\xcb"], "undecodable"),
    ([b"kv", b"\x00" * 8, b"\x92\x01\x91\x92" + fixstr("NoSuchEvent") + b"\x01"], "undecodable"),
])
def test_a_bad_frame_is_a_coded_error(parts, fragment):
    with pytest.raises(VllmEventError, match=fragment) as info:
        decode_frame(parts)
    assert info.value.code == "invalid_request"


def fixmap(pairs: list[tuple[str, bytes]]) -> bytes:
    assert len(pairs) < 16
    return bytes([0x80 | len(pairs)]) + b"".join(fixstr(k) + v for k, v in pairs)


# vLLM >= PR #42892, as a 0.26 server sends it: [1.5, [{"type": "BlockStored", ...}, {"type":
# "AllBlocksCleared"}], 0], with fields newer than our structs (lora_name, extra_keys, group_idx).
GOLDEN_MAP_EVENTS = (
    b"\x93" + b"\xcb\x3f\xf8\x00\x00\x00\x00\x00\x00" + b"\x92"
    + fixmap([("type", fixstr("BlockStored")), ("block_hashes", b"\x92\x6f\xcf" + b"\xff" * 8),
              ("parent_block_hash", b"\xc0"), ("token_ids", b"\x98" + bytes(range(1, 9))), ("block_size", b"\x04"),
              ("lora_id", b"\xc0"), ("medium", fixstr("GPU")), ("lora_name", b"\xc0"), ("extra_keys", b"\x92\xc0\xc0"),
              ("group_idx", b"\x00")])
    + fixmap([("type", b"\xb0AllBlocksCleared")])
    + b"\x00"
)
GOLDEN_MAP_ENVELOPE = fixmap([("ts", b"\xcb\x3f\xf8" + b"\x00" * 6),
                              ("events", b"\x91" + fixmap([("type", fixstr("BlockRemoved")), ("block_hashes", b"\x91\x6f"),
                                                           ("medium", b"\xc0")]))])


def test_map_encoded_events_of_newer_vllm_decode_too():
    _, _, batch = decode_frame([b"", (0).to_bytes(8, "big"), GOLDEN_MAP_EVENTS])
    st, cleared = batch.events
    assert (batch.ts, batch.data_parallel_rank) == (1.5, 0)
    assert isinstance(st, BlockStored) and isinstance(cleared, AllBlocksCleared)
    assert (st.block_hashes, st.parent_block_hash, st.token_ids, st.block_size, st.medium) == (
        [111, 2**64 - 1], None, list(range(1, 9)), 4, "GPU")
    _, _, batch = decode_frame([b"", (1).to_bytes(8, "big"), GOLDEN_MAP_ENVELOPE])
    (gone,) = batch.events
    assert isinstance(gone, BlockRemoved) and gone.block_hashes == [111] and batch.ts == 1.5


def test_a_block_stored_and_removed_in_one_batch_is_in_neither_list():
    prompt = list(range(8))
    tr = VllmKvTranslator(4)
    out = tr.translate(KVEventBatch(ts=0.0, events=[
        BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=prompt, block_size=4),
        BlockRemoved(block_hashes=[2])]))
    assert out.stored == block_hashes(prompt, 4)[:1] and out.removed == [] and len(tr) == 1
    out = tr.translate(KVEventBatch(ts=0.0, events=[
        BlockRemoved(block_hashes=[1]),
        BlockStored(block_hashes=[3], parent_block_hash=None, token_ids=prompt[:4], block_size=4)]))
    assert out.removed == out.stored == block_hashes(prompt, 4)[:1]  # removed first, then stored: cached


def stored(theirs: list, parent, tokens: list[int], bs: int = 4) -> KVEventBatch:
    return KVEventBatch(ts=0.0, events=[BlockStored(block_hashes=theirs, parent_block_hash=parent, token_ids=tokens,
                                                    block_size=bs)])


def test_a_chain_stored_in_two_events_gets_the_routers_hashes_of_the_whole_prompt():
    prompt = list(range(100, 112))  # three blocks of 4
    tr = VllmKvTranslator(4)
    first = tr.translate(stored([b"\x01" * 32], None, prompt[:4]))  # bytes hashes, as vLLM's sha256 option
    rest = tr.translate(stored([b"\x02" * 32, 3], b"\x01" * 32, prompt[4:]))
    assert first.stored + rest.stored == block_hashes(prompt, 4)
    gone = tr.translate(KVEventBatch(ts=0.0, events=[BlockRemoved(block_hashes=[3, 999])]))
    assert gone.removed == block_hashes(prompt, 4)[2:] and gone.num_unknown_removed == 1
    assert len(tr) == 2
    assert tr.translate(KVEventBatch(ts=0.0, events=[AllBlocksCleared()])).cleared and len(tr) == 0


def test_an_unknown_parent_is_counted_unchainable_and_a_wrong_block_size_is_an_error():
    tr = VllmKvTranslator(4)
    out = tr.translate(stored([5, 6], 4242, list(range(8))))
    assert out.num_unchainable_blocks == 2 and out.stored == [] and not out.cleared and len(tr) == 0
    with pytest.raises(VllmEventError, match="block size"):
        tr.translate(stored([5], None, list(range(16)), bs=16))


def test_sequence_gaps_are_reported_and_replayed_duplicates_ignored():
    tr = VllmKvTranslator(4)
    assert tr.accept(10) == [] and tr.accept(11) == []
    assert tr.accept(14) == [12, 13]
    assert tr.accept(12) == [] and tr.last_seq == 14


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["store", "remove", "clear"]), st.integers(0, 5), st.integers(1, 4)),
                max_size=40))
def test_the_translated_cache_is_the_servers_cache_in_our_hashes(ops):
    """A model server caching prompts block by block (chained from earlier blocks, as vLLM
    does); after every batch the translator's view, in our hashes, is exactly the server's
    cached blocks' router hashes."""
    bs = 4
    prompts = [[(p * 7 + i) % 11 for i in range(16)] for p in range(6)]
    server: dict[int, int] = {}  # vLLM-side hash -> our hash of that block
    ours: set[int] = set()
    tr = VllmKvTranslator(bs)
    next_id = [1]
    theirs_of: dict[tuple[int, int], int] = {}  # (prompt, block) -> vLLM hash while cached
    for op, p, n in ops:
        hashes = block_hashes(prompts[p], bs)
        if op == "store":
            have = 0
            while have < 4 and (p, have) in theirs_of:
                have += 1
            upto = min(4, have + n)
            if upto == have:
                continue
            new = []
            for b in range(have, upto):
                theirs_of[(p, b)] = next_id[0]
                server[next_id[0]] = hashes[b]
                new.append(next_id[0])
                next_id[0] += 1
            parent = theirs_of[(p, have - 1)] if have else None
            out = tr.translate(stored(new, parent, prompts[p][have * bs:upto * bs], bs))
            ours |= set(out.stored)
        elif op == "remove":  # evict the prompt's tail block (vLLM evicts a chain tail first)
            tail = max((b for (q, b) in theirs_of if q == p), default=None)
            if tail is None:
                continue
            h = theirs_of.pop((p, tail))
            del server[h]
            out = tr.translate(KVEventBatch(ts=0.0, events=[BlockRemoved(block_hashes=[h])]))
            ours -= set(out.removed)
        else:
            server.clear()
            theirs_of.clear()
            tr.translate(KVEventBatch(ts=0.0, events=[AllBlocksCleared()]))
            ours.clear()
        assert ours == set(server.values())
