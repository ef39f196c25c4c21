"""Anthropic's Messages API on the router (`POST /v1/messages`, services/anthropic.py), driven by
Anthropic's official client on real stacks (nats-server, redis-server).

Story: on FlexLB's own engine a conversation with a system prompt and a tool round-trip in its
history is answered, whole and streamed alike, with the key in `x-api-key`; a stop sequence
ends it as `stop_sequence`, naming it. In front of a scripted server (the relay test's canned
stream: reasoning, text, a tool call in pieces), the client's streamed events and its whole
message carry a thinking block, the text and a `tool_use` block whose input is the arguments
joined, and stop with `tool_use`.
"""

from __future__ import annotations

import json

import anthropic
import httpx

from tests.integration.stack import expected_text
from tests.integration.test_relay_passthrough import start_canned_server

KEY = "sk-ant-flexlb-test"
TOOLS = [{"name": "get_weather", "description": "Weather of a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": [{"type": "text", "text": "Checking."},
                                      {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                       "input": {"city": "Paris"}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny, 21 C"},
                                 {"type": "text", "text": "Thanks. And tomorrow?"}]},
]


def client_of(url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key=KEY, timeout=60, max_retries=0)


def test_the_anthropic_client_talks_to_flexlbs_own_engine_whole_and_streamed(flexlb_up):
    _, state = flexlb_up("--workers", "1", env={"FLEXLB_TENANT_API_KEYS": json.dumps({KEY: "acme"})})
    client = client_of(state["router_url"])
    whole = client.messages.create(model="flexlb-sim", max_tokens=12, system="You are terse.", messages=HISTORY,
                                   tools=TOOLS)
    assert whole.role == "assistant" and whole.stop_reason == "max_tokens"
    assert [b.type for b in whole.content] == ["text"] and whole.id.startswith("msg_")
    assert whole.content[0].text == expected_text(whole.id[len("msg_"):], 12)  # (the sim engine's text of that request)
    assert whole.usage.output_tokens == 12 and whole.usage.input_tokens > 20
    with client.messages.stream(model="flexlb-sim", max_tokens=12, system="You are terse.", messages=HISTORY,
                                tools=TOOLS) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_delta" in kinds
    assert streamed.content[0].text == expected_text(streamed.id[len("msg_"):], 12)
    assert streamed.stop_reason == "max_tokens" and streamed.usage.output_tokens == 12
    # A stop sequence (FlexLB's request_id passes as on chat, so the text is known before): cut there, and named.
    text = expected_text("anthropic-stop-1", 12)
    stop = text[3:5]
    cut = client.messages.create(model="flexlb-sim", max_tokens=12, system="You are terse.", messages=HISTORY,
                                 tools=TOOLS, stop_sequences=[stop], extra_body={"request_id": "anthropic-stop-1"})
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[:text.index(stop)]
    # Without the key: 401, as for every API route once keys are configured.
    anon = anthropic.Anthropic(base_url=state["router_url"], api_key="wrong", timeout=60, max_retries=0)
    try:
        anon.messages.create(model="flexlb-sim", max_tokens=4, messages=HISTORY[:1])
        raise AssertionError("a wrong key was accepted")
    except anthropic.AuthenticationError:
        pass


def test_thinking_text_and_a_tool_call_from_an_engine_server_reach_the_anthropic_client(flexlb_up, spawn, tmp_path):
    url = start_canned_server(spawn, tmp_path)
    _, state = flexlb_up("--engine", "openai", "--engine-url", url)
    client = client_of(state["router_url"])
    with client.messages.stream(model="flexlb-sim", max_tokens=32, messages=HISTORY[:1], tools=TOOLS) as stream:
        events = list(stream)
        final = stream.get_final_message()
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    assert starts == ["thinking", "text", "tool_use"]
    assert [b.type for b in final.content] == ["thinking", "text", "tool_use"]
    assert final.content[0].thinking == "The user wants weather." and final.content[1].text == "Checking."
    assert (final.content[2].id, final.content[2].name, final.content[2].input) == ("call_7", "get_weather", {"city": "Paris"})
    assert final.stop_reason == "tool_use"
    whole = client.messages.create(model="flexlb-sim", max_tokens=32, messages=HISTORY[:1], tools=TOOLS)
    assert [b.type for b in whole.content] == ["thinking", "text", "tool_use"] and whole.stop_reason == "tool_use"
    assert whole.content[2].input == {"city": "Paris"}
    sent = httpx.get(url + "/_sim/requests", timeout=10).json()[-1]  # what the server got: an OpenAI chat request
    assert sent["tools"][0]["function"]["name"] == "get_weather" and sent["messages"][0]["content"] == "Weather in Paris?"
