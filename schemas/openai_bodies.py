"""One home for the OpenAI response shapes: a non-streaming answer's body and a stream's
server-sent events, for /v1/completions and /v1/chat/completions. The router answers its
clients with them (services/api.py), the sim server answers peer routers with them
(workers/sim_server/formats.py, with vLLM's token ids where a request asks for them); the
shapes are schemas/api.py's, the SSE framing schemas/http.py's `sse`.

A shape is made per request (its id, creation time and model) and used as:
`first()` the stream's opening event (chat: the role chunk; completions: none),
`chunk(text, finish_reason, token_ids, extra)` one event per engine delta (`extra`: what the
engine server said beyond the text, relayed unchanged; the section at the end),
`usage_chunk(usage)` the include_usage event, `body(text, finish_reason, usage, token_ids)`
the non-streaming answer. Streamed chunks carry no `usage` key but on the usage chunk (as vLLM
sends them); a chat chunk without text has an empty delta (`{}`, as OpenAI's last chunk).
`skips_empty`: a chunk with neither text nor an end need not be sent (chat), where a
completion stream sends every engine chunk.
"""

from __future__ import annotations

import msgspec

from schemas.api import (
    ChatChoice,
    ChatChoiceWithTokenIds,
    ChatChunkChoice,
    ChatChunkChoiceWithTokenIds,
    ChatCompletionChunk,
    ChatCompletionChunkWithPromptIds,
    ChatCompletionResponse,
    ChatCompletionResponseWithPromptIds,
    ChatDelta,
    ChatMessage,
    CompletionChoice,
    CompletionChoiceWithTokenIds,
    CompletionChunk,
    CompletionResponse,
    PromptTokensDetails,
    UsageWithDetails,
)
from schemas.http import SSE_DONE, error_body, sse

_encode = msgspec.json.Encoder().encode


def usage_of(num_prompt_tokens: int, num_output_tokens: int, num_cached_tokens: int | None) -> UsageWithDetails:
    """OpenAI's usage; `prompt_tokens_details.cached_tokens` where the engine said (None: left out)."""
    return UsageWithDetails(
        prompt_tokens=num_prompt_tokens, completion_tokens=num_output_tokens,
        total_tokens=num_prompt_tokens + num_output_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=num_cached_tokens) if num_cached_tokens is not None else None,
    )


class CompletionShape:
    """`text_completion` bodies and chunks (/v1/completions). `return_token_ids` (vLLM >= 0.10.2):
    each choice carries its token ids."""

    skips_empty = False
    is_chat = False
    done = SSE_DONE

    def __init__(self, request_id: str, created: int, model: str, include_usage: bool = False,
                 return_token_ids: bool = False) -> None:
        self.request_id, self.created, self.model = request_id, created, model
        self.include_usage, self.return_token_ids = include_usage, return_token_ids

    def _choice(self, text: str, finish_reason: str | None, token_ids: list[int] | None) -> CompletionChoice:
        if self.return_token_ids:
            return CompletionChoiceWithTokenIds(text=text, finish_reason=finish_reason, token_ids=token_ids or [])
        return CompletionChoice(text=text, finish_reason=finish_reason)

    def _chunk(self, choices: list[CompletionChoice], usage: UsageWithDetails | None = None) -> bytes:
        return sse(_encode(CompletionChunk(id=self.request_id, object="text_completion", created=self.created,
                                           model=self.model, choices=choices, usage=usage)))

    def first(self) -> bytes:
        return b""

    def chunk(self, text: str, finish_reason: str | None, token_ids: list[int] | None = None, extra: str = "") -> bytes:
        out = self._chunk([self._choice(text, finish_reason, token_ids)])
        return with_extra(out, extra, False) if extra else out

    def usage_chunk(self, usage: UsageWithDetails) -> bytes:
        return self._chunk([], usage)

    def error(self, code: str, message: str) -> bytes:
        return sse(error_body(code, message))

    def stopped_by(self, stop: str | None) -> None:
        """(Which stop string ended the output: OpenAI's answer does not say.)"""

    def whole(self, text: str, finish_reason: str | None, usage: UsageWithDetails, joiner: "ExtrasJoiner") -> bytes:
        """The non-streamed answer, with what the engine server said beyond the text."""
        return joiner.into(self.body(text, finish_reason, usage), self.is_chat)

    def body(self, text: str, finish_reason: str | None, usage: UsageWithDetails,
             token_ids: list[int] | None = None) -> bytes:
        return _encode(CompletionResponse(id=self.request_id, created=self.created, model=self.model,
                                          choices=[self._choice(text, finish_reason, token_ids)], usage=usage))


