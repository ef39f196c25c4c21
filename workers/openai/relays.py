"""The openai agent's stream relays: one per request, turning each server-sent event of the
engine server's stream into token chunks in the agent's outbox (workers/openai/agent.py,
module docstring "Execution" and "Streams without token ids"). `StreamRelay` reads OpenAI's
/v1/completions and /v1/chat/completions chunks, `SGLangRelay` SGLang's /generate; both
read through lean reader Structs (only the fields the agent uses; the rest is ignored).
`EmbeddingsRelay` turns a /v1/embeddings answer (not a stream) into chunks the same way.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

import msgspec

from schemas import messages as m
from schemas.openai_bodies import MAX_EXTRA_BYTES, ExtraTooLarge, chunk_extras
from workers.agent import ReqMeta
from workers.config import WorkerConfig
from workers.openai.upstream import UpstreamFailure
from workers.openai.upstream import refusal_of as _refusal


@dataclass
class OpenBatch:
    """A dispatched batch the agent has released to the server, until every member has its
    first token or its end."""

    batch_id: str
    requests: list[m.BatchRequest]
    released_ns: int = 0
    waiting_first: set[str] = field(default_factory=set)  # members with neither a first token nor an end yet
    first_ms: dict[str, float] = field(default_factory=dict)  # member -> first-token latency from release
    cached: dict[str, int] = field(default_factory=dict)  # member -> cached prompt tokens (estimate)


class RelayHost(Protocol):
    """What a relay uses of the agent that owns it (workers/openai/agent.py `OpenAIAgent`):
    its open requests, its outbox and first-token bookkeeping. Relays import this, not the
    agent: the imports point one way (agent -> relays)."""

    cfg: WorkerConfig
    meta: dict[str, ReqMeta]  # the open requests: one that left (cancelled, failed) is gone
    first_token_ns: dict[str, int]
    stream_token_ids: bool | None  # the server streams token ids (None: not known yet)

    def first_or_end(self, batch: OpenBatch, request_id: str, first_ms: float | None) -> None: ...

    def note_token_gap(self, now_s: float, ms_per_token: float) -> None: ...

    def queue_tokens(self, meta: ReqMeta, chunk: m.TokensGenerated) -> None: ...


class _Delta(msgspec.Struct):
    """A chat chunk's delta: what the agent reads of it."""

    content: str | None = None  # the text (None in the role chunk and in tool-call / reasoning chunks)
    # Counted as output (a chunk with any of them stands for tokens); relayed with the rest of
    # what FlexLB does not make itself (TokensGenerated.extra).
    reasoning_content: str | None = None  # vLLM < 0.11, SGLang
    reasoning: str | None = None  # vLLM >= 0.11
    tool_calls: list | None = None


class _Choice(msgspec.Struct):
    """What the agent reads of a streamed completion or chat chunk's choice (the rest is
    relayed as it came: schemas/openai_bodies.py `chunk_extras`)."""

    index: int | None = None
    text: str | None = None  # /v1/completions
    delta: _Delta | None = None  # /v1/chat/completions
    token_ids: list[int] | None = None  # vLLM >= 0.10.2 with return_token_ids: this chunk's
    finish_reason: str | None = None


class _Chunk(msgspec.Struct):
    choices: list[_Choice] = []
    usage: dict | None = None  # with stream_options.include_usage: the last chunk's (every chunk's with continuous usage)
    error: object = None  # an error chunk (vLLM: {"error": {...}})
    # vLLM's chat stream with return_token_ids: the server's own rendering of the messages, in
    # the first chunk (ChatCompletionStreamResponse.prompt_token_ids).
    prompt_token_ids: list[int] | None = None


class _SGLangMeta(msgspec.Struct):
    finish_reason: object = None  # {"type": "length" | "stop" | "abort", ...} on the last chunk; null before
    prompt_tokens: int | None = None
    completion_tokens: int | None = None  # output tokens so far
    cached_tokens: int | None = None


class _SGLangChunk(msgspec.Struct):
    """One event of SGLang's streamed /generate (module docstring, SGLang)."""

    text: str | None = None  # cumulative (SGLang's default) or this chunk's (--incremental-streaming-output)
    output_ids: list[int] | None = None  # likewise
    meta_info: _SGLangMeta | None = None
    error: object = None


