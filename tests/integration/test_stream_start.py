"""No refusal after 200 (issue 34, 2): a streaming response starts only once its request is
dispatched (or its first token or outcome comes). A stream the router refuses at admission,
or admits and then fails in its batcher before dispatch, gets a real HTTP status with
Retry-After; one held in the batcher gets its 200 only after its batch's dispatch was acked;
all of it for a client of the leader and of a standby that forwards to it.

The hold is the slo-budget batcher's TPOT hold (services/core/batchers/slo_budget.py): while
a long request decodes on the one worker (~6 s), a request whose TPOT target (1 ms) that
worker cannot meet waits in the router's queue. With a TTFT target of 1.5 s it is refused
there (slo_unattainable) at its emergency point, ~1.3 s after admission, the long request
still running. With 15 s (and the enqueue deadline raised to 60 s, so that its expiry does
not come first) it is held past the long request's end and dispatched at the batch loop's
next look at the queue: at its emergency point, ~14.8 s, where the load has dropped (a
worker's terminal event does not wake the batch loop: only arrivals, prefill completions and
the fair queue's room do), so it leaves instead of being refused.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import httpx

from tests.integration.stack import expected_text, wait_async, wait_for

LONG_TOKENS = 200  # the request that decodes while the others are held (seconds at --time-scale 1)
STRICT = {"slo_ttft_ms": 1500, "slo_tpot_ms": 1}  # held, then refused at its emergency point
PATIENT = {"slo_ttft_ms": 15_000, "slo_tpot_ms": 1}  # held past the long request's end, then dispatched


async def observe(c: httpx.AsyncClient, url: str, body: dict, first_token: asyncio.Event | None = None,
                  out: dict | None = None) -> dict:
    """One request as a client sees it, filled into `out` as it comes: status, headers and when
    they came (time.time_ns: the router's clock, same machine), then the error body, or the
    streamed text and [DONE]."""
    out = {} if out is None else out
    out.update({"status": None, "status_ns": None, "headers": {}, "text": "", "errors": [], "done": False})
    async with c.stream("POST", url + "/v1/completions", json=body) as resp:
        out["status_ns"] = time.time_ns()
        out["status"], out["headers"] = resp.status_code, dict(resp.headers)
        if resp.status_code != 200:
            out["error"] = json.loads(await resp.aread())["error"]
            return out
        if not body.get("stream"):
            out["text"] = (await resp.aread()) and resp.json()["choices"][0]["text"]
            return out
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                out["done"] = True
                break
            obj = json.loads(line[len("data: "):])
            if "error" in obj:
                out["errors"].append(obj["error"])
            else:
                out["text"] += obj["choices"][0]["text"]
                if first_token is not None:
                    first_token.set()
    return out


async def record(c: httpx.AsyncClient, url: str, rid: str) -> dict:
    resp = await c.get(url + f"/admin/requests/{rid}")
    return resp.json() if resp.status_code == 200 else {}


def events(rec: dict) -> dict[str, dict]:
    return {e["what"]: e for e in rec.get("timeline", [])}


def roles(urls: list[str]) -> dict[str, str]:
    out = {}
    for url in urls:
        try:
            health = httpx.get(url + "/healthz", timeout=5)
            ready = httpx.get(url + "/readyz", timeout=5).status_code == 200
        except httpx.HTTPError:
            return {}
        if not ready:
            return {}
        out[health.json()["role"]] = url
    return out if set(out) == {"leader", "standby"} else {}


async def test_streams_are_refused_with_a_status_before_dispatch_and_start_only_at_dispatch(flexlb_up):
    _, state = flexlb_up("--workers", "1", "--routers", "2", "--time-scale", "1",
                         "--batcher-params", json.dumps({"enqueue_deadline_ms": 60_000}))
    by_role = wait_for(lambda: roles(state["router_urls"]), 60, "a ready leader and a ready standby")
    leader, standby = by_role["leader"], by_role["standby"]
    tag = uuid.uuid4().hex[:8]

    def body(name: str, max_tokens: int = 5, stream: bool = True, **extra) -> dict:
        return {"prompt": f"{name} {tag}", "max_tokens": max_tokens, "stream": stream, "request_id": f"{name}-{tag}",
                **extra}

    async with httpx.AsyncClient(timeout=120) as c:
        # 1. Refused at admission (no worker can make a 0.001 ms TTFT): 429 with Retry-After, not a 200.
        for name, url in (("refused-leader", leader), ("refused-standby", standby)):
            res = await observe(c, url, body(name, slo_ttft_ms=0.001))
            assert res["status"] == 429 and res["error"]["code"] == "slo_unattainable", res
            assert res["headers"].get("retry-after") == "1", res["headers"]
            assert (await record(c, leader, f"{name}-{tag}"))["admission"]["verdict"] == "rejected"

        # 2. A long request decodes on the one worker: from now on, 1 ms TPOT targets are held.
        first_token = asyncio.Event()
        long_task = asyncio.create_task(observe(c, leader, body("long", LONG_TOKENS), first_token))
        await asyncio.wait_for(first_token.wait(), 60)
        held = {
            "strict-leader": (leader, body("strict-leader", **STRICT)),
            "strict-standby": (standby, body("strict-standby", **STRICT)),
            "patient-leader": (leader, body("patient-leader", **PATIENT)),
            "patient-standby": (standby, body("patient-standby", **PATIENT)),
            "strict-plain": (leader, body("strict-plain", stream=False, **STRICT)),  # non-streaming: as before
        }
        seen: dict[str, dict] = {name: {} for name in held}
        tasks = {name: asyncio.create_task(observe(c, url, b, out=seen[name])) for name, (url, b) in held.items()}

        # While they are held (admitted, neither dispatched nor failed), no client has a status line.
        async def all_admitted():
            recs = {n: await record(c, leader, f"{n}-{tag}") for n in held}
            return recs if all("admitted" in events(r) for r in recs.values()) else None

        await wait_async(all_admitted, 30, "every held request admitted by the leader", interval_s=0.05)
        await asyncio.sleep(0.5)  # (time for a status line sent at admission, as before, to reach the client)
        status_lines = {n: seen[n]["status"] for n in held}
        still_held = {n for n in held
                      if not {"batch_dispatched", "queue_failure"} & set(events(await record(c, leader, f"{n}-{tag}")))}
        assert {"patient-leader", "patient-standby"} <= still_held, still_held
        assert all(status_lines[n] is None for n in still_held), status_lines  # held: nothing sent yet

        results = dict(zip(tasks, await asyncio.wait_for(asyncio.gather(*tasks.values()), 120)))
        long_res = await asyncio.wait_for(long_task, 120)
        recs = {n: await record(c, leader, f"{n}-{tag}") for n in held}

    assert long_res["status"] == 200 and long_res["done"] and not long_res["errors"]
    assert long_res["text"] == expected_text(f"long-{tag}", LONG_TOKENS)

    # 3. Admitted, queued, then failed by the router's batcher before dispatch: 429 with
    # Retry-After and the JSON error body, never a 200 with an error event inside.
    for name in ("strict-leader", "strict-standby", "strict-plain"):
        res, ev = results[name], events(recs[name])
        assert "admitted" in ev and ev["queue_failure"]["code"] == "slo_unattainable", recs[name]["timeline"]
        assert "batch_dispatched" not in ev
        assert res["status"] == 429 and res["error"]["code"] == "slo_unattainable" and res["error"]["retryable"], res
        assert res["headers"]["x-request-id"] == f"{name}-{tag}"
        if name != "strict-plain":
            assert res["headers"].get("retry-after") == "1", res["headers"]

    # 4. Held, then dispatched: 200 and every token, and the status line came after the
    # dispatch was acked (the leader's record: its batch formed at t_ms, acked dispatch_ms later).
    for name in ("patient-leader", "patient-standby"):
        res, rec = results[name], recs[name]
        ev = events(rec)
        assert res["status"] == 200 and res["done"] and not res["errors"], res
        assert res["text"] == expected_text(f"{name}-{tag}", 5)
        dispatched = ev["batch_dispatched"]
        assert dispatched["t_ms"] - ev["admitted"]["t_ms"] >= 1000, rec["timeline"]  # it was held (behind the long one)
        acked_ns = rec["arrival_ns"] + (dispatched["t_ms"] + dispatched["dispatch_ms"]) * 1e6
        assert res["status_ns"] >= acked_ns - 2_000, (name, res["status_ns"] - acked_ns, rec["timeline"])
