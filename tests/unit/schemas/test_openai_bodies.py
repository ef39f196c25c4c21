"""One home per response shape (schemas/openai_bodies.py): the router's answers and the sim
server's are built by the same classes, streams framed by schemas/http.py `sse` alone."""

from __future__ import annotations

import ast
import json

import pytest

from schemas.openai_bodies import (
    MAX_EXTRA_BYTES,
    ChatShape,
    CompletionShape,
    ExtrasJoiner,
    ExtraTooLarge,
    chunk_extras,
    usage_of,
    with_extra,
)
from tests import REPO

BUILT_HERE = {"CompletionResponse", "CompletionChunk", "ChatCompletionResponse", "ChatCompletionChunk",
              "ChatCompletionResponseWithPromptIds", "ChatCompletionChunkWithPromptIds"}


def events(data: bytes) -> list[dict]:
    assert data.endswith(b"\n\n")
    return [json.loads(e.removeprefix(b"data: ")) for e in data.split(b"\n\n") if e]


def test_completion_chunks_carry_usage_only_on_the_usage_chunk():
    shape = CompletionShape("cmpl-1", 7, "m", include_usage=True)
    assert shape.first() == b""
    [chunk] = events(shape.chunk("ab", None))
    assert chunk == {"id": "cmpl-1", "object": "text_completion", "created": 7, "model": "m",
                     "choices": [{"index": 0, "text": "ab", "logprobs": None, "finish_reason": None}]}
    [last] = events(shape.usage_chunk(usage_of(3, 2, None)))
    assert last["choices"] == [] and last["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                                                       "prompt_tokens_details": None}
    body = json.loads(shape.body("ab", "length", usage_of(3, 2, 1)))
    assert body["choices"][0]["text"] == "ab" and body["usage"]["prompt_tokens_details"] == {"cached_tokens": 1}


def test_chat_opens_with_the_role_and_an_empty_delta_has_no_content():
    shape = ChatShape("chatcmpl-1", 7, "m", return_token_ids=True, prompt_token_ids=[5, 6])
    [first] = events(shape.first())
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""} and first["prompt_token_ids"] == [5, 6]
    [end] = events(shape.chunk("", "stop", []))
    assert end["choices"][0]["delta"] == {} and end["choices"][0]["finish_reason"] == "stop"
    assert "prompt_token_ids" not in end and end["choices"][0]["token_ids"] == []
    body = json.loads(shape.body("hi", "stop", usage_of(2, 1, None), [9]))
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "hi"} and body["prompt_token_ids"] == [5, 6]


def test_the_router_and_the_sim_server_use_the_same_shapes():
    from services import api
    from workers.sim_server import formats

    assert api.ChatShape is formats.ChatShape is ChatShape
    assert api.CompletionShape is formats.CompletionShape is CompletionShape


def test_no_response_body_is_built_anywhere_else():
    """The OpenAI response Structs are constructed in schemas/openai_bodies.py only."""
    bad = []
    for pkg in ("services", "workers", "schemas"):
        for path in (REPO / pkg).rglob("*.py"):
            if path.name == "openai_bodies.py":
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in BUILT_HERE:
                    bad.append(f"{path.relative_to(REPO)}:{node.lineno} {node.func.id}")
    assert not bad, bad


# --------------------------------------------------------------------------- relayed unchanged

# A vLLM-style chat chunk with everything FlexLB does not make: tool-call argument deltas,
# reasoning, logprobs (a float as the server printed it), a server field and vLLM's null stop_reason.
TOOL_CHUNK = (b'{"id":"chatcmpl-1","object":"chat.completion.chunk","created":7,"model":"m","system_fingerprint":"fp_9",'
              b'"choices":[{"index":0,"delta":{"reasoning_content":"think","tool_calls":[{"index":0,"id":"call_1",'
              b'"type":"function","function":{"name":"get_weather","arguments":"{\\"ci"}}]},'
              b'"logprobs":{"content":[{"token":"x","logprob":-0.313261657953262,"bytes":[120],"top_logprobs":[]}]},'
              b'"finish_reason":null,"stop_reason":null,"token_ids":[5]}]}')


def test_a_chunks_fields_beyond_its_text_are_taken_with_their_bytes_and_what_flexlb_makes_is_not():
    extra = json.loads(chunk_extras(TOOL_CHUNK)[0][0])
    assert set(extra) == {"delta", "choice", "chunk"}
    assert set(extra["delta"]) == {"reasoning_content", "tool_calls"}  # (not role, not content)
    assert set(extra["choice"]) == {"logprobs"}  # (null stop_reason left out; index, token_ids are FlexLB's)
    assert extra["chunk"] == {"system_fingerprint": "fp_9"}  # (id, created, model are FlexLB's)
    raw, own = chunk_extras(TOOL_CHUNK)[0]
    assert own
    assert '"logprob":-0.313261657953262' in raw and '"arguments":"{\\"ci"' in raw  # the server's bytes
    assert chunk_extras(b'{"choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}') == {}
    assert chunk_extras(b'{"choices":[{"index":0,"delta":{"content":"a"},"finish_reason":"stop"}]}') == {}
    # A server's own field alone: it rides with the chunk (which goes for its text), not on its own.
    assert chunk_extras(b'{"system_fingerprint":"fp","choices":[{"index":0,"delta":{"content":"a"}}]}') == {
        0: ('{"chunk":{"system_fingerprint":"fp"}}', False)}
    ended = json.loads(chunk_extras(b'{"choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}]}')[0][0])
    assert ended == {"choice": {"finish_reason": "tool_calls"}}  # a finish reason FlexLB does not make itself
    with pytest.raises(ExtraTooLarge):
        chunk_extras(b'{"choices":[{"index":0,"delta":{"reasoning_content":"' + b"x" * MAX_EXTRA_BYTES + b'"}}]}')


def test_the_clients_chunk_carries_them_unchanged_and_a_whole_answer_joins_them_as_the_sdks_do():
    shape = ChatShape("r1", 5, "flexlb-sim")
    out = with_extra(shape.chunk("", None), chunk_extras(TOOL_CHUNK)[0][0], True)
    assert out.startswith(b"data: ") and out.endswith(b"\n\n")
    body = json.loads(out[6:])
    sent = json.loads(TOOL_CHUNK)
    assert body["id"] == "r1" and body["model"] == "flexlb-sim" and body["system_fingerprint"] == "fp_9"
    assert body["choices"][0]["delta"]["tool_calls"] == sent["choices"][0]["delta"]["tool_calls"]
    assert b'"logprob":-0.313261657953262' in out
    j = ExtrasJoiner()
    j.add(chunk_extras(TOOL_CHUNK)[0][0])
    j.add(chunk_extras(b'{"choices":[{"index":0,"delta":{"reasoning_content":" more","tool_calls":[{"index":0,'
                       b'"function":{"arguments":"ty\\": \\"Paris\\"}"}}]},"logprobs":{"content":[{"token":"y",'
                       b'"logprob":-1.0}]},"finish_reason":"tool_calls"}]}')[0][0])
    whole = json.loads(j.into(shape.body("", "stop", usage_of(3, 2, None)), True))
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None and choice["message"]["reasoning_content"] == "think more"
    assert choice["message"]["tool_calls"] == [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}}]
    assert [t["token"] for t in choice["logprobs"]["content"]] == ["x", "y"]
    plain = shape.body("hi", "stop", usage_of(3, 2, None))
    assert ExtrasJoiner().into(plain, True) == plain  # nothing relayed: FlexLB's body as it was
