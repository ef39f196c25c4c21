"""What happens to requests when an engine server fails them (issue 36): retries before the
first token and circuit breakers, through `flexlb up --engine openai` in front of real
`flexlb sim-server` processes, one of which answers 500 to every generation at once while
its /health and /metrics stay fine."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections import Counter

import httpx

from schemas import messages as m
from tests.integration.stack import (
    _stream_into,
    expected_text,
    make_bodies,
    read_event_log,
    run_concurrent_streams,
    start_sim_server,
    wait_all_terminal,
    wait_async,
    wait_for,
)
from workers.openai.agent import parse_prometheus


def metric(url: str, name: str) -> float:
    return sum(v for _, v in parse_prometheus(httpx.get(url + "/metrics", timeout=5).text).get(name, []))


def workers(router: str) -> dict[str, dict]:
    return {w["id"]: w for w in httpx.get(router + "/admin/workers", timeout=10).json()["workers"]}


def _replays_identically(state: dict, path: str) -> dict:
    from tests.integration.test_eventlog import export, replay_json

    export(state, path)
    rc, summary = replay_json(path)
    assert rc == 0 and summary["errors"] == [] and summary["gaps"] == [], summary
    assert summary["matched"] == summary["decisions"] and summary["first_divergence"] is None, summary
    return summary


def test_a_server_failing_every_generation_is_retried_around_and_its_breaker_lets_only_probes_through(spawn, flexlb_up,
                                                                                                     tmp_path):
    good = [start_sim_server(spawn, "--time-scale", "0.05")[0] for _ in range(3)]
    bad, _ = start_sim_server(spawn, "--time-scale", "0.05", "--fail-generations")
    _, state = flexlb_up("--engine", "openai", *[a for url in (*good, bad) for a in ("--engine-url", url)],
                         "--breaker-open-s", "2")
    router = state["router_url"]
    wait_for(lambda: sum(w["state"] == "ready" for w in workers(router).values()) == 4, 60, "4 ready openai workers")
    assert httpx.get(bad + "/health", timeout=5).status_code == 200  # it looks healthy

    bodies = make_bodies(400, seed=36)
    results = asyncio.run(run_concurrent_streams(router, bodies))
    ok = [r for r in results if r["status"] == 200 and r["done"] and not r["errors"]]
    assert len(ok) >= 0.99 * len(bodies), Counter(str(r["errors"][:1]) for r in results if r not in ok)
    for r, b in zip(results, bodies):
        if r in ok:  # the text of a request the bad server failed first: the good one's, whole, once
            assert "".join(r["texts"]) == expected_text(r["request_id"], b["max_tokens"])
    failed_first = metric(bad, "flexlb_sim_failed_generations_total")
    assert failed_first >= 5  # it got work, and failed it
    bad_id = next(wid for wid, w in workers(router).items() if w["breaker"]["state"] != "closed"
                  or w["breaker"]["times_opened"] > 0)
    view = workers(router)[bad_id]["breaker"]
    assert view["last_error"].startswith("upstream_error") and view["times_opened"] >= 1, view
    assert all(w["breaker"]["times_opened"] == 0 for wid, w in workers(router).items() if wid != bad_id)
    assert 'flexlb_worker_breaker_state{worker="%s"}' % bad_id in httpx.get(router + "/metrics", timeout=5).text

    # Open: a second wave reaches the bad server only as probes (one per half-open).
    envs_before = asyncio.run(read_event_log(state["nats_url"]))
    probes_before = sum(1 for e in envs_before if isinstance(e.payload, m.WorkerBreakerChanged)
                        and e.payload.to_state == "half_open")
    more = asyncio.run(run_concurrent_streams(router, make_bodies(100, seed=37)))
    assert sum(1 for r in more if r["done"] and not r["errors"]) >= 99
    envs = asyncio.run(read_event_log(state["nats_url"]))
    changes = [e.payload for e in envs if isinstance(e.payload, m.WorkerBreakerChanged)]
    assert {c.worker_id for c in changes} == {bad_id}
    assert ("closed", "open") in {(c.from_state, c.to_state) for c in changes}
    probes = sum(1 for c in changes if c.to_state == "half_open") - probes_before
    assert metric(bad, "flexlb_sim_failed_generations_total") - failed_first <= probes
    retried = [e.payload for e in envs if isinstance(e.payload, m.RequestRetried)]
    assert retried and {r.from_worker_id for r in retried} == {bad_id} and bad_id not in {r.to_worker_id for r in retried}
    # The journal replays identically: every outcome the breakers read, every transition, every retry.
    _replays_identically(state, str(tmp_path / "fail-fast.jsonl.gz"))


# ------------------------------------------------------------------ migration mid-stream
async def _kill_while_decoding(router: str, victim_pids: list[int], bodies: list[dict], between_s: float = 1.0,
                               min_decoding: int = 0) -> list[dict]:
    """Stream `bodies`; SIGKILL each of `victim_pids` in turn (`between_s` apart) once every
    stream has its first tokens (each is decoding, on a victim or elsewhere), or with
    `min_decoding`, once that many are decoding (have tokens, not finished). -> client results."""
    limits = httpx.Limits(max_connections=len(bodies) + 10, max_keepalive_connections=len(bodies) + 10)
    async with httpx.AsyncClient(timeout=httpx.Timeout(180.0), limits=limits) as client:
        outs = [{"request_id": None, "texts": [], "finish_reason": None, "done": False, "errors": [], "status": None}
                for _ in bodies]
        tasks = [asyncio.create_task(_stream_into(out, client, router, b)) for out, b in zip(outs, bodies)]
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        while sum(len(o["texts"]) >= 3 and not t.done() for o, t in zip(outs, tasks)) < (min_decoding or len(bodies)):
            assert min_decoding or not any(t.done() for t in tasks), "a stream ended before the kill"
            assert loop.time() - t0 < 90, f"{sum(bool(o['texts']) for o in outs)} of {len(bodies)} streams started in 90 s"
            await asyncio.sleep(0.05)
        for i, pid in enumerate(victim_pids):
            if i:
                await asyncio.sleep(between_s)
            os.kill(pid, signal.SIGKILL)
        await asyncio.wait_for(asyncio.gather(*tasks), 120)
        return outs


def _assert_whole(results: list[dict], bodies: list[dict]) -> None:
    for r, b in zip(results, bodies):
        assert r["status"] == 200 and r["done"] and not r["errors"], r
        assert r["finish_reason"] == "length"
        # the text of the same request in a run with no fault: no token missing, none twice
        assert "".join(r["texts"]) == expected_text(r["request_id"], b["max_tokens"])


def _settled(router: str, nats_url: str, results: list[dict], bodies: list[dict]) -> list[m.RequestMigrated]:
    """Every request's terminal event, its usage right (each token counted once, a
    continuation's included), the ledger empty. -> the migrations."""
    ids = {r["request_id"] for r in results}
    envs = asyncio.run(wait_all_terminal(nats_url, ids))
    finished = {e.payload.request_id: e.payload for e in envs if isinstance(e.payload, m.RequestFinished)}
    for r, b in zip(results, bodies):
        if not r["errors"]:
            assert finished[r["request_id"]].num_output_tokens == b["max_tokens"]
    wait_for(lambda: httpx.get(router + "/admin/ledger", timeout=10).json()["num_entries"] == 0, 30, "an empty ledger")
    return [e.payload for e in envs if isinstance(e.payload, m.RequestMigrated)]


