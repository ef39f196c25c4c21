"""OpenAI's Responses API translated onto the chat path (services/responses.py)."""

from __future__ import annotations

import json

import pytest

from schemas.http import HttpError
from schemas.openai_bodies import usage_of
from services.responses import ResponsesShape, to_chat


def chat_of(body: dict) -> dict:
    return json.loads(to_chat(json.dumps(body).encode()))


def test_a_responses_request_becomes_the_chat_request_it_means():
    chat = chat_of({
        "model": "m", "instructions": "Be terse.", "max_output_tokens": 7, "temperature": 0.1, "store": False,
        "text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}, "strict": True}},
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
        "tool_choice": {"type": "function", "name": "f"}, "priority_class": "critical",
        "input": [{"role": "developer", "content": "Rules."}, {"role": "user", "content": "hi"},
                  {"type": "reasoning", "id": "rs_1", "summary": []},
                  {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                  {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "{\"a\":1}"},
                  {"type": "function_call_output", "call_id": "c1", "output": "one"},
                  {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "done"}]}]})
    assert chat["messages"] == [
        {"role": "system", "content": "Be terse."}, {"role": "system", "content": "Rules."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "f", "arguments": "{\"a\":1}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "assistant", "content": "done"}]
    assert (chat["max_tokens"], chat["temperature"], chat["priority_class"]) == (7, 0.1, "critical")
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object"},
                                                                               "strict": True}}
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert chat_of({"input": "hi"}) == {"messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("body,needle", [
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "x", "store": True}, "store"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "web_search"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input_image"),
    ({"input": "x", "frobnicate": 1}, "frobnicate"),
    ({"input": []}, "input"),
])
def test_what_it_cannot_honour_is_refused_naming_the_field(body, needle):
    with pytest.raises(HttpError) as err:
        to_chat(json.dumps(body).encode())
    assert err.value.code == "invalid_request" and needle in err.value.message


def test_the_stream_events_are_numbered_and_end_with_the_whole_response():
    shape = ResponsesShape("r1", "m", 10)
    raw = shape.first() + shape.chunk("Hi", None) + shape.chunk(" there", "stop") + shape.usage_chunk(usage_of(10, 2, 4))
    events = [json.loads(part.split(b"\ndata: ", 1)[1]) for part in raw.split(b"\n\n") if part]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    done = events[-1]["response"]
    assert done["output"][0]["content"][0]["text"] == "Hi there" and done["status"] == "completed"
    assert done["usage"]["input_tokens_details"] == {"cached_tokens": 4}
