"""`--engine openai`: FlexLB's worker agent in front of real HTTP servers (the project's sim
engine behind `flexlb sim-server`, which speaks vLLM's /v1/completions, /metrics and KV
events). Router -> JetStream -> agent -> server, end to end, with real nats-server and
redis-server started by `flexlb up`."""

from __future__ import annotations

import asyncio
import os
import signal
from collections import Counter

import httpx
import nats

from schemas import messages as m
from schemas.subjects import kv_events_subject
from schemas.tokens import block_hashes, encode_text
from services.infra import free_port
from tests.integration.stack import (
    expected_text,
    make_bodies,
    run_concurrent_streams,
    start_sim_server,
    streams_complete_across,
    wait_all_terminal,
    wait_async,
    wait_for,
)
from workers.openai.agent import parse_prometheus


def sim_server(spawn, *extra: str, time_scale: str = "0.05") -> tuple[str, object]:
    return start_sim_server(spawn, "--time-scale", time_scale, *extra)


def metric(url: str, name: str) -> float:
    return sum(v for _, v in parse_prometheus(httpx.get(url + "/metrics", timeout=5).text).get(name, []))


def workers(router: str) -> dict[str, dict]:
    return {w["id"]: w for w in httpx.get(router + "/admin/workers", timeout=10).json()["workers"]}


def ready_fleet(router: str, n: int) -> None:
    wait_for(lambda: sum(w["state"] == "ready" for w in workers(router).values()) == n, 60, f"{n} ready openai workers")


def test_200_streamed_completions_through_the_adapter(spawn, flexlb_up):
    (url_a, _), (url_b, _) = sim_server(spawn), sim_server(spawn)
    _, state = flexlb_up("--engine", "openai", "--engine-url", url_a, "--engine-url", url_b)
    router = state["router_url"]
    ready_fleet(router, 2)
    assert {w["engine"] for w in workers(router).values()} == {"openai"}
    # The servers generate it: the text depends on the request id the agent passed on.
    bodies, results, envs, finished = streams_complete_across(state, 200, seed=13)
    for r, b in zip(results, bodies):
        assert finished[r["request_id"]].num_prompt_tokens == len(encode_text(b["prompt"]))
    prefills = [e.payload for e in envs if isinstance(e.payload, m.PrefillCompleted)]
    assert prefills and all(p.measured_ms > 0 for p in prefills)  # measured, for the predictor
    assert metric(url_a, "flexlb_sim_requests_finished_total") + metric(url_b, "flexlb_sim_requests_finished_total") == 200
    assert min(metric(url_a, "flexlb_sim_requests_finished_total"), metric(url_b, "flexlb_sim_requests_finished_total")) > 0


def test_without_migration_a_killed_server_ends_its_requests_with_a_code_and_the_rest_reroute(spawn, flexlb_up):
    # (with the defaults they go on elsewhere: tests/integration/test_failures.py)
    (url_a, _), (url_b, proc_b) = sim_server(spawn, time_scale="1"), sim_server(spawn, time_scale="1")
    _, state = flexlb_up("--engine", "openai", "--engine-url", url_a, "--engine-url", url_b, "--migration-limit", "0",
                         "--retry-limit", "0")
    router = state["router_url"]
    ready_fleet(router, 2)

    async def run():
        bodies = [dict(b, max_tokens=300) for b in make_bodies(40, seed=21)]
        streams = asyncio.create_task(run_concurrent_streams(router, bodies))
        await wait_async(lambda: asyncio.sleep(0, metric(url_b, "flexlb_sim_output_tokens_total") > 0), 60,
                         "tokens flowing from server b")
        os.kill(proc_b.popen.pid, signal.SIGKILL)
        return bodies, await asyncio.wait_for(streams, 60)  # every stream ends: none hangs

    bodies, results = asyncio.run(run())
    codes = Counter(r["errors"][0]["code"] for r in results if r["errors"])
    assert codes and set(codes) <= {"upstream_error", "upstream_refused"}, codes
    for r, b in zip(results, bodies):
        if not r["errors"]:
            assert "".join(r["texts"]) == expected_text(r["request_id"], b["max_tokens"])
    assert all(r["errors"][0]["retryable"] for r in results if r["errors"])
    wait_for(lambda: workers(router)["w1"]["state"] == "not_ready", 30, "w1 reported not ready")
    assert workers(router)["w1"]["liveness"] == "ready"  # its agent lives on
    again = asyncio.run(run_concurrent_streams(router, make_bodies(30, seed=22)))
    assert all(r["done"] and not r["errors"] and r["finish_reason"] == "length" for r in again), again
    wait_for(lambda: httpx.get(router + "/admin/ledger", timeout=10).json()["num_entries"] == 0, 30, "an empty ledger")