class ChatShape:
    """`chat.completion` bodies and `chat.completion.chunk` chunks (/v1/chat/completions).
    `return_token_ids` (vLLM >= 0.10.2): each choice carries its token ids, and the prompt's
    ids (`prompt_token_ids`) come in the first chunk or the body."""

    skips_empty = True
    is_chat = True
    done = SSE_DONE

    def __init__(self, request_id: str, created: int, model: str, include_usage: bool = False,
                 return_token_ids: bool = False, prompt_token_ids: list[int] | None = None) -> None:
        self.request_id, self.created, self.model = request_id, created, model
        self.include_usage, self.return_token_ids = include_usage, return_token_ids
        self.prompt_token_ids = prompt_token_ids or []

    def _chunk(self, choices: list[ChatChunkChoice], usage: UsageWithDetails | None = None,
               prompt_token_ids: list[int] | None = None) -> bytes:
        if prompt_token_ids is not None:
            return sse(_encode(ChatCompletionChunkWithPromptIds(
                id=self.request_id, object="chat.completion.chunk", created=self.created, model=self.model,
                choices=choices, usage=usage, prompt_token_ids=prompt_token_ids)))
        return sse(_encode(ChatCompletionChunk(id=self.request_id, object="chat.completion.chunk", created=self.created,
                                               model=self.model, choices=choices, usage=usage)))

    def first(self) -> bytes:
        return self._chunk([ChatChunkChoice(delta=ChatDelta(role="assistant", content=""))],
                           prompt_token_ids=self.prompt_token_ids if self.return_token_ids else None)

    def chunk(self, text: str, finish_reason: str | None, token_ids: list[int] | None = None, extra: str = "") -> bytes:
        delta = ChatDelta(content=text) if text else ChatDelta()
        if self.return_token_ids:
            out = self._chunk([ChatChunkChoiceWithTokenIds(delta=delta, finish_reason=finish_reason,
                                                           token_ids=token_ids or [])])
        else:
            out = self._chunk([ChatChunkChoice(delta=delta, finish_reason=finish_reason)])
        return with_extra(out, extra, True) if extra else out

    def usage_chunk(self, usage: UsageWithDetails) -> bytes:
        return self._chunk([], usage)

    def error(self, code: str, message: str) -> bytes:
        return sse(error_body(code, message))

    def stopped_by(self, stop: str | None) -> None:
        """(Which stop string ended the output: OpenAI's answer does not say.)"""

    def whole(self, text: str, finish_reason: str | None, usage: UsageWithDetails, joiner: "ExtrasJoiner") -> bytes:
        """The non-streamed answer, with what the engine server said beyond the text."""
        return joiner.into(self.body(text, finish_reason, usage), self.is_chat)

    def body(self, text: str, finish_reason: str | None, usage: UsageWithDetails,
             token_ids: list[int] | None = None) -> bytes:
        message = ChatMessage(role="assistant", content=text)
        if self.return_token_ids:
            return _encode(ChatCompletionResponseWithPromptIds(
                id=self.request_id, created=self.created, model=self.model, usage=usage,
                choices=[ChatChoiceWithTokenIds(message=message, finish_reason=finish_reason, token_ids=token_ids or [])],
                prompt_token_ids=self.prompt_token_ids))
        return _encode(ChatCompletionResponse(id=self.request_id, created=self.created, model=self.model, usage=usage,
                                              choices=[ChatChoice(message=message, finish_reason=finish_reason)]))


