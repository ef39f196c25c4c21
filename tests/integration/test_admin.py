"""Draining, undraining and removing workers through the admin API and `flexlb workers`."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import httpx
import redis

from schemas import messages as m
from services.infra import free_port
from tests.integration.stack import REPO, make_bodies, read_event_log, run_concurrent_streams, wait_for


def cli(*argv: str) -> tuple[int, dict]:
    out = subprocess.run([sys.executable, "-m", "services.cli", "workers", *argv], cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    return out.returncode, json.loads(out.stdout) if out.stdout.strip() else {"stderr": out.stderr}


def workers(url: str) -> dict[str, dict]:
    return {w["id"]: w for w in httpx.get(url + "/admin/workers").json()["workers"]}


async def test_drain_finishes_held_work_takes_no_new_work_and_undrain_restores(flexlb_up):
    proc, state = flexlb_up("--time-scale", "0.05", "--workers", "2")
    url = state["router_url"]
    bodies = [{**b, "max_tokens": 60} for b in make_bodies(60, seed=11)]
    load = asyncio.create_task(run_concurrent_streams(url, bodies))
    await asyncio.sleep(0.3)
    code, body = await asyncio.to_thread(cli, "drain", "w0", "--url", url)
    assert code == 0 and body["state"] in ("draining", "drained"), body
    # New work goes to w1 only, while w0 finishes what it holds.
    async with httpx.AsyncClient(timeout=60) as c:
        fresh = [(await c.post(url + "/v1/completions", json={"prompt": f"after drain {i}", "max_tokens": 2})).json()
                 for i in range(10)]
        records = [(await c.get(url + f"/admin/requests/{b['id']}")).json() for b in fresh]
    assert {r["admission"]["prefill_worker_id"] for r in records} == {"w1"}
    results = await load
    assert all(r["done"] and not r["errors"] for r in results), [r for r in results if r["errors"]][:2]
    w0 = wait_for(lambda: workers(url)["w0"]["state"] == "drained" and workers(url)["w0"], 20, "w0 to report drained")
    assert w0["num_dispatched"] > 0 and w0["num_finished"] == w0["num_dispatched"] and w0["num_held"] == 0
    r = redis.Redis.from_url(state["redis_url"])
    assert r.exists("flexlb:default:drain:w0")  # the flag lives in Redis: every replica honours it
    envs = await read_event_log(state["nats_url"])
    actions = [e.payload.action for e in envs if isinstance(e.payload, m.WorkerDrainChanged) and e.payload.worker_id == "w0"]
    assert actions[:2] == ["drain", "drained"]
    # Undrain: back in service.
    code, body = await asyncio.to_thread(cli, "undrain", "w0", "--url", url)
    assert code == 0 and body["state"] == "ready"
    async with httpx.AsyncClient(timeout=60) as c:
        # Two idle workers tie on cost and the pick among ties is a seeded draw: a few
        # requests in a row can all land on w1 (it failed once with 8 on this VM). Undrained,
        # w0 must be picked within 40; drained it never is (asserted above for 10).
        # Sent 16 at a time: with work waiting on w1, its cost rises past w0's, so the check
        # does not rest on the seeded draw among tied idle workers (a clean-clone run saw 40
        # sequential picks all on w1). Not 4: w0's predictor may still carry what it learned
        # while loaded (a 3-token prefill predicted 34 ms on w0 against 5 ms on w1, seen), and
        # 4 pending on w1 did not outweigh that in 40 picks.
        picks = []

        async def pick(i: int) -> str:
            b = (await c.post(url + "/v1/completions", json={"prompt": f"undrained {i}", "max_tokens": 20})).json()
            return (await c.get(url + f"/admin/requests/{b['id']}")).json()["admission"]["prefill_worker_id"]

        while "w0" not in picks and len(picks) < 96:
            picks += await asyncio.gather(*(pick(len(picks) + k) for k in range(16)))
    assert "w0" in picks, picks
    assert not r.exists("flexlb:default:drain:w0")
    assert proc.stop() == 0


async def test_remove_refuses_a_busy_worker_unless_forced(flexlb_up):
    _, state = flexlb_up("--time-scale", "0.2", "--workers", "2", "--batch-size-max", "4")
    url = state["router_url"]
    bodies = [{**b, "max_tokens": 100} for b in make_bodies(80, seed=12, max_prompt_chars=3000)]
    load = asyncio.create_task(run_concurrent_streams(url, bodies))
    await asyncio.to_thread(wait_for, lambda: workers(url)["w0"]["num_held"] > 0, 20, "w0 to hold work")
    code, body = await asyncio.to_thread(cli, "remove", "w0", "--url", url)
    assert code == 1 and body["error"]["code"] == "conflict", body
    assert "w0" in workers(url)  # nothing changed
    code, body = await asyncio.to_thread(cli, "remove", "w0", "--force", "--url", url)
    moved = body.get("num_requests_moved", 0)
    assert code == 0 and body["removed"] and moved > 0, body
    results = await load
    for res in results:  # every stream ends: finished, or failed with a retryable code
        assert res["done"], res
        assert all(e["code"] == "worker_failed" and e["retryable"] for e in res["errors"]), res
    # Only what w0 held can fail (started there); everything else, w1's share and w0's
    # re-routed queue, finishes. Fewest-pending spreads the 80 evenly, so w0 may hold 40.
    failed = sum(bool(r["errors"]) for r in results)
    assert failed <= moved < len(results), (failed, moved)
    code, body = await asyncio.to_thread(cli, "remove", "no-such-worker", "--url", url)
    assert code == 1 and body["error"]["code"] == "not_found"


async def test_admin_api_needs_the_bearer_token_and_nothing_changes_without_it(spawn, nats_url, redis_url):
    port = free_port()
    env = {"FLEXLB_NATS_URL": nats_url, "FLEXLB_REDIS_URL": redis_url, "FLEXLB_ADMIN_TOKEN": "s3cret",
           "FLEXLB_CLUSTER": "tok", "FLEXLB_ROUTER_ID": "router-tok"}
    spawn("worker", "--id", "tok-w0", "--time-scale", "0.01", env=env, name="tok-w0")
    router = spawn("router", "--port", str(port), env=env, name="router-tok")
    url = f"http://127.0.0.1:{port}"

    def up():
        assert router.popen.poll() is None, router.tail()
        try:
            return httpx.get(url + "/readyz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(up, 60, "router ready")
    r = redis.Redis.from_url(redis_url)
    for method, path in [("POST", "/admin/workers/tok-w0/drain"), ("DELETE", "/admin/workers/tok-w0"),
                         ("GET", "/admin/workers"), ("GET", "/admin/ledger")]:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            resp = httpx.request(method, url + path, headers=headers)
            assert resp.status_code == 401 and resp.json()["error"]["code"] == "unauthorized", (path, headers)
    assert not r.exists("flexlb:tok:drain:tok-w0")
    auth = {"Authorization": "Bearer s3cret"}
    # With the token, a state change a web page could send cross-site is still refused: a
    # simple request (text/plain, a form), an Origin of another site, Sec-Fetch-Site cross-site.
    for extra, body in (({}, None), ({"Content-Type": "text/plain"}, b"{}"),
                        ({"Content-Type": "application/x-www-form-urlencoded"}, b"a=1"),
                        ({"Content-Type": "application/json", "Origin": "http://evil.example"}, b"{}"),
                        ({"Content-Type": "application/json", "Sec-Fetch-Site": "cross-site"}, b"{}")):
        resp = httpx.post(url + "/admin/workers/tok-w0/drain", headers={**auth, **extra}, content=body)
        assert resp.status_code == 403 and resp.json()["error"]["code"] == "forbidden", (extra, resp.text)
        assert not r.exists("flexlb:tok:drain:tok-w0")
    same_origin = {**auth, "Origin": url}
    ok = httpx.post(url + "/admin/workers/tok-w0/drain", headers=same_origin, json={})
    assert ok.status_code == 200 and r.exists("flexlb:tok:drain:tok-w0")
    # Beyond loopback without a token the router refuses to start.
    bad = spawn("router", "--host", "0.0.0.0", "--port", str(free_port()),
                env={k: v for k, v in env.items() if k != "FLEXLB_ADMIN_TOKEN"}, name="router-open")
    assert bad.popen.wait(30) == 2 and "admin_token" in bad.tail()
