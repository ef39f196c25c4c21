"""The fair queue on a real stack (issue 27, 4): work beyond what the engines run waits at the
router; a quiet tenant's requests are released ahead of a noisy tenant's backlog; sheddable
work is refused first with 429 and Retry-After; per-class and per-tenant metrics; the
journal replays the queue's decisions identically."""

from __future__ import annotations

import asyncio
import json

import httpx

from tests.integration.stack import stream_completion, wait_async
from tests.integration.test_eventlog import export, replay_json, wait_quiet


async def waiting_at_least(url: str, priority_class: str, n: int) -> bool:
    async with httpx.AsyncClient() as c:
        text = (await c.get(url + "/metrics")).text
    prefix = f'flexlb_fair_queue_waiting{{priority_class="{priority_class}"}} '
    return any(line.startswith(prefix) and float(line[len(prefix):]) >= n for line in text.splitlines())


def body(i: int, tenant: str, max_tokens: int = 40, **extra) -> dict:
    return {"prompt": f"{tenant} request {i} " + "x" * 40, "max_tokens": max_tokens, "stream": True, **extra}


async def post_stream(c: httpx.AsyncClient, url: str, b: dict, tenant: str) -> dict:
    c.headers["x-flexlb-tenant"] = tenant  # (one client per tenant: the header is the client's)
    return await stream_completion(c, url, b)


async def test_a_quiet_tenant_overtakes_a_noisy_tenants_backlog_and_the_journal_replays(flexlb_up, tmp_path):
    # 2 workers x 2 sequences, no engine buffer: 4 run at once, the rest wait at the router.
    # (the two tenants configured, with the default weight: a metrics label names configured tenants only)
    _, state = flexlb_up("--workers", "2", "--time-scale", "1", "--max-num-seqs", "2", "--fair-engine-buffer", "0",
                         "--tenant-weights", '{"noisy": 1.0, "quiet": 1.0}')
    url = state["router_url"]
    async with httpx.AsyncClient(timeout=120) as noisy, httpx.AsyncClient(timeout=120) as quiet:
        noisy_tasks = [asyncio.create_task(post_stream(noisy, url, body(i, "noisy"), "noisy")) for i in range(24)]

        await wait_async(lambda: waiting_at_least(url, "standard", 10), 30, "the noisy tenant's backlog in the fair queue")
        quiet_results = await asyncio.gather(*(post_stream(quiet, url, body(i, "quiet"), "quiet") for i in range(3)))
        noisy_results = await asyncio.gather(*noisy_tasks)
    assert all(r["done"] and not r["errors"] for r in quiet_results + noisy_results)
    # Each quiet request was released as soon as a slot freed, ahead of the noisy backlog: it
    # waited less than most of the noisy requests that were queued when it arrived.
    async with httpx.AsyncClient() as c:
        records = {r["request_id"]: (await c.get(url + f"/admin/requests/{r['request_id']}")).json()
                   for r in quiet_results + noisy_results}
        metrics = (await c.get(url + "/metrics")).text

    def waited_ms(rec: dict) -> float:
        by = {e["what"]: e["t_ms"] for e in rec["timeline"]}
        return by["admitted"] - by.get("queued", by["admitted"])

    quiet_waits = [waited_ms(records[r["request_id"]]) for r in quiet_results]
    noisy_waits = sorted(waited_ms(records[r["request_id"]]) for r in noisy_results)
    assert all("released" in {e["what"] for e in records[r["request_id"]]["timeline"]} for r in quiet_results), \
        [records[r["request_id"]]["timeline"] for r in quiet_results]
    assert max(quiet_waits) < noisy_waits[len(noisy_waits) // 2], (quiet_waits, noisy_waits)
    assert 'flexlb_tenant_requests_total{outcome="queued",tenant="noisy"}' in metrics
    assert 'flexlb_fair_queue_requests_total{outcome="released",priority_class="standard"}' in metrics
    assert 'flexlb_tenant_tokens_total{kind="output",tenant="quiet"} 120.0' in metrics

    await wait_quiet(url)
    path = str(tmp_path / "fair.jsonl.gz")
    export(state, path)
    rc, summary = replay_json(path)
    print({k: summary[k] for k in ("events", "decisions", "matched", "first_divergence")})
    assert rc == 0 and summary["errors"] == [] and summary["gaps"] == [], summary
    assert summary["matched"] == summary["decisions"] >= 27 and summary["first_divergence"] is None


async def test_sheddable_work_is_refused_first_with_retry_after_and_a_critical_request_goes_first(flexlb_up):
    params = json.dumps({"max_queued_total": 4, "starvation_bound_ms": 120_000})  # (no starvation dispatch here)
    _, state = flexlb_up("--workers", "1", "--time-scale", "1", "--max-num-seqs", "1", "--fair-engine-buffer", "0",
                         "--fairness-params", params)
    url = state["router_url"]
    async with httpx.AsyncClient(timeout=120) as c:
        first = asyncio.create_task(stream_completion(c, url, body(0, "t", max_tokens=100)))  # holds the one slot a while
        await wait_async(lambda: metric_at_least(url, "flexlb_inflight_requests ", 1), 30, "the first request running")
        shed = []
        for i in range(1, 5):  # one at a time: which is "newest" is the order they reached the router
            shed.append(asyncio.create_task(stream_completion(c, url, body(i, "t", priority_class="sheddable"))))
            await wait_async(lambda: waiting_at_least(url, "sheddable", i), 30, f"{i} sheddable requests waiting")
        # The queue is full: a standard and then a critical request each evict the newest sheddable one.
        std = asyncio.create_task(stream_completion(c, url, body(10, "t", priority=50)))
        await wait_async(lambda: waiting_at_least(url, "standard", 1), 30, "the standard request waiting")
        crit = asyncio.create_task(stream_completion(c, url, body(11, "t", priority_class="critical")))
        await wait_async(lambda: waiting_at_least(url, "critical", 1), 30, "the critical request waiting")
        # A sheddable offer into the full queue is refused at once, with Retry-After.
        late = await c.post(url + "/v1/completions", json={"prompt": "late", "max_tokens": 2, "priority": 10})
        results = await asyncio.gather(first, *shed, std, crit)
        metrics = (await c.get(url + "/metrics")).text
        timelines = {r["request_id"]: (await c.get(url + f"/admin/requests/{r['request_id']}")).json()["timeline"]
                     for r in results}
    assert late.status_code == 429 and late.json()["error"]["code"] == "shed", late.text
    assert late.headers["retry-after"] == "1"
    refused = [r for r in results if r["status"] == 429]
    assert len(refused) == 2 and all("shed" in json.dumps(r["errors"]) for r in refused), [r["errors"] for r in results]
    assert [r["status"] for r in results[1:5]] == [200, 200, 429, 429]  # the newest sheddable ones went first
    assert all(r["done"] and not r["errors"] for r in results if r["status"] == 200)
    assert 'flexlb_fair_queue_requests_total{outcome="shed",priority_class="sheddable"} 3.0' in metrics
    # The critical request was released before the standard one that arrived before it.
    crit_first, std_first = results[6]["first_at"], results[5]["first_at"]
    assert crit_first < std_first, json.dumps(timelines)


async def metric_at_least(url: str, prefix: str, n: float) -> bool:
    async with httpx.AsyncClient() as c:
        text = (await c.get(url + "/metrics")).text
    return any(line.startswith(prefix) and float(line[len(prefix):]) >= n for line in text.splitlines())
