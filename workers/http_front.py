"""An HTTP front for the simulated engine, so peer routers can drive the very same engine.

`flexlb sim-server --port P [engine flags]` serves one `SimEngine` (built by
`workers.agent.make_engine`, exactly as the NATS worker builds it) over the HTTP dialects
that sglang-router and vllm-router speak to their workers, so a benchmark can put FlexLB,
sglang-router (cache_aware, power_of_two, ...) and vllm-router (cache_aware, round_robin,
...) in front of identical engines and compare routing alone.

The step loop (one asyncio task): `engine.step()`; sleep `duration_ms × time_scale`; then
deliver that step's tokens, finishes and failures to the per-request streams. With nothing
to do it waits until a request arrives. `time_scale` 0 is instant but still yields to the
event loop once per step. The engine's state changes at `step()` (before the sleep), as in
the NATS worker: a request cancelled during the sleep gets nothing of that step.

Every generation request becomes one `EngineBatch` of one `EngineRequest`. Its id is the
`X-Request-Id` header, else the body's `rid` (SGLang) or `request_id`, else a fresh one
(`<worker id>-<boot hex>-<n>`); an id that is still in the engine is refused (409
`duplicate_request`). The simulated output depends on the id (`sim_token_id`). Text is
tokenized with the project's byte-level tokenizer (`schemas.tokens`: one ASCII character =
one token), or with `--tokenizer PATH` by a Hugging Face tokenizer.json (the router's
`--tokenizer`: both then give the same ids for a text), and output ids are decoded back
with the same one (incrementally, so a UTF-8 character split across chunks is not mangled:
an HF tokenizer's chunk is held while its text ends in U+FFFD). As in vLLM, a text prompt
gets the tokenizer's special tokens (BOS) unless the body says `add_special_tokens: false`
(`/v1/completions`, `/tokenize`, `/v1/completions/render`); output text skips them. An HF
tokenizer runs in a thread (it releases the GIL; the step loop keeps its pace). A client
that disconnects cancels its request in the engine.

Endpoints
- `POST /v1/completions` (OpenAI): `prompt` (text, token ids, or a one-element list of
  either), `max_tokens` (default 16, as OpenAI), `stream`, `stream_options.include_usage`,
  `return_token_ids` (vLLM >= 0.10.2: each choice also carries `token_ids`, that chunk's).
  Non-streaming: `{"id", "object": "text_completion", "created", "model", "choices":
  [{"index": 0, "text", "logprobs": null, "finish_reason": "length"}], "usage":
  {"prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details":
  {"cached_tokens"}}}`. Streaming: SSE `data: {...}` chunks of the same shape (object
  `text_completion`, the text of that engine step; the last one has `finish_reason`), with
  `include_usage` one more chunk with `choices: []` and `usage`, then `data: [DONE]`.
- `POST /v1/chat/completions` (OpenAI): `messages` rendered by the server's chat template
  (`--chat-template FILE`, else the one beside `--tokenizer`'s tokenizer.json, else the
  built-in one of schemas/chat_template.py for the byte tokenizer; none: 400) with `tools`,
  `add_generation_prompt` (default true), `continue_final_message`,
  `chat_template_kwargs`, a tool call's JSON `arguments` decoded first (as vLLM does), then
  encoded without special tokens (the template writes them) and run as a completion of
  `max_completion_tokens` or `max_tokens` (default 16, as /v1/completions). `tool_choice`
  and the like are accepted and ignored. Non-streaming: `{"id": "chatcmpl-...", "object":
  "chat.completion", "choices": [{"index": 0, "message": {"role": "assistant",
  "content"}, "logprobs": null, "finish_reason"}], "usage"}` (usage as above). Streaming:
  `chat.completion.chunk`s, the first `{"delta": {"role": "assistant", "content": ""}}`,
  then `{"delta": {"content"}}` per engine step (the last with `finish_reason`), with
  `include_usage` a last `choices: []` chunk with `usage`, then `data: [DONE]`. With
  `return_token_ids`, as vLLM: the prompt's ids as top-level `prompt_token_ids` (of the
  first chunk, or of the body) and each choice's `token_ids`. Counted in
  `flexlb_sim_chat_requests_total`.
- `POST /generate` (SGLang): `text` or `input_ids` (or a one-element list),
  `sampling_params.max_new_tokens` (default 128, as SGLang), `stream`. Non-streaming:
  `{"text", "output_ids", "meta_info": {"id", "finish_reason": {"type": "length",
  "length"}, "prompt_tokens", "completion_tokens", "cached_tokens"}}`. Streaming: SSE of
  `{"text", "output_ids", "meta_info": {...}, "index": 0}` (finish_reason null until the
  last; completion_tokens the count so far), then `data: [DONE]`, as SGLang does: text and
  output_ids are the whole output so far (SGLang's default), or that chunk's with
  `--incremental-streaming-output` (SGLang's flag of that name).
- `POST /abort_request` (SGLang): `{"rid"}` -> 200 (also when it is not running); the
  request leaves the engine and its stream ends as SGLang ends it: a last chunk with
  `finish_reason: {"type": "abort"}` (an error chunk on the OpenAI endpoints; a 499
  `cancelled` before the first token or for a non-streaming request).
- Unknown body fields (`model`, `temperature`, `slo_ttft_ms`, `stream_options`, sglang-
  router's `echo: false`, `skip_special_tokens`, `return_hidden_states`, `bootstrap_*`, ...)
  are accepted and ignored. Refused with 400 because they would change the answer: `n` > 1,
  `echo: true`, a batch of several prompts.
- Errors: `{"error": {"code", "message", "retryable"}}` (`schemas.errors`), status by code:
  `invalid_request` 400 (bad JSON, bad field, empty prompt, max_tokens < 1), `too_large` 413
  (prompt + max_tokens over `max_seq_len_tokens`, or more KV blocks than the engine has),
  `duplicate_request` 409, `not_ready` 503 (the step loop died), `dispatch_failed` /
  anything else from the engine 502. A failure
  before the first token is an HTTP error (a streaming response starts only with its first
  token); after it, an error chunk `data: {"error": {...}}` then `data: [DONE]`.
- `POST /tokenize` (vLLM): `{"prompt"}` or `{"text"}` (text or ids), or vLLM's chat form
  `{"messages", ...}` (rendered as /v1/chat/completions renders it) -> `{"count",
  "max_model_len", "tokens", "token_strs": null}` (vllm-router's fallback when render fails).
- `POST /v1/completions/render` (vLLM): the completion body -> `[{"request_id", "model",
  "token_ids"}]`, vLLM's render shape. vllm-router 0.1.17's cache_aware calls it on every
  worker for every `/v1/completions` request (it falls back to `/tokenize` when a worker's
  render fails); its prefix tree is built from these token ids. `/generate` is routed by
  text, without either call.
- `GET /health`: 200 while the step loop runs, 503 once it has died. `GET
  /health_generate`: a real one-token generation through the engine (prompt "health",
  shorter than a block, so the prefix cache is untouched; counted apart, in
  `flexlb_sim_health_generations_total`).
- `GET /server_info`, `/get_server_info`: the engine's configuration in SGLang's key names
  where one exists (`served_model_name`, `context_length`, `max_total_num_tokens`,
  `page_size`, `max_running_requests`, `chunked_prefill_size`, `dp_size` 1, `tp_size` 1),
  plus ours. `GET /model_info`, `/get_model_info`: `{"is_generation": true,
  "served_model_name", "model_type": "flexlb-sim"}`. Neither has `model_path` or
  `tokenizer_path`: sglang-router downloads a tokenizer named there (no internet here);
  ours is under `tokenizer` (`byte`, or `hf:<path>`).
- `GET /v1/models`: the one served model, with `max_model_len`.
- `GET /get_load`: SGLang's list `[{"dp_rank": 0, "num_reqs": running + waiting,
  "num_waiting_reqs", "num_tokens"}]`. The power_of_two policies of sglang-router 0.3.2 and
  vllm-router 0.1.17 poll it every `--worker-startup-check-interval` seconds (default 30)
  and sum `num_tokens` over the list (sglang-router reads anything else, `{"load": N}`
  included, as -1 = unknown).
  `num_tokens` is the KV held by requests, `num_used_kv_blocks × block_size_tokens` (their
  computed prompt and generated tokens, rounded up to blocks; SGLang's also adds the prompts
  of its waiting queue, which the engine's public contract does not expose).
- `GET /metrics` (Prometheus text, built by hand: no global registry; the same at `GET
  /_sim/metrics`, which `--bare-openai` keeps). vLLM's names, label
  `model_name`: `vllm:num_requests_running`, `vllm:num_requests_waiting`,
  `vllm:kv_cache_usage_perc` (used / total blocks, 0..1; cached-but-free blocks count as
  free, as in vLLM), `vllm:cache_config_info{block_size, num_gpu_blocks}` (value 1), `vllm:prefix_cache_queries_total` / `vllm:prefix_cache_hits_total`
  (prompt tokens / cached prompt tokens of finished requests), `vllm:prompt_tokens_total`,
  `vllm:generation_tokens_total`, `vllm:num_preemptions_total` (when the engine reports
  preemptions). Ours: `flexlb_sim_requests_total` (accepted into the engine, health checks
  excluded), `flexlb_sim_requests_finished_total`, `flexlb_sim_requests_cancelled_total`,
  `flexlb_sim_requests_failed_total{code}`, `flexlb_sim_prompt_tokens_total` /
  `flexlb_sim_cached_tokens_total` (finished requests), `flexlb_sim_output_tokens_total`
  (tokens delivered), `flexlb_sim_preemptions_total` (when reported), `flexlb_sim_steps_total`,
  `flexlb_sim_engine_errors_total`, `flexlb_sim_kv_blocks{state="free|cached|used"}`.

What the peer routers call (observed on sglang-router 0.3.2 and vllm-router 0.1.17):
sglang-router registers a worker with `GET /health`, `/server_info` (falling back to
`/get_server_info`), `/model_info` (then `/get_model_info`) and takes `served_model_name`
as the model id; it also probes for gRPC with an HTTP/2 preface (`PRI *`, answered 404,
logged once; uvicorn warns "Invalid HTTP request received"). It forwards `/v1/completions`
and `/generate` bodies re-serialized, adding `echo`, `no_stop_trim`, `ignore_eos`,
`skip_special_tokens`, `return_hidden_states` (and on /generate `log_metrics`,
`return_bytes`, ...), and refuses a /v1/completions body without `model` or with a
token-id prompt itself. vllm-router checks `GET /health` at start, then every
`--health-check-interval-secs` (default 60, both routers); cache_aware calls
`/v1/completions/render` as above. Neither calls `/health_generate`, `/metrics` or
`/v1/models` on its own.

`--bare-openai`: the server looks like an OpenAI-compatible one with neither Prometheus
metrics nor token ids (TGI, llama.cpp, vLLM < 0.10.2): `GET /metrics` is 404 (its counters
stay at `/_sim/metrics`, for tests), and `return_token_ids` is ignored (no `token_ids` in
choices, no `prompt_token_ids`). Everything else is served as usual (/health, /v1/models,
usage with include_usage).

KV events, vLLM's (`--kv-events-endpoint tcp://*:5557`, optionally `--kv-events-replay-endpoint
tcp://*:5558` and `--kv-events-topic`; needs pyzmq): the server publishes its prefix cache's
changes as `vllm serve --kv-events-config` does (and, as vLLM, binds an endpoint with `*`
or `::` but connects to any other), after each engine step one batch of
BlockStored / BlockRemoved events on a ZMQ PUB socket, with vLLM's replay socket
(workers/vllm_kv_zmq.py `EngineKvPublisher`: vLLM-side hashes are a different hash of ours;
a BlockStored's token ids come from the submitted prompts). Counted in
`flexlb_sim_kv_event_batches_total` / `flexlb_sim_kv_events_unknown_blocks_total`.

Not modelled: sampling (temperature, top_p, stop strings, logprobs: the output is the
engine's deterministic `sim_token_id` text and always stops at max_tokens, finish_reason
"length"; so no tool calls or reasoning either), several prompts per request, priorities and
SLO fields, vLLM's PD protocol (kv_transfer_params), data parallelism.

PD disaggregation, SGLang's way (`--role prefill` / `--role decode`; sglang-router
`--pd-disaggregation --prefill URL PORT --decode URL`): the router sends the same body to a
prefill server and a decode server at once, with `bootstrap_host`, `bootstrap_port` and
`bootstrap_room` added (observed on sglang-router 0.3.2). The prefill server runs the prompt
on its role-prefill engine; when the engine hands the request off, the room is marked ready
(first token id, cached tokens) and the prefill server answers with that one token. The
decode server long-polls `GET /_sim/bootstrap?room=R` on `bootstrap_host:bootstrap_port`
(the prefill server's own HTTP port: give that port as the router's bootstrap port), then
queues the request on its role-decode engine with `submit_decode` (the KV "arrives": no
prefill compute) and streams every token from the first, as SGLang's decode server does.
KV transfer time is not modelled (as on the NATS path). A room waits `BOOTSTRAP_WAIT_S`; a
prefill that fails or is cancelled resolves its room with the error, which the decode
server returns. A prefill / decode server refuses a generation without `bootstrap_room`
(400 `invalid_request`), since it could not do it alone. Health checks run on either role.

Decisions: a raw ASGI app (no framework) keeps per-request overhead low and gives direct
control of disconnects (a watcher awaits `http.disconnect` and cancels the engine request,
also while it is still queued); JSON by msgspec. An exception inside `engine.step()` is an
engine bug: it is logged, counted, and every open request fails with `worker_failed` (and
is cancelled in the engine) rather than hanging; the loop then waits for the next request
before it steps again (an engine that keeps raising fails each new request, it never spins).

Imports: `schemas` and `workers` only (never `services`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import time
from collections import Counter
from typing import Any, Awaitable, Callable

import msgspec

from schemas.chat_template import ChatTemplateError, ChatTemplates
from schemas.errors import ERROR_CODES
from schemas.tokens import BYTE_TOKENIZER, ByteTokenizer, HFTokenizer
from workers.agent import WorkerConfig, make_engine
from workers.engines.base import EngineBatch, EngineRequest, FailedOut, FinishedOut, StepResult
from workers.engines.step_loop import ENGINE_FAILED_CODE, StepLoop

log = logging.getLogger("flexlb.sim_http")

DEFAULT_MODEL_NAME = "flexlb-sim"
OPENAI_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
SGLANG_DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default for /generate
MAX_BODY_BYTES = 64 * 1024 * 1024  # a larger request body is refused (413)
MAX_REQUEST_ID_CHARS = 256
HEALTH_PROMPT = "health"  # 6 tokens: under a block (16 by default), so never in the prefix cache
BOOTSTRAP_WAIT_S = 120.0  # PD: how long a decode server waits for its prefill's room
MAX_ROOMS = 65536  # PD: rooms kept (ready or awaited); the oldest is dropped beyond


_json_encode = msgspec.json.Encoder().encode
_json_decode = msgspec.json.Decoder().decode

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


class HttpError(Exception):
    """A request the front refuses; rendered as `{"error": {"code", "message", "retryable"}}`."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def error_status(code: str) -> int:
    """HTTP status of an error code; a code outside `schemas.errors` (an engine we do not
    know yet) is a 502, the engine's fault."""
    known = ERROR_CODES.get(code)
    return known.http_status if known else 502


