"""Fault injection on real processes: a worker killed with SIGKILL under load."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import string
import time

import httpx

from schemas import messages as m
from tests.integration.stack import (
    expected_text,
    make_bodies,
    read_event_log,
    run_concurrent_streams,
    stream_completion,
    terminal_counts,
    wait_all_terminal,
    wait_async,
)

DETECTION_S = 3 * 0.5  # dead_after_missed_syncs x liveness_sync_ms (the defaults)


async def test_kill_9_a_worker_mid_batch_under_load_loses_nothing(flexlb_up):
    proc, state = flexlb_up("--time-scale", "0.05", "--workers", "2", "--batch-size-max", "8")
    url = state["router_url"]
    rng = random.Random(3)
    # Long prompts build a prefill backlog on each worker, so that at the kill some of the
    # victim's batches are running and some have not started.
    bodies = [{"prompt": "".join(rng.choice(string.ascii_letters) for _ in range(rng.randint(2000, 4000))),
               "max_tokens": rng.randint(20, 60)} for _ in range(220)]
    victim_pid = state["pids"]["worker-w0"]

    async def kill_soon():
        await asyncio.sleep(0.8)
        os.kill(victim_pid, signal.SIGKILL)
        return time.time_ns()

    killer = asyncio.create_task(kill_soon())
    results = await run_concurrent_streams(url, bodies)
    killed_ns = await killer

    ok = failed = 0
    for body, res in zip(bodies, results):
        assert res["status"] == 200, res
        assert res["done"], res  # every stream ended: nothing hung
        if res["errors"]:
            assert [e["code"] for e in res["errors"]] == ["worker_failed"], res
            assert res["errors"][0]["retryable"] is True
            failed += 1
        else:
            assert "".join(res["texts"]) == expected_text(res["request_id"], body["max_tokens"])
            ok += 1
    ids = {r["request_id"] for r in results}

    envs = await wait_all_terminal(state["nats_url"], ids)
    counts = terminal_counts(envs)
    assert {i: counts[i] for i in ids} == {i: 1 for i in ids}  # exactly one each
    [dead] = [e for e in envs if isinstance(e.payload, m.WorkerLivenessChanged) and e.payload.worker_id == "w0"
              and e.payload.liveness == "dead"]
    assert (dead.time_ns - killed_ns) / 1e9 <= DETECTION_S + 2.0, (dead.time_ns - killed_ns) / 1e9
    assert dead.payload.num_rerouted > 0, dead.payload  # some of its batches had not started
    router_failures = [e for e in envs if isinstance(e.payload, m.RequestFailed) and e.payload.request_id in ids]
    assert len(router_failures) == failed == dead.payload.num_failed
    for e in router_failures:  # each failure came within detection + 2 s of the kill
        assert (e.time_ns - killed_ns) / 1e9 <= DETECTION_S + 2.0
    # The re-routed requests all finished, with every token, on the surviving worker.
    async with httpx.AsyncClient(timeout=30) as c:
        records = [(await c.get(url + f"/admin/requests/{rid}")).json() for rid in ids]
        ledger = None

        async def ledger_empty():
            nonlocal ledger
            ledger = (await c.get(url + "/admin/ledger")).json()
            return ledger["num_entries"] == 0

        await wait_async(ledger_empty, 30, "an empty ledger")
    rerouted = [r for r in records if any(t["event"] == "rerouted" for t in r["timeline"])]
    assert len(rerouted) == dead.payload.num_rerouted
    by_id = {r["request_id"]: r for r in results}
    for rec in rerouted:
        assert not by_id[rec["request_id"]]["errors"], rec
    print(f"kill -9: ok={ok} failed={failed} rerouted={dead.payload.num_rerouted} purged={dead.payload.num_purged_commands} "
          f"detected after {(dead.time_ns - killed_ns) / 1e9:.2f} s")
    assert ok + failed == len(bodies) and ok > failed
    workers = httpx.get(url + "/admin/workers").json()["workers"]
    assert {w["id"]: w["liveness"] for w in workers}["w0"] == "dead"
    assert proc.stop() == 0


async def test_cancel_racing_completion_1000_seeded_trials_one_terminal_each_and_an_empty_ledger(flexlb_up):
    _, state = flexlb_up("--time-scale", "0.01", "--workers", "2")
    url = state["router_url"]
    rng = random.Random(2024)
    trials = [(rng.randint(1, 12), rng.randint(0, 13)) for _ in range(1000)]
    for i in range(0, len(trials), 50):  # 20 long ones cut early: the cancel side happens however fast the machine
        trials[i] = (2000, 1)
    ids: list[str] = []

    async def one(client: httpx.AsyncClient, max_tokens: int, cut_after: int) -> None:
        body = {"prompt": f"race {len(ids)} " + "x" * rng.randint(1, 64), "max_tokens": max_tokens, "stream": True}
        async with client.stream("POST", url + "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            ids.append(resp.headers["x-request-id"])
            seen = 0
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if seen >= cut_after:  # the client goes away: racing the worker's completion
                    break
                seen += 1
                if line == "data: [DONE]":
                    break

    limits = httpx.Limits(max_connections=120, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        for start in range(0, len(trials), 100):
            await asyncio.gather(*(one(client, *t) for t in trials[start:start + 100]))
    assert len(set(ids)) == 1000

    async def settled():
        envs = await read_event_log(state["nats_url"])
        counts = terminal_counts(envs)
        return (envs, counts) if all(counts.get(i, 0) >= 1 for i in ids) else None

    envs, counts = await wait_async(settled, 60, "a terminal event for every trial")
    assert {i: counts[i] for i in ids} == {i: 1 for i in ids}
    kinds = {type(e.payload).__name__ for e in envs if isinstance(e.payload, m.TERMINAL_TYPES) and e.payload.request_id in set(ids)}
    assert {"RequestFinished", "RequestCancelled"} <= kinds  # both sides of the race happened

    async def ledger_empty():
        async with httpx.AsyncClient() as c:
            return (await c.get(url + "/admin/ledger")).json()["num_entries"] == 0

    await wait_async(ledger_empty, 30, "an empty ledger")


async def test_redis_restart_under_load_loses_nothing_and_the_ledger_is_rebuilt(flexlb_up):
    import subprocess

    import redis as redis_sync

    from services.infra import find_binary, wait_port

    proc, state = flexlb_up("--time-scale", "0.5", "--workers", "2")
    url, redis_url = state["router_url"], state["redis_url"]
    port = int(redis_url.rsplit(":", 1)[1].split("/")[0])
    bodies = [{**b, "max_tokens": 100} for b in make_bodies(200, seed=5, max_prompt_chars=2000)]
    load = asyncio.create_task(run_concurrent_streams(url, bodies))
    await asyncio.sleep(0.5)
    assert not load.done()  # the outage happens under load
    os.kill(state["pids"]["redis-server"], signal.SIGKILL)
    await asyncio.sleep(0.5)
    async with httpx.AsyncClient(timeout=10) as c:
        ready = await c.get(url + "/readyz")
    assert ready.status_code == 503 and "redis" in ready.json()["error"]["message"]
    await asyncio.sleep(1.0)
    restarted = subprocess.Popen([find_binary("redis-server"), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                  "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_port(port, 10, restarted)
        r = redis_sync.Redis.from_url(redis_url)

        async def rebuilt():  # the ledger comes back from the router's memory while load runs
            return sum(r.hlen(k) for k in r.scan_iter("flexlb:*:ledger:*")) > 0 or load.done()

        await wait_async(rebuilt, 10, "the ledger to be rebuilt in the new redis")
        assert not load.done()  # (rebuilt while requests were still running)
        results = await load
        for body, res in zip(bodies, results):  # nothing lost, nothing failed
            assert res["status"] == 200 and res["done"] and not res["errors"], res
            assert "".join(res["texts"]) == expected_text(res["request_id"], body["max_tokens"])
        ids = {res["request_id"] for res in results}

        async def settled():
            counts = terminal_counts(await read_event_log(state["nats_url"]))
            return all(counts.get(i, 0) == 1 for i in ids)

        await wait_async(settled, 30, "one terminal event per request")

        async def ledger_empty():
            return sum(r.hlen(k) for k in r.scan_iter("flexlb:*:ledger:*")) == 0

        await wait_async(ledger_empty, 10, "the ledger to drain (it agrees with the workers: nothing held)")
        metrics = httpx.get(url + "/metrics").text
        assert any(ln.startswith("flexlb_ledger_resyncs_total") and float(ln.split()[-1]) >= 1 for ln in metrics.splitlines())
    finally:
        proc.stop()
        restarted.terminate()
        restarted.wait(10)


async def test_nats_stopped_for_3_s_under_load_no_request_hangs(flexlb_up):
    import subprocess

    from services.infra import find_binary, wait_port

    proc, state = flexlb_up("--time-scale", "0.5", "--workers", "2")
    url, nats_url = state["router_url"], state["nats_url"]
    port = int(nats_url.rsplit(":", 1)[1])
    bodies = [{**b, "max_tokens": 100} for b in make_bodies(200, seed=6, max_prompt_chars=2000)]
    load = asyncio.create_task(run_concurrent_streams(url, bodies))
    await asyncio.sleep(0.8)
    assert not load.done()
    os.kill(state["pids"]["nats-server"], signal.SIGKILL)
    await asyncio.sleep(1.0)
    async with httpx.AsyncClient(timeout=10) as c:
        ready = await c.get(url + "/readyz")
    assert ready.status_code == 503 and "nats" in ready.json()["error"]["message"]
    await asyncio.sleep(2.0)
    restarted = subprocess.Popen([find_binary("nats-server"), "-js", "-a", "127.0.0.1", "-p", str(port), "-sd",
                                  state["nats_data_dir"]], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_port(port, 10, restarted)
        started = time.monotonic()
        results = await asyncio.wait_for(load, 120)  # bounded: nothing may hang
        elapsed = time.monotonic() - started
        codes: dict[str, int] = {}
        for body, res in zip(bodies, results):
            assert res["done"], res  # every stream ended
            if res["errors"]:
                for e in res["errors"]:
                    codes[e["code"]] = codes.get(e["code"], 0) + 1
            else:
                assert "".join(res["texts"]) == expected_text(res["request_id"], body["max_tokens"])
        msgs = sorted({e["message"][:60] for r in results for e in r["errors"]})[:4]
        print(f"nats outage: {sum(not r['errors'] for r in results)} finished, failed by code {codes} {msgs}, "
              f"all ended {elapsed:.1f} s after restart")
        assert set(codes) <= {"worker_failed", "dispatch_failed", "stream_overflow", "timed_out"}, codes
        async with httpx.AsyncClient(timeout=30) as c:
            ok = await c.post(url + "/v1/completions", json={"prompt": "after the outage", "max_tokens": 4})
        assert ok.status_code == 200  # the cluster recovered by itself
    finally:
        proc.stop()
        restarted.terminate()
        restarted.wait(10)


async def test_a_request_past_its_deadline_is_stopped_on_the_worker_and_times_out(flexlb_up):
    _, state = flexlb_up("--time-scale", "1.0", "--workers", "1")
    url = state["router_url"]
    async with httpx.AsyncClient(timeout=60) as c:
        t0 = time.monotonic()
        resp = await c.post(url + "/v1/completions", json={"prompt": "slow", "max_tokens": 400, "timeout_s": 1.0})
        elapsed = time.monotonic() - t0
        rid = resp.headers.get("x-request-id")
    assert resp.status_code == 504 and resp.json()["error"]["code"] == "timed_out", resp.text
    assert elapsed < 5.0  # 400 tokens would take ~12 s; the deadline stopped it
    async def terminal_events():
        envs = await read_event_log(state["nats_url"])
        return [e.payload for e in envs if isinstance(e.payload, m.TERMINAL_TYPES) and e.payload.request_id == rid]

    terminal = await wait_async(terminal_events, 10, "the worker's timed_out event")
    await asyncio.sleep(0.5)
    terminal = await terminal_events()
    assert len(terminal) == 1 and isinstance(terminal[0], m.RequestTimedOut) and terminal[0].worker_id == "w0"

    async def ledger_empty():
        async with httpx.AsyncClient() as c2:
            return (await c2.get(url + "/admin/ledger")).json()["num_entries"] == 0

    await wait_async(ledger_empty, 10, "an empty ledger")


async def test_a_request_the_worker_stops_reporting_without_a_terminal_event_is_settled(flexlb_up):
    """Status reports are authoritative. The worker is frozen (SIGSTOP) mid-request and two
    status reports in its name that no longer list the request are published (what a worker
    that lost a request, and whose terminal event was lost, would send): the router settles
    it — the client gets worker_failed, one terminal event, a calibration eviction event, and
    its Redis ledger entry is gone — instead of holding it until the TTL sweep."""
    import msgspec

    from schemas.subjects import status_subject

    # The frozen worker must not be declared dead (3 missed 0.5 s syncs) before calibration's
    # settlement fails the request (fold.SETTLE_GRACE_S after the two reports): 12 syncs here.
    _, state = flexlb_up("--time-scale", "1.0", "--workers", "1", env={"FLEXLB_DEAD_AFTER_MISSED_SYNCS": "12"})
    url, nats_url = state["router_url"], state["nats_url"]
    nc, reports = await _status_reports(nats_url, "w0")
    worker_pid = state["pids"]["worker-w0"]
    async with httpx.AsyncClient(timeout=60) as c:
        task = asyncio.create_task(c.post(url + "/v1/completions", json={"prompt": "settle me", "max_tokens": 600}))
        async def running():
            return any(r.running_request_ids for r in reports)

        await wait_async(running, 20, "the worker to report the request running")
        seen = len(reports)

        async def two_more():
            return len(reports) > seen + 1

        await wait_async(two_more, 10, "two more reports listing it (the router saw it running)")
        rid = reports[-1].running_request_ids[0]
        os.kill(worker_pid, signal.SIGSTOP)
        try:
            factory = m.EnvelopeFactory("w0", reports[-1].boot_id + "-probe")
            for _ in range(2):
                lost = msgspec.structs.replace(reports[-1], running_request_ids=[], num_running_requests=0)
                await nc.publish(status_subject("w0"), m.encode(factory.wrap(lost, time.time_ns())))
                await asyncio.sleep(0.1)
            resp = await asyncio.wait_for(task, 10)
        finally:
            os.kill(worker_pid, signal.SIGCONT)
        assert resp.status_code >= 500, resp.text
        assert resp.json()["error"]["code"] == "worker_failed" and "stopped reporting" in resp.json()["error"]["message"]
        ledger = (await c.get(url + "/admin/ledger")).json()
        assert not any(e.get("field") == f"kv:{rid}" for e in ledger.get("entries", [])), ledger
    await nc.close()

    async def events_for_rid():
        envs = await read_event_log(nats_url)
        terminal = [e.payload for e in envs if isinstance(e.payload, m.TERMINAL_TYPES) and e.payload.request_id == rid]
        evicted = [e.payload for e in envs if isinstance(e.payload, m.LedgerEntryEvicted) and e.payload.field == f"kv:{rid}"]
        return (terminal, evicted) if terminal and evicted else None

    terminal, evicted = await wait_async(events_for_rid, 10, "the terminal and eviction events")
    await asyncio.sleep(1.0)  # the thawed worker may still say something about it: still exactly one terminal
    terminal, evicted = await events_for_rid()
    assert len(terminal) == 1 and isinstance(terminal[0], m.RequestFailed) and terminal[0].code == "worker_failed"
    assert [e.reason for e in evicted] == ["calibration"]


async def test_a_request_left_out_of_reports_whose_terminal_event_is_only_late_is_not_failed(flexlb_up):
    """Calibration's settlement waits SETTLE_GRACE_S before failing the client: two status
    reports that leave a running request out (as a report that beats the request's terminal
    event, lagging in the pulled event stream, does) must not fail it when it then finishes."""
    import msgspec

    from schemas.subjects import status_subject

    _, state = flexlb_up("--time-scale", "1.0", "--workers", "1")
    url, nats_url = state["router_url"], state["nats_url"]
    nc, reports = await _status_reports(nats_url, "w0")
    async with httpx.AsyncClient(timeout=60) as c:
        body = {"prompt": "late, not lost", "max_tokens": 60, "stream": True}  # ~2 s here: running when settled
        task = asyncio.create_task(stream_completion(c, url, body))
        await wait_async(lambda: _listed(reports, 3), 20, "three reports listing the request (the router saw it running)")
        factory = m.EnvelopeFactory("w0", reports[-1].boot_id + "-probe")
        lost = msgspec.structs.replace(reports[-1], running_request_ids=[], num_running_requests=0)
        for _ in range(2):  # back to back: no real report (every 200 ms) between them
            await nc.publish(status_subject("w0"), m.encode(factory.wrap(lost, time.time_ns())))
        res = await asyncio.wait_for(task, 30)
        metrics = (await c.get(url + "/metrics")).text
    await nc.close()
    assert res["status"] == 200 and res["done"] and not res["errors"], res
    assert "".join(res["texts"]) == expected_text(res["request_id"], 60)
    assert "flexlb_ledger_settlements_total 1.0" in metrics  # it was settled, and still not failed


async def _status_reports(nats_url: str, worker_id: str):
    """A connection to the bus and the list the worker's status reports are appended to as they come."""
    import nats

    from schemas.subjects import status_subject

    nc = await nats.connect(nats_url)
    reports: list[m.WorkerStatusReported] = []

    async def on_status(msg):
        env = m.decode(msg.data)
        if isinstance(env.payload, m.WorkerStatusReported):
            reports.append(env.payload)

    await nc.subscribe(status_subject(worker_id), cb=on_status)
    return nc, reports


