"""vLLM's KV event sockets (workers/openai/kv_zmq.py): our stand-in for vLLM's publisher and our
subscriber, over real ZMQ sockets on loopback ports chosen by the OS.

Story: a model of a vLLM server's prefix cache (blocks keyed by their token prefix, vLLM
hashes a function of the content, shared prefixes cached once, leaves evicted first) turns
stores, evictions and clears into vLLM events; the publisher sends them, dropping some
frames on purpose; the subscriber's view in our hashes must equal the model's cache in
`schemas.tokens.block_hashes` whenever the replay filled every gap, and be a subset of it
(never a block the server does not hold) when it could not. ZMQ's slow joiner (a new SUB
misses what was sent while it connected) is handled by `joined`: probe batches until one
arrives, bounded; the subscriber's catch-up replays what the probes before it missed.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time

import msgspec
import pytest
import zmq
from hypothesis import event, given, settings
from hypothesis import strategies as st

from schemas.tokens import block_hashes
from tests.integration.stack import asgi_call
from workers.openai.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    Translated,
    VllmEventError,
    decode_frame,
)
from workers.openai.kv_zmq import VllmKvPublisher, VllmKvSubscriber, parse_kv_events_config

BS = 4  # tokens per block
LOOPBACK = "tcp://127.0.0.1:*"  # bound on a port the OS picks; .endpoint has it
WAIT_S = 10.0  # generous bound of every wait for a frame
PROBE_EVERY_S = 0.01


# --------------------------------------------------------------------------- helpers
class View:
    """A consumer's view of one server's cache in our hashes: Translated applied in order."""

    def __init__(self) -> None:
        self.hashes: set[int] = set()
        self.results: list[Translated] = []

    def apply(self, out: Translated) -> None:
        self.results.append(out)
        if out.cleared:
            self.hashes.clear()
        self.hashes -= set(out.removed)
        self.hashes |= set(out.stored)

    @property
    def forgets(self) -> list[Translated]:
        return [r for r in self.results if r.num_lost_batches]


async def joined(pub: VllmKvPublisher, sub: VllmKvSubscriber, view: View) -> int:
    """Probe with empty batches until the subscriber returns one; returns its seq."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        probe = pub.publish([])
        try:
            while True:
                out = await asyncio.wait_for(sub.next(), PROBE_EVERY_S)
                view.apply(out)
                if out.seq == probe:
                    return probe
        except asyncio.TimeoutError:
            continue
    raise AssertionError(f"the subscriber got no probe within {WAIT_S} s")


async def drain_to(sub: VllmKvSubscriber, seq: int, view: View) -> None:
    """Apply results until the one of batch `seq` (bounded)."""
    async def run() -> None:
        while True:
            out = await sub.next()
            view.apply(out)
            if out.seq == seq:
                return

    await asyncio.wait_for(run(), WAIT_S)


def vllm_hash(key: tuple[int, ...]) -> int:
    """A stand-in for vLLM's content hash of a block (its whole token prefix): not ours."""
    return int.from_bytes(hashlib.sha256(repr(key).encode()).digest()[:8], "big")


