"""The HTTP front of the simulated engine (`flexlb sim-server`, workers/sim_server/http.py), alone
and behind the peer routers (sglang-router, vllm-router) that benchmarks compare FlexLB with.

Story: two `flexlb sim-server` processes at time scale 0 (instant) serve every dialect the
routers speak; each router in turn is started in front of both, waits until it reports both
workers healthy, and forwards a few dozen requests (streaming and not, OpenAI and SGLang,
shared prefixes). Every request must come back with exactly the tokens asked for, the
servers' own counters must add up to what was sent, and each policy must leave its mark
(round_robin alternates, cache_aware keeps a prefix on one worker). A third server at time
scale 1 (real profile speed) holds long requests so that disconnects, duplicates and load
can be observed while they run.

The routers are required (CI installs them): a missing one fails these tests, it never skips.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import httpx
import pytest

from services.infra import free_port
from tests.integration.stack import asgi_call

REPO = Path(__file__).resolve().parent.parent.parent
MODEL = "flexlb-sim"
MAX_SEQ_LEN_TOKENS = 4096
STARTUP_TIMEOUT_S = 45  # generous: a cold start on a loaded CI machine
REQUEST_TIMEOUT_S = 30


# --------------------------------------------------------------------------- processes
class Process:
    """A child process in its own process group, its output in a file; stop() kills the group."""

    def __init__(self, name: str, argv: list[str], log_path: Path) -> None:
        self.name = name
        self.log_path = log_path
        self._log = open(log_path, "ab")
        env = {k: v for k, v in os.environ.items() if not k.startswith("FLEXLB_")}
        env.setdefault("NO_COLOR", "1")
        self.popen = subprocess.Popen(argv, cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                      start_new_session=True)

    def tail(self, n: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def check_alive(self) -> None:
        if self.popen.poll() is not None:
            raise AssertionError(f"{self.name} exited with {self.popen.returncode}:\n{self.tail()}")

    def stop(self, timeout_s: float = 10) -> None:
        if self.popen.poll() is None:
            for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 5)):
                try:
                    os.killpg(self.popen.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.popen.wait(wait_s)
                    break
                except subprocess.TimeoutExpired:
                    continue
        self._log.close()


async def wait_until(predicate, timeout_s: float, what: str, procs: tuple[Process, ...] = (), interval_s: float = 0.1):
    """Await predicate() (async, may raise httpx errors while a server starts) until truthy."""
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        for p in procs:
            p.check_alive()
        try:
            last = await predicate()
        except httpx.HTTPError as exc:
            last = repr(exc)
        else:
            if last:
                return last
        await asyncio.sleep(interval_s)
    tails = "\n".join(f"--- {p.name}:\n{p.tail()}" for p in procs)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what} (last: {last!r})\n{tails}")


class SimServer:
    def __init__(self, worker_id: str, time_scale: float, log_dir: Path, role: str = "pd_fusion") -> None:
        self.worker_id = worker_id
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = Process(worker_id, [
            sys.executable, "-m", "services.cli", "sim-server", "--port", str(self.port), "--worker-id", worker_id,
            "--time-scale", str(time_scale), "--max-seq-len-tokens", str(MAX_SEQ_LEN_TOKENS), "--role", role,
        ], log_dir / f"{worker_id}.log")

    async def wait_ready(self, client: httpx.AsyncClient) -> None:
        async def healthy():
            return (await client.get(f"{self.url}/health")).status_code == 200
        await wait_until(healthy, STARTUP_TIMEOUT_S, f"{self.worker_id} /health", (self.proc,))


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {"name{labels}": value} (and "name" for unlabelled samples)."""
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            samples[key] = float(value)
    return samples


async def metrics_of(client: httpx.AsyncClient, server: SimServer) -> dict[str, float]:
    resp = await client.get(f"{server.url}/metrics")
    assert resp.status_code == 200, resp.text
    return parse_metrics(resp.text)


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("sim-http")


