"""llama.cpp's own `llama-server` under FlexLB (issue 38, first part; services/llamacpp.py): the
first engine in these tests that this project did not write. `flexlb up --engine llamacpp`
builds (or finds) the server, makes its tiny model, starts the servers and an openai agent in
front of each; the official OpenAI client streams through the router. Skipped only where the
server cannot be built (no cmake or C++ compiler); the first build takes minutes, then it is
cached (~/.cache/flexlb/llama.cpp)."""

from __future__ import annotations

import httpx
import pytest

from services import llamacpp as lc

pytestmark = pytest.mark.timeout(2400)  # (a first build of llama-server, then seconds)


@pytest.fixture(scope="module")
def llama_server() -> str:
    found = lc.find_server()
    if found:
        return found
    lacking = lc.can_build()
    if lacking:
        pytest.skip(f"llama-server cannot be built on this machine: {lacking}")
    return lc.build_server()


def test_flexlb_up_engine_llamacpp_serves_the_openai_client_and_keeps_a_conversation_on_its_server(llama_server,
                                                                                                   flexlb_up):
    from openai import OpenAI

    _, state = flexlb_up("--engine", "llamacpp", "--workers", "2")
    url = state["router_url"]
    llama = [s for s in state["servers"] if s["name"].startswith("llama-server-")]
    assert len(llama) == 2 and all("--metrics" in s["argv"] and "--jinja" in s["argv"] for s in llama)
    workers = httpx.get(url + "/admin/workers", timeout=10).json()["workers"]
    assert {w["model"] for w in workers} == {"flexlb-tiny"} and all(w["engine"] == "openai" and w["live"] for w in workers)
    assert {w["signals"]["metrics"] for w in workers} == {"llamacpp"}  # its /metrics understood as load signals
    for s in llama:  # llama.cpp itself answers behind them
        assert httpx.get(s["url"] + "/health", timeout=5).json()["status"] == "ok"
    client = OpenAI(base_url=url + "/v1", api_key="-", max_retries=0)
    chunks = list(client.chat.completions.create(
        model="flexlb-tiny", messages=[{"role": "user", "content": "hello there"}], max_tokens=6, stream=True))
    assert chunks and chunks[-1].choices[0].finish_reason == "length"
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) >= 1
    text = client.completions.create(model="flexlb-tiny", prompt="the quick brown fox", max_tokens=4)
    assert text.choices[0].finish_reason == "length" and text.usage.completion_tokens == 4
    # Two turns of one conversation: the second's prompt holds the first's, so it goes where
    # that prefix is cached (the approximate index: llama-server publishes no KV events).
    history = [{"role": "user", "content": "the quick brown fox jumps over the lazy dog " * 20}]
    first = client.chat.completions.with_raw_response.create(model="flexlb-tiny", messages=history, max_tokens=4)
    history += [{"role": "assistant", "content": first.parse().choices[0].message.content or "ok"},
                {"role": "user", "content": "and then?"}]
    second = client.chat.completions.with_raw_response.create(model="flexlb-tiny", messages=history, max_tokens=4)
    placed = [httpx.get(url + f"/admin/requests/{r.headers['x-request-id']}", timeout=10).json()["admission"]
              ["prefill_worker_id"] for r in (first, second)]
    assert placed[0] == placed[1], placed
    # ... and llama.cpp says it found the first turn's prompt in its cache (its usage, relayed).
    assert second.parse().usage.prompt_tokens_details.cached_tokens > 0
    # Fields only an engine server honours reach llama.cpp, and what it answers reaches the client.
    streamed = list(client.chat.completions.create(
        model="flexlb-tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=3, stream=True,
        logprobs=True, top_logprobs=2))
    tops = [t.top_logprobs for c in streamed if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert tops and all(len(t) == 2 for t in tops)
    assert {c.system_fingerprint for c in streamed[1:]} == {streamed[-1].system_fingerprint} != {None}
    # Anthropic's client and the Responses API, over the same chat path, on llama.cpp.
    import anthropic

    claude = anthropic.Anthropic(base_url=url, api_key="-", max_retries=0, timeout=60)
    with claude.messages.stream(model="flexlb-tiny", max_tokens=5, system="Be brief.",
                                messages=[{"role": "user", "content": "hello"}]) as stream:
        kinds = [e.type for e in stream]
        message = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 5
    response = client.responses.create(model="flexlb-tiny", input="hello", max_output_tokens=5)
    assert response.status == "incomplete" and response.usage.output_tokens == 5 and response.output[0].type == "message"


def test_a_gguf_file_of_ones_own_and_arguments_for_its_servers(llama_server, flexlb_up, tmp_path):
    """The README's example: `--gguf FILE` (here a copy of the generated model under another
    name: its servers serve it under that name) and `--llama-server-arg` reach every server."""
    import shutil

    mine = tmp_path / "my-model.gguf"
    shutil.copy(lc.tiny_model(), mine)
    _, state = flexlb_up("--engine", "llamacpp", "--workers", "1", "--gguf", str(mine),
                         "--llama-server-arg=--threads", "--llama-server-arg=1")
    (server,) = [s for s in state["servers"] if s["name"].startswith("llama-server-")]
    assert server["argv"][server["argv"].index("-m") + 1] == str(mine) and server["argv"][-2:] == ["--threads", "1"]
    r = httpx.post(state["router_url"] + "/v1/completions", json={"model": "my-model", "prompt": "hello", "max_tokens": 3},
                   timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text


def test_one_llama_server_killed_under_load_every_request_ends_and_the_other_serves_on(llama_server, flexlb_up):
    """Issue 36's rules with a server of someone else's: a llama-server streams text without token
    ids, so a request it was streaming cannot migrate: it fails with a retryable code that
    says so, never hangs; one not yet started there is retried on the other server; and what
    comes after the kill is served by the server left."""
    import asyncio
    import os
    import signal
    import time

    from tests.integration.stack import run_concurrent_streams, wait_for

    _, state = flexlb_up("--engine", "llamacpp", "--workers", "2")
    url = state["router_url"]
    victim = next(s for s in state["servers"] if s["name"] == "llama-server-0")
    bodies = [{"model": "flexlb-tiny", "prompt": f"request {i}: the quick brown fox jumps over the lazy dog",
               "max_tokens": 1000, "ignore_eos": True} for i in range(24)]

    async def load_then_kill() -> list[dict]:
        streams = asyncio.ensure_future(run_concurrent_streams(url, bodies))
        await asyncio.sleep(0.5)  # (some streaming, some queued at each server)
        os.kill(victim["pid"], signal.SIGKILL)
        return await asyncio.wait_for(streams, 300)

    started = time.monotonic()
    results = asyncio.run(load_then_kill())
    assert time.monotonic() - started < 300  # (every request ended: none hangs on the dead server)
    whole = [r for r in results if r["finish_reason"] == "length" and not r["errors"]]
    failed = [r for r in results if r["errors"]]
    assert len(whole) + len(failed) == len(bodies), results
    assert whole, "the server left served nothing"
    parallel = int(victim["argv"][victim["argv"].index("--parallel") + 1])
    assert len(failed) <= parallel  # (only what the dead server was streaming: its slots)
    for r in failed:  # a stream cut mid-way: retryable, and it says why it could not go on elsewhere
        error = r["errors"][0]
        assert isinstance(error, dict) and error["retryable"], r
        assert error["code"] == "upstream_error" and "not migrated" in error["message"] and "without token ids" in error["message"]
    metrics = httpx.get(url + "/metrics", timeout=10).text
    retried = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines() if line.startswith("flexlb_retries_total"))
    assert failed or retried > 0, "the kill touched no request: nothing shown"
    # Afterwards the router knows: the dead server's worker is not ready, and saying why; the other serves.
    def dead_known() -> bool:
        workers = httpx.get(url + "/admin/workers", timeout=10).json()["workers"]
        return any(w["reported_state"] == "not_ready" and victim["url"] in (w["not_ready_reason"] or "") for w in workers)

    wait_for(dead_known, 60, "the router to see the killed llama-server's worker not ready")
    after = asyncio.run(run_concurrent_streams(url, bodies[:6]))
    assert all(r["finish_reason"] == "length" and not r["errors"] for r in after), after


def test_a_client_that_leaves_stops_the_work_at_llama_server(llama_server, flexlb_up):
    """Abort on cancel: the client closes its stream; the router cancels the request, the agent
    closes its upstream stream, and llama.cpp stops decoding it (its /slots say no slot is
    processing, and its count of tokens predicted is short of the 3,000 asked)."""
    import time

    from tests.integration.stack import wait_for

    _, state = flexlb_up("--engine", "llamacpp", "--workers", "1")
    url = state["router_url"]
    (server,) = [s for s in state["servers"] if s["name"].startswith("llama-server-")]
    body = {"model": "flexlb-tiny", "prompt": "the quick brown fox", "max_tokens": 3000, "ignore_eos": True,
            "stream": True}
    with httpx.Client(timeout=60) as client, client.stream("POST", url + "/v1/completions", json=body) as resp:
        rid = resp.headers["x-request-id"]
        lines = resp.iter_lines()
        got = [line for line, _ in zip(lines, range(5))]  # a few chunks, then the client goes
        assert len(got) == 5
        assert any(s["is_processing"] for s in httpx.get(server["url"] + "/slots", timeout=5).json())
    left = time.monotonic()

    def idle() -> bool:
        return not any(s["is_processing"] for s in httpx.get(server["url"] + "/slots", timeout=5).json())

    wait_for(idle, 30, "llama-server to stop decoding the request whose client left")
    predicted = next(float(line.split()[-1]) for line in httpx.get(server["url"] + "/metrics", timeout=5).text.splitlines()
                     if line.startswith("llamacpp:tokens_predicted_total"))
    assert predicted < 3000, predicted  # (stopped, not run to its end: llama.cpp's own count)
    record = httpx.get(url + f"/admin/requests/{rid}", timeout=10).json()
    assert time.monotonic() - left < 30
    assert [e["event"] for e in record["timeline"]][-1] == "request.cancelled", record["timeline"]


def test_embeddings_from_llama_server_have_the_models_dimension(llama_server, flexlb_up):
    """POST /v1/embeddings through FlexLB to llama-servers started with `--embeddings` (and a
    pooling OpenAI's API takes): the agent finds that its server serves them (/admin/workers),
    the official client's vectors have the model's embedding width (the gguf's
    `llama.embedding_length`), one per input, and generation still runs on the same servers."""
    from openai import OpenAI

    _, state = flexlb_up("--engine", "llamacpp", "--workers", "1", "--llama-server-arg=--embeddings",
                         "--llama-server-arg=--pooling", "--llama-server-arg=mean")
    router = state["router_url"]
    workers = httpx.get(router + "/admin/workers", timeout=10).json()["workers"]
    assert [w["signals"]["embeddings"] for w in workers] == [True]
    import gguf

    width = gguf.GGUFReader(lc.tiny_model()).fields["llama.embedding_length"].contents()
    client = OpenAI(base_url=router + "/v1", api_key="none", max_retries=0)
    got = client.embeddings.create(model="flexlb-tiny", input=["the first text", "a second, longer text to embed"])
    assert [len(d.embedding) for d in got.data] == [width, width] and [d.index for d in got.data] == [0, 1]
    assert got.usage.prompt_tokens > 0
    raw = httpx.post(router + "/v1/embeddings", json={"model": "flexlb-tiny", "input": "hello"}, timeout=60)
    assert raw.status_code == 200 and len(raw.json()["data"][0]["embedding"]) == width, raw.text
    out = client.chat.completions.create(model="flexlb-tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert out.usage.completion_tokens == 4


def test_a_text_completion_is_tokenized_by_llama_server_itself(llama_server, flexlb_up):
    """Without the model's tokenizer at the router (`--tokenizer`), `flexlb up --engine llamacpp`
    has its agents send a text completion's text (`--engine-prompt text`), so the server runs
    its own model's tokens, not the router's byte ids: the prompt tokens it processed are its
    own /tokenize count of the text, fewer than the text's bytes (the model's BPE merges)."""
    _, state = flexlb_up("--engine", "llamacpp", "--workers", "1")
    (server,) = [s["url"] for s in state["servers"] if s["name"].startswith("llama-server-")]
    text = "the theory of the thing is that the other three are there then " * 4

    def processed() -> float:
        metrics = httpx.get(server + "/metrics", timeout=10).text
        return sum(float(line.split()[-1]) for line in metrics.splitlines()
                   if line.startswith("llamacpp:prompt_tokens_total"))

    own = httpx.post(server + "/tokenize", json={"content": text, "add_special": True}, timeout=30).json()["tokens"]
    assert len(own) < len(text.encode())  # (else this test could not tell the two apart)
    before = processed()
    r = httpx.post(state["router_url"] + "/v1/completions", json={"model": "flexlb-tiny", "prompt": text, "max_tokens": 2},
                   timeout=60)
    assert r.status_code == 200, r.text
    assert processed() - before == len(own)
