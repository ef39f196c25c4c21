"""vLLM's KV-cache events, as its ZMQ publisher sends them, translated into FlexLB's.

Part of the OpenAI-compatible engine agent (issue 13): the wire format and the translation;
the sockets are in workers/openai/kv_zmq.py.

Wire format (vLLM `vllm/distributed/kv_events.py`, `--kv-events-config`): a PUB socket sends
multipart frames `[topic, seq, payload]`: `seq` is an 8-byte big-endian signed integer, one
per batch, increasing by 1; `payload` is msgpack of a `KVEventBatch`. The structs below copy
vLLM's field for field, with vLLM's msgspec options: `array_like=True` (a struct is an array
of its fields in declaration order), `tag=True` on the events (the first array element is
the class name), `omit_defaults=True`. A `ExternalBlockHash` is `bytes | int` (vLLM hashes
blocks with a configurable function; both come over the wire). Golden frames encoded by hand
from this layout pin it (tests/unit/workers/openai/test_vllm_kv_events.py). Fields vLLM added later (`medium`,
`lora_id`, `data_parallel_rank`) default to None, so older publishers decode too; fields
newer than these structs (`lora_name`, `extra_keys`, `group_idx`, ...) are ignored.

Two encodings. vLLM PR #42892 (2026) dropped `array_like` from the event structs: newer
servers send each event as a msgpack map tagged under "type" (`{"type": "BlockStored",
"block_hashes": ...}`), inside the array envelope (seen from vLLM 0.26) or, in later source,
a map envelope (`{"ts": ..., "events": [...]}`). `decode_frame` tries the array form, then
map events in an array envelope, then the map envelope (the `*Map` structs at the end, which
subclass the array ones, so `isinstance(ev, BlockStored)` holds for either).

Translation. The router's prefix index keys blocks by FlexLB's chained hashes
(`schemas.tokens.block_hashes`), not vLLM's. A `BlockStored` carries the token ids of its
blocks and the vLLM hash of the parent of the first, so `VllmKvTranslator` recomputes our
hashes from the token ids, chained from the parent's digest that it remembered when that
parent was stored. A parent it never saw (events missed, or the agent started after the
server) cannot be chained: its blocks are counted in `num_unchainable_blocks` and left out
of our view (so are their children later, whose parents we then do not know either). That
is a partial view, not a wrong one; vLLM has no snapshot to ask for, so those blocks come
back only when the server stores them again. `BlockRemoved` maps vLLM hashes back to ours
(unknown ones are counted, not an error: they were stored before we listened).
`AllBlocksCleared` forgets everything. `accept(seq, ...)` checks the sequence: a gap is
reported so the caller can ask the replay socket for the missing batches.

A `Translated` is the net effect of one batch, applied in this order: if `cleared`, forget
everything; then drop `removed`; then add `stored`. A block stored then removed within one
batch appears in neither list (removed then stored again: in both, which that order makes
right).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Union

import msgspec

from schemas.tokens import ROOT_DIGEST, chain_block_hashes

ExternalBlockHash = Union[bytes, int]


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base class of vLLM's KV cache events."""


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]


_DECODER = msgspec.msgpack.Decoder(KVEventBatch)


class VllmEventError(ValueError):
    """A frame that is not vLLM's KV event format; `code` is "invalid_request"."""

    code = "invalid_request"


def decode_frame(parts: list[bytes]) -> tuple[str, int, KVEventBatch]:
    """(topic, seq, batch) of one multipart frame from vLLM's PUB socket."""
    if len(parts) != 3:
        raise VllmEventError(f"a KV event frame has 3 parts (topic, seq, payload), got {len(parts)}")
    topic, seq, payload = parts
    if len(seq) != 8:
        raise VllmEventError(f"the sequence part is 8 bytes, got {len(seq)}")
    return topic.decode(errors="replace"), int.from_bytes(seq, "big", signed=True), decode_payload(payload)


def decode_payload(payload: bytes) -> KVEventBatch:
    """A `KVEventBatch` from its msgpack, in either encoding (module docstring)."""
    first_error = None
    for decoder in _DECODERS:
        try:
            return decoder.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            first_error = first_error or exc
    raise VllmEventError(f"undecodable KV event batch: {first_error}")


