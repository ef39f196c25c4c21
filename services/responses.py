"""OpenAI's Responses API (`POST /v1/responses`) over the router's chat path (issue 38, Build 4).

As /v1/messages (services/anthropic.py): the request is translated into a chat completion
(`to_chat`), goes through template, admission, fair queue, scheduling and the journal like any
chat request, and its answer is written back as a `response` object or the Responses stream
events (`ResponsesShape`).

Request: `input` (a string: one user message; or items: messages with `role` user, assistant,
system or developer (-> system) and text content or `input_text` / `output_text` parts;
`function_call` items -> the assistant's tool calls; `function_call_output` -> tool messages;
`reasoning` items are left out), `instructions` -> a first system message,
`max_output_tokens` -> max_tokens (absent: the router's limit, as on chat), `temperature`,
`top_p`, `stream`, `tools` (type function: name, description, parameters) and `tool_choice`
(auto, none, required, or a function), `parallel_tool_calls`, `text.format` json_schema or
json_object -> the engine's `response_format`, `metadata` and `user`; FlexLB's own fields as on
chat. Refused 400, naming the field: `previous_response_id` and `store: true` (FlexLB keeps no
responses: send the conversation in `input`), tools of another type, image or file parts,
`background`, and any other field of the Responses API this does not map.

Answer: the engine's reasoning -> a `reasoning` item (its text as `reasoning_text` content), the
text -> a `message` item with one `output_text` part, each tool call -> a `function_call` item
(`call_id` the engine's id); status `completed`, or `incomplete` with reason
`max_output_tokens` (finish reason length); usage input, output, total and cached tokens.
Streamed: `response.created`, `response.in_progress`, per item `response.output_item.added`,
its parts and deltas (`response.content_part.added`, `response.output_text.delta`,
`response.reasoning_text.delta`, `response.function_call_arguments.delta`) and their `.done`
events, `response.output_item.done`; then `response.completed` (or `response.incomplete`)
with the whole response; every event numbered (`sequence_number`). A failure after the start
is an `error` event.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from schemas.api import UsageWithDetails
from schemas.http import HttpError
from schemas.openai_bodies import ExtrasJoiner
from services.chat import decode_object

_encode = msgspec.json.Encoder().encode
_FLEXLB = ("request_id", "priority", "priority_class", "slo_ttft_ms", "slo_tpot_ms", "timeout_s", "ignore_eos")
_REFUSED = {"previous_response_id": "FlexLB keeps no responses: send the whole conversation in input",
            "background": "responses run in the foreground only", "conversation": "FlexLB keeps no conversations",
            "prompt": "stored prompts are not kept here"}
_NEUTRAL = {"store": (False,), "truncation": ("disabled",), "include": ([],), "service_tier": ("auto", "default"),
            "reasoning": ({},), "stream_options": ({},)}


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise HttpError("invalid_request", f"{where}: a string or a list of content parts")
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            out.append(part["text"])
        else:
            raise HttpError("invalid_request", f"{where}[{j}]: only text parts are supported, got {str(kind)[:40]!r}")
    return "".join(out)


def _messages(body: dict) -> list[dict]:
    out: list[dict] = []
    if body.get("instructions") is not None:
        out.append({"role": "system", "content": _text(body["instructions"], "instructions")})
    items = body.get("input")
    if isinstance(items, str):
        return out + [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise HttpError("invalid_request", "input: a string or a non-empty list of items is required")
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise HttpError("invalid_request", f"{where}: an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise HttpError("invalid_request", f"{where}.role: user, assistant, system or developer")
            out.append({"role": "system" if role == "developer" else role,
                        "content": _text(item.get("content", ""), f"{where}.content")})
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise HttpError("invalid_request", f"{where}: a function_call needs call_id, name and arguments")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            elif last is not None and last["role"] == "assistant":
                last["tool_calls"] = [call]
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise HttpError("invalid_request", f"{where}: a function_call_output needs its call_id")
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": _text(item.get("output", ""), f"{where}.output")})
        elif kind == "reasoning":
            continue
        else:
            raise HttpError("invalid_request", f"{where}: an item of type {str(kind)[:40]!r} is not supported "
                                               "(message, function_call, function_call_output, reasoning)")
    return out


def to_chat(raw: bytes) -> bytes:
    """A Responses request body -> the chat completion body the router parses (module docstring)."""
    body = decode_object(raw, "input")
    chat: dict[str, Any] = {"messages": _messages(body)}
    taken = {"input", "instructions", "max_output_tokens", "tools", "tool_choice", "text"}
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    for key in ("model", "temperature", "top_p", "stream", "parallel_tool_calls", "metadata", "user", *_FLEXLB):
        taken.add(key)
        if body.get(key) is not None:
            chat[key] = body[key]
    tools = body.get("tools")
    if tools:
        if not isinstance(tools, list):
            raise HttpError("invalid_request", "tools: a list")
        chat["tools"] = []
        for i, tool in enumerate(tools):
            if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("name"), str):
                kind = tool.get("type") if isinstance(tool, dict) else None
                raise HttpError("invalid_request", f"tools[{i}]: only function tools are supported, got {str(kind)[:40]!r}")
            fn = {"name": tool["name"], "parameters": tool.get("parameters") or {"type": "object"}}
            if isinstance(tool.get("description"), str):
                fn["description"] = tool["description"]
            chat["tools"].append({"type": "function", "function": fn})
    choice = body.get("tool_choice")
    if choice is not None:
        if choice in ("auto", "none", "required"):
            chat["tool_choice"] = choice
        elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
            chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
        else:
            raise HttpError("invalid_request", "tool_choice: auto, none, required or {\"type\": \"function\", \"name\"}")
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        chat["response_format"] = {"type": "json_schema", "json_schema": {
            k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}}
    elif isinstance(fmt, dict) and fmt.get("type") == "json_object":
        chat["response_format"] = {"type": "json_object"}
    for key, value in body.items():
        if key in taken or value is None:
            continue
        if key in _REFUSED:
            raise HttpError("invalid_request", f"{key}: not supported ({_REFUSED[key]})")
        if value in _NEUTRAL.get(key, ()):
            continue
        raise HttpError("invalid_request", f"{key[:40]}: not supported on /v1/responses"
                                           + (" at this value" if key in _NEUTRAL else ""))
    return _encode(chat)


class ResponsesShape:
    """The Responses API's events and response object (a shape as schemas/openai_bodies.py's).
    Keeps the output items as they grow: `response.completed` carries them whole."""

    skips_empty = True
    is_chat = True
    include_usage = True  # (the stream ends with the usage: response.completed)
    done = b""

    def __init__(self, request_id: str, model: str, num_prompt_tokens: int) -> None:
        self.id = "resp_" + request_id
        self.model = model
        self.created = int(time.time())
        self.num_prompt_tokens = num_prompt_tokens
        self.seq = 0
        self.items: list[dict] = []  # the output items so far
        self.open: dict | None = None  # the item receiving deltas
        self.tool_index: int | None = None  # the open function_call item's call index
        self.reason: str | None = None

    def _event(self, kind: str, data: dict) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **data}
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + _encode(data) + b"\n\n"

    def _response(self, status: str, usage: UsageWithDetails | None = None) -> dict:
        out: dict[str, Any] = {
            "id": self.id, "object": "response", "created_at": self.created, "status": status, "model": self.model,
            "output": self.items, "parallel_tool_calls": True, "tool_choice": "auto", "tools": [], "store": False,
            "error": None, "incomplete_details": None}
        if status == "incomplete":
            out["incomplete_details"] = {"reason": "max_output_tokens"}
        if usage is not None:
            details = usage.prompt_tokens_details
            out["usage"] = {"input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens,
                            "total_tokens": usage.total_tokens,
                            "input_tokens_details": {"cached_tokens": details.cached_tokens if details else 0},
                            "output_tokens_details": {"reasoning_tokens": 0}}
        return out

    def first(self) -> bytes:
        return (self._event("response.created", {"response": self._response("in_progress")})
                + self._event("response.in_progress", {"response": self._response("in_progress")}))

    def _add(self, item: dict) -> bytes:
        out = self._close()
        self.items.append(item)
        self.open = item
        index = len(self.items) - 1
        out += self._event("response.output_item.added", {"output_index": index, "item": item})
        if item["type"] == "message":
            out += self._event("response.content_part.added", {
                "item_id": item["id"], "output_index": index, "content_index": 0,
                "part": {"type": "output_text", "text": "", "annotations": []}})
            item["content"] = [{"type": "output_text", "text": "", "annotations": []}]
        elif item["type"] == "reasoning":
            item["content"] = [{"type": "reasoning_text", "text": ""}]
        return out

    def _close(self) -> bytes:
        item, self.open = self.open, None
        if item is None:
            return b""
        index = self.items.index(item)
        out = b""
        if item["type"] == "message":
            part = item["content"][0]
            out += self._event("response.output_text.done", {"item_id": item["id"], "output_index": index,
                                                             "content_index": 0, "text": part["text"], "logprobs": []})
            out += self._event("response.content_part.done", {"item_id": item["id"], "output_index": index,
                                                              "content_index": 0, "part": part})
        elif item["type"] == "reasoning":
            out += self._event("response.reasoning_text.done", {"item_id": item["id"], "output_index": index,
                                                                "content_index": 0, "text": item["content"][0]["text"]})
        elif item["type"] == "function_call":
            out += self._event("response.function_call_arguments.done", {
                "item_id": item["id"], "output_index": index, "arguments": item["arguments"]})
        item["status"] = "completed"
        return out + self._event("response.output_item.done", {"output_index": index, "item": item})

    def chunk(self, text: str, finish_reason: str | None, token_ids: list[int] | None = None, extra: str = "") -> bytes:
        out = b""
        parts = msgspec.json.decode(extra) if extra else {}
        delta = parts.get("delta", {})
        thinking = delta.get("reasoning_content") or delta.get("reasoning")
        n = len(self.items)
        if isinstance(thinking, str) and thinking:
            if self.open is None or self.open["type"] != "reasoning":
                out += self._add({"type": "reasoning", "id": f"rs_{self.id}_{n}", "summary": [], "status": "in_progress"})
            self.open["content"][0]["text"] += thinking
            out += self._event("response.reasoning_text.delta", {"item_id": self.open["id"], "output_index": len(self.items) - 1,
                                                                 "content_index": 0, "delta": thinking})
        if text:
            if self.open is None or self.open["type"] != "message":
                out += self._add({"type": "message", "id": f"msg_{self.id}_{len(self.items)}", "status": "in_progress",
                                  "role": "assistant"})
            self.open["content"][0]["text"] += text
            out += self._event("response.output_text.delta", {"item_id": self.open["id"], "output_index": len(self.items) - 1,
                                                              "content_index": 0, "delta": text, "logprobs": []})
        for call in delta.get("tool_calls") or ():
            if not isinstance(call, dict):
                continue
            fn = call.get("function") or {}
            index = call.get("index", 0)
            if self.open is None or self.open["type"] != "function_call" or self.tool_index != index:
                k = len(self.items)
                out += self._add({"type": "function_call", "id": f"fc_{self.id}_{k}",
                                  "call_id": call.get("id") or f"call_{self.id}_{k}", "name": fn.get("name", ""),
                                  "arguments": "", "status": "in_progress"})
                self.tool_index = index
            if fn.get("arguments"):
                self.open["arguments"] += fn["arguments"]
                out += self._event("response.function_call_arguments.delta", {
                    "item_id": self.open["id"], "output_index": len(self.items) - 1, "delta": fn["arguments"]})
        if finish_reason is not None:
            self.reason = finish_reason
        return out

    def stopped_by(self, stop: str | None) -> None:
        """(The Responses API does not say which stop string ended the output.)"""

    def usage_chunk(self, usage: UsageWithDetails) -> bytes:
        out = self._close()
        status = "incomplete" if self.reason == "length" else "completed"
        return out + self._event(f"response.{status}", {"response": self._response(status, usage)})

    def error(self, code: str, message: str) -> bytes:
        return self._event("error", {"code": code, "message": message, "param": None})

    def whole(self, text: str, finish_reason: str | None, usage: UsageWithDetails, joiner: ExtrasJoiner) -> bytes:
        thinking = joiner.delta.get("reasoning_content") or joiner.delta.get("reasoning")
        if isinstance(thinking, str) and thinking:
            self.items.append({"type": "reasoning", "id": f"rs_{self.id}_0", "summary": [], "status": "completed",
                               "content": [{"type": "reasoning_text", "text": thinking}]})
        if text:
            self.items.append({"type": "message", "id": f"msg_{self.id}_{len(self.items)}", "status": "completed",
                               "role": "assistant", "content": [{"type": "output_text", "text": text, "annotations": []}]})
        for call in joiner.delta.get("tool_calls") or ():
            fn = call.get("function") or {}
            k = len(self.items)
            self.items.append({"type": "function_call", "id": f"fc_{self.id}_{k}",
                               "call_id": call.get("id") or f"call_{self.id}_{k}", "name": fn.get("name", ""),
                               "arguments": fn.get("arguments", ""), "status": "completed"})
        status = "incomplete" if finish_reason == "length" else "completed"
        return _encode(self._response(status, usage))