def _ready(router: str, n: int) -> None:
    wait_for(lambda: sum(w["state"] == "ready" for w in workers(router).values()) == n, 60, f"{n} ready workers")


def test_kill_9_a_sim_worker_while_64_streams_decode_and_every_stream_completes_whole(flexlb_up):
    _, state = flexlb_up("--time-scale", "1", "--workers", "2")
    router = state["router_url"]
    _ready(router, 2)
    bodies = [dict(b, max_tokens=150) for b in make_bodies(64, seed=64)]
    results = asyncio.run(_kill_while_decoding(router, [state["pids"]["worker-w0"]], bodies))
    _assert_whole(results, bodies)
    moved = _settled(router, state["nats_url"], results, bodies)
    assert moved and {mv.from_worker_id for mv in moved} == {"w0"} and {mv.to_worker_id for mv in moved} == {"w1"}
    assert all(3 <= mv.num_tokens_carried < 150 for mv in moved)


def test_kill_9_a_decode_worker_of_1p2d_while_64_streams_decode_and_every_stream_completes_whole(flexlb_up):
    _, state = flexlb_up("--time-scale", "1", "--prefill", "1", "--decode", "2")
    router = state["router_url"]
    _ready(router, 3)
    victim = next(wid for wid, w in sorted(workers(router).items()) if w["role"] == "decode")
    bodies = [dict(b, max_tokens=150) for b in make_bodies(64, seed=65)]
    results = asyncio.run(_kill_while_decoding(router, [state["pids"][f"worker-{victim}"]], bodies))
    _assert_whole(results, bodies)
    moved = _settled(router, state["nats_url"], results, bodies)
    assert moved and {mv.from_worker_id for mv in moved} == {victim} and victim not in {mv.to_worker_id for mv in moved}