async def _listed(reports: list, n: int) -> bool:
    return sum(bool(r.running_request_ids) for r in reports) >= n


async def test_a_worker_outbound_buffer_overflow_stops_the_request_visibly(flexlb_up):
    """NATS goes away while a worker streams a long request; its outbound buffer (4 KiB
    here) fills: the worker stops the request, counts it (num_stream_overflows in its
    status), and the client gets an error with a code instead of a silent hole or a hang."""
    import subprocess

    import nats as nats_client

    from schemas.subjects import STATUS_STREAM, status_subject
    from services.infra import find_binary, wait_port

    proc, state = flexlb_up("--time-scale", "1.0", "--workers", "1", "--outbound-buffer-bytes", "4096")
    url, nats_url = state["router_url"], state["nats_url"]
    port = int(nats_url.rsplit(":", 1)[1])
    async with httpx.AsyncClient(timeout=120) as c:
        from tests.integration.stack import stream_completion

        stream = asyncio.create_task(stream_completion(c, url, {"prompt": "a long answer", "max_tokens": 3000}))
        await asyncio.sleep(1.5)  # streaming by now
        assert not stream.done()
        os.kill(state["pids"]["nats-server"], signal.SIGKILL)
        await asyncio.sleep(3.0)  # ~100 token chunks of ~200 bytes: far beyond 4 KiB
        restarted = subprocess.Popen([find_binary("nats-server"), "-js", "-a", "127.0.0.1", "-p", str(port), "-sd",
                                      state["nats_data_dir"]], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_port(port, 10, restarted)
            res = await asyncio.wait_for(stream, 60)  # bounded: it must end
            assert res["done"] and res["errors"], res
            assert res["errors"][0]["code"] in {"stream_overflow", "worker_failed"}, res["errors"]
            nc = await nats_client.connect(nats_url)
            js = nc.jetstream()

            async def overflow_counted():
                raw = await js.get_last_msg(STATUS_STREAM.name, status_subject("w0"))
                return m.decode(raw.data).payload.num_stream_overflows >= 1

            await wait_async(overflow_counted, 15, "the worker to count the overflow in its status")
            await nc.close()
        finally:
            proc.stop()
            restarted.terminate()
            restarted.wait(10)


async def test_a_frozen_worker_with_its_connection_open_is_dead_after_exactly_3_missed_cycles(flexlb_up):
    """SIGSTOP keeps the worker's TCP connection to NATS open but stops its heartbeats: the
    router's missed-cycle counter must accumulate across cycles — suspect at 1 and 2, dead at
    exactly 3 (dead_after_missed_syncs) — and a report brings it back to ready."""
    _, state = flexlb_up("--workers", "2", "--time-scale", "0.01")
    url = state["router_url"]
    pid = state["pids"]["worker-w0"]
    seen: list[tuple[str, int]] = []
    async with httpx.AsyncClient(timeout=10) as c:
        async def view():
            return {w["id"]: w for w in (await c.get(url + "/admin/workers")).json()["workers"]}

        async def both_ready():
            v = await view()
            return v.get("w0", {}).get("liveness") == "ready" and v.get("w1", {}).get("liveness") == "ready"

        await wait_async(both_ready, 20, "both workers ready")
        os.kill(pid, signal.SIGSTOP)
        try:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                v = await view()
                w0 = v["w0"]
                if not seen or seen[-1] != (w0["liveness"], w0["num_missed_syncs"]):
                    seen.append((w0["liveness"], w0["num_missed_syncs"]))
                assert v["w1"]["liveness"] in ("ready", "suspect")  # the healthy one is untouched
                if w0["liveness"] == "dead":
                    break
                await asyncio.sleep(0.05)
        finally:
            os.kill(pid, signal.SIGCONT)
        print("w0 liveness seen:", seen)
        assert seen[-1] == ("dead", 3), seen
        assert all(missed in (1, 2) for liveness, missed in seen if liveness == "suspect"), seen
        assert ("suspect", 2) in seen, seen  # the count went up across cycles, not reset each one

        async def back():
            return (await view())["w0"]["liveness"] == "ready"

        await wait_async(back, 10, "the thawed worker back to ready")
