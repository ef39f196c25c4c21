"""A simulated LLM engine: a pure, deterministic model of timing, KV blocks and prefix cache.

The worker agent drives it: `submit_batch` / `submit_decode` / `cancel` change the queues at
once; `step()` runs one engine iteration, changes the state immediately and returns a
`StepResult` whose `duration_ms` the agent sleeps before it publishes the step's outputs.
Nothing here reads a clock, draws a random number or does I/O (but `load_profile`).

Parameters of `SimEngine` (no defaults; the agent passes its worker config):
- profile: the `TimingProfile` (`load_profile(None)`: llama2-70b on H100 TP8).
- role: "pd_fusion" | "prefill" | "decode" (parsed by `schemas.messages.parse_role`).
- num_kv_blocks: KV capacity in blocks; block_size_tokens: tokens per block (and per hashed
  prefix block); max_seq_len_tokens: longest prompt + max_tokens one request may have.

Scheduling (vLLM-like, no chunked prefill, no preemption), one unit of work per step:
1. prefill (roles pd_fusion, prefill): if the head queued batch fits in KV as a whole, run
   its prefill; each request produces its first token (index 0). pd_fusion: the request
   joins the running set (or finishes now if max_tokens == 1). prefill: the request is
   handed off (`HandoffOut`, carrying the first token, which is NOT in `tokens`; the decode
   worker emits index 0) and releases its blocks, even when max_tokens == 1.
2. otherwise decode (roles pd_fusion, decode): every running sequence produces one token; a
   sequence that reaches max_tokens finishes. Role decode first admits queued hand-offs
   FIFO while they fit; an admitted request emits index 0 = its `first_token_id` and, if
   max_tokens > 1, index 1 in that same step (max_tokens == 1: it finishes in that step
   and adds no compute). So every request emits indices 0..max_tokens-1 once, in order.
3. otherwise, if submissions failed since the last step, a zero-duration step of kind
   "report" carries them (failures also ride on any prefill/decode step); else None.

Timing (`TimingProfile`, a data file; default: llama2-70b on H100 TP8, fitted on Splitwise):
  prefill_ms     = prefill_base_ms + prefill_per_token_ms * Σ(p - c)
                   + prefill_per_token_sq_ms * Σ(p² - c²)   (p prompt, c cached tokens)
  decode_step_ms = decode_base_ms + decode_per_seq_ms * batch_size
                   + decode_per_context_token_ms * Σ(prompt + tokens generated so far)

KV blocks and the prefix cache (the vLLM design):
- a request reserves ceil((prompt + max_tokens) / block_size_tokens) blocks on admission
  (role prefill: ceil(prompt / block_size_tokens); it never decodes, the decode worker does).
- prompt block hashes are `schemas.tokens.block_hashes` (full blocks only). The prefix hit
  is the number of leading hashes in the cache; cached tokens = hits × block size, but a
  hit covering the whole prompt is cut to prompt - block size (the last block is always
  computed). Hit blocks are shared (refcount); only the rest is allocated.
- after its prompt is computed (role decode: once its KV is admitted), a request registers
  its not-yet-cached prompt blocks in the cache (still pinned by it). A block whose hash is
  already cached stays private to it.
- on finish / cancel / hand-off the request unpins: private blocks become free, cached
  blocks with no other user become evictable, appended to the LRU list tail block first,
  so a prompt's tail is evicted before its head (a chained prefix stays usable longest).
- allocation evicts least-recently-used evictable blocks when free blocks run short.
- invariant: free + used (private or pinned) + evictable == num_kv_blocks.
- `blocks_stored` / `blocks_removed` of a step are the net change of the cache's hash set
  over that step (disjoint lists: a hash stored and evicted in one step is in neither).

Submissions are validated at once: prompt empty or max_tokens < 1 -> "invalid_request";
prompt + max_tokens > max_seq_len_tokens, or more blocks than num_kv_blocks -> "too_large";
requests of one batch beyond what num_kv_blocks can hold together -> "dispatch_failed"
(the batch could never run as one unit). Failed requests leave their batch (the rest stays)
and are reported in the next step. A request id already live in the engine, an empty batch
or the wrong role is a caller bug: ValueError (the agent dedupes redelivered commands).
"""

from __future__ import annotations

import hashlib
import importlib.resources
import pathlib
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field
from typing import Annotated, Iterable, Literal

import msgspec

from schemas.messages import parse_role
from schemas.tokens import block_hashes

DEFAULT_PROFILE_FILE = "llama2-70b-h100-tp8.json"  # under workers/profiles/

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


