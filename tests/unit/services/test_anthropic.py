"""Anthropic's Messages API translated onto the chat path (services/anthropic.py): the request
into a chat completion, and the chat path's output back into Anthropic's events and message."""

from __future__ import annotations

import json

import msgspec
import pytest

from schemas.http import HttpError
from schemas.openai_bodies import ExtrasJoiner, usage_of
from services.anthropic import MessagesShape, to_chat


def chat_of(body: dict) -> dict:
    return json.loads(to_chat(json.dumps(body).encode()))


def test_a_messages_request_becomes_the_chat_request_it_means():
    chat = chat_of({
        "model": "m", "max_tokens": 9, "system": [{"type": "text", "text": "Be "}, {"type": "text", "text": "terse."}],
        "stop_sequences": ["END"], "temperature": 0.2, "top_k": 5, "priority_class": "critical",
        "tools": [{"name": "f", "description": "d", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "tool", "name": "f"},
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "..."}, {"type": "text", "text": "ok"},
                                              {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
                {"type": "text", "text": "42"}]}, {"type": "text", "text": "so?"}]},
        ]})
    assert chat["messages"] == [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "ok", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "42"},
        {"role": "user", "content": "so?"},
    ]
    assert (chat["max_tokens"], chat["stop"], chat["temperature"], chat["model"]) == (9, ["END"], 0.2, "m")
    assert chat["tools"] == [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"},
                                                                "description": "d"}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert chat["top_k"] == 5 and chat["priority_class"] == "critical"  # (to the engine; FlexLB's own, as on chat)
    assert chat_of({"max_tokens": 1, "messages": [{"role": "user", "content": "x"}],
                    "tool_choice": {"type": "any"}})["tool_choice"] == "required"


@pytest.mark.parametrize("body,needle", [
    ({"messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
    ({"max_tokens": 1, "messages": []}, "messages"),
    ({"max_tokens": 1, "messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
    ({"max_tokens": 1, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "'image'"),
    ({"max_tokens": 1, "messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "maybe"}}, "tool_choice"),
    ({"max_tokens": 1, "messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "f"}]}]},
     "not supported in a user message"),
])
def test_what_it_cannot_mean_is_refused_naming_the_field(body, needle):
    with pytest.raises(HttpError) as err:
        to_chat(json.dumps(body).encode())
    assert err.value.code == "invalid_request" and needle in err.value.message


def events(raw: bytes) -> list[dict]:
    return [json.loads(part.split(b"\ndata: ", 1)[1]) for part in raw.split(b"\n\n") if part]


def extra(**parts) -> str:
    return msgspec.json.encode(parts).decode()


def test_the_chat_paths_output_becomes_anthropics_events_and_message():
    shape = MessagesShape("r1", "m", 30)
    raw = shape.first()
    raw += shape.chunk("", None, extra=extra(delta={"reasoning_content": "hmm"}))
    raw += shape.chunk("Hello", None)
    raw += shape.chunk("", None, extra=extra(delta={"tool_calls": [{"index": 0, "id": "c1", "function": {
        "name": "f", "arguments": '{"a":'}}]}))
    raw += shape.chunk("", None, extra=extra(delta={"tool_calls": [{"index": 0, "function": {"arguments": " 1}"}}]}))
    raw += shape.chunk("", "stop", extra=extra(choice={"finish_reason": "tool_calls"}))
    raw += shape.usage_chunk(usage_of(30, 7, None))
    got = events(raw)
    assert [e["type"] for e in got] == [
        "message_start", "content_block_start", "content_block_delta", "content_block_stop", "content_block_start",
        "content_block_delta", "content_block_stop", "content_block_start", "content_block_delta",
        "content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    assert got[0]["message"]["usage"] == {"input_tokens": 30, "output_tokens": 0}
    assert [e["content_block"]["type"] for e in got if e["type"] == "content_block_start"] == ["thinking", "text", "tool_use"]
    assert "".join(e.get("delta", {}).get("partial_json", "") for e in got) == '{"a": 1}'
    assert got[-2]["delta"]["stop_reason"] == "tool_use" and got[-2]["usage"] == {"output_tokens": 7}
    j = ExtrasJoiner()
    j.add(extra(delta={"tool_calls": [{"index": 0, "id": "c1", "function": {"name": "f", "arguments": '{"a": 1}'}}]},
                choice={"finish_reason": "tool_calls"}))
    whole = json.loads(MessagesShape("r2", "m", 30).whole("Hi", "stop", usage_of(30, 7, 16), j))
    assert whole["content"] == [{"type": "text", "text": "Hi"}, {"type": "tool_use", "id": "c1", "name": "f", "input": {"a": 1}}]
    assert whole["stop_reason"] == "tool_use" and whole["id"] == "msg_r2"
    assert whole["usage"] == {"input_tokens": 30, "output_tokens": 7, "cache_read_input_tokens": 16}
    plain = json.loads(MessagesShape("r3", "m", 5).whole("Hi", "length", usage_of(5, 2, None), ExtrasJoiner()))
    assert plain["stop_reason"] == "max_tokens" and plain["content"] == [{"type": "text", "text": "Hi"}]
