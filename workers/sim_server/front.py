"""The sim-server's engine side (`SimFront`): one engine (built by `workers.config.make_engine`,
exactly as the NATS worker builds it), driven by the shared step loop
(workers/engines/step_loop.py), and the open requests' streams; no transport. The ASGI app
(workers/sim_server/http.py) submits requests and reads their deltas.

Each engine step, once its time is up, becomes one `Delta` per request it touched (its new
token ids, and its end: finished or failed), put on the request's queue. An exception from
`engine.step()` fails every open request with `worker_failed` (the step loop's rule).
A request abandoned while a computed step waits for delivery keeps its id refused until
then (that step may still carry its tokens).

`GET /metrics` (Prometheus text, built by hand: no global registry; the same at `GET
  /_sim/metrics`, which `--bare-openai` keeps). vLLM's names, label
  `model_name`: `vllm:num_requests_running`, `vllm:num_requests_waiting`,
  `vllm:kv_cache_usage_perc` (used / total blocks, 0..1; cached-but-free blocks count as
  free, as in vLLM), `vllm:cache_config_info{block_size, num_gpu_blocks}` (value 1),
  `vllm:prefix_cache_queries_total` / `vllm:prefix_cache_hits_total` (prompt tokens /
  cached prompt tokens of finished requests), `vllm:prompt_tokens_total`,
  `vllm:generation_tokens_total`, `vllm:num_preemptions_total` (when the engine reports
  preemptions). Ours: `flexlb_sim_requests_total` (accepted into the engine, health checks
  excluded), `flexlb_sim_traced_requests_total` (POSTs with a W3C `traceparent` header),
  `flexlb_sim_failed_generations_total` (generations failed by `--fail-generations`),
  `flexlb_sim_requests_finished_total`, `flexlb_sim_requests_cancelled_total`,
  `flexlb_sim_requests_failed_total{code}`, `flexlb_sim_prompt_tokens_total` /
  `flexlb_sim_cached_tokens_total` (finished requests), `flexlb_sim_output_tokens_total`
  (tokens delivered), `flexlb_sim_preemptions_total` (when reported), `flexlb_sim_steps_total`,
  `flexlb_sim_engine_errors_total`, `flexlb_sim_kv_blocks{state="free|cached|used"}`.
  With LoRA adapters (`--lora-adapters`, workers/config.py): vLLM's
  `vllm:lora_requests_info{max_lora, running_lora_adapters, waiting_lora_adapters}` (the
  distinct adapters of the running and of the waiting sequences, comma-separated; value:
  the time it was read, as vLLM's is the time it was set), and ours
  `flexlb_sim_lora_loads_total` (adapters loaded into a slot). vLLM's gauge does not say
  which adapters sit idle in a slot, so neither does ours: what an openai agent in front of
  this server reports as loaded is what it would report in front of vLLM.

KV events, vLLM's (`--kv-events-endpoint tcp://*:5557`, optionally `--kv-events-replay-endpoint
tcp://*:5558` and `--kv-events-topic`; needs pyzmq): the server publishes its prefix cache's
changes as `vllm serve --kv-events-config` does (and, as vLLM, binds an endpoint with `*`
or `::` but connects to any other), after each engine step one batch of
BlockStored / BlockRemoved events on a ZMQ PUB socket, with vLLM's replay socket
(workers/openai/kv_zmq.py `EngineKvPublisher`: vLLM-side hashes are a different hash of ours;
a BlockStored's token ids come from the submitted prompts). Counted in
`flexlb_sim_kv_event_batches_total` / `flexlb_sim_kv_events_unknown_blocks_total`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import time
from collections import Counter
from typing import Any

from schemas.http import HttpError
from schemas.tokens import BYTE_TOKENIZER, ByteTokenizer, HFTokenizer
from workers.config import WorkerConfig, make_engine
from workers.engines.base import EngineBatch, EngineRequest, FailedOut, FinishedOut, StepResult
from workers.engines.step_loop import ENGINE_FAILED_CODE, StepLoop
from workers.sim_server.pd import MAX_ROOMS

log = logging.getLogger("flexlb.sim_http")

DEFAULT_MODEL_NAME = "flexlb-sim"


class Delta:
    """What one engine step produced for one request (delivered after the step's sleep)."""

    __slots__ = ("token_ids", "finished", "failed")

    def __init__(self, token_ids: list[int], finished: FinishedOut | None = None,
                 failed: FailedOut | None = None) -> None:
        self.token_ids = token_ids
        self.finished = finished
        self.failed = failed


class OpenRequest:
    """A request in the engine, from submission until its terminal delta (or its cancel)."""

    __slots__ = ("request_id", "num_prompt_tokens", "max_tokens", "deltas", "is_health_check")

    def __init__(self, request_id: str, num_prompt_tokens: int, max_tokens: int, is_health_check: bool) -> None:
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self.max_tokens = max_tokens
        self.deltas: asyncio.Queue[Delta] = asyncio.Queue()
        self.is_health_check = is_health_check


class SimFront:
    """One engine, its step loop, and the open requests' streams (the transport-free half)."""

    def __init__(self, cfg: WorkerConfig, model_name: str = DEFAULT_MODEL_NAME,
                 tokenizer: ByteTokenizer | HFTokenizer = BYTE_TOKENIZER) -> None:
        self.cfg = cfg
        self.model_name = model_name
        self.tokenizer = tokenizer  # text prompts in, output ids to text (module docstring)
        if cfg.engine == "torch" and cfg.role != "pd_fusion":
            raise ValueError("the HTTP front runs the torch engine colocated only (pd_fusion): its PD hand-off of "
                             "real KV goes through the NATS worker")
        self.engine = make_engine(cfg)
        if model_name in self.engine.lora_adapters:  # (the NATS worker's check is WorkerConfig.validate's)
            raise ValueError(f"lora_adapters names the served model {model_name!r}: a request's `model` would not "
                             "say whether it wants the adapter or the base")
        self._boot = secrets.token_hex(3)
        self._ids = itertools.count()
        self._open: dict[str, OpenRequest] = {}  # request id -> its stream
        # Abandoned while a computed step waits for delivery: that step may still carry their
        # tokens, so the id is refused until it is delivered (a new request under the same id
        # would otherwise receive the old one's tokens).
        self._is_step_in_flight = False
        self._abandoned_in_step: set[str] = set()
        self.step_loop = StepLoop(self.engine, self, cfg.time_scale, f"sim-server {cfg.worker_id}")
        self._loop_task: asyncio.Task | None = None
        self._reports_preemptions = "num_preemptions" in StepResult.__struct_fields__
        self.role = cfg.role
        # PD (module docstring): bootstrap room -> future of (first token id, cached tokens),
        # or an HttpError when the prefill failed; request id -> its room (prefill role).
        self._rooms: dict[int, asyncio.Future] = {}
        self._room_of: dict[str, int] = {}
        # Counters (monotonic, since start).
        self.num_requests = 0  # accepted into the engine, health checks excluded
        self.num_chat_requests = 0  # of those, through /v1/chat/completions
        self.num_traced_requests = 0  # POSTs that carried a W3C traceparent header
        self.num_failed_generations = 0  # generations answered 500 by fault injection (--fail-generations)
        self.num_health_generations = 0
        self.num_finished = 0
        self.num_cancelled = 0
        self.code_to_num_failed: Counter[str] = Counter()
        self.num_prompt_tokens_finished = 0  # prompt tokens of finished requests
        self.num_cached_tokens_finished = 0  # of those, served from the prefix cache
        self.num_output_tokens = 0  # tokens delivered to requests
        self.num_preemptions = 0
        self.num_steps = 0
        # vLLM's KV events (module docstring): the engine's cache changes on a ZMQ PUB socket.
        self.kv_events = None
        if cfg.kv_events_endpoint:
            from workers.openai.kv_zmq import EngineKvPublisher  # pyzmq (the openai extra): only when asked for

            self.kv_events = EngineKvPublisher(cfg.kv_events_endpoint, cfg.kv_events_replay_endpoint or None,
                                               cfg.kv_events_topic, cfg.block_size_tokens)
        elif cfg.kv_events_replay_endpoint:
            raise ValueError("kv_events_replay_endpoint needs kv_events_endpoint")

    # ----------------------------------------------------------------------- lifecycle
    def start(self) -> None:
        self._loop_task = asyncio.get_running_loop().create_task(self.step_loop.run(), name="sim-step-loop")

    async def stop(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except asyncio.CancelledError:
                pass
        self._fail_all("worker_failed", f"sim-server {self.cfg.worker_id} is shutting down")
        if self.kv_events is not None:
            self.kv_events.close()

    @property
    def is_running(self) -> bool:
        return self._loop_task is not None and not self._loop_task.done()

    # ----------------------------------------------------------------------- commands
    def new_request_id(self) -> str:
        return f"{self.cfg.worker_id}-{self._boot}-{next(self._ids)}"

    def submit(self, request_id: str, prompt_token_ids: list[int], max_tokens: int,
               is_health_check: bool = False, room: int | None = None,
               handoff: tuple[int, int] | None = None, lora_adapter: str = "", output_offset: int = 0) -> OpenRequest:
        """Queue one request in the engine; its deltas arrive on the returned stream. PD: a
        prefill server's request names its bootstrap `room`; a decode server's comes with the
        `handoff` (first token id, cached tokens) its room delivered. `lora_adapter`: one of
        the engine's adapters ("": the base model)."""
        if not is_health_check and self.role == "prefill" and room is None:
            raise HttpError("invalid_request", "a prefill server needs bootstrap_room (PD: send through a PD router)")
        if not is_health_check and self.role == "decode" and handoff is None:
            raise HttpError("invalid_request", "a decode server needs bootstrap_room (PD: send through a PD router)")
        if request_id in self._open:
            raise HttpError("duplicate_request", f"request {request_id} is already running on this server")
        if request_id in self._abandoned_in_step:
            raise HttpError("duplicate_request", f"request {request_id} is still leaving the engine; retry")
        if not self.is_running:
            raise HttpError("not_ready", "the engine's step loop is not running")
        req = OpenRequest(request_id, len(prompt_token_ids), max_tokens, is_health_check)
        request = EngineRequest(request_id=request_id, prompt_token_ids=prompt_token_ids, max_tokens=max_tokens,
                                lora_adapter=lora_adapter, output_offset=output_offset)
        if self.kv_events is not None:
            self.kv_events.note_prompt(prompt_token_ids)  # the tokens and parents of the blocks it may store
        try:
            if self.role == "decode":
                first_token_id, num_cached = handoff if handoff is not None else (0, 0)
                self.engine.submit_decode(request, first_token_id, num_cached)
            else:
                self.engine.submit_batch(EngineBatch(batch_id=request_id, requests=[request]))
        except ValueError as exc:  # an abandoned request whose failure the engine has yet to report
            raise HttpError("duplicate_request", str(exc)) from None
        if room is not None and self.role == "prefill":
            self._room_of[request_id] = room
        self._open[request_id] = req
        if is_health_check:
            self.num_health_generations += 1
        else:
            self.num_requests += 1
        self.step_loop.work.set()
        return req

    def abandon(self, request_id: str) -> bool:
        """The client went away: drop the request from the engine. False if it had ended."""
        req = self._open.pop(request_id, None)
        if req is None:
            return False
        self._resolve_room(request_id, HttpError("cancelled", f"the prefill of {request_id} was cancelled"))
        self.engine.cancel(request_id)  # False when its failure is still pending: nothing to free
        if self._is_step_in_flight:
            self._abandoned_in_step.add(request_id)
        if not req.is_health_check:
            self.num_cancelled += 1
        return True

    def room(self, room: int) -> asyncio.Future:
        """The room's future, made by whichever side asks first (the router sends to both
        servers at once, so the decode server may ask before the prefill server has the request)."""
        fut = self._rooms.get(room)
        if fut is None:
            fut = self._rooms[room] = asyncio.get_running_loop().create_future()
            if len(self._rooms) > MAX_ROOMS:  # dicts keep insertion order: drop the oldest
                del self._rooms[next(iter(self._rooms))]
        return fut

    def forget_room(self, room: int) -> None:
        """A room is answered once: the decode server has its hand-off."""
        self._rooms.pop(room, None)

    def _resolve_room(self, request_id: str, value: tuple[int, int] | HttpError) -> None:
        room = self._room_of.pop(request_id, None)
        if room is None:
            return
        fut = self.room(room)
        if not fut.done():
            fut.set_result(value)

    # ----------------------------------------------------------------------- the step loop's sink (workers/engines/step_loop.py)
    async def step_began(self, step: StepResult) -> None:
        if self.kv_events is not None:  # at step(), as the engine's state changes
            self.kv_events.publish_step(step.blocks_stored, step.blocks_removed)
        self._is_step_in_flight = True

    def sleep_over(self) -> None:
        self._is_step_in_flight = False
        self._abandoned_in_step.clear()

    async def step_ended(self, step: StepResult, measured_ms: float) -> None:
        self._deliver(step)

    async def engine_failed(self, message: str) -> None:
        self._fail_all(ENGINE_FAILED_CODE, message)

    @property
    def num_engine_errors(self) -> int:
        return self.step_loop.num_engine_errors

    def _deliver(self, step: StepResult) -> None:
        self.num_steps += 1
        if self._reports_preemptions:
            self.num_preemptions += getattr(step, "num_preemptions", 0)
        request_id_to_delta: dict[str, tuple[OpenRequest, Delta]] = {}

        def delta_of(request_id: str) -> Delta | None:
            entry = request_id_to_delta.get(request_id)
            if entry is None:
                req = self._open.get(request_id)
                if req is None:
                    return None  # cancelled meanwhile (or shut down)
                entry = request_id_to_delta[request_id] = (req, Delta([]))
            return entry[1]

        for t in step.tokens:
            delta = delta_of(t.request_id)
            if delta is not None:
                delta.token_ids.append(t.token_id)
        for f in step.finished:
            delta = delta_of(f.request_id)
            if delta is not None:
                delta.finished = f
        for f in step.failed:
            self._resolve_room(f.request_id, HttpError(f.code, f"prefill failed: {f.message}"))
            delta = delta_of(f.request_id)
            if delta is not None:
                delta.failed = f
        for h in step.handoffs:  # prefill role: the prompt is done; the decode server takes over
            self._resolve_room(h.request_id, (h.first_token_id, h.num_cached_tokens))
            delta = delta_of(h.request_id)
            if delta is not None:
                req = self._open[h.request_id]
                delta.token_ids.append(h.first_token_id)
                delta.finished = FinishedOut(request_id=h.request_id, finish_reason="length",
                                             num_prompt_tokens=req.num_prompt_tokens, num_output_tokens=1,
                                             num_cached_tokens=h.num_cached_tokens)
        for request_id, (req, delta) in request_id_to_delta.items():
            if delta.finished is not None or delta.failed is not None:
                del self._open[request_id]
            if not req.is_health_check:
                self._count(delta)
            req.deltas.put_nowait(delta)

    def _count(self, delta: Delta) -> None:
        self.num_output_tokens += len(delta.token_ids)
        if delta.finished is not None:
            self.num_finished += 1
            self.num_prompt_tokens_finished += delta.finished.num_prompt_tokens
            self.num_cached_tokens_finished += delta.finished.num_cached_tokens
        if delta.failed is not None:
            self.code_to_num_failed[delta.failed.code] += 1
            log.info("request %s failed in the engine: %s: %s", delta.failed.request_id, delta.failed.code,
                     delta.failed.message)

    def _fail_all(self, code: str, message: str) -> None:
        for request_id, req in list(self._open.items()):
            self.engine.cancel(request_id)
            self._resolve_room(request_id, HttpError(code, message))
            delta = Delta([], failed=FailedOut(request_id=request_id, code=code, message=message))
            if not req.is_health_check:
                self._count(delta)
            req.deltas.put_nowait(delta)
        self._open.clear()

    # ----------------------------------------------------------------------- introspection
    def load(self) -> list[dict[str, int]]:
        """SGLang's `/get_load` body (see the module docstring)."""
        running, waiting = self.engine.num_running_requests, self.engine.num_queued_requests
        return [{
            "dp_rank": 0, "num_reqs": running + waiting, "num_waiting_reqs": waiting,
            "num_tokens": self.engine.num_used_kv_blocks * self.cfg.block_size_tokens,
        }]

    def metrics_text(self) -> str:
        e = self.engine
        model = f'{{model_name="{self.model_name}"}}'
        lines: list[str] = []

        def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
            lines.append(f"# HELP {name} {help_text}")
            lines.append(f"# TYPE {name} {kind}")
            lines.extend(f"{name}{labels} {value}" for labels, value in samples)

        total_blocks = e.num_kv_blocks
        metric("vllm:num_requests_running", "gauge", "Requests running in the engine.", [(model, e.num_running_requests)])
        metric("vllm:num_requests_waiting", "gauge", "Requests queued in the engine.", [(model, e.num_queued_requests)])
        metric("vllm:kv_cache_usage_perc", "gauge", "KV blocks held by requests / all KV blocks (0..1).",
               [(model, e.num_used_kv_blocks / total_blocks if total_blocks else 0.0)])
        metric("vllm:cache_config_info", "gauge", "The KV cache's configuration (labels), as vLLM exports it.",
               [(f'{{block_size="{self.cfg.block_size_tokens}",num_gpu_blocks="{total_blocks}"}}', 1)])
        metric("vllm:prefix_cache_queries_total", "counter", "Prompt tokens of finished requests.",
               [(model, self.num_prompt_tokens_finished)])
        metric("vllm:prefix_cache_hits_total", "counter", "Prompt tokens of finished requests served from the prefix cache.",
               [(model, self.num_cached_tokens_finished)])
        metric("vllm:prompt_tokens_total", "counter", "Prompt tokens of finished requests.",
               [(model, self.num_prompt_tokens_finished)])
        metric("vllm:generation_tokens_total", "counter", "Output tokens delivered.", [(model, self.num_output_tokens)])
        if self._reports_preemptions:
            metric("vllm:num_preemptions_total", "counter", "Sequences preempted.", [(model, self.num_preemptions)])
        metric("flexlb_sim_requests_total", "counter", "Requests accepted into the engine (health checks excluded).",
               [("", self.num_requests)])
        metric("flexlb_sim_chat_requests_total", "counter", "Requests accepted through /v1/chat/completions.",
               [("", self.num_chat_requests)])
        metric("flexlb_sim_traced_requests_total", "counter", "POSTs that carried a W3C traceparent header.",
               [("", self.num_traced_requests)])
        metric("flexlb_sim_failed_generations_total", "counter", "Generations answered 500 by fault injection "
               "(--fail-generations).", [("", self.num_failed_generations)])
        metric("flexlb_sim_requests_finished_total", "counter", "Requests that generated all their tokens.",
               [("", self.num_finished)])
        metric("flexlb_sim_requests_cancelled_total", "counter", "Requests cancelled by a client disconnect.",
               [("", self.num_cancelled)])
        metric("flexlb_sim_requests_failed_total", "counter", "Requests failed, by error code.",
               [(f'{{code="{code}"}}', n) for code, n in sorted(self.code_to_num_failed.items())])
        metric("flexlb_sim_health_generations_total", "counter", "GET /health_generate generations.",
               [("", self.num_health_generations)])
        metric("flexlb_sim_prompt_tokens_total", "counter", "Prompt tokens of finished requests.",
               [("", self.num_prompt_tokens_finished)])
        metric("flexlb_sim_cached_tokens_total", "counter", "Prompt tokens of finished requests served from the prefix cache.",
               [("", self.num_cached_tokens_finished)])
        metric("flexlb_sim_output_tokens_total", "counter", "Output tokens delivered.", [("", self.num_output_tokens)])
        if self._reports_preemptions:
            metric("flexlb_sim_preemptions_total", "counter", "Sequences preempted by the engine.", [("", self.num_preemptions)])
        metric("flexlb_sim_steps_total", "counter", "Engine steps run.", [("", self.num_steps)])
        metric("flexlb_sim_engine_errors_total", "counter", "Exceptions raised by engine.step().",
               [("", self.num_engine_errors)])
        if e.lora_adapters:
            labels = (f'{{max_lora="{e.max_loras}",running_lora_adapters="{",".join(e.running_lora_adapters())}",'
                      f'waiting_lora_adapters="{",".join(e.waiting_lora_adapters())}"}}')
            metric("vllm:lora_requests_info", "gauge", "Running stats on lora requests.", [(labels, time.time())])
            metric("flexlb_sim_lora_loads_total", "counter", "LoRA adapters loaded into a slot.",
                   [("", e.num_lora_loads)])
        metric("flexlb_sim_kv_blocks", "gauge", "KV blocks by state.", [
            ('{state="free"}', e.num_free_kv_blocks), ('{state="cached"}', e.num_cached_kv_blocks),
            ('{state="used"}', e.num_used_kv_blocks),
        ])
        if self.kv_events is not None:
            metric("flexlb_sim_kv_event_batches_total", "counter", "vLLM KV event batches published.",
                   [("", self.kv_events.publisher.num_published)])
            metric("flexlb_sim_kv_events_unknown_blocks_total", "counter",
                   "Stored blocks not published as KV events: not among the submitted prompts' blocks.",
                   [("", self.kv_events.num_unknown_stored)])
        return "\n".join(lines) + "\n"

    def server_info(self) -> dict[str, Any]:
        c = self.cfg
        return {
            "served_model_name": self.model_name, "context_length": c.max_seq_len_tokens,
            "max_total_num_tokens": c.num_kv_blocks * c.block_size_tokens, "page_size": c.block_size_tokens,
            "max_running_requests": self.engine.max_num_seqs, "chunked_prefill_size": c.max_num_batched_tokens,
            "dp_size": 1, "tp_size": 1, "engine": "flexlb-sim", "worker_id": c.worker_id,
            "time_scale": c.time_scale, "num_kv_blocks": c.num_kv_blocks, "block_size_tokens": c.block_size_tokens,
            "chunked_prefill": c.chunked_prefill, "profile": c.profile or "default", "tokenizer": self.tokenizer.name,
            "scheduler": c.scheduler, "max_prefill_tokens": c.max_prefill_tokens,
            "lora_paths": list(self.engine.lora_adapters), "max_loras_per_batch": self.engine.max_loras,
        }
