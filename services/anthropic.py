"""Anthropic's Messages API (`POST /v1/messages`) over the router's chat path (issue 38, Build 4).

A Messages request is translated into a chat completion (`to_chat`) and goes the way every
chat request goes: template and tokens, admission, fair queue, scheduling, the journal, the
engine (an engine server behind `--engine openai` gets it as an OpenAI chat request). Its
answer is written back in Anthropic's shapes (`MessagesShape`), streamed as Anthropic's events
or whole.

Request, field by field:
- `system` (a string, or text blocks) -> a first `system` message;
- `messages`: a `user` message's text blocks -> its content; its `tool_result` blocks -> `tool`
  messages (`tool_call_id` = `tool_use_id`, the result's text); an `assistant` message's
  `tool_use` blocks -> its `tool_calls` (arguments: the `input` as JSON), `thinking` blocks
  are left out (what a model thought is not sent back to it); another block type (images,
  documents) is refused 400 naming it;
- `max_tokens` (required, as Anthropic requires it), `stop_sequences` -> `stop`,
  `temperature`, `top_p`, `stream`;
- `tools` ({name, description, input_schema}) -> functions; `tool_choice` auto / any / tool /
  none -> "auto" / "required" / that function / "none";
- `top_k`, `metadata`, and fields FlexLB does not know -> to the engine as they came (chat's
  pass-through: only an engine server behind `--engine openai` runs them; FlexLB's own
  engines refuse them, 400 naming them); FlexLB's own fields (`priority_class`, `slo_ttft_ms`,
  ...) as on chat.
The key: `x-api-key` (Anthropic's clients send it) or `Authorization: Bearer`.

Answer: text -> a `text` block, the engine's reasoning -> a `thinking` block before it, tool
calls -> `tool_use` blocks (`input` parsed from the arguments; arguments that are not JSON are
kept as {"arguments": "..."}); stop_reason `end_turn` (stop), `max_tokens` (length),
`stop_sequence` (a stop string ended it, `stop_sequence` naming it), `tool_use` (the model
called a tool); usage `input_tokens` (the prompt as the router rendered it) and
`output_tokens`, `cache_read_input_tokens` where the engine said how many were cached.
Streamed: `message_start`, then per block `content_block_start`, its deltas (`text_delta`,
`thinking_delta`, `input_json_delta`) and `content_block_stop`, then `message_delta` (stop
reason, output tokens) and `message_stop`; a failure after the start is an `error` event.
Errors before the answer starts are FlexLB's JSON errors with their HTTP status, which
Anthropic's SDKs raise by status (400 BadRequestError, 429 RateLimitError, ...).
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from schemas.api import UsageWithDetails
from schemas.http import HttpError
from schemas.openai_bodies import ExtrasJoiner
from services.chat import decode_object

_encode = msgspec.json.Encoder().encode
# Anthropic fields taken here (the rest go to the engine as they came, chat's pass-through)
_TAKEN = frozenset({"model", "messages", "system", "max_tokens", "stop_sequences", "temperature", "top_p", "stream",
                    "tools", "tool_choice"})
_FLEXLB = frozenset({"request_id", "priority", "priority_class", "slo_ttft_ms", "slo_tpot_ms", "timeout_s",
                     "ignore_eos"})
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def _text_of(content: Any, where: str) -> str:
    """A string, or the text of a list of text blocks."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise HttpError("invalid_request", f"{where}: a string or a list of content blocks")
    parts = []
    for j, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise HttpError("invalid_request", f"{where}[{j}]: only text blocks are supported here, got {str(kind)[:40]!r}")
        parts.append(block["text"])
    return "".join(parts)


