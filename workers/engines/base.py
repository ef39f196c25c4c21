"""The engine contract: what the worker agent (workers/agent.py) and the sim HTTP front
(workers/sim_server/http.py) call on an engine, and the records one engine step returns.

`Engine` is implemented by `SimEngine` (workers/engines/sim.py: modelled time and KV) and
`TorchEngine` (workers/engines/torch_engine.py: a real model, measured time), both on the
shared scheduler `ScheduledEngine` (workers/engines/scheduler.py). The HTTP-backed engine
(workers/openai/agent.py) has no steps of its own: it is an agent backend
(`EngineBackend` in workers/agent.py), not an `Engine`.

Calling contract (one caller, one thread: the event loop):
- `submit_batch` (roles pd_fusion, prefill) / `submit_decode` (role decode) queue requests
  at once; `cancel` removes one at once. None of them computes anything.
- `step()` runs one engine iteration: the engine's state changes immediately (a request
  cancelled afterwards gets nothing more), and the returned `StepResult` is what the caller
  publishes once the step's time is up: it sleeps `duration_ms` (× its time scale) first
  when `measures_time` is False (modelled time), not at all when True (the step already
  ran and `duration_ms` was measured). None: nothing to do; wait for a submission.
- A request's invalid input is not an exception: it comes back as a `FailedOut` in the
  next step (a step of kind "report" when nothing else runs). A caller bug is a
  ValueError: a request id already in the engine, an empty batch, the wrong role.
- Every request emits output indices 0..n-1 once, in order, then exactly one of
  `FinishedOut`, `FailedOut` or (role prefill) `HandoffOut`, unless it is cancelled.
- An exception from `step()` is an engine bug; what the caller then does is
  workers/engines/step_loop.py's (every request the engine held fails `worker_failed`).
"""

from __future__ import annotations

from typing import Literal, Protocol

import msgspec


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
    # The LoRA adapter to run it with ("": the base model). One the engine does not serve
    # fails the request `adapter_not_found` (workers/engines/scheduler.py, "LoRA adapters").
    lora_adapter: str = ""
    # A continuation's first output index (schemas ForEngine.output_offset): the engine draws its
    # n-th token as output number output_offset + n (the sim's token id, the sampler's seed);
    # TokenOut.index and the counts stay its own, from 0.
    output_offset: int = 0


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
    code: str  # a schemas.errors code: "invalid_request" | "too_large" | "dispatch_failed" | "adapter_not_found"
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
    lora_loads: list[str] = []  # LoRA adapters loaded into a slot in this step, in load order


class Engine(Protocol):
    """One engine behind the worker (module docstring: the calling contract)."""

    role: str  # "pd_fusion" | "prefill" | "decode"
    num_kv_blocks: int  # KV capacity, in blocks of block_size_tokens
    block_size_tokens: int
    max_seq_len_tokens: int  # longest prompt + max_tokens one request may have
    max_num_seqs: int  # most sequences running at once (reported: the router queues beyond it)
    lora_adapters: list[str]  # the LoRA adapters it can serve (loaded or loadable); []: none
    max_loras: int  # adapter slots: adapters loaded at once (0: no adapters)
    num_lora_loads: int  # adapters loaded into a slot since boot
    # True: step() ran the step and duration_ms is measured wall time (the caller does not
    # sleep it); False: duration_ms is modelled and the caller sleeps it before publishing.
    measures_time: bool

    def submit_batch(self, batch: EngineBatch) -> None:
        """Queue a batch's requests, FIFO (roles pd_fusion, prefill)."""

    def submit_decode(self, request: EngineRequest, first_token_id: int, num_cached_tokens: int,
                      kv: object = None) -> None:
        """Role decode: queue a request handed off by a prefill engine; `first_token_id` is its
        output index 0, `kv` the prompt's K/V where the prefill engine exported it."""

    def cancel(self, request_id: str) -> bool:
        """Drop a waiting or running request and free its KV; False if it is not here."""

    def step(self) -> StepResult | None:
        """Run one iteration; None when there is nothing to do."""

    # Introspection (status reports, /metrics, /get_load): current values, no side effects.
    @property
    def num_free_kv_blocks(self) -> int: ...

    @property
    def num_cached_kv_blocks(self) -> int:
        """Blocks held only by the prefix cache (evictable)."""

    @property
    def num_used_kv_blocks(self) -> int:
        """Blocks held by requests."""

    @property
    def num_running_requests(self) -> int: ...

    @property
    def num_queued_requests(self) -> int: ...

    @property
    def num_queued_batches(self) -> int:
        """Batches none of whose members has started its prefill."""

    def running_request_ids(self) -> list[str]:
        """Every request the engine holds (waiting, then running)."""

    def all_cached_block_hashes(self) -> list[int]:
        """The prefix cache's block hashes (a KV snapshot)."""

    def loaded_lora_adapters(self) -> list[str]:
        """The adapters in its slots now, least recently used first."""

