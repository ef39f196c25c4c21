"""A simulated LLM engine: a pure, deterministic model of timing, KV blocks and prefix cache,
scheduled like vLLM V1 (`scheduler="vllm"`, the default) or like SGLang (`scheduler="sglang"`,
prefill-first).

The worker agent (and the HTTP front, workers/http_front.py) drives it: `submit_batch` /
`submit_decode` / `cancel` change the queues at once; `step()` runs one engine iteration,
changes the state immediately and returns a `StepResult` whose `duration_ms` the caller
sleeps before it publishes the step's outputs. Nothing here reads a clock, draws a random
number or does I/O (but `load_profile`).

Parameters of `SimEngine` (the agent passes its worker config, `workers.agent.make_engine`):
- profile: the `TimingProfile` (`load_profile(None)`: llama2-70b on H100 TP8).
- role: "pd_fusion" | "prefill" | "decode" (parsed by `schemas.messages.parse_role`).
- num_kv_blocks: KV capacity in blocks; block_size_tokens: tokens per block (and per hashed
  prefix block); max_seq_len_tokens: longest prompt + max_tokens one request may have.
- max_num_batched_tokens (8192, vLLM V1's default for its API server): tokens one step may
  compute: prefill chunks plus one per decoding sequence.
- max_num_seqs (256): most sequences running at once (waiting ones are admitted below it).
- chunked_prefill (True, as vLLM V1): a prompt that does not fit the step's remaining budget
  is split across steps. Off: each prompt is computed whole in one step, and the step budget
  becomes max(max_num_batched_tokens, max_seq_len_tokens) (vLLM refuses a config whose
  budget is below max_model_len without chunking; we raise the budget instead).
- scheduler ("vllm"): "vllm" mixes decodes and prompt chunks in one step (below); "sglang"
  runs prefill steps and decode steps apart, prefill first (section "Prefill-first").
- max_prefill_tokens (16384, SGLang's default): sglang only, the most new prompt tokens one
  prefill step takes (its `--max-prefill-tokens`); max_num_batched_tokens is then SGLang's
  `--chunked-prefill-size` (8192 by default in both).

Scheduling, scheduler "vllm": continuous batching, first come first served (vLLM V1's
scheduler, FCFS policy).
A submitted batch's requests join the waiting queue together, in order ("released to the
engine together"; a batch is no longer computed as one unit). Each step:
1. running sequences first, in admission order: a decoding sequence takes 1 token of the
   budget; one still prefilling (chunked) takes min(what it has left, the budget left).
   Its KV must grow to cover the tokens it computes; when the free blocks (plus evictable
   cache blocks) cannot cover it, the NEWEST running sequence is preempted: its blocks are
   freed (its prompt blocks stay in the prefix cache, evictable), it goes back to the FRONT
   of the waiting queue with 0 computed tokens and is recomputed later (prompt + the tokens
   it already generated; they are not emitted again). If the newest is the one asking, it
   preempts itself and the running pass stops.
2. then, if nothing was preempted in this step, waiting sequences FIFO while the budget
   lasts and fewer than max_num_seqs run: the prefix-cache hit is looked up (first
   admission and after a preemption), and the sequence is admitted with as many tokens as
   fit (chunked) or not at all (no chunking, or no KV: the pass stops, FIFO is kept).
3. every sequence whose computed tokens reach all its known tokens samples one token: a
   prompt's last chunk produces its first token (index 0); a decoding sequence its next.
   pd_fusion/decode: a sequence reaching max_tokens finishes. prefill: the request is handed
   off (`HandoffOut`, carrying the first token, which is NOT in `tokens`; the decode worker
   emits index 0) and releases its blocks, even when max_tokens == 1.
Prefill-first, scheduler "sglang" (SGLang's default scheduler: `get_next_batch_to_run` with
mixed chunking off; roles pd_fusion and prefill). Each step is EITHER a prefill step OR a
decode step, never both:
1. prefill step, whenever one can be formed: first the running prompt still being chunked
   (at most one), continued with min(what it has left, the chunk budget); then waiting
   sequences FIFO (prefix hit looked up as above) while fewer than max_num_seqs run. The
   step's budgets are the chunk budget max_num_batched_tokens (SGLang's
   chunked_prefill_size) and the input budget max_prefill_tokens. A waiting prompt whose
   uncached tokens fit the chunk budget left is taken whole; one that does not is cut to the
   chunk budget left and becomes the prompt being chunked, which ends the batch (it goes on
   at the head of the next prefill step). A prompt beyond the input budget left ends the
   batch unless the batch is empty (the first always goes). No KV for the next prompt ends
   the batch (FIFO kept). Without chunked_prefill a prompt always goes whole and only the
   input budget limits the batch. A prompt's continuation that cannot get its KV does not
   preempt anyone: the step is a decode step instead.
2. otherwise (nothing waiting, or the head cannot be admitted: KV, max_num_seqs), a decode
   step of every decoding sequence, in admission order, with the same KV growth and
   newest-first preemption as above (a preempted sequence waits at the front and is
   recomputed by a later prefill step).
So a waiting prompt interrupts every running decode for one whole prefill step (and a long
one for several back to back): the decodes' TPOT carries the prefill steps. The step time is
the same formula (a prefill step has no decode part, a decode step no prefill part). Role
decode runs as under "vllm" (there is no prefill: hand-offs are admitted and decoded
together), whichever the scheduler.

Role decode: a hand-off waits like any request with its prompt already computed (its KV
arrives with it): admitted FIFO when blocks for prompt + 1 fit; it emits index 0 = its
`first_token_id` and, if max_tokens > 1, index 1 in that same step (max_tokens == 1: it
finishes at admission and adds no compute). So every request emits indices
0..max_tokens-1 once, in order, preempted or not. A step with no compute but failures to
report is a zero-duration step of kind "report"; nothing at all: None.

Step time (`TimingProfile`, a data file; default: llama2-70b on H100 TP8, fitted on Splitwise),
for the chunks (c tokens computed before, k computed now) and decoding sequences of one step:
  prefill part = prefill_base_ms + prefill_per_token_ms * Σk
                 + prefill_per_token_sq_ms * Σ((c + k)² − c²)          (if any chunk)
  decode part  = decode_per_seq_ms * num_decoding
                 + decode_per_context_token_ms * Σ(context of each decoding sequence)
  step_ms      = prefill part + decode part, plus decode_base_ms when the step has no chunk
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

Not modelled: speculative decoding, priority scheduling, long-prefill thresholds, SGLang's
mixed chunking and its KV reservation for future decode tokens (new_token_ratio; admission
here needs the blocks of the tokens computed now, under both schedulers), swapping to CPU, KV transfer time (PD), per-step CPU overhead, and output-length-dependent stop rules
(a request always generates exactly max_tokens: finish_reason "length").

Submissions are validated at once: prompt empty or max_tokens < 1 -> "invalid_request";
prompt + max_tokens > max_seq_len_tokens, or more blocks than num_kv_blocks (a request must
be able to finish alone) -> "too_large". Failed requests leave their batch (the rest stays)
and are reported in the next step. A request id already live in the engine, an empty batch
or the wrong role is a caller bug: ValueError (the agent dedupes redelivered commands).

The old one-unit-per-step model (each dispatched batch computed as one prefill step, KV for
prompt + max_tokens reserved up front, no preemption) is gone: no engine operators run
behaves like it, and benchmarks against peers need the engine they run.
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
SCHEDULERS = ("vllm", "sglang")  # the engine's step scheduler (module docstring)

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
    # Sampling (the torch engine; the sim's output does not depend on them): temperature 0 is
    # greedy; seed None: derived from the request id (the same request, the same output).
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False


class EngineBatch(msgspec.Struct, frozen=True, kw_only=True):
    batch_id: str
    requests: list[EngineRequest]


class TokenOut(msgspec.Struct, frozen=True, kw_only=True):
    request_id: str
    index: int  # position in the request's output, 0 = first output token
    token_id: int


class FinishedOut(msgspec.Struct, frozen=True, kw_only=True):
    request_id: str
    finish_reason: str  # "length"; the torch engine: "stop" on the model's end token
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int  # decode role: as given to submit_decode


class HandoffOut(msgspec.Struct, frozen=True, kw_only=True):
    """Role prefill: the request's prefill is done and it left this engine."""

    request_id: str
    batch_id: str
    first_token_id: int
    num_cached_tokens: int
    # The torch engine: the prompt's K/V, a [2, layers, tokens, kv_heads, head_dim] tensor,
    # for the decode worker (workers/engines/torch_engine.py). The sim engine: None.
    kv: object = None


