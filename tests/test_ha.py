"""Issue 15's fault tests on real processes: a three-node NATS cluster losing a node (any
one, and the one the leader router talks to), and one NATS server frozen with its
connections open. Each runs >= 300 requests in flight through the fault and asserts: none
hung, every failure has a code, exactly one terminal event per request, the ledger empty
afterwards, >= 95 % succeed."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time

import httpx
import nats

from tests.stack import fault_outcome, make_bodies, settled_cleanly, stream_completion, wait_async

NUM_REQUESTS = 340
MIN_IN_FLIGHT = 300


def _bodies(seed: int) -> list[dict]:
    return [{**b, "max_tokens": 60} for b in make_bodies(NUM_REQUESTS, seed=seed, max_prompt_chars=600)]


async def _load_through(url: str, bodies: list[dict], fault, after_s: float = 1.0) -> tuple[list[dict], float, object]:
    """Start every request, wait `after_s`, run `fault()` (its result is returned), then
    wait (bounded) for every stream to end."""
    limits = httpx.Limits(max_connections=len(bodies) + 10, max_keepalive_connections=len(bodies) + 10)
    async with httpx.AsyncClient(timeout=httpx.Timeout(180.0), limits=limits) as client:
        tasks = [asyncio.create_task(stream_completion(client, url, b)) for b in bodies]
        await asyncio.sleep(after_s)
        assert not all(t.done() for t in tasks)
        fault_at = time.monotonic()
        out = await fault()
        done, hung = await asyncio.wait(tasks, timeout=150)  # bounded: nothing may hang
        if hung:
            for t in hung:
                t.cancel()
            async with httpx.AsyncClient(timeout=10) as c:
                workers = (await c.get(url + "/admin/workers")).json()
            raise AssertionError(f"{len(hung)} of {len(tasks)} streams hung; workers: {workers}")
    return [t.result() for t in tasks], fault_at, out


async def _streams_replicated(nats_url: str, replicas: int) -> bool:
    """Every FlexLB stream has `replicas` copies and each follower is current (a restarted
    node has caught up)."""
    nc = await nats.connect(nats_url.split(","), connect_timeout=2)
    try:
        infos = await nc.jetstream().streams_info()
        return bool(infos) and all(
            si.config.num_replicas == replicas and si.cluster is not None and si.cluster.leader
            and len(si.cluster.replicas or []) == replicas - 1 and all(r.current for r in si.cluster.replicas)
            for si in infos if si.config.name.startswith("FLEXLB_"))
    finally:
        await nc.close()


def _server(state: dict, name: str) -> dict:
    [server] = [s for s in state["servers"] if s["name"] == name]
    return server


def _check(summary: dict, what: str) -> None:
    print(f"{what}: {summary}")
    assert summary["in_flight"] >= MIN_IN_FLIGHT, summary
    assert summary["ok"] >= 0.95 * summary["total"], summary


def _replays_identically(state: dict, path: str) -> dict:
    """Export the run (through the cluster's URLs) and replay it: every decision matches."""
    from tests.test_eventlog import export, replay_json

    export(state, path)
    rc, summary = replay_json(path)
    print({k: summary[k] for k in ("events", "decisions", "matched", "first_divergence", "gaps", "errors")})
    assert rc == 0 and summary["errors"] == [] and summary["gaps"] == [], summary
    assert summary["decisions"] >= NUM_REQUESTS and summary["matched"] == summary["decisions"], summary
    assert summary["first_divergence"] is None
    return summary


async def _kill_node_under_load(flexlb_up, tmp_path, pick) -> None:
    proc, state = flexlb_up("--nats-cluster", "3", "--time-scale", "0.5", "--workers", "2")
    url, nats_url = state["router_url"], state["nats_url"]
    assert len(nats_url.split(",")) == 3
    await wait_async(lambda: _streams_replicated(nats_url, 3), 30, "streams with 3 current replicas")
    before = httpx.get(url + "/healthz").json()["nats_server"]
    victim = pick(state, before)
    node = _server(state, victim)
    bodies = _bodies(seed=15)

    async def kill():
        os.kill(node["pid"], signal.SIGKILL)
        return time.monotonic()

    restarted = None
    try:
        results, fault_at, _ = await _load_through(url, bodies, kill)
        summary = fault_outcome(bodies, results, fault_at)
        _check(summary, f"kill -9 {victim} (router on {before})")
        await settled_cleanly(url, nats_url, results)
        after = httpx.get(url + "/healthz").json()["nats_server"]
        assert after and after != node["url"], after  # the router is on a live node
        restarted = subprocess.Popen(node["argv"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True)
        started = time.monotonic()
        await wait_async(lambda: _streams_replicated(nats_url, 3), 60, f"{victim} to rejoin and catch up")
        print(f"{victim} rejoined, every stream current, {time.monotonic() - started:.1f} s after restart")
        async with httpx.AsyncClient(timeout=30) as c:
            r = await c.post(url + "/v1/completions", json={"prompt": "after the node came back", "max_tokens": 4})
        assert r.status_code == 200, r.text
        await asyncio.sleep(1.0)  # a liveness cycle more in the journal
        _replays_identically(state, str(tmp_path / "cluster-run.jsonl.gz"))
    finally:
        proc.stop()
        if restarted is not None:
            restarted.terminate()
            restarted.wait(10)


async def test_one_nats_node_of_three_killed_and_restarted_under_load(flexlb_up, tmp_path):
    # A node the router is not connected to: the workers' sessions there move, streams led
    # there elect a new leader.
    await _kill_node_under_load(flexlb_up, tmp_path, lambda state, router_on: next(
        s["name"] for s in state["servers"] if s["name"].startswith("nats-") and s["url"] != router_on))


async def test_the_nats_node_the_leader_router_is_connected_to_killed_under_load(flexlb_up, tmp_path):
    await _kill_node_under_load(flexlb_up, tmp_path, lambda state, router_on: next(
        s["name"] for s in state["servers"] if s["url"] == router_on))


async def test_one_nats_server_frozen_for_3_s_kills_no_healthy_worker(flexlb_up):
    # SIGSTOP: the connections stay open, nothing moves for 3 s, every heartbeat stops at once.
    # The router must see that its bus is silent (its own ping unanswered) and not declare the
    # workers dead for it.
    proc, state = flexlb_up("--time-scale", "0.5", "--workers", "2")
    url, nats_url = state["router_url"], state["nats_url"]
    pid = state["pids"]["nats-server"]
    bodies = _bodies(seed=16)

    async def freeze():
        os.kill(pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(3.0)
        finally:
            os.kill(pid, signal.SIGCONT)

    try:
        results, fault_at, _ = await _load_through(url, bodies, freeze)
        summary = fault_outcome(bodies, results, fault_at)
        _check(summary, "nats frozen 3 s")
        assert "no_worker" not in summary["failed"], summary
        await settled_cleanly(url, nats_url, results)
        workers = httpx.get(url + "/admin/workers").json()["workers"]
        assert {w["id"]: w["liveness"] for w in workers} == {"w0": "ready", "w1": "ready"}, workers
        metrics = httpx.get(url + "/metrics").text
        [silent] = [float(line.split()[-1]) for line in metrics.splitlines()
                    if line.startswith("flexlb_bus_silent_cycles_total")]
        assert silent >= 1, "the router did not notice the silent bus"
        from tests.stack import read_event_log
        from schemas import messages as m

        deaths = [e for e in await read_event_log(nats_url) if isinstance(e.payload, m.WorkerLivenessChanged)
                  and e.payload.liveness == "dead"]
        assert deaths == [], deaths
    finally:
        proc.stop()
