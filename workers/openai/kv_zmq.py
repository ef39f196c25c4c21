"""vLLM's KV-event sockets: its publisher (for tests and the simulated server) and our subscriber.

The wire format and the translation into FlexLB's hashes are in workers/openai/kv_events.py;
this module is the transport, after vLLM's `ZmqEventPublisher` (vllm/distributed/kv_events.py)
and its example subscriber (examples/online_serving/kv_events_subscriber.py).

Protocol. A PUB socket (`endpoint`, default `tcp://*:5557`) sends each batch as the
multipart frame `[topic, seq, payload]`: `seq` counts batches from 0 (+1 each, 8 bytes big
endian, restarting at 0 when the server restarts), `payload` is msgpack of a `KVEventBatch`.
An optional ROUTER socket (`replay_endpoint`, e.g. `tcp://*:5558`) keeps the last
`buffer_steps` (default 10000) `(seq, payload)`; on a request `[client_id, b"", start_seq]`
it sends `[client_id, b"", seq, payload]` for every buffered seq >= start_seq, then the end
marker `[client_id, b"", -1 (8 bytes, signed), b""]`. Like vLLM, an endpoint with `*` or
`::` (or ipc://, inproc://) is bound, any other PUB endpoint is connected to (the publisher's
`bind=True` binds `tcp://127.0.0.1:PORT` too); the replay socket is always bound.

`VllmKvPublisher` (blocking, any thread): `publish(events, ts, drop=)` encodes a batch, gives
it the next seq, keeps it for replay and sends it on PUB, unless `drop=True` (kept for
replay, not sent: a lost frame, for tests). A background thread owns the ROUTER socket and
answers replay requests; `close()` stops and joins it and closes both sockets. Parameters:
`topic` (default ""), `buffer_steps` (default 10000; small ones simulate a replay miss),
`event_encoding` ("array", the default: vLLM before PR #42892; "map": events as tagged
maps in the array envelope, as vLLM 0.26 sends), `hwm` (PUB send high-water mark, default
100000 as vLLM's), `bind` (None: vLLM's rule above). Its `endpoint` / `replay_endpoint`
are the bound addresses (a `:*` port resolved by the OS), to connect to.

`VllmKvSubscriber` (asyncio): a SUB socket on `endpoint` filtered by `topic` (ZMQ filters by
prefix; frames whose topic is not exactly ours are counted in `num_foreign_frames` and
skipped), and a DEALER socket on `replay_endpoint`. DEALER, not vLLM's example REQ: a REQ
socket takes exactly one reply per request, while the replay answers one request with many
frames; a DEALER sends `[b"", start_seq]` (the empty delimiter the ROUTER expects) and
receives every `[b"", seq, payload]` up to the end marker. `await next()` (or `async for`)
returns one `Translated` per batch, in seq order (`Translated.seq` set):

- A batch that follows on (seq = last + 1) is translated.
- A gap (seq > last + 1): the missing seqs are asked of the replay socket and translated
  first (`num_replayed`). When some cannot be had (no replay socket, the replay is silent
  for `replay_timeout_s` (default 2 s) between frames, the buffer no longer holds them, or
  they do not decode), our view may be wrong and vLLM has no snapshot to ask for: the
  subscriber forgets it, returning `Translated(cleared=True, num_lost_batches=N, seq=the
  last lost seq)`, counts `num_gaps_unfilled`, then translates the replayed batches after
  the last lost one, then this one. The server's blocks cached before come back only as it
  stores them again (vLLM announces a block once, when it is cached).
- The first batch (or the first after a restart) with seq > 0: the history before it is
  asked of the replay socket (`catch_up`, default True); what it still holds is translated,
  the rest is simply not known (nothing to forget; later stores under unknown parents count
  in `Translated.num_unchainable_blocks`). This also covers ZMQ's slow joiner: the batches a
  new SUB missed while connecting come from the replay.
- seq <= last on the SUB socket (which never repeats a frame): the server restarted with an
  empty cache: `Translated(cleared=True)` (`num_restarts`), then the batch as a first one. A
  restart that we notice only after the new seq has passed our last one looks like a gap
  and is not detected (vLLM frames carry no boot id).
- A frame that does not decode, or a batch that does not translate (block size, hash
  count): logged and counted in `num_bad_frames`, never raised; when its seq is readable
  that batch is lost (the view is forgotten as above); without one, the next good batch
  shows a gap.

`next()` can be cancelled (e.g. by a timeout) without losing a frame or a replay: the SUB
receive in progress, the frame in hand and its replay (a task) go on and are taken up by the
next call. `close()` (synchronous) closes the sockets and the context; a `next()` waiting
then raises CancelledError. Counters: `num_batches` (translated, live or replayed),
`num_replayed`, `num_gaps_unfilled`, `num_lost_batches`, `num_bad_frames`,
`num_foreign_frames`, `num_restarts`, `num_replay_requests`, `num_replay_timeouts`.

`EngineKvPublisher`: our engines (workers/engines/sim.py, torch) as a vLLM server would
publish them, for `flexlb sim-server --kv-events-endpoint` (workers/sim_server/http.py). A step's
`blocks_stored` / `blocks_removed` hold our hashes, but a vLLM BlockStored needs each block's
token ids and its parent: `note_prompt(token_ids)` (at every submission) remembers, for
each full block of the prompt, our hash -> (its token ids, its parent's hash), in an LRU of
`max_known_blocks` (default 262144) blocks. Our engines (sim and torch) cache prompt blocks
only, so every stored block was noted, unless over a quarter million distinct blocks were
submitted since (then it is skipped, logged and counted in `num_unknown_stored`).
`publish_step(stored, removed)` sends one batch per step that changed the cache (none otherwise, as vLLM): the
BlockStored events first (a run of blocks each the child of the one before is one event,
its parent the run's first block's parent), then one BlockRemoved (the step's lists are its
net change, disjoint, so this order only keeps chains followable). vLLM's hashes are
`vllm_block_hash(ours)`, a different 64-bit hash of ours, so a consumer cannot pass them
through and must recompute ours from the token ids, as it must for a real vLLM. A batch the
PUB socket refuses is logged and counted (`num_publish_errors`), the engine goes on.

`parse_kv_events_config(json_text, host)`: the JSON given to `vllm serve --kv-events-config`
-> (endpoint, replay_endpoint, topic) to connect to on `host`, with vLLM's port offset per
data-parallel rank.

Imports: `schemas` and `workers` only (and pyzmq, the `openai` extra).

One module over 500 lines: both ends of vLLM's KV-event wire (the subscriber the agent runs
and the publisher the sim-server runs) share its frame format, sequence and replay rules.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import json
import logging
import re
import threading
import time
from typing import Any, Literal

import msgspec
import zmq
import zmq.asyncio

from schemas.tokens import ROOT_DIGEST, chain_block_hashes
from workers.openai.kv_events import (
    AllBlocksCleared,
    AllBlocksClearedMap,
    BlockRemoved,
    BlockRemovedMap,
    BlockStored,
    BlockStoredMap,
    KVEventBatch,
    KVEventBatchMapEvents,
    Translated,
    VllmEventError,
    VllmKvTranslator,
    decode_frame,
    decode_payload,
)

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay's end marker, with an empty payload
REPLAY_TIMEOUT_S = 2.0  # longest silence of the replay socket between two frames of one answer
DEFAULT_BUFFER_STEPS = 10_000  # vLLM's default replay buffer, in batches
DEFAULT_HWM = 100_000  # vLLM's PUB high-water mark, in messages; also our SUB's receive one
_POLL_MS = 50  # the replay thread checks for close() this often

EventEncoding = Literal["array", "map"]


def vllm_binds(endpoint: str) -> bool:
    """Whether vLLM binds (True) or connects (False) its PUB socket for `endpoint`."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def _to_map(ev: Any) -> Any:
    if isinstance(ev, BlockStored):
        return BlockStoredMap(**msgspec.structs.asdict(ev))
    if isinstance(ev, BlockRemoved):
        return BlockRemovedMap(**msgspec.structs.asdict(ev))
    if isinstance(ev, AllBlocksCleared):
        return AllBlocksClearedMap()
    raise TypeError(f"not a vLLM KV event: {ev!r}")