class FailedOut(msgspec.Struct, frozen=True, kw_only=True):
    request_id: str
    code: str  # a schemas.errors code: "invalid_request" | "too_large" | "dispatch_failed"
    message: str


StepKind = Literal["prefill", "decode", "report"]


class BatchPrefilled(msgspec.Struct, frozen=True, kw_only=True):
    """Every request of a submitted batch has finished its prefill (or left the engine)."""

    batch_id: str
    request_ids: list[str]  # the members whose prompt ran (cancelled ones are not listed; may be empty)
    num_prompt_tokens: int  # Σ prompt tokens of those members
    num_cached_tokens: int  # Σ of their prefix hits at first admission


class StepResult(msgspec.Struct, frozen=True, kw_only=True):
    """What one engine iteration did; publish it after sleeping `duration_ms`."""

    kind: StepKind  # "prefill": the step computed prompt chunks; "decode": only decodes; "report": no compute
    duration_ms: float
    batches_started: list[str] = []  # batches whose first prompt chunk ran in this step
    batches_prefilled: list[BatchPrefilled] = []  # batches whose last member's prefill ended in this step
    # batch id -> the part of duration_ms spent on its prompt chunks in this step (module docstring)
    prefill_ms_by_batch: dict[str, float] = {}
    num_prefill_tokens: int = 0  # prompt (or recompute) tokens computed in this step
    num_decode_tokens: int = 0  # decoding sequences in this step
    num_preemptions: int = 0  # sequences preempted in this step
    tokens: list[TokenOut] = []  # in generation order; per request, by ascending index
    finished: list[FinishedOut] = []
    handoffs: list[HandoffOut] = []
    failed: list[FailedOut] = []
    blocks_stored: list[int] = []  # hashes added to the prefix cache in this step
    blocks_removed: list[int] = []  # hashes evicted from the prefix cache in this step