# --------------------------------------------------------------------------- inputs/outputs
class EngineRequest(msgspec.Struct, frozen=True, kw_only=True):
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int  # output tokens to generate (the only stop rule: finish_reason "length")
    # The prompt's chained block hashes when the caller already has them (what-if runs from a
    # journal, which records hashes, not tokens); None: computed from the token ids.
    block_hashes: list[int] | None = None


class EngineBatch(msgspec.Struct, frozen=True, kw_only=True):
    batch_id: str
    requests: list[EngineRequest]


class TokenOut(msgspec.Struct, frozen=True, kw_only=True):
    request_id: str
    index: int  # position in the request's output, 0 = first output token
    token_id: int


class FinishedOut(msgspec.Struct, frozen=True, kw_only=True):
    request_id: str
    finish_reason: str  # always "length"
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int  # decode role: as given to submit_decode


class HandoffOut(msgspec.Struct, frozen=True, kw_only=True):
    """Role prefill: the request's prefill is done and it left this engine."""

    request_id: str
    batch_id: str
    first_token_id: int
    num_cached_tokens: int


class FailedOut(msgspec.Struct, frozen=True, kw_only=True):
    request_id: str
    code: str  # a schemas.errors code: "invalid_request" | "too_large" | "dispatch_failed"
    message: str


StepKind = Literal["prefill", "decode", "report"]


class StepResult(msgspec.Struct, frozen=True, kw_only=True):
    """What one engine iteration did; publish it after sleeping `duration_ms`."""

    kind: StepKind  # "report": no compute, only failures to publish
    duration_ms: float
    batch_id: str | None = None  # prefill steps
    prefill_request_ids: list[str] = []  # prefill steps: the requests whose prompt ran
    num_prompt_tokens: int = 0  # prefill steps: Σ prompt tokens
    num_cached_tokens: int = 0  # prefill steps: Σ prompt tokens served from the cache
    tokens: list[TokenOut] = []  # in generation order; per request, by ascending index
    finished: list[FinishedOut] = []
    handoffs: list[HandoffOut] = []
    failed: list[FailedOut] = []
    blocks_stored: list[int] = []  # hashes added to the prefix cache in this step
    blocks_removed: list[int] = []  # hashes evicted from the prefix cache in this step


# --------------------------------------------------------------------------- the engine
@dataclass
class _Sequence:
    """A request in the engine, from submission until it leaves."""

    request: EngineRequest
    prompt_block_hashes: list[int]
    batch_id: str | None = None
    first_token_id: int = 0  # role decode: produced by the prefill worker
    num_cached_tokens: int = 0
    pinned_block_hashes: list[int] = field(default_factory=list)  # cache blocks it references
    num_private_blocks: int = 0  # blocks it holds outside the cache
    num_output_tokens: int = 0


@dataclass
class _QueuedBatch:
    batch_id: str
    seqs: list[_Sequence]


