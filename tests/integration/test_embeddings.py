"""`POST /v1/embeddings` (issue 38, Build 4; services/embeddings.py): routed only to workers whose
engine server serves embeddings, the server's vectors returned byte for byte.

Story: two engine servers behind `flexlb up --engine openai` (real nats-server and
redis-server): `flexlb sim-server --embedding-dim 8` serves embeddings, a plain sim-server
does not. Each agent asks its server at start and says so (`/admin/workers`: signals.embeddings).
The official `openai` client's embeddings all come from the one that serves them (its vectors
are `sim_embedding` of the texts, exactly), in float and base64; `dimensions` and an unknown
field reach that server as they were sent. A stack of FlexLB's own engines refuses embeddings
400 saying no worker serves them; a bad body is 400 naming what is wrong.
"""

from __future__ import annotations

import base64
import struct

import httpx
import pytest
from openai import BadRequestError, OpenAI

from schemas.tokens import BYTE_TOKENIZER
from services.infra import free_port
from tests.integration.stack import wait_for
from workers.sim_server.http import sim_embedding


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _sim_server(spawn, name: str, *flags: str) -> str:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    spawn("sim-server", "--port", str(port), "--worker-id", name, "--time-scale", "0", *flags, name=name)
    wait_for(lambda: _healthy(url), 60, f"{url}/health")
    return url


def test_embeddings_go_to_the_server_that_serves_them_and_come_back_unchanged(flexlb_up, spawn):
    embedder = _sim_server(spawn, "emb", "--embedding-dim", "8")
    plain = _sim_server(spawn, "gen")
    _, state = flexlb_up("--engine", "openai", "--engine-url", embedder, "--engine-url", plain)
    router = state["router_url"]

    def signals() -> dict[str, bool]:
        workers = httpx.get(router + "/admin/workers", timeout=10).json()["workers"]
        return {w["id"]: (w.get("signals") or {}).get("embeddings") for w in workers}

    # (w0 in front of the first --engine-url, w1 the second)
    wait_for(lambda: signals() == {"w0": True, "w1": False}, 60, "both workers registered with their signals")
    client = OpenAI(base_url=router + "/v1", api_key="none", max_retries=0)
    texts = ["the quick brown fox", "jumps over", "the lazy dog"]
    for _ in range(3):  # every time to the one that serves them (the other has no embeddings)
        got = client.embeddings.create(model="flexlb-sim", input=texts)
        assert [d.index for d in got.data] == [0, 1, 2]
        for d, text in zip(got.data, texts):  # (the SDK asks for base64 and decodes float32s)
            assert d.embedding == pytest.approx(sim_embedding(BYTE_TOKENIZER.encode(text), 8), abs=1e-6)
        assert got.usage.prompt_tokens == sum(len(t) for t in texts)  # the server's count
        assert got.model == "flexlb-sim"
    one = client.embeddings.create(model="flexlb-sim", input="hello", encoding_format="base64", dimensions=4,
                                   extra_body={"x_vendor": {"pool": "mean"}})
    raw = httpx.post(router + "/v1/embeddings", json={"model": "flexlb-sim", "input": "hello",
                                                      "encoding_format": "base64"}, timeout=30).json()
    vector = list(struct.unpack("<8f", base64.b64decode(raw["data"][0]["embedding"])))
    assert vector == pytest.approx(sim_embedding(BYTE_TOKENIZER.encode("hello"), 8), abs=1e-6)
    # Floats as the server wrote them, byte for byte.
    ids = [[104, 101, 108, 108, 111], [104, 105]]  # ("hello", "hi" in the byte tokenizer)
    resp = httpx.post(router + "/v1/embeddings", json={"input": ids, "encoding_format": "float"}, timeout=30)
    direct = httpx.post(embedder + "/v1/embeddings", json={"input": ids}, timeout=30).json()
    assert resp.status_code == 200 and resp.json()["data"] == direct["data"]
    assert resp.json()["data"][0]["embedding"] == sim_embedding(BYTE_TOKENIZER.encode("hello"), 8)
    assert len(base64.b64decode(one.data[0].embedding)) == 4 * 4  # (asked for base64: the SDK leaves it so)
    sent = httpx.get(embedder + "/_sim/requests", timeout=10).json()
    asked = next(b for b in reversed(sent) if b.get("dimensions") == 4)
    assert asked["x_vendor"] == {"pool": "mean"} and asked["encoding_format"] == "base64" and asked["input"] == ["hello"]
    # The generation server got none of them; generations still run on either.
    assert httpx.get(plain + "/_sim/requests", timeout=10).json() == []
    out = client.completions.create(model="flexlb-sim", prompt="hi", max_tokens=3)
    assert out.choices[0].finish_reason == "length"
    # Bad bodies: 400 naming what is wrong, before any worker.
    for body, says in (({"input": []}, "input is empty"), ({"input": [""]}, "input[0] is empty"),
                       ({"input": ["a", 1]}, "input must be"), ({"input": "a", "stream": True}, "stream"),
                       ({"model": "flexlb-sim"}, "input")):
        resp = httpx.post(router + "/v1/embeddings", json=body, timeout=30)
        assert resp.status_code == 400 and says in resp.json()["error"]["message"], (body, resp.text)


def test_a_pool_of_flexlbs_own_engines_refuses_embeddings_saying_why(flexlb_up):
    _, state = flexlb_up("--workers", "1", "--time-scale", "0")
    client = OpenAI(base_url=state["router_url"] + "/v1", api_key="none", max_retries=0)
    with pytest.raises(BadRequestError) as exc:
        client.embeddings.create(model="flexlb-sim", input="hello")
    assert exc.value.status_code == 400 and "no live worker serves embeddings" in str(exc.value)