def _messages(body: dict) -> list[dict]:
    out: list[dict] = []
    system = body.get("system")
    if system is not None:
        out.append({"role": "system", "content": _text_of(system, "system")})
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise HttpError("invalid_request", "messages: a non-empty list is required")
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or msg.get("role") not in ("user", "assistant"):
            raise HttpError("invalid_request", f"messages[{i}].role: user or assistant")
        role, content = msg["role"], msg.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise HttpError("invalid_request", f"messages[{i}].content: a string or a list of content blocks")
        text, calls = [], []
        for j, block in enumerate(content):
            kind = block.get("type") if isinstance(block, dict) else None
            where = f"messages[{i}].content[{j}]"
            if kind == "text" and isinstance(block.get("text"), str):
                text.append(block["text"])
            elif kind == "tool_use" and role == "assistant":
                if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                    raise HttpError("invalid_request", f"{where}: a tool_use block needs an id and a name")
                calls.append({"id": block["id"], "type": "function", "function": {
                    "name": block["name"], "arguments": json.dumps(block.get("input", {}))}})
            elif kind == "tool_result" and role == "user":
                if not isinstance(block.get("tool_use_id"), str):
                    raise HttpError("invalid_request", f"{where}: a tool_result block needs its tool_use_id")
                result = block.get("content", "")
                out.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                            "content": _text_of(result, f"{where}.content")})
            elif kind in ("thinking", "redacted_thinking") and role == "assistant":
                continue
            else:
                raise HttpError("invalid_request", f"{where}: a {str(kind)[:40]!r} block is not supported in a "
                                                   f"{role} message (text, tool_use, tool_result)")
        if text or calls or role == "assistant":
            msg_out: dict[str, Any] = {"role": role, "content": "".join(text) if text or not calls else None}
            if calls:
                msg_out["tool_calls"] = calls
            out.append(msg_out)
    return out


def _tools(tools: Any) -> list[dict]:
    if not isinstance(tools, list):
        raise HttpError("invalid_request", "tools: a list")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
            raise HttpError("invalid_request", f"tools[{i}]: a tool needs a name")
        fn = {"name": tool["name"], "parameters": tool.get("input_schema", {"type": "object"})}
        if isinstance(tool.get("description"), str):
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Any) -> Any:
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise HttpError("invalid_request", "tool_choice: {\"type\": auto | any | tool (with name) | none}")


def to_chat(raw: bytes) -> bytes:
    """A Messages request body -> the chat completion body the router parses (module docstring)."""
    body = decode_object(raw, "messages and max_tokens")
    max_tokens = body.get("max_tokens")
    if max_tokens is None:
        raise HttpError("invalid_request", "max_tokens: required")
    chat: dict[str, Any] = {"messages": _messages(body), "max_tokens": max_tokens}
    for key in ("model", "temperature", "top_p", "stream"):
        if body.get(key) is not None:
            chat[key] = body[key]
    if body.get("stop_sequences") is not None:
        chat["stop"] = body["stop_sequences"]
    if body.get("tools") is not None:
        chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    for key, value in body.items():  # FlexLB's own fields as on chat; the rest to the engine (chat's pass-through)
        if key not in _TAKEN and value is not None:
            chat[key] = value
    return _encode(chat)


def _event(kind: str, data: dict) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + _encode(data) + b"\n\n"