def test_a_killed_engine_server_behind_the_openai_agent_migrates_its_64_streams(spawn, flexlb_up):
    (url_a, proc_a), (url_b, _) = (start_sim_server(spawn, "--time-scale", "1") for _ in range(2))
    _, state = flexlb_up("--engine", "openai", "--engine-url", url_a, "--engine-url", url_b)
    router = state["router_url"]
    _ready(router, 2)
    bodies = [dict(b, max_tokens=150) for b in make_bodies(64, seed=66)]
    results = asyncio.run(_kill_while_decoding(router, [proc_a.popen.pid], bodies))
    _assert_whole(results, bodies)
    moved = _settled(router, state["nats_url"], results, bodies)
    assert moved and {mv.from_worker_id for mv in moved} == {"w0"} and {mv.to_worker_id for mv in moved} == {"w1"}


def test_a_request_that_would_migrate_past_the_limit_fails_with_a_code_saying_so(flexlb_up, tmp_path):
    _, state = flexlb_up("--time-scale", "1", "--workers", "3", "--migration-limit", "1")
    router = state["router_url"]
    _ready(router, 3)
    bodies = [dict(b, max_tokens=200) for b in make_bodies(30, seed=67)]
    # w0 dies: its streams migrate (once) to w1 or w2; then w1 dies: those it took from w0 may
    # not migrate again, its own go on to w2.
    results = asyncio.run(_kill_while_decoding(router, [state["pids"]["worker-w0"], state["pids"]["worker-w1"]], bodies,
                                               between_s=2.5))
    codes = Counter(r["errors"][0]["code"] for r in results if r["errors"])
    assert set(codes) == {"migration_limit_exceeded"}, codes
    moved = _settled(router, state["nats_url"], results, bodies)
    assert {mv.from_worker_id for mv in moved} == {"w0", "w1"}
    again = {mv.request_id for mv in moved if mv.from_worker_id == "w1"}
    failed = {r["request_id"] for r in results if r["errors"]}
    assert not again & failed  # what went on from w1 had not migrated before
    _assert_whole([r for r in results if not r["errors"]], [b for r, b in zip(results, bodies) if not r["errors"]])
    path = str(tmp_path / "migrations.jsonl.gz")
    _replays_identically(state, path)  # (the migrations are admissions in it)
    from tests.integration.test_eventlog import flexlb

    res = flexlb("explain", next(iter(again)), "--file", path, "--json")  # explain shows the migration
    assert res.returncode == 0, res.stderr
    what = [step["what"] for step in json.loads(res.stdout)["timeline"]]
    assert "request.migrated" in what and what.count("admitted") >= 2, what


# ------------------------------------------------------------------ deadlines and cancellation
async def _cancels_of(nats_url: str, rid: str) -> list:
    return [e for e in await read_event_log(nats_url)
            if isinstance(e.payload, (m.RequestCancelled, m.RequestTimedOut)) and e.payload.request_id == rid]


