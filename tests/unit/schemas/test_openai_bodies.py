"""One home per response shape (schemas/openai_bodies.py): the router's answers and the sim
server's are built by the same classes, streams framed by schemas/http.py `sse` alone."""

from __future__ import annotations

import ast
import json

from schemas.openai_bodies import ChatShape, CompletionShape, usage_of
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