# --------------------------------------------------------------------------- the engine
@dataclass(eq=False)
class _Sequence:
    """A request in the engine, from submission until it leaves."""

    request: EngineRequest
    prompt_block_hashes: list[int]
    num_prompt_tokens: int
    batch_id: str | None = None
    first_token_id: int = 0  # role decode: produced by the prefill worker
    num_cached_tokens: int = -1  # prefix hit at first admission (-1: not admitted yet)
    num_computed_tokens: int = 0  # tokens whose KV exists (prompt first, then outputs)
    num_output_tokens: int = 0  # tokens generated so far (all emitted)
    output_token_ids: list[int] = field(default_factory=list)  # those tokens (a recompute feeds them back)
    pinned_block_hashes: list[int] = field(default_factory=list)  # cache blocks it references
    num_registered_blocks: int = 0  # prompt blocks [0, this) already looked at for the cache
    num_private_blocks: int = 0  # blocks it holds outside the cache
    is_prefilled: bool = False  # its prompt ran (or arrived, role decode): counted for its batch
    num_preemptions: int = 0

    @property
    def num_tokens(self) -> int:
        """Tokens known: the prompt and every generated one (the last has no KV yet)."""
        return self.num_prompt_tokens + self.num_output_tokens

    @property
    def num_held_blocks(self) -> int:
        return len(self.pinned_block_hashes) + self.num_private_blocks


