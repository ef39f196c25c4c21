"""The simulated engine: the shared scheduler (workers/engines/scheduler.py, vLLM V1's or
SGLang's) over a pure, deterministic model of step time, KV blocks and the prefix cache.

The worker agent and the HTTP front drive it through the engine contract
(workers/engines/base.py). Nothing here reads a clock, draws a random number or does I/O
(but `load_profile`); the caller sleeps each step's modelled `duration_ms`.

Parameters of `SimEngine`: `profile`, the `TimingProfile` (`load_profile(None)`: llama2-70b
on H100 TP8, fitted on Splitwise), then the scheduler's (workers/engines/scheduler.py; its
`lora_adapters` and `max_loras` are the adapters it serves and its slots), and
`lora_load_ms` (DEFAULT_LORA_LOAD_MS, 20): the modelled time of loading one adapter into a
slot (below).
Its output tokens are `sim_token_id(request id, index)`, and a request generates exactly
max_tokens (finish_reason "length").

Step time (`TimingProfile`, a data file; default: llama2-70b on H100 TP8, fitted on Splitwise),
for the chunks (c tokens computed before, k computed now) and decoding sequences of one step:
  prefill part = prefill_base_ms + prefill_per_token_ms * Σk
                 + prefill_per_token_sq_ms * Σ((c + k)² − c²)          (if any chunk)
  decode part  = decode_per_seq_ms * num_decoding
                 + decode_per_context_token_ms * Σ(context of each decoding sequence)
  step_ms      = prefill part + decode part, plus decode_base_ms when the step has no chunk
plus lora_load_ms for each adapter the step loads (`StepResult.lora_loads`: admission of a
sequence whose adapter was not in a slot), charged to the batch of the sequence it was
loaded for while that one is still in its prefill. The default 20 ms is an assumption, not a
measurement (no bench report has one yet): set it from the served model's adapter load time.
A pure prefill step of whole prompts (c = cached tokens) is the profile's prefill formula and
a pure decode step its decode formula: the fixed cost of a step (weights read once) is paid
once, the prefill's base when a chunk is present. A chunk's share of a step, used to report a
batch's prefill time (`prefill_ms_by_batch`), is its own linear and quadratic terms plus the
base in proportion to its k; the decode part belongs to no batch.

KV blocks and the prefix cache (the vLLM design):
- a running sequence holds ceil(tokens with KV / block_size_tokens) blocks: its prompt and
  the tokens generated so far (role prefill: the prompt only), grown as it computes.
- prompt block hashes are `schemas.tokens.block_hashes` (full blocks only). The prefix hit
  is the number of leading hashes in the cache; cached tokens = hits × block size, but a
  hit covering every known token is cut by one block (at least one token is computed). Hit
  blocks are shared (refcount); only the rest is allocated.
- as a prompt's full blocks are computed (after each chunk; role decode: on admission) they
  are registered in the cache, still pinned by the sequence. A block whose hash is already
  cached stays private to it.
- on finish / cancel / hand-off / preemption the sequence unpins: private blocks become free,
  cached blocks with no other user become evictable, appended to the LRU list tail block
  first, so a prompt's tail is evicted before its head (a chained prefix stays usable longest).
- allocation evicts least-recently-used evictable blocks when free blocks run short.
- invariant: free + used (private or pinned) + evictable == num_kv_blocks; waiting sequences
  hold no block.
- `blocks_stored` / `blocks_removed` of a step are the net change of the cache's hash set
  over that step (disjoint lists: a hash stored and evicted in one step is in neither).
"""

from __future__ import annotations

import hashlib
import importlib.resources
import pathlib
from collections import Counter, OrderedDict
from typing import Annotated, Iterable, Sequence

import msgspec

# The contract's records, importable from here (the what-if runner, tests):
from workers.engines.base import BatchPrefilled, EngineBatch, EngineRequest, FailedOut, StepResult  # noqa: F401
from workers.engines.scheduler import ScheduledEngine, _Sequence