class VllmKvPublisher:
    """vLLM's side of the KV event sockets (module docstring)."""

    def __init__(self, endpoint: str = "tcp://*:5557", replay_endpoint: str | None = None, *, topic: str = "",
                 buffer_steps: int = DEFAULT_BUFFER_STEPS, event_encoding: EventEncoding = "array",
                 hwm: int = DEFAULT_HWM, bind: bool | None = None) -> None:
        if buffer_steps <= 0:
            raise ValueError("buffer_steps must be positive")
        if event_encoding not in ("array", "map"):
            raise ValueError(f"event_encoding is 'array' or 'map', got {event_encoding!r}")
        self.topic = topic
        self.event_encoding = event_encoding
        self._topic_bytes = topic.encode()
        self._encoder = msgspec.msgpack.Encoder()
        self._lock = threading.Lock()  # the PUB socket, the seq counter and the buffer
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=buffer_steps)
        self._next_seq = 0
        self.num_published = 0  # batches given a seq, dropped ones included
        self.num_dropped = 0  # batches kept for replay but not sent (drop=True)
        self.num_replay_requests = 0
        self.num_bad_replay_requests = 0  # not [client_id, b"", start_seq]: logged, ignored
        self._closed = False
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._router: zmq.Socket | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        try:
            self._pub.set_hwm(hwm)
            if vllm_binds(endpoint) if bind is None else bind:
                self._pub.bind(endpoint)
                self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                self._pub.connect(endpoint)
                self.endpoint = endpoint
            self.replay_endpoint: str | None = None
            if replay_endpoint is not None:
                self._router = self._ctx.socket(zmq.ROUTER)
                self._router.bind(replay_endpoint)
                self.replay_endpoint = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError:
            self._ctx.destroy(linger=0)
            raise
        if self._router is not None:
            self._thread = threading.Thread(target=self._serve_replay, name="vllm-kv-replay", daemon=True)
            self._thread.start()

    def publish(self, events: list, ts: float | None = None, *, drop: bool = False) -> int:
        """Send one batch of vLLM KV events; returns its seq. `drop`: keep it for replay only."""
        batch_ts = time.time() if ts is None else ts
        if self.event_encoding == "map":
            batch: KVEventBatch = KVEventBatchMapEvents(ts=batch_ts, events=[_to_map(ev) for ev in events])
        else:
            batch = KVEventBatch(ts=batch_ts, events=list(events))
        payload = self._encoder.encode(batch)
        with self._lock:
            if self._closed:
                raise RuntimeError("the publisher is closed")
            seq = self._next_seq
            self._next_seq += 1
            self._buffer.append((seq, payload))
            self.num_published += 1
            if drop:
                self.num_dropped += 1
            else:
                self._pub.send_multipart([self._topic_bytes, seq.to_bytes(8, "big"), payload])
        return seq

    def _serve_replay(self) -> None:
        assert self._router is not None
        router = self._router
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                try:
                    if not poller.poll(_POLL_MS):
                        continue
                    frame = router.recv_multipart()
                    if len(frame) != 3 or frame[1] != b"" or len(frame[2]) != 8:
                        self.num_bad_replay_requests += 1
                        log.warning("replay: a request is [client_id, b'', start_seq (8 bytes)], got %d parts", len(frame))
                        continue
                    self.num_replay_requests += 1
                    client, _, start = frame
                    start_seq = int.from_bytes(start, "big")
                    with self._lock:
                        answer = [(s, p) for s, p in self._buffer if s >= start_seq]
                    for s, p in answer:
                        router.send_multipart([client, b"", s.to_bytes(8, "big"), p])
                    router.send_multipart([client, b"", END_SEQ, b""])
                except zmq.ZMQError as exc:  # keep serving; a broken socket shows in every loop's log line
                    log.error("replay: %s", exc)
                    self._stop.wait(_POLL_MS / 1000)
        finally:
            router.close(linger=0)

    def close(self) -> None:
        """Stop the replay thread, close both sockets and the context. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._pub.close(linger=0)
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=10)
            if self._thread.is_alive():
                raise RuntimeError("the replay thread did not stop within 10 s")
        self._ctx.term()

    def __enter__(self) -> VllmKvPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _seq_of(parts: list[bytes]) -> int | None:
    """The seq of a frame that did not decode, when it has one."""
    if len(parts) == 3 and len(parts[1]) == 8:
        return int.from_bytes(parts[1], "big", signed=True)
    return None


class VllmKvSubscriber:
    """Our side: vLLM KV event batches, gaps replayed, translated into our hashes (module docstring)."""

    def __init__(self, endpoint: str, replay_endpoint: str | None, topic: str, block_size_tokens: int,
                 replay_timeout_s: float = REPLAY_TIMEOUT_S, *, catch_up: bool = True) -> None:
        if replay_timeout_s <= 0:
            raise ValueError("replay_timeout_s must be positive")
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self._topic_bytes = topic.encode()
        self.block_size_tokens = block_size_tokens
        self.replay_timeout_s = replay_timeout_s
        self.catch_up = catch_up
        self._tr = VllmKvTranslator(block_size_tokens)
        self._pending: collections.deque[Translated] = collections.deque()
        self._held: tuple[int, KVEventBatch | None] | None = None  # a frame decoded but not yet handled
        self._recv: asyncio.Future | None = None  # the SUB receive in progress, kept across a cancelled next()
        self._replaying: tuple[range, asyncio.Future | None] | None = None  # for the held frame: missing seqs, replay
        self.num_batches = 0
        self.num_replayed = 0
        self.num_gaps_unfilled = 0
        self.num_lost_batches = 0
        self.num_bad_frames = 0
        self.num_foreign_frames = 0
        self.num_restarts = 0
        self.num_replay_requests = 0
        self.num_replay_timeouts = 0
        self._closed = False
        self._ctx = zmq.asyncio.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.set_hwm(DEFAULT_HWM)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._sub.connect(endpoint)
        self._dealer: zmq.asyncio.Socket | None = None
        self._new_dealer()

    @property
    def last_seq(self) -> int | None:
        """The seq of the last batch handled (translated or lost)."""
        return self._tr.last_seq

    def _new_dealer(self) -> None:
        if self._dealer is not None:
            self._dealer.close(linger=0)  # drops a request still queued and any late answer to it
            self._dealer = None
        if self.replay_endpoint is not None and not self._closed:
            self._dealer = self._ctx.socket(zmq.DEALER)
            self._dealer.connect(self.replay_endpoint)

    def __aiter__(self) -> VllmKvSubscriber:
        return self

    async def __anext__(self) -> Translated:
        return await self.next()

    async def next(self) -> Translated:
        """The next batch's translation, in seq order (module docstring)."""
        while not self._pending:
            if self._closed:
                raise RuntimeError("the subscriber is closed")
            if self._held is None:
                if self._recv is None:
                    self._recv = asyncio.ensure_future(self._sub.recv_multipart())
                parts = await asyncio.shield(self._recv)  # cancelled here, the frame waits in self._recv
                self._recv = None
                self._held = self._decode(parts)
                if self._held is None:
                    continue
            seq, batch = self._held
            if self._replaying is None:
                missing = self._missing_before(seq)
                self._replaying = (missing, asyncio.ensure_future(self._replay(missing)) if missing else None)
            missing, replay = self._replaying
            replayed = {} if replay is None else await asyncio.shield(replay)  # cancelled here, it goes on
            self._held = self._replaying = None
            self._handle(seq, batch, missing, replayed)
        return self._pending.popleft()

    def _decode(self, parts: list[bytes]) -> tuple[int, KVEventBatch | None] | None:
        if len(parts) == 3 and parts[0] != self._topic_bytes:
            self.num_foreign_frames += 1
            return None
        try:
            _, seq, batch = decode_frame(parts)
        except VllmEventError as exc:
            self.num_bad_frames += 1
            seq = _seq_of(parts)
            log.warning("KV events from %s: bad frame (seq %s): %s", self.endpoint, seq, exc)
            return None if seq is None else (seq, None)
        return seq, batch

    def _missing_before(self, seq: int) -> range:
        """The seqs to ask the replay for before batch `seq` (module docstring)."""
        last = self._tr.last_seq
        if last is None or seq <= last:  # the first batch, or the first after a restart
            return range(0, seq) if self.catch_up and seq > 0 and self._dealer is not None else range(0)
        return range(last + 1, seq)

    def _handle(self, seq: int, batch: KVEventBatch | None, missing: range, replayed: dict[int, KVEventBatch]) -> None:
        last = self._tr.last_seq
        restarted = last is not None and seq <= last
        starting = last is None or restarted
        if restarted:
            self.num_restarts += 1
            log.warning("KV events from %s: seq %d after %d: the server restarted; forgetting its blocks",
                        self.endpoint, seq, last)
            self._tr = VllmKvTranslator(self.block_size_tokens)
            self._pending.append(Translated(cleared=True))
        first = missing.start
        lost = [s for s in missing if s not in replayed]
        if lost:
            first = lost[-1] + 1
            if starting:
                log.info("KV events from %s: seqs %d..%d are no longer replayable; starting from %d",
                         self.endpoint, lost[0], lost[-1], first)
            else:
                self.num_gaps_unfilled += 1
                log.warning("KV events from %s: %d of the batches %d..%d lost for good; forgetting the server's blocks",
                            self.endpoint, len(lost), missing.start, missing.stop - 1)
                self._forget(len(lost), lost[-1])
        for s in range(first, missing.stop):
            self._apply(s, replayed[s], is_replayed=True)
        self._tr.last_seq = seq
        if batch is None:
            self._forget(1, seq)  # its frame did not decode (counted in _decode)
        else:
            self._apply(seq, batch, is_replayed=False)

    def _forget(self, num_lost: int, seq: int) -> None:
        self.num_lost_batches += num_lost
        last = self._tr.last_seq
        self._tr = VllmKvTranslator(self.block_size_tokens)
        self._tr.last_seq = last
        self._pending.append(Translated(cleared=True, num_lost_batches=num_lost, seq=seq))

    def _apply(self, seq: int, batch: KVEventBatch, *, is_replayed: bool) -> None:
        try:
            out = self._tr.translate(batch)
        except VllmEventError as exc:  # the translator may have applied part of it: forget
            self.num_bad_frames += 1
            log.error("KV events from %s: batch %d does not translate: %s", self.endpoint, seq, exc)
            self._forget(1, seq)
            return
        out.seq = seq
        self.num_batches += 1
        self.num_replayed += int(is_replayed)
        self._pending.append(out)

    async def _replay(self, missing: range) -> dict[int, KVEventBatch]:
        """The batches of `missing` that the replay socket still has (possibly none)."""
        if self._dealer is None:
            return {}
        dealer = self._dealer
        got: dict[int, KVEventBatch] = {}
        self.num_replay_requests += 1
        try:
            await dealer.send_multipart([b"", missing.start.to_bytes(8, "big")])  # queued while connecting
            while True:
                if not await dealer.poll(int(self.replay_timeout_s * 1000), zmq.POLLIN):
                    self.num_replay_timeouts += 1
                    log.warning("KV events from %s: the replay socket %s was silent for %.1f s",
                                self.endpoint, self.replay_endpoint, self.replay_timeout_s)
                    self._new_dealer()
                    return got
                parts = await dealer.recv_multipart()
                if len(parts) != 3 or parts[0] != b"" or len(parts[1]) != 8:
                    self.num_bad_frames += 1
                    log.warning("KV events from %s: a replay frame is [b'', seq, payload], got %d parts",
                                self.endpoint, len(parts))
                    continue
                if parts[1] == END_SEQ and parts[2] == b"":
                    return got
                s = int.from_bytes(parts[1], "big", signed=True)
                if s not in missing:  # later ones come on the SUB socket too
                    continue
                try:
                    got[s] = decode_payload(parts[2])
                except VllmEventError as exc:
                    self.num_bad_frames += 1
                    log.warning("KV events from %s: replayed batch %d: %s", self.endpoint, s, exc)
        except zmq.ZMQError as exc:  # a broken replay socket: what it sent so far, a fresh socket next time
            log.error("KV events from %s: replay socket %s: %s", self.endpoint, self.replay_endpoint, exc)
            self._new_dealer()
            return got
        except asyncio.CancelledError:  # close()
            self._new_dealer()
            raise

    def close(self) -> None:
        """Close the sockets and the context. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._recv is not None:
            self._recv.cancel()
            self._recv = None
        if self._replaying is not None and self._replaying[1] is not None:
            self._replaying[1].cancel()
        self._replaying = None
        self._sub.close(linger=0)
        if self._dealer is not None:
            self._dealer.close(linger=0)
            self._dealer = None
        self._ctx.term()


def vllm_block_hash(ours: int) -> int:
    """The vLLM-side hash our stand-in server publishes for our block hash `ours` (unsigned 64 bits)."""
    digest = hashlib.blake2b(ours.to_bytes(8, "little"), digest_size=8, person=b"flexlb-vllm-sim").digest()
    return int.from_bytes(digest, "big")


class EngineKvPublisher:
    """Our engine's cache changes as vLLM KV events (module docstring)."""

    def __init__(self, endpoint: str, replay_endpoint: str | None, topic: str, block_size_tokens: int, *,
                 max_known_blocks: int = 262_144, buffer_steps: int = DEFAULT_BUFFER_STEPS) -> None:
        if max_known_blocks <= 0:
            raise ValueError("max_known_blocks must be positive")
        self.block_size_tokens = block_size_tokens
        self.max_known_blocks = max_known_blocks
        # our hash -> (the block's token ids, our hash of its parent or None), least recently noted first
        self._known: collections.OrderedDict[int, tuple[list[int], int | None]] = collections.OrderedDict()
        self.num_unknown_stored = 0  # stored blocks skipped: not among the noted prompts' blocks
        self.num_publish_errors = 0  # steps whose batch the PUB socket refused (logged)
        self.publisher = VllmKvPublisher(endpoint, replay_endpoint, topic=topic, buffer_steps=buffer_steps)
        log.info("KV events: publishing on %s (replay %s, topic %r)", self.publisher.endpoint,
                 self.publisher.replay_endpoint or "none", topic)

    def note_prompt(self, token_ids: list[int]) -> None:
        """Remember the full blocks of a submitted prompt (their tokens and parents)."""
        bs = self.block_size_tokens
        parent = None
        for i, (ours, _) in enumerate(chain_block_hashes(token_ids, bs, ROOT_DIGEST)):
            if ours in self._known:
                self._known.move_to_end(ours)
            else:
                self._known[ours] = (list(token_ids[i * bs:(i + 1) * bs]), parent)
            parent = ours
        while len(self._known) > self.max_known_blocks:
            self._known.popitem(last=False)

    def publish_step(self, blocks_stored: list[int], blocks_removed: list[int]) -> int | None:
        """One batch for a step's cache change; its seq, None when the step changed nothing."""
        events: list = []
        run: list[int] = []  # our hashes of the BlockStored being built, each the child of the one before
        num_unknown = 0

        def flush() -> None:
            if run:
                parent = self._known[run[0]][1]
                events.append(BlockStored(
                    block_hashes=[vllm_block_hash(h) for h in run],
                    parent_block_hash=None if parent is None else vllm_block_hash(parent),
                    token_ids=[t for h in run for t in self._known[h][0]], block_size=self.block_size_tokens,
                    medium="GPU"))
                run.clear()

        for h in blocks_stored:
            entry = self._known.get(h)
            if entry is None:
                num_unknown += 1
                flush()
                continue
            if run and entry[1] != run[-1]:
                flush()
            run.append(h)
        flush()
        if num_unknown:
            self.num_unknown_stored += num_unknown
            log.warning("KV events: %d stored blocks of no noted prompt not published (%d in all)",
                        num_unknown, self.num_unknown_stored)
        if blocks_removed:
            events.append(BlockRemoved(block_hashes=[vllm_block_hash(h) for h in blocks_removed], medium="GPU"))
        if not events:
            return None
        try:
            return self.publisher.publish(events)
        except zmq.ZMQError as exc:  # the engine goes on; the gap shows at the subscriber
            self.num_publish_errors += 1
            log.error("KV events: publishing a step failed: %s", exc)
            return None

    def close(self) -> None:
        self.publisher.close()


