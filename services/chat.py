"""OpenAI request parsing and response shapes of the router's API: `/v1/chat/completions` and
`/v1/completions` (services/api.py moves the bytes; this module decides what they say).

Chat completions. A request's `messages` are rendered with the model's chat template
(schemas/chat_template.py, exactly as transformers' `apply_chat_template` renders them),
resolved at start as the engines resolve it: `--chat-template FILE`, else the tokenizer's
directory (`--tokenizer`): its `chat_template.jinja`, `chat_template.json`, or
`tokenizer_config.json`'s `chat_template`. With the default byte-level tokenizer and no
template, the built-in one (`DEFAULT_CHAT_TEMPLATE`), so `flexlb up` serves chat out of the
box; a Hugging Face tokenizer without a template answers chat requests 400, naming the
settings that would give one (as vLLM does: no guessed template). The rendered text is
encoded without special tokens (the template writes them, as `apply_chat_template(...,
tokenize=True)` does), and the router routes on those ids: a conversation's next turn
starts with the previous turn's rendering, so it hits the prefix cache that turn filled.
The request also travels as it came (`ChatForward`: messages, tools, tool_choice, the
template switches): an engine that renders chat itself (the openai agent's server) gets it
as chat; FlexLB's own engines run the ids.

Fields (schemas/api.py `ChatCompletionRequest`): `max_completion_tokens`, else `max_tokens`,
else `max_output_tokens` (the router's limit: like vLLM, a request without one may run to
the limit); `stop` (a string or up to 16 strings); `seed`, `temperature` (absent: greedy, as
on /v1/completions), `top_p`; `stream`, `stream_options.include_usage`; `tools` (to the
template, and to the server), `tool_choice` (to the server);
`add_generation_prompt` (default true), `continue_final_message`, `chat_template_kwargs`
(vLLM's extensions, to the template). For the engine only (`ENGINE_ONLY_FIELDS` at another
value than neutral: logprobs, top_logprobs, penalties, logit_bias, parallel_tool_calls, store,
metadata; a response_format other than text; any field FlexLB does not know, up to
MAX_EXTRA_FIELDS): taken out as they came (`ParsedChat.extra_body`, then ForEngine.extra_body),
so that only an engine server behind `--engine openai` runs the request, and FlexLB's own
engines refuse it 400 naming them (the scheduler's `engine_fields`). Refused 400
`invalid_request`, naming the field: `n` > 1; `stream_options` without `stream`; a message
part that is not text (images, audio: FlexLB's engines are text-only); `continue_final_message`
with `add_generation_prompt`. A template error (its `raise_exception`, a missing variable in a
strict template) is 400 with the template's message.

Stop strings, on both endpoints: the output text is cut before the first occurrence of any
`stop` string and the request ends there with finish_reason "stop" (the router cancels the
rest of its work; the worker's report of it counts as cancelled). Text that could be the
start of a stop string is held back until it is known not to be, so a stop string split
across chunks is still never sent. An engine server is given the strings too, and usually
stops first.

Response shapes: `chat.completion` (`message: {role: assistant, content}`) and
`chat.completion.chunk` (the first chunk's delta `{role: assistant, content: ""}`, then
`delta.content` chunks, the last with `finish_reason`; with `include_usage` one more chunk
with `choices: []` and `usage`; then `data: [DONE]`). Usage counts output tokens as the
engine reported them (up to the stop, where one cut the text) and carries
`prompt_tokens_details.cached_tokens` when the engine said how many prompt tokens it found
cached.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from schemas import messages as m
from schemas.api import (
    ChatCompletionRequest,
    UsageWithDetails,
)
from schemas.chat_template import ChatTemplateError, ChatTemplates, load_chat_templates, tool_arguments_as_objects
from schemas.http import HttpError
from schemas.openai_bodies import usage_of
from schemas.subjects import validate_token
from schemas.tokens import ByteTokenizer, HFTokenizer
from services.core.fairness import CLASSES

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024

_CHAT_DECODER = msgspec.json.Decoder(ChatCompletionRequest)


class _LaxChatRequest(ChatCompletionRequest, forbid_unknown_fields=False):
    """The chat body once its unknown fields are taken out for the engine (`decode_with_extra`)."""


_LAX_CHAT_DECODER = msgspec.json.Decoder(_LaxChatRequest)
_CHAT_FIELDS = frozenset(ChatCompletionRequest.__struct_fields__)
_decode_raw_fields = msgspec.json.Decoder(dict[str, msgspec.Raw]).decode
MAX_EXTRA_FIELDS = 32  # fields of a body FlexLB does not know, passed to the engine: at most this many ...
MAX_EXTRA_FIELD_NAME = 64  # ... with names this long (printable ASCII)


def decode_with_extra(body: bytes, strict: msgspec.json.Decoder, lax: msgspec.json.Decoder, known: frozenset[str],
                      settings, wants: str):
    """(request, its unknown top-level fields) of a body: decoded by `strict` (no unknown field:
    the usual case, one decode), else the fields not in `known` taken out (values not null, as
    JSON values) and the rest decoded by `lax`. An unknown field inside a known one stays an
    error (400 naming it)."""
    try:
        return decode_request(body, strict, settings, wants), {}
    except HttpError as exc:
        if "unknown field" not in exc.message or " - at `$." in exc.message:
            raise
    req = decode_request(body, lax, settings, wants)
    extra = {}
    for key, raw in _decode_raw_fields(body).items():
        if key in known or bytes(raw) == b"null":
            continue
        if len(key) > MAX_EXTRA_FIELD_NAME or not key.isascii() or not key.isprintable():
            raise HttpError("invalid_request", f"unknown field {key[:40]!r}: a field name of at most "
                                               f"{MAX_EXTRA_FIELD_NAME} printable ASCII characters is needed")
        extra[key] = msgspec.json.decode(raw)
        if len(extra) > MAX_EXTRA_FIELDS:
            raise HttpError("invalid_request", f"more than {MAX_EXTRA_FIELDS} fields this router does not know")
    return req, extra


MAX_MODEL_NAME_BYTES = 256  # a longer model name is refused (400)

def decode_request(body: bytes, decoder: msgspec.json.Decoder, settings, wants: str):
    """A request body decoded by `decoder`; HttpError invalid_request otherwise. `wants` says
    what an empty body lacks. (Its `model` picks a pool: the scheduler refuses one no worker
    serves, model_not_found.)"""
    if not body:
        raise HttpError("invalid_request", f"empty body; expected a JSON object with {wants}")
    try:
        req = decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise HttpError("invalid_request", f"invalid body: {exc}") from None
    except msgspec.DecodeError as exc:
        raise HttpError("invalid_request", f"invalid JSON: {exc}") from None
    except RecursionError:  # (msgspec's own bound on nesting, about 1,000 levels: a 400, not a 500 and a traceback)
        raise HttpError("invalid_request", "invalid JSON: nested too deeply") from None
    return req


_OBJECT_DECODER = msgspec.json.Decoder(dict)


def decode_object(body: bytes, wants: str) -> dict:
    """A body that must be a JSON object, with decode_request's errors (the APIs translated
    onto the chat path: services/anthropic.py, services/responses.py)."""
    return decode_request(body, _OBJECT_DECODER, None, wants)


def check_options(req, settings) -> None:
    """The FlexLB fields both endpoints share (request_id, priority, timeout_s, SLO targets)."""
    if req.request_id is not None:
        try:
            validate_token("request_id", req.request_id)
        except ValueError as exc:
            raise HttpError("invalid_request", str(exc)) from None
    if req.priority is not None and not 1 <= req.priority <= 100:
        raise HttpError("invalid_request", f"priority must be in 1..100, got {req.priority}")
    if req.priority_class is not None and req.priority_class not in CLASSES:
        raise HttpError("invalid_request", f"priority_class must be one of {', '.join(CLASSES)}, got {req.priority_class[:40]!r}")
    model = getattr(req, "model", None)
    if model is not None and (len(model.encode()) > MAX_MODEL_NAME_BYTES or any(c < " " or c == "\x7f" for c in model)):
        # (a model name becomes a metrics label, an event field and a log line: bounded, printable)
        raise HttpError("invalid_request", f"model must be at most {MAX_MODEL_NAME_BYTES} bytes without control "
                                           f"characters, got {model[:40]!r}")
    if req.timeout_s is not None and not (0 < req.timeout_s <= settings.request_timeout_s):
        raise HttpError("invalid_request", f"timeout_s must be in (0, {settings.request_timeout_s}], got {req.timeout_s}")
    for name in ("slo_ttft_ms", "slo_tpot_ms"):
        value = getattr(req, name)
        if value is not None and not (value > 0 and value < 1e9):
            raise HttpError("invalid_request", f"{name} must be a positive number of ms, got {value}")


def check_max_tokens(value, settings, name: str = "max_tokens") -> int:
    if isinstance(value, bool) or value < 1:
        raise HttpError("invalid_request", f"{name} must be >= 1, got {value}")
    if value > settings.max_output_tokens:
        raise HttpError("invalid_request", f"{name} {value} exceeds the limit of {settings.max_output_tokens}")
    return value


def stop_strings(value: str | list[str] | None) -> list[str]:
    """OpenAI's `stop`: a string or a list of them -> the list (validated)."""
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if len(stops) > MAX_STOP_STRINGS:
        raise HttpError("invalid_request", f"stop: at most {MAX_STOP_STRINGS} strings, got {len(stops)}")
    for s in stops:
        if not s or len(s) > MAX_STOP_CHARS:
            raise HttpError("invalid_request", f"stop: every string must have 1..{MAX_STOP_CHARS} characters")
    return list(dict.fromkeys(stops))


