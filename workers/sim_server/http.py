"""An HTTP front for the simulated engine, so peer routers can drive the very same engine.

`flexlb sim-server --port P [engine flags]` serves one `SimEngine` (built by
`workers.config.make_engine`, exactly as the NATS worker builds it) over the HTTP dialects
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
- LoRA adapters (`--lora-adapters`, the sim engine's; workers/engines/scheduler.py): a
  `/v1/completions` or `/v1/chat/completions` body whose `model` is one of them runs with
  it (as vLLM selects an adapter), and its answer names it as `model`; `/generate` takes
  SGLang's `lora_path` (a name that is not an adapter: 400). Any other `model` runs on the
  base model: vLLM answers 404 to an unknown model, but peer
  routers and benchmark clients send their own names and the sim-server has always
  ignored them.
- Unknown body fields (`model` but an adapter's name, `temperature`, `slo_ttft_ms`,
  `stream_options`, sglang-router's `echo: false`, `skip_special_tokens`,
  `return_hidden_states`, `bootstrap_*`, ...) are accepted and ignored. Refused with 400 because they would change the answer: `n` > 1,
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
- `GET /v1/models`: the served model, with `max_model_len`, then each LoRA adapter as vLLM
  lists one: `{"id": adapter, "root", "parent": the served model, "max_model_len": null}`.
- `GET /get_load`: SGLang's list `[{"dp_rank": 0, "num_reqs": running + waiting,
  "num_waiting_reqs", "num_tokens"}]`. The power_of_two policies of sglang-router 0.3.2 and
  vllm-router 0.1.17 poll it every `--worker-startup-check-interval` seconds (default 30)
  and sum `num_tokens` over the list (sglang-router reads anything else, `{"load": N}`
  included, as -1 = unknown).
  `num_tokens` is the KV held by requests, `num_used_kv_blocks × block_size_tokens` (their
  computed prompt and generated tokens, rounded up to blocks; SGLang's also adds the prompts
  of its waiting queue, which the engine's public contract does not expose).
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
`--embedding-dim N`: `POST /v1/embeddings` (OpenAI's: `input` a text, token ids, or a list of
either; `encoding_format` float or base64; `dimensions` up to N) answers each input with N
floats drawn from its token ids (`sim_embedding`: the same text, the same vector), at once,
with the engine running nothing; `usage.prompt_tokens` the inputs' tokens. Without it (0, the
default) the path is 404, as on a server that serves no embeddings. The bodies it was sent are
at `GET /_sim/requests` too.
`--canned-chunks FILE`: a scripted server, for relay tests. FILE has one SSE event's data per
line (a chunk's JSON, as a real server would write it, kept byte for byte); every streamed
/v1/chat/completions and /v1/completions request is answered with those events, then
`data: [DONE]`, whatever it asks (a non-streamed one: 400). The bodies it was sent, the last
16, are at `GET /_sim/requests` (what a router forwarded). The engine runs nothing for them.
Not modelled: sampling (temperature, top_p, stop strings, logprobs: the output is the
engine's deterministic `sim_token_id` text and always stops at max_tokens, finish_reason
"length"; so no tool calls or reasoning either), several prompts per request, priorities and
SLO fields, vLLM's PD protocol (kv_transfer_params), data parallelism.
Decisions: a raw ASGI app (no framework, schemas/http.py's helpers) keeps per-request
overhead low and gives direct control of disconnects (a watcher awaits `http.disconnect` and
cancels the engine request, also while it is still queued); JSON by msgspec. Parts: the
engine side and `/metrics` (workers/sim_server/front.py), request parsing (workers/sim_server/requests.py),
response formats (workers/sim_server/formats.py), PD bootstrap (workers/sim_server/pd.py).

Imports: `schemas` and `workers` only (never `services`).
"""

from __future__ import annotations

import asyncio
import base64
import collections
import hashlib
import itertools
import logging
import math
import random
import struct
from typing import Any, Awaitable, Callable

from schemas.chat_template import ChatTemplates
from schemas.http import SSE_DONE, ClientGone, HttpError, Receive, Scope, Send, error_body, read_body, send_bytes, send_error, send_json, sse
from schemas.tokens import BYTE_TOKENIZER, ByteTokenizer, HFTokenizer
from workers.config import WorkerConfig
from workers.sim_server.formats import ABORT_MESSAGE, ChatFormat, OpenAIFormat, Output, SGLangFormat
from workers.sim_server.front import DEFAULT_MODEL_NAME, Delta, OpenRequest, SimFront  # noqa: F401  (SimFront: this module's API)
from workers.sim_server.pd import BOOTSTRAP_WAIT_S, bootstrap_of, fetch_handoff
from workers.sim_server.requests import (
    bool_field,
    chat_prompt,
    int_field,
    output_offset_of,
    parse_json_object,
    prompt_of,
    refuse_unmodelled,
    request_id_of,
)

