"""OpenAI's Responses API on the router (`POST /v1/responses`, services/responses.py), driven by
the official `openai` client's `client.responses` on real stacks (nats-server, redis-server).

Story: on FlexLB's own engine, `responses.create` answers an input of messages and a function
round-trip, whole and streamed, the text the sim engine makes for that request; a response cut
by `max_output_tokens` is `incomplete`; what FlexLB cannot honour (a stored previous response)
is refused 400 naming it. In front of a scripted server (the relay test's canned stream), the
response has a reasoning item, the message and a function call whose arguments are joined, and
the streamed events end in `response.completed` with the same items.
"""

from __future__ import annotations

import json

import httpx
import pytest
from openai import BadRequestError, OpenAI

from tests.integration.stack import expected_text
from tests.integration.test_relay_passthrough import start_canned_server

TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather of a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]
INPUT = [
    {"role": "user", "content": "Weather in Paris?"},
    {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
    {"type": "function_call_output", "call_id": "call_1", "output": "Sunny, 21 C"},
    {"role": "user", "content": [{"type": "input_text", "text": "And tomorrow?"}]},
]


def client_of(url: str) -> OpenAI:
    return OpenAI(base_url=url + "/v1", api_key="unused", timeout=60, max_retries=0)


def test_the_openai_clients_responses_api_on_flexlbs_own_engine(flexlb_up):
    _, state = flexlb_up("--workers", "1")
    client = client_of(state["router_url"])
    whole = client.responses.create(model="flexlb-sim", instructions="Be terse.", input=INPUT, tools=TOOLS,
                                    max_output_tokens=12, extra_body={"request_id": "resp-whole-1"})
    assert whole.id == "resp_resp-whole-1" and whole.status == "incomplete"
    assert whole.incomplete_details.reason == "max_output_tokens"
    assert whole.output_text == expected_text("resp-whole-1", 12)
    assert whole.usage.output_tokens == 12 and whole.usage.input_tokens > 20
    events = list(client.responses.create(model="flexlb-sim", input="Hello", max_output_tokens=6, stream=True,
                                          extra_body={"request_id": "resp-stream-1"}))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == expected_text("resp-stream-1", 6)
    assert events[-1].response.output_text == expected_text("resp-stream-1", 6)
    with pytest.raises(BadRequestError) as err:
        client.responses.create(model="flexlb-sim", input="Hello", previous_response_id="resp_x")
    assert "previous_response_id" in str(err.value)


def test_reasoning_text_and_a_function_call_from_an_engine_server_reach_the_responses_client(flexlb_up, spawn, tmp_path):
    url = start_canned_server(spawn, tmp_path)
    _, state = flexlb_up("--engine", "openai", "--engine-url", url)
    client = client_of(state["router_url"])
    whole = client.responses.create(model="flexlb-sim", input="Weather in Paris?", tools=TOOLS)
    assert [item.type for item in whole.output] == ["reasoning", "message", "function_call"]
    assert whole.output[0].content[0].text == "The user wants weather." and whole.output_text == "Checking."
    call = whole.output[2]
    assert (call.call_id, call.name, json.loads(call.arguments)) == ("call_7", "get_weather", {"city": "Paris"})
    assert whole.status == "completed"
    events = list(client.responses.create(model="flexlb-sim", input="Weather in Paris?", tools=TOOLS, stream=True))
    assert events[-1].type == "response.completed"
    done = events[-1].response
    assert [item.type for item in done.output] == ["reasoning", "message", "function_call"]
    assert done.output[2].arguments == call.arguments
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == call.arguments
    sent = httpx.get(url + "/_sim/requests", timeout=10).json()[-1]  # what the server got: an OpenAI chat request
    assert sent["tools"][0]["function"]["name"] == "get_weather"
