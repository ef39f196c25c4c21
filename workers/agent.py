"""The engine worker: pulls commands from JetStream, runs them on an engine, reports.

Loops (one asyncio task each):
- commands: pull `DispatchBatch` (roles pd_fusion, prefill) or `StartDecode` (role decode)
  from this worker's durable work-queue consumer; dedupe by batch id (a redelivery after a
  lost ack is acked and ignored); refuse a command whose fencing epoch is older than the
  newest seen (each of its requests fails with `dispatch_failed`, retryable); ack.
- engine: the shared step loop (workers/engines/step_loop.py) with this agent as its sink:
  `engine.step()`, sleep `duration_ms × time_scale`, then publish the step:
  `BatchStarted` (before the sleep) for each batch whose first chunk runs in it, token
  chunks (the last of a request carries `finish_reason`): the step's chunks in one
  `TokensBatch` per router where the dispatch named the router's batch subject, else one
  `TokensGenerated` per request on its own token subject,
  `PrefillCompleted` once a batch's last member finished its prefill, with its measured ms:
  the sum over the steps its chunks ran in of the step's measured time × the batch's share
  of that step (`StepResult.prefill_ms_by_batch`; with continuous batching a batch shares
  steps with other batches and with decodes, and the router's predictor learns its part),
  `StartDecode` hand-offs to the decode worker (PD mode), and terminal events. An exception
  from `engine.step()` fails every request the worker holds with `worker_failed`
  (retryable), counted in `flexlb_worker_engine_errors_total`; the loop goes on.
- heartbeat: `WorkerStatusReported` every `heartbeat_interval_ms` on
  `flexlb.evt.status.<worker>`; it lists the running request ids (authoritative) and the
  engine's limits: `max_num_seqs`, the LoRA adapters it can serve, its `max_loras` slots
  and the adapters loaded in them (least recently used first). `WorkerRegistered` carries
  the same limits, taken from the first status. A request naming an adapter the engine
  does not serve fails `adapter_not_found` (not retryable: the router's view of what the
  worker serves was wrong), from the engine's next step as its other invalid input does.
- cancel: core-NATS `CancelRequest` -> the engine drops the request -> `RequestCancelled`.

Undecodable commands are counted (also in the heartbeat), dead-lettered to
`flexlb.dlq.<worker>` with the reason, and acked so they do not block the queue.
On SIGTERM the worker drains: it reports `draining` (the router routes nothing more to it)
and finishes what it holds for up to `drain_timeout_s` (30 s; a second signal ends it at
once); then it fails what it still holds (`worker_failed`, retryable) so no request hangs,
reports `stopping`, and exits (final reports bounded by SHUTDOWN_TIMEOUT_S).
Start-up waits for NATS as long as it takes, logging "waiting for NATS at URL: why
(retrying)" every WAIT_LOG_INTERVAL_S, but a SIGTERM meanwhile stops it at once.

Imports: `schemas` and the engines only (never `services`).

One module over 500 lines: the bus side every engine kind shares (commands, dedupe, fencing,
withdrawals, deadlines, drain, the token outbox and resends, status, start-up and stop) is
one state machine over one set of per-request maps; the engine side is workers/engines/,
the settings workers/config.py.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import nats
from nats.errors import OutboundBufferLimitError
from nats.js.api import AckPolicy, ConsumerConfig, ObjectStoreConfig, StreamConfig
from nats.js.errors import BadRequestError

from schemas import messages as m
from schemas.acked import AckedPublisher, publish_until_acked
from schemas.subjects import (
    ALL_STREAMS,
    DISPATCH_STREAM,
    HDR_DLQ_REASON,
    HDR_DLQ_SUBJECT,
    KV_BUCKET,
    KV_BUCKET_TTL_S,
    cancel_subject,
    decode_consumer,
    decode_subject,
    dispatch_consumer,
    dispatch_subject,
    dlq_subject,
    epoch_subject,
    kv_events_subject,
    kv_object_name,
    kv_snapshot_request_subject,
    nats_servers,
    redact_url,
    resend_subject,
    status_subject,
    worker_events_subject,
)
from schemas.tokens import TextDecoder
from workers.config import WorkerConfig, make_engine
from workers.engines.base import Engine, EngineBatch, EngineRequest, StepResult
from workers.engines.step_loop import StepLoop

log = logging.getLogger("flexlb.worker")

CONTINUATION_TEXT_TOKENS = 8  # a continuation's decoder reads this many of the output tokens sent (a UTF-8 character is 4 bytes at most)
SEEN_BATCHES_MAX = 100_000  # batch ids remembered for dedupe
SENT_TOKENS_MAX = 2048  # requests whose token chunks are kept for a resend (the most recent)
WITHDRAWN_MAX = 100_000  # withdrawn request ids remembered (their command may still come)
SHUTDOWN_TIMEOUT_S = 3.0  # final reports at shutdown are given up after this (bus gone)
DRAIN_POLL_S = 0.05  # draining: how often the worker looks whether it still holds anything
WAIT_LOG_INTERVAL_S = 10.0  # while start-up waits for NATS, one "waiting for NATS" line this often


def engine_request(request_id: str, prompt_token_ids: list[int], max_tokens: int,
                   sampling: m.Sampling | None, lora_adapter: str = "", output_offset: int = 0) -> EngineRequest:
    s = sampling or m.Sampling()
    return EngineRequest(request_id=request_id, prompt_token_ids=prompt_token_ids, max_tokens=max_tokens,
                         temperature=s.temperature, top_p=s.top_p, seed=s.seed, ignore_eos=s.ignore_eos,
                         lora_adapter=lora_adapter, output_offset=output_offset)


@runtime_checkable
class EngineBackend(Protocol):
    """Where the agent's requests run: the methods the agent calls on itself for that, and
    the only ones an engine kind replaces. `WorkerAgent` implements them over a stepped
    `Engine` (workers/engines/base.py: sim, torch) and the shared step loop;
    `OpenAIAgent` (workers/openai/agent.py) over an engine server's HTTP API. Everything
    else (the bus, dedupe, fencing, withdrawals, deadlines, drain, token relay) is the
    agent's and the same for every kind."""

    def build_engine(self) -> Engine | None:
        """The engine, at construction; None: the requests run elsewhere (a server)."""

    async def prepare_engine(self) -> None:
        """Before the worker registers: learn what it must report (a server's KV geometry,
        its model); may change the config. Must not fail for a server that is not up yet."""

    def engine_loops(self) -> list:
        """The coroutines that run the requests (the step loop; a server's release, status and
        KV-event loops), each started as a task after registration and cancelled at stop."""

    def submit_batch(self, batch_id: str, requests: list[m.BatchRequest]) -> None:
        """Take a dispatched batch (already deduped, fenced and not withdrawn); never blocks."""

    def cancel_request(self, request_id: str) -> bool:
        """Stop running `request_id`: True if it was held (the caller reports the end)."""

    def cached_block_hashes(self) -> list[int]:
        """Our block hashes of the prefix cache now (answers a router's snapshot request)."""

    def status(self) -> m.WorkerStatusReported:
        """The heartbeat: what runs, what is queued, the KV use, the signals it has."""

    def close_engine(self) -> None:
        """At the end of `run`, whatever happened (also after a stop during start-up):
        release what `prepare_engine` and the loops opened (connections, sockets)."""