async def _dispatched(nats_url: str, rid: str) -> bool:
    return any(isinstance(e.payload, m.BatchDispatched) and rid in e.payload.request_ids
               for e in await read_event_log(nats_url))


def test_a_client_gone_or_past_its_deadline_is_stopped_where_it_is_through_the_leader_and_a_standby(flexlb_up):
    """One worker with one engine slot (the fair queue holds the rest) behind a leader and a
    standby. At each stage, through each router: the request is stopped where it is (the
    leader's fair queue: never dispatched; decoding: the worker cancels it in its engine)."""
    from tests.integration.test_fair_queue import body, waiting_at_least

    _, state = flexlb_up("--workers", "1", "--time-scale", "1", "--max-num-seqs", "1", "--fair-engine-buffer", "0",
                         "--routers", "2")
    leader, standby = state["router_urls"]
    nats_url = state["nats_url"]
    _ready(leader, 1)

    async def run():
        async with httpx.AsyncClient(timeout=60) as c:
            async def stream_then_leave(url: str, b: dict, after_tokens: int, headers=None) -> str:
                async with c.stream("POST", url + "/v1/completions", json=b, headers=headers or {}) as resp:
                    rid = resp.headers["x-request-id"]
                    n = 0
                    async for line in resp.aiter_lines():
                        n += line.startswith("data: ")
                        if n >= after_tokens:
                            break
                return rid  # (leaving the block closes the connection: the client is gone)

            # Decoding, through the standby then the leader: the worker cancels it in its engine.
            for url in (standby, leader):
                rid = await stream_then_leave(url, body(0, f"d{url[-4:]}", max_tokens=2000), 5)
                got = await wait_async(lambda rid=rid: _cancels_of(nats_url, rid), 20, f"{rid} cancelled at its worker")
                assert any(e.payload.worker_id == "w0" for e in got), got
            # Queued at the leader (its one slot busy), through the standby then the leader: out
            # of the fair queue, never dispatched.
            hog = asyncio.create_task(stream_then_leave(leader, body(1, "hog", max_tokens=400), 400))
            await asyncio.sleep(1.0)
            for i, url in enumerate((standby, leader)):
                waiting = asyncio.create_task(c.post(url + "/v1/completions", json={**body(2 + i, "q"), "stream": False}))
                await wait_async(lambda: waiting_at_least(leader, "standard", 1), 30, "a request in the leader's fair queue")
                waiting.cancel()  # the client goes away
                rid = None

                async def queued_cancel():
                    cancels = [e for e in await read_event_log(nats_url) if isinstance(e.payload, m.RequestCancelled)
                               and e.payload.worker_id.startswith("router")]
                    return cancels[-1] if len(cancels) > i else None
                ev = await wait_async(queued_cancel, 20, "the leader's fair queue cancelled it")
                rid = ev.payload.request_id
                assert not await _dispatched(nats_url, rid)
            # Past its deadline while decoding (X-Request-Timeout-Ms): 504-style error, stopped at the worker.
            hog.cancel()
            async with c.stream("POST", standby + "/v1/completions", json=body(9, "late", max_tokens=3000),
                                headers={"x-request-timeout-ms": "1500"}) as resp:
                rid = resp.headers.get("x-request-id")
                text = (await resp.aread()).decode()
            assert resp.status_code == 504 or '"timed_out"' in text, (resp.status_code, text[-300:])
            got = await wait_async(lambda: _cancels_of(nats_url, rid), 20, f"{rid} stopped at its worker")
            assert got

    asyncio.run(run())