log = logging.getLogger("flexlb.sim_http")

OPENAI_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
SGLANG_DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default for /generate
MAX_BODY_BYTES = 64 * 1024 * 1024  # a larger request body is refused (413)
HEALTH_PROMPT = "health"  # 6 tokens: under a block (16 by default), so never in the prefix cache

def sim_embedding(token_ids: list[int], dim: int) -> list[float]:
    """A text's simulated embedding: `dim` floats drawn from its token ids (the same ids give
    the same vector), L2-normalized, rounded to 6 digits (so its JSON is short and exact)."""
    digest = hashlib.blake2b(struct.pack(f"<{len(token_ids)}q", *token_ids), digest_size=8).digest()
    rng = random.Random(int.from_bytes(digest, "little"))
    vector = [rng.gauss(0.0, 1.0) for _ in range(dim)]
    norm = math.sqrt(sum(x * x for x in vector)) or 1.0
    return [round(x / norm, 6) for x in vector]


GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/generate"})
_CLIENT_GONE = Delta([])  # put on a stream by the disconnect watcher
_ABORTED = Delta([])  # put on a stream by POST /abort_request


class SimHttpApp:
    """The ASGI application: routes, lifespan (starts and stops the step loop), disconnects."""

    def __init__(self, front: SimFront, bare_openai: bool = False, incremental_streaming_output: bool = False,
                 chat_templates: ChatTemplates | None = None, fail_generations: bool = False,
                 canned_chunks: list[bytes] | None = None, embedding_dim: int = 0) -> None:
        self.front = front
        # --embedding-dim: POST /v1/embeddings answers vectors of this many floats (0: not served)
        self.embedding_dim = embedding_dim
        # --canned-chunks: every streamed generation answered with these events (module docstring)
        self.canned_chunks = canned_chunks
        self.received: collections.deque[dict] = collections.deque(maxlen=16)
        # Fault injection (--fail-generations): every generation answered 500 at once, while
        # /health, /metrics and the rest answer as usual (a bad GPU, a wedged engine process).
        self.fail_generations = fail_generations
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
            ("POST", "/v1/embeddings"): self.embeddings,
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
            ("GET", "/_sim/requests"): self.requests_received,
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
        if self.fail_generations and scope["path"] in GENERATION_PATHS:
            self.front.num_failed_generations += 1
            await send_error(send, "internal", f"sim-server {self.front.cfg.worker_id} fails every generation "
                                               "(--fail-generations)")
            return
        if scope["method"] == "POST" and any(key == b"traceparent" for key, _ in scope["headers"]):
            self.front.num_traced_requests += 1  # (a real server's spans would join the client's trace)
        try:
            await handler(scope, receive, send)
        except HttpError as exc:
            await send_error(send, exc.code, exc.message)
        except ClientGone:
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
    async def _canned(self, body: dict[str, Any], send: Send) -> None:
        """--canned-chunks: the scripted events, whatever was asked (module docstring)."""
        self.received.append(body)
        if not bool_field(body, "stream"):
            raise HttpError("invalid_request", "--canned-chunks answers streamed requests only")
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]})
        for data in self.canned_chunks or ():
            await send({"type": "http.response.body", "body": sse(data), "more_body": True})
        await send({"type": "http.response.body", "body": SSE_DONE, "more_body": False})

    async def requests_received(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_json(send, 200, list(self.received))

    async def completions(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = parse_json_object(await read_body(receive, MAX_BODY_BYTES))
        if self.canned_chunks is not None:
            await self._canned(body, send)
            return
        refuse_unmodelled(body)
        if "prompt" not in body:
            raise HttpError("invalid_request", "prompt is required")
        prompt = await prompt_of(self.front.tokenizer, body["prompt"], "prompt", body)
        max_tokens = int_field(body, "max_tokens", OPENAI_DEFAULT_MAX_TOKENS)
        stream = bool_field(body, "stream")
        options = body.get("stream_options")
        include_usage = isinstance(options, dict) and options.get("include_usage") is True
        request_id = request_id_of(scope, body) or self.front.new_request_id()
        adapter = self._adapter_of_model(body)
        fmt = OpenAIFormat(request_id, adapter or self.front.model_name, len(prompt), include_usage,
                           return_token_ids=bool_field(body, "return_token_ids") and not self.bare_openai)
        await self._run(receive, send, request_id, prompt, max_tokens, stream, fmt, self._bootstrap(body),
                        lora_adapter=adapter, output_offset=output_offset_of(scope))

    async def chat_completions(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = parse_json_object(await read_body(receive, MAX_BODY_BYTES))
        if self.canned_chunks is not None:
            await self._canned(body, send)
            return
        refuse_unmodelled(body)
        prompt = await chat_prompt(body, self.chat_templates, self.front.tokenizer)
        max_tokens = int_field(body, "max_completion_tokens", int_field(body, "max_tokens", OPENAI_DEFAULT_MAX_TOKENS))
        stream = bool_field(body, "stream")
        options = body.get("stream_options")
        include_usage = isinstance(options, dict) and options.get("include_usage") is True
        request_id = request_id_of(scope, body) or self.front.new_request_id()
        adapter = self._adapter_of_model(body)
        fmt = ChatFormat(request_id, adapter or self.front.model_name, prompt, include_usage,
                         return_token_ids=bool_field(body, "return_token_ids") and not self.bare_openai)
        await self._run(receive, send, request_id, prompt, max_tokens, stream, fmt, self._bootstrap(body), is_chat=True,
                        lora_adapter=adapter, output_offset=output_offset_of(scope))

    async def generate(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = parse_json_object(await read_body(receive, MAX_BODY_BYTES))
        if body.get("text") is not None:
            prompt = await prompt_of(self.front.tokenizer, body["text"], "text")
        elif body.get("input_ids") is not None:
            prompt = await prompt_of(self.front.tokenizer, body["input_ids"], "input_ids")
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
        await self._run(receive, send, request_id, prompt, max_tokens, stream, fmt, self._bootstrap(body),
                        lora_adapter=self._adapter_of_lora_path(body), output_offset=output_offset_of(scope))

    async def abort_request(self, scope: Scope, receive: Receive, send: Send) -> None:
        """SGLang's `POST /abort_request {"rid"}`: the request leaves the engine (its stream
        ends without a finish: the client asked for it); 200 whether or not it was running."""
        body = parse_json_object(await read_body(receive, MAX_BODY_BYTES))
        rid = body.get("rid")
        if not isinstance(rid, str) or not rid:
            raise HttpError("invalid_request", "rid (a request id) is required")
        req = self.front._open.get(rid)
        if self.front.abandon(rid):
            log.debug("request %s: aborted by POST /abort_request", rid)
            req.deltas.put_nowait(_ABORTED)
        await send_bytes(send, 200, b"")

    def _adapter_of_model(self, body: dict[str, Any]) -> str:
        """The LoRA adapter an OpenAI body's `model` names; "" (the base model) for any other
        value (module docstring, LoRA adapters)."""
        model = body.get("model")
        return model if isinstance(model, str) and model in self.front.engine.lora_adapters else ""

    def _adapter_of_lora_path(self, body: dict[str, Any]) -> str:
        """SGLang's /generate `lora_path`: one of the adapters, or none (the base model)."""
        path = body.get("lora_path")
        if path is None or path == "":
            return ""
        if isinstance(path, list) and len(path) == 1:  # SGLang's batch form, one prompt
            path = path[0]
        if not isinstance(path, str) or path not in self.front.engine.lora_adapters:
            served = ", ".join(self.front.engine.lora_adapters) or "none"
            raise HttpError("invalid_request", f"lora_path {path!r} is not a LoRA adapter of this server (it has: {served})")
        return path

    def _bootstrap(self, body: dict[str, Any]) -> tuple[str, int, int] | None:
        """PD fields matter on a prefill or decode server only; a colocated one ignores them."""
        return None if self.front.role == "pd_fusion" else bootstrap_of(body)

    async def _run(self, receive: Receive, send: Send, request_id: str, prompt: list[int], max_tokens: int,
                   stream: bool, fmt: OpenAIFormat | SGLangFormat | ChatFormat,
                   bootstrap: tuple[str, int, int] | None = None, is_chat: bool = False, lora_adapter: str = "",
                   output_offset: int = 0) -> None:
        room = handoff = None
        if bootstrap is not None and self.front.role == "prefill":
            room = bootstrap[2]
        elif bootstrap is not None and self.front.role == "decode":
            handoff = await fetch_handoff(*bootstrap)
        req = self.front.submit(request_id, prompt, max_tokens, room=room, handoff=handoff, lora_adapter=lora_adapter,
                                output_offset=output_offset)
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
                        else sse(error_body("cancelled", ABORT_MESSAGE)))
                await send({"type": "http.response.body", "body": body + SSE_DONE, "more_body": False})
                return
            if delta.failed is not None:
                if not started:  # nothing sent yet: a plain HTTP error
                    await send_error(send, delta.failed.code, delta.failed.message, headers)
                    return
                error = error_body(delta.failed.code, delta.failed.message)
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
        body = parse_json_object(await read_body(receive, MAX_BODY_BYTES))
        value = body.get("prompt", body.get("text"))
        if body.get("messages") is not None:  # vLLM's chat form: rendered as /v1/chat/completions renders it
            tokens = await chat_prompt(body, self.chat_templates, self.front.tokenizer)
        elif value is None:
            raise HttpError("invalid_request", "prompt (or text, or messages) is required")
        else:
            tokens = await prompt_of(self.front.tokenizer, value, "prompt", body)
        await send_json(send, 200, {"count": len(tokens), "max_model_len": self.front.cfg.max_seq_len_tokens,
                                    "tokens": tokens, "token_strs": None})

    async def embeddings(self, scope: Scope, receive: Receive, send: Send) -> None:
        """--embedding-dim N: each input's vector, N floats from its token ids (module docstring)."""
        if not self.embedding_dim:
            raise HttpError("not_found", "this sim-server serves no embeddings (start it with --embedding-dim N)")
        body = parse_json_object(await read_body(receive, MAX_BODY_BYTES))
        self.received.append(body)
        raw = body.get("input")
        inputs = [raw] if isinstance(raw, str) or (isinstance(raw, list) and raw and isinstance(raw[0], int)) else raw
        if not isinstance(inputs, list) or not inputs:
            raise HttpError("invalid_request", "input must be a text, token ids or a non-empty list of either")
        dim = body.get("dimensions", self.embedding_dim)
        if type(dim) is not int or not 1 <= dim <= self.embedding_dim:
            raise HttpError("invalid_request", f"dimensions must be in 1..{self.embedding_dim}, got {dim!r}")
        encoding = body.get("encoding_format", "float")
        if encoding not in ("float", "base64"):
            raise HttpError("invalid_request", f"encoding_format must be float or base64, got {encoding!r}")
        data, count = [], 0
        for i, one in enumerate(inputs):
            tokens = await prompt_of(self.front.tokenizer, one, f"input[{i}]", body)
            count += len(tokens)
            vector = sim_embedding(tokens, dim)
            data.append({"object": "embedding", "index": i, "embedding": vector if encoding == "float" else
                         base64.b64encode(struct.pack(f"<{dim}f", *vector)).decode()})
        await send_json(send, 200, {"object": "list", "data": data, "model": self.front.model_name,
                                    "usage": {"prompt_tokens": count, "total_tokens": count}})

    async def render(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = parse_json_object(await read_body(receive, MAX_BODY_BYTES))
        if "prompt" not in body:
            raise HttpError("invalid_request", "prompt is required")
        tokens = await prompt_of(self.front.tokenizer, body["prompt"], "prompt", body)
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
        base = self.front.model_name
        await send_json(send, 200, {"object": "list", "data": [{
            "id": base, "object": "model", "created": 0, "owned_by": "flexlb",
            "root": base, "max_model_len": self.front.cfg.max_seq_len_tokens,
        }] + [{  # vLLM's card of a LoRA adapter: its base model as `parent`, no max_model_len
            "id": adapter, "object": "model", "created": 0, "owned_by": "flexlb", "root": adapter, "parent": base,
            "max_model_len": None,
        } for adapter in self.front.engine.lora_adapters]})

    async def get_load(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_json(send, 200, self.front.load())

    async def metrics(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_bytes(send, 200, self.front.metrics_text().encode(), content_type=b"text/plain; version=0.0.4; charset=utf-8")


def serve(cfg: WorkerConfig, host: str, port: int, model_name: str = DEFAULT_MODEL_NAME, log_level: str = "info",
          tokenizer: ByteTokenizer | HFTokenizer = BYTE_TOKENIZER, bare_openai: bool = False,
          incremental_streaming_output: bool = False, chat_templates: ChatTemplates | None = None,
          fail_generations: bool = False, canned_chunks: list[bytes] | None = None, embedding_dim: int = 0) -> None:
    """Run the front until SIGINT / SIGTERM (uvicorn's handlers); open requests then fail."""
    import uvicorn

    app = SimHttpApp(SimFront(cfg, model_name, tokenizer), bare_openai=bare_openai,
                     incremental_streaming_output=incremental_streaming_output, chat_templates=chat_templates,
                     fail_generations=fail_generations, canned_chunks=canned_chunks, embedding_dim=embedding_dim)
    uvicorn_level = {"warn": "warning"}.get(log_level.lower(), log_level.lower())
    # Keep-alive stays uvicorn's 5 s, as in the vLLM and SGLang servers the routers expect.
    config = uvicorn.Config(app, host=host, port=port, log_level=uvicorn_level, access_log=False, lifespan="on",
                            timeout_graceful_shutdown=3)
    uvicorn.Server(config).run()