@dataclass
class ReqMeta:
    token_subject: str
    decode_worker_id: str
    prompt_token_ids: list[int]  # kept only for the PD hand-off
    max_tokens: int
    deadline_ns: int = 0  # wall clock; past it the worker stops the request (timed_out); 0: none
    sampling: m.Sampling | None = None  # passed on in a PD hand-off
    batch_id: str = ""  # the command it came in (a re-route may bring the request back in another)
    token_batch_subject: str = ""  # its router takes its tokens coalesced there (TokensBatch); "": one message a chunk
    output_offset: int = 0  # a continuation's first output index (ForEngine.output_offset): added to its indices and counts
    # Its text so far: a UTF-8 character whose bytes span two steps is sent whole, once.
    text: TextDecoder = field(default_factory=TextDecoder)

    def continues(self, prompt_token_ids: list[int]) -> "ReqMeta":
        """A continuation (output_offset > 0): its prompt ends with the output already sent,
        whose last character may be incomplete (held back, unsent). The decoder reads the last
        few output tokens, so that the continuation's first bytes complete that character;
        their own text was sent before."""
        if self.output_offset:
            self.text.decode(prompt_token_ids[-min(self.output_offset, CONTINUATION_TEXT_TOKENS):])
        return self


class WorkerAgent:
    def __init__(self, config: WorkerConfig) -> None:
        self.cfg = config
        self.boot_id = secrets.token_hex(4)
        self.host = socket.gethostname()
        self.engine = self.build_engine()
        self.work = asyncio.Event()  # set when the engine has something new to do
        self.tokens_queued = asyncio.Event()  # set when the outbox gets a chunk (a backend that flushes on a timer waits on it)
        # The engine's step loop (workers/engines/step_loop.py), with this agent as its sink.
        self.step_loop = (StepLoop(self.engine, self, config.time_scale, f"worker {config.worker_id}", self.work)
                          if self.engine is not None else None)
        self._kv_bucket = None  # the PD hand-off KV object store (torch engine), opened on first use
        self.envelopes = m.EnvelopeFactory(config.worker_id, self.boot_id)
        self.meta: dict[str, ReqMeta] = {}  # request id -> what publishing its outputs needs
        self.seen_batches: OrderedDict[str, None] = OrderedDict()
        self.max_epoch = 0
        # Requests the router withdrew, with the batch withdrawn ("": every batch): never run that copy.
        self.withdrawn: OrderedDict[str, str] = OrderedDict()
        self.state = "ready"
        self.not_ready_reason = ""  # one line, with a state other than ready: why (WorkerStatusReported)
        # The LoRA adapters it can serve (reported): the engine's (the sim's configured ones; torch
        # none); the openai agent's server's, from its /v1/models.
        self.lora_adapters: list[str] = list(self.engine.lora_adapters) if self.engine is not None else []
        self.num_batches_executed = 0
        self.num_requests_finished = 0
        self.num_undecodable = 0
        self.num_stale_refused = 0
        self.acked: AckedPublisher | None = None  # terminal events: acked by the stream, re-sent until they are
        self.last_status: m.WorkerStatusReported | None = None  # what /metrics reads (workers/metrics.py)
        # request id -> (its token subject, its chunks so far): recent requests', for a resend
        self.sent_tokens: OrderedDict[str, tuple[str, list[m.TokensGenerated]]] = OrderedDict()
        # The outbox of token chunks not yet published (queue_tokens, _flush_tokens): router
        # subject -> chunks for one TokensBatch, and (subject, chunk) for routers that take one
        # TokensGenerated per chunk.
        self.token_batches: dict[str, list[m.TokensGenerated]] = {}
        self.token_singles: list[tuple[str, m.TokensGenerated]] = []
        self.num_chunks_resent = 0
        self.num_stream_overflows = 0  # requests stopped because their tokens did not fit the outbound buffer
        self.first_token_ns: dict[str, int] = {}  # request id -> when its first token was published (until it ends)
        self.last_step_ms = 0.0
        # Requests the engine let go of in the step being run (finished, failed, handed off)
        # whose outputs are published only when the step's time is up: still reported as
        # held until then, or a long step (a big prefill chunk) would make the router's
        # calibration settle them as lost while their terminal events are on their way.
        self.unpublished_request_ids: list[str] = []
        self.recent_steps: deque[tuple[float, float]] = deque()  # (monotonic end s, engine ms) of the steps of the last m.RECENT_STEPS_WINDOW_S
        self.batch_members: dict[str, list[str]] = {}  # batch id -> request ids, until its prefill ends
        self.batch_prefill_ms: dict[str, float] = {}  # batch id -> measured prefill ms so far (its steps' shares)
        self.kv_seq = 0  # per-boot sequence of KV events, gap-free
        self.nc = None
        self.js = None
        self._waiting_for = "starting"  # what start-up waits for now (said if it is stopped meanwhile)

    # ------------------------------------------------------------------ EngineBackend (see the Protocol)
    def build_engine(self) -> Engine | None:
        return make_engine(self.cfg)

    async def prepare_engine(self) -> None:
        pass  # a stepped engine is ready once built

    def engine_loops(self) -> list:
        return [self.step_loop.run()]

    def submit_batch(self, batch_id: str, requests: list[m.BatchRequest]) -> None:
        self.engine.submit_batch(EngineBatch(batch_id=batch_id, requests=[
            engine_request(r.request_id, r.prompt_token_ids, r.max_tokens, r.sampling, r.lora_adapter, r.output_offset)
            for r in requests
        ]))

    def _is_withdrawn(self, request_id: str, batch_id: str) -> bool:
        withdrawn = self.withdrawn.get(request_id)
        return withdrawn is not None and withdrawn in ("", batch_id)

    def _superseded(self, request_id: str) -> None:
        """A new command for a request we still hold: the router re-routed it (it judged us
        dead, or the dispatch uncertain) and it came back here. The old copy goes silently;
        the new one is the request now (its withdrawal, late, names the old batch)."""
        if request_id in self.meta:
            log.info("request %s came again in a new command: its earlier copy is dropped", request_id)
            self.cancel_request(request_id)
            self._forget(request_id)

    def cancel_request(self, request_id: str) -> bool:
        return self.engine.cancel(request_id)

    def cached_block_hashes(self) -> list[int]:
        return self.engine.all_cached_block_hashes()

    def close_engine(self) -> None:
        pass  # a stepped engine holds nothing outside the process

    # ------------------------------------------------------------------ plumbing
    def _forget(self, request_id: str) -> ReqMeta | None:
        """The request left this worker: drop what we kept for it."""
        self.first_token_ns.pop(request_id, None)
        return self.meta.pop(request_id, None)

    def _env(self, payload) -> bytes:
        return m.encode(self.envelopes.wrap(payload, time.time_ns()))

    def queue_tokens(self, meta: ReqMeta, chunk: m.TokensGenerated) -> None:
        """Keep a token chunk for a resend (a router that missed some, its NATS node lost with
        them in flight, asks for them again: ResendTokens) and put it in the outbox:
        coalesced with every other chunk for its router when the router takes them so
        (meta.token_batch_subject), else alone for the request's own subject.
        _flush_tokens publishes the outbox; a request's chunks keep their order."""
        sent = self.sent_tokens.get(chunk.request_id)
        if sent is None:
            sent = self.sent_tokens[chunk.request_id] = (meta.token_subject, [])
            if len(self.sent_tokens) > SENT_TOKENS_MAX:
                self.sent_tokens.popitem(last=False)
        sent[1].append(chunk)
        if meta.token_batch_subject:
            batch = self.token_batches.get(meta.token_batch_subject)
            if batch is None:
                self.token_batches[meta.token_batch_subject] = [chunk]
            else:
                batch.append(chunk)
        else:
            self.token_singles.append((meta.token_subject, chunk))
        self.tokens_queued.set()

    async def _flush_tokens(self) -> None:
        """Publish the outbox (core NATS): one TokensBatch per router subject (split in
        halves, in order, while over the server's max payload), one TokensGenerated per chunk
        for the rest. A request whose chunk does not fit the outbound buffer (NATS away too
        long) is stopped with stream_overflow; with a TokensBatch that is every request in it."""
        if not self.token_batches and not self.token_singles:
            return
        batches, self.token_batches = self.token_batches, {}
        singles, self.token_singles = self.token_singles, []
        overflowed: set[str] = set()
        for subject, chunks in batches.items():
            await self._publish_batch(subject, chunks, overflowed)
        for subject, chunk in singles:
            if chunk.request_id in overflowed:
                continue
            try:
                await self.nc.publish(subject, self._env(chunk))
            except OutboundBufferLimitError:
                overflowed.add(chunk.request_id)
        for request_id in overflowed:
            await self._stream_overflow(request_id)

    async def _publish_batch(self, subject: str, chunks: list[m.TokensGenerated], overflowed: set[str]) -> None:
        data = self._env(m.TokensBatch(worker_id=self.cfg.worker_id, chunks=chunks))
        if len(data) > self.nc.max_payload and len(chunks) > 1:
            half = len(chunks) // 2
            await self._publish_batch(subject, chunks[:half], overflowed)
            await self._publish_batch(subject, chunks[half:], overflowed)
            return
        try:
            await self.nc.publish(subject, data)
        except OutboundBufferLimitError:
            overflowed.update(c.request_id for c in chunks)

    async def _on_resend(self, msg) -> None:
        try:
            cmd = m.decode_as(msg.data, m.ResendTokens).payload
        except m.DecodeError as exc:
            await self._dead_letter(msg, str(exc))
            return
        sent = self.sent_tokens.get(cmd.request_id)
        if sent is None:
            log.warning("resend of %s from %d: its tokens are no longer kept", cmd.request_id, cmd.from_index)
            return
        chunks = [c for c in sent[1] if c.start_index >= cmd.from_index]
        for chunk in chunks:  # one message each, on the request's subject: what every router version reads
            await self.nc.publish(cmd.token_subject or sent[0], self._env(chunk))
        self.num_chunks_resent += len(chunks)

    async def _event(self, payload) -> None:
        """A request event. A terminal one must reach the stream (it settles the request's
        ledger entries): acked and re-sent until it is (schemas/acked.py says which are not)."""
        subject = worker_events_subject(self.cfg.worker_id)
        if self.acked is not None and isinstance(payload, m.TERMINAL_TYPES):
            env = self.envelopes.wrap(payload, time.time_ns())
            await self.acked.publish(subject, m.encode(env), env.event_id)
        else:
            await self.nc.publish(subject, self._env(payload))

    async def _ensure_streams(self) -> None:
        for spec in ALL_STREAMS:
            config = StreamConfig.from_response(spec.api_config(self.cfg.nats_replicas))
            try:
                await self.js.add_stream(config)
            except BadRequestError:  # it exists: its limits are the router's settings, not ours to reset
                log.debug("stream %s exists; keeping its configuration", spec.name)

    async def _kv_store(self):
        """The hand-off KV object store (schemas.subjects.KV_BUCKET), created on first use."""
        if self._kv_bucket is None:
            try:
                self._kv_bucket = await self.js.create_object_store(
                    KV_BUCKET, config=ObjectStoreConfig(bucket=KV_BUCKET, ttl=KV_BUCKET_TTL_S))
            except BadRequestError:  # it exists with other limits (an operator's): use it as it is
                self._kv_bucket = await self.js.object_store(KV_BUCKET)
        return self._kv_bucket

    async def _put_kv(self, name: str, kv) -> None:
        from workers.engines.torch_engine import kv_to_bytes

        await (await self._kv_store()).put(name, kv_to_bytes(kv))

    async def _take_kv(self, name: str):
        """Read a hand-off's K/V and delete it (the bucket's TTL removes what is never read)."""
        from workers.engines.torch_engine import kv_from_bytes

        store = await self._kv_store()
        result = await store.get(name)
        try:
            await store.delete(name)
        except Exception as exc:  # harmless: the TTL removes it
            log.warning("hand-off KV %s: delete failed (%s); the bucket's TTL will remove it", name, exc)
        return kv_from_bytes(result.data)

    def recent_step_ms(self) -> float:
        """Mean engine ms of the steps that ended in the last m.RECENT_STEPS_WINDOW_S (3 s; 0: none)."""
        horizon = time.monotonic() - m.RECENT_STEPS_WINDOW_S
        while self.recent_steps and self.recent_steps[0][0] < horizon:
            self.recent_steps.popleft()
        if not self.recent_steps:
            return 0.0
        return round(sum(ms for _, ms in self.recent_steps) / len(self.recent_steps), 3)

    def status(self) -> m.WorkerStatusReported:
        e = self.engine
        return m.WorkerStatusReported(
            worker_id=self.cfg.worker_id, role=self.cfg.role, boot_id=self.boot_id, state=self.state,
            engine=self.cfg.engine, pid=os.getpid(), host=self.host, block_size_tokens=self.cfg.block_size_tokens,
            num_kv_blocks=self.cfg.num_kv_blocks, num_free_kv_blocks=e.num_free_kv_blocks,
            num_cached_kv_blocks=e.num_cached_kv_blocks, max_batch_tokens=self.cfg.max_batch_tokens,
            max_seq_len_tokens=e.max_seq_len_tokens, num_running_requests=e.num_running_requests,
            num_queued_batches=e.num_queued_batches,
            running_request_ids=e.running_request_ids() + self.unpublished_request_ids,
            num_batches_executed=self.num_batches_executed, num_requests_finished=self.num_requests_finished,
            num_undecodable_messages=self.num_undecodable, num_stale_commands_refused=self.num_stale_refused,
            fencing_epoch=self.max_epoch,
            num_stream_overflows=self.num_stream_overflows, time_scale=self.cfg.time_scale,
            last_step_ms=self.last_step_ms, recent_step_ms=self.recent_step_ms(), heartbeat_interval_ms=self.cfg.heartbeat_interval_ms,
            not_ready_reason=self.not_ready_reason if self.state != "ready" else "",
            model=self.cfg.served_model(), lora_adapters=list(self.lora_adapters), max_num_seqs=e.max_num_seqs,
            max_loras=e.max_loras, loaded_lora_adapters=e.loaded_lora_adapters(),
        )

    # ------------------------------------------------------------------ run
    async def run(self, stop: asyncio.Event, urgent: asyncio.Event | None = None) -> None:
        """Start, serve until `stop` is set, drain, stop. Start-up (NATS, streams, the engine's
        preparation) waits as long as it must, saying what for, but gives way to `stop` at
        once: a worker told to stop before it registered closes what it opened and returns.
        Told to stop while serving, it drains first (`drain_timeout_s`): it reports
        "draining" (the router sends it no new work) and finishes what it holds, for up to
        the timeout or until `urgent` is set (a second signal), then fails the rest retryable."""
        starting = asyncio.create_task(self._start(), name="start-up")
        stopped = asyncio.create_task(stop.wait(), name="stop")
        await asyncio.wait({starting, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():
            starting.cancel()
            await asyncio.gather(starting, return_exceptions=True)
            log.warning("worker %s: stopped during start-up (%s)", self.cfg.worker_id, self._waiting_for)
            await self._close(None)
            return
        stopped.cancel()
        psub, metrics_server = starting.result()  # start-up's own failure raises here
        tasks = [
            asyncio.create_task(self._heartbeat_loop(), name="heartbeat"),
            asyncio.create_task(self._command_loop(psub), name="commands"),
            asyncio.create_task(self.acked.run(), name="acked"),
        ] + [asyncio.create_task(loop, name="engine") for loop in self.engine_loops()]
        await stop.wait()
        if self.cfg.drain_timeout_s > 0 and self.meta:
            await self._drain(self.cfg.drain_timeout_s, urgent)
        self.state, self.not_ready_reason = "stopping", "worker stopping (told to: SIGTERM or SIGINT)"
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        try:
            await asyncio.wait_for(self._say_goodbye(), SHUTDOWN_TIMEOUT_S)
        except asyncio.TimeoutError:
            log.error("bus unreachable at shutdown: %d requests not reported failed", len(self.meta))
        await self._close(metrics_server)

    async def _close(self, metrics_server) -> None:
        """Close the connection if it is up, waiting at most SHUTDOWN_TIMEOUT_S / 3. One that
        is away is left to the process's exit: nats-py's close then flushes the pending bytes
        into the dead socket and waits for them, swallowing a cancel (asyncio.wait_for on it
        never returned: a worker ignored SIGTERM while NATS was away)."""
        self.close_engine()
        if self.nc is not None and self.nc.is_connected:
            closing = asyncio.create_task(self.nc.close(), name="nats-close")
            done, _ = await asyncio.wait({closing}, timeout=SHUTDOWN_TIMEOUT_S / 3)
            if not done:
                log.warning("nats close at shutdown did not finish in %.1f s; exiting without it", SHUTDOWN_TIMEOUT_S / 3)
            elif closing.exception() is not None:  # closing a broken connection: say so, exit anyway
                log.warning("nats close at shutdown failed: %s", closing.exception().__class__.__name__)
        elif self.nc is not None:
            log.warning("nats not connected at shutdown: %d bytes of outputs not sent", self.nc.pending_data_size)
        if metrics_server is not None:
            metrics_server.shutdown()

    async def _start(self):
        """Connect, set up the streams, prepare the engine, subscribe and register. Returns
        (the command pull subscription, the metrics server or None)."""
        cfg = self.cfg
        num_errors = 0
        last_wait_log = 0.0

        async def error_cb(exc: Exception) -> None:
            nonlocal num_errors, last_wait_log
            num_errors += 1
            if self.js is None:  # not connected yet (nats.connect retries): say what start-up waits for
                now = time.monotonic()
                if now - last_wait_log >= WAIT_LOG_INTERVAL_S:
                    last_wait_log = now
                    log.warning("waiting for NATS at %s: %s (retrying)", cfg.nats_url, exc or exc.__class__.__name__)
            elif num_errors == 1 or num_errors % 40 == 0:  # a 10 s outage logs a line, not 40 tracebacks
                log.warning("nats error (%d so far): %s", num_errors, exc)

        self._waiting_for = f"waiting for NATS at {redact_url(cfg.nats_url)}"
        self.nc = await nats.connect(
            nats_servers(cfg.nats_url), name=f"flexlb-worker-{cfg.worker_id}", max_reconnect_attempts=-1, reconnect_time_wait=0.25,
            connect_timeout=5, error_cb=error_cb, pending_size=cfg.outbound_buffer_bytes,
        )
        self.js = self.nc.jetstream()
        self.acked = AckedPublisher(self.nc, f"worker {cfg.worker_id} terminal event")
        metrics_server = None
        if cfg.metrics_port:
            from workers.metrics import StatusCollector, serve

            metrics_server, _ = serve(cfg.metrics_host, cfg.metrics_port, StatusCollector(
                lambda: self.last_status, lambda: (len(self.acked.pending), self.acked.num_lost), self))
        try:
            self._waiting_for = f"setting up the JetStream streams at {redact_url(cfg.nats_url)}"
            await self._ensure_streams()
            self._waiting_for = "preparing the engine"
            await self.prepare_engine()
            self._waiting_for = "registering"
            await self.nc.subscribe(cancel_subject(cfg.worker_id), cb=self._on_cancel)
            await self.nc.subscribe(kv_snapshot_request_subject(cfg.worker_id), cb=self._on_snapshot_request)
            await self.nc.subscribe(epoch_subject(cfg.worker_id), cb=self._on_fence_epoch)
            await self.nc.subscribe(resend_subject(cfg.worker_id), cb=self._on_resend)
            if cfg.role == "decode":
                subject, durable = decode_subject(cfg.worker_id), decode_consumer(cfg.worker_id)
            else:
                subject, durable = dispatch_subject(cfg.worker_id), dispatch_consumer(cfg.worker_id)
            psub = await self.js.pull_subscribe(
                subject, durable=durable, stream=DISPATCH_STREAM.name,
                config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, ack_wait=30, max_ack_pending=10000),
            )
            # The limits as its first status says them (the openai agent's: learned by prepare_engine).
            first = self.status()
            registered = m.WorkerRegistered(
                worker_id=cfg.worker_id, role=cfg.role, boot_id=self.boot_id, engine=cfg.engine, pid=os.getpid(),
                host=self.host, block_size_tokens=cfg.block_size_tokens, num_kv_blocks=cfg.num_kv_blocks,
                max_batch_tokens=cfg.max_batch_tokens, max_seq_len_tokens=cfg.max_seq_len_tokens,
                heartbeat_interval_ms=cfg.heartbeat_interval_ms, model=cfg.served_model(),
                lora_adapters=list(first.lora_adapters), max_num_seqs=first.max_num_seqs, max_loras=first.max_loras,
            )
            await self.js.publish(worker_events_subject(cfg.worker_id), self._env(registered))
            await self.nc.publish(status_subject(cfg.worker_id), self._env(first))
        except BaseException:
            if metrics_server is not None:
                metrics_server.shutdown()
            raise
        self._waiting_for = "started"
        log.info("worker %s (%s, boot %s) ready", cfg.worker_id, cfg.role, self.boot_id)
        return psub, metrics_server

    async def _drain(self, timeout_s: float, urgent: asyncio.Event | None) -> None:
        """Report "draining" and serve on until nothing is held, the timeout, or `urgent`."""
        held = len(self.meta)
        self.state = "draining"
        self.not_ready_reason = f"worker stopping (told to): finishing the {held} requests it holds, for up to {timeout_s:g} s"
        log.warning("worker %s: %s", self.cfg.worker_id, self.not_ready_reason)
        try:  # at once, not at the next heartbeat: the router stops sending work here
            await self.nc.publish(status_subject(self.cfg.worker_id), self._env(self.status()))
        except Exception as exc:  # the bus is away: the heartbeat loop says it when it can
            log.warning("worker %s: could not report draining: %s", self.cfg.worker_id, exc.__class__.__name__)
        deadline = time.monotonic() + timeout_s
        while self.meta and time.monotonic() < deadline and not (urgent is not None and urgent.is_set()):
            await asyncio.sleep(DRAIN_POLL_S)
        if self.meta:
            why = "told again to stop" if urgent is not None and urgent.is_set() else f"{timeout_s:g} s drain timeout"
            log.warning("worker %s: %s with %d of %d requests unfinished: failing them (retryable)", self.cfg.worker_id,
                        why, len(self.meta), held)
        else:
            log.warning("worker %s: drained: the %d requests it held finished", self.cfg.worker_id, held)

    async def _say_goodbye(self) -> None:
        await self._fail_everything("worker stopping")
        await self.nc.publish(status_subject(self.cfg.worker_id), self._env(self.status()))
        await self.nc.flush()
        unacked = await self.acked.drain(SHUTDOWN_TIMEOUT_S * 0.8)
        if unacked:
            log.error("%d terminal events unacked at shutdown (the router settles them from status reports)", unacked)

    async def _fail_everything(self, reason: str) -> None:
        for request_id in list(self.meta):
            self.cancel_request(request_id)
            self._forget(request_id)
            await self._event(m.RequestFailed(
                request_id=request_id, worker_id=self.cfg.worker_id, code="worker_failed", message=reason, retryable=True,
            ))

    async def _heartbeat_loop(self) -> None:
        interval = self.cfg.heartbeat_interval_ms / 1000
        while True:
            try:
                self.last_status = self.status()
                await self.nc.publish(status_subject(self.cfg.worker_id), self._env(self.last_status))
            except Exception as exc:  # bus outage: keep beating, the next one may get through
                log.warning("heartbeat publish failed: %s", exc)
            await asyncio.sleep(interval)

    async def _command_loop(self, psub) -> None:
        while True:
            try:
                msgs = await psub.fetch(batch=64, timeout=1.0)
            except asyncio.TimeoutError:
                continue
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # bus outage: wait it out
                log.warning("command fetch failed: %s", exc)
                await asyncio.sleep(0.5)
                continue
            for msg in msgs:
                try:
                    await self._on_command(msg)
                except asyncio.CancelledError:
                    raise
                except Exception:  # a command we cannot execute: dead-letter it, keep going
                    log.exception("command on %s failed", msg.subject)
                    await self._dead_letter(msg, "command handler raised")
                await msg.ack()

    async def _dead_letter(self, msg, reason: str) -> None:
        self.num_undecodable += 1
        await self.nc.publish(
            dlq_subject(self.cfg.worker_id), msg.data,
            headers={HDR_DLQ_REASON: reason[:512], HDR_DLQ_SUBJECT: msg.subject},
        )

    async def _on_command(self, msg) -> None:
        try:
            cmd = m.decode(msg.data).payload
        except m.DecodeError as exc:
            log.warning("undecodable command on %s: %s", msg.subject, exc)
            await self._dead_letter(msg, str(exc))
            return
        if isinstance(cmd, m.DispatchBatch) and self.cfg.role != "decode":
            if cmd.batch_id in self.seen_batches:
                return  # redelivery of a batch we already took
            self.seen_batches[cmd.batch_id] = None
            if len(self.seen_batches) > SEEN_BATCHES_MAX:
                self.seen_batches.popitem(last=False)
            if cmd.epoch < self.max_epoch:
                self.num_stale_refused += 1
                for r in cmd.requests:
                    await self._event(m.RequestFailed(
                        request_id=r.request_id, worker_id=self.cfg.worker_id, code="dispatch_failed", retryable=True,
                        message=f"stale fencing epoch {cmd.epoch} < {self.max_epoch}",
                    ))
                return
            self.max_epoch = cmd.epoch
            requests = [r for r in cmd.requests if not self._is_withdrawn(r.request_id, cmd.batch_id)]
            if not requests:
                return  # every request was withdrawn by the router before the command arrived
            for r in requests:
                self._superseded(r.request_id)
                keep = r.prompt_token_ids if self.cfg.role == "prefill" else []
                self.meta[r.request_id] = ReqMeta(r.token_subject, r.decode_worker_id, keep, r.max_tokens, r.deadline_ns,
                                                  r.sampling, batch_id=cmd.batch_id,
                                                  token_batch_subject=r.token_batch_subject,
                                                  output_offset=r.output_offset).continues(r.prompt_token_ids)
            self.batch_members[cmd.batch_id] = [r.request_id for r in requests]
            self.submit_batch(cmd.batch_id, requests)
        elif isinstance(cmd, m.StartDecode) and self.cfg.role == "decode":
            key = f"{cmd.batch_id}:{cmd.request_id}"
            if key in self.seen_batches or self._is_withdrawn(cmd.request_id, cmd.batch_id):
                return
            self.seen_batches[key] = None
            request = engine_request(cmd.request_id, cmd.prompt_token_ids, cmd.max_tokens, cmd.sampling,
                                     output_offset=cmd.output_offset)
            kv = None
            if cmd.kv_object:
                try:
                    kv = await self._take_kv(cmd.kv_object)
                except Exception as exc:  # the KV is gone or broken: fail visibly, the router re-tries elsewhere
                    log.error("hand-off %s: reading its KV %s failed: %s", cmd.request_id, cmd.kv_object, exc)
                    await self._event(m.RequestFailed(
                        request_id=cmd.request_id, worker_id=self.cfg.worker_id, code="worker_failed", retryable=True,
                        message=f"the hand-off's KV ({cmd.kv_object}) could not be read: {exc}"))
                    return
            self._superseded(cmd.request_id)
            self.meta[cmd.request_id] = ReqMeta(cmd.token_subject, self.cfg.worker_id, [], cmd.max_tokens, cmd.deadline_ns,
                                                cmd.sampling, batch_id=cmd.batch_id,
                                                token_batch_subject=cmd.token_batch_subject,
                                                output_offset=cmd.output_offset).continues(cmd.prompt_token_ids)
            self.engine.submit_decode(request, first_token_id=cmd.first_token_id, num_cached_tokens=cmd.num_cached_tokens,
                                      kv=kv)
        else:
            await self._dead_letter(msg, f"{type(cmd).__name__} is not a command for a {self.cfg.role} worker")
            return
        self.work.set()

    async def _on_cancel(self, msg) -> None:
        try:
            cmd = m.decode_as(msg.data, m.CancelRequest).payload
        except m.DecodeError as exc:
            await self._dead_letter(msg, str(exc))
            return
        if cmd.withdraw:
            self.withdrawn[cmd.request_id] = cmd.batch_id
            if len(self.withdrawn) > WITHDRAWN_MAX:
                self.withdrawn.popitem(last=False)
            meta = self.meta.get(cmd.request_id)
            if meta is not None and cmd.batch_id in ("", meta.batch_id) and self.cancel_request(cmd.request_id):
                self._forget(cmd.request_id)  # the router owns its terminal event
            return
        if self.cancel_request(cmd.request_id):
            self._forget(cmd.request_id)
            await self._event(m.RequestCancelled(request_id=cmd.request_id, worker_id=self.cfg.worker_id, reason=cmd.reason))

    async def _on_fence_epoch(self, msg) -> None:
        try:
            cmd = m.decode_as(msg.data, m.FenceEpoch).payload
        except m.DecodeError as exc:
            await self._dead_letter(msg, str(exc))
            return
        if cmd.epoch > self.max_epoch:
            log.info("fencing epoch %d (router %s); older commands are refused", cmd.epoch, cmd.router_id)
            self.max_epoch = cmd.epoch

    async def _on_snapshot_request(self, msg) -> None:
        try:
            m.decode_as(msg.data, m.RequestKvSnapshot)  # only checked: any valid request gets the whole view
        except m.DecodeError as exc:
            await self._dead_letter(msg, str(exc))
            return
        # Consistent with every KV event published so far (kv_seq does not advance).
        await self.nc.publish(kv_events_subject(self.cfg.worker_id), self._env(m.KvSnapshot(
            worker_id=self.cfg.worker_id, boot_id=self.boot_id, kv_seq=self.kv_seq,
            block_hashes=self.cached_block_hashes(), block_size_tokens=self.cfg.block_size_tokens,
        )))

    async def _publish_kv(self, step: StepResult) -> None:
        wid = self.cfg.worker_id
        if step.blocks_removed:
            self.kv_seq += 1
            await self.nc.publish(kv_events_subject(wid), self._env(m.KvBlocksRemoved(
                worker_id=wid, boot_id=self.boot_id, kv_seq=self.kv_seq, block_hashes=list(step.blocks_removed),
            )))
        if step.blocks_stored:
            self.kv_seq += 1
            await self.nc.publish(kv_events_subject(wid), self._env(m.KvBlocksStored(
                worker_id=wid, boot_id=self.boot_id, kv_seq=self.kv_seq, block_hashes=list(step.blocks_stored),
                block_size_tokens=self.cfg.block_size_tokens,
            )))

    # ------------------------------------------------------------------ the step loop's sink (workers/engines/step_loop.py)
    async def step_began(self, step: StepResult) -> None:
        for batch_id in step.batches_started:
            await self._event(m.BatchStarted(
                batch_id=batch_id, worker_id=self.cfg.worker_id, request_ids=self.batch_members.get(batch_id, []),
            ))
        self.unpublished_request_ids = ([f.request_id for f in step.finished] + [f.request_id for f in step.failed]
                                        + [h.request_id for h in step.handoffs])

    def sleep_over(self) -> None:
        pass

    async def step_ended(self, step: StepResult, measured_ms: float) -> None:
        self.last_step_ms = measured_ms
        if step.kind != "report":  # the engine's own step time: what the batch costs, not loop lateness
            self.recent_steps.append((time.monotonic(), step.duration_ms))
        # Each batch's prefill time is its share of the steps its chunks ran in, measured.
        stretch = measured_ms / step.duration_ms if step.duration_ms > 0 else 1.0
        for batch_id, share_ms in step.prefill_ms_by_batch.items():
            self.batch_prefill_ms[batch_id] = self.batch_prefill_ms.get(batch_id, 0.0) + share_ms * stretch
        try:
            await self._publish_step(step, measured_ms)
            await self._enforce_deadlines()
        except asyncio.CancelledError:
            raise
        except Exception:  # keep the engine going; the lost outputs surface as client errors
            log.exception("publishing a step's outputs failed")
        finally:
            self.unpublished_request_ids = []

    async def engine_failed(self, message: str) -> None:
        await self._fail_everything(message)

    @property
    def num_engine_errors(self) -> int:
        """Exceptions raised by engine.step() (the worker's /metrics)."""
        return self.step_loop.num_engine_errors if self.step_loop is not None else 0

    @property
    def num_lora_loads(self) -> int | None:
        """LoRA adapters its engine loaded into a slot since boot (the worker's /metrics);
        None (not exported) without an engine of its own or with no adapters to load."""
        return self.engine.num_lora_loads if self.engine is not None and self.engine.max_loras else None

    async def _stream_overflow(self, request_id: str) -> None:
        """Its tokens no longer fit the outbound buffer (NATS away too long): stop it and say
        so. The failure event may not fit either; then the router learns it from the status
        reports, which stop listing the request (calibration), or from the token gap."""
        self.num_stream_overflows += 1
        self.cancel_request(request_id)
        self._forget(request_id)
        log.warning("request %s: outbound buffer of %d bytes full; stopped (stream_overflow)", request_id,
                    self.cfg.outbound_buffer_bytes)
        try:
            await self._event(m.RequestFailed(request_id=request_id, worker_id=self.cfg.worker_id, code="stream_overflow",
                                              message=f"worker {self.cfg.worker_id}: outbound buffer full while NATS was away",
                                              retryable=True))
        except OutboundBufferLimitError:
            log.warning("request %s: its stream_overflow event did not fit the buffer either", request_id)

    async def _enforce_deadlines(self) -> None:
        """Stop requests past their deadline (they would run on for nobody): timed_out."""
        now = time.time_ns()
        late = [rid for rid, meta in self.meta.items() if 0 < meta.deadline_ns <= now]
        for rid in late:
            if self.cancel_request(rid):
                self._forget(rid)
                await self._event(m.RequestTimedOut(request_id=rid, worker_id=self.cfg.worker_id, phase="running"))

    async def _publish_step(self, step: StepResult, measured_ms: float) -> None:
        wid = self.cfg.worker_id
        await self._publish_kv(step)
        finished = {f.request_id: f for f in step.finished}
        chunks: dict[str, list] = {}
        for t in step.tokens:
            chunks.setdefault(t.request_id, []).append(t)
        now_ns = time.time_ns()
        for request_id, toks in chunks.items():
            meta = self.meta.get(request_id)
            if meta is None:
                continue  # cancelled meanwhile
            if toks[0].index == 0:
                self.first_token_ns[request_id] = now_ns
            ids = [t.token_id for t in toks]
            fin = finished.get(request_id)
            self.queue_tokens(meta, m.TokensGenerated(
                request_id=request_id, worker_id=wid, start_index=meta.output_offset + toks[0].index, token_ids=ids,
                text=meta.text.decode(ids, final=fin is not None), finish_reason=fin.finish_reason if fin else None,
                num_cached_tokens=fin.num_cached_tokens if fin else None,
            ))
        await self._flush_tokens()  # the step's tokens: one message per router (before their requests' terminal events)
        for done in step.batches_prefilled:
            self.batch_members.pop(done.batch_id, None)
            if not done.request_ids:  # every member was cancelled: nothing ran to report
                self.batch_prefill_ms.pop(done.batch_id, None)
                continue
            self.num_batches_executed += 1
            await self._event(m.PrefillCompleted(
                batch_id=done.batch_id, worker_id=wid, request_ids=list(done.request_ids),
                measured_ms=round(self.batch_prefill_ms.pop(done.batch_id, 0.0), 3),
                num_prompt_tokens=done.num_prompt_tokens, num_cached_tokens=done.num_cached_tokens,
            ))
        for h in step.handoffs:
            meta = self._forget(h.request_id)
            if meta is None:
                continue
            try:
                kv_object = ""
                if h.kv is not None:  # the torch engine: ship the prompt's K/V first
                    kv_object = kv_object_name(h.batch_id, h.request_id)
                    await self._put_kv(kv_object, h.kv)
                cmd = m.StartDecode(
                    request_id=h.request_id, prefill_worker_id=wid, decode_worker_id=meta.decode_worker_id,
                    batch_id=h.batch_id, prompt_token_ids=meta.prompt_token_ids, max_tokens=meta.max_tokens,
                    token_subject=meta.token_subject, first_token_id=h.first_token_id, num_cached_tokens=h.num_cached_tokens,
                    deadline_ns=meta.deadline_ns, sampling=meta.sampling, kv_object=kv_object,
                    token_batch_subject=meta.token_batch_subject, output_offset=meta.output_offset,
                )
                await publish_until_acked(self.js, decode_subject(meta.decode_worker_id), self._env(cmd),
                                          f"{h.batch_id}:{h.request_id}")
            except Exception as exc:  # the hand-off is lost: fail the request visibly
                log.error("hand-off of %s to %s failed: %s", h.request_id, meta.decode_worker_id, exc)
                await self._event(m.RequestFailed(
                    request_id=h.request_id, worker_id=wid, code="worker_failed", retryable=True,
                    message=f"hand-off to decode worker {meta.decode_worker_id} failed: {exc}",
                ))
        for f in step.finished:
            first_ns = self.first_token_ns.get(f.request_id, 0)
            meta = self._forget(f.request_id)
            if meta is None:
                continue
            self.num_requests_finished += 1
            await self._event(m.RequestFinished(
                request_id=f.request_id, worker_id=wid, finish_reason=f.finish_reason, num_prompt_tokens=f.num_prompt_tokens,
                num_output_tokens=meta.output_offset + f.num_output_tokens, num_cached_tokens=f.num_cached_tokens,
                first_token_ns=first_ns,
            ))
        for f in step.failed:
            if self._forget(f.request_id) is None:
                continue
            await self._event(m.RequestFailed(request_id=f.request_id, worker_id=wid, code=f.code, message=f.message))
