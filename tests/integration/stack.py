"""Helpers for integration tests: read the event log, run streamed completions."""

from __future__ import annotations

import asyncio
import json
import random
import string
import time
from collections import Counter
from pathlib import Path

import httpx
import nats

from schemas import messages as m
from services.eventlog import read_stream as read_event_log  # noqa: F401 (the tests' name for it)
from workers.engines.sim import sim_token_id

REPO = Path(__file__).resolve().parent.parent.parent


def terminal_counts(envs: list[m.Envelope]) -> Counter:
    return Counter(e.payload.request_id for e in envs if isinstance(e.payload, m.TERMINAL_TYPES))


def expected_text(request_id: str, max_tokens: int) -> str:
    return "".join(chr(sim_token_id(request_id, i)) for i in range(max_tokens))


async def stream_completion(client: httpx.AsyncClient, url: str, body: dict) -> dict:
    """One streamed completion; returns request id, texts, finish reason, whether [DONE] came."""
    out = {"request_id": None, "texts": [], "finish_reason": None, "done": False, "errors": [], "status": None,
           "sent": time.monotonic(), "ended": None}
    try:
        await _stream_into(out, client, url, body)
    finally:
        out["ended"] = time.monotonic()
    return out


async def _stream_into(out: dict, client: httpx.AsyncClient, url: str, body: dict) -> None:
    async with client.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as resp:
        out["status"] = resp.status_code
        out["request_id"] = resp.headers.get("x-request-id")
        if resp.status_code != 200:
            out["errors"].append((await resp.aread()).decode())
            return
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                out["done"] = True
                break
            obj = json.loads(data)
            if "error" in obj:
                out["errors"].append(obj["error"])
                continue
            choice = obj["choices"][0]
            if "first_at" not in out:
                out["first_at"] = time.monotonic()
            out["texts"].append(choice["text"])
            if choice["finish_reason"]:
                out["finish_reason"] = choice["finish_reason"]


def make_bodies(n: int, seed: int, max_prompt_chars: int = 400) -> list[dict]:
    rng = random.Random(seed)
    bodies = []
    for _ in range(n):
        length = rng.randint(8, max_prompt_chars)
        prompt = "".join(rng.choice(string.ascii_letters + " ") for _ in range(length))
        bodies.append({"prompt": prompt, "max_tokens": rng.randint(4, 40)})
    return bodies


async def run_concurrent_streams(url: str, bodies: list[dict]) -> list[dict]:
    limits = httpx.Limits(max_connections=len(bodies) + 10, max_keepalive_connections=len(bodies) + 10)
    async with httpx.AsyncClient(timeout=httpx.Timeout(180.0), limits=limits) as client:
        return await asyncio.gather(*(stream_completion(client, url, b) for b in bodies))


async def wait_all_terminal(nats_url: str, ids: set[str], timeout_s: float = 30) -> list[m.Envelope]:
    """The event log once every request in `ids` has a terminal event (bounded wait)."""
    missing: list = ["the log not read yet"]

    async def settled():
        try:
            envs = await read_event_log(nats_url)
        except nats.errors.TimeoutError:  # a cluster's stream electing a new leader: ask again
            return None
        counts = terminal_counts(envs)
        missing[:] = [i for i in ids if counts.get(i, 0) == 0]
        return envs if not missing else None

    try:
        return await wait_async(settled, timeout_s, "a terminal event for every request")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; {len(missing)} of {len(ids)} without one, e.g. {missing[:3]}") from None


def start_sim_server(spawn, *args: str, timeout_s: float = 45, env: dict[str, str] | None = None) -> tuple[str, object]:
    """`flexlb sim-server ARGS` on a free loopback port (through the `spawn` fixture; `env`:
    settings in its environment, FLEXLB_*); returns (its URL, the process) once /health
    answers 200, or fails with the server's log tail."""
    from services.infra import free_port

    port = free_port()
    proc = spawn("sim-server", "--port", str(port), *args, env=env, name=f"sim-{port}")
    url = f"http://127.0.0.1:{port}"

    def healthy():
        if proc.popen.poll() is not None:
            raise AssertionError(f"sim-server exited with {proc.popen.returncode}:\n{proc.tail()}")
        try:
            return httpx.get(url + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(healthy, timeout_s, f"the sim-server at {url} to answer /health")
    return url, proc


async def asgi_call(app, method: str, path: str, body: dict | None = None, timeout_s: float = 10) -> tuple[int, bytes]:
    """One request to an ASGI app in this process, its client staying connected: (status, body)."""
    inbox = [{"type": "http.request", "body": json.dumps(body or {}).encode(), "more_body": False}]
    stays = asyncio.Event()  # never set: the client does not disconnect
    sent: list[dict] = []

    async def receive():
        if inbox:
            return inbox.pop(0)
        await stays.wait()

    async def send(message):
        sent.append(message)

    await asyncio.wait_for(app({"type": "http", "method": method, "path": path, "headers": []}, receive, send), timeout_s)
    return sent[0]["status"], b"".join(x.get("body", b"") for x in sent[1:])


async def seconds_until_leader(url: str, limit_s: float) -> float:
    """After a leader is stopped or killed: seconds until the router at `url` says it leads
    (its /healthz role), polled every 20 ms; AssertionError past `limit_s`."""
    t0 = time.monotonic()
    while True:
        try:
            async with httpx.AsyncClient(timeout=2) as c:
                if (await c.get(url + "/healthz")).json().get("role") == "leader":
                    return time.monotonic() - t0
        except httpx.HTTPError:
            pass  # busy or restarting: asked again below
        assert time.monotonic() - t0 < limit_s, f"{url} did not take over within {limit_s} s"
        await asyncio.sleep(0.02)


async def wait_async(predicate, timeout_s: float, what: str, interval_s: float = 0.2):
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    last = None
    while loop.time() < deadline:
        last = await predicate()
        if last:
            return last
        await asyncio.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what} (last: {last!r})")