def error_object(code: str, message: str) -> dict[str, Any]:
    """`{"error": {"code", "message", "retryable"}}`; an unknown code counts as retryable."""
    known = ERROR_CODES.get(code)
    return {"error": {"code": code, "message": message, "retryable": known.retryable if known else True}}


def error_body(code: str, message: str) -> bytes:
    return _json_encode(error_object(code, message))


# --------------------------------------------------------------------------- engine side
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
            from workers.vllm_kv_zmq import EngineKvPublisher  # pyzmq (the openai extra): only when asked for

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
               handoff: tuple[int, int] | None = None) -> OpenRequest:
        """Queue one request in the engine; its deltas arrive on the returned stream. PD: a
        prefill server's request names its bootstrap `room`; a decode server's comes with the
        `handoff` (first token id, cached tokens) its room delivered."""
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
        request = EngineRequest(request_id=request_id, prompt_token_ids=prompt_token_ids, max_tokens=max_tokens)
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
            "max_running_requests": c.max_num_seqs, "chunked_prefill_size": c.max_num_batched_tokens,
            "dp_size": 1, "tp_size": 1, "engine": "flexlb-sim", "worker_id": c.worker_id,
            "time_scale": c.time_scale, "num_kv_blocks": c.num_kv_blocks, "block_size_tokens": c.block_size_tokens,
            "chunked_prefill": c.chunked_prefill, "profile": c.profile or "default", "tokenizer": self.tokenizer.name,
            "scheduler": c.scheduler, "max_prefill_tokens": c.max_prefill_tokens,
        }