_decode_chunk = msgspec.json.Decoder(_Chunk).decode
_decode_sglang_chunk = msgspec.json.Decoder(_SGLangChunk).decode
# A stream's finish reasons that end a request normally, and what they end it as ("tool_calls":
# the model called a tool, a normal end of its turn).
FINISH_REASONS = {"length": "length", "stop": "stop", "tool_calls": "stop"}
class _Relay:
    """One request's stream: each server-sent event's data (UpstreamClient calls on_data from
    the event loop's read callback, no task switch) -> a token chunk in the agent's outbox.
    Raises UpstreamFailure for what ends the request (module docstring, Failures). The
    protocols' parsers (StreamRelay, SGLangRelay) share the rest here."""

    __slots__ = ("agent", "batch", "meta", "request", "request_id", "offset", "index", "finish", "first_ns", "last_s",
                 "held", "without_ids", "server_num_output_tokens", "server_num_cached_tokens")

    def __init__(self, agent: RelayHost, batch: OpenBatch, r: m.BatchRequest, meta: ReqMeta) -> None:
        self.agent = agent
        self.batch = batch
        self.meta = meta
        self.request = r
        self.request_id = r.request_id
        self.offset = r.output_offset  # a migrated request's continuation: its first token's index in the output
        self.index = 0  # output tokens relayed so far (counted, where the stream has no ids), from this server
        self.finish: str | None = None
        self.first_ns = 0
        self.last_s = 0.0
        # The last chunk, held until the stream ends, so that the server's usage (after it) can
        # give the request's cached prompt tokens and, without ids, its true count (end()).
        self.held: m.TokensGenerated | None = None
        self.without_ids = False  # a chunk came without token ids (its tokens were counted)
        self.server_num_output_tokens: int | None = None  # the server's count (usage, meta_info)
        self.server_num_cached_tokens: int | None = None

    def _check_owner(self) -> None:
        if self.agent.meta.get(self.request_id) is not self.meta:
            # It left the agent (cancelled, failed, superseded) while its bytes were on the
            # way: close the stream (the server aborts it); whoever ended it reported it.
            raise UpstreamFailure("cancelled", "the request left the agent")

    def _emit(self, ids: list[int], num_tokens: int, text: str, reason: str | None, extra: str = "") -> None:
        """A chunk of `num_tokens` tokens (`ids`, or none when the stream has no ids) to the
        outbox; the last chunk is held (end())."""
        agent, rid = self.agent, self.request_id
        if num_tokens:
            now_s = time.monotonic()
            if self.index == 0:
                self.first_ns = time.time_ns()
                agent.first_token_ns[rid] = self.first_ns
                agent.first_or_end(self.batch, rid, (time.monotonic_ns() - self.batch.released_ns) / 1e6)
            else:
                agent.note_token_gap(now_s, (now_s - self.last_s) * 1000 / num_tokens)
            self.last_s = now_s
        chunk = m.TokensGenerated(request_id=rid, worker_id=agent.cfg.worker_id, start_index=self.offset + self.index,
                                  token_ids=ids, text=text, finish_reason=reason, num_tokens=0 if ids else num_tokens,
                                  extra=extra)
        self.index += num_tokens
        if reason is not None:  # the last chunk: held for the server's usage, which comes after it (end())
            self.finish = reason
            self.held = chunk
            return
        agent.queue_tokens(self.meta, chunk)

    def end(self) -> None:
        """The stream is over: its held last chunk goes out with the prompt tokens the server
        found cached (its usage, after the last chunk: the client's
        usage.prompt_tokens_details.cached_tokens) and, where the stream has no ids, standing
        for the tokens the server counted that the chunks before it did not."""
        chunk, self.held = self.held, None
        if chunk is None:
            return
        counted = self.server_num_output_tokens
        if self.without_ids and counted is not None and counted != self.index:
            n = max(counted - (chunk.start_index - self.offset), 0)
            self.index = chunk.start_index - self.offset + n
            chunk = msgspec.structs.replace(chunk, num_tokens=n)
        if self.server_num_cached_tokens is not None:
            chunk = msgspec.structs.replace(chunk, num_cached_tokens=self.server_num_cached_tokens)
        self.agent.queue_tokens(self.meta, chunk)

    def num_output_tokens(self) -> int:
        """The request's output count (a continuation's from its request's first output token): the
        server's where the stream has no ids, else the ids relayed."""
        if self.without_ids and self.server_num_output_tokens is not None:
            return self.offset + self.server_num_output_tokens
        return self.offset + self.index

    def num_cached_tokens(self) -> int | None:
        return self.server_num_cached_tokens


