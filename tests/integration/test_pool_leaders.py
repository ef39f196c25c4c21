"""A scheduling leader per pool (issue 27, 2) on real processes: routers started with
`--scheduling-pool` each lead one model's workers under their own Redis lease; any router
takes any request and forwards it to its pool's leader; killing one pool's leader under load
fails that pool over to its standby within 3 s, with every request answered (the retryable
refusals of the failover retried, as a client does), and the other pool sees no error."""

from __future__ import annotations

import asyncio
import secrets

import httpx

from services.infra import free_port
from tests.integration.stack import expected_text, seconds_until_leader, wait_for
from tests.integration.test_eventlog import export, replay_json


def _ids(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(3)}"


def _health(url: str) -> dict | None:
    try:
        r = httpx.get(url + "/healthz", timeout=2)
        return r.json() if r.status_code == 200 else None
    except httpx.HTTPError:
        return None


def _ready(url: str) -> bool:
    try:
        return httpx.get(url + "/readyz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


async def _one(c: httpx.AsyncClient, url: str, model: str, i: int, max_tokens: int = 4) -> tuple[str, list[int]]:
    """One completion, retried on a retryable refusal as a client would: (outcome, statuses seen)."""
    statuses = []
    for _ in range(20):
        try:
            r = await c.post(url + "/v1/completions", json={"model": model, "prompt": f"{model} {i}", "max_tokens": max_tokens},
                             timeout=20)
        except httpx.TimeoutException:
            return f"no answer in 20 s from {url} for {model} {i}", statuses
        statuses.append(r.status_code)
        if r.status_code == 200:
            body = r.json()
            assert body["model"] == model and body["choices"][0]["text"] == expected_text(body["id"], max_tokens)
            return "ok", statuses
        if not r.json()["error"]["retryable"]:
            return f"refused {r.status_code} {r.text[:200]}", statuses
        await asyncio.sleep(0.2)
    return "gave up", statuses


async def test_each_pool_has_its_leader_and_one_fails_over_within_3_s_while_the_other_sees_no_error(spawn, nats_url,
                                                                                                    redis_url, tmp_path):
    env = {"FLEXLB_NATS_URL": nats_url, "FLEXLB_REDIS_URL": redis_url}
    cluster = _ids("c")
    for model in ("a", "b"):
        for i in range(2):
            spawn("worker", "--id", _ids(f"{model}{i}"), "--time-scale", "0.05", "--served-model-name", model, env=env,
                  name=f"worker-{model}{i}")
    routers = {}
    for name, pool in (("a1", "a"), ("b1", "b"), ("a2", "a")):  # a2 starts last: pool a's standby
        port = free_port()
        proc = spawn("router", "--router-id", _ids(f"r{name}"), "--port", str(port), "--cluster", cluster,
                     "--scheduling-pool", pool, env=env, name=f"router-{name}")
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: proc.popen.poll() is None and _ready(url), 60, f"router {name} ready")
        routers[name] = (proc, url)
        if name != "a2":
            wait_for(lambda: (_health(url) or {}).get("role") == "leader", 10, f"router {name} to lead pool {pool}")
    a1, b1, a2 = (routers[n][1] for n in ("a1", "b1", "a2"))
    assert [(_health(u)["role"], _health(u)["scheduling_pool"]) for u in (a1, b1, a2)] == [
        ("leader", "a"), ("leader", "b"), ("standby", "a")]
    assert _health(a1)["epoch"] != _health(b1)["epoch"]  # one counter: every lease gets its own number
    async with httpx.AsyncClient(timeout=60) as c:
        models = {d["id"] for d in (await c.get(b1 + "/v1/models")).json()["data"]}
        assert {"a", "b"} <= models, models
        # Any router takes any model: b1 forwards pool a's requests to a1, a2 forwards both.
        for url in (a1, b1, a2):
            for model in ("a", "b"):
                assert (await _one(c, url, model, 0))[0] == "ok"
        a1_metrics = (await c.get(a1 + "/metrics")).text
        assert "flexlb_forwarded_requests_total" in a1_metrics

        # Under load through the survivors (b1 and a2), kill pool a's leader.
        results: dict[str, list] = {"a": [], "b": []}
        stop = asyncio.Event()

        async def load(model: str, url: str, k: int) -> None:
            i = 0
            while not stop.is_set():
                results[model].append(await _one(c, url, model, 1000 * k + i))
                i += 1

        tasks = [asyncio.create_task(load(model, url, k)) for k, (model, url) in
                 enumerate([("a", b1), ("a", a2), ("b", b1), ("b", a2), ("a", b1), ("b", b1)])]
        await asyncio.sleep(2.0)
        routers["a1"][0].popen.kill()
        takeover_s = await seconds_until_leader(a2, 10)
        await asyncio.sleep(3.0)
        stop.set()
        await asyncio.gather(*tasks)
    retried = sum(len(statuses) > 1 for _, statuses in results["a"])
    print(f"pool a failed over in {takeover_s:.2f} s; requests a {len(results['a'])} ({retried} retried), "
          f"b {len(results['b'])}")
    assert takeover_s <= 3.0
    assert all(outcome == "ok" for outcome, _ in results["a"]), [r for r in results["a"] if r[0] != "ok"][:5]
    assert len(results["b"]) >= 20 and all(statuses == [200] for _, statuses in results["b"]), \
        [r for r in results["b"] if r[1] != [200]][:5]
    assert _health(b1)["role"] == "leader" and _health(b1)["epoch"] < _health(a2)["epoch"]
    # Each pool's leaders journaled their own decisions: every journal replays identically.
    path = str(tmp_path / "pools.jsonl.gz")
    export({"nats_url": nats_url}, path)
    rc, summary = replay_json(path)
    print({k: summary[k] for k in ("journals", "events", "decisions", "matched", "first_divergence")})
    assert rc == 0 and summary["errors"] == [] and summary["first_divergence"] is None, summary
    assert summary["journals"] >= 3 and summary["matched"] == summary["decisions"] > 0, summary


async def test_flexlb_up_starts_a_leader_per_pool(flexlb_up):
    _, state = flexlb_up("--time-scale", "0.01", "--pool", "a=1", "--pool", "b=1", "--leader-per-pool")
    urls = state["router_urls"]
    assert [(_health(u)["role"], _health(u)["scheduling_pool"]) for u in urls] == [("leader", "a"), ("leader", "b")]
    async with httpx.AsyncClient(timeout=60) as c:
        for url in urls:  # each router takes both models: its own, and the other forwarded to its leader
            for model in ("a", "b"):
                assert (await _one(c, url, model, 1))[0] == "ok"
        workers = {w["id"] for w in (await c.get(urls[0] + "/admin/workers")).json()["workers"]}
    assert workers == {w["id"] for w in state["workers"] if w["model"] == "a"}  # its core holds its own pool only
