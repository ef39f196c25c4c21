"""Model pools (issue 27, 1) on a real stack: `flexlb up --pool a=2 --pool b=2`; each request
goes to a worker of the model it names, /v1/models lists the pools, an unknown model is 404,
a pool without a live worker 503 with Retry-After."""

from __future__ import annotations

import asyncio

import httpx

from schemas import messages as m
from tests.integration.stack import wait_all_terminal, wait_async

NUM_REQUESTS = 1000


async def test_two_pools_route_every_request_to_its_model_and_refuse_what_they_cannot_serve(flexlb_up):
    _, state = flexlb_up("--time-scale", "0.01", "--pool", "a=2", "--pool", "b=2")
    url = state["router_url"]
    model_of = {w["id"]: w["model"] for w in state["workers"]}
    assert sorted(model_of.values()) == ["a", "a", "b", "b"]
    limits = httpx.Limits(max_connections=100, max_keepalive_connections=100)
    async with httpx.AsyncClient(timeout=120, limits=limits) as c:
        models = (await c.get(url + "/v1/models")).json()
        assert {d["id"] for d in models["data"]} == {"a", "b", "flexlb-sim"}  # the pools, and the default model

        gate = asyncio.Semaphore(100)

        async def one(i: int) -> tuple[str, str]:
            model = "ab"[i % 2]
            body = {"model": model, "prompt": f"request {i} for {model}", "max_tokens": 2}
            if i % 4 == 1:  # the chat endpoint routes by model too
                body = {"model": model, "messages": [{"role": "user", "content": f"chat {i}"}], "max_tokens": 2}
            async with gate:
                path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
                resp = await c.post(url + path, json=body)
            assert resp.status_code == 200, resp.text[:300]
            out = resp.json()
            assert out["model"] == model
            return out["id"], model

        sent = dict(await asyncio.gather(*(one(i) for i in range(NUM_REQUESTS))))
        envs = await wait_all_terminal(state["nats_url"], set(sent), timeout_s=60)
        finished = {e.payload.request_id: e.payload.worker_id for e in envs if isinstance(e.payload, m.RequestFinished)}
        assert set(finished) == set(sent)
        misrouted = [(rid, sent[rid], w) for rid, w in finished.items() if model_of[w] != sent[rid]]
        assert misrouted == [], misrouted[:5]
        admitted = {e.payload.request_id: e.payload.model for e in envs if isinstance(e.payload, m.RequestAdmitted)}
        assert {rid: admitted[rid] for rid in sent} == sent  # the event log says each request's pool
        assert {model_of[w] for w in finished.values()} == {"a", "b"}

        unknown = await c.post(url + "/v1/completions", json={"model": "gpt-9", "prompt": "hi", "max_tokens": 2})
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found", unknown.text
        # No model: the default (flexlb-sim), which no worker here serves: a pool without a worker.
        default = await c.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert default.status_code == 503 and default.json()["error"]["code"] == "no_worker", default.text

        # Pool b's workers drained: b is known but has no live worker, a still serves.
        for worker_id in [w for w, model in model_of.items() if model == "b"]:
            assert (await c.post(url + f"/admin/workers/{worker_id}/drain", json={})).status_code == 200

        async def b_refused():
            r = await c.post(url + "/v1/completions", json={"model": "b", "prompt": "hi", "max_tokens": 2})
            return [r] if r.status_code == 503 else None

        [refused] = await wait_async(b_refused, 20, "model b to have no live worker")
        assert refused.json()["error"]["code"] == "no_worker" and refused.json()["error"]["retryable"] is True
        assert refused.headers["retry-after"] == "1"
        assert "b" in {d["id"] for d in (await c.get(url + "/v1/models")).json()["data"]}  # still listed
        ok = await c.post(url + "/v1/completions", json={"model": "a", "prompt": "still here", "max_tokens": 2})
        assert ok.status_code == 200
        # Readiness per pool, for a load balancer in front of each model.
        ready = {m: (await c.get(url + f"/readyz?model={m}")) for m in ("a", "b", "gpt-9")}
        assert [ready[m].status_code for m in ("a", "b", "gpt-9")] == [200, 503, 404], {m: r.text for m, r in ready.items()}
        assert "no live worker serves model 'b'" in ready["b"].json()["error"]["message"]
        metrics = (await c.get(url + "/metrics")).text
        assert 'flexlb_model_requests_total{model="a",outcome="admitted"}' in metrics
        assert 'flexlb_model_requests_total{model="b",outcome="no_worker"}' in metrics



async def test_a_standby_forwards_the_requests_model_to_the_leader(flexlb_up):
    _, state = flexlb_up("--time-scale", "0.01", "--pool", "a=1", "--pool", "b=1", "--http-workers", "2")
    standby = state["http_worker_urls"][1]  # a standby's own port: it forwards every request to the leader
    model_of = {w["id"]: w["model"] for w in state["workers"]}
    async with httpx.AsyncClient(timeout=60) as c:
        sent = {}
        for i in range(20):
            model = "ab"[i % 2]
            resp = await c.post(standby + "/v1/completions", json={"model": model, "prompt": f"fwd {i}", "max_tokens": 2})
            assert resp.status_code == 200, resp.text[:300]
            sent[resp.json()["id"]] = model
        unknown = await c.post(standby + "/v1/completions", json={"model": "gpt-9", "prompt": "hi", "max_tokens": 2})
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found", unknown.text
    envs = await wait_all_terminal(state["nats_url"], set(sent), timeout_s=60)
    finished = {e.payload.request_id: e.payload.worker_id for e in envs if isinstance(e.payload, m.RequestFinished)}
    assert {rid: model_of[w] for rid, w in finished.items()} == sent


async def test_requests_for_lora_adapters_are_served_with_their_adapter_and_keep_to_the_workers_holding_it(flexlb_up):
    _, state = flexlb_up("--time-scale", "0.05", "--workers", "4", "--lora-adapters", "sql,chat,code", "--max-loras", "1")
    url = state["router_url"]
    async with httpx.AsyncClient(timeout=60) as c:
        models = {d["id"]: d.get("parent") for d in (await c.get(url + "/v1/models")).json()["data"]}
        assert models["sql"] == models["chat"] == models["code"] == "flexlb-sim", models
        outs = []
        for i in range(24):  # one at a time: affinity alone decides (no load)
            adapter = ("sql", "chat", "code")[i % 3]
            resp = await c.post(url + "/v1/completions", json={"model": adapter, "prompt": f"p{i}", "max_tokens": 2})
            assert resp.status_code == 200, resp.text
            assert resp.json()["model"] == adapter
            outs.append((resp.json()["id"], adapter))
        records = {rid: (await c.get(url + f"/admin/requests/{rid}")).json() for rid, _ in outs}
    placed = {}
    for rid, adapter in outs:
        placed.setdefault(adapter, set()).add(records[rid]["admission"]["prefill_worker_id"])
    # One slot per worker, three adapters on four workers: each adapter stays on the worker it
    # was first loaded on, so the 24 requests cost 3 loads, not one per switch.
    assert all(len(ws) == 1 for ws in placed.values()), placed
    assert len(set().union(*placed.values())) == 3, placed
    assert all(records[rid]["decisions"][0]["stage"] == "lora" for rid, _ in outs)
