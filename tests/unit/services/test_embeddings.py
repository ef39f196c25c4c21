"""services/embeddings.py: what POST /v1/embeddings accepts (every form OpenAI has, bounded) and
how the server's items are joined into the client's body."""

from __future__ import annotations

import json

import pytest

from schemas.http import HttpError
from schemas.tokens import BYTE_TOKENIZER
from services.embeddings import MAX_INPUTS, EmbeddingsAnswer, parse_embeddings
from services.settings import RouterSettings

SETTINGS = RouterSettings(max_prompt_tokens=64)


def parse(body: dict):
    return parse_embeddings(json.dumps(body).encode(), SETTINGS, BYTE_TOKENIZER)


@pytest.mark.parametrize("value, inputs, tokens", [
    ("hi", ["hi"], [104, 105]),
    (["hi", "a"], ["hi", "a"], [104, 105, 97]),
    ([1, 2, 3], [[1, 2, 3]], [1, 2, 3]),
    ([[1, 2], [3]], [[1, 2], [3]], [1, 2, 3]),
])
def test_the_four_input_forms_become_a_list_of_inputs_and_the_routers_tokens(value, inputs, tokens):
    req, got_tokens, forward, extra = parse({"input": value, "model": "m"})
    assert forward.input == inputs and got_tokens == tokens and extra == {} and req.model == "m"


def test_fields_for_the_server_travel_apart_and_flexlbs_own_are_read():
    req, _, _, extra = parse({"input": "x", "encoding_format": "base64", "dimensions": 4, "user": "u",
                              "priority": 70, "request_id": "e-1"})
    assert extra == {"encoding_format": "base64", "dimensions": 4, "user": "u"}
    assert req.priority == 70 and req.request_id == "e-1"


@pytest.mark.parametrize("body, code, says", [
    ({"input": []}, "invalid_request", "input is empty"),
    ({"input": ["a", ""]}, "invalid_request", "input[1] is empty"),
    ({"input": [[]]}, "invalid_request", "input[0] is empty"),
    ({"input": ["a", [1]]}, "invalid_request", "input must be"),
    ({"input": [-1]}, "invalid_request", "token ids must be in"),
    ({"input": ["a"] * (MAX_INPUTS + 1)}, "invalid_request", f"at most {MAX_INPUTS} inputs"),
    ({"input": "x" * 65}, "too_large", "the limit of 64"),
    ({"input": ["x" * 40, "y" * 40]}, "too_large", "exceed the limit of 64"),
    ({"input": "x", "stream": True}, "invalid_request", "not streamed"),
    ({"input": "x", "slo_tpot_ms": 50}, "invalid_request", "no output tokens"),
    ({"input": "x", "priority": 0}, "invalid_request", "priority must be in"),
    ({"model": "m"}, "invalid_request", "input"),
])
def test_what_cannot_be_served_is_400_or_413_naming_it(body, code, says):
    with pytest.raises(HttpError) as exc:
        parse(body)
    assert exc.value.code == code and says in exc.value.message


def test_the_servers_items_are_joined_byte_for_byte_with_its_usage_or_the_routers_count():
    answer = EmbeddingsAnswer("m", 7)
    answer.add('{"data":{"object":"embedding","index":0,"embedding":[0.1000,-2e-3]}}')
    answer.add('{"data":{"object":"embedding","index":1,"embedding":"AAAA"}}')
    assert json.loads(answer.body())["usage"] == {"prompt_tokens": 7, "total_tokens": 7}
    assert b'[0.1000,-2e-3]' in answer.body()  # (as the server wrote the numbers)
    answer.add('{"usage":{"prompt_tokens":9,"total_tokens":9}}')
    body = json.loads(answer.body())
    assert body["object"] == "list" and body["model"] == "m" and [d["index"] for d in body["data"]] == [0, 1]
    assert body["usage"] == {"prompt_tokens": 9, "total_tokens": 9}