class SimEngine:
    """One simulated engine; see the module docstring for the model and the contract."""

    def __init__(self, profile: TimingProfile, role: str, num_kv_blocks: int, block_size_tokens: int,
                 max_seq_len_tokens: int) -> None:
        if min(num_kv_blocks, block_size_tokens, max_seq_len_tokens) <= 0:
            raise ValueError("num_kv_blocks, block_size_tokens and max_seq_len_tokens must be positive")
        self.profile = profile
        self.role = parse_role(role)
        self.num_kv_blocks = num_kv_blocks
        self.block_size_tokens = block_size_tokens
        self.max_seq_len_tokens = max_seq_len_tokens
        self._batch_queue: deque[_QueuedBatch] = deque()
        self._request_id_to_queued_batch: dict[str, _QueuedBatch] = {}
        self._decode_queue: dict[str, _Sequence] = {}  # role decode, FIFO by insertion
        self._running: dict[str, _Sequence] = {}  # admission order
        self._pending_failures: list[FailedOut] = []
        self._num_free_blocks = num_kv_blocks
        self._block_hash_to_refcount: dict[int, int] = {}  # every cached block -> users
        self._evictable: OrderedDict[int, None] = OrderedDict()  # refcount 0, LRU first
        self._step_stored: dict[int, None] = {}
        self._step_removed: dict[int, None] = {}

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
        return pinned + sum(s.num_private_blocks for s in self._running.values())

    @property
    def num_running_requests(self) -> int:
        return len(self._running)

    @property
    def num_queued_batches(self) -> int:
        return len(self._batch_queue)

    @property
    def num_queued_requests(self) -> int:
        return len(self._request_id_to_queued_batch) + len(self._decode_queue)

    def running_request_ids(self) -> list[str]:
        """Queued then running request ids (not those whose failure awaits the next step)."""
        queued = [s.request.request_id for b in self._batch_queue for s in b.seqs]
        return queued + list(self._decode_queue) + list(self._running)

    def all_cached_block_hashes(self) -> list[int]:
        return list(self._block_hash_to_refcount)

    def check_invariants(self) -> None:
        """Raise AssertionError if the block accounting is inconsistent (tests, debug runs)."""
        free, used, evictable = self._num_free_blocks, self.num_used_kv_blocks, len(self._evictable)
        pins = Counter(h for s in self._running.values() for h in s.pinned_block_hashes)
        refcounts = self._block_hash_to_refcount
        checks = {
            "a block count is negative": min(free, used, evictable) >= 0,
            "free + used + evictable != num_kv_blocks": free + used + evictable == self.num_kv_blocks,
            "refcounts != pins of running requests": pins == {h: n for h, n in refcounts.items() if n},
            "evictable != cached blocks without users": set(self._evictable) == {h for h, n in refcounts.items() if not n},
        }
        broken = [what for what, ok in checks.items() if not ok]
        if broken:
            raise AssertionError(f"{'; '.join(broken)} (free {free}, used {used}, evictable {evictable})")

    # ----------------------------------------------------------------------- commands
    def submit_batch(self, batch: EngineBatch) -> None:
        """Queue a batch FIFO (roles pd_fusion, prefill); invalid requests fail at next step."""
        if self.role == "decode":
            raise ValueError("submit_batch on a decode engine; use submit_decode")
        if not batch.requests:
            raise ValueError(f"batch {batch.batch_id} has no requests")
        self._check_new_ids([r.request_id for r in batch.requests])
        queued = _QueuedBatch(batch.batch_id, [])
        num_batch_blocks = 0
        for request in batch.requests:
            failure = self._validate(request)
            if failure is None and num_batch_blocks + self._num_blocks_needed(request) > self.num_kv_blocks:
                failure = FailedOut(
                    request_id=request.request_id,
                    code="dispatch_failed",
                    message=f"batch {batch.batch_id} needs more than the engine's {self.num_kv_blocks} KV blocks",
                )
            if failure is not None:
                self._pending_failures.append(failure)
                continue
            num_batch_blocks += self._num_blocks_needed(request)
            seq = _Sequence(request, self._hashes(request), batch_id=batch.batch_id)
            queued.seqs.append(seq)
            self._request_id_to_queued_batch[request.request_id] = queued
        if queued.seqs:
            self._batch_queue.append(queued)

    def submit_decode(self, request: EngineRequest, first_token_id: int, num_cached_tokens: int) -> None:
        """Role decode: queue a handed-off request (its KV arrives; no prefill compute)."""
        if self.role != "decode":
            raise ValueError(f"submit_decode on a {self.role} engine")
        self._check_new_ids([request.request_id])
        failure = self._validate(request)
        if failure is not None:
            self._pending_failures.append(failure)
            return
        seq = _Sequence(request, self._hashes(request), first_token_id=first_token_id,
                        num_cached_tokens=num_cached_tokens)
        self._decode_queue[request.request_id] = seq

    def cancel(self, request_id: str) -> bool:
        """Remove a queued or running request and free its blocks; False if it is not here."""
        batch = self._request_id_to_queued_batch.pop(request_id, None)
        if batch is not None:
            batch.seqs = [s for s in batch.seqs if s.request.request_id != request_id]
            if not batch.seqs:
                self._batch_queue.remove(batch)
            return True
        if self._decode_queue.pop(request_id, None) is not None:
            return True
        seq = self._running.pop(request_id, None)
        if seq is None:
            return False
        self._release(seq)
        return True

    def step(self) -> StepResult | None:
        """Run one iteration (see the module docstring); None when there is nothing to do."""
        self._step_stored.clear()
        self._step_removed.clear()
        failed, self._pending_failures = self._pending_failures, []
        result = None
        if self.role != "decode":
            result = self._prefill_step(failed)
        if result is None:
            result = self._decode_step(failed)
        if result is None and failed:
            result = StepResult(kind="report", duration_ms=0.0, failed=failed)
        return result

    # ----------------------------------------------------------------------- steps
    def _prefill_step(self, failed: list[FailedOut]) -> StepResult | None:
        if not self._batch_queue:
            return None
        head = self._batch_queue[0]
        hits = self._plan_admission(head.seqs)
        if hits is None:
            return None
        self._batch_queue.popleft()
        tokens: list[TokenOut] = []
        finished: list[FinishedOut] = []
        handoffs: list[HandoffOut] = []
        for seq, num_hit_blocks in zip(head.seqs, hits):
            del self._request_id_to_queued_batch[seq.request.request_id]
            seq.num_cached_tokens = num_hit_blocks * self.block_size_tokens
        self._admit(head.seqs, hits)
        for seq in head.seqs:
            rid = seq.request.request_id
            self._register_prompt_blocks(seq)
            first = sim_token_id(rid, 0)
            seq.num_output_tokens = 1
            if self.role == "prefill":
                handoffs.append(HandoffOut(request_id=rid, batch_id=head.batch_id, first_token_id=first,
                                           num_cached_tokens=seq.num_cached_tokens))
                self._release(seq)
                continue
            tokens.append(TokenOut(request_id=rid, index=0, token_id=first))
            self._running[rid] = seq
            if seq.request.max_tokens == 1:
                finished.append(self._finish(seq))
        prompt_and_cached = [(len(s.request.prompt_token_ids), s.num_cached_tokens) for s in head.seqs]
        return StepResult(
            kind="prefill",
            duration_ms=self.profile.prefill_ms(prompt_and_cached),
            batch_id=head.batch_id,
            prefill_request_ids=[s.request.request_id for s in head.seqs],
            num_prompt_tokens=sum(p for p, _ in prompt_and_cached),
            num_cached_tokens=sum(c for _, c in prompt_and_cached),
            tokens=tokens, finished=finished, handoffs=handoffs, failed=failed,
            blocks_stored=list(self._step_stored), blocks_removed=list(self._step_removed),
        )

    def _decode_step(self, failed: list[FailedOut]) -> StepResult | None:
        tokens: list[TokenOut] = []
        finished: list[FinishedOut] = []
        while self._decode_queue:  # role decode: admit hand-offs FIFO while they fit
            seq = next(iter(self._decode_queue.values()))
            hits = self._plan_admission([seq])
            if hits is None:
                break
            rid = seq.request.request_id
            del self._decode_queue[rid]
            self._admit([seq], hits)
            self._register_prompt_blocks(seq)
            tokens.append(TokenOut(request_id=rid, index=0, token_id=seq.first_token_id))
            seq.num_output_tokens = 1
            self._running[rid] = seq
            if seq.request.max_tokens == 1:
                finished.append(self._finish(seq))
        if not self._running and not tokens:
            return None
        generating = list(self._running.values())
        num_context_tokens = sum(len(s.request.prompt_token_ids) + s.num_output_tokens for s in generating)
        for seq in generating:
            index = seq.num_output_tokens
            tokens.append(TokenOut(request_id=seq.request.request_id, index=index,
                                   token_id=sim_token_id(seq.request.request_id, index)))
            seq.num_output_tokens += 1
            if seq.num_output_tokens == seq.request.max_tokens:
                finished.append(self._finish(seq))
        duration_ms = self.profile.decode_step_ms(len(generating), num_context_tokens) if generating else 0.0
        return StepResult(
            kind="decode", duration_ms=duration_ms, tokens=tokens, finished=finished, failed=failed,
            blocks_stored=list(self._step_stored), blocks_removed=list(self._step_removed),
        )

    def _finish(self, seq: _Sequence) -> FinishedOut:
        del self._running[seq.request.request_id]
        self._release(seq)
        return FinishedOut(
            request_id=seq.request.request_id,
            finish_reason="length",
            num_prompt_tokens=len(seq.request.prompt_token_ids),
            num_output_tokens=seq.num_output_tokens,
            num_cached_tokens=seq.num_cached_tokens,
        )

    # ----------------------------------------------------------------------- validation
    def _check_new_ids(self, request_ids: list[str]) -> None:
        failing = {f.request_id for f in self._pending_failures}
        live = [rid for rid in request_ids if rid in self._request_id_to_queued_batch
                or rid in self._decode_queue or rid in self._running or rid in failing]
        if live or len(set(request_ids)) < len(request_ids):
            raise ValueError(f"duplicate request ids: {live or request_ids} (already in the engine or twice)")

    def _validate(self, request: EngineRequest) -> FailedOut | None:
        num_prompt_tokens = len(request.prompt_token_ids)
        if num_prompt_tokens == 0 or request.max_tokens < 1:
            code, message = "invalid_request", "the prompt must be non-empty and max_tokens at least 1"
        elif num_prompt_tokens + request.max_tokens > self.max_seq_len_tokens:
            code, message = "too_large", (f"prompt {num_prompt_tokens} + max_tokens {request.max_tokens} tokens "
                                          f"exceed max_seq_len_tokens {self.max_seq_len_tokens}")
        elif self._num_blocks_needed(request) > self.num_kv_blocks:
            code, message = "too_large", (f"needs {self._num_blocks_needed(request)} KV blocks, "
                                          f"the engine has {self.num_kv_blocks}")
        else:
            return None
        return FailedOut(request_id=request.request_id, code=code, message=message)

    # ----------------------------------------------------------------------- KV blocks
    def _num_blocks_needed(self, request: EngineRequest) -> int:
        num_output_tokens = 0 if self.role == "prefill" else request.max_tokens  # prefill hands off
        return -(-(len(request.prompt_token_ids) + num_output_tokens) // self.block_size_tokens)

    def _hashes(self, request: EngineRequest) -> list[int]:
        if request.block_hashes is not None:
            return request.block_hashes
        return block_hashes(request.prompt_token_ids, self.block_size_tokens)

    def _num_hit_blocks(self, seq: _Sequence) -> int:
        """Leading prompt blocks served from the cache (a whole-prompt hit drops its last)."""
        num_hit_blocks = 0
        for h in seq.prompt_block_hashes:
            if h not in self._block_hash_to_refcount:
                break
            num_hit_blocks += 1
        if num_hit_blocks * self.block_size_tokens >= len(seq.request.prompt_token_ids):
            num_hit_blocks = max(0, num_hit_blocks - 1)
        return num_hit_blocks

    def _plan_admission(self, seqs: list[_Sequence]) -> list[int] | None:
        """Hit blocks per sequence if all `seqs` fit now (evicting LRU cache blocks), else None."""
        hits = [self._num_hit_blocks(s) for s in seqs]
        num_new_blocks = sum(self._num_blocks_needed(s.request) - n for s, n in zip(seqs, hits))
        evictable_hits = {h for s, n in zip(seqs, hits) for h in s.prompt_block_hashes[:n] if h in self._evictable}
        available = self._num_free_blocks + len(self._evictable) - len(evictable_hits)
        return hits if num_new_blocks <= available else None

    def _admit(self, seqs: list[_Sequence], hits: list[int]) -> None:
        """Pin the hit blocks first (so eviction cannot take them), then allocate the rest."""
        for seq, num_hit_blocks in zip(seqs, hits):
            for h in seq.prompt_block_hashes[:num_hit_blocks]:
                if self._block_hash_to_refcount[h] == 0:
                    del self._evictable[h]
                self._block_hash_to_refcount[h] += 1
                seq.pinned_block_hashes.append(h)
            seq.num_private_blocks = self._num_blocks_needed(seq.request) - num_hit_blocks
        num_new_blocks = sum(s.num_private_blocks for s in seqs)
        while self._num_free_blocks < num_new_blocks:
            h, _ = self._evictable.popitem(last=False)
            del self._block_hash_to_refcount[h]
            self._note_cache_change(h, stored=False)
            self._num_free_blocks += 1
        self._num_free_blocks -= num_new_blocks

    def _register_prompt_blocks(self, seq: _Sequence) -> None:
        for h in seq.prompt_block_hashes[len(seq.pinned_block_hashes):]:
            if h in self._block_hash_to_refcount:
                continue  # cached by someone else: this copy stays private
            self._block_hash_to_refcount[h] = 1
            seq.pinned_block_hashes.append(h)
            seq.num_private_blocks -= 1
            self._note_cache_change(h, stored=True)

    def _note_cache_change(self, block_hash: int, stored: bool) -> None:
        """Record the net change of this step: a store undoes an earlier removal and back."""
        undo, record = (self._step_removed, self._step_stored) if stored else (self._step_stored, self._step_removed)
        if block_hash in undo:
            del undo[block_hash]
        else:
            record[block_hash] = None

    def _release(self, seq: _Sequence) -> None:
        """Unpin: private blocks become free, unused cached blocks evictable (tail first)."""
        for h in reversed(seq.pinned_block_hashes):
            self._block_hash_to_refcount[h] -= 1
            if self._block_hash_to_refcount[h] == 0:
                self._evictable[h] = None
        self._num_free_blocks += seq.num_private_blocks
        seq.pinned_block_hashes = []
        seq.num_private_blocks = 0
