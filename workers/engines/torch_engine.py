"""The torch engine: a real transformer (workers/engines/torch_model.py) behind the engine
contract (workers/engines/base.py), on the scheduler it shares with the sim engine.

`TorchEngine` derives from `ScheduledEngine` (workers/engines/scheduler.py), as `SimEngine`
does: the same `submit_batch` / `submit_decode` / `cancel` / `step`, the same continuous
batching under `max_num_batched_tokens`, chunked prefill, `max_num_seqs`, preemption of the
newest running sequence with recompute, the same `StepResult`s and KV events. What it
brings of its own, through the scheduler's hooks:

- the block accounting: the `PagedKvCache` (workers/engines/paged_kv.py) is the only record
  of which blocks are free, used or evictable, so the scheduler's decisions and the tensors
  cannot disagree. Prefix hits are looked up in it by the router's chained block hashes;
  its stored / removed events become the step's `blocks_stored` / `blocks_removed`.
- the compute: each step runs ONE forward pass over the packed tokens of every scheduled
  sequence (prefill chunks from their first uncached token, decodes one token each), reading
  and writing K/V through the block tables; the sequences that reach all their known tokens
  sample their next token (workers/engines/sampling.py; per-request seed, so batching,
  chunking and recompute do not change the output).
- the time: `duration_ms` is MEASURED (wall time of the forward and sampling, after a
  `torch.cuda.synchronize()` on a GPU), not modelled; the agent does not sleep it again
  (`measures_time`). A batch's share of a step (`prefill_ms_by_batch`) is the step's time ×
  its chunk tokens / all tokens of the step (decodes count one each), so the router's
  prefill predictor learns the real engine online.
- stop rule: a request ends at `max_tokens` ("length") or on the model's end token
  ("stop", unless `ignore_eos`); the seeded tiny and 1b presets have no end token.

PD hand-off with real KV: role prefill exports the prompt's K/V ([2, layers, tokens,
kv_heads, head_dim]) in its `HandoffOut.kv`; role decode takes it in `submit_decode(kv=...)`
and writes it into its own blocks at admission (blocks it already caches under the same
hashes are pinned, not written), then decodes from it: the prompt is never recomputed
(unless the sequence is preempted later, like any). `kv_to_bytes` / `kv_from_bytes` are the
wire format: one JSON header line (shape, dtype) and the raw tensor bytes; the worker ships
them through a JetStream object store (workers/agent.py says why).

The step runs on the caller's thread (the worker's event loop): on the tiny model a step is
milliseconds; a large model on a CPU makes the heartbeat late by a step, far inside the
router's liveness timeouts at the default `max_num_batched_tokens`.

Bad input is a failed request, as in the sim (`invalid_request`: a token id outside the
vocabulary, bad sampling parameters; `too_large`: beyond the model's max positions), and a
hand-off whose K/V does not fit this model fails `dispatch_failed` (the prefill worker runs
another model).

LoRA adapters: none. The engine is built without any (`lora_adapters` is a setting of the
sim engine), so it reports none and a request naming one fails `adapter_not_found` (the
scheduler's validation, "it serves no LoRA adapters"); the router never sends one here
unless its view of the worker is wrong. Running real adapters would need their weights
applied in torch_model.py's projections, per sequence of the packed batch.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import time

import torch

from workers.engines.base import EngineRequest, FailedOut, HandoffOut
from workers.engines.paged_kv import KvFull, PagedKvCache, SeqKv
from workers.engines.sampling import SamplingParams, sample
from workers.engines.scheduler import ScheduledEngine, _Sequence
from workers.engines.torch_model import PRESETS, LlamaModel, build_model, load_hf_dir


def load_model(spec: str, device: str = "cpu", seed: int = 0, dtype: str | None = None) -> LlamaModel:
    """`tiny` / `1b` (seeded random weights) or a local Hugging Face Llama directory."""
    if spec in PRESETS:
        cfg = PRESETS[spec]
        if dtype is not None:
            from dataclasses import replace
            cfg = replace(cfg, dtype=dtype)
        return build_model(cfg, seed=seed, device=device)
    if pathlib.Path(spec).is_dir():
        return load_hf_dir(spec, device=device, dtype=dtype)
    raise ValueError(f"model {spec!r} is neither a preset ({', '.join(PRESETS)}) nor a local directory")


def kv_to_bytes(kv: torch.Tensor) -> bytes:
    """The hand-off's wire format: a JSON header line, then the tensor's raw bytes."""
    t = kv.detach().contiguous().cpu()
    header = json.dumps({"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}).encode()
    return header + b"\n" + t.view(torch.uint8).numpy().tobytes()


def kv_from_bytes(data: bytes) -> torch.Tensor:
    head, sep, raw = bytes(data).partition(b"\n")
    try:
        meta = json.loads(head)
        dtype = getattr(torch, meta["dtype"])
        shape = [int(x) for x in meta["shape"]]
    except (ValueError, KeyError, AttributeError, TypeError) as exc:
        raise ValueError(f"not a KV hand-off payload: {exc}") from None
    t = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    n = 1
    for x in shape:
        n *= x
    if not sep or t.numel() != n * dtype.itemsize:
        raise ValueError(f"KV payload has {t.numel()} bytes, its header {shape} {meta['dtype']} says {n * dtype.itemsize}")
    return t.view(dtype).reshape(shape)


def _request_seed(request: EngineRequest) -> int:
    if request.seed is not None:
        return request.seed
    return int.from_bytes(hashlib.blake2b(request.request_id.encode(), digest_size=8).digest(), "little") >> 1


class TorchEngine(ScheduledEngine):
    """A real model under the shared scheduler (module docstring)."""

    measures_time = True

    def __init__(self, model: LlamaModel, role: str, num_kv_blocks: int, block_size_tokens: int,
                 max_seq_len_tokens: int, max_num_batched_tokens: int = 8192, max_num_seqs: int = 256,
                 chunked_prefill: bool = True, scheduler: str = "vllm", max_prefill_tokens: int = 16384) -> None:
        cfg = model.cfg
        super().__init__(role=role, num_kv_blocks=num_kv_blocks, block_size_tokens=block_size_tokens,
                         max_seq_len_tokens=min(max_seq_len_tokens, cfg.max_positions),
                         max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                         chunked_prefill=chunked_prefill, scheduler=scheduler, max_prefill_tokens=max_prefill_tokens)
        self.model = model
        self.device = next(model.parameters()).device
        self.stop_token_id = cfg.eos_token_id
        self.kv = PagedKvCache(cfg.num_layers, num_kv_blocks, block_size_tokens, cfg.num_kv_heads, cfg.head_dim,
                               dtype=cfg.torch_dtype, device=str(self.device))
        self._slots: dict[str, list[int]] = {}  # request -> slots of the tokens it computes this step
        self._arriving_kv: dict[str, torch.Tensor] = {}  # role decode: hand-offs not admitted yet
        self._params: dict[str, SamplingParams] = {}

    # ----------------------------------------------------------------------- introspection
    @property
    def num_free_kv_blocks(self) -> int:
        return self.kv.num_free_blocks

    @property
    def num_cached_kv_blocks(self) -> int:
        return self.kv.num_evictable_blocks

    @property
    def num_used_kv_blocks(self) -> int:
        return self.kv.num_used_blocks

    def all_cached_block_hashes(self) -> list[int]:
        return self.kv.cached_hashes()

    def check_invariants(self) -> None:
        self.kv.check_invariants()
        checks = {
            "a waiting sequence holds KV": all(not self.kv.has(s.request.request_id) for s in self._waiting),
            "a running sequence's KV differs from its computed tokens": all(
                self.kv.has(s.request.request_id) and self.kv.num_tokens(s.request.request_id) == s.num_computed_tokens
                for s in self._running),
            "more sequences run than max_num_seqs": len(self._running) <= self.max_num_seqs,
            **self._lora_checks(),
        }
        broken = [what for what, ok in checks.items() if not ok]
        if broken:
            raise AssertionError("; ".join(broken))

    # ----------------------------------------------------------------------- commands
    def submit_decode(self, request: EngineRequest, first_token_id: int, num_cached_tokens: int,
                      kv: torch.Tensor | None = None) -> None:
        """Role decode: queue a handed-off request with its prompt's K/V (module docstring)."""
        cfg = self.model.cfg
        want = (2, cfg.num_layers, len(request.prompt_token_ids), cfg.num_kv_heads, cfg.head_dim)
        if kv is None or tuple(kv.shape) != want:
            self._check_new_ids([request.request_id])
            got = "none" if kv is None else list(kv.shape)
            self._pending_failures.append(FailedOut(
                request_id=request.request_id, code="dispatch_failed",
                message=f"the hand-off's KV is {got}, this model needs {list(want)} (prefill runs another model?)"))
            return
        super().submit_decode(request, first_token_id, num_cached_tokens)
        if request.request_id in self._request_id_to_seq:
            self._arriving_kv[request.request_id] = kv

    def cancel(self, request_id: str) -> bool:
        self._arriving_kv.pop(request_id, None)
        self._params.pop(request_id, None)
        return super().cancel(request_id)

    # ----------------------------------------------------------------------- validation
    def _validate(self, request: EngineRequest) -> FailedOut | None:
        failure = super()._validate(request)
        if failure is not None:
            return failure
        vocab = self.model.cfg.vocab_size
        bad = next((t for t in request.prompt_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            return FailedOut(request_id=request.request_id, code="invalid_request",
                             message=f"token id {bad} is outside the model's vocabulary of {vocab}")
        try:
            self._params[request.request_id] = SamplingParams(
                temperature=request.temperature, top_p=request.top_p, seed=_request_seed(request),
                max_tokens=request.max_tokens, stop_token_id=self.stop_token_id, ignore_eos=request.ignore_eos)
        except ValueError as exc:
            return FailedOut(request_id=request.request_id, code="invalid_request", message=str(exc))
        return None

    def _finish_reason(self, seq: _Sequence, token_id: int, num_output_tokens: int) -> str | None:
        if num_output_tokens >= seq.request.max_tokens:
            return "length"
        params = self._params.get(seq.request.request_id)
        if params is not None and params.stops(token_id, num_output_tokens):
            return "stop"
        return None

    # ----------------------------------------------------------------------- KV blocks
    def _num_cached_prefix_blocks(self, seq: _Sequence) -> int:
        return self.kv.num_cached_prefix_blocks(seq.prompt_block_hashes)

    def _admit(self, seq: _Sequence, num_hit_blocks: int, num_new: int) -> bool:
        rid = seq.request.request_id
        bs = self.block_size_tokens
        start = max(seq.num_computed_tokens, num_hit_blocks * bs)
        if not self.kv.can_start(seq.prompt_block_hashes, num_hit_blocks, start + num_new):
            return False
        cached = self.kv.allocate(rid, seq.prompt_block_hashes, max_hit_blocks=num_hit_blocks)
        arriving = self._arriving_kv.pop(rid, None)
        if arriving is not None and seq.num_computed_tokens > cached:  # a hand-off: its prompt's K/V arrived
            slots = self.kv.extend(rid, seq.num_computed_tokens - cached)
            self.kv.write_slots(slots, arriving[:, :, cached:seq.num_computed_tokens])
        elif seq.num_computed_tokens == 0:
            seq.num_computed_tokens = cached
            if seq.num_cached_tokens < 0:
                seq.num_cached_tokens = cached
        seq.num_registered_blocks = num_hit_blocks
        self._slots[rid] = self.kv.extend(rid, num_new) if num_new else []
        return True

    def _grow(self, seq: _Sequence, num_tokens_with_kv: int) -> bool:
        rid = seq.request.request_id
        try:
            self._slots[rid] = self.kv.extend(rid, num_tokens_with_kv - self.kv.num_tokens(rid))
        except KvFull:
            return False
        return True

    def _register_prompt_blocks(self, seq: _Sequence) -> None:
        self.kv.register_full_blocks(seq.request.request_id, min(seq.num_computed_tokens, seq.num_prompt_tokens))

    def _release(self, seq: _Sequence) -> None:
        rid = seq.request.request_id
        if self.kv.has(rid):
            self.kv.free(rid)
        self._slots.pop(rid, None)
        if rid not in self._request_id_to_seq:  # it left the engine (not a preemption)
            self._params.pop(rid, None)

    def _handoff(self, seq: _Sequence, first_token_id: int) -> HandoffOut:
        rid = seq.request.request_id
        return HandoffOut(request_id=rid, batch_id=seq.batch_id or "", first_token_id=first_token_id,
                          num_cached_tokens=seq.num_cached_tokens, kv=self.kv.export(rid, seq.num_prompt_tokens))

    # ----------------------------------------------------------------------- the compute
    def _compute(self, work: list[tuple[_Sequence, int, int, bool]],
                 sampling: list[_Sequence]) -> tuple[list[int], float, dict[str, float]]:
        t0 = time.perf_counter()
        ids: list[int] = []
        positions: list[int] = []
        lengths: list[int] = []
        seq_ids: list[str] = []
        slots: list[list[int]] = []
        last_row: dict[int, int] = {}  # id(seq) -> row of its last new token
        for seq, c, k, _ in work:
            rid = seq.request.request_id
            prompt, n = seq.request.prompt_token_ids, seq.num_prompt_tokens
            if c + k <= n:
                ids.extend(prompt[c:c + k])
            else:
                ids.extend(prompt[c:n] + seq.output_token_ids[max(0, c - n):c + k - n])
            positions.extend(range(c, c + k))
            lengths.append(k)
            seq_ids.append(rid)
            slots.append(self._slots.pop(rid))
            last_row[id(seq)] = len(ids) - 1
        token_ids: list[int] = []
        if work:
            with torch.inference_mode():
                rows = self.model(torch.tensor(ids, device=self.device), torch.tensor(positions, device=self.device),
                                  lengths, SeqKv(self.kv, seq_ids, slots), rows=[last_row[id(s)] for s in sampling])
                greedy = torch.argmax(rows, dim=-1).tolist()  # one device sync for the greedy ones
                for i, seq in enumerate(sampling):
                    params = self._params[seq.request.request_id]
                    index = seq.request.output_offset + seq.num_output_tokens  # (a continuation's: from its offset)
                    token_ids.append(greedy[i] if params.temperature == 0 else sample(rows[i], params, index))
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        duration_ms = (time.perf_counter() - t0) * 1000
        num_step_tokens = sum(k for _, _, k, _ in work)
        prefill_ms_by_batch: dict[str, float] = {}
        for seq, _, k, is_decode in work:
            if not is_decode and seq.batch_id is not None and not seq.is_prefilled:
                share = duration_ms * k / num_step_tokens
                prefill_ms_by_batch[seq.batch_id] = prefill_ms_by_batch.get(seq.batch_id, 0.0) + share
        for kind, hashes in self.kv.take_events():  # evictions while scheduling, stores as blocks filled
            for h in hashes:
                self._note_cache_change(h, stored=kind == "stored")
        return token_ids, duration_ms, prefill_ms_by_batch