@pytest.fixture(scope="module")
async def servers(log_dir):
    """sim-a, sim-b (time scale 0) for the routers; sim-slow (time scale 1) for long requests."""
    started = [SimServer("sim-a", 0, log_dir), SimServer("sim-b", 0, log_dir), SimServer("sim-slow", 1, log_dir)]
    try:
        async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as client:
            await asyncio.gather(*(s.wait_ready(client) for s in started))
        yield {s.worker_id: s for s in started}
    finally:
        for s in started:
            s.proc.stop()


@pytest.fixture
async def client():
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as c:
        yield c


# --------------------------------------------------------------------------- SSE helpers
async def read_sse(resp: httpx.Response) -> tuple[list[dict], bool]:
    """Every `data: {...}` event of a response and whether it ended with `data: [DONE]`."""
    events, done = [], False
    async for line in resp.aiter_lines():
        if not line.startswith("data: "):
            continue
        payload = line[len("data: "):]
        if payload == "[DONE]":
            done = True
            continue
        assert not done, "an event after [DONE]"
        events.append(json.loads(payload))
    return events, done


async def complete(client: httpx.AsyncClient, base: str, prompt, max_tokens: int, stream: bool, **extra) -> dict:
    """POST /v1/completions; returns {"text", "completion_tokens", "finish_reason", "id", "usage"}."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": stream, **extra}
    if not stream:
        resp = await client.post(f"{base}/v1/completions", json=body)
        assert resp.status_code == 200, resp.text
        data = resp.json()
        choice = data["choices"][0]
        return {"text": choice["text"], "completion_tokens": data["usage"]["completion_tokens"], "usage": data["usage"],
                "finish_reason": choice["finish_reason"], "id": data["id"]}
    async with client.stream("POST", f"{base}/v1/completions", json=body) as resp:
        assert resp.status_code == 200, await resp.aread()
        events, done = await read_sse(resp)
    assert done, f"no [DONE] after {events}"
    chunks = [e for e in events if e["choices"]]
    usage = [e["usage"] for e in events if e.get("usage")]
    return {"text": "".join(c["choices"][0]["text"] for c in chunks), "completion_tokens": len(chunks),
            "finish_reason": chunks[-1]["choices"][0]["finish_reason"], "id": chunks[0]["id"],
            "usage": usage[0] if usage else None,
            "finish_reasons_before_last": {c["choices"][0]["finish_reason"] for c in chunks[:-1]}}


async def generate(client: httpx.AsyncClient, base: str, text: str, max_new_tokens: int, stream: bool) -> dict:
    """POST /generate (SGLang); returns {"text", "completion_tokens", "finish_reason", "id"}."""
    body = {"text": text, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}, "stream": stream}
    if not stream:
        resp = await client.post(f"{base}/generate", json=body)
        assert resp.status_code == 200, resp.text
        data = resp.json()
        meta = data["meta_info"]
        return {"text": data["text"], "completion_tokens": meta["completion_tokens"], "id": meta["id"],
                "finish_reason": meta["finish_reason"]["type"], "cached_tokens": meta["cached_tokens"]}
    async with client.stream("POST", f"{base}/generate", json=body) as resp:
        assert resp.status_code == 200, await resp.aread()
        events, done = await read_sse(resp)
    assert done and events
    texts = [e["text"] for e in events]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:])), f"SGLang streams cumulative text: {texts}"
    meta = events[-1]["meta_info"]
    return {"text": texts[-1], "completion_tokens": meta["completion_tokens"], "id": meta["id"],
            "finish_reason": meta["finish_reason"]["type"], "cached_tokens": meta["cached_tokens"]}


# --------------------------------------------------------------------------- the front alone
async def test_completions_non_streaming_counts_tokens_and_usage(servers, client):
    base = servers["sim-a"].url
    out = await complete(client, base, "Hello, world", 7, stream=False)
    assert (len(out["text"]), out["completion_tokens"], out["finish_reason"]) == (7, 7, "length")
    assert out["usage"]["prompt_tokens"] == len("Hello, world")
    assert out["usage"]["total_tokens"] == len("Hello, world") + 7
    assert out["id"].startswith("cmpl-sim-a-")
    ids = await complete(client, base, [72, 101, 108, 108, 111], 3, stream=False, temperature=0.7, slo_ttft_ms=100)
    assert (ids["usage"]["prompt_tokens"], len(ids["text"])) == (5, 3)


async def test_completions_streaming_sends_one_chunk_per_token_then_usage_and_done(servers, client):
    out = await complete(client, servers["sim-a"].url, "stream me", 5, stream=True,
                         stream_options={"include_usage": True})
    assert (len(out["text"]), out["completion_tokens"], out["finish_reason"]) == (5, 5, "length")
    assert out["finish_reasons_before_last"] == {None}
    assert out["usage"]["completion_tokens"] == 5 and out["usage"]["prompt_tokens"] == len("stream me")
    one = await complete(client, servers["sim-a"].url, "x", 1, stream=True)
    assert (len(one["text"]), one["finish_reason"], one["usage"]) == (1, "length", None)


async def test_generate_sglang_dialect_streaming_and_not(servers, client):
    base = servers["sim-b"].url
    out = await generate(client, base, "sglang says", 6, stream=False)
    assert (len(out["text"]), out["completion_tokens"], out["finish_reason"]) == (6, 6, "length")
    assert out["id"].startswith("sim-b-")
    streamed = await generate(client, base, "sglang streams", 4, stream=True)
    assert (len(streamed["text"]), streamed["completion_tokens"], streamed["finish_reason"]) == (4, 4, "length")
    resp = await client.post(f"{base}/generate", json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2},
                                                       "rid": "my-rid", "bootstrap_room": 7})
    assert resp.status_code == 200 and resp.json()["meta_info"]["id"] == "my-rid"


async def test_generate_streams_the_whole_output_ids_so_far_as_sglang_does(servers, client):
    body = {"input_ids": [7, 8, 9], "sampling_params": {"max_new_tokens": 4}, "stream": True, "rid": "ids-1"}
    async with client.stream("POST", f"{servers['sim-b'].url}/generate", json=body) as resp:
        events, done = await read_sse(resp)
    assert done and len(events) == 4
    ids = [e["output_ids"] for e in events]
    assert [len(i) for i in ids] == [1, 2, 3, 4] and all(b[:len(a)] == a for a, b in zip(ids, ids[1:]))
    assert [e["meta_info"]["completion_tokens"] for e in events] == [1, 2, 3, 4]
    assert "".join(chr(t) for t in ids[-1]) == events[-1]["text"]


async def test_abort_request_ends_a_running_generation(servers, client):
    slow = servers["sim-slow"]
    before = await metrics_of(client, slow)
    body = {"text": "abort me", "sampling_params": {"max_new_tokens": 2000}, "stream": True, "rid": "abort-1"}
    async with client.stream("POST", f"{slow.url}/generate", json=body) as resp:
        lines = resp.aiter_lines()
        line = ""
        while not line.startswith("data: "):
            line = await anext(lines)
        assert (await client.post(f"{slow.url}/abort_request", json={"rid": "abort-1"})).status_code == 200
        rest = [json.loads(x[6:]) for x in [x async for x in lines] if x.startswith("data: {")]
    assert rest[-1]["meta_info"]["finish_reason"]["type"] == "abort"  # as SGLang ends an aborted stream
    after = await metrics_of(client, slow)
    assert after["flexlb_sim_requests_cancelled_total"] == before["flexlb_sim_requests_cancelled_total"] + 1
    assert (await client.post(f"{slow.url}/abort_request", json={"rid": "abort-1"})).status_code == 200  # gone: still 200
    assert (await client.post(f"{slow.url}/abort_request", json={})).status_code == 400


async def test_chat_completions_in_openais_shapes_through_the_official_client(servers, client):
    import openai

    base = servers["sim-a"].url
    oai = openai.AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}]
    rendered = "<|system|>\nYou are terse.\n<|user|>\nHi\n<|assistant|>\n"  # the built-in template
    one = await oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=5)
    assert (one.object, one.choices[0].message.role, one.choices[0].finish_reason) == ("chat.completion", "assistant", "length")
    assert len(one.choices[0].message.content) == 5 and one.id.startswith("chatcmpl-")
    assert (one.usage.prompt_tokens, one.usage.completion_tokens) == (len(rendered), 5)
    assert one.usage.prompt_tokens_details.cached_tokens == 0
    stream = await oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, stream=True,
                                               stream_options={"include_usage": True},
                                               extra_body={"return_token_ids": True})
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    assert chunks[0].model_extra["prompt_token_ids"] == list(rendered.encode())
    content = [c for c in chunks[1:] if c.choices]
    assert [c.choices[0].finish_reason for c in content] == [None, None, None, "length"]
    text = "".join(c.choices[0].delta.content for c in content)
    assert [t for c in content for t in c.choices[0].model_extra["token_ids"]] == list(text.encode())
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    # /tokenize renders messages as the chat endpoint does (vLLM's chat form).
    tokens = (await client.post(f"{base}/tokenize", json={"messages": messages})).json()["tokens"]
    assert tokens == list(rendered.encode())
    bad = await client.post(f"{base}/v1/chat/completions", json={"model": MODEL, "messages": []})
    assert (bad.status_code, bad.json()["error"]["code"]) == (400, "invalid_request")
    metrics = await metrics_of(client, servers["sim-a"])
    assert metrics["flexlb_sim_chat_requests_total"] >= 2


async def test_a_repeated_prompt_hits_the_prefix_cache_and_the_metrics_say_so(servers, client):
    base, server = servers["sim-b"].url, servers["sim-b"]
    before = await metrics_of(client, server)
    prompt = "A shared system prompt that is longer than a few KV blocks. " * 4  # 240 tokens: 15 blocks of 16
    first = await complete(client, base, prompt, 2, stream=False)
    second = await complete(client, base, prompt + "and a new question?", 2, stream=False)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == len(prompt) == 240
    after = await metrics_of(client, server)
    label = f'{{model_name="{MODEL}"}}'
    assert after[f"vllm:prefix_cache_hits_total{label}"] - before[f"vllm:prefix_cache_hits_total{label}"] == 240
    assert after[f"vllm:prefix_cache_queries_total{label}"] - before[f"vllm:prefix_cache_queries_total{label}"] == \
        2 * len(prompt) + len("and a new question?")
    assert after["flexlb_sim_cached_tokens_total"] - before["flexlb_sim_cached_tokens_total"] == 240
    assert after["flexlb_sim_requests_total"] - before["flexlb_sim_requests_total"] == 2
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert 0 <= after[f"{name}{label}"], name
    assert after[f"vllm:kv_cache_usage_perc{label}"] <= 1
    assert "flexlb_sim_prompt_tokens_total" in after and "flexlb_sim_preemptions_total" in after


async def test_tokenize_counts_bytes_and_reports_the_model_length(servers, client):
    base = servers["sim-a"].url
    resp = await client.post(f"{base}/tokenize", json={"model": MODEL, "prompt": "héllo"})
    assert resp.status_code == 200
    assert resp.json() == {"count": 6, "max_model_len": MAX_SEQ_LEN_TOKENS, "tokens": list("héllo".encode()),
                           "token_strs": None}
    assert (await client.post(f"{base}/tokenize", json={"text": "abc"})).json()["count"] == 3
    render = await client.post(f"{base}/v1/completions/render", json={"model": MODEL, "prompt": "abc"})
    assert render.status_code == 200 and render.json()[0]["token_ids"] == [97, 98, 99]


async def test_errors_have_a_code_and_a_status_before_and_during_a_stream(servers, client):
    base = servers["sim-a"].url
    too_long = "x" * MAX_SEQ_LEN_TOKENS
    for stream in (False, True):
        resp = await client.post(f"{base}/v1/completions", json={"prompt": too_long, "max_tokens": 8, "stream": stream})
        assert resp.status_code == 413, resp.text
        assert resp.json()["error"]["code"] == "too_large" and "max_seq_len_tokens" in resp.json()["error"]["message"]
    resp = await client.post(f"{base}/generate", json={"text": too_long, "sampling_params": {"max_new_tokens": 8}})
    assert (resp.status_code, resp.json()["error"]["code"]) == (413, "too_large")
    cases = {
        "empty prompt": {"prompt": "", "max_tokens": 4},
        "max_tokens 0": {"prompt": "hi", "max_tokens": 0},
        "max_tokens text": {"prompt": "hi", "max_tokens": "4"},
        "n 2": {"prompt": "hi", "n": 2},
        "two prompts": {"prompt": ["a", "b"]},
        "no prompt": {"max_tokens": 4},
    }
    for what, body in cases.items():
        resp = await client.post(f"{base}/v1/completions", json=body)
        assert (resp.status_code, resp.json()["error"]["code"]) == (400, "invalid_request"), what
    resp = await client.post(f"{base}/v1/completions", content=b"{not json")
    assert (resp.status_code, resp.json()["error"]["code"]) == (400, "invalid_request")
    resp = await client.get(f"{base}/no/such/path")
    assert (resp.status_code, resp.json()["error"]["code"]) == (404, "not_found")


async def test_introspection_endpoints_name_no_tokenizer_to_download(servers, client):
    base = servers["sim-a"].url
    assert (await client.get(f"{base}/health")).status_code == 200
    assert (await client.get(f"{base}/health_generate")).status_code == 200
    for path in ("/server_info", "/get_server_info", "/model_info", "/get_model_info"):
        resp = await client.get(f"{base}{path}")
        assert resp.status_code == 200, path
        assert not {"model_path", "tokenizer_path"} & resp.json().keys(), path
    assert (await client.get(f"{base}/server_info")).json()["context_length"] == MAX_SEQ_LEN_TOKENS
    models = (await client.get(f"{base}/v1/models")).json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    load = (await client.get(f"{base}/get_load")).json()
    assert load == [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]


async def test_a_running_request_shows_in_the_load_refuses_its_duplicate_and_a_disconnect_cancels_it(servers, client):
    slow = servers["sim-slow"]
    before = await metrics_of(client, slow)
    body = {"model": MODEL, "prompt": "a long generation", "max_tokens": 2000, "stream": True}  # ~60 s at time scale 1
    async with client.stream("POST", f"{slow.url}/v1/completions", json=body, headers={"X-Request-Id": "long-1"}) as resp:
        assert resp.status_code == 200
        lines = resp.aiter_lines()  # kept referenced: a collected line iterator closes the response
        line = ""
        while not line.startswith("data: "):
            line = await anext(lines)
        assert json.loads(line[6:])["id"] == "cmpl-long-1"
        load = (await client.get(f"{slow.url}/get_load")).json()[0]
        assert load["num_reqs"] == 1 and load["num_tokens"] > 0, load
        dup = await client.post(f"{slow.url}/v1/completions", json={"prompt": "x", "max_tokens": 2},
                                headers={"X-Request-Id": "long-1"})
        assert (dup.status_code, dup.json()["error"]["code"]) == (409, "duplicate_request")
    # The stream is closed after one chunk: the request must leave the engine.
    # A non-streaming client that gives up: its request must leave the engine too.
    with pytest.raises(httpx.TimeoutException):
        await client.post(f"{slow.url}/generate", json={"text": "unary", "sampling_params": {"max_new_tokens": 2000}},
                          timeout=0.5)

    async def both_cancelled():
        m = await metrics_of(client, slow)
        cancelled = m["flexlb_sim_requests_cancelled_total"] - before["flexlb_sim_requests_cancelled_total"]
        running = m[f'vllm:num_requests_running{{model_name="{MODEL}"}}'] + m[f'vllm:num_requests_waiting{{model_name="{MODEL}"}}']
        return cancelled == 2 and running == 0
    await wait_until(both_cancelled, 10, "both disconnected requests to be cancelled in the engine", (slow.proc,))


async def test_an_engine_bug_mid_stream_ends_the_stream_with_an_error_chunk_not_a_hang():
    """In process (no socket): the ASGI app with an engine that raises after two steps."""
    from workers.config import WorkerConfig
    from workers.sim_server.http import SimFront, SimHttpApp

    front = SimFront(WorkerConfig(worker_id="inproc", time_scale=0).validate())
    app = SimHttpApp(front)
    real_step, num_busy_steps = front.engine.step, 0

    def failing_step():  # two steps that did work, then a bug
        nonlocal num_busy_steps
        if num_busy_steps == 2:
            raise RuntimeError("a bug in the engine")
        step = real_step()
        num_busy_steps += step is not None
        return step

    front.engine.step = failing_step
    front.start()
    try:
        status, raw = await asgi_call(app, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 10, "stream": True})
    finally:
        await front.stop()
    assert status == 200
    events = raw.decode().split("\n\n")
    data = [e.removeprefix("data: ") for e in events if e]
    assert data[-1] == "[DONE]"
    assert [len(json.loads(d)["choices"][0]["text"]) for d in data[:-2]] == [1, 1]  # two steps made it
    assert json.loads(data[-2])["error"]["code"] == "worker_failed"
    metrics = parse_metrics(front.metrics_text())
    assert metrics["flexlb_sim_engine_errors_total"] == 1  # once: with nothing open the loop waits, never spins
    assert metrics['flexlb_sim_requests_failed_total{code="worker_failed"}'] == 1
    assert front.engine.num_running_requests == 0  # cancelled in the engine, not left running


# --------------------------------------------------------------------------- behind the peer routers
def sglang_router_argv(port: int, worker_urls: list[str], policy: str) -> list[str]:
    return [
        sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
        "--worker-urls", *worker_urls, "--policy", policy,
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
        "--worker-startup-check-interval", "1",  # also power_of_two's /get_load period (default 30 s)
        "--shutdown-grace-period-secs", "1", "--log-level", "warn",
    ]


def vllm_router_argv(port: int, worker_urls: list[str], policy: str) -> list[str]:
    return [
        sys.executable, "-m", "vllm_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
        "--worker-urls", *worker_urls, "--policy", policy,
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
        "--worker-startup-check-interval", "1", "--log-level", "warning",
    ]


ROUTERS = {"sglang-router": ("sglang_router", sglang_router_argv), "vllm-router": ("vllm_router", vllm_router_argv)}

CASES = [
    ("sglang-router", "cache_aware"),
    ("sglang-router", "power_of_two"),
    ("sglang-router", "round_robin"),
    ("vllm-router", "cache_aware"),
    ("vllm-router", "round_robin"),
    ("vllm-router", "power_of_two"),
]

NUM_GROUPS = 4  # shared prefixes
NUM_PER_GROUP = 8  # /v1/completions requests per prefix
NUM_GENERATE = 6  # /generate requests, unique prompts


def group_prefix(case: str, group: int) -> str:
    # Distinct from the first character, 160 tokens (10 blocks): a router's prefix tree and
    # the engine's block hashes both tell the groups apart at once. New for every case, so
    # that no case finds its prefixes cached by an earlier one.
    return (f"{'ABCD'[group]}{group} {case} system prompt number {group} for the peer router test. " * 4)[:160]


def served_by(response_id: str, worker_ids: list[str]) -> str:
    """Which sim-server answered: our ids are `[cmpl-]<worker id>-<boot>-<n>`."""
    for wid in worker_ids:
        if response_id.removeprefix("cmpl-").startswith(f"{wid}-"):
            return wid
    raise AssertionError(f"response id {response_id!r} names none of {worker_ids}")


def test_peer_routers_are_installed():
    missing = [name for name, (module, _) in ROUTERS.items() if importlib.util.find_spec(module) is None]
    assert not missing, f"{missing} not installed: pip install sglang-router==0.3.2 vllm-router==0.1.17"


@pytest.mark.parametrize("router,policy", CASES, ids=[f"{r}-{p}" for r, p in CASES])
async def test_a_peer_router_drives_both_sim_servers(servers, client, log_dir, router, policy):
    module, argv_of = ROUTERS[router]
    assert importlib.util.find_spec(module) is not None, f"{router} is not installed"
    workers = [servers["sim-a"], servers["sim-b"]]
    worker_ids = [w.worker_id for w in workers]
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = Process(f"{router}-{policy}", argv_of(port, [w.url for w in workers], policy),
                   log_dir / f"{router}-{policy}.log")
    try:
        async def both_workers_healthy():
            resp = await client.get(f"{base}/workers")
            if resp.status_code != 200:
                return False
            healthy = {w["url"] for w in resp.json()["workers"] if w.get("is_healthy")}
            return healthy == {w.url for w in workers}
        await wait_until(both_workers_healthy, STARTUP_TIMEOUT_S, f"{router} to report both workers healthy", (proc,))
        before = {w.worker_id: await metrics_of(client, w) for w in workers}

        # The first request of each prefix group goes alone (so a cache-aware tree sees it
        # before its siblings), then everything else at once.
        async def completion(group: int, i: int):
            max_tokens = 1 + (group * NUM_PER_GROUP + i) % 12
            prompt = group_prefix(f"{router}/{policy}", group) + f" question {i}?"
            out = await complete(client, base, prompt, max_tokens, stream=i % 2 == 0)
            return ("completions", group, max_tokens, out)

        async def generation(i: int):
            max_tokens = 1 + i % 5
            prompt = f"{i} {router}/{policy}: a generate prompt that shares no block with any other"
            out = await generate(client, base, prompt, max_tokens, stream=i % 2 == 1)
            return ("generate", None, max_tokens, out)

        results = [await completion(g, 0) for g in range(NUM_GROUPS)]
        results += await asyncio.gather(*(completion(g, i) for g in range(NUM_GROUPS) for i in range(1, NUM_PER_GROUP)),
                                        *(generation(i) for i in range(NUM_GENERATE)))
        proc.check_alive()
        after = {w.worker_id: await metrics_of(client, w) for w in workers}
    finally:
        proc.stop()

    for endpoint, group, max_tokens, out in results:
        assert (out["completion_tokens"], len(out["text"]), out["finish_reason"]) == (max_tokens, max_tokens, "length"), \
            (endpoint, group, out)
    per_worker = Counter(served_by(out["id"], worker_ids) for _, _, _, out in results)
    served = {wid: after[wid]["flexlb_sim_requests_total"] - before[wid]["flexlb_sim_requests_total"] for wid in worker_ids}
    assert served == {wid: per_worker[wid] for wid in worker_ids}, "the servers' counters disagree with the answers"
    assert sum(served.values()) == len(results) == NUM_GROUPS * NUM_PER_GROUP + NUM_GENERATE
    if policy != "cache_aware":  # cache_aware may keep every group on one worker while the load is balanced
        assert all(n > 0 for n in served.values()), f"{router} {policy} sent everything to one worker: {served}"
    if policy == "round_robin":
        assert abs(served["sim-a"] - served["sim-b"]) <= 1, served
    if policy == "cache_aware":
        group_to_workers = defaultdict(set)
        for endpoint, group, _, out in results:
            if endpoint == "completions":
                group_to_workers[group].add(served_by(out["id"], worker_ids))
        assert all(len(ws) == 1 for ws in group_to_workers.values()), f"a prefix group was split: {dict(group_to_workers)}"
        hits = sum(after[w]["flexlb_sim_cached_tokens_total"] - before[w]["flexlb_sim_cached_tokens_total"] for w in worker_ids)
        # Each group's later requests reuse its 160-token prefix (10 blocks) on the same worker
        # (round_robin, which splits each group over both workers, gets 6 of 8, not 7 of 8).
        assert hits >= NUM_GROUPS * (NUM_PER_GROUP - 1) * 160, hits


async def test_sglang_router_pd_mode_drives_a_prefill_and_a_decode_sim_server(log_dir, client):
    """sglang-router --pd-disaggregation sends each body to both servers with a bootstrap
    room; the prefill server computes the prompt, the decode server waits for the room and
    streams every token. The prefill server does the prompt work, the decode server none."""
    prefill, decode = SimServer("pd-p", 0, log_dir, "prefill"), SimServer("pd-d", 0, log_dir, "decode")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    router = None
    try:
        await asyncio.gather(prefill.wait_ready(client), decode.wait_ready(client))
        # Alone, a decode server refuses: it cannot compute a prompt.
        alone = await client.post(f"{decode.url}/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert alone.status_code == 400 and alone.json()["error"]["code"] == "invalid_request", alone.text
        router = Process("sglang-pd", [
            sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
            "--pd-disaggregation", "--prefill", prefill.url, str(prefill.port), "--decode", decode.url,
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
            "--worker-startup-check-interval", "1", "--shutdown-grace-period-secs", "1", "--log-level", "warn",
        ], log_dir / "sglang-pd.log")

        async def ready():
            return (await client.get(f"{base}/readiness")).status_code == 200
        await wait_until(ready, STARTUP_TIMEOUT_S, "sglang-router (PD) to be ready", (router,))
        prompts = [f"{i}: a PD prompt that the prefill server computes and the decode server continues" for i in range(12)]
        outs = await asyncio.gather(*(complete(client, base, p, 1 + i % 6, stream=i % 2 == 0)
                                      for i, p in enumerate(prompts)))
        router.check_alive()
        p_metrics, d_metrics = await metrics_of(client, prefill), await metrics_of(client, decode)
    finally:
        for proc in ([router] if router else []) + [prefill.proc, decode.proc]:
            proc.stop()
    for i, out in enumerate(outs):
        # (streamed: the decode engine's first step carries the first token and the second)
        assert (len(out["text"]), out["finish_reason"]) == (1 + i % 6, "length"), out
        assert i % 2 == 0 or out["completion_tokens"] == 1 + i % 6, out
        assert served_by(out["id"], ["pd-d", "pd-p"]) == "pd-d"  # the client's stream is the decode server's
    assert p_metrics["flexlb_sim_requests_total"] == d_metrics["flexlb_sim_requests_total"] == len(prompts)
    assert p_metrics["flexlb_sim_prompt_tokens_total"] == sum(len(p) for p in prompts)
    # decode produced every token; prefill one per request (its answer to the router)
    assert d_metrics["flexlb_sim_output_tokens_total"] == sum(1 + i % 6 for i in range(len(prompts)))
    assert p_metrics["flexlb_sim_output_tokens_total"] == len(prompts)


def test_the_metric_parser_reads_labelled_and_plain_samples():
    text = '# TYPE x counter\nx 3\ny{model_name="m"} 0.5\nflexlb_sim_requests_failed_total{code="too_large"} 1\n'
    assert parse_metrics(text) == {"x": 3.0, 'y{model_name="m"}': 0.5, 'flexlb_sim_requests_failed_total{code="too_large"}': 1.0}
    assert re.fullmatch(r"cmpl-sim-a-\w+-\d+", "cmpl-sim-a-ab12cd-7")
    assert served_by("cmpl-sim-b-ab12cd-7", ["sim-a", "sim-b"]) == "sim-b"