DEFAULT_PROFILE_FILE = "llama2-70b-h100-tp8.json"  # under workers/profiles/
DEFAULT_LORA_LOAD_MS = 20.0  # the modelled time of loading one LoRA adapter into a slot (module docstring)

_NonNegative = Annotated[float, msgspec.Meta(ge=0)]


class TimingProfile(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Step-time coefficients of one model on one hardware setup (see the module docstring)."""

    name: str
    source: str  # where the numbers come from
    prefill_base_ms: _NonNegative
    prefill_per_token_ms: _NonNegative  # per computed (uncached) prompt token
    prefill_per_token_sq_ms: _NonNegative  # per (p² - c²) of each request
    decode_base_ms: _NonNegative
    decode_per_seq_ms: _NonNegative  # per sequence in the decode batch
    decode_per_context_token_ms: _NonNegative  # per context token of the decode batch

    def prefill_ms(self, prompt_and_cached_tokens: Iterable[tuple[int, int]]) -> float:
        """Prefill time of one batch, given (prompt tokens, cached tokens) per request."""
        pairs = list(prompt_and_cached_tokens)
        num_computed_tokens = sum(p - c for p, c in pairs)
        num_computed_sq_tokens = sum(p * p - c * c for p, c in pairs)
        return (
            self.prefill_base_ms
            + self.prefill_per_token_ms * num_computed_tokens
            + self.prefill_per_token_sq_ms * num_computed_sq_tokens
        )

    def decode_step_ms(self, batch_size: int, num_context_tokens: int) -> float:
        return (
            self.decode_base_ms
            + self.decode_per_seq_ms * batch_size
            + self.decode_per_context_token_ms * num_context_tokens
        )


def load_profile(path: str | None = None) -> TimingProfile:
    """Load a timing profile; None means the packaged default. A bad file is a ValueError."""
    if path is None:
        source = importlib.resources.files("workers") / "profiles" / DEFAULT_PROFILE_FILE
    else:
        source = pathlib.Path(path)
    try:
        data = source.read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read timing profile {source}: {exc}") from None
    try:
        return msgspec.json.decode(data, type=TimingProfile)
    except msgspec.DecodeError as exc:
        raise ValueError(f"bad timing profile {source}: {exc}") from None


def sim_token_id(request_id: str, index: int) -> int:
    """The simulated output token at `index`: a lowercase letter, a space at index % 6 == 5."""
    if index % 6 == 5:
        return 32
    digest = hashlib.blake2b(f"{request_id}:{index}".encode(), digest_size=8).digest()
    return 97 + int.from_bytes(digest, "little") % 26


class SimEngine(ScheduledEngine):
    """The scheduler with modelled time and counted KV blocks (module docstring)."""

    measures_time = False  # duration_ms is modelled: the caller sleeps it

    def __init__(self, profile: TimingProfile, role: str, num_kv_blocks: int, block_size_tokens: int,
                 max_seq_len_tokens: int, max_num_batched_tokens: int = 8192, max_num_seqs: int = 256,
                 chunked_prefill: bool = True, scheduler: str = "vllm", max_prefill_tokens: int = 16384,
                 lora_adapters: Sequence[str] = (), max_loras: int = 0,
                 lora_load_ms: float = DEFAULT_LORA_LOAD_MS) -> None:
        super().__init__(role=role, num_kv_blocks=num_kv_blocks, block_size_tokens=block_size_tokens,
                         max_seq_len_tokens=max_seq_len_tokens, max_num_batched_tokens=max_num_batched_tokens,
                         max_num_seqs=max_num_seqs, chunked_prefill=chunked_prefill, scheduler=scheduler,
                         max_prefill_tokens=max_prefill_tokens, lora_adapters=lora_adapters, max_loras=max_loras)
        if lora_load_ms < 0:
            raise ValueError(f"lora_load_ms must be >= 0, got {lora_load_ms}")
        self.profile = profile
        self.lora_load_ms = lora_load_ms
        self._num_free_blocks = num_kv_blocks
        self._block_hash_to_refcount: dict[int, int] = {}  # every cached block -> users
        self._evictable: OrderedDict[int, None] = OrderedDict()  # refcount 0, LRU first

    # ----------------------------------------------------------------------- introspection
    @property
    def num_free_kv_blocks(self) -> int:
        return self._num_free_blocks

    @property
    def num_cached_kv_blocks(self) -> int:
        """Evictable blocks held only by the prefix cache."""
        return len(self._evictable)

    @property
    def num_used_kv_blocks(self) -> int:
        """Blocks held by requests: private ones plus cached ones they pin."""
        pinned = sum(1 for n in self._block_hash_to_refcount.values() if n > 0)
        return pinned + sum(s.num_private_blocks for s in self._running)

    def all_cached_block_hashes(self) -> list[int]:
        return list(self._block_hash_to_refcount)

    def check_invariants(self) -> None:
        """Raise AssertionError if the block accounting is inconsistent (tests, debug runs)."""
        free, used, evictable = self._num_free_blocks, self.num_used_kv_blocks, len(self._evictable)
        pins = Counter(h for s in self._running for h in s.pinned_block_hashes)
        refcounts = self._block_hash_to_refcount
        bs = self.block_size_tokens
        checks = {
            "a block count is negative": min(free, used, evictable) >= 0,
            "free + used + evictable != num_kv_blocks": free + used + evictable == self.num_kv_blocks,
            "refcounts != pins of running requests": pins == {h: n for h, n in refcounts.items() if n},
            "evictable != cached blocks without users": set(self._evictable) == {h for h, n in refcounts.items() if not n},
            "a waiting sequence holds blocks": all(s.num_held_blocks == 0 for s in self._waiting),
            "a running sequence holds fewer blocks than its KV": all(
                s.num_held_blocks >= -(-s.num_computed_tokens // bs) for s in self._running),
            "more sequences run than max_num_seqs": len(self._running) <= self.max_num_seqs,
            **self._lora_checks(),
        }
        broken = [what for what, ok in checks.items() if not ok]
        if broken:
            raise AssertionError(f"{'; '.join(broken)} (free {free}, used {used}, evictable {evictable})")

    # ----------------------------------------------------------------------- the compute
    def _compute(self, work: list[tuple[_Sequence, int, int, bool]],
                 sampling: list[_Sequence]) -> tuple[list[int], float, dict[str, float]]:
        """Run the step: (the token each `sampling` sequence produces, the step's ms, each
        batch's share of them). Here: `sim_token_id` and the timing profile (module docstring)."""
        p = self.profile
        chunk_ms: list[tuple[str | None, int, float]] = []  # (batch, k, own linear + quadratic ms)
        num_prefill_tokens = num_decoding = num_context_tokens = 0
        for seq, c, k, is_decode in work:
            if is_decode:
                num_decoding += 1
                num_context_tokens += c + 1
            else:
                num_prefill_tokens += k
                chunk_ms.append((seq.batch_id if not seq.is_prefilled else None, k,
                                 p.prefill_per_token_ms * k + p.prefill_per_token_sq_ms * ((c + k) ** 2 - c * c)))
        duration_ms = 0.0
        prefill_ms_by_batch: dict[str, float] = {}
        if num_prefill_tokens:
            duration_ms += p.prefill_base_ms
            for batch_id, k, own_ms in chunk_ms:
                duration_ms += own_ms
                if batch_id is not None:
                    share = own_ms + p.prefill_base_ms * k / num_prefill_tokens
                    prefill_ms_by_batch[batch_id] = prefill_ms_by_batch.get(batch_id, 0.0) + share
        elif num_decoding:
            duration_ms += p.decode_base_ms
        if num_decoding:
            duration_ms += p.decode_per_seq_ms * num_decoding + p.decode_per_context_token_ms * num_context_tokens
        for _, seq in self._step_lora_loads:  # admitted with its adapter loaded into a slot first
            duration_ms += self.lora_load_ms
            if seq.batch_id is not None and not seq.is_prefilled:
                prefill_ms_by_batch[seq.batch_id] = prefill_ms_by_batch.get(seq.batch_id, 0.0) + self.lora_load_ms
        token_ids = [sim_token_id(seq.request.request_id, seq.request.output_offset + seq.num_output_tokens)
                     for seq in sampling]
        return token_ids, duration_ms, prefill_ms_by_batch

    # ----------------------------------------------------------------------- KV blocks
    def _num_cached_prefix_blocks(self, seq: _Sequence) -> int:
        num_hit_blocks = 0
        for h in seq.prompt_block_hashes:
            if h not in self._block_hash_to_refcount:
                break
            num_hit_blocks += 1
        return num_hit_blocks

    def _admit(self, seq: _Sequence, num_hit_blocks: int, num_new: int) -> bool:
        """Pin the hit blocks and allocate KV for the tokens it computes now; False (nothing
        changed) when the blocks are not there."""
        hit_hashes = seq.prompt_block_hashes[:num_hit_blocks]
        num_tokens_with_kv = max(seq.num_computed_tokens, num_hit_blocks * self.block_size_tokens) + num_new
        num_needed = -(-num_tokens_with_kv // self.block_size_tokens) - num_hit_blocks
        evictable_hits = sum(1 for h in hit_hashes if h in self._evictable)
        if num_needed > self._num_free_blocks + len(self._evictable) - evictable_hits:
            return False
        for h in hit_hashes:  # pin first, so that eviction cannot take them
            if self._block_hash_to_refcount[h] == 0:
                del self._evictable[h]
            self._block_hash_to_refcount[h] += 1
        seq.pinned_block_hashes = list(hit_hashes)
        seq.num_registered_blocks = num_hit_blocks
        if seq.num_computed_tokens == 0:
            seq.num_computed_tokens = num_hit_blocks * self.block_size_tokens
            if seq.num_cached_tokens < 0:
                seq.num_cached_tokens = seq.num_computed_tokens
        self._allocate(seq, num_needed)
        return True

    def _grow(self, seq: _Sequence, num_tokens_with_kv: int) -> bool:
        """Give a running sequence the blocks for this many tokens; False when they are not there."""
        num_needed = -(-num_tokens_with_kv // self.block_size_tokens) - seq.num_held_blocks
        if num_needed <= 0:
            return True
        if num_needed > self._num_free_blocks + len(self._evictable):
            return False
        self._allocate(seq, num_needed)
        return True

    def _allocate(self, seq: _Sequence, num_blocks: int) -> None:
        while self._num_free_blocks < num_blocks:
            h, _ = self._evictable.popitem(last=False)
            del self._block_hash_to_refcount[h]
            self._note_cache_change(h, stored=False)
            self._num_free_blocks += 1
        self._num_free_blocks -= num_blocks
        seq.num_private_blocks += num_blocks

    def _register_prompt_blocks(self, seq: _Sequence) -> None:
        """Put the prompt's newly computed full blocks in the cache (still pinned by it)."""
        num_full = min(seq.num_computed_tokens, seq.num_prompt_tokens) // self.block_size_tokens
        num_full = min(num_full, len(seq.prompt_block_hashes))
        for h in seq.prompt_block_hashes[seq.num_registered_blocks:num_full]:
            if h in self._block_hash_to_refcount:
                continue  # cached by someone else: this copy stays private
            self._block_hash_to_refcount[h] = 1
            seq.pinned_block_hashes.append(h)
            seq.num_private_blocks -= 1
            self._note_cache_change(h, stored=True)
        seq.num_registered_blocks = max(seq.num_registered_blocks, num_full)

    def _release(self, seq: _Sequence) -> None:
        """Unpin: private blocks become free, unused cached blocks evictable (tail first)."""
        for h in reversed(seq.pinned_block_hashes):
            self._block_hash_to_refcount[h] -= 1
            if self._block_hash_to_refcount[h] == 0:
                self._evictable[h] = None
        self._num_free_blocks += seq.num_private_blocks
        seq.pinned_block_hashes = []
        seq.num_private_blocks = 0