class StreamRelay(_Relay):
    """OpenAI's streamed /v1/completions and /v1/chat/completions chunks (module docstring)."""

    __slots__ = ()

    def on_data(self, payload: bytes) -> None:
        self._check_owner()
        try:
            chunk = _decode_chunk(payload)
        except msgspec.DecodeError:
            raise UpstreamFailure("upstream_error", f"undecodable stream chunk: {payload[:200]!r}") from None
        if chunk.error is not None:
            raise UpstreamFailure("upstream_error", f"the engine server failed the request: {chunk.error}")
        try:  # what the chunk says beyond the text, relayed unchanged (schemas/openai_bodies.py)
            extras = chunk_extras(payload) if chunk.choices else {}
        except (msgspec.DecodeError, ExtraTooLarge) as exc:
            raise UpstreamFailure("upstream_error", f"stream chunk: {exc}") from None
        agent = self.agent
        usage = chunk.usage
        if usage:
            self._note_usage(usage)
        if chunk.prompt_token_ids is not None and self.request.chat is not None:
            agent.note_prompt_rendering(self.request, chunk.prompt_token_ids)
        for position, choice in enumerate(chunk.choices):
            ids = choice.token_ids
            reason = choice.finish_reason
            delta = choice.delta
            text = (delta.content if delta is not None else choice.text) or ""
            # (own: the choice says something of its own, not only the chunk's fields, which ride
            # with a chunk that goes anyway)
            extra, own = extras.get(position if choice.index is None else choice.index, ("", False)) if extras else ("", False)
            if reason is not None:
                mapped = FINISH_REASONS.get(reason)
                if mapped is None:
                    raise UpstreamFailure("upstream_error", f"the engine server ended the request: {reason}")
                reason = mapped
            if ids is not None:
                if agent.stream_token_ids is not True:
                    agent.stream_token_ids = True
                if ids or reason is not None or own:
                    self._emit(ids, len(ids), text, reason, extra)
                continue
            # No token ids (a server without return_token_ids): count the tokens this chunk
            # stands for: the server's running count where it gives one per chunk, else one
            # per chunk with output (text, reasoning or a tool call).
            has_output = bool(text) or (delta is not None and bool(delta.reasoning_content or delta.reasoning
                                                                    or delta.tool_calls))
            if not has_output and reason is None and not own:
                continue  # a role chunk, or nothing new
            if has_output and agent.stream_token_ids is None:
                agent.stream_token_ids = False
            self.without_ids = True
            running = usage.get("completion_tokens") if usage else None
            if type(running) is int:
                n = max(running - self.index, 0)
            else:
                n = 1 if has_output else 0
            self._emit([], n, text, reason, extra)

    def _note_usage(self, usage: dict) -> None:
        completion = usage.get("completion_tokens")
        if type(completion) is int:
            self.server_num_output_tokens = completion
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        if type(cached) is int:
            self.server_num_cached_tokens = cached