# --------------------------------------------------------------------------- what FlexLB relays unchanged
# An engine server's chunk says more than FlexLB makes itself: a chat delta's `tool_calls`,
# `reasoning_content` / `reasoning`, `refusal`; a choice's `logprobs`, vLLM's `stop_reason`, a
# finish reason other than length or stop ("tool_calls"); the server's own fields
# (`system_fingerprint`, llama.cpp's `timings`, ...). The openai agent takes every such field
# whose value is not null, its JSON bytes as they came (`chunk_extras`), to the router with
# the chunk's tokens (TokensGenerated.extra); the router puts them into the client's chunk
# (`with_extra`) and, for a whole answer, joins them as the OpenAI SDKs join a stream's deltas
# (`ExtrasJoiner`). What FlexLB makes itself is not taken: the chunk's id, object, created,
# model, usage, prompt_token_ids; a choice's index, text, delta, token_ids, a finish reason
# length or stop; a delta's role and content.
MADE_CHUNK_FIELDS = frozenset({"id", "object", "created", "model", "choices", "usage", "prompt_token_ids", "error"})
MADE_CHOICE_FIELDS = frozenset({"index", "text", "delta", "token_ids", "finish_reason"})
MADE_DELTA_FIELDS = frozenset({"role", "content"})
MADE_FINISH_REASONS = frozenset({"length", "stop"})
MAX_EXTRA_BYTES = 256 * 1024  # a chunk's relayed fields beyond this fail the request (NATS's 1 MiB message)

_NULL = b"null"
_decode_raw_object = msgspec.json.Decoder(dict[str, msgspec.Raw]).decode
_decode_raw_list = msgspec.json.Decoder(list[dict[str, msgspec.Raw]]).decode
_decode_extra = msgspec.json.Decoder(dict[str, dict[str, msgspec.Raw]]).decode


class ExtraTooLarge(ValueError):
    pass


def _kept(obj: dict[str, msgspec.Raw], made: frozenset) -> dict[str, msgspec.Raw]:
    return {k: v for k, v in obj.items() if k not in made and bytes(v) != _NULL}


def chunk_extras(payload: bytes) -> dict[int, tuple[str, bool]]:
    """Choice index -> (the JSON text of what that choice's part of a streamed chunk (an SSE
    event's data) says beyond what FlexLB makes (module section above): {"delta": {...},
    "choice": {...}, "chunk": {...}}, each key only where it has fields; whether the choice's
    own part says anything, not only the chunk's). A choice with nothing is left out. Values are
    the server's bytes. Raises msgspec.DecodeError on a chunk that is not a JSON object,
    ExtraTooLarge past MAX_EXTRA_BYTES."""
    top = _decode_raw_object(payload)
    chunk_level = _kept(top, MADE_CHUNK_FIELDS)
    raw_choices = top.get("choices")
    out: dict[int, str] = {}
    choices = _decode_raw_list(raw_choices) if raw_choices is not None and bytes(raw_choices) != _NULL else []
    for position, choice in enumerate(choices):
        extra: dict[str, dict[str, msgspec.Raw]] = {}
        raw_delta = choice.get("delta")
        if raw_delta is not None and bytes(raw_delta) != _NULL:
            delta = _kept(_decode_raw_object(raw_delta), MADE_DELTA_FIELDS)
            if delta:
                extra["delta"] = delta
        kept = _kept(choice, MADE_CHOICE_FIELDS)
        reason = choice.get("finish_reason")
        if reason is not None and bytes(reason) != _NULL and msgspec.json.decode(reason) not in MADE_FINISH_REASONS:
            kept["finish_reason"] = reason
        if kept:
            extra["choice"] = kept
        own = bool(extra)
        if chunk_level:
            extra["chunk"] = chunk_level
        if not extra:
            continue
        text = _encode(extra)
        if len(text) > MAX_EXTRA_BYTES:
            raise ExtraTooLarge(f"a stream chunk's fields beyond its text are {len(text)} bytes, over the "
                                f"{MAX_EXTRA_BYTES}-byte limit")
        index = choice.get("index")
        out[msgspec.json.decode(index) if index is not None and bytes(index) != _NULL else position] = (text.decode(), own)
    return out