def test_a_server_3x_slower_than_its_peers_gets_under_half_their_share_and_is_reported_degraded(spawn, flexlb_up):
    urls = [start_sim_server(spawn, "--time-scale", "0.2")[0] for _ in range(3)]
    slow, _ = start_sim_server(spawn, "--time-scale", "0.6")  # (a gray failure: thermal throttling, a noisy neighbour)
    _, state = flexlb_up("--engine", "openai", *[a for url in (*urls, slow) for a in ("--engine-url", url)])
    router = state["router_url"]
    _ready(router, 4)

    async def wave(i: int) -> list[dict]:
        return await run_concurrent_streams(router, [dict(b, max_tokens=60) for b in make_bodies(40, seed=100 + i)])

    async def waves(n: int, first: int = 0) -> list[dict]:
        return [r for i in range(first, first + n) for r in await wave(i)]

    # Reported degraded once the router has learned its steps (a single scale on the engine
    # profile, learned slowly on purpose: services/core/decode_model.py), load going on meanwhile.
    def degraded() -> list[str]:
        results = asyncio.run(waves(2, first=50))
        assert all(r["done"] and not r["errors"] for r in results)
        return [wid for wid, w in workers(router).items() if w["degraded"]]

    [slow_id] = wait_for(degraded, 180, "the slow server reported degraded", interval_s=0)
    view = workers(router)
    assert view[slow_id]["step_ratio"] >= 2.0 and all(w["step_ratio"] < 1.5 for wid, w in view.items() if wid != slow_id)
    assert f'flexlb_worker_degraded{{worker="{slow_id}"}} 1.0' in httpx.get(router + "/metrics", timeout=5).text

    # From then on it gets under half a healthy server's share.
    before = {url: metric(url, "flexlb_sim_requests_finished_total") for url in (*urls, slow)}
    results = asyncio.run(waves(6))
    assert all(r["done"] and not r["errors"] for r in results)
    got = {url: metric(url, "flexlb_sim_requests_finished_total") - before[url] for url in (*urls, slow)}
    healthy = sum(got[u] for u in urls) / len(urls)
    assert got[slow] < 0.5 * healthy, got


def test_a_client_gone_in_the_batch_window_or_in_prefill_is_stopped_there_through_the_leader_and_a_standby(flexlb_up):
    """The two stages the test above does not reach: a batch window held open (fixed-window,
    4 s), where the request is taken out before dispatch, and a long prefill, where the worker
    stops it in its engine before its first token."""
    _, state = flexlb_up("--workers", "1", "--time-scale", "1", "--routers", "2", "--batcher", "fixed-window",
                         "--batch-wait-ms", "4000", "--batch-size-max", "64")
    leader, standby = state["router_urls"]
    nats_url = state["nats_url"]
    _ready(leader, 1)

    names = iter(range(1000))

    async def leave_after(c: httpx.AsyncClient, url: str, body: dict, until) -> str:
        """Stream `body` (its id ours), leave (close the connection) once `until(request id)`
        holds, whether or not its response has started (a stream's starts at its dispatch)."""
        rid = f"leaver-{next(names)}"
        task = asyncio.create_task(c.post(url + "/v1/completions", json={**body, "stream": True},
                                          headers={"x-request-id": rid}))
        await wait_async(lambda: until(rid), 20, f"{rid} at the stage")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return rid

    async def run():
        async with httpx.AsyncClient(timeout=60) as c:
            # In the batch window: never dispatched, cancelled at the leader (whichever router the client used).
            for url in (standby, leader):
                async def queued(rid: str) -> bool:  # the leader has it (in its batch window: 4 s)
                    return (await c.get(leader + f"/admin/requests/{rid}")).status_code == 200
                rid = await leave_after(c, url, {"prompt": f"window {url[-5:]}", "max_tokens": 50}, queued)
                got = await wait_async(lambda rid=rid: _cancels_of(nats_url, rid), 20, f"{rid} cancelled in the window")
                assert got[0].payload.worker_id.startswith("router"), got
                await asyncio.sleep(4.5)  # past the window: had it stayed, it would have gone
                assert not await _dispatched(nats_url, rid)
            # In prefill (a 6,000-token prompt, about half a second of it): stopped at the worker
            # before its first token.
            for i, url in enumerate((standby, leader)):
                rid = await leave_after(c, url, {"prompt": f"{i} " + "p" * 6000, "max_tokens": 50},
                                        lambda rid: _dispatched(nats_url, rid))
                got = await wait_async(lambda rid=rid: _cancels_of(nats_url, rid), 20, f"{rid} cancelled in prefill")
                assert any(e.payload.worker_id == "w0" for e in got), got

    asyncio.run(run())