class ServerCache:
    """A vLLM server's prefix cache: block key = the token prefix up to and including it."""

    def __init__(self) -> None:
        self.cached: set[tuple[int, ...]] = set()

    def store(self, prompt: list[int], num_blocks: int) -> list:
        """Cache up to num_blocks more blocks of prompt after its cached prefix."""
        keys = [tuple(prompt[: (i + 1) * BS]) for i in range(len(prompt) // BS)]
        have = 0
        while have < len(keys) and keys[have] in self.cached:
            have += 1
        upto = min(len(keys), have + num_blocks)
        if upto == have:
            return []
        self.cached |= set(keys[have:upto])
        parent = vllm_hash(keys[have - 1]) if have else None
        return [BlockStored(block_hashes=[vllm_hash(k) for k in keys[have:upto]], parent_block_hash=parent,
                            token_ids=prompt[have * BS: upto * BS], block_size=BS, medium="GPU")]

    def evict(self, prompt: list[int]) -> list:
        """Evict the deepest cached block of prompt's chain, when it is a leaf."""
        keys = [k for k in (tuple(prompt[: (i + 1) * BS]) for i in range(len(prompt) // BS)) if k in self.cached]
        if not keys:
            return []
        tail = max(keys, key=len)
        if any(len(k) == len(tail) + BS and k[: len(tail)] == tail for k in self.cached):
            return []  # another prompt's chain goes on from it
        self.cached.discard(tail)
        return [BlockRemoved(block_hashes=[vllm_hash(tail)], medium="GPU")]

    def clear(self) -> list:
        self.cached.clear()
        return [AllBlocksCleared()]

    def our_hashes(self) -> set[int]:
        return {block_hashes(list(k), BS)[-1] for k in self.cached}


# Four prompts of four blocks: 0 and 1 share two blocks, 2 shares one with them, 3 none.
PROMPTS = [
    list(range(8)) + [10] * 4 + [11] * 4,
    list(range(8)) + [20] * 4 + [21] * 4,
    list(range(4)) + [30] * 12,
    [40 + i for i in range(16)],
]


@pytest.fixture
def sockets():
    """Make publishers and subscribers; all closed after the test, no replay thread left."""
    made: list = []

    def make(kind, *args, **kwargs):
        obj = kind(*args, **kwargs)
        made.append(obj)
        return obj

    yield make
    for obj in reversed(made):
        if isinstance(obj, zmq.Context):
            obj.destroy(linger=0)
        else:
            obj.close()
    assert not [t for t in threading.enumerate() if t.name == "vllm-kv-replay"]


async def pair(sockets, *, replay: bool = True, buffer_steps: int = 10_000, encoding: str = "array",
               topic: str = "kv", replay_timeout_s: float = 2.0):
    pub = sockets(VllmKvPublisher, LOOPBACK, LOOPBACK if replay else None, topic=topic, buffer_steps=buffer_steps,
                  event_encoding=encoding)
    sub = sockets(VllmKvSubscriber, pub.endpoint, pub.replay_endpoint, topic, BS, replay_timeout_s)
    view = View()
    await joined(pub, sub, view)
    return pub, sub, view


# --------------------------------------------------------------------------- (a) the wire
async def test_published_frames_decode_with_the_pinned_structs_and_translate_to_our_hashes(sockets):
    prompt = PROMPTS[0]
    stored = BlockStored(block_hashes=[b"\x01" * 32, b"\x02" * 32], parent_block_hash=None, token_ids=prompt[:8],
                         block_size=BS, medium="GPU")
    rest = BlockStored(block_hashes=[7, 8], parent_block_hash=b"\x02" * 32, token_ids=prompt[8:], block_size=BS)
    pub = sockets(VllmKvPublisher, LOOPBACK, None, topic="kv-events")
    raw = sockets(zmq.Context)
    sub_raw = raw.socket(zmq.SUB)
    sub_raw.setsockopt(zmq.SUBSCRIBE, b"")
    sub_raw.setsockopt(zmq.LINGER, 0)
    sub_raw.connect(pub.endpoint)
    # Slow joiner: probe until one arrives, then the frames under test.
    deadline = time.monotonic() + WAIT_S
    while not sub_raw.poll(int(PROBE_EVERY_S * 1000)):
        assert time.monotonic() < deadline, "no probe arrived"
        pub.publish([])
    while sub_raw.poll(100):
        sub_raw.recv_multipart()
    seq = pub.publish([stored, rest], ts=1.5)
    assert sub_raw.poll(int(WAIT_S * 1000))
    parts = sub_raw.recv_multipart()
    sub_raw.close()
    assert parts[1] == seq.to_bytes(8, "big")
    topic, got_seq, batch = decode_frame(parts)
    assert (topic, got_seq, batch.ts, batch.events) == ("kv-events", seq, 1.5, [stored, rest])

    sub = sockets(VllmKvSubscriber, pub.endpoint, None, "kv-events", BS)
    view = View()
    await joined(pub, sub, view)
    last = pub.publish([stored, rest])
    await drain_to(sub, last, view)
    assert view.results[-1].stored == block_hashes(prompt, BS)


def test_published_frames_are_vllms_three_parts_and_a_replay_answer_ends_with_the_marker(sockets):
    pub = sockets(VllmKvPublisher, LOOPBACK, LOOPBACK, buffer_steps=3)
    for i in range(5):
        pub.publish([BlockRemoved(block_hashes=[i])], ts=float(i), drop=True)
    ctx = sockets(zmq.Context)
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(pub.replay_endpoint)
    dealer.send_multipart([b"", (0).to_bytes(8, "big")])
    answer = []
    while True:
        assert dealer.poll(int(WAIT_S * 1000)), "the replay did not answer"
        answer.append(dealer.recv_multipart())
        if answer[-1][2] == b"":
            break
    dealer.close()
    assert [len(a) for a in answer] == [3] * 4 and all(a[0] == b"" for a in answer)
    assert [int.from_bytes(a[1], "big", signed=True) for a in answer] == [2, 3, 4, -1]  # the buffer holds 3
    assert [decode_frame([b"", a[1], a[2]])[2].events for a in answer[:-1]] == [
        [BlockRemoved(block_hashes=[i])] for i in (2, 3, 4)]
    assert pub.num_dropped == 5 and pub.num_replay_requests == 1


# --------------------------------------------------------------------------- (b) replay
@pytest.mark.parametrize("encoding", ["array", "map"])
async def test_a_dropped_frame_is_replayed_and_the_view_is_the_servers_cache(sockets, encoding):
    pub, sub, view = await pair(sockets, encoding=encoding)
    server = ServerCache()
    replayed_before = sub.num_replayed
    pub.publish(server.store(PROMPTS[0], 3))
    pub.publish(server.store(PROMPTS[1], 4) + server.evict(PROMPTS[0]), drop=True)  # lost on PUB
    pub.publish(server.store(PROMPTS[3], 2), drop=True)
    last = pub.publish(server.store(PROMPTS[2], 4))
    await drain_to(sub, last, view)
    assert view.hashes == server.our_hashes() and len(view.hashes) == 2 + 2 + 2 + 3  # prompts 0 and 1 share two blocks, 2 one
    assert sub.num_replayed - replayed_before == 2 and sub.num_gaps_unfilled == 0 and not view.forgets
    assert [r.seq for r in view.results[-4:]] == list(range(last - 3, last + 1))


# --------------------------------------------------------------------------- (c) replay miss
@pytest.mark.parametrize("replay", ["buffer too small", "no replay socket", "replay silent"])
async def test_a_gap_the_replay_cannot_fill_forgets_everything_then_stores_rebuild(sockets, replay):
    if replay == "replay silent":  # a ROUTER that never answers
        ctx = sockets(zmq.Context)
        mute = ctx.socket(zmq.ROUTER)
        mute.setsockopt(zmq.LINGER, 0)
        port = mute.bind_to_random_port("tcp://127.0.0.1")
        pub = sockets(VllmKvPublisher, LOOPBACK, None, topic="kv")
        sub = sockets(VllmKvSubscriber, pub.endpoint, f"tcp://127.0.0.1:{port}", "kv", BS, 0.2, catch_up=False)
        view = View()
        await joined(pub, sub, view)
    else:
        pub, sub, view = await pair(sockets, replay=replay == "buffer too small", buffer_steps=1)
    server = ServerCache()
    pub.publish(server.store(PROMPTS[0], 2))
    pub.publish(server.store(PROMPTS[0], 1) + server.store(PROMPTS[1], 4), drop=True)
    seq = pub.publish(server.store(PROMPTS[0], 1))  # its parent was in the lost batch
    await drain_to(sub, seq, view)
    forget = view.results[-2]
    assert forget.cleared and forget.num_lost_batches == 1 and forget.seq == seq - 1
    assert sub.num_gaps_unfilled == 1 and sub.num_lost_batches == 1
    assert view.results[-1].num_unchainable_blocks == 1 and view.hashes == set()
    assert sub.num_replay_timeouts == (1 if replay == "replay silent" else 0)
    seq = pub.publish(server.store(PROMPTS[3], 4))  # a new chain from the root
    await drain_to(sub, seq, view)
    assert view.hashes == set(block_hashes(PROMPTS[3], BS)) and view.hashes <= server.our_hashes()
    if replay == "replay silent":
        mute.close()


# --------------------------------------------------------------------------- bad frames, restarts
async def test_bad_frames_are_counted_and_a_lost_batch_forgets_and_the_loop_goes_on(sockets):
    ctx = sockets(zmq.Context)
    raw = ctx.socket(zmq.PUB)
    raw.setsockopt(zmq.LINGER, 0)
    port = raw.bind_to_random_port("tcp://127.0.0.1")
    sub = sockets(VllmKvSubscriber, f"tcp://127.0.0.1:{port}", None, "", BS)
    encode = msgspec.msgpack.encode
    seq = 0

    def send(events: list) -> int:
        nonlocal seq
        seq += 1
        raw.send_multipart([b"", seq.to_bytes(8, "big"), encode(KVEventBatch(ts=0.0, events=events))])
        return seq

    view = View()

    async def probe() -> None:
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            s = send([])
            try:
                while (await asyncio.wait_for(sub.next(), PROBE_EVERY_S)).seq != s:
                    pass
                return
            except asyncio.TimeoutError:
                continue
        raise AssertionError("no probe arrived")

    await probe()
    raw.send_multipart([b"", b"\x00" * 8])  # two parts: no seq to blame
    raw.send_multipart([b"other", (999).to_bytes(8, "big"), encode(KVEventBatch(ts=0.0, events=[]))])  # not our topic
    seq += 1
    raw.send_multipart([b"", seq.to_bytes(8, "big"), b"\x92\xcb"])  # its batch does not decode: lost
    good = send(ServerCache().store(PROMPTS[3], 2))
    wrong_size = send([BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=[1] * 8, block_size=8)])
    after = send(ServerCache().store(PROMPTS[2], 1))
    await drain_to(sub, after, view)
    assert sub.num_bad_frames == 3 and sub.num_foreign_frames == 1
    assert [(r.seq, r.num_lost_batches) for r in view.forgets] == [(good - 1, 1), (wrong_size, 1)]
    assert view.hashes == set(block_hashes(PROMPTS[2], BS)[:1]) and sub.num_lost_batches == 2
    raw.close()


async def test_a_server_restart_starts_over_with_a_clear(sockets):
    pub, sub, view = await pair(sockets)
    server = ServerCache()
    for p in PROMPTS:
        pub.publish(server.store(p, 4))
    for _ in range(200):  # the new boot's seqs stay below this while the SUB reconnects
        last = pub.publish([])
    await drain_to(sub, last, view)
    assert view.hashes == server.our_hashes() and len(view.hashes) == 16 - 2 - 1  # shared blocks once
    endpoint, replay_endpoint = pub.endpoint, pub.replay_endpoint
    pub.close()
    pub = sockets(VllmKvPublisher, endpoint, replay_endpoint, topic="kv", bind=True)  # the same ports, seq from 0
    await joined(pub, sub, view)
    assert sub.num_restarts == 1 and view.hashes == set()
    restart = next(i for i, r in enumerate(view.results) if r.cleared and not r.num_lost_batches)
    after = [r.seq for r in view.results[restart + 1:]]
    assert after == list(range(len(after)))  # the new boot's probes, those missed while reconnecting replayed
    seq = pub.publish(ServerCache().store(PROMPTS[1], 4))
    await drain_to(sub, seq, view)
    assert view.hashes == set(block_hashes(PROMPTS[1], BS))


async def test_a_next_cancelled_anywhere_loses_no_batch(sockets):
    """Timeouts of 1 ms cut next() while it receives or while it waits for a replay."""
    pub, sub, view = await pair(sockets, replay_timeout_s=5.0)
    server = ServerCache()
    for i in range(12):
        pub.publish(server.store(PROMPTS[i % 4], 1) + server.evict(PROMPTS[(i + 2) % 4]), drop=i % 2 == 0)
        last = pub.publish(server.store(PROMPTS[(i + 1) % 4], 1))
        while True:  # read until a 1 ms timeout cuts a next() short
            try:
                view.apply(await asyncio.wait_for(sub.next(), 0.001))
            except asyncio.TimeoutError:
                break
    if view.results[-1].seq != last:
        await drain_to(sub, last, view)
    assert sub.num_replayed >= 6
    assert view.hashes == server.our_hashes() and not view.forgets and sub.num_gaps_unfilled == 0


# --------------------------------------------------------------------------- (d) the property
OPS = st.lists(
    st.tuples(
        st.lists(st.tuples(st.sampled_from(["store", "store", "evict", "clear"]), st.integers(0, 3), st.integers(1, 4)),
                 min_size=1, max_size=3),  # one batch's events
        st.booleans(),  # dropped on PUB
    ),
    max_size=12,
)


@settings(max_examples=40, deadline=None)
@given(OPS, st.sampled_from([10_000, 10_000, 2]), st.sampled_from([True, True, False]))
def test_the_subscribers_view_is_the_servers_cache_unless_a_gap_could_not_be_filled(ops, buffer_steps, with_replay):
    async def scenario() -> None:
        pub = VllmKvPublisher(LOOPBACK, LOOPBACK if with_replay else None, topic="kv", buffer_steps=buffer_steps)
        sub = VllmKvSubscriber(pub.endpoint, pub.replay_endpoint, "kv", BS, 0.5)
        try:
            view = View()
            await joined(pub, sub, view)
            server = ServerCache()
            for batch_ops, drop in ops:
                events = []
                for op, p, n in batch_ops:
                    events += (server.store(PROMPTS[p], n) if op == "store" else
                               server.evict(PROMPTS[p]) if op == "evict" else server.clear())
                pub.publish(events, drop=drop)
            last = pub.publish([])
            await drain_to(sub, last, view)
            assert view.hashes <= server.our_hashes()  # never a block the server does not hold
            event(f"gaps unfilled: {min(sub.num_gaps_unfilled, 1)}, replayed: {min(sub.num_replayed, 1)}")
            if sub.num_gaps_unfilled == 0:
                assert view.hashes == server.our_hashes()
            if with_replay and buffer_steps == 10_000:
                assert sub.num_gaps_unfilled == 0
            if any(drop for _, drop in ops) and not with_replay:
                assert sub.num_gaps_unfilled >= 1
        finally:
            sub.close()
            pub.close()

    asyncio.run(scenario())


# --------------------------------------------------------------------------- the operator's config
@pytest.mark.parametrize("config,host,rank,expected", [
    ('{"enable_kv_cache_events": true}', "10.0.0.7", 0, ("tcp://10.0.0.7:5557", None, "")),
    ('{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:6000", '
     '"replay_endpoint": "tcp://*:6001", "topic": "kv-events"}', "gpu-3", 2,
     ("tcp://gpu-3:6002", "tcp://gpu-3:6003", "kv-events")),
    ('{"enable_kv_cache_events": true, "endpoint": "tcp://[::]:5557", "replay_endpoint": "tcp://10.1.1.1:5558"}',
     "fd00::5", 0, ("tcp://[fd00::5]:5557", "tcp://10.1.1.1:5558", "")),
    ('{"enable_kv_cache_events": true, "endpoint": "ipc:///tmp/kv"}', "h", 1, ("ipc:///tmp/kv_dp1", None, "")),
], ids=["defaults", "dp-rank-2", "ipv6-and-bound-replay", "ipc"])
def test_the_operators_kv_events_config_gives_the_endpoints_to_connect_to(config, host, rank, expected):
    assert parse_kv_events_config(config, host, rank) == expected


@pytest.mark.parametrize("config,fragment", [
    ('{"enable_kv_cache_events": false}', "publishes no KV events"),
    ('{"enable_kv_cache_events": true, "publisher": "null"}', "publishes no KV events"),
    ('{"enable_kv_cache_events": true, "endpoint": "tcp://10.0.0.1:5557"}', "connects its PUB socket"),
    ('{"enable_kv_cache_events": true, "endpoint": "inproc://kv"}', "inside vLLM's process"),
    ("[1]", "JSON object"),
    ("{", "not JSON"),
])
def test_a_config_without_a_reachable_publisher_is_a_coded_error(config, fragment):
    with pytest.raises(VllmEventError, match=fragment) as info:
        parse_kv_events_config(config, "h")
    assert info.value.code == "invalid_request"


def test_closing_is_clean_and_idempotent_and_publishing_after_it_fails(sockets):
    pub = VllmKvPublisher(LOOPBACK, LOOPBACK)
    pub.close()
    pub.close()
    assert not [t for t in threading.enumerate() if t.name == "vllm-kv-replay"]
    with pytest.raises(RuntimeError, match="closed"):
        pub.publish([])


# --------------------------------------------------------------------------- the sim server as a vLLM
async def test_the_sim_servers_kv_events_give_the_engines_cache_in_our_hashes(sockets):
    """`flexlb sim-server --kv-events-endpoint`, in process: completions sharing a prefix on a
    small cache (so blocks are evicted too); the subscriber's view equals the engine's cache."""
    import json

    from workers.config import WorkerConfig
    from workers.openai.kv_zmq import vllm_block_hash
    from workers.sim_server.http import SimFront, SimHttpApp

    cfg = WorkerConfig(worker_id="kv", time_scale=0, block_size_tokens=BS, num_kv_blocks=48,
                       kv_events_endpoint=LOOPBACK, kv_events_replay_endpoint=LOOPBACK, kv_events_topic="kv").validate()
    front = SimFront(cfg)
    app = SimHttpApp(front)
    front.start()
    try:
        pub = front.kv_events.publisher
        sub = sockets(VllmKvSubscriber, pub.endpoint, pub.replay_endpoint, "kv", BS)
        view = View()
        await joined(pub, sub, view)

        async def complete(prompt: str) -> dict:
            status, raw = await asgi_call(app, "POST", "/v1/completions", {"prompt": prompt, "max_tokens": 3}, WAIT_S)
            assert status == 200, raw
            return json.loads(raw)

        system = "You are a helpful assistant. "  # 29 tokens: 7 shared blocks
        for wave in range(3):
            answers = await asyncio.gather(*(complete(f"{system}question {wave}.{i}: what is {i * 7}?")
                                             for i in range(5)))
            assert all(a["usage"]["completion_tokens"] == 3 for a in answers)
        last = pub.num_published - 1
        await drain_to(sub, last, view)
        cached = set(front.engine.all_cached_block_hashes())
        assert cached and view.hashes == cached
        assert any(r.removed for r in view.results)  # the cache was small enough to evict
        assert front.kv_events.num_unknown_stored == 0 and sub.num_gaps_unfilled == 0
        _, _, batch = decode_frame([b"kv", b"\0" * 8, pub._buffer[-1][1]])  # vLLM's hashes are not ours
        assert not {h for ev in batch.events for h in ev.block_hashes} & set(cached)
        assert {vllm_block_hash(h) for h in cached} <= {h for _, payload in pub._buffer
                                                          for ev in decode_frame([b"", b"\0" * 8, payload])[2].events
                                                          if isinstance(ev, BlockStored) for h in ev.block_hashes}
        metrics = front.metrics_text()
        assert f"flexlb_sim_kv_event_batches_total {pub.num_published}" in metrics
    finally:
        await front.stop()