# --------------------------------------------------------------------------- request parsing
def prompt_token_ids(value: Any, field: str, tokenizer: ByteTokenizer | HFTokenizer = BYTE_TOKENIZER,
                     add_special_tokens: bool | None = None) -> list[int]:
    """Text, token ids, or a one-element list of either -> token ids (text by `tokenizer`,
    `add_special_tokens` None: its default). An empty prompt passes: the engine refuses it
    (`invalid_request`), as on the NATS path."""
    if isinstance(value, str):
        return tokenizer.encode(value, add_special_tokens)
    if isinstance(value, list):
        if all(type(v) is int for v in value):
            if any(v < 0 for v in value):
                raise HttpError("invalid_request", f"{field}: token ids must be >= 0")
            return value
        if len(value) == 1 and isinstance(value[0], (str, list)):
            return prompt_token_ids(value[0], field, tokenizer, add_special_tokens)
        if all(isinstance(v, (str, list)) for v in value):
            raise HttpError("invalid_request", f"{field}: a batch of {len(value)} prompts is not supported; send one per request")
    raise HttpError("invalid_request", f"{field} must be text or a list of token ids")


def int_field(body: dict[str, Any], name: str, default: int) -> int:
    value = body.get(name)
    if value is None:
        return default
    if type(value) is not int:
        raise HttpError("invalid_request", f"{name} must be an integer, got {value!r}")
    return value