def sampling_of(req) -> m.Sampling | None:
    """The request's sampling for the engine; None: greedy (every field at its default)."""
    given = {k: v for k, v in (("temperature", req.temperature), ("top_p", req.top_p), ("seed", req.seed)) if v is not None}
    if req.ignore_eos:
        given["ignore_eos"] = True
    if not given:
        return None
    try:
        return msgspec.convert(given, m.Sampling)
    except msgspec.ValidationError as exc:
        raise HttpError("invalid_request", f"sampling: {exc}") from None


@dataclass
class ParsedChat:
    req: ChatCompletionRequest
    tokens: list[int]  # the rendered conversation's ids: what the router routes on and FlexLB's engines run
    max_tokens: int
    stop: list[str]
    chat: m.ChatForward
    sampling: m.Sampling | None
    include_usage: bool
    extra_body: dict  # fields for the engine only (ForEngine.extra_body); {}: none


# Known OpenAI fields FlexLB's own engines do not honour, and their neutral values: given at
# another value, each goes to the engine as it came (ForEngine.extra_body), so only an engine
# server that takes OpenAI bodies runs the request (the scheduler's `engine_fields`).
ENGINE_ONLY_FIELDS = (("logprobs", False), ("top_logprobs", None), ("presence_penalty", 0.0),
                      ("frequency_penalty", 0.0), ("logit_bias", None), ("parallel_tool_calls", None),
                      ("store", False), ("metadata", None))