class MessagesShape:
    """Anthropic's message and stream events, made from what the chat path gives (a shape as
    schemas/openai_bodies.py's: `first`, `chunk`, `usage_chunk`, `done`, `error`, `whole`).
    Keeps the open content block of a stream."""

    skips_empty = True
    is_chat = True
    include_usage = True  # (the stream ends with the usage: message_delta)
    done = b""

    def __init__(self, request_id: str, model: str, num_prompt_tokens: int) -> None:
        self.id = "msg_" + request_id
        self.model = model
        self.num_prompt_tokens = num_prompt_tokens
        self.block = -1  # the open block's index (-1: none)
        self.block_kind = ""  # text | thinking | tool_use
        self.tool_index: int | None = None  # the open tool_use block's call index
        self.reason: str | None = None
        self.stop_sequence: str | None = None

    def first(self) -> bytes:
        return _event("message_start", {"type": "message_start", "message": {
            "id": self.id, "type": "message", "role": "assistant", "content": [], "model": self.model,
            "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": self.num_prompt_tokens, "output_tokens": 0}}})

    def _open(self, kind: str, block: dict) -> bytes:
        out = self._close()
        self.block += 1
        self.block_kind = kind
        return out + _event("content_block_start", {"type": "content_block_start", "index": self.block,
                                                    "content_block": block})

    def _close(self) -> bytes:
        if not self.block_kind:
            return b""
        self.block_kind = ""
        self.tool_index = None
        return _event("content_block_stop", {"type": "content_block_stop", "index": self.block})

    def _delta(self, delta: dict) -> bytes:
        return _event("content_block_delta", {"type": "content_block_delta", "index": self.block, "delta": delta})

    def chunk(self, text: str, finish_reason: str | None, token_ids: list[int] | None = None, extra: str = "") -> bytes:
        out = b""
        parts = msgspec.json.decode(extra) if extra else {}
        delta = parts.get("delta", {})
        thinking = delta.get("reasoning_content") or delta.get("reasoning")
        if isinstance(thinking, str) and thinking:
            if self.block_kind != "thinking":
                out += self._open("thinking", {"type": "thinking", "thinking": ""})
            out += self._delta({"type": "thinking_delta", "thinking": thinking})
        if text:
            if self.block_kind != "text":
                out += self._open("text", {"type": "text", "text": ""})
            out += self._delta({"type": "text_delta", "text": text})
        for call in delta.get("tool_calls") or ():
            if not isinstance(call, dict):
                continue
            fn = call.get("function") or {}
            index = call.get("index", 0)
            if self.block_kind != "tool_use" or self.tool_index != index:
                out += self._open("tool_use", {"type": "tool_use", "id": call.get("id") or f"toolu_{self.id}_{index}",
                                               "name": fn.get("name", ""), "input": {}})
                self.tool_index = index
            if fn.get("arguments"):
                out += self._delta({"type": "input_json_delta", "partial_json": fn["arguments"]})
        given = parts.get("choice", {}).get("finish_reason")
        if finish_reason is not None:
            self.reason = given if isinstance(given, str) else finish_reason
        return out

    def stopped_by(self, stop: str | None) -> None:
        """A stop string ended the output (the router's cursor): Anthropic's stop_sequence."""
        if stop is not None:
            self.reason, self.stop_sequence = "stop_sequence", stop

    def _stop_reason(self) -> str:
        if self.reason == "stop_sequence":
            return "stop_sequence"
        return STOP_REASONS.get(self.reason or "stop", "end_turn")

    def usage_chunk(self, usage: UsageWithDetails) -> bytes:
        return self._close() + _event("message_delta", {
            "type": "message_delta", "delta": {"stop_reason": self._stop_reason(), "stop_sequence": self.stop_sequence},
            "usage": {"output_tokens": usage.completion_tokens}}) + _event("message_stop", {"type": "message_stop"})

    def error(self, code: str, message: str) -> bytes:
        return _event("error", {"type": "error", "error": {"type": code, "message": message}})

    def whole(self, text: str, finish_reason: str | None, usage: UsageWithDetails, joiner: ExtrasJoiner) -> bytes:
        content: list[dict] = []
        thinking = joiner.delta.get("reasoning_content") or joiner.delta.get("reasoning")
        if isinstance(thinking, str) and thinking:
            content.append({"type": "thinking", "thinking": thinking, "signature": ""})
        if text:
            content.append({"type": "text", "text": text})
        for i, call in enumerate(joiner.delta.get("tool_calls") or ()):
            fn = call.get("function") or {}
            try:
                args = json.loads(fn.get("arguments") or "{}")
            except ValueError:
                args = {"arguments": fn.get("arguments")}
            content.append({"type": "tool_use", "id": call.get("id") or f"toolu_{self.id}_{i}",
                            "name": fn.get("name", ""), "input": args})
        given = joiner.choice.get("finish_reason")
        if self.reason != "stop_sequence":
            self.reason = given if isinstance(given, str) else finish_reason
        out_usage: dict[str, Any] = {"input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens}
        if usage.prompt_tokens_details is not None:
            out_usage["cache_read_input_tokens"] = usage.prompt_tokens_details.cached_tokens
        return _encode({"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                        "stop_reason": self._stop_reason(), "stop_sequence": self.stop_sequence, "usage": out_usage})
