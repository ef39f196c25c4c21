"""The scheduler shared by the sim and torch engines: queues, continuous batching (vLLM V1's
scheduler, or SGLang's prefill-first one), chunked prefill, preemption, hand-offs, and the
step's records (workers/engines/base.py has the contract and the records).

`ScheduledEngine` is an abstract base: it decides which sequences compute how many tokens in
a step and turns what they computed into a `StepResult`. A subclass owns the two things that
differ between engines, through the hooks below (section "Hooks"):
- the KV blocks: `SimEngine` (workers/engines/sim.py) counts blocks and keeps its own prefix
  cache; `TorchEngine` (workers/engines/torch_engine.py) asks its paged KV cache, which
  holds the tensors.
- the compute: the sim models a step's time from a timing profile and draws `sim_token_id`;
  the torch engine runs the model and measures the time.
Why a base class and not composition: the hooks are called from deep inside the scheduling
passes (admission, growth, preemption), with the scheduler's own `_Sequence` records, and
both engines share every line of that; a separate "KV policy" object would have to see the
same records anyway. Nothing here reads a clock, draws a random number or does I/O.

Parameters (the worker builds the engine from its config: `workers.config.make_engine`):
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
- lora_adapters (none): the LoRA adapters the engine can serve (section "LoRA adapters");
  max_loras (0; >= 1 with adapters, and only then): its adapter slots, vLLM's `--max-loras`.

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

LoRA adapters (vLLM's multi-LoRA serving: a request names an adapter, a batch mixes
adapters, at most max_loras are loaded at once, in an LRU of slots):
- a request naming an adapter the engine does not serve fails `adapter_not_found` at
  submission (an engine without adapters, the torch engine, serves none).
- a sequence is admitted only if its adapter is loaded, or a slot is free, or one can be
  freed: the least recently used loaded adapter that no running sequence uses is evicted.
  Admission loads the adapter (counted in `num_lora_loads`, listed in the step's
  `lora_loads`; the sim charges each load's time to the step, workers/engines/sim.py).
  Every step marks the adapters of the sequences it runs most recently used, as vLLM's
  worker does.
- when every slot holds an adapter a running sequence uses, the sequence waits where it is
  in the queue, and the sequences behind it are admitted only if they run the base model.
  vLLM V1 skips such a request and admits later ones of any adapter; those keep the loaded
  adapters busy, so a steady stream of them can starve it forever. Here nothing new holds a
  slot while it waits: the running sequences of the loaded adapters finish, a slot frees,
  and it is the first to take it. (Preempted sequences go back to the front.)
- invariants (checked by the engines' `check_invariants`): at most max_loras adapters are
  loaded; every running sequence's adapter is loaded.
- role decode: a hand-off carries no adapter (StartDecode names none); it decodes on the base.

Role decode: a hand-off waits like any request with its prompt already computed (its KV
arrives with it): admitted FIFO when blocks for prompt + 1 fit; it emits index 0 = its
`first_token_id` and, if max_tokens > 1, index 1 in that same step (max_tokens == 1: it
finishes at admission and adds no compute). So every request emits indices
0..max_tokens-1 once, in order, preempted or not. A step with no compute but failures to
report is a zero-duration step of kind "report"; nothing at all: None.

Not modelled: speculative decoding, priority scheduling, long-prefill thresholds, SGLang's
mixed chunking and its KV reservation for future decode tokens (new_token_ratio; admission
here needs the blocks of the tokens computed now, under both schedulers), swapping to CPU,
KV transfer time (PD), per-step CPU overhead, and, in the sim engine, output-dependent stop
rules (a request generates exactly max_tokens: finish_reason "length"; the torch engine
also stops at the model's end token).

Submissions are validated at once: prompt empty or max_tokens < 1 -> "invalid_request"; an
adapter it does not serve -> "adapter_not_found"; prompt + max_tokens > max_seq_len_tokens,
or more blocks than num_kv_blocks (a request must be able to finish alone) -> "too_large".
Failed requests leave their batch (the rest stays) and are reported in the next step. A
request id already live in the engine, an empty batch or the wrong role is a caller bug:
ValueError (the agent dedupes redelivered commands).

Hooks (a subclass implements them; each is called only as said):
- `_num_cached_prefix_blocks(seq)`: leading prompt blocks found in the cache (a lookup,
  no change); the scheduler caps it so that at least one token is computed.
- `_admit(seq, num_hit_blocks, num_new)`: pin the hit blocks and allocate KV for the
  tokens computed now; False (nothing changed) when the blocks are not there.
- `_grow(seq, num_tokens_with_kv)`: more KV for a running sequence; False when not there.
- `_register_prompt_blocks(seq)`: the prompt's newly computed full blocks enter the cache.
- `_release(seq)`: unpin and free everything the sequence holds (finish, cancel, hand-off,
  preemption).
- `_compute(work, sampling)`: run the step: the token each sampling sequence produces, the
  step's ms, each batch's share of them. Cache changes are recorded with
  `_note_cache_change` (the step's `blocks_stored` / `blocks_removed`); the adapters this
  step loaded, with the sequence each was loaded for, are `_step_lora_loads`.
- optional: `_finish_reason` (default: "length" at max_tokens), `_handoff` (default: no
  K/V), `_validate` (call super first), and the KV introspection properties.

One module over 500 lines: admission, chunking, preemption and the prefix cache act on the
same running set and block table within one step; split, one invariant (every block
accounted once) would span modules.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from schemas.messages import parse_role
from schemas.tokens import block_hashes
from workers.engines.base import (
    BatchPrefilled,
    EngineBatch,
    EngineRequest,
    FailedOut,
    FinishedOut,
    HandoffOut,
    StepKind,
    StepResult,
    TokenOut,
)

SCHEDULERS = ("vllm", "sglang")  # the engine's step scheduler (module docstring)


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



class ScheduledEngine:
    """The scheduling both engines share (module docstring); a subclass supplies the hooks."""

    measures_time = False  # duration_ms is modelled: the caller sleeps it (the torch engine: measured)

    def __init__(self, role: str, num_kv_blocks: int, block_size_tokens: int, max_seq_len_tokens: int,
                 max_num_batched_tokens: int = 8192, max_num_seqs: int = 256, chunked_prefill: bool = True,
                 scheduler: str = "vllm", max_prefill_tokens: int = 16384, lora_adapters: Sequence[str] = (),
                 max_loras: int = 0) -> None:
        if min(num_kv_blocks, block_size_tokens, max_seq_len_tokens, max_num_batched_tokens, max_num_seqs,
               max_prefill_tokens) <= 0:
            raise ValueError("num_kv_blocks, block_size_tokens, max_seq_len_tokens, max_num_batched_tokens, "
                             "max_num_seqs and max_prefill_tokens must be positive")
        if scheduler not in SCHEDULERS:
            raise ValueError(f"unknown engine scheduler {scheduler!r}; known: {', '.join(SCHEDULERS)}")
        if not all(lora_adapters) or len(set(lora_adapters)) < len(lora_adapters):
            raise ValueError(f"lora_adapters must be distinct non-empty names, got {list(lora_adapters)}")
        if max_loras < 0 or bool(lora_adapters) != (max_loras > 0):
            raise ValueError(f"max_loras must be >= 1 with lora_adapters and 0 without, got {max_loras} "
                             f"with {len(lora_adapters)} adapters")
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
        self._step_stored: dict[int, None] = {}  # block hashes the cache gained in this step (net)
        self._step_removed: dict[int, None] = {}  # and lost
        self.num_preemptions = 0  # since boot
        self.lora_adapters = list(lora_adapters)  # what it can serve (module docstring, "LoRA adapters")
        self._servable_loras = frozenset(lora_adapters)
        self.max_loras = max_loras
        self._loaded_loras: OrderedDict[str, None] = OrderedDict()  # the slots' adapters, least recently used first
        self._step_lora_loads: list[tuple[str, _Sequence]] = []  # (adapter, the sequence it was loaded for) of this step
        self.num_lora_loads = 0  # since boot

    # ----------------------------------------------------------------------- introspection
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

    def loaded_lora_adapters(self) -> list[str]:
        """The adapters in the slots, least recently used first."""
        return list(self._loaded_loras)

    def running_lora_adapters(self) -> list[str]:
        """The distinct adapters of the running sequences, in admission order (vLLM's
        `running_lora_adapters` label)."""
        return list(dict.fromkeys(s.request.lora_adapter for s in self._running if s.request.lora_adapter))

    def waiting_lora_adapters(self) -> list[str]:
        """The distinct adapters of the waiting sequences, in queue order (vLLM's
        `waiting_lora_adapters` label)."""
        return list(dict.fromkeys(s.request.lora_adapter for s in self._waiting if s.request.lora_adapter))

    # The KV introspection is the subclass's (workers/engines/base.py, Engine).
    @property
    def num_free_kv_blocks(self) -> int:
        raise NotImplementedError

    @property
    def num_cached_kv_blocks(self) -> int:
        raise NotImplementedError

    @property
    def num_used_kv_blocks(self) -> int:
        raise NotImplementedError

    def all_cached_block_hashes(self) -> list[int]:
        raise NotImplementedError

    def check_invariants(self) -> None:
        """Raise AssertionError if the accounting is inconsistent (tests, debug runs)."""
        raise NotImplementedError

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
        self._step_lora_loads.clear()
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
            is_grown, n = self._grow_preempting(seq, seq.num_computed_tokens + num_new)
            num_preempted += n
            if not is_grown:
                break  # nothing older is left to preempt: nothing more runs this step
            scheduled.append((seq, num_new))
            budget -= num_new
            i += 1
        admitted_handoffs: list[_Sequence] = []
        if num_preempted == 0:
            i = 0  # the sequences before this one wait for a LoRA slot (module docstring, "LoRA adapters")
            while i < len(self._waiting) and len(self._running) < self.max_num_seqs:
                seq = self._waiting[i]
                if self._waits_for_lora_slot(seq, is_behind_a_waiter=i > 0):
                    i += 1
                    continue
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
                del self._waiting[i]
                self._use_lora(seq)
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
        i = 0  # the sequences before this one wait for a LoRA slot (module docstring, "LoRA adapters")
        while (not cut and i < len(self._waiting) and len(self._running) < self.max_num_seqs and input_left > 0
               and (chunk_left is None or chunk_left > 0)):
            seq = self._waiting[i]
            if self._waits_for_lora_slot(seq, is_behind_a_waiter=i > 0):
                i += 1
                continue
            num_hit_blocks = self._num_hit_blocks(seq)
            num_new = seq.num_tokens - num_hit_blocks * self.block_size_tokens
            if chunk_left is not None and num_new > chunk_left:
                num_new, cut = chunk_left, True
            if scheduled and num_new > input_left:
                break
            if not self._admit(seq, num_hit_blocks, num_new):
                break
            del self._waiting[i]
            self._use_lora(seq)
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
            is_grown, n = self._grow_preempting(seq, seq.num_computed_tokens + 1)
            num_preempted += n
            if not is_grown:
                break
            scheduled.append((seq, 1))
            i += 1
        return scheduled, num_preempted, []

    def _grow_preempting(self, seq: _Sequence, num_tokens_with_kv: int) -> tuple[bool, int]:
        """Grow a running sequence's KV, preempting the newest running sequences until it
        fits: (False when `seq` itself had to go, the number preempted)."""
        num_preempted = 0
        while not self._grow(seq, num_tokens_with_kv):
            victim = self._running.pop()
            self._preempt(victim)
            num_preempted += 1
            if victim is seq:
                return False, num_preempted
        return True, num_preempted

    # ----------------------------------------------------------------------- LoRA slots (module docstring)
    def _waits_for_lora_slot(self, seq: _Sequence, is_behind_a_waiter: bool) -> bool:
        """Whether `seq` stays waiting for its adapter: no slot holds it or can take it, or a
        sequence ahead of it waits for a slot (`is_behind_a_waiter`) and it runs an adapter too."""
        adapter = seq.request.lora_adapter
        if not adapter:
            return False
        if is_behind_a_waiter:
            return True
        return (adapter not in self._loaded_loras and len(self._loaded_loras) >= self.max_loras
                and self._lora_victim() is None)

    def _lora_victim(self) -> str | None:
        """The least recently used loaded adapter no running sequence uses; None: all are in use."""
        in_use = {s.request.lora_adapter for s in self._running}
        return next((a for a in self._loaded_loras if a not in in_use), None)

    def _use_lora(self, seq: _Sequence) -> None:
        """`seq` is admitted: load its adapter unless it is loaded (evicting `_lora_victim` when
        the slots are full; `_waits_for_lora_slot` said one can go) and mark it most recently used."""
        adapter = seq.request.lora_adapter
        if not adapter:
            return
        if adapter not in self._loaded_loras:
            if len(self._loaded_loras) >= self.max_loras:
                del self._loaded_loras[self._lora_victim()]
            self.num_lora_loads += 1
            self._step_lora_loads.append((adapter, seq))
        self._loaded_loras[adapter] = None
        self._loaded_loras.move_to_end(adapter)

    def _lora_checks(self) -> dict[str, bool]:
        """The LoRA slots' invariants, for the engines' `check_invariants`: what -> holds."""
        return {
            "more LoRA adapters loaded than max_loras": len(self._loaded_loras) <= self.max_loras,
            "a running sequence's LoRA adapter is not loaded": all(
                s.request.lora_adapter in self._loaded_loras for s in self._running if s.request.lora_adapter),
        }

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
            if seq.request.lora_adapter:  # the step runs it: its adapter is the most recently used
                self._loaded_loras.move_to_end(seq.request.lora_adapter)
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
            lora_loads=[adapter for adapter, _ in self._step_lora_loads],
        )

    # ----------------------------------------------------------------------- hooks (module docstring)
    def _compute(self, work: list[tuple[_Sequence, int, int, bool]],
                 sampling: list[_Sequence]) -> tuple[list[int], float, dict[str, float]]:
        """Run the step over `work` [(sequence, tokens computed before, now, is a decode)]:
        (the token each `sampling` sequence produces, the step's ms, batch id -> its share)."""
        raise NotImplementedError

    def _num_cached_prefix_blocks(self, seq: _Sequence) -> int:
        raise NotImplementedError

    def _admit(self, seq: _Sequence, num_hit_blocks: int, num_new: int) -> bool:
        raise NotImplementedError

    def _grow(self, seq: _Sequence, num_tokens_with_kv: int) -> bool:
        raise NotImplementedError

    def _register_prompt_blocks(self, seq: _Sequence) -> None:
        raise NotImplementedError

    def _release(self, seq: _Sequence) -> None:
        raise NotImplementedError

    def _finish_reason(self, seq: _Sequence, token_id: int, num_output_tokens: int) -> str | None:
        """After emitting `token_id` as output number `num_output_tokens` (from 1): why it
        ends, or None. Default: at max_tokens ("length"), the only stop rule of the sim."""
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
        elif request.lora_adapter and request.lora_adapter not in self._servable_loras:
            served = (f"it serves {', '.join(self.lora_adapters)}" if self.lora_adapters
                      else "it serves no LoRA adapters")
            code, message = "adapter_not_found", f"LoRA adapter {request.lora_adapter!r} is not served by this engine: {served}"
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
        num_hit_blocks = self._num_cached_prefix_blocks(seq)
        if cap and num_hit_blocks * self.block_size_tokens >= seq.num_tokens:
            num_hit_blocks = max(0, num_hit_blocks - 1)
        return num_hit_blocks

    def _note_cache_change(self, block_hash: int, stored: bool) -> None:
        """Record the net change of this step: a store undoes an earlier removal and back."""
        undo, record = (self._step_removed, self._step_stored) if stored else (self._step_stored, self._step_removed)
        if block_hash in undo:
            del undo[block_hash]
        else:
            record[block_hash] = None