@dataclass
class _BatchProgress:
    batch_id: str
    request_ids: list[str]  # members still expected to prefill or already prefilled
    num_pending: int  # members whose prefill has not ended
    started: bool = False
    num_prompt_tokens: int = 0  # of the members that prefilled
    num_cached_tokens: int = 0


class SimEngine:
    """One simulated engine; see the module docstring for the model and the contract."""

    measures_time = False  # duration_ms is modelled: the caller sleeps it (the torch engine: measured, already spent)

    def __init__(self, profile: TimingProfile, role: str, num_kv_blocks: int, block_size_tokens: int,
                 max_seq_len_tokens: int, max_num_batched_tokens: int = 8192, max_num_seqs: int = 256,
                 chunked_prefill: bool = True, scheduler: str = "vllm", max_prefill_tokens: int = 16384) -> None:
        if min(num_kv_blocks, block_size_tokens, max_seq_len_tokens, max_num_batched_tokens, max_num_seqs,
               max_prefill_tokens) <= 0:
            raise ValueError("num_kv_blocks, block_size_tokens, max_seq_len_tokens, max_num_batched_tokens, "
                             "max_num_seqs and max_prefill_tokens must be positive")
        if scheduler not in SCHEDULERS:
            raise ValueError(f"unknown engine scheduler {scheduler!r}; known: {', '.join(SCHEDULERS)}")
        self.profile = profile
        self.role = parse_role(role)
        self.num_kv_blocks = num_kv_blocks
        self.block_size_tokens = block_size_tokens
        self.max_seq_len_tokens = max_seq_len_tokens
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.chunked_prefill = chunked_prefill
        self.scheduler = scheduler
        self.max_prefill_tokens = max_prefill_tokens
        self._waiting: deque[_Sequence] = deque()  # FIFO; preempted sequences re-enter at the front
        self._running: list[_Sequence] = []  # admission order (the last is the newest)
        self._request_id_to_seq: dict[str, _Sequence] = {}  # waiting and running
        self._batches: dict[str, _BatchProgress] = {}  # batches with a member still to prefill
        self._pending_failures: list[FailedOut] = []
        self._pending_prefilled: list[BatchPrefilled] = []  # batches completed by a cancel, for the next step
        self._num_free_blocks = num_kv_blocks
        self._block_hash_to_refcount: dict[int, int] = {}  # every cached block -> users
        self._evictable: OrderedDict[int, None] = OrderedDict()  # refcount 0, LRU first
        self._step_stored: dict[int, None] = {}
        self._step_removed: dict[int, None] = {}
        self.num_preemptions = 0  # since boot

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

    @property
    def num_running_requests(self) -> int:
        return len(self._running)

    @property
    def num_queued_batches(self) -> int:
        """Batches none of whose members has started its prefill."""
        return sum(1 for b in self._batches.values() if not b.started)

    @property
    def num_queued_requests(self) -> int:
        return len(self._waiting)

    @property
    def num_waiting_tokens(self) -> int:
        """Tokens the waiting sequences still have to compute (ignoring cache hits)."""
        return sum(s.num_tokens - s.num_computed_tokens for s in self._waiting)

    @property
    def num_kv_tokens(self) -> int:
        """Tokens with KV in running sequences."""
        return sum(s.num_computed_tokens for s in self._running)

    def running_request_ids(self) -> list[str]:
        """Waiting then running request ids (not those whose failure awaits the next step)."""
        return [s.request.request_id for s in self._waiting] + [s.request.request_id for s in self._running]

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
        }
        broken = [what for what, ok in checks.items() if not ok]
        if broken:
            raise AssertionError(f"{'; '.join(broken)} (free {free}, used {used}, evictable {evictable})")

    # ----------------------------------------------------------------------- commands
    def submit_batch(self, batch: EngineBatch) -> None:
        """Queue a batch's requests FIFO (roles pd_fusion, prefill); invalid ones fail at next step."""
        if self.role == "decode":
            raise ValueError("submit_batch on a decode engine; use submit_decode")
        if not batch.requests:
            raise ValueError(f"batch {batch.batch_id} has no requests")
        if batch.batch_id in self._batches:
            raise ValueError(f"batch {batch.batch_id} is already in the engine")
        self._check_new_ids([r.request_id for r in batch.requests])
        seqs = []
        for request in batch.requests:
            failure = self._validate(request)
            if failure is not None:
                self._pending_failures.append(failure)
                continue
            seqs.append(_Sequence(request, self._hashes(request), len(request.prompt_token_ids), batch_id=batch.batch_id))
        if not seqs:
            return
        self._batches[batch.batch_id] = _BatchProgress(batch.batch_id, [s.request.request_id for s in seqs], len(seqs))
        for seq in seqs:
            self._waiting.append(seq)
            self._request_id_to_seq[seq.request.request_id] = seq

    def submit_decode(self, request: EngineRequest, first_token_id: int, num_cached_tokens: int,
                      kv: object = None) -> None:
        """Role decode: queue a handed-off request (its KV arrives; no prefill compute). `kv`:
        the prompt's K/V from a torch prefill worker; the sim models it and ignores it."""
        if self.role != "decode":
            raise ValueError(f"submit_decode on a {self.role} engine")
        self._check_new_ids([request.request_id])
        failure = self._validate(request)
        if failure is not None:
            self._pending_failures.append(failure)
            return
        n = len(request.prompt_token_ids)
        seq = _Sequence(request, self._hashes(request), n, first_token_id=first_token_id,
                        num_cached_tokens=num_cached_tokens, num_computed_tokens=n, is_prefilled=True)
        self._waiting.append(seq)
        self._request_id_to_seq[request.request_id] = seq

    def cancel(self, request_id: str) -> bool:
        """Remove a waiting or running request and free its blocks; False if it is not here."""
        seq = self._request_id_to_seq.pop(request_id, None)
        if seq is None:
            return False
        if seq.num_held_blocks or seq in self._running:
            self._running.remove(seq)
            self._release(seq)
        else:
            self._waiting.remove(seq)
        self._leave_batch(seq, prefilled=False, done=self._pending_prefilled)
        return True

    def step(self) -> StepResult | None:
        """Run one iteration (see the module docstring); None when there is nothing to do."""
        self._step_stored.clear()
        self._step_removed.clear()
        failed, self._pending_failures = self._pending_failures, []
        prefilled, self._pending_prefilled = self._pending_prefilled, []
        scheduled, num_preempted, admitted_handoffs = self._schedule()
        if not scheduled and not admitted_handoffs:
            if failed or prefilled:
                return StepResult(kind="report", duration_ms=0.0, failed=failed, batches_prefilled=prefilled)
            return None
        return self._execute(scheduled, num_preempted, admitted_handoffs, failed, prefilled)

    # ----------------------------------------------------------------------- scheduling
    def _schedule(self) -> tuple[list[tuple[_Sequence, int]], int, list[_Sequence]]:
        """Pick this step's work: [(sequence, tokens to compute)], preemptions, admitted hand-offs."""
        if self.scheduler == "sglang" and self.role != "decode":
            return self._schedule_prefill_first()
        budget = (self.max_num_batched_tokens if self.chunked_prefill
                  else max(self.max_num_batched_tokens, self.max_seq_len_tokens))
        scheduled: list[tuple[_Sequence, int]] = []
        num_preempted = 0
        i = 0
        while i < len(self._running) and budget > 0:
            seq = self._running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            preempted_itself = False
            while not self._grow(seq, seq.num_computed_tokens + num_new):
                victim = self._running.pop()
                self._preempt(victim)
                num_preempted += 1
                if victim is seq:
                    preempted_itself = True
                    break
            if preempted_itself:
                break  # nothing older is left to preempt: nothing more runs this step
            scheduled.append((seq, num_new))
            budget -= num_new
            i += 1
        admitted_handoffs: list[_Sequence] = []
        if num_preempted == 0:
            while self._waiting and len(self._running) < self.max_num_seqs:
                seq = self._waiting[0]
                is_handoff = seq.is_prefilled and seq.num_output_tokens == 0  # role decode, KV arriving
                if is_handoff:
                    num_hit_blocks = min(self._num_hit_blocks(seq, cap=False), seq.num_prompt_tokens // self.block_size_tokens)
                    num_left = 0 if self._finish_reason(seq, seq.first_token_id, 1) else 1  # its decode of index 1
                else:
                    num_hit_blocks = self._num_hit_blocks(seq)
                    num_left = seq.num_tokens - num_hit_blocks * self.block_size_tokens
                if budget <= 0 and num_left > 0:
                    break
                if self.chunked_prefill:
                    num_new = min(num_left, budget)
                elif num_left <= budget:
                    num_new = num_left
                else:
                    break  # a whole prompt only, and it does not fit this step: FIFO waits
                if not self._admit(seq, num_hit_blocks, num_new):
                    break
                self._waiting.popleft()
                self._running.append(seq)
                if is_handoff:
                    seq.num_output_tokens = 1  # index 0 (the hand-off's token) is emitted this step
                    seq.output_token_ids = [seq.first_token_id]
                    admitted_handoffs.append(seq)
                if num_new:
                    scheduled.append((seq, num_new))
                    budget -= num_new
        return scheduled, num_preempted, admitted_handoffs

    def _schedule_prefill_first(self) -> tuple[list[tuple[_Sequence, int]], int, list[_Sequence]]:
        """Scheduler "sglang": a prefill step if one can be formed, else a decode step (module
        docstring, "Prefill-first")."""
        scheduled: list[tuple[_Sequence, int]] = []
        chunk_left = self.max_num_batched_tokens if self.chunked_prefill else None
        input_left = self.max_prefill_tokens
        for seq in self._running:  # the prompt being chunked (or recomputed) goes on first
            if self._is_decoding(seq):
                continue
            num_new = seq.num_tokens - seq.num_computed_tokens
            if chunk_left is not None:
                num_new = min(num_new, chunk_left)
            if num_new <= 0 or not self._grow(seq, seq.num_computed_tokens + num_new):
                continue
            scheduled.append((seq, num_new))
            input_left -= num_new
            if chunk_left is not None:
                chunk_left -= num_new
        cut = any(seq.num_computed_tokens + k < seq.num_tokens for seq, k in scheduled)
        while (not cut and self._waiting and len(self._running) < self.max_num_seqs and input_left > 0
               and (chunk_left is None or chunk_left > 0)):
            seq = self._waiting[0]
            num_hit_blocks = self._num_hit_blocks(seq)
            num_new = seq.num_tokens - num_hit_blocks * self.block_size_tokens
            if chunk_left is not None and num_new > chunk_left:
                num_new, cut = chunk_left, True
            if scheduled and num_new > input_left:
                break
            if not self._admit(seq, num_hit_blocks, num_new):
                break
            self._waiting.popleft()
            self._running.append(seq)
            scheduled.append((seq, num_new))
            input_left -= num_new
            if chunk_left is not None:
                chunk_left -= num_new
        if scheduled:
            return scheduled, 0, []
        num_preempted = 0
        i = 0
        while i < len(self._running):  # a decode step of every decoding sequence
            seq = self._running[i]
            if not self._is_decoding(seq):
                i += 1
                continue
            preempted_itself = False
            while not self._grow(seq, seq.num_computed_tokens + 1):
                victim = self._running.pop()
                self._preempt(victim)
                num_preempted += 1
                if victim is seq:
                    preempted_itself = True
                    break
            if preempted_itself:
                break
            scheduled.append((seq, 1))
            i += 1
        return scheduled, num_preempted, []

    @staticmethod
    def _is_decoding(seq: _Sequence) -> bool:
        """Every known token but the last has KV: its next step samples one token."""
        return seq.num_output_tokens > 0 and seq.num_computed_tokens == seq.num_tokens - 1

    def _execute(self, scheduled: list[tuple[_Sequence, int]], num_preempted: int, admitted_handoffs: list[_Sequence],
                 failed: list[FailedOut], batches_done: list[BatchPrefilled]) -> StepResult:
        tokens: list[TokenOut] = []
        finished: list[FinishedOut] = []
        handoffs: list[HandoffOut] = []
        batches_started: list[str] = []
        work: list[tuple[_Sequence, int, int, bool]] = []  # (sequence, tokens computed before, now, is a decode)
        num_prefill_tokens = num_decoding = 0
        for seq in admitted_handoffs:  # role decode: the first token came with the hand-off
            tokens.append(TokenOut(request_id=seq.request.request_id, index=0, token_id=seq.first_token_id))
            self._register_prompt_blocks(seq)
            reason = self._finish_reason(seq, seq.first_token_id, 1)
            if reason:
                finished.append(self._finish(seq, reason))
        for seq, k in scheduled:
            c = seq.num_computed_tokens
            is_decode = seq.num_output_tokens > 0 and c == seq.num_tokens - 1
            if is_decode:
                num_decoding += 1
            else:
                num_prefill_tokens += k
                progress = self._batches.get(seq.batch_id) if seq.batch_id and not seq.is_prefilled else None
                if progress is not None and not progress.started:
                    progress.started = True
                    batches_started.append(progress.batch_id)
            work.append((seq, c, k, is_decode))
            seq.num_computed_tokens = c + k
            self._register_prompt_blocks(seq)
        # Every sequence whose computed tokens reach all its known ones samples one token.
        sampling = [seq for seq, _ in scheduled if seq.num_computed_tokens >= seq.num_tokens]
        token_ids, duration_ms, prefill_ms_by_batch = self._compute(work, sampling)
        for seq, token_id in zip(sampling, token_ids):
            rid = seq.request.request_id
            index = seq.num_output_tokens
            if not seq.is_prefilled:  # its prompt's last chunk: the first token
                self._leave_batch(seq, prefilled=True, done=batches_done)
                seq.is_prefilled = True
                if self.role == "prefill":
                    seq.num_output_tokens = 1
                    seq.output_token_ids = [token_id]
                    handoffs.append(self._handoff(seq, token_id))
                    self._running.remove(seq)
                    del self._request_id_to_seq[rid]
                    self._release(seq)
                    continue
            tokens.append(TokenOut(request_id=rid, index=index, token_id=token_id))
            seq.num_output_tokens = index + 1
            seq.output_token_ids.append(token_id)
            reason = self._finish_reason(seq, token_id, index + 1)
            if reason:
                finished.append(self._finish(seq, reason))
        kind: StepKind = "prefill" if num_prefill_tokens else "decode"
        return StepResult(
            kind=kind, duration_ms=duration_ms, batches_started=batches_started, batches_prefilled=batches_done,
            prefill_ms_by_batch=prefill_ms_by_batch, num_prefill_tokens=num_prefill_tokens,
            num_decode_tokens=num_decoding, num_preemptions=num_preempted,
            tokens=tokens, finished=finished, handoffs=handoffs, failed=failed,
            blocks_stored=list(self._step_stored), blocks_removed=list(self._step_removed),
        )

    # ----------------------------------------------------------------------- the compute (the torch engine overrides)
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
        token_ids = [sim_token_id(seq.request.request_id, seq.num_output_tokens) for seq in sampling]
        return token_ids, duration_ms, prefill_ms_by_batch

    def _finish_reason(self, seq: _Sequence, token_id: int, num_output_tokens: int) -> str | None:
        """After emitting `token_id` as output number `num_output_tokens` (from 1): why it
        ends, or None. The sim generates exactly max_tokens."""
        return "length" if num_output_tokens >= seq.request.max_tokens else None

    def _handoff(self, seq: _Sequence, first_token_id: int) -> HandoffOut:
        """Role prefill, before the sequence's blocks are released."""
        return HandoffOut(request_id=seq.request.request_id, batch_id=seq.batch_id or "", first_token_id=first_token_id,
                          num_cached_tokens=seq.num_cached_tokens)

    def _finish(self, seq: _Sequence, reason: str) -> FinishedOut:
        self._running.remove(seq)
        del self._request_id_to_seq[seq.request.request_id]
        self._release(seq)
        return FinishedOut(
            request_id=seq.request.request_id,
            finish_reason=reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            num_cached_tokens=max(0, seq.num_cached_tokens),
        )

    def _preempt(self, seq: _Sequence) -> None:
        """Free its blocks and put it first in line; it recomputes prompt + outputs later."""
        self._release(seq)
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._waiting.appendleft(seq)

    def _leave_batch(self, seq: _Sequence, prefilled: bool, done: list[BatchPrefilled]) -> None:
        """Account a member's prefill end (or departure) to its batch; report the batch when
        its last member is through."""
        if seq.is_prefilled or seq.batch_id is None:
            return
        progress = self._batches.get(seq.batch_id)
        if progress is None:
            return
        progress.num_pending -= 1
        if prefilled:
            progress.num_prompt_tokens += seq.num_prompt_tokens
            progress.num_cached_tokens += max(0, seq.num_cached_tokens)
        else:
            progress.request_ids.remove(seq.request.request_id)
        if progress.num_pending == 0:  # reported even when every member was cancelled (empty ids)
            del self._batches[seq.batch_id]
            done.append(BatchPrefilled(batch_id=progress.batch_id, request_ids=progress.request_ids,
                                       num_prompt_tokens=progress.num_prompt_tokens,
                                       num_cached_tokens=progress.num_cached_tokens))

    # ----------------------------------------------------------------------- validation
    def _check_new_ids(self, request_ids: list[str]) -> None:
        failing = {f.request_id for f in self._pending_failures}
        live = [rid for rid in request_ids if rid in self._request_id_to_seq or rid in failing]
        if live or len(set(request_ids)) < len(request_ids):
            raise ValueError(f"duplicate request ids: {live or request_ids} (already in the engine or twice)")

    def _validate(self, request: EngineRequest) -> FailedOut | None:
        num_prompt_tokens = len(request.prompt_token_ids)
        num_output_tokens = 0 if self.role == "prefill" else request.max_tokens  # prefill hands off
        num_blocks = -(-(num_prompt_tokens + num_output_tokens) // self.block_size_tokens)
        if num_prompt_tokens == 0 or request.max_tokens < 1:
            code, message = "invalid_request", "the prompt must be non-empty and max_tokens at least 1"
        elif num_prompt_tokens + request.max_tokens > self.max_seq_len_tokens:
            code, message = "too_large", (f"prompt {num_prompt_tokens} + max_tokens {request.max_tokens} tokens "
                                          f"exceed max_seq_len_tokens {self.max_seq_len_tokens}")
        elif num_blocks > self.num_kv_blocks:
            code, message = "too_large", f"needs {num_blocks} KV blocks, the engine has {self.num_kv_blocks}"
        else:
            return None
        return FailedOut(request_id=request.request_id, code=code, message=message)

    # ----------------------------------------------------------------------- KV blocks
    def _hashes(self, request: EngineRequest) -> list[int]:
        if request.block_hashes is not None:
            return request.block_hashes
        return block_hashes(request.prompt_token_ids, self.block_size_tokens)

    def _num_hit_blocks(self, seq: _Sequence, cap: bool = True) -> int:
        """Leading prompt blocks served from the cache (cap: at least one token is computed)."""
        num_hit_blocks = 0
        for h in seq.prompt_block_hashes:
            if h not in self._block_hash_to_refcount:
                break
            num_hit_blocks += 1
        if cap and num_hit_blocks * self.block_size_tokens >= seq.num_tokens:
            num_hit_blocks = max(0, num_hit_blocks - 1)
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