def engine_only(req: ChatCompletionRequest) -> dict:
    """The request's engine-only fields (ENGINE_ONLY_FIELDS) not at their neutral value; a
    response_format other than text too."""
    out = {name: getattr(req, name) for name, neutral in ENGINE_ONLY_FIELDS if getattr(req, name) not in (neutral, None)}
    if req.response_format is not None and req.response_format.get("type", "text") != "text":
        out["response_format"] = req.response_format
    return out


def _refuse_unhonoured(req: ChatCompletionRequest) -> None:
    """Known OpenAI fields at a value no engine behind FlexLB is asked for: refused, naming the field."""
    if req.n != 1:
        raise HttpError("invalid_request", f"n: only one choice per request is supported, got {req.n}")
    if req.stream_options is not None:
        if not req.stream:
            raise HttpError("invalid_request", "stream_options: only with stream true")
        if req.stream_options.continuous_usage_stats:
            raise HttpError("invalid_request", "stream_options.continuous_usage_stats: not supported")
    if req.continue_final_message and req.add_generation_prompt:
        raise HttpError("invalid_request", "continue_final_message and add_generation_prompt cannot both be true "
                                            "(set add_generation_prompt false to continue the last message)")


def _check_messages(messages: list) -> None:
    if not messages:
        raise HttpError("invalid_request", "messages: at least one message is needed")
    for i, msg in enumerate(messages):
        role = msg.get("role")
        if not isinstance(role, str) or not role:
            raise HttpError("invalid_request", f"messages[{i}].role: a non-empty string is needed")
        content = msg.get("content")
        if content is None or isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise HttpError("invalid_request", f"messages[{i}].content: a string or a list of content parts")
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise HttpError("invalid_request", f"messages[{i}].content[{j}]: only text parts are supported, got {kind!r}")