_TCP = re.compile(r"^tcp://(?P<host>\[[^\]]*\]|[^/]*):(?P<port>\d+)$")
_ANY_HOST = {"*", "0.0.0.0", "::", "[::]", "[*]", ""}


def _with_rank(endpoint: str, rank: int) -> str:
    """vLLM's `ZmqEventPublisher.offset_endpoint_port`: rank r publishes on port + r."""
    if rank == 0:
        return endpoint
    if endpoint.startswith(("inproc://", "ipc://")):
        return f"{endpoint}_dp{rank}"
    m = _TCP.match(endpoint)
    if not m:
        raise VllmEventError(f"unsupported KV events endpoint {endpoint!r}")
    return f"tcp://{m['host']}:{int(m['port']) + rank}"


def _connectable(endpoint: str, host: str, what: str) -> str:
    if endpoint.startswith("ipc://"):
        return endpoint  # same machine
    if endpoint.startswith("inproc://"):
        raise VllmEventError(f"the {what} endpoint {endpoint!r} is inside vLLM's process")
    m = _TCP.match(endpoint)
    if not m:
        raise VllmEventError(f"unsupported {what} endpoint {endpoint!r}")
    if m["host"] not in _ANY_HOST:
        return endpoint
    shown = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"tcp://{shown}:{m['port']}"


