"""Everything an engine server answers reaches the client, and what the client asks of it reaches
the server (issue 38, Build 3; schemas/openai_bodies.py "what FlexLB relays unchanged",
workers/openai/agent.py "Pass-through").

Story: a scripted server (`flexlb sim-server --canned-chunks`) answers every chat request with
a vLLM-style stream that has everything FlexLB does not make itself: a tool call whose
arguments arrive in pieces, reasoning, logprobs with floats as the server printed them, a
finish reason `tool_calls`, and fields of the server's own. Through `flexlb up --engine openai`
(real nats-server and redis-server), the client's chunks carry each of them byte for byte,
the official `openai` client's whole answer has them joined (the tool call's arguments whole),
and the fields the client sent that FlexLB does not use (logprobs, response_format, a vendor
extension) are in the body the server got. In front of FlexLB's own engines the same request
is refused 400, naming the fields.
"""

from __future__ import annotations

import json

import httpx
import msgspec
import pytest
from openai import BadRequestError, OpenAI

from services.infra import free_port
from tests.integration.stack import wait_for

# The scripted stream, one SSE event's data per line, as a server would write it.
CANNED = [
    b'{"id":"chatcmpl-9","object":"chat.completion.chunk","created":1,"model":"m","system_fingerprint":"fp_canned",'
    b'"choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}',
    b'{"id":"chatcmpl-9","object":"chat.completion.chunk","created":1,"model":"m","system_fingerprint":"fp_canned",'
    b'"choices":[{"index":0,"delta":{"reasoning_content":"The user wants weather."},"logprobs":null,"finish_reason":null}]}',
    b'{"id":"chatcmpl-9","object":"chat.completion.chunk","created":1,"model":"m","system_fingerprint":"fp_canned",'
    b'"choices":[{"index":0,"delta":{"content":"Checking."},"logprobs":{"content":[{"token":"Checking",'
    b'"logprob":-0.0312617,"bytes":[67],"top_logprobs":[{"token":"Checking","logprob":-0.0312617,"bytes":[67]}]}]},'
    b'"finish_reason":null}]}',
    b'{"id":"chatcmpl-9","object":"chat.completion.chunk","created":1,"model":"m","system_fingerprint":"fp_canned",'
    b'"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"call_7","type":"function","function":'
    b'{"name":"get_weather","arguments":"{\\"city\\": "}}]},"logprobs":null,"finish_reason":null}]}',
    b'{"id":"chatcmpl-9","object":"chat.completion.chunk","created":1,"model":"m","system_fingerprint":"fp_canned",'
    b'"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"\\"Paris\\"}"}}]},'
    b'"logprobs":null,"finish_reason":null}]}',
    b'{"id":"chatcmpl-9","object":"chat.completion.chunk","created":1,"model":"m","system_fingerprint":"fp_canned",'
    b'"choices":[{"index":0,"delta":{},"logprobs":null,"finish_reason":"tool_calls","stop_reason":null}],'
    b'"x_vendor_timings":{"predicted_ms":12.5}}',
    b'{"id":"chatcmpl-9","object":"chat.completion.chunk","created":1,"model":"m","choices":[],'
    b'"usage":{"prompt_tokens":9,"completion_tokens":6,"total_tokens":15}}',
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
ASK = {"model": "flexlb-sim", "messages": [{"role": "user", "content": "Weather in Paris?"}], "max_tokens": 32,
       "tools": TOOLS, "logprobs": True, "top_logprobs": 1, "response_format": {"type": "json_object"},
       "x_vendor_option": {"beam": [1, 2]}}


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def start_canned_server(spawn, tmp_path) -> str:
    """A `flexlb sim-server --canned-chunks` streaming CANNED, healthy: its URL."""
    canned = tmp_path / "canned.jsonl"
    canned.write_bytes(b"\n".join(CANNED) + b"\n")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    spawn("sim-server", "--port", str(port), "--worker-id", "s0", "--canned-chunks", str(canned), name="canned")
    wait_for(lambda: _healthy(url), 60, f"{url}/health")
    return url


def _events(raw: bytes) -> list[bytes]:
    return [e[len(b"data: "):] for e in raw.split(b"\n\n") if e.startswith(b"data: ") and e != b"data: [DONE]"]


def _raw(data: bytes) -> dict[str, bytes]:
    """Every field of one chunk's data, its chunk's, its choice's and its delta's, as written."""
    top = msgspec.json.decode(data, type=dict[str, msgspec.Raw])
    out = {k: bytes(v) for k, v in top.items() if k != "choices"}
    for choice in msgspec.json.decode(top["choices"], type=list[dict[str, msgspec.Raw]]):
        out.update((k, bytes(v)) for k, v in choice.items() if k != "delta")
        if "delta" in choice:
            out.update((k, bytes(v)) for k, v in msgspec.json.decode(choice["delta"], type=dict[str, msgspec.Raw]).items())
    return out


def test_what_the_server_answers_reaches_the_client_and_what_the_client_asks_reaches_the_server(flexlb_up, spawn,
                                                                                                  tmp_path):
    url = start_canned_server(spawn, tmp_path)
    _, state = flexlb_up("--engine", "openai", "--engine-url", url)
    router = state["router_url"]

    # Streamed: every event FlexLB sends carries the server's fields byte for byte.
    with httpx.Client(timeout=60) as http:
        r = http.post(router + "/v1/chat/completions", json={**ASK, "stream": True})
    assert r.status_code == 200, r.text
    got = _events(r.content)
    for key in ("reasoning_content", "logprobs", "tool_calls", "x_vendor_timings"):
        sent = [_raw(e)[key] for e in CANNED if _raw(e).get(key, b"null") != b"null"]
        relayed = [_raw(e)[key] for e in got if _raw(e).get(key, b"null") != b"null"]
        assert sent and relayed == sent, key
    # (a server's own field rides with every chunk that carries something of the server's)
    assert {_raw(e).get("system_fingerprint") for e in got[1:]} == {b'"fp_canned"'}
    ends = [json.loads(e)["choices"][0]["finish_reason"] for e in got if json.loads(e)["choices"]]
    assert ends[-1] == "tool_calls"
    assert all(json.loads(e)["id"] == json.loads(got[0])["id"] != "chatcmpl-9" for e in got)  # (FlexLB's own id)

    # The request's fields FlexLB does not use reached the server as the client sent them.
    received = httpx.get(url + "/_sim/requests", timeout=10).json()[-1]
    for key in ("logprobs", "top_logprobs", "response_format", "x_vendor_option", "tools"):
        assert received[key] == ASK[key], key
    assert received["stream"] is True  # (the agent's own fields stay the agent's)

    # Whole: the official client sees the answer joined, as it would from the server itself.
    client = OpenAI(base_url=router + "/v1", api_key="unused", timeout=60, max_retries=0)
    whole = client.chat.completions.create(**{k: v for k, v in ASK.items() if k not in ("model", "messages", "x_vendor_option")},
                                           model=ASK["model"], messages=ASK["messages"],
                                           extra_body={"x_vendor_option": ASK["x_vendor_option"]})
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert (call.id, call.function.name, json.loads(call.function.arguments)) == ("call_7", "get_weather", {"city": "Paris"})
    assert choice.message.content == "Checking."
    assert choice.message.model_extra["reasoning_content"] == "The user wants weather."
    assert [t.token for t in choice.logprobs.content] == ["Checking"]
    assert whole.system_fingerprint == "fp_canned"


def test_flexlbs_own_engines_refuse_what_they_do_not_honour_naming_the_fields(flexlb_up):
    _, state = flexlb_up("--workers", "1")
    client = OpenAI(base_url=state["router_url"] + "/v1", api_key="unused", timeout=60, max_retries=0)
    with pytest.raises(BadRequestError) as err:
        client.chat.completions.create(model="flexlb-sim", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       logprobs=True, extra_body={"x_vendor_option": 1})
    assert "logprobs, x_vendor_option" in str(err.value) and "--engine openai" in str(err.value)
    with pytest.raises(BadRequestError) as err:
        client.completions.create(model="flexlb-sim", prompt="hi", max_tokens=4, echo=True)
    assert "echo" in str(err.value)
    ok = client.chat.completions.create(model="flexlb-sim", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                        logprobs=False)  # (at its neutral value: nothing for the engine)
    assert ok.choices[0].message.content