@dataclass
class Translated:
    """What one batch means for FlexLB's KV events: apply `cleared`, then `removed`, then
    `stored` (module docstring)."""

    stored: list[int] = field(default_factory=list)  # our hashes, newly cached
    removed: list[int] = field(default_factory=list)  # our hashes, no longer cached
    cleared: bool = False  # forget every block of this server first (AllBlocksCleared, or lost batches)
    num_unchainable_blocks: int = 0  # stored blocks left out: their parent is unknown to us (a partial view)
    num_unknown_removed: int = 0  # removed vLLM hashes we never knew (stored before we listened)
    num_lost_batches: int = 0  # > 0 (with cleared): batches missed for good; set by the subscriber
    seq: int | None = None  # the batch's sequence number (the last lost one when num_lost_batches); set by the subscriber


class VllmKvTranslator:
    """vLLM block hashes -> FlexLB's, for one server (module docstring)."""

    def __init__(self, block_size_tokens: int) -> None:
        if block_size_tokens <= 0:
            raise ValueError("block_size_tokens must be positive")
        self.block_size_tokens = block_size_tokens
        self._ours: dict[ExternalBlockHash, tuple[int, bytes]] = {}  # vLLM hash -> (our hash, our digest)
        self.last_seq: int | None = None

    def __len__(self) -> int:
        return len(self._ours)

    def accept(self, seq: int) -> list[int]:
        """Record a batch's sequence number; returns the missing ones before it (a gap: ask
        the replay socket for them), [] when it follows on. A number at or below the last
        one (a replayed duplicate) returns [] and changes nothing."""
        if self.last_seq is None or seq == self.last_seq + 1:
            self.last_seq = seq
            return []
        if seq <= self.last_seq:
            return []
        missing = list(range(self.last_seq + 1, seq))
        self.last_seq = seq
        return missing

    def translate(self, batch: KVEventBatch) -> Translated:
        out = Translated()
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                self._stored(ev, out)
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    ours = self._ours.pop(h, None)
                    if ours is None:
                        out.num_unknown_removed += 1
                    elif ours[0] in out.stored:  # stored earlier in this batch: net effect nothing
                        out.stored.remove(ours[0])
                    else:
                        out.removed.append(ours[0])
            else:  # AllBlocksCleared
                self._ours.clear()
                out.stored.clear()
                out.removed.clear()
                out.cleared = True
        return out

    def _stored(self, ev: BlockStored, out: Translated) -> None:
        if ev.block_size != self.block_size_tokens:
            raise VllmEventError(f"the server's block size is {ev.block_size}, this worker reports {self.block_size_tokens}")
        if ev.parent_block_hash is None:
            parent = ROOT_DIGEST
        elif ev.parent_block_hash in self._ours:
            parent = self._ours[ev.parent_block_hash][1]
        else:
            out.num_unchainable_blocks += len(ev.block_hashes)  # its chain started before we listened
            return
        chained = chain_block_hashes(ev.token_ids, self.block_size_tokens, parent)
        if len(chained) != len(ev.block_hashes):
            raise VllmEventError(f"BlockStored has {len(ev.block_hashes)} hashes for {len(ev.token_ids)} tokens "
                                 f"of blocks of {ev.block_size}")
        for theirs, (ours, digest) in zip(ev.block_hashes, chained):
            self._ours[theirs] = (ours, digest)
            out.stored.append(ours)


# vLLM >= PR #42892: events as maps tagged under "type" (module docstring). Subclasses of the
# array structs, so the translator's isinstance checks hold for both.
class BlockStoredMap(BlockStored, array_like=False, tag="BlockStored"):
    pass


class BlockRemovedMap(BlockRemoved, array_like=False, tag="BlockRemoved"):
    pass


class AllBlocksClearedMap(AllBlocksCleared, array_like=False, tag="AllBlocksCleared"):
    pass


class KVEventBatchMapEvents(KVEventBatch):
    """Array envelope, map events (vLLM 0.26)."""

    events: list[Union[BlockStoredMap, BlockRemovedMap, AllBlocksClearedMap]]


class KVEventBatchMap(KVEventBatchMapEvents, array_like=False):
    """Map envelope, map events (vLLM's later source)."""


_DECODERS = (_DECODER, msgspec.msgpack.Decoder(KVEventBatchMapEvents), msgspec.msgpack.Decoder(KVEventBatchMap))