def bool_field(body: dict[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise HttpError("invalid_request", f"{name} must be true or false, got {value!r}")
    return value


def refuse_unmodelled(body: dict[str, Any]) -> None:
    """Fields that would change the answer are refused rather than silently ignored."""
    if int_field(body, "n", 1) != 1:
        raise HttpError("invalid_request", "n > 1 is not supported by the simulated engine")
    if bool_field(body, "echo"):
        raise HttpError("invalid_request", "echo is not supported by the simulated engine")


def tool_arguments_as_objects(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """An assistant message's tool calls with their `arguments` (a JSON string in OpenAI's
    shape) decoded, as vLLM hands them to the template (templates print them with tojson);
    an argument string that is not JSON stays a string. The caller's messages are not changed."""
    out = messages
    for i, msg in enumerate(messages):
        calls = msg.get("tool_calls")
        if not isinstance(calls, list):
            continue
        fixed = []
        for call in calls:
            fn = call.get("function") if isinstance(call, dict) else None
            if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                try:
                    call = {**call, "function": {**fn, "arguments": _json_decode(fn["arguments"])}}
                except msgspec.DecodeError:
                    pass
            fixed.append(call)
        if out is messages:
            out = list(messages)
        out[i] = {**msg, "tool_calls": fixed}
    return out


def bootstrap_of(body: dict[str, Any]) -> tuple[str, int, int] | None:
    """SGLang's PD fields (host, port, room), or None when the body has no `bootstrap_room`."""
    room = body.get("bootstrap_room")
    if room is None:
        return None
    host, port = body.get("bootstrap_host"), body.get("bootstrap_port")
    if type(room) is not int or not isinstance(host, str) or type(port) is not int:
        raise HttpError("invalid_request", "bootstrap_room, bootstrap_host and bootstrap_port must be int, str, int")
    return host, port, room


async def fetch_handoff(host: str, port: int, room: int) -> tuple[int, int]:
    """PD, decode side: long-poll the prefill server's `/_sim/bootstrap` for the room; its
    error (or an unreachable server) fails this request with the same code."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout=10)
    except (OSError, asyncio.TimeoutError) as exc:
        raise HttpError("dispatch_failed", f"bootstrap server {host}:{port} unreachable: {exc}") from None
    try:
        writer.write(f"GET /_sim/bootstrap?room={room} HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n\r\n"
                     .encode())
        data = await asyncio.wait_for(reader.read(), timeout=BOOTSTRAP_WAIT_S + 10)
    except (OSError, asyncio.TimeoutError) as exc:
        raise HttpError("dispatch_failed", f"bootstrap of room {room} at {host}:{port} failed: {exc}") from None
    finally:
        writer.close()
    head, _, payload = data.partition(b"\r\n\r\n")
    try:
        status = int(head.split(b" ", 2)[1])
        if b"transfer-encoding: chunked" in head.lower():
            payload = _dechunk(payload)
        obj = _json_decode(payload)
    except (IndexError, ValueError, msgspec.DecodeError):
        raise HttpError("dispatch_failed", f"bootstrap of room {room}: unreadable answer {data[:200]!r}") from None
    if status != 200:
        err = obj.get("error", {}) if isinstance(obj, dict) else {}
        raise HttpError(err.get("code", "dispatch_failed"), f"room {room}: {err.get('message', status)}")
    return int(obj["first_token_id"]), int(obj["num_cached_tokens"])


def _dechunk(payload: bytes) -> bytes:
    out, rest = [], payload
    while rest:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            break
        out.append(rest[:size])
        rest = rest[size + 2:]
    return b"".join(out)


def request_id_of(scope: Scope, body: dict[str, Any]) -> str | None:
    for key, value in scope["headers"]:
        if key == b"x-request-id":
            request_id = value.decode("latin-1")
            break
    else:
        request_id = body.get("rid")
        if request_id is None:
            request_id = body.get("request_id")
    if request_id is None or request_id == "":
        return None
    if not isinstance(request_id, str) or len(request_id) > MAX_REQUEST_ID_CHARS:
        raise HttpError("invalid_request", f"the request id must be a string of at most {MAX_REQUEST_ID_CHARS} characters")
    return request_id


# --------------------------------------------------------------------------- response formats
class Output:
    """One request's output so far: token ids and their text (decoded incrementally)."""

    __slots__ = ("token_ids", "text_parts", "_decoder")

    def __init__(self, tokenizer: ByteTokenizer | HFTokenizer = BYTE_TOKENIZER) -> None:
        self.token_ids: list[int] = []
        self.text_parts: list[str] = []
        self._decoder = tokenizer.incremental_decoder()

    def add(self, delta: Delta) -> str:
        """Append a step's tokens; return their text (a split UTF-8 character waits)."""
        self.token_ids.extend(delta.token_ids)
        text = self._decoder.decode(delta.token_ids, final=delta.finished is not None)
        self.text_parts.append(text)
        return text

    @property
    def text(self) -> str:
        return "".join(self.text_parts)


def sse(obj: Any) -> bytes:
    return b"data: " + _json_encode(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


class OpenAIFormat:
    """`/v1/completions` bodies and chunks (OpenAI completion shape)."""

    def __init__(self, request_id: str, model: str, num_prompt_tokens: int, include_usage: bool,
                 return_token_ids: bool = False) -> None:
        self.id = f"cmpl-{request_id}"
        self.model = model
        self.created = int(time.time())
        self.num_prompt_tokens = num_prompt_tokens
        self.include_usage = include_usage
        self.return_token_ids = return_token_ids  # vLLM >= 0.10.2: each choice carries its token ids

    def _usage(self, out: Output, finished: FinishedOut) -> dict[str, Any]:
        n = len(out.token_ids)
        return {"prompt_tokens": self.num_prompt_tokens, "completion_tokens": n, "total_tokens": self.num_prompt_tokens + n,
                "prompt_tokens_details": {"cached_tokens": finished.num_cached_tokens}}

    def chunk(self, out: Output, delta: Delta, text: str) -> bytes:
        finish_reason = delta.finished.finish_reason if delta.finished is not None else None
        choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        if self.return_token_ids:
            choice["token_ids"] = delta.token_ids
        data = sse({"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                    "choices": [choice]})
        if delta.finished is not None and self.include_usage:
            data += sse({"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                         "choices": [], "usage": self._usage(out, delta.finished)})
        return data

    def body(self, out: Output, finished: FinishedOut) -> bytes:
        return _json_encode({
            "id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
            "choices": [{"index": 0, "text": out.text, "logprobs": None, "finish_reason": finished.finish_reason,
                         **({"token_ids": out.token_ids} if self.return_token_ids else {})}],
            "usage": self._usage(out, finished),
        })


class ChatFormat:
    """`/v1/chat/completions` bodies and chunks (OpenAI chat shape; vLLM's token ids)."""

    def __init__(self, request_id: str, model: str, prompt_token_ids: list[int], include_usage: bool,
                 return_token_ids: bool = False) -> None:
        self.id = f"chatcmpl-{request_id}"
        self.model = model
        self.created = int(time.time())
        self.prompt_token_ids = prompt_token_ids
        self.include_usage = include_usage
        # vLLM >= 0.10.2: the prompt's ids (the first chunk, or the body) and each choice's ids.
        self.return_token_ids = return_token_ids
        self.sent_role = False

    def _usage(self, out: Output, finished: FinishedOut) -> dict[str, Any]:
        n, p = len(out.token_ids), len(self.prompt_token_ids)
        return {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n,
                "prompt_tokens_details": {"cached_tokens": finished.num_cached_tokens}}

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> bytes:
        return sse({"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                    "choices": choices, **extra})

    def chunk(self, out: Output, delta: Delta, text: str) -> bytes:
        data = b""
        if not self.sent_role:  # the first chunk: the role, no content (and the prompt's ids)
            self.sent_role = True
            extra = {"prompt_token_ids": self.prompt_token_ids} if self.return_token_ids else {}
            data = self._chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                 "finish_reason": None}], **extra)
        finish_reason = delta.finished.finish_reason if delta.finished is not None else None
        choice: dict[str, Any] = {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": finish_reason}
        if self.return_token_ids:
            choice["token_ids"] = delta.token_ids
        data += self._chunk([choice])
        if delta.finished is not None and self.include_usage:
            data += self._chunk([], usage=self._usage(out, delta.finished))
        return data

    def body(self, out: Output, finished: FinishedOut) -> bytes:
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": out.text}, "logprobs": None,
                                  "finish_reason": finished.finish_reason}
        extra: dict[str, Any] = {}
        if self.return_token_ids:
            choice["token_ids"] = out.token_ids
            extra["prompt_token_ids"] = self.prompt_token_ids
        return _json_encode({"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                             "choices": [choice], "usage": self._usage(out, finished), **extra})


class SGLangFormat:
    """`/generate` bodies and chunks (SGLang shape: cumulative text in streams)."""

    def __init__(self, request_id: str, num_prompt_tokens: int, incremental: bool = False) -> None:
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self.incremental = incremental  # --incremental-streaming-output: each chunk's ids and text only

    def _meta(self, out: Output, finished: FinishedOut | None) -> dict[str, Any]:
        n = len(out.token_ids)
        return {
            "id": self.request_id,
            "finish_reason": {"type": finished.finish_reason, "length": n} if finished is not None else None,
            "prompt_tokens": self.num_prompt_tokens, "completion_tokens": n,
            "cached_tokens": finished.num_cached_tokens if finished is not None else 0,
        }

    def chunk(self, out: Output, delta: Delta, text: str) -> bytes:
        if self.incremental:
            return sse({"text": text, "output_ids": delta.token_ids, "meta_info": self._meta(out, delta.finished),
                        "index": 0})
        return sse({"text": out.text, "output_ids": out.token_ids, "meta_info": self._meta(out, delta.finished),
                    "index": 0})

    def body(self, out: Output, finished: FinishedOut) -> bytes:
        return _json_encode({"text": out.text, "output_ids": out.token_ids, "meta_info": self._meta(out, finished)})

    def aborted(self, out: Output) -> bytes:
        """The last chunk of a request aborted by /abort_request: no new output, finish type abort."""
        meta = {**self._meta(out, None), "finish_reason": {"type": "abort", "message": ABORT_MESSAGE}}
        return sse({"text": "" if self.incremental else out.text, "output_ids": [] if self.incremental else out.token_ids,
                    "meta_info": meta, "index": 0})


# --------------------------------------------------------------------------- the ASGI app
_JSON = (b"content-type", b"application/json")
_CLIENT_GONE = Delta([])  # put on a stream by the disconnect watcher
_ABORTED = Delta([])  # put on a stream by POST /abort_request
ABORT_MESSAGE = "aborted by POST /abort_request"


class Disconnected(Exception):
    """The client went away while we read its request."""


async def read_body(receive: Receive) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise Disconnected
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise HttpError("too_large", f"request body over {MAX_BODY_BYTES} bytes")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def parse_json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = _json_decode(raw) if raw else {}
    except msgspec.DecodeError as exc:
        raise HttpError("invalid_request", f"the body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise HttpError("invalid_request", "the body must be a JSON object")
    return body


async def send_bytes(send: Send, status: int, body: bytes, content_type: bytes = b"application/json",
                     headers: list[tuple[bytes, bytes]] | None = None) -> None:
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", content_type), (b"content-length", str(len(body)).encode()), *(headers or []),
    ]})
    await send({"type": "http.response.body", "body": body})


async def send_json(send: Send, status: int, obj: Any, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    await send_bytes(send, status, _json_encode(obj), headers=headers)


async def send_error(send: Send, code: str, message: str, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    await send_bytes(send, error_status(code), error_body(code, message), headers=headers)


class SimHttpApp:
    """The ASGI application: routes, lifespan (starts and stops the step loop), disconnects."""

    def __init__(self, front: SimFront, bare_openai: bool = False, incremental_streaming_output: bool = False,
                 chat_templates: ChatTemplates | None = None) -> None:
        self.front = front
        # /v1/chat/completions renders messages with these (None: chat is refused, 400).
        self.chat_templates = chat_templates
        # Looks like an OpenAI-compatible server with no Prometheus /metrics and no token ids
        # in its streams (TGI, llama.cpp, vLLM < 0.10.2): module docstring, --bare-openai.
        self.bare_openai = bare_openai
        # SGLang's --incremental-streaming-output: /generate streams each chunk's output_ids and
        # text, not the whole output so far.
        self.incremental_streaming_output = incremental_streaming_output
        self.routes: dict[tuple[str, str], Callable[[Scope, Receive, Send], Awaitable[None]]] = {
            ("POST", "/v1/completions"): self.completions,
            ("POST", "/v1/chat/completions"): self.chat_completions,
            ("POST", "/generate"): self.generate,
            ("POST", "/abort_request"): self.abort_request,
            ("POST", "/tokenize"): self.tokenize,
            ("POST", "/v1/completions/render"): self.render,
            ("GET", "/health"): self.health,
            ("GET", "/health_generate"): self.health_generate,
            ("GET", "/server_info"): self.server_info,
            ("GET", "/get_server_info"): self.server_info,
            ("GET", "/model_info"): self.model_info,
            ("GET", "/get_model_info"): self.model_info,
            ("GET", "/v1/models"): self.models,
            ("GET", "/get_load"): self.get_load,
            ("GET", "/metrics"): self.metrics,
            ("GET", "/_sim/metrics"): self.metrics,
            ("GET", "/_sim/bootstrap"): self.bootstrap,
        }
        if bare_openai:
            del self.routes[("GET", "/metrics")]
        self._paths = {path for _, path in self.routes}
        self._unknown_paths_logged: set[str] = set()
        self._log_requests = log.isEnabledFor(logging.DEBUG)  # --log-level debug: one line per request
        self._render_ids = itertools.count()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return  # websockets: not served
        if self._log_requests:
            log.debug("%s %s", scope["method"], scope["path"])
        handler = self.routes.get((scope["method"], scope["path"]))
        if handler is None:
            await self._not_found(scope, send)
            return
        try:
            await handler(scope, receive, send)
        except HttpError as exc:
            await send_error(send, exc.code, exc.message)
        except Disconnected:
            pass

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self.front.start()
                log.info("sim-server %s: engine ready (%d KV blocks of %d tokens, time scale %g, model %s, tokenizer %s)",
                         self.front.cfg.worker_id, self.front.cfg.num_kv_blocks, self.front.cfg.block_size_tokens,
                         self.front.cfg.time_scale, self.front.model_name, self.front.tokenizer.name)
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.front.stop()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _not_found(self, scope: Scope, send: Send) -> None:
        path = scope["path"]
        if path not in self._unknown_paths_logged and len(self._unknown_paths_logged) < 1000:
            self._unknown_paths_logged.add(path)  # once per path: shows what a router probes
            log.info("%s %s is not served (404 from now on, logged once)", scope["method"], path)
        if path in self._paths:
            await send_error(send, "invalid_request", f"method {scope['method']} not allowed on {path}")
        else:
            await send_error(send, "not_found", f"{path} is not served by the flexlb sim-server")

    # ----------------------------------------------------------------------- generation
    async def completions(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = parse_json_object(await read_body(receive))
        refuse_unmodelled(body)
        if "prompt" not in body:
            raise HttpError("invalid_request", "prompt is required")
        prompt = await self._prompt(body["prompt"], "prompt", body)
        max_tokens = int_field(body, "max_tokens", OPENAI_DEFAULT_MAX_TOKENS)
        stream = bool_field(body, "stream")
        options = body.get("stream_options")
        include_usage = isinstance(options, dict) and options.get("include_usage") is True
        request_id = request_id_of(scope, body) or self.front.new_request_id()
        fmt = OpenAIFormat(request_id, self.front.model_name, len(prompt), include_usage,
                           return_token_ids=bool_field(body, "return_token_ids") and not self.bare_openai)
        await self._run(receive, send, request_id, prompt, max_tokens, stream, fmt, self._bootstrap(body))

    async def chat_completions(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = parse_json_object(await read_body(receive))
        refuse_unmodelled(body)
        prompt = await self._chat_prompt(body)
        max_tokens = int_field(body, "max_completion_tokens", int_field(body, "max_tokens", OPENAI_DEFAULT_MAX_TOKENS))
        stream = bool_field(body, "stream")
        options = body.get("stream_options")
        include_usage = isinstance(options, dict) and options.get("include_usage") is True
        request_id = request_id_of(scope, body) or self.front.new_request_id()
        fmt = ChatFormat(request_id, self.front.model_name, prompt, include_usage,
                         return_token_ids=bool_field(body, "return_token_ids") and not self.bare_openai)
        await self._run(receive, send, request_id, prompt, max_tokens, stream, fmt, self._bootstrap(body), is_chat=True)

    async def _chat_prompt(self, body: dict[str, Any]) -> list[int]:
        """A chat body's `messages` rendered by the chat template (with `tools`,
        `add_generation_prompt`, `continue_final_message`, `chat_template_kwargs`) and
        encoded without special tokens (the template writes them), as vLLM does."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(x, dict) for x in messages):
            raise HttpError("invalid_request", "messages must be a non-empty list of objects")
        if self.chat_templates is None:
            raise HttpError("invalid_request", f"no chat template for this server's tokenizer ({self.front.tokenizer.name}):"
                                               " start it with --chat-template FILE")
        tools = body.get("tools")
        kwargs = body.get("chat_template_kwargs")
        if tools is not None and not isinstance(tools, list):
            raise HttpError("invalid_request", "tools must be a list")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise HttpError("invalid_request", "chat_template_kwargs must be an object")
        add_generation_prompt = body.get("add_generation_prompt", True)
        if not isinstance(add_generation_prompt, bool):
            raise HttpError("invalid_request", "add_generation_prompt must be true or false")
        try:
            text = self.chat_templates.render(tool_arguments_as_objects(messages), tools=tools,
                                              add_generation_prompt=add_generation_prompt,
                                              continue_final_message=bool_field(body, "continue_final_message"),
                                              chat_template_kwargs=kwargs)
        except ChatTemplateError as exc:
            raise HttpError("invalid_request", f"chat template: {exc}") from None
        tokenizer = self.front.tokenizer
        if tokenizer.is_costly:
            return await asyncio.to_thread(tokenizer.encode, text, False)
        return tokenizer.encode(text, False)

    async def generate(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = parse_json_object(await read_body(receive))
        if body.get("text") is not None:
            prompt = await self._prompt(body["text"], "text")
        elif body.get("input_ids") is not None:
            prompt = await self._prompt(body["input_ids"], "input_ids")
        else:
            raise HttpError("invalid_request", "text or input_ids is required")
        params = body.get("sampling_params") or {}
        if not isinstance(params, dict):
            raise HttpError("invalid_request", "sampling_params must be an object")
        refuse_unmodelled(params)
        max_tokens = int_field(params, "max_new_tokens", SGLANG_DEFAULT_MAX_NEW_TOKENS)
        stream = bool_field(body, "stream")
        request_id = request_id_of(scope, body) or self.front.new_request_id()
        fmt = SGLangFormat(request_id, len(prompt), incremental=self.incremental_streaming_output)
        await self._run(receive, send, request_id, prompt, max_tokens, stream, fmt, self._bootstrap(body))

    async def abort_request(self, scope: Scope, receive: Receive, send: Send) -> None:
        """SGLang's `POST /abort_request {"rid"}`: the request leaves the engine (its stream
        ends without a finish: the client asked for it); 200 whether or not it was running."""
        body = parse_json_object(await read_body(receive))
        rid = body.get("rid")
        if not isinstance(rid, str) or not rid:
            raise HttpError("invalid_request", "rid (a request id) is required")
        req = self.front._open.get(rid)
        if self.front.abandon(rid):
            log.debug("request %s: aborted by POST /abort_request", rid)
            req.deltas.put_nowait(_ABORTED)
        await send_bytes(send, 200, b"")

    async def _prompt(self, value: Any, field: str, body: dict[str, Any] | None = None) -> list[int]:
        """`prompt_token_ids` by the front's tokenizer, with the body's `add_special_tokens`
        (vLLM's field; absent: the tokenizer's default); an HF tokenizer in a thread."""
        add = body.get("add_special_tokens") if body is not None else None
        if add is not None and not isinstance(add, bool):
            raise HttpError("invalid_request", f"add_special_tokens must be true or false, got {add!r}")
        tokenizer = self.front.tokenizer
        if tokenizer.is_costly:
            return await asyncio.to_thread(prompt_token_ids, value, field, tokenizer, add)
        return prompt_token_ids(value, field, tokenizer, add)

    def _bootstrap(self, body: dict[str, Any]) -> tuple[str, int, int] | None:
        """PD fields matter on a prefill or decode server only; a colocated one ignores them."""
        return None if self.front.role == "pd_fusion" else bootstrap_of(body)

    async def _run(self, receive: Receive, send: Send, request_id: str, prompt: list[int], max_tokens: int,
                   stream: bool, fmt: OpenAIFormat | SGLangFormat | ChatFormat,
                   bootstrap: tuple[str, int, int] | None = None, is_chat: bool = False) -> None:
        room = handoff = None
        if bootstrap is not None and self.front.role == "prefill":
            room = bootstrap[2]
        elif bootstrap is not None and self.front.role == "decode":
            handoff = await fetch_handoff(*bootstrap)
        req = self.front.submit(request_id, prompt, max_tokens, room=room, handoff=handoff)
        if is_chat:
            self.front.num_chat_requests += 1
        watcher = asyncio.get_running_loop().create_task(self._watch_disconnect(receive, req))
        headers = [(b"x-request-id", request_id.encode("latin-1", errors="replace"))]
        try:
            if stream:
                await self._stream(send, req, fmt, headers)
            else:
                await self._unary(send, req, fmt, headers)
        finally:
            watcher.cancel()
            self.front.abandon(request_id)  # no-op unless we leave early (client gone, or a bug)

    async def _watch_disconnect(self, receive: Receive, req: OpenRequest) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                if self.front.abandon(req.request_id):
                    log.debug("request %s: client disconnected; cancelled in the engine", req.request_id)
                    req.deltas.put_nowait(_CLIENT_GONE)
                return

    async def _unary(self, send: Send, req: OpenRequest, fmt: OpenAIFormat | SGLangFormat,
                     headers: list[tuple[bytes, bytes]]) -> None:
        out = Output(self.front.tokenizer)
        while True:
            delta = await req.deltas.get()
            if delta is _CLIENT_GONE:
                return
            if delta is _ABORTED:
                await send_error(send, "cancelled", ABORT_MESSAGE, headers)
                return
            if delta.failed is not None:
                await send_error(send, delta.failed.code, delta.failed.message, headers)
                return
            out.add(delta)
            if delta.finished is not None:
                await send_bytes(send, 200, fmt.body(out, delta.finished), headers=headers)
                return

    async def _stream(self, send: Send, req: OpenRequest, fmt: OpenAIFormat | SGLangFormat,
                      headers: list[tuple[bytes, bytes]]) -> None:
        out = Output(self.front.tokenizer)
        started = False
        while True:
            delta = await req.deltas.get()
            if delta is _CLIENT_GONE:
                return
            if delta is _ABORTED:  # SGLang ends the stream with a finish of type abort
                if not started:
                    await send_error(send, "cancelled", ABORT_MESSAGE, headers)
                    return
                body = (fmt.aborted(out) if isinstance(fmt, SGLangFormat)
                        else sse(error_object("cancelled", ABORT_MESSAGE)))
                await send({"type": "http.response.body", "body": body + SSE_DONE, "more_body": False})
                return
            if delta.failed is not None:
                if not started:  # nothing sent yet: a plain HTTP error
                    await send_error(send, delta.failed.code, delta.failed.message, headers)
                    return
                error = error_object(delta.failed.code, delta.failed.message)
                await send({"type": "http.response.body", "body": sse(error) + SSE_DONE, "more_body": False})
                return
            if not started:
                started = True
                await send({"type": "http.response.start", "status": 200, "headers": [
                    (b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"), *headers,
                ]})
            text = out.add(delta)
            data = fmt.chunk(out, delta, text)
            if delta.finished is not None:
                await send({"type": "http.response.body", "body": data + SSE_DONE, "more_body": False})
                return
            await send({"type": "http.response.body", "body": data, "more_body": True})

    async def health_generate(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A real one-token generation (see the module docstring), bounded by 20 s."""
        request_id = f"health-{self.front.new_request_id()}"
        req = self.front.submit(request_id, self.front.tokenizer.encode(HEALTH_PROMPT), 1, is_health_check=True)
        try:
            delta = await asyncio.wait_for(req.deltas.get(), timeout=20)
        except asyncio.TimeoutError:
            await send_error(send, "timed_out", "no token within 20 s")
            return
        finally:
            self.front.abandon(request_id)
        if delta.failed is not None:
            await send_error(send, delta.failed.code, delta.failed.message)
        else:
            await send_bytes(send, 200, b"")

    async def bootstrap(self, scope: Scope, receive: Receive, send: Send) -> None:
        """PD: `?room=R` -> `{"first_token_id", "num_cached_tokens"}` once this prefill server
        has handed the room's request off; the prefill's error if it failed; 504 `timed_out`
        after `BOOTSTRAP_WAIT_S`. A room is answered once (then forgotten)."""
        query = dict(pair.split("=", 1) for pair in scope.get("query_string", b"").decode().split("&") if "=" in pair)
        try:
            room = int(query["room"])
        except (KeyError, ValueError):
            raise HttpError("invalid_request", "room (an integer) is required") from None
        fut = self.front.room(room)
        try:
            value = await asyncio.wait_for(asyncio.shield(fut), timeout=BOOTSTRAP_WAIT_S)
        except asyncio.TimeoutError:
            raise HttpError("timed_out", f"room {room}: no hand-off within {BOOTSTRAP_WAIT_S:g} s") from None
        self.front.forget_room(room)
        if isinstance(value, HttpError):
            raise value
        await send_json(send, 200, {"first_token_id": value[0], "num_cached_tokens": value[1]})

    # ----------------------------------------------------------------------- tokenizer
    async def tokenize(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = parse_json_object(await read_body(receive))
        value = body.get("prompt", body.get("text"))
        if body.get("messages") is not None:  # vLLM's chat form: rendered as /v1/chat/completions renders it
            tokens = await self._chat_prompt(body)
        elif value is None:
            raise HttpError("invalid_request", "prompt (or text, or messages) is required")
        else:
            tokens = await self._prompt(value, "prompt", body)
        await send_json(send, 200, {"count": len(tokens), "max_model_len": self.front.cfg.max_seq_len_tokens,
                                    "tokens": tokens, "token_strs": None})

    async def render(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = parse_json_object(await read_body(receive))
        if "prompt" not in body:
            raise HttpError("invalid_request", "prompt is required")
        tokens = await self._prompt(body["prompt"], "prompt", body)
        await send_json(send, 200, [{"request_id": f"cmpl-render-{next(self._render_ids)}", "model": self.front.model_name,
                                     "token_ids": tokens}])

    # ----------------------------------------------------------------------- introspection
    async def health(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.front.is_running:
            await send_bytes(send, 200, b"")
        else:
            await send_error(send, "not_ready", "the engine's step loop is not running")

    async def server_info(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_json(send, 200, self.front.server_info())

    async def model_info(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_json(send, 200, {"is_generation": True, "served_model_name": self.front.model_name,
                                    "model_type": "flexlb-sim"})

    async def models(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_json(send, 200, {"object": "list", "data": [{
            "id": self.front.model_name, "object": "model", "created": 0, "owned_by": "flexlb",
            "root": self.front.model_name, "max_model_len": self.front.cfg.max_seq_len_tokens,
        }]})

    async def get_load(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_json(send, 200, self.front.load())

    async def metrics(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_bytes(send, 200, self.front.metrics_text().encode(), content_type=b"text/plain; version=0.0.4; charset=utf-8")


def serve(cfg: WorkerConfig, host: str, port: int, model_name: str = DEFAULT_MODEL_NAME, log_level: str = "info",
          tokenizer: ByteTokenizer | HFTokenizer = BYTE_TOKENIZER, bare_openai: bool = False,
          incremental_streaming_output: bool = False, chat_templates: ChatTemplates | None = None) -> None:
    """Run the front until SIGINT / SIGTERM (uvicorn's handlers); open requests then fail."""
    import uvicorn

    app = SimHttpApp(SimFront(cfg, model_name, tokenizer), bare_openai=bare_openai,
                     incremental_streaming_output=incremental_streaming_output, chat_templates=chat_templates)
    uvicorn_level = {"warn": "warning"}.get(log_level.lower(), log_level.lower())
    # Keep-alive stays uvicorn's 5 s, as in the vLLM and SGLang servers the routers expect.
    config = uvicorn.Config(app, host=host, port=port, log_level=uvicorn_level, access_log=False, lifespan="on",
                            timeout_graceful_shutdown=3)
    uvicorn.Server(config).run()