def parse_chat(body: bytes, settings, tokenizer: ByteTokenizer | HFTokenizer,
               templates: ChatTemplates | None) -> ParsedChat:
    """Decode, validate and render a chat completion body; HttpError with a design code."""
    req, extra = decode_with_extra(body, _CHAT_DECODER, _LAX_CHAT_DECODER, _CHAT_FIELDS, settings, "messages")
    _refuse_unhonoured(req)
    extra.update(engine_only(req))
    _check_messages(req.messages)
    check_options(req, settings)
    if req.max_completion_tokens is not None:
        max_tokens = check_max_tokens(req.max_completion_tokens, settings, "max_completion_tokens")
    elif req.max_tokens is not None:
        max_tokens = check_max_tokens(req.max_tokens, settings)
    else:
        max_tokens = settings.max_output_tokens
    stop = stop_strings(req.stop)
    sampling = sampling_of(req)
    if templates is None:
        raise HttpError("invalid_request", f"no chat template for this router's tokenizer ({tokenizer.name}): start it "
                                            "with --chat-template FILE, or a --tokenizer directory that has one")
    try:
        text = templates.render(tool_arguments_as_objects(req.messages), tools=req.tools, add_generation_prompt=req.add_generation_prompt,
                                continue_final_message=req.continue_final_message,
                                chat_template_kwargs=req.chat_template_kwargs)
    except ChatTemplateError as exc:
        raise HttpError("invalid_request", f"chat template: {exc}") from None
    bound = tokenizer.max_chars_per_token
    if bound is not None and len(text) > settings.max_prompt_tokens * bound:
        raise HttpError("too_large", f"the rendered conversation of {len(text)} characters exceeds the limit of "
                                      f"{settings.max_prompt_tokens} tokens")
    tokens = tokenizer.encode(text, add_special_tokens=False)
    if not tokens:
        raise HttpError("invalid_request", "the rendered conversation is empty")
    if len(tokens) > settings.max_prompt_tokens:
        raise HttpError("too_large", f"the rendered conversation of {len(tokens)} tokens exceeds the limit of "
                                      f"{settings.max_prompt_tokens}")
    chat = m.ChatForward(messages=req.messages, tools=req.tools, tool_choice=req.tool_choice,
                         add_generation_prompt=req.add_generation_prompt,
                         continue_final_message=req.continue_final_message,
                         chat_template_kwargs=req.chat_template_kwargs)
    return ParsedChat(req, tokens, max_tokens, stop, chat, sampling,
                      include_usage=bool(req.stream_options and req.stream_options.include_usage), extra_body=extra)


class StopMatcher:
    """Cuts a stream's text before the first stop string (module docstring): `feed` returns
    the text that may go out now and whether a stop string was met; `flush` the held tail
    at the end of the stream."""

    __slots__ = ("stops", "hold", "pending", "matched")

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self.hold = max(len(s) for s in stops) - 1  # the longest tail that can be a stop string's start
        self.pending = ""
        self.matched: str | None = None  # the stop string that ended the text

    def feed(self, text: str) -> tuple[str, bool]:
        buf = self.pending + text if self.pending else text
        hits = [(i, s) for i, s in ((buf.find(s), s) for s in self.stops) if i >= 0]
        if hits:
            self.pending = ""
            first, self.matched = min(hits)
            return buf[:first], True
        keep = 0
        for k in range(min(self.hold, len(buf)), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self.stops):
                keep = k
                break
        self.pending = buf[len(buf) - keep:] if keep else ""
        return (buf[:len(buf) - keep] if keep else buf), False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


def resolve_chat_templates(settings, tokenizer: ByteTokenizer | HFTokenizer) -> ChatTemplates | None:
    """The router's chat templates (module docstring): `settings.chat_template`, else the
    tokenizer's directory's, else the built-in one for the byte tokenizer; None: chat
    requests are refused. A template file that cannot be read is a ValueError at start."""
    model_dir = settings.tokenizer if isinstance(tokenizer, HFTokenizer) else ""
    try:
        templates = load_chat_templates(settings.chat_template, model_dir)
    except ChatTemplateError as exc:
        raise ValueError(f"chat_template: {exc}") from None
    if templates is None and isinstance(tokenizer, ByteTokenizer):
        templates = ChatTemplates.builtin()
    return templates


class OutputCursor:
    """What a request's client has been given so far: its output tokens, the cached prompt
    tokens its engine reported (on the last chunk), and its text cut at a stop string."""

    __slots__ = ("stops", "num_tokens", "num_cached_tokens")

    def __init__(self, stops: list[str]) -> None:
        self.stops = StopMatcher(stops) if stops else None
        self.num_tokens = 0
        self.num_cached_tokens: int | None = None

    def take(self, chunk: m.TokensGenerated) -> tuple[str, str | None, bool]:
        """-> (the text that may go out now, the finish reason if the output ends here, whether
        a stop string ended it: the caller then cancels the rest of the work)."""
        self.num_tokens += chunk.num_chunk_tokens
        text, reason = chunk.text, chunk.finish_reason
        if reason is not None and chunk.num_cached_tokens is not None:
            self.num_cached_tokens = chunk.num_cached_tokens
        if self.stops is not None:
            text, hit = self.stops.feed(text)
            if hit:
                return text, "stop", True
            if reason is not None:
                text += self.stops.flush()
        return text, reason, False

    def usage(self, num_prompt_tokens: int) -> UsageWithDetails:
        return usage_of(num_prompt_tokens, self.num_tokens, self.num_cached_tokens)

    @property
    def stop_matched(self) -> str | None:
        """The stop string that ended the output (None: none did)."""
        return self.stops.matched if self.stops is not None else None