def test_a_cancel_reaches_the_server(spawn, flexlb_up):
    url, _ = sim_server(spawn, time_scale="1")
    _, state = flexlb_up("--engine", "openai", "--engine-url", url)
    router = state["router_url"]
    ready_fleet(router, 1)

    async def run():
        async with httpx.AsyncClient(timeout=60) as client:
            async with client.stream("POST", router + "/v1/completions",
                                     json={"prompt": "tell me a long story", "max_tokens": 3000, "stream": True}) as resp:
                assert resp.status_code == 200
                n = 0
                async for line in resp.aiter_lines():
                    n += line.startswith("data: ")
                    if n >= 3:
                        break  # the client goes away mid-stream

    asyncio.run(run())
    wait_for(lambda: metric(url, "flexlb_sim_requests_cancelled_total") >= 1, 30, "the server to see the cancel")
    assert metric(url, "vllm:num_requests_running") == 0
    assert metric(url, "flexlb_sim_output_tokens_total") < 3000


def test_a_clients_traceparent_reaches_the_engine_server(spawn, flexlb_up):
    """One Request value from the API to the engine: the header becomes Request.traceparent,
    the dispatch carries it, the agent sends it to its server (which counts POSTs with one)."""
    url, _ = sim_server(spawn)
    _, state = flexlb_up("--engine", "openai", "--engine-url", url)
    router = state["router_url"]
    ready_fleet(router, 1)
    traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    for headers in ({"traceparent": traceparent}, {}, {"traceparent": traceparent}):
        resp = httpx.post(router + "/v1/completions", json={"prompt": "hi", "max_tokens": 4}, headers=headers, timeout=60)
        assert resp.status_code == 200, resp.text
    bad = httpx.post(router + "/v1/completions", json={"prompt": "hi", "max_tokens": 4},
                     headers={"traceparent": "00-x-y-01"}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_request"
    assert metric(url, "flexlb_sim_requests_finished_total") == 3
    assert metric(url, "flexlb_sim_traced_requests_total") == 2


def test_vllm_kv_events_drive_the_exact_prefix_index(spawn, flexlb_up):
    pub, replay = free_port(), free_port()
    url, _ = sim_server(spawn, "--kv-events-endpoint", f"tcp://*:{pub}", "--kv-events-replay-endpoint", f"tcp://*:{replay}")
    _, state = flexlb_up("--engine", "openai", "--engine-url", url, "--kv-events-endpoint", f"tcp://127.0.0.1:{pub}",
                         "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{replay}")
    router = state["router_url"]
    ready_fleet(router, 1)
    prompt = "a shared system prompt that is long enough for several blocks " * 3

    async def run():
        nc = await nats.connect(state["nats_url"])
        stored: list[int] = []

        async def on_kv(msg):
            payload = m.decode(msg.data).payload
            if isinstance(payload, m.KvBlocksStored):
                stored.extend(payload.block_hashes)

        await nc.subscribe(kv_events_subject("w0"), cb=on_kv)
        first = await run_concurrent_streams(router, [{"prompt": prompt, "max_tokens": 4}])
        want = block_hashes(encode_text(prompt), 16)
        await wait_async(lambda: asyncio.sleep(0, set(want) <= set(stored)), 30, "the prompt's blocks as FlexLB KV events")
        second = await run_concurrent_streams(router, [{"prompt": prompt + " and more", "max_tokens": 4}])
        await nc.close()
        return want, first + second

    want, results = asyncio.run(run())
    assert all(r["done"] and not r["errors"] for r in results), results
    envs = asyncio.run(wait_all_terminal(state["nats_url"], {r["request_id"] for r in results}))
    second = [e.payload for e in envs if isinstance(e.payload, m.PrefillCompleted) and results[1]["request_id"] in e.payload.request_ids]
    # The agent's view of the server's cache, built from the translated events, saw the
    # first prompt's blocks when the second was released (the router consumes the same events).
    assert second and second[0].num_cached_tokens >= 16 * (len(want) - 1), second
