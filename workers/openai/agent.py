"""The worker agent in front of an OpenAI-compatible server (vLLM, SGLang, TGI, llama.cpp, ...):
`--engine openai`.

The bus side is the agent's own (workers/agent.py): it pulls `DispatchBatch` from its
JetStream consumer, dedupes, honours fencing epochs, withdrawals, cancel, deadlines and
drain, and publishes lifecycle, token, status and KV events. What differs is where a
request runs: on the server at `engine_url`, over HTTP. This class is the agent's
`EngineBackend` (build, prepare, loops, submit, cancel, cached blocks, status, close) for
such a server, and replaces nothing else of it.

Execution. A batch is queued in the agent, then released to the server whole: every
member's POST starts at once (the server batches them itself), when
`upstream_max_concurrency` leaves room for all of them (a batch larger than the limit goes
alone, when nothing else is open). `engine_protocol` says which POST:
- `openai` (default), a completion: `POST {engine_url}/v1/completions` with the prompt as
  token ids, `max_tokens`, `stream: true`, `stream_options.include_usage`,
  `return_token_ids: true` (vLLM >= 0.10.2: every chunk carries its token ids), the sampling
  of the request (`temperature` 0 when it sets none: FlexLB's default is greedy, vLLM's is
  1.0), `top_p`, `seed`, `ignore_eos`, `stop` (when the request has stop strings), and
  `X-Request-Id: <request id>`.
- `openai`, a chat request (`BatchRequest.chat`): `POST {engine_url}/v1/chat/completions`
  with the client's `messages`, `tools` / `tool_choice` / `chat_template_kwargs` when given,
  `add_generation_prompt: false` / `continue_final_message: true` only when they differ
  from the servers' defaults (so a strict server sees a plain OpenAI body), and the rest as
  for a completion: the server renders the chat itself, so its tool-call and reasoning
  parsers stay its own. The router routed on its own rendering (`prompt_token_ids`); vLLM
  says its rendering in the first chunk (`prompt_token_ids`, with return_token_ids), and a
  different one is counted (`flexlb_worker_chat_prompt_mismatches_total`, the worker's
  /metrics) and logged once per model with the fix (the router needs the model's tokenizer
  directory or the server's --chat-template): the router's prefix index and predictions
  are off for such requests, not their output. Read from each chunk: `delta.content` (the
  text; the role chunk has none), `token_ids`, `finish_reason` ("tool_calls" ends the turn
  normally: relayed as "stop").
- `sglang`: SGLang's native `POST {engine_url}/generate` with `input_ids` (the router's
  ids, chat requests too: SGLang's /generate renders nothing), `sampling_params`
  (`max_new_tokens`, `temperature`, `top_p`, `sampling_seed`, `ignore_eos`, `stop`),
  `stream: true`, `rid` = the request id, and `lora_path` = its LoRA adapter if it names
  one. SGLang streams `output_ids` and `text` whole so far (its default) or per chunk
  (`--incremental-streaming-output`); each chunk says which: its
  `meta_info.completion_tokens` is the count so far, and a chunk after the first with that
  many ids or more is cumulative (the new tokens are the tail past those relayed; text
  likewise), else incremental (the first chunk reads the same either way). `meta_info`
  gives the count, `cached_tokens` (RequestFinished.num_cached_tokens) and `finish_reason`
  ({"type": "length" | "stop" | "abort"}: abort fails the request, upstream_error). A
  cancel closes the stream (SGLang aborts a request whose client went) and also POSTs
  `/abort_request {"rid"}`, best effort.
The streams are read by workers/openai/upstream.py (keep-alive connections, httptools, each
event handed over from the read callback), not httpx: httpx's streaming was most of the
agent's CPU per token (bench/README.md, "adapter_cost.py"). Tokens are relayed with the
server's text as they arrive, through the agent's outbox (workers/agent.py): the chunks its
streams bring within TOKEN_FLUSH_S (1 ms) of the first unsent one go to a router in one
TokensBatch, and a request's last chunk is out before its end is reported. Released:
`BatchStarted`; every member's first token (or end): `PrefillCompleted` with the batch's
measured prefill, the longest first-token latency of its members from the release (the
agent's own queue is excluded; the server's is not, so a server that queues inflates it:
keep `upstream_max_concurrency` near the server's `--max-num-seqs`), which the router's
predictor learns from. Cached prompt tokens: the KV event view's count at release when
events are on, else 0 until the server's usage says.

LoRA adapters: a request that names one (`BatchRequest.lora_adapter`) is sent with `model`
= the adapter's name (how vLLM and SGLang select an adapter on their OpenAI endpoints), or
`lora_path` on SGLang's /generate; a server without that adapter refuses it (vLLM 404:
`adapter_not_found`; SGLang 400: invalid_request, it says no more). The adapters the agent
reports are those GET /v1/models lists with a `parent` (vLLM's --lora-modules; one the
server loads at run time appears at the agent's next start), its slots `max_loras` (the
setting, else vllm:lora_requests_info's max_lora) and the loaded ones from
vllm:lora_requests_info (workers/openai/status.py; None without it).

Streams without token ids (vLLM < 0.10.2, SGLang's OpenAI endpoints, TGI, llama.cpp: a
server that ignores return_token_ids): the text is relayed and its tokens counted, as
`TokensGenerated(token_ids=[], num_tokens=n)`: n = the server's running count in the chunk
where it gives one (a `usage` in every chunk: vLLM's and SGLang's continuous usage stats),
else 1 for each chunk with output (text, reasoning or a tool call). The last chunk is held
until the stream ends, so that the server's final `usage.completion_tokens` (it comes after
the last chunk) can make the count whole: the last chunk stands for what the chunks before
it did not count, and RequestFinished.num_output_tokens is the server's count.
`continuous_usage_stats` is not asked for (a strict server would refuse the field).

Failures, each with a code, never a hang: the server refuses (429, 503) ->
`upstream_refused`; 400 -> `invalid_request`; 413 -> `too_large`; another status, an
error chunk, a cut connection, a stream that ends without a finish reason, with vLLM's
`abort` or another unknown finish reason, SGLang's `abort`, a /generate chunk without
output_ids, or no byte for `upstream_stall_timeout_s` -> `upstream_error`. All retryable
except the client's own mistakes. A cancel (or a deadline, or a withdrawal) closes the
upstream request: the server sees the client go and aborts it.

Status. At every heartbeat the agent asks whether the server is up, and how loaded:
1. `GET {engine_url}/metrics`, Prometheus text: vLLM's `vllm:num_requests_running`,
   `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`, `vllm:cache_config_info`
   (`num_gpu_blocks`, `block_size`), `vllm:prefix_cache_queries_total` / `hits_total`, or
   SGLang's `sglang:num_running_reqs`, `sglang:num_queue_reqs`, `sglang:token_usage`, or
   llama.cpp's `llamacpp:requests_processing`, `requests_deferred` and prompt-cache counters
   (liveness "metrics", metrics "vllm" | "sglang" | "llamacpp");
2. else (a status other than 200, or none of those names) `GET /health` 200 (liveness
   "health", metrics "none"), else `GET /v1/models` 200 (and for sglang `/get_model_info`;
   liveness "models"). Found without metrics, /metrics is asked again every
   METRICS_REPROBE_POLLS polls only, and the endpoint that answered last is asked first.
No connection (or no answer within METRICS_TIMEOUT_S) fails the poll at once. Running =
the server's (with metrics "none": the agent's open streams); queued = the agent's
unreleased batches + the server's waiting requests; max_num_seqs = engine_max_num_seqs,
else the highest running count a poll saw while requests waited (workers/openai/status.py,
0 until one did; forgotten when the server is gone); free blocks = (1 - usage) x blocks
(all of them without metrics); `recent_step_ms` = the mean gap between tokens of the
streams of the last 3 s (the server's time per output token). Every status carries `signals`
(EngineSignals: protocol, metrics, liveness, token_ids: None until the first stream with
output says, kv_events) and, while not ready, `not_ready_reason`: one line naming the
server's URL, the endpoint and how it failed. The agent is `not_ready` until the server
first answers, and again after `UNREACHABLE_AFTER_POLLS` polls in a row fail: then
everything it holds fails with `upstream_error` (queued ones with `upstream_refused`), so
the router re-routes new work at once and no request waits on a dead server (the agent's
heartbeats keep coming, so its liveness is unchanged). At start, the server's block size
and block count (cache_config_info) and max_model_len (/v1/models) replace the configured
ones before the worker registers.

KV events (`kv_events_endpoint`): vLLM's ZMQ publisher, through workers/openai/kv_zmq.py,
translated into FlexLB's `KvBlocksStored` / `KvBlocksRemoved` / `KvAllCleared` with our own
chained hashes, so the router's exact prefix index works in front of vLLM; a snapshot
request is answered from that view. A gap the replay socket cannot fill clears the view
(`KvAllCleared`): the router forgets this worker's blocks and relearns them. Without events
the agent knows no blocks: run the router with `prefix_index approximate` (`flexlb up
--engine openai` does so by itself).

Pass-through. The client's fields FlexLB does not use itself (logprobs, response_format,
penalties, a server's own extension; `ForEngine.extra_body`) are added to the server's body
as they came, never over a field the agent sets. Back, whatever a chunk says beyond its text
and token ids (a delta's tool_calls and reasoning, a choice's logprobs, a finish reason
"tool_calls", the server's own fields; schemas/openai_bodies.py `chunk_extras`) rides with
that chunk's tokens (`TokensGenerated.extra`, the server's bytes) to the router, which puts it
into the client's chunk unchanged. SGLang's /generate has no such fields.

Embeddings. When its server comes up the agent asks it once whether it answers `POST
/v1/embeddings` (one input: a 200 with a data list) and reports it (EngineSignals.embeddings):
the router sends embeddings requests (ForEngine.embed) only to such workers. One is a plain
POST of the client's inputs and fields (`model` the server's), not a stream; its data items go
to the router one per chunk, byte for byte, and its usage last (relays.py `EmbeddingsRelay`).
A whole answer (these, /metrics, /v1/models) over 64 MiB fails upstream_error.

Not done: PD through the server's KV connector (vLLM `kv_transfer_params`, SGLang
bootstrap); n > 1 (the router refuses it); text prompts are tokenized at the router
(`--tokenizer`).

Parts: the /metrics reading (workers/openai/status.py) and the stream relays per protocol
(workers/openai/relays.py). What stays here (about 500 lines with this docstring over it) is
one concept, the requests' life on the server: queue, release, stream, poll, fail; split
further, its state (queued, streams, batch_of, ending) would be passed between modules.

Imports: `schemas` and `workers` only.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import deque

import msgspec

from schemas import messages as m
from schemas.errors import error_code
from schemas.subjects import kv_events_subject
from schemas.tokens import block_hashes
from workers.agent import ReqMeta, WorkerAgent  # noqa: F401  (ReqMeta: where tests take it)
from workers.openai.relays import FINISH_REASONS, EmbeddingsRelay, OpenBatch, SGLangRelay, StreamRelay  # noqa: F401  (FINISH_REASONS: where tests take it)
from workers.openai.status import (  # noqa: F401  (STATUS_METRICS, parse_prometheus: this module's API)
    STATUS_METRICS,
    MaxNumSeqsLearner,
    ServerStatus,
    parse_prometheus,
    server_status,
)
from workers.openai.upstream import UpstreamClient, UpstreamFailure, refusal_of  # noqa: F401  (refusal_of: this module's API)

log = logging.getLogger("flexlb.worker.openai")

UNREACHABLE_AFTER_POLLS = 3  # liveness polls failed in a row before the server counts as gone
METRICS_TIMEOUT_S = 2.0  # of each GET of a poll (/metrics, /health, /v1/models, ...)
# A server found without Prometheus metrics is asked for /metrics again every this many polls
# (10 s at the default 200 ms heartbeat), in case they appear (a restart with them on).
METRICS_REPROBE_POLLS = 50
STREAM_GAPS_WINDOW_S = 3.0
# Token chunks that arrive within this of the first unsent one go to the router in one
# message (TokensBatch): an engine step's chunks reach the agent over its many streams a
# little apart. What it adds to each token's latency, at most.
TOKEN_FLUSH_S = 0.001

_decode_json = msgspec.json.Decoder().decode
_encode_json = msgspec.json.Encoder().encode


class OpenAIAgent(WorkerAgent):
    def __init__(self, config) -> None:
        super().__init__(config)
        self.base_url = config.engine_url.rstrip("/")
        # Streams, /metrics and /v1/models (workers/openai/upstream.py: httpx's streaming was most
        # of the agent's CPU per token, and its /metrics GET per heartbeat the next largest part).
        self.upstream = UpstreamClient(self.base_url, config.upstream_max_concurrency + 8)
        self.queued: deque[OpenBatch] = deque()  # not yet released, in arrival order
        self.streams: dict[str, asyncio.Task] = {}  # request id -> its stream, while open
        self.batch_of: dict[str, OpenBatch] = {}  # request id -> its batch (queued or open)
        self.wake = asyncio.Event()
        self.protocol = config.engine_protocol  # "openai" | "sglang" (module docstring)
        self.server = ServerStatus()
        self.server_ok = False
        self.num_failed_polls = 0
        self.num_polls = 0
        # The server's max_num_seqs as its /metrics taught it (openai_status.learn_max_num_seqs);
        # reported unless engine_max_num_seqs is set; forgotten when the server counts as gone
        # (it may come back with other settings).
        self.learned_max_num_seqs = 0
        self.max_num_seqs_learner = MaxNumSeqsLearner()
        self.num_upstream_failures = 0
        # Which endpoint says the server is up: "" (not yet known), "metrics" (Prometheus text
        # with vLLM's or SGLang's names), "health" (GET /health 200), "models" (GET /v1/models,
        # or SGLang's /get_model_info, 200). The fallbacks of a server without /metrics.
        self.liveness = ""
        # Why the server counts as down (WorkerStatusReported.not_ready_reason while it is).
        self.server_not_ready_reason = f"engine server {self.base_url} not polled yet"
        # Whether the server's streams carry token ids: None until the first one says.
        self.stream_token_ids: bool | None = None
        # Chat requests whose prompt the server rendered to other token ids than the router did
        # (vLLM says its own with return_token_ids): flexlb_worker_chat_prompt_mismatches_total.
        self.num_chat_prompt_mismatches = 0
        self.models_warned_of_mismatch: set[str] = set()  # one warning per model, not per request
        self.token_gaps: deque[tuple[float, float]] = deque()  # (monotonic s, ms per token) of the last 3 s
        self.token_gaps_sum_ms = 0.0  # the sum of those ms
        self.kv_view: dict[int, None] = {}  # our block hashes the server holds (KV events)
        self.kv_feed = None
        self._background: set[asyncio.Task] = set()  # PrefillCompleted publications, aborts on their way
        # Requests let go of whose terminal event is being published: still reported as held
        # until it is out, or the router's calibration settles them as lost meanwhile.
        self.ending: set[str] = set()
        # The server answers POST /v1/embeddings (asked each time it comes up: _probe_embeddings).
        self.serves_embeddings = False

    def build_engine(self):
        return None  # the server is the engine

    # ------------------------------------------------------------------ start
    def close_engine(self) -> None:
        if self.kv_feed is not None:
            self.kv_feed.close()
        self.upstream.close()

    async def prepare_engine(self) -> None:
        """Learn the model name and the KV geometry before registering (non-fatal: a server
        that is not up yet is waited for by the status loop, not-ready meanwhile)."""
        cfg = self.cfg
        try:
            status, body = await self.upstream.get("/v1/models", METRICS_TIMEOUT_S)
            if status != 200:
                raise UpstreamFailure("upstream_error", f"answered {status}")
            models = _decode_json(body).get("data") or []
            if models and not cfg.engine_model:
                cfg.engine_model = str(models[0].get("id", ""))
            # vLLM lists each loaded LoRA adapter as a model with a `parent` (its base model).
            self.lora_adapters = [str(x["id"]) for x in models if isinstance(x, dict) and x.get("parent") and x.get("id")]
            if models and isinstance(models[0].get("max_model_len"), int):
                cfg.max_seq_len_tokens = models[0]["max_model_len"]
        except (UpstreamFailure, msgspec.DecodeError, AttributeError) as exc:
            log.warning("engine server %s: GET /v1/models failed (%s); model %r", self.base_url, exc, cfg.engine_model)
        await self._poll()
        st = self.server
        if st.block_size and st.block_size != cfg.block_size_tokens:
            log.info("engine server block size %d replaces the configured %d", st.block_size, cfg.block_size_tokens)
            cfg.block_size_tokens = st.block_size
        if st.num_gpu_blocks:
            cfg.num_kv_blocks = st.num_gpu_blocks
        if cfg.kv_events_endpoint:
            from workers.openai.kv_zmq import VllmKvSubscriber

            self.kv_feed = VllmKvSubscriber(cfg.kv_events_endpoint, cfg.kv_events_replay_endpoint or None,
                                            cfg.kv_events_topic, cfg.block_size_tokens)
        log.info("worker %s in front of %s (model %r, %s metrics, %d KV blocks of %d)", cfg.worker_id, self.base_url,
                 cfg.engine_model, st.flavour or "no known", cfg.num_kv_blocks, cfg.block_size_tokens)

    def engine_loops(self) -> list:
        loops = [self._release_loop(), self._status_loop(), self._token_flush_loop()]
        if self.kv_feed is not None:
            loops.append(self._kv_loop())
        return loops

    # ------------------------------------------------------------------ tokens
    async def _token_flush_loop(self) -> None:
        while True:
            await self.tokens_queued.wait()
            await asyncio.sleep(TOKEN_FLUSH_S)
            self.tokens_queued.clear()
            try:
                await self._flush_tokens()
            except asyncio.CancelledError:
                raise
            except Exception:  # keep relaying: the router finds the lost chunks' gap and asks for them again
                log.exception("publishing token chunks failed")

    # ------------------------------------------------------------------ status
    async def _check_server(self) -> ServerStatus:
        """One liveness check (module docstring, Status): the server's status from its
        /metrics, or an empty one when the server is up without them; UpstreamFailure saying
        which endpoint failed and how."""
        failures: list[str] = []
        if self.liveness in ("", "metrics") or self.num_polls % METRICS_REPROBE_POLLS == 0:
            status, body = await self._get("/metrics")
            if status == 200:
                st = server_status(parse_prometheus(body.decode(errors="replace"), STATUS_METRICS))
                if st.flavour:
                    self.liveness = "metrics"
                    return st
                failures.append("GET /metrics: no vLLM or SGLang metrics in it")
            else:
                failures.append(f"GET /metrics answered {status}")
        fallbacks = [("/health", "health"), ("/v1/models", "models")]
        if self.protocol == "sglang":
            fallbacks.append(("/get_model_info", "models"))
        fallbacks.sort(key=lambda f: f[1] != self.liveness)  # the one that answered last time first
        for path, liveness in fallbacks:
            status, _ = await self._get(path)
            if status == 200:
                self.liveness = liveness
                return ServerStatus()
            failures.append(f"GET {path} answered {status}")
        raise UpstreamFailure("upstream_error", "; ".join(failures))

    async def _get(self, path: str) -> tuple[int, bytes]:
        """GET for a poll; no connection (or no answer in time) raises, naming the endpoint:
        the other endpoints would fail the same way."""
        try:
            return await self.upstream.get(path, METRICS_TIMEOUT_S)
        except UpstreamFailure as exc:
            raise UpstreamFailure(exc.code, f"GET {path}: {exc.message}") from None

    async def _poll(self) -> None:
        self.num_polls += 1
        try:
            self.server = await self._check_server()
        except UpstreamFailure as exc:
            self.num_failed_polls += 1
            reason = f"engine server {self.base_url}: {exc.message}"
            if not self.server_ok and self.queued:  # never came up: what was sent here meanwhile fails now
                await self._fail_held(f"the engine server {self.base_url} does not answer ({exc})")
            if self.server_ok and self.num_failed_polls >= UNREACHABLE_AFTER_POLLS:
                self.server_ok = False
                self.server_not_ready_reason = reason
                self.learned_max_num_seqs = 0
                self.max_num_seqs_learner.forget()
                log.error("engine server %s: %d polls failed (%s); not ready, failing what it holds",
                          self.base_url, self.num_failed_polls, exc)
                await self._fail_held(f"the engine server {self.base_url} stopped answering ({exc})")
            elif self.num_failed_polls == 1:
                log.warning("engine server %s: liveness poll failed: %s", self.base_url, exc)
            if not self.server_ok:
                self.server_not_ready_reason = reason
            return
        if not self.server_ok:
            await self._probe_embeddings()
            log.info("engine server %s answers (liveness: %s, metrics: %s, embeddings: %s): ready", self.base_url,
                     self.liveness, self.server.flavour or "none", "yes" if self.serves_embeddings else "no")
        self.server_ok = True
        self.server_not_ready_reason = ""
        self.num_failed_polls = 0
        self.learned_max_num_seqs = self.max_num_seqs_learner.observe(self.server)
        self.wake.set()

    async def _probe_embeddings(self) -> None:
        """Whether the server answers POST /v1/embeddings (EngineSignals.embeddings): one input,
        a 200 with a data list. Another status (llama-server without --embeddings: 501; a
        generative model behind vLLM: 400 or 404) or no answer: it does not."""
        body = _encode_json({"model": self.cfg.engine_model, "input": "flexlb embeddings probe"})
        try:
            status, raw = await self.upstream.post("/v1/embeddings", body, METRICS_TIMEOUT_S)
            data = _decode_json(raw).get("data") if status == 200 else None
        except (UpstreamFailure, msgspec.DecodeError, AttributeError) as exc:
            status, data = f"no answer ({exc})", None
        self.serves_embeddings = isinstance(data, list) and bool(data)
        if not self.serves_embeddings:
            log.debug("engine server %s: POST /v1/embeddings answered %s: no embeddings", self.base_url, status)

    def signals(self) -> m.EngineSignals:
        return m.EngineSignals(protocol=self.protocol, metrics=self.server.flavour or "none",
                               liveness=self.liveness or "metrics", token_ids=self.stream_token_ids,
                               kv_events=bool(self.cfg.kv_events_endpoint), embeddings=self.serves_embeddings)

    async def _status_loop(self) -> None:
        interval = self.cfg.heartbeat_interval_ms / 1000
        while True:
            await self._poll()
            await self._enforce_deadlines()
            await asyncio.sleep(interval)

    def note_token_gap(self, now_s: float, ms_per_token: float) -> None:
        self.token_gaps.append((now_s, ms_per_token))
        self.token_gaps_sum_ms += ms_per_token

    def stream_step_ms(self) -> float:
        horizon = time.monotonic() - STREAM_GAPS_WINDOW_S
        while self.token_gaps and self.token_gaps[0][0] < horizon:
            self.token_gaps_sum_ms -= self.token_gaps.popleft()[1]
        if not self.token_gaps:
            self.token_gaps_sum_ms = 0.0  # no drift from the running sum
            return 0.0
        return round(self.token_gaps_sum_ms / len(self.token_gaps), 3)

    def status(self) -> m.WorkerStatusReported:
        cfg, st = self.cfg, self.server
        held = [r.request_id for b in self.queued for r in b.requests] + list(self.streams) + list(self.ending)
        step_ms = self.stream_step_ms()
        used = min(cfg.num_kv_blocks, round(st.kv_usage * cfg.num_kv_blocks))
        return m.WorkerStatusReported(
            worker_id=cfg.worker_id, role=cfg.role, boot_id=self.boot_id,
            state=self.state if (self.server_ok or self.state != "ready") else "not_ready", engine="openai",
            pid=os.getpid(), host=self.host, block_size_tokens=cfg.block_size_tokens, num_kv_blocks=cfg.num_kv_blocks,
            num_free_kv_blocks=cfg.num_kv_blocks - used, num_cached_kv_blocks=min(len(self.kv_view), cfg.num_kv_blocks),
            max_batch_tokens=cfg.max_batch_tokens, max_seq_len_tokens=cfg.max_seq_len_tokens,
            num_running_requests=max(st.num_running, len(self.streams)),
            num_queued_batches=len(self.queued) + st.num_waiting, running_request_ids=held,
            num_batches_executed=self.num_batches_executed, num_requests_finished=self.num_requests_finished,
            num_undecodable_messages=self.num_undecodable, num_stale_commands_refused=self.num_stale_refused,
            fencing_epoch=self.max_epoch,
            num_stream_overflows=self.num_stream_overflows, time_scale=1.0, last_step_ms=step_ms,
            recent_step_ms=step_ms, heartbeat_interval_ms=cfg.heartbeat_interval_ms,
            not_ready_reason=self.server_not_ready_reason if not self.server_ok else
            getattr(self, "not_ready_reason", "") if self.state != "ready" else "", signals=self.signals(),
            model=cfg.served_model(), lora_adapters=list(self.lora_adapters),
            max_num_seqs=cfg.engine_max_num_seqs or self.learned_max_num_seqs, max_loras=cfg.max_loras or st.max_loras,
            loaded_lora_adapters=list(st.loaded_lora_adapters) if st.loaded_lora_adapters is not None else None,
        )

    # ------------------------------------------------------------------ commands
    def submit_batch(self, batch_id: str, requests: list[m.BatchRequest]) -> None:
        batch = OpenBatch(batch_id, list(requests))
        for r in requests:
            self.batch_of[r.request_id] = batch
        self.queued.append(batch)
        self.wake.set()

    def cancel_request(self, request_id: str) -> bool:
        batch = self.batch_of.pop(request_id, None)
        if batch is None:
            return False
        if batch.released_ns:
            task = self.streams.pop(request_id, None)
            if task is not None and task is not asyncio.current_task():
                task.cancel()  # closes the upstream request: the server aborts it
        else:
            batch.requests = [r for r in batch.requests if r.request_id != request_id]
            if not batch.requests and batch in self.queued:
                self.queued.remove(batch)
        self.first_or_end(batch, request_id, None)
        return True

    def cached_block_hashes(self) -> list[int]:
        return list(self.kv_view)

    async def _fail_held(self, message: str) -> None:
        while self.queued:
            batch = self.queued.popleft()
            for r in batch.requests:
                await self._fail(r.request_id, UpstreamFailure("upstream_refused", message))
        for request_id in list(self.streams):
            await self._fail(request_id, UpstreamFailure("upstream_error", message))

    async def _fail(self, request_id: str, failure: UpstreamFailure) -> None:
        self.ending.add(request_id)
        try:
            if not self.cancel_request(request_id):
                return
            self._forget(request_id)
            self.num_upstream_failures += 1
            await self._event(m.RequestFailed(request_id=request_id, worker_id=self.cfg.worker_id, code=failure.code,
                                              message=failure.message, retryable=error_code(failure.code).retryable))
        finally:
            self.ending.discard(request_id)

    # ------------------------------------------------------------------ release
    async def _release_loop(self) -> None:
        limit = self.cfg.upstream_max_concurrency
        while True:
            self.wake.clear()
            while self.queued and self.server_ok:
                batch = self.queued[0]
                if self.streams and len(self.streams) + len(batch.requests) > limit:
                    break
                self.queued.popleft()
                await self._release(batch)
            await self.wake.wait()

    def _estimate_cached(self, r: m.BatchRequest) -> int:
        if not self.kv_view:
            return 0
        n = 0
        for h in block_hashes(r.prompt_token_ids, self.cfg.block_size_tokens):
            if h not in self.kv_view:
                break
            n += 1
        return min(n * self.cfg.block_size_tokens, len(r.prompt_token_ids))

    async def _release(self, batch: OpenBatch) -> None:
        batch.released_ns = time.monotonic_ns()
        batch.waiting_first = {r.request_id for r in batch.requests}
        await self._event(m.BatchStarted(batch_id=batch.batch_id, worker_id=self.cfg.worker_id,
                                         request_ids=[r.request_id for r in batch.requests]))
        for r in batch.requests:
            batch.cached[r.request_id] = self._estimate_cached(r)
            self.streams[r.request_id] = asyncio.create_task(self._stream(batch, r), name=f"stream {r.request_id}")

    def first_or_end(self, batch: OpenBatch, request_id: str, first_ms: float | None) -> None:
        """A member got its first token (first_ms) or ended without one; once every member has,
        the batch's prefill is complete."""
        if request_id not in batch.waiting_first:
            return
        batch.waiting_first.discard(request_id)
        if first_ms is not None:
            batch.first_ms[request_id] = first_ms
        if batch.waiting_first:
            return
        self.batch_members.pop(batch.batch_id, None)
        if batch.first_ms:  # else every member ended before its first token: no prefill to report
            self._in_background(self._prefill_completed(batch))

    async def _prefill_completed(self, batch: OpenBatch) -> None:
        members = [r for r in batch.requests if r.request_id in batch.first_ms]
        self.num_batches_executed += 1
        await self._event(m.PrefillCompleted(
            batch_id=batch.batch_id, worker_id=self.cfg.worker_id, request_ids=[r.request_id for r in members],
            measured_ms=round(max(batch.first_ms.values()), 3),
            num_prompt_tokens=sum(len(r.prompt_token_ids) for r in members),
            num_cached_tokens=sum(batch.cached.get(r.request_id, 0) for r in members),
        ))

    # ------------------------------------------------------------------ one request
    def _sampling(self, r: m.BatchRequest) -> dict:
        """The request's sampling in OpenAI's names (SGLang's sampling_params share them but the seed)."""
        s = r.sampling or m.Sampling()
        out = {"temperature": s.temperature if s.temperature is not None else 0.0}
        if s.top_p is not None:
            out["top_p"] = s.top_p
        if s.seed is not None:
            out["seed"] = s.seed
        if s.ignore_eos:
            out["ignore_eos"] = True
        if r.stop:
            out["stop"] = list(r.stop)
        return out

    def _request(self, r: m.BatchRequest) -> tuple[str, dict]:
        """(path, JSON body) of one request's upstream POST (module docstring, Execution)."""
        if self.protocol == "sglang":
            params = {"max_new_tokens": r.max_tokens, **self._sampling(r)}
            if "seed" in params:
                params["sampling_seed"] = params.pop("seed")
            body = {"input_ids": r.prompt_token_ids, "sampling_params": params, "stream": True, "rid": r.request_id}
            if r.lora_adapter:
                body["lora_path"] = r.lora_adapter
            return "/generate", body
        common = {"model": r.lora_adapter or self.cfg.engine_model, "max_tokens": r.max_tokens, "stream": True,
                  "stream_options": {"include_usage": True}, "return_token_ids": True, **self._sampling(r)}
        chat = r.chat
        if chat is None:
            prompt = r.prompt_text if r.prompt_text and self.cfg.engine_prompt == "text" else r.prompt_token_ids
            return "/v1/completions", self._with_extra_body(r, {"prompt": prompt, **common})
        body = {"messages": chat.messages, **common}
        if chat.tools is not None:
            body["tools"] = chat.tools
        if chat.tool_choice is not None:
            body["tool_choice"] = chat.tool_choice
        # vLLM's and SGLang's extensions, sent only when they differ from their defaults (a
        # stricter server then sees a plain OpenAI body).
        if not chat.add_generation_prompt:
            body["add_generation_prompt"] = False
        if chat.continue_final_message:
            body["continue_final_message"] = True
        if chat.chat_template_kwargs:
            body["chat_template_kwargs"] = chat.chat_template_kwargs
        return "/v1/chat/completions", self._with_extra_body(r, body)

    @staticmethod
    def _with_extra_body(r: m.BatchRequest, body: dict) -> dict:
        """The client's fields FlexLB does not use itself (ForEngine.extra_body), added as they
        came; a field the agent sets (the prompt, max_tokens, stream, sampling) stays the agent's."""
        if r.extra_body:
            for key, value in r.extra_body.items():
                body.setdefault(key, value)
        return body

    def note_prompt_rendering(self, r: m.BatchRequest, server_ids: list[int]) -> None:
        """The server said how it rendered a chat request's messages: count a rendering other
        than the router's (what it routed on: its prefix index and predictions are then off,
        and vLLM's KV events describe other blocks), and say once per model how to fix it."""
        if server_ids == r.prompt_token_ids:
            return
        self.num_chat_prompt_mismatches += 1
        model = self.cfg.engine_model
        if model in self.models_warned_of_mismatch:
            return
        self.models_warned_of_mismatch.add(model)
        n = next((i for i, (a, b) in enumerate(zip(server_ids, r.prompt_token_ids)) if a != b),
                 min(len(server_ids), len(r.prompt_token_ids)))
        log.warning("model %r: the router's chat template rendering differs from the engine server's (%s): request %s "
                    "has %d prompt tokens at the router, %d at the server, the first difference at token %d. Routing "
                    "and prefix caching then work on the wrong tokens: give the router the model's tokenizer directory "
                    "(--tokenizer, with its tokenizer_config.json chat template) or the server's template file "
                    "(--chat-template). Counted in flexlb_worker_chat_prompt_mismatches_total; logged once per model.",
                    model, self.base_url, r.request_id, len(r.prompt_token_ids), len(server_ids), n)

    async def _abort_upstream(self, request_id: str) -> None:
        """SGLang: besides closing the stream, ask the server to abort the request (best effort:
        a server that has no /abort_request, or is gone, is logged at debug level)."""
        try:
            status, _ = await self.upstream.post("/abort_request", _encode_json({"rid": request_id}), METRICS_TIMEOUT_S)
            if status != 200:
                log.debug("engine server %s: POST /abort_request for %s answered %d", self.base_url, request_id, status)
        except UpstreamFailure as exc:
            log.debug("engine server %s: POST /abort_request for %s failed: %s", self.base_url, request_id, exc)

    async def _stream(self, batch: OpenBatch, r: m.BatchRequest) -> None:
        rid = r.request_id
        meta = self.meta.get(rid)
        if meta is None:  # ended by the router between its release and now
            self.streams.pop(rid, None)
            return
        if r.embed is not None:  # not a stream: one POST, its vectors as chunks (relays.py)
            relay = EmbeddingsRelay(self, batch, r, meta)
            body = self._with_extra_body(r, {"model": r.lora_adapter or self.cfg.engine_model, "input": r.embed.input})
            run = relay.fetch(self.upstream, _encode_json(body), self.cfg.upstream_stall_timeout_s)
        else:
            relay = (SGLangRelay if self.protocol == "sglang" else StreamRelay)(self, batch, r, meta)
            path, body = self._request(r)
            run = self.upstream.stream(path, _encode_json(body), rid, relay.on_data, self.cfg.upstream_stall_timeout_s,
                                       r.traceparent, r.output_offset)
        try:
            await run
            if relay.finish is None:
                raise UpstreamFailure("upstream_error",
                                      f"the stream ended after {relay.index} tokens without a finish reason")
        except asyncio.CancelledError:
            if self.protocol == "sglang":
                self._in_background(self._abort_upstream(rid))
            raise  # cancelled by the router, a deadline or a failure: whoever cancelled reports it
        except UpstreamFailure as exc:
            failure = self._failure_of(r, exc)
        else:
            failure = None
        finally:
            self.wake.set()
        if self.streams.get(rid) is not asyncio.current_task():
            return  # ended meanwhile by whoever removed it (it reported the end)
        self.ending.add(rid)
        self.streams.pop(rid, None)
        if failure is not None:
            await self._fail(rid, failure)
            self.ending.discard(rid)
            return
        try:
            relay.end()  # its last chunk, when it was held for the server's count
            await self._flush_tokens()  # its last chunk before its end
            self.batch_of.pop(rid, None)
            self.first_or_end(batch, rid, None)
            self._forget(rid)
            self.num_requests_finished += 1
            cached = relay.num_cached_tokens()
            await self._event(m.RequestFinished(
                request_id=rid, worker_id=self.cfg.worker_id, finish_reason=relay.finish,
                num_prompt_tokens=len(r.prompt_token_ids), num_output_tokens=relay.num_output_tokens(),
                num_cached_tokens=cached if cached is not None else batch.cached.get(rid, 0),
                first_token_ns=relay.first_ns))
        finally:
            self.ending.discard(rid)

    @staticmethod
    def _failure_of(r: m.BatchRequest, failure: UpstreamFailure) -> UpstreamFailure:
        """What the request fails with: the failure, but a 404 to a request naming a LoRA
        adapter is vLLM's "the model does not exist": `adapter_not_found`."""
        if r.lora_adapter and failure.status == 404:
            return UpstreamFailure("adapter_not_found", f"LoRA adapter {r.lora_adapter!r}: {failure.message}", 404)
        return failure

    def _in_background(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ------------------------------------------------------------------ KV events
    async def _kv_loop(self) -> None:
        wid = self.cfg.worker_id
        while True:
            out = await self.kv_feed.next()
            if out.cleared:
                self.kv_view.clear()
                self.kv_seq += 1
                await self.nc.publish(kv_events_subject(wid), self._env(m.KvAllCleared(worker_id=wid, boot_id=self.boot_id, kv_seq=self.kv_seq)))
            for h in out.removed:
                self.kv_view.pop(h, None)
            for h in out.stored:
                self.kv_view[h] = None
            if out.removed:
                self.kv_seq += 1
                await self.nc.publish(kv_events_subject(wid), self._env(m.KvBlocksRemoved(
                    worker_id=wid, boot_id=self.boot_id, kv_seq=self.kv_seq, block_hashes=list(out.removed))))
            if out.stored:
                self.kv_seq += 1
                await self.nc.publish(kv_events_subject(wid), self._env(m.KvBlocksStored(
                    worker_id=wid, boot_id=self.boot_id, kv_seq=self.kv_seq, block_hashes=list(out.stored),
                    block_size_tokens=self.cfg.block_size_tokens)))