class SGLangRelay(_Relay):
    """SGLang's streamed /generate (module docstring, SGLang): `output_ids` and `text` are
    cumulative by default and this chunk's with `--incremental-streaming-output`; which, is
    read from each chunk (`meta_info.completion_tokens` is the count so far: a chunk with that
    many ids or more, after the first, is cumulative, and its new tokens are the tail)."""

    __slots__ = ("text_len", "is_cumulative")

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.text_len = 0  # characters of the cumulative text relayed
        self.is_cumulative: bool | None = None  # None: not yet told (the first chunk reads the same either way)

    def on_data(self, payload: bytes) -> None:
        self._check_owner()
        try:
            chunk = _decode_sglang_chunk(payload)
        except msgspec.DecodeError:
            raise UpstreamFailure("upstream_error", f"undecodable stream chunk: {payload[:200]!r}") from None
        if chunk.error is not None:
            raise UpstreamFailure("upstream_error", f"the engine server failed the request: {chunk.error}")
        meta = chunk.meta_info or _SGLangMeta()
        reason = None
        if meta.finish_reason is not None:
            kind = meta.finish_reason.get("type") if isinstance(meta.finish_reason, dict) else meta.finish_reason
            reason = FINISH_REASONS.get(kind) if isinstance(kind, str) else None
            if reason is None:  # "abort" (or what we do not know): the server ended it
                raise UpstreamFailure("upstream_error", f"the engine server ended the request: {meta.finish_reason}")
        if type(meta.completion_tokens) is int:
            self.server_num_output_tokens = meta.completion_tokens
        if type(meta.cached_tokens) is int:
            self.server_num_cached_tokens = meta.cached_tokens
        ids = chunk.output_ids
        if ids is None:
            raise UpstreamFailure("upstream_error", "the server's /generate stream carries no output_ids")
        if self.agent.stream_token_ids is not True:
            self.agent.stream_token_ids = True
        total = meta.completion_tokens
        if self.index > 0:
            if type(total) is int:
                self.is_cumulative = len(ids) >= total
            elif self.is_cumulative is None:
                self.is_cumulative = len(ids) > self.index  # no count: the longer reading
        new_ids = ids[self.index:] if self.is_cumulative else ids
        text = chunk.text or ""
        if self.is_cumulative or (self.index == 0 and self.is_cumulative is None):
            # Cumulative text (or the first chunk, where both readings agree): the new tail.
            new_text = text[self.text_len:]
            self.text_len = max(self.text_len, len(text))
        else:
            new_text = text
        if new_ids or reason is not None:
            self._emit(new_ids, len(new_ids), new_text, reason)


_decode_answer = msgspec.json.Decoder(dict[str, msgspec.Raw]).decode
_decode_items = msgspec.json.Decoder(list[msgspec.Raw]).decode


class EmbeddingsRelay(_Relay):
    """An embeddings request (ForEngine.embed): one POST /v1/embeddings, not a stream. Its
    answer's `data` items go to the router one per chunk, each chunk's `extra` the JSON text
    {"data": <the item's bytes>}, then a last chunk (finish_reason "stop") with {"usage":
    <the server's usage>}; no tokens (services/embeddings.py joins them). The answer is the
    request's first token as the batch's prefill measure sees it."""

    __slots__ = ()

    async def fetch(self, upstream, body: bytes, timeout_s: float) -> None:
        status, raw = await upstream.post("/v1/embeddings", body, timeout_s)
        self._check_owner()
        if status != 200:
            raise _refusal(status, raw)
        try:
            answer = _decode_answer(raw)
            items = _decode_items(answer["data"]) if "data" in answer else None
        except msgspec.DecodeError:
            items = None
        if items is None:
            raise UpstreamFailure("upstream_error", f"an embeddings answer without a data list: {bytes(raw[:200])!r}")
        agent = self.agent
        self.first_ns = time.time_ns()
        agent.first_token_ns[self.request_id] = self.first_ns
        agent.first_or_end(self.batch, self.request_id, (time.monotonic_ns() - self.batch.released_ns) / 1e6)
        for item in items:
            extra = b'{"data":' + bytes(item) + b"}"
            if len(extra) > MAX_EXTRA_BYTES:
                raise UpstreamFailure("upstream_error", f"an embedding of {len(extra)} bytes exceeds the "
                                                        f"{MAX_EXTRA_BYTES}-byte limit of a chunk: ask for base64")
            self._emit([], 0, "", None, extra.decode())
        usage = answer.get("usage")
        known = usage is not None and bytes(usage) != b"null"
        self._emit([], 0, "", "stop", ('{"usage":' + bytes(usage).decode() + "}") if known else "")