def fault_outcome(bodies: list[dict], results: list[dict], fault_at: float) -> dict:
    """What an issue-15 fault test asserts of a load run through a fault at `fault_at`
    (time.monotonic()): every stream ended ([DONE]: none hung); every failure carries a code
    (an SSE error object with one, or an HTTP error body with one); every success has exactly
    the sim engine's text. Returns counts: ok, failed by code, and how many requests were in
    flight (sent before the fault, ended after it)."""
    codes: Counter = Counter()
    ok = 0
    for body, res in zip(bodies, results):
        if res["status"] != 200:
            [raw] = res["errors"]
            err = json.loads(raw)["error"]  # a JSON error body, or this fails: a failure without a code
            assert err["code"], res
            codes[err["code"]] += 1
            continue
        assert res["done"], res  # the stream ended with [DONE]: nothing hung
        if res["errors"]:
            for e in res["errors"]:
                assert isinstance(e, dict) and e.get("code"), res
            codes[res["errors"][0]["code"]] += 1
        else:
            assert "".join(res["texts"]) == expected_text(res["request_id"], body["max_tokens"]), res
            ok += 1
    in_flight = sum(1 for r in results if r["sent"] <= fault_at < r["ended"])
    return {"ok": ok, "failed": dict(codes), "in_flight": in_flight, "total": len(results)}


async def settled_cleanly(url: str, nats_url: str, results: list[dict], timeout_s: float = 60) -> None:
    """After a fault: exactly one terminal event per request (so nothing was released twice:
    a request's ledger entries go with its one terminal event) and the router's ledger empty."""
    ids = {r["request_id"] for r in results if r["request_id"]}
    envs = await wait_all_terminal(nats_url, ids, timeout_s)
    counts = terminal_counts(envs)
    twice = {i: [(type(e.payload).__name__, e.producer, getattr(e.payload, "code", "")) for e in envs
                 if isinstance(e.payload, m.TERMINAL_TYPES) and e.payload.request_id == i] for i in ids if counts[i] != 1}
    assert not twice, f"{len(twice)} requests without exactly one terminal event: {dict(list(twice.items())[:3])}"
    async with httpx.AsyncClient(timeout=30) as c:
        async def ledger_empty():
            return (await c.get(url + "/admin/ledger")).json()["num_entries"] == 0

        await wait_async(ledger_empty, timeout_s, "an empty ledger")


def wait_for(predicate, timeout_s: float, what: str, interval_s: float = 0.1):
    """Poll until predicate() is truthy (bounded, generous); return its value or fail."""
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what} (last: {last!r})")


def streams_complete_across(state: dict, n: int, seed: int, workers: tuple[str, ...] = ("w0", "w1")):
    """`n` streamed completions through a `flexlb up` of these (sim-engine) workers: every one
    complete with the engine's text and its token count, spread over all of them, the ledger
    empty. -> (bodies, client results, terminal events, RequestFinished by request id)."""
    router = state["router_url"]
    wait_for(lambda: sum(w["state"] == "ready" for w in httpx.get(router + "/admin/workers", timeout=10).json()["workers"])
             == len(workers), 60, f"{len(workers)} ready workers")
    bodies = make_bodies(n, seed=seed)
    results = asyncio.run(run_concurrent_streams(router, bodies))
    for r, b in zip(results, bodies):
        assert r["status"] == 200 and r["done"] and not r["errors"], r
        assert r["finish_reason"] == "length"
        assert "".join(r["texts"]) == expected_text(r["request_id"], b["max_tokens"])
    envs = asyncio.run(wait_all_terminal(state["nats_url"], {r["request_id"] for r in results}))
    finished = {e.payload.request_id: e.payload for e in envs if isinstance(e.payload, m.RequestFinished)}
    assert {r["request_id"] for r in results} == set(finished)
    for r, b in zip(results, bodies):
        assert finished[r["request_id"]].num_output_tokens == b["max_tokens"]
    assert {f.worker_id for f in finished.values()} == set(workers)
    wait_for(lambda: httpx.get(router + "/admin/ledger", timeout=10).json()["num_entries"] == 0, 30, "an empty ledger")
    return bodies, results, envs, finished