def with_extra(chunk_sse: bytes, extra: str, chat: bool) -> bytes:
    """A chunk FlexLB made (`sse(...)` of one choice) with the relayed fields of `extra` put in:
    into its delta (chat), its choice (a finish reason the server gave replaces FlexLB's), and
    the chunk itself; each value the server's bytes."""
    if not extra:
        return chunk_sse
    parts = _decode_extra(extra)
    body = msgspec.json.decode(chunk_sse[len(b"data: "):].rstrip(), type=dict[str, msgspec.Raw])
    choice = msgspec.json.decode(body["choices"], type=list[dict[str, msgspec.Raw]])[0]
    if chat and "delta" in parts:
        delta = msgspec.json.decode(choice["delta"], type=dict[str, msgspec.Raw])
        delta.update(parts["delta"])
        choice["delta"] = msgspec.Raw(_encode(delta))
    choice.update(parts.get("choice", {}))
    body["choices"] = msgspec.Raw(_encode([choice]))
    for key, value in parts.get("chunk", {}).items():
        body.setdefault(key, value)
    return sse(_encode(body))


class ExtrasJoiner:
    """A whole answer's relayed fields, joined from its chunks' as the OpenAI SDKs join a
    stream's deltas: a delta's strings (reasoning_content, refusal, ...) concatenated,
    `tool_calls` merged by their `index` (id and type set, the function's name and arguments
    concatenated); a choice's `logprobs` lists (chat's content and refusal, a completion's
    tokens, token_logprobs, top_logprobs, text_offset) concatenated; any other field: its last
    value. `into(body, chat)` puts them into the body FlexLB made."""

    __slots__ = ("delta", "choice", "chunk")

    def __init__(self) -> None:
        self.delta: dict = {}
        self.choice: dict = {}
        self.chunk: dict = {}

    def add(self, extra: str) -> None:
        if not extra:
            return
        parts = msgspec.json.decode(extra)
        for key, value in parts.get("delta", {}).items():
            if key == "tool_calls" and isinstance(value, list):
                self._tool_calls(value)
            elif isinstance(value, str) and isinstance(self.delta.get(key), str):
                self.delta[key] += value
            else:
                self.delta[key] = value
        for key, value in parts.get("choice", {}).items():
            old = self.choice.get(key)
            if key == "logprobs" and isinstance(value, dict) and isinstance(old, dict):
                for name, items in value.items():
                    if isinstance(items, list) and isinstance(old.get(name), list):
                        old[name] = old[name] + items
                    else:
                        old[name] = items
            else:
                self.choice[key] = value
        self.chunk.update(parts.get("chunk", {}))

    def _tool_calls(self, calls: list) -> None:
        joined = self.delta.setdefault("tool_calls", [])
        for call in calls:
            if not isinstance(call, dict):
                continue
            index = call.get("index", len(joined))
            into = next((c for c in joined if c.get("index") == index), None)
            if into is None:
                joined.append(into := {"index": index})
            for key, value in call.items():
                if key == "function" and isinstance(value, dict):
                    fn = into.setdefault("function", {})
                    for name, part in value.items():
                        fn[name] = fn[name] + part if isinstance(part, str) and isinstance(fn.get(name), str) else part
                elif key != "index":
                    into[key] = value

    def into(self, body: bytes, chat: bool) -> bytes:
        if not (self.delta or self.choice or self.chunk):
            return body
        out = msgspec.json.decode(body)
        choice = out["choices"][0]
        if chat and self.delta:
            message = choice["message"]
            message.update(self.delta)
            if "tool_calls" in self.delta:  # (a message's calls carry no stream index)
                message["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in self.delta["tool_calls"]]
            if "tool_calls" in self.delta and not message.get("content"):
                message["content"] = None  # (OpenAI's: a message that only calls tools has no content)
        choice.update(self.choice)
        for key, value in self.chunk.items():
            out.setdefault(key, value)
        return _encode(out)
