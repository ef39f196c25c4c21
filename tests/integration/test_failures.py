"""What happens to requests when an engine server fails them (issue 36): retries before the
first token and circuit breakers, through `flexlb up --engine openai` in front of real
`flexlb sim-server` processes, one of which answers 500 to every generation at once while
its /health and /metrics stay fine."""

from __future__ import annotations

import asyncio
from collections import Counter

import httpx

from schemas import messages as m
from tests.integration.stack import (
    expected_text,
    make_bodies,
    read_event_log,
    run_concurrent_streams,
    start_sim_server,
    wait_for,
)
from workers.openai.agent import parse_prometheus


def metric(url: str, name: str) -> float:
    return sum(v for _, v in parse_prometheus(httpx.get(url + "/metrics", timeout=5).text).get(name, []))


def workers(router: str) -> dict[str, dict]:
    return {w["id"]: w for w in httpx.get(router + "/admin/workers", timeout=10).json()["workers"]}


def test_a_server_failing_every_generation_is_retried_around_and_its_breaker_lets_only_probes_through(spawn, flexlb_up):
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
