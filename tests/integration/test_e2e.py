"""The walking skeleton end to end: `flexlb up` -> router -> workers -> streamed tokens.

Real processes, real nats-server and redis-server (started by `flexlb up` itself).
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
import redis

from schemas import messages as m
from tests.integration.stack import (
    expected_text,
    make_bodies,
    read_event_log,
    run_concurrent_streams,
    stream_completion,
    terminal_counts,
    wait_async,
)

N_CONCURRENT = 200


@pytest.mark.parametrize(
    "fleet",
    [["--workers", "2"], ["--prefill", "1", "--decode", "1"]],
    ids=["colocated-pd_fusion", "disaggregated-1p1d"],
)
async def test_200_concurrent_streams_complete_exactly_once_and_leave_no_ledger(flexlb_up, fleet):
    proc, state = flexlb_up("--time-scale", "0.01", *fleet)
    url = state["router_url"]
    bodies = make_bodies(N_CONCURRENT, seed=7)

    results = await run_concurrent_streams(url, bodies)

    # Every stream completed, with every generated token, in order.
    for body, res in zip(bodies, results):
        assert res["status"] == 200 and not res["errors"], res
        assert res["done"] and res["finish_reason"] == "length", res
        assert "".join(res["texts"]) == expected_text(res["request_id"], body["max_tokens"])
    ids = {r["request_id"] for r in results}
    assert len(ids) == N_CONCURRENT

    # Exactly one terminal event per request in the event log.
    async def all_terminal():
        envs = await read_event_log(state["nats_url"])
        counts = terminal_counts(envs)
        return envs if all(counts.get(i, 0) >= 1 for i in ids) else None

    envs = await wait_async(all_terminal, 30, "a terminal event for every request")
    counts = terminal_counts(envs)
    assert {i: counts[i] for i in ids} == {i: 1 for i in ids}
    finished = {e.payload.request_id: e.payload for e in envs if isinstance(e.payload, m.RequestFinished)}
    for body, res in zip(bodies, results):
        assert finished[res["request_id"]].num_output_tokens == body["max_tokens"]
    # Requests were batched: fewer batches than requests.
    batches = [e.payload for e in envs if isinstance(e.payload, m.BatchDispatched)]
    assert sum(len(b.request_ids) for b in batches) == N_CONCURRENT
    assert len(batches) < N_CONCURRENT

    # The Redis ledger drains to empty (both through the admin API and in Redis itself).
    async def ledger_empty():
        async with httpx.AsyncClient() as c:
            return (await c.get(url + "/admin/ledger")).json()["num_entries"] == 0

    await wait_async(ledger_empty, 30, "an empty ledger")
    r = redis.Redis.from_url(state["redis_url"])
    assert sum(r.hlen(k) for k in r.scan_iter("flexlb:*:ledger:*")) == 0
    assert proc.stop() == 0  # SIGTERM: every child stopped, exit 0


async def test_non_stream_completion_is_openai_shaped_with_usage(flexlb_up):
    _, state = flexlb_up("--time-scale", "0.01", "--workers", "1")
    async with httpx.AsyncClient(timeout=60) as c:
        resp = await c.post(state["router_url"] + "/v1/completions", json={"prompt": "Hello, world", "max_tokens": 12})
        models = (await c.get(state["router_url"] + "/v1/models")).json()
    assert resp.status_code == 200
    body = resp.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["model"] == models["data"][0]["id"]
    assert body["choices"][0]["text"] == expected_text(body["id"], 12)
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": len("Hello, world".encode()), "completion_tokens": 12, "total_tokens": 24,
                             "prompt_tokens_details": {"cached_tokens": 0}}


BAD_BODIES = [
    ("missing-prompt", b'{"max_tokens": 4}', 400, "invalid_request"),
    ("negative-max-tokens", b'{"prompt": "hi", "max_tokens": -1}', 400, "invalid_request"),
    ("zero-max-tokens", b'{"prompt": "hi", "max_tokens": 0}', 400, "invalid_request"),
    ("huge-max-tokens", b'{"prompt": "hi", "max_tokens": 100000000}', 400, "invalid_request"),
    ("prompt-wrong-type", b'{"prompt": 42}', 400, "invalid_request"),
    ("max-tokens-wrong-type", b'{"prompt": "hi", "max_tokens": "many"}', 400, "invalid_request"),
    ("stream-wrong-type", b'{"prompt": "hi", "stream": "yes"}', 400, "invalid_request"),
    ("negative-token-id", b'{"prompt": [1, -2, 3]}', 400, "invalid_request"),
    ("empty-prompt", b'{"prompt": ""}', 400, "invalid_request"),
    ("not-an-object", b'[1, 2, 3]', 400, "invalid_request"),
    ("invalid-json", b'{"prompt": "hi",', 400, "invalid_request"),
    ("empty-body", b"", 400, "invalid_request"),
    ("unknown-model", b'{"prompt": "hi", "model": "gpt-9"}', 404, "model_not_found"),
    ("bad-request-id", b'{"prompt": "hi", "request_id": "a.b c"}', 400, "invalid_request"),
    ("10MB-prompt", b'{"prompt": "' + b"a" * (10 * 1024 * 1024) + b'"}', 413, "too_large"),
    ("prompt-over-token-limit", b'{"prompt": "' + b"a" * 40000 + b'"}', 413, "too_large"),
]


async def test_invalid_bodies_get_4xx_with_a_code_and_the_router_keeps_serving(flexlb_up):
    _, state = flexlb_up("--time-scale", "0.01", "--workers", "1")
    url = state["router_url"]
    async with httpx.AsyncClient(timeout=60) as c:
        for name, data, status, code in BAD_BODIES:
            resp = await c.post(url + "/v1/completions", content=data, headers={"Content-Type": "application/json"})
            assert resp.status_code == status, (name, resp.text[:300])
            err = resp.json()["error"]
            assert err["code"] == code, (name, err)
            assert isinstance(err["message"], str) and err["message"]
            assert isinstance(err["retryable"], bool)
        assert (await c.get(url + "/no/such/path")).json()["error"]["code"] == "not_found"
        ok = await c.post(url + "/v1/completions", json={"prompt": "still here?", "max_tokens": 3})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
        metrics = (await c.get(url + "/metrics")).text
    assert 'flexlb_requests_total{code="invalid_request",outcome="rejected"}' in metrics


async def test_decisions_are_data_in_the_event_log_and_in_admin_requests(flexlb_up):
    _, state = flexlb_up("--time-scale", "0.01", "--prefill", "2", "--decode", "2")
    url = state["router_url"]
    async with httpx.AsyncClient(timeout=60) as c:
        body = (await c.post(url + "/v1/completions", json={"prompt": "explain me", "max_tokens": 6, "priority": 30})).json()
        rid = body["id"]

        async def finished_record():
            r = await c.get(url + f"/admin/requests/{rid}")
            rec = r.json()
            return rec if any(t["event"] == "request.finished" for t in rec.get("timeline", [])) else None

        record = await wait_async(finished_record, 20, "the request's record to show its finish")
        missing = await c.get(url + "/admin/requests/cmpl-nope")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    assert record["admission"]["verdict"] in ("admitted", "best_effort")
    assert record["admission"]["slo_ttft_ms"] == 300.0  # <=256 tokens: 150 ms x priority-30 multiplier 2.0
    stages = [d["stage"] for d in record["decisions"]]
    assert stages == ["decode", "prefill"]
    decode, prefill = record["decisions"]
    assert decode["policy"] == "kv-aware" and prefill["policy"] == "cost-based"
    assert {c["worker_id"] for c in prefill["candidates"]} == {"p0", "p1"}
    assert {c["worker_id"] for c in decode["candidates"]} == {"d0", "d1"}
    assert all({"prefill_ms", "wait_ms", "queue_ms", "cached_tokens"} <= set(c["components"]) for c in prefill["candidates"])
    events = [t["event"] for t in record["timeline"]]
    for earlier, later in [("arrived", "admitted"), ("admitted", "batch_dispatched"), ("batch_dispatched", "prefill_completed"),
                           ("prefill_completed", "request.finished")]:
        assert events.index(earlier) < events.index(later), events
    assert "first_token" in events
    # The same decisions are route.decided events in the log, with every candidate's score card.
    envs = await read_event_log(state["nats_url"])
    decided = [e.payload for e in envs if isinstance(e.payload, m.RouteDecided) and e.payload.request_id == rid]
    assert [d.stage for d in decided] == ["decode", "prefill"]
    assert decided[1].picked_worker_id == prefill["picked"] and len(decided[1].candidates) == 2


async def test_flexlb_up_with_two_routers_serves_through_both(flexlb_up):
    proc, state = flexlb_up("--time-scale", "0.01", "--workers", "2", "--routers", "2")
    assert len(state["router_urls"]) == 2 and "router-1" in state["pids"]
    async with httpx.AsyncClient(timeout=60) as c:
        roles = [(await c.get(u + "/healthz")).json()["role"] for u in state["router_urls"]]
        assert sorted(roles) == ["leader", "standby"]
        for u in state["router_urls"]:
            body = (await c.post(u + "/v1/completions", json={"prompt": "two routers", "max_tokens": 5})).json()
            assert body["choices"][0]["text"] == expected_text(body["id"], 5)
    assert proc.stop() == 0


async def test_http_workers_share_one_port_and_the_standbys_forward_to_the_leader(flexlb_up):
    proc, state = flexlb_up("--time-scale", "0", "--workers", "2", "--http-workers", "2")
    url, own = state["router_url"], state["http_worker_urls"]
    assert len(state["router_urls"]) == 1 and len(own) == 2 and "router-1" in state["pids"]
    async with httpx.AsyncClient(timeout=60) as c:
        roles = [(await c.get(u + "/healthz")).json()["role"] for u in own]
        assert roles == ["leader", "standby"]
        bodies = []
        for wave in range(10):  # a new connection per request: the kernel spreads them
            async with httpx.AsyncClient(timeout=60) as fresh:
                bodies += [r.json() for r in await asyncio.gather(*(
                    fresh.post(url + "/v1/completions", json={"prompt": f"shared {wave} {k}", "max_tokens": 3},
                               headers={"Connection": "close"}) for k in range(20)))]
        forwarded = [line for line in (await c.get(own[1] + "/metrics")).text.splitlines()
                     if line.startswith("flexlb_forwarded_requests_total")]
    assert all(b["choices"][0]["text"] == expected_text(b["id"], 3) for b in bodies), bodies[:2]
    assert forwarded and 0 < float(forwarded[0].split()[-1]) < 200, forwarded  # both processes took some
    assert proc.stop() == 0


async def test_a_standby_relays_tokens_that_arrive_before_the_leaders_reply(flexlb_up):
    """Instant workers stream a forwarded request's tokens to the standby, and under load they
    can get there before the leader's SubmitReply (which names the workers). Those tokens are
    the request's, not orphans: before the fix, ~0.6 % of requests at C = 32 failed
    `worker_failed` ("finished with 1 tokens but only 0 reached the router")."""
    proc, state = flexlb_up("--time-scale", "0", "--workers", "2", "--routers", "2")
    standby = state["router_urls"][1]
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=32)) as c:
        assert (await c.get(standby + "/healthz")).json()["role"] == "standby"

        async def one(i: int):
            r = await c.post(standby + "/v1/completions", json={"prompt": f"early {i % 7}", "max_tokens": 1})
            return r.status_code, r.json()

        results = []
        for wave in range(25):
            results += await asyncio.gather(*(one(wave * 32 + k) for k in range(32)))
        metrics = (await c.get(standby + "/metrics")).text
    bad = [body for status, body in results if status != 200]
    assert not bad, (len(bad), bad[:2])
    assert all(body["choices"][0]["text"] == expected_text(body["id"], 1) for _, body in results)
    orphans = [line for line in metrics.splitlines() if line.startswith("flexlb_orphan_token_chunks_total")]
    assert orphans and float(orphans[0].split()[-1]) == 0.0, orphans
    assert proc.stop() == 0


async def _get_on(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str) -> bytes:
    """One keep-alive GET /healthz on an open connection: the status line."""
    writer.write(f"GET /healthz HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    length = next(int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length"))
    await asyncio.wait_for(reader.readexactly(length), 10)
    return head.split(b"\r\n")[0]


@pytest.mark.parametrize("keep_alive_s,idle_s,kept", [(None, 6.0, True), ("1", 2.5, False)], ids=["default", "1s"])
async def test_an_idle_client_connection_outlives_a_proxys_idle_timeout(flexlb_up, keep_alive_s, idle_s, kept):
    """Behind a load balancer the router's keep-alive must outlast the proxy's idle timeout, or
    a request the proxy sends on a connection the router is closing fails (uvicorn's own 5 s
    did that; a client of our own saw httpx.ReadError). The default (75 s) keeps a connection
    idle for 6 s; FLEXLB_HTTP_KEEP_ALIVE_S=1 closes it within 2.5 s (the setting is used)."""
    env = {"FLEXLB_HTTP_KEEP_ALIVE_S": keep_alive_s} if keep_alive_s else None
    proc, state = flexlb_up("--time-scale", "0", "--workers", "1", env=env)
    host_port = state["router_url"].removeprefix("http://")
    host, port = host_port.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        assert await _get_on(reader, writer, host_port) == b"HTTP/1.1 200 OK"
        await asyncio.sleep(idle_s)
        if kept:
            assert await _get_on(reader, writer, host_port) == b"HTTP/1.1 200 OK"
        else:
            assert await asyncio.wait_for(reader.read(1), 10) == b""  # the router closed it
    finally:
        writer.close()
    assert proc.stop() == 0


async def test_a_request_finishing_in_a_long_step_is_not_settled_as_lost(flexlb_up):
    """A 16000-token prompt is prefilled in two chunks (budget 8192) of several hundred ms
    each at time scale 1. It finishes (max_tokens 1) in the second step: the engine lets go
    of it when the step begins, its outputs go out when the step's time is up. The worker
    keeps reporting it as held until then, so the router's calibration (2 missed 200 ms
    reports) does not settle it as lost (`worker_failed`) while its terminal event is due."""
    proc, state = flexlb_up("--time-scale", "1", "--workers", "1")
    url = state["router_url"]
    async with httpx.AsyncClient(timeout=httpx.Timeout(60.0)) as client:
        res = await stream_completion(client, url, {"prompt": "ab" * 8000, "max_tokens": 1})
        metrics = (await client.get(url + "/metrics")).text
    assert res["status"] == 200 and not res["errors"], res
    assert res["done"] and "".join(res["texts"]) == expected_text(res["request_id"], 1)
    settled = [line for line in metrics.splitlines() if line.startswith("flexlb_ledger_settlements_total")]
    assert settled and float(settled[0].split()[-1]) == 0.0, settled