def parse_kv_events_config(json_text: str, host: str, data_parallel_rank: int = 0) -> tuple[str, str | None, str]:
    """(endpoint, replay_endpoint, topic) to connect to, from the JSON an operator gave
    `vllm serve --kv-events-config` for the server on `host` (vLLM's defaults: endpoint
    `tcp://*:5557`, no replay, topic ""). A wildcard host becomes `host`; data-parallel rank
    r is on port + r. Raises VllmEventError when the server publishes no events, or its PUB
    socket connects out (an endpoint without `*` or `::`: FlexLB's SUB connects, it does
    not bind)."""
    try:
        cfg = json.loads(json_text)
    except json.JSONDecodeError as exc:
        raise VllmEventError(f"--kv-events-config is not JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise VllmEventError("--kv-events-config is a JSON object")
    publisher = cfg.get("publisher") or ("zmq" if cfg.get("enable_kv_cache_events") else "null")
    if not cfg.get("enable_kv_cache_events") or publisher != "zmq":
        raise VllmEventError("the server publishes no KV events (enable_kv_cache_events false or publisher not zmq)")
    endpoint = _with_rank(str(cfg.get("endpoint") or "tcp://*:5557"), data_parallel_rank)
    if not vllm_binds(endpoint):
        raise VllmEventError(f"vLLM connects its PUB socket to {endpoint!r} instead of binding it; "
                             "FlexLB's subscriber connects: give vLLM tcp://*:PORT")
    replay = cfg.get("replay_endpoint")
    replay_endpoint = None if not replay else _connectable(_with_rank(str(replay), data_parallel_rank), host, "replay")
    return _connectable(endpoint, host, "KV events"), replay_endpoint, str(cfg.get("topic") or "")
