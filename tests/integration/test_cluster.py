"""Router and workers as separate processes on the session's real NATS and Redis servers:
poison messages, and a router killed and restarted while workers run."""

from __future__ import annotations

import asyncio
import secrets
from collections import Counter

import httpx
import nats
import pytest

from schemas import messages as m
from schemas.subjects import (
    DLQ_STREAM,
    HDR_DLQ_REASON,
    HDR_DLQ_SUBJECT,
    STATUS_STREAM,
    cancel_subject,
    dispatch_subject,
    dlq_subject,
    status_subject,
    token_subject,
    worker_events_subject,
)
from services.infra import free_port
from tests.integration.stack import expected_text, read_event_log, seconds_until_leader, wait_async, wait_for


def _ids(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(3)}"


def start_stack(spawn, nats_url, redis_url, num_workers=1, router_id=None, port=None, cluster=None):
    env = {"FLEXLB_NATS_URL": nats_url, "FLEXLB_REDIS_URL": redis_url}
    workers = [_ids("w") for _ in range(num_workers)]
    for w in workers:
        spawn("worker", "--id", w, "--time-scale", "0.01", env=env, name=w)
    router_id = router_id or _ids("router")
    port = port or free_port()
    cluster = cluster or _ids("c")
    router = spawn("router", "--router-id", router_id, "--port", str(port), "--cluster", cluster, env=env, name=router_id)
    url = f"http://127.0.0.1:{port}"

    def ready():
        if router.popen.poll() is not None:
            raise AssertionError(f"router exited:\n{router.tail()}")
        try:
            r = httpx.get(url + "/readyz", timeout=2)
        except httpx.HTTPError:
            return None
        return r.json() if r.status_code == 200 else None

    readiness = wait_for(ready, 60, "router ready")
    return {"url": url, "router": router, "router_id": router_id, "workers": workers, "env": env,
            "cluster": cluster, "port": port, "readiness": readiness}


def complete(url: str, prompt: str = "ping", max_tokens: int = 5) -> dict:
    r = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["text"] == expected_text(body["id"], max_tokens)
    return body


async def test_undecodable_messages_are_counted_dead_lettered_and_consumers_keep_running(spawn, nats_url, redis_url):
    stack = start_stack(spawn, nats_url, redis_url)
    router_id, worker_id = stack["router_id"], stack["workers"][0]
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    wrong_kind = m.encode(m.EnvelopeFactory("x", "b").wrap(m.CancelRequest(request_id="r", worker_id="w"), 1))
    await nc.publish(status_subject("poison-w"), b"\x00\x01 not an envelope")
    await nc.publish(status_subject("poison-w2"), wrong_kind)  # decodes, but is no status report
    await nc.publish(worker_events_subject("poison-w"), b'{"event_id": 1')
    await nc.publish(token_subject(router_id, "no-such-request"), b"junk")
    await js.publish(dispatch_subject(worker_id), b"junk command")
    await nc.flush()

    async def dead_letters():
        info = await js.stream_info(DLQ_STREAM.name, subjects_filter=">")
        return info.state.subjects or {}

    async def ours():
        subjects = await dead_letters()
        return subjects if subjects.get(dlq_subject(router_id), 0) >= 4 and subjects.get(dlq_subject(worker_id), 0) >= 1 else None

    await wait_async(ours, 30, "dead letters from the router and the worker")
    last = await js.get_last_msg(DLQ_STREAM.name, dlq_subject(worker_id))
    assert last.headers[HDR_DLQ_SUBJECT] == dispatch_subject(worker_id)
    assert "malformed" in last.headers[HDR_DLQ_REASON].lower()
    last = await js.get_last_msg(DLQ_STREAM.name, dlq_subject(router_id))
    assert last.headers[HDR_DLQ_REASON]

    # Counted: in the router's metrics and in the worker's heartbeat.
    metrics = httpx.get(stack["url"] + "/metrics").text
    for source in ("status", "events", "tokens"):
        line = next(ln for ln in metrics.splitlines() if ln.startswith(f'flexlb_undecodable_messages_total{{source="{source}"}}'))
        assert float(line.split()[-1]) >= 1, line

    async def worker_counted():
        raw = await js.get_last_msg(STATUS_STREAM.name, status_subject(worker_id))
        return m.decode(raw.data).payload.num_undecodable_messages >= 1

    await wait_async(worker_counted, 10, "the worker's heartbeat to count the poison command")
    await nc.close()
    # Every consumer kept running: the whole path still serves.
    for i in range(3):
        complete(stack["url"], f"after poison {i}")


async def test_killed_router_restarts_rebuilds_its_worker_view_and_serves(spawn, nats_url, redis_url):
    stack = start_stack(spawn, nats_url, redis_url, num_workers=2)
    complete(stack["url"], "before the crash")
    old_epoch = httpx.get(stack["url"] + "/healthz").json()["epoch"]
    stack["router"].popen.kill()  # kill -9
    stack["router"].popen.wait(10)

    env = stack["env"]
    router = spawn("router", "--router-id", stack["router_id"], "--port", str(stack["port"]), "--cluster", stack["cluster"],
                   env=env, name="router-restarted")

    def ready():
        if router.popen.poll() is not None:
            raise AssertionError(f"restarted router exited:\n{router.tail()}")
        try:
            r = httpx.get(stack["url"] + "/readyz", timeout=2)
        except httpx.HTTPError:
            return None
        return r.json() if r.status_code == 200 else None

    readiness = wait_for(ready, 60, "restarted router ready")
    # The view is rebuilt from the workers' last heartbeats, well within 2 s of the router's start.
    assert readiness["view_ready_after_ms"] is not None and readiness["view_ready_after_ms"] < 2000, readiness
    workers = httpx.get(stack["url"] + "/admin/workers").json()["workers"]
    assert {w["id"] for w in workers if w["live"]} >= set(stack["workers"])
    for w in workers:
        assert {"id", "role", "state", "pid", "host", "last_heartbeat_ns"} <= set(w)
    for i in range(4):
        complete(stack["url"], f"after the restart {i}")
    # The restarted router took a newer fencing epoch; a command from the old one is refused.
    new_epoch = httpx.get(stack["url"] + "/healthz").json()["epoch"]
    assert new_epoch > old_epoch
    victim = stack["workers"][0]
    nc = await nats.connect(nats_url)
    js = nc.jetstream()

    async def victim_knows_new_epoch():
        # The new leader tells every live worker its epoch each liveness cycle (a worker it
        # dispatched nothing to yet learns it that way); the refusal below needs that first.
        raw = await js.get_last_msg(STATUS_STREAM.name, status_subject(victim))
        return m.decode(raw.data).payload.fencing_epoch >= new_epoch

    await wait_async(victim_knows_new_epoch, 30, f"worker {victim} to report fencing epoch {new_epoch}")
    stale = m.DispatchBatch(batch_id=_ids("stale"), router_id=stack["router_id"], worker_id=victim, epoch=old_epoch,
                            requests=[m.BatchRequest(request_id=_ids("zombie"), prompt_token_ids=[1, 2, 3], max_tokens=2,
                                                     decode_worker_id=victim, token_subject="flexlb.tok.nobody.x")])
    await js.publish(dispatch_subject(victim), m.encode(m.EnvelopeFactory("old-router", "b").wrap(stale, 1)))

    async def refused():
        raw = await js.get_last_msg(STATUS_STREAM.name, status_subject(victim))
        return m.decode(raw.data).payload.num_stale_commands_refused >= 1

    await wait_async(refused, 10, "the worker to refuse the old epoch's command")
    await nc.close()

    async def ledger_empty():
        return httpx.get(stack["url"] + "/admin/ledger").json()["num_entries"] == 0

    try:
        await wait_async(ledger_empty, 20, "an empty ledger after the restart")
    except AssertionError:
        raise AssertionError(httpx.get(stack["url"] + "/admin/ledger").json())


@pytest.mark.parametrize("flag,value", [("--port", "0x"), ("--batch-size-max", "0"), ("--prefill-policy", "best-ever")])
def test_bad_router_configuration_exits_2_naming_the_setting(spawn, flag, value):
    proc = spawn("router", flag, value, name="bad-router")
    code = proc.popen.wait(30)
    assert code == 2
    out = proc.tail()
    assert flag.lstrip("-").replace("-", "_") in out or flag in out or value in out, out


async def test_unconfirmed_ledger_entries_are_evicted_by_the_ttl_sweep(spawn, nats_url, redis_url):
    import redis.asyncio as aioredis

    from services.shell.ledger import Ledger, LedgerEntry

    cluster = _ids("ttl")
    env_extra = {"FLEXLB_LEDGER_TTL_S": "1", "FLEXLB_LEDGER_SWEEP_S": "0.5"}
    stack = start_stack(spawn, nats_url, redis_url, cluster=cluster)
    # A second router with a short TTL on the same cluster (the first keeps the default).
    port = free_port()
    router = spawn("router", "--router-id", _ids("sweeper"), "--port", str(port), "--cluster", cluster,
                   env={**stack["env"], **env_extra}, name="sweeper")
    wait_for(lambda: router.popen.poll() is None and _ready(f"http://127.0.0.1:{port}"), 60, "sweeper ready")
    r = aioredis.from_url(redis_url)
    ledger = Ledger(r, cluster, ttl_s=1)
    now_ms = int(__import__("time").time() * 1000)
    await ledger.reserve([LedgerEntry(stack["workers"][0], "kv:lost-1", {"kind": "decode"}),
                          LedgerEntry(stack["workers"][0], "pf:lost-batch", {"kind": "prefill"})], now_ms)
    await r.zadd(ledger.expiry_key, {"malformed-member-without-separator": 0})  # must not stop the sweep
    assert len(await ledger.entries()) == 2

    async def gone():
        return len(await ledger.entries()) == 0 and await r.zcard(ledger.expiry_key) == 0

    await wait_async(gone, 15, "the TTL sweep to evict the unconfirmed entries")
    metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    line = next(ln for ln in metrics.splitlines() if ln.startswith("flexlb_ledger_evictions_total"))
    assert float(line.split()[-1]) >= 2
    await r.aclose()


def _ready(url: str) -> bool:
    try:
        return httpx.get(url + "/readyz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


async def test_two_routers_standby_forwards_and_takes_over_within_3_s_when_the_leader_dies(spawn, nats_url, redis_url):
    import time

    stack = start_stack(spawn, nats_url, redis_url, num_workers=2, router_id=_ids("leader"))
    a_url = stack["url"]
    port_b = free_port()
    b = spawn("router", "--router-id", _ids("standby"), "--port", str(port_b), "--cluster", stack["cluster"],
              env=stack["env"], name="standby")
    b_url = f"http://127.0.0.1:{port_b}"
    wait_for(lambda: b.popen.poll() is None and _ready(b_url), 60, "standby ready")
    a_health, b_health = httpx.get(a_url + "/healthz").json(), httpx.get(b_url + "/healthz").json()
    assert (a_health["role"], b_health["role"]) == ("leader", "standby")
    # The standby serves clients by forwarding scheduling to the leader; tokens come straight to it.
    complete(b_url, "through the standby")
    async with httpx.AsyncClient(timeout=60) as c:
        from tests.integration.stack import stream_completion

        res = await stream_completion(c, b_url, {"prompt": "streamed via standby", "max_tokens": 7})
    assert res["done"] and not res["errors"] and "".join(res["texts"]) == expected_text(res["request_id"], 7)
    # kill -9 the leader: the standby takes the lease (and a newer epoch) within 3 s.
    stack["router"].popen.kill()
    t0 = time.monotonic()
    wait_for(lambda: httpx.get(b_url + "/healthz").json()["role"] == "leader", 10, "the standby to take over",
             interval_s=0.05)
    takeover_s = time.monotonic() - t0
    print(f"takeover after {takeover_s:.2f} s")
    assert takeover_s <= 3.0
    new_epoch = httpx.get(b_url + "/healthz").json()["epoch"]
    assert new_epoch > a_health["epoch"]
    for i in range(3):
        complete(b_url, f"after the takeover {i}")
    # A command from the dead leader's epoch is refused by the workers.
    victim = stack["workers"][1]
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    stale = m.DispatchBatch(batch_id=_ids("stale"), router_id=stack["router_id"], worker_id=victim, epoch=a_health["epoch"],
                            requests=[m.BatchRequest(request_id=_ids("zombie"), prompt_token_ids=[1, 2], max_tokens=2,
                                                     decode_worker_id=victim, token_subject="flexlb.tok.nobody.x")])
    await js.publish(dispatch_subject(victim), m.encode(m.EnvelopeFactory("old-leader", "b").wrap(stale, 1)))

    async def refused():
        raw = await js.get_last_msg(STATUS_STREAM.name, status_subject(victim))
        return m.decode(raw.data).payload.num_stale_commands_refused >= 1

    await wait_async(refused, 10, "the worker to refuse the dead leader's epoch")
    await nc.close()


async def test_a_withdrawn_request_is_dropped_silently_even_if_its_command_comes_later(spawn, nats_url, redis_url):
    """An uncertain dispatch (no ack) or a zombie worker: the router withdraws what it ended."""
    stack = start_stack(spawn, nats_url, redis_url)
    worker = stack["workers"][0]
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    rid, kept = _ids("withdrawn"), _ids("kept")
    f = m.EnvelopeFactory("test-router", "b")
    await nc.publish(cancel_subject(worker), m.encode(f.wrap(m.CancelRequest(request_id=rid, worker_id=worker,
                                                                              withdraw=True), 1)))
    await nc.flush()
    await asyncio.sleep(0.3)
    batch = m.DispatchBatch(batch_id=_ids("late"), router_id="test-router", worker_id=worker, epoch=10**6, requests=[
        m.BatchRequest(request_id=r, prompt_token_ids=[5, 6, 7], max_tokens=2, decode_worker_id=worker,
                       token_subject=f"flexlb.tok.test-router.{r}") for r in (rid, kept)])
    await js.publish(dispatch_subject(worker), m.encode(f.wrap(batch, 2)))

    async def kept_finished():
        envs = await read_event_log(nats_url)
        return envs if any(isinstance(e.payload, m.RequestFinished) and e.payload.request_id == kept for e in envs) else None

    envs = await wait_async(kept_finished, 15, "the kept request to finish")
    await asyncio.sleep(0.5)
    envs = await read_event_log(nats_url)
    assert not [e for e in envs if getattr(e.payload, "request_id", None) == rid and isinstance(e.payload, m.TERMINAL_TYPES)]
    await nc.close()


async def test_a_withdrawal_is_of_one_batch_and_the_request_re_routed_back_to_the_same_worker_runs(spawn, nats_url, redis_url):
    """The router judged a worker dead (a frozen bus) and withdrew a request's batch there; the
    re-route picked the same worker again. The old batch's copy is dropped, the new one runs:
    before the withdrawal named its batch, the worker dropped both and the client hung."""
    stack = start_stack(spawn, nats_url, redis_url)
    worker = stack["workers"][0]
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    rid, kept = _ids("moved"), _ids("kept")
    old_batch, new_batch = _ids("old"), _ids("new")
    f = m.EnvelopeFactory("test-router", "b")

    def dispatch(batch_id: str, rids: tuple[str, ...]) -> m.DispatchBatch:
        return m.DispatchBatch(batch_id=batch_id, router_id="test-router", worker_id=worker, epoch=10**6, requests=[
            m.BatchRequest(request_id=r, prompt_token_ids=[5, 6, 7], max_tokens=2, decode_worker_id=worker,
                           token_subject=f"flexlb.tok.test-router.{r}") for r in rids])

    await nc.publish(cancel_subject(worker), m.encode(f.wrap(m.CancelRequest(
        request_id=rid, worker_id=worker, withdraw=True, batch_id=old_batch), 1)))
    await nc.flush()
    await asyncio.sleep(0.3)
    await js.publish(dispatch_subject(worker), m.encode(f.wrap(dispatch(old_batch, (rid, kept)), 2)))
    await js.publish(dispatch_subject(worker), m.encode(f.wrap(dispatch(new_batch, (rid,)), 3)))

    async def both_finished():
        envs = await read_event_log(nats_url)
        done = {e.payload.request_id for e in envs if isinstance(e.payload, m.RequestFinished)}
        return envs if {rid, kept} <= done else None

    await wait_async(both_finished, 15, "the kept and the re-dispatched request to finish")
    await asyncio.sleep(0.5)
    envs = await read_event_log(nats_url)
    assert [type(e.payload) for e in envs if getattr(e.payload, "request_id", None) == rid
            and isinstance(e.payload, m.TERMINAL_TYPES)] == [m.RequestFinished]  # once: the new batch's
    [started] = [e.payload for e in envs if isinstance(e.payload, m.BatchStarted) and rid in e.payload.request_ids]
    assert started.batch_id == new_batch
    await nc.close()


async def test_requests_a_dead_leader_held_undispatched_fail_retryable_at_once_on_the_standby(spawn, nats_url, redis_url):
    """The leader holds forwarded requests in its batch queue (fixed-window, a 20 s window) and is killed:
    nothing will ever dispatch them, so the standby fails them with a retryable not_ready as
    soon as it sees the leader gone, not at their 600 s deadline."""
    import time

    env = {"FLEXLB_NATS_URL": nats_url, "FLEXLB_REDIS_URL": redis_url}
    worker = _ids("w")
    spawn("worker", "--id", worker, "--time-scale", "0.01", env=env, name=worker)
    cluster = _ids("c")
    port_a, port_b = free_port(), free_port()
    leader = spawn("router", "--router-id", _ids("leader"), "--port", str(port_a), "--cluster", cluster,
                   "--batcher", "fixed-window", "--batch-wait-ms", "20000", "--batch-size-max", "64", env=env, name="leader")
    a_url, b_url = f"http://127.0.0.1:{port_a}", f"http://127.0.0.1:{port_b}"
    wait_for(lambda: leader.popen.poll() is None and _ready(a_url), 60, "leader ready")
    b = spawn("router", "--router-id", _ids("standby"), "--port", str(port_b), "--cluster", cluster,
              "--batcher", "fixed-window", "--batch-wait-ms", "20000", "--batch-size-max", "64", env=env, name="standby")
    wait_for(lambda: b.popen.poll() is None and _ready(b_url), 60, "standby ready")
    assert httpx.get(b_url + "/healthz").json()["role"] == "standby"
    async with httpx.AsyncClient(timeout=60) as c:
        tasks = [asyncio.create_task(c.post(b_url + "/v1/completions", json={"prompt": f"held {i}", "max_tokens": 3}))
                 for i in range(3)]

        await asyncio.sleep(1.0)  # admitted and queued at the leader (its window is 20 s)
        assert not any(t.done() for t in tasks)
        leader.popen.kill()
        t0 = time.monotonic()
        responses = await asyncio.wait_for(asyncio.gather(*tasks), 15)
        elapsed = time.monotonic() - t0
    for r in responses:
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "not_ready" and "had not dispatched" in r.json()["error"]["message"]
    assert elapsed < 6.0, elapsed  # takeover (~2 s) plus a lease cycle, not the 600 s deadline


async def test_a_worker_publishes_a_requests_token_chunks_again_from_an_index_when_asked(spawn, nats_url, redis_url):
    """The router's NATS node was lost with chunks in flight: it asks for them again
    (ResendTokens), and the worker publishes the same chunks, from that index on."""
    from schemas.subjects import resend_subject
    from workers.engines.sim import sim_token_id

    stack = start_stack(spawn, nats_url, redis_url)
    body = complete(stack["url"], "resend me", max_tokens=12)
    rid, worker = body["id"], stack["workers"][0]
    nc = await nats.connect(nats_url)
    got: list[m.TokensGenerated] = []
    subject = f"flexlb.tok.test-resend.{rid}"

    async def on_chunk(msg):
        got.append(m.decode_as(msg.data, m.TokensGenerated).payload)

    await nc.subscribe(subject, cb=on_chunk)
    cmd = m.ResendTokens(request_id=rid, worker_id=worker, from_index=5, token_subject=subject)
    await nc.publish(resend_subject(worker), m.encode(m.EnvelopeFactory("test", "b").wrap(cmd, 1)))

    async def the_tail():
        return got if got and got[-1].finish_reason else None

    await wait_async(the_tail, 10, "the resent chunks up to the finished one")
    assert got[0].start_index >= 5 and all(c.request_id == rid and c.worker_id == worker for c in got)
    # Chunk starts chain, and the tokens are the request's own from the first resent index.
    for a, b in zip(got, got[1:]):
        assert b.start_index == a.start_index + len(a.token_ids)
    ids = [t for c in got for t in c.token_ids]
    assert ids == [sim_token_id(rid, i) for i in range(got[0].start_index, 12)]
    # A request the worker never ran: nothing is sent (and nothing breaks).
    await nc.publish(resend_subject(worker), m.encode(m.EnvelopeFactory("test", "b").wrap(
        m.ResendTokens(request_id="never-ran", worker_id=worker, from_index=0, token_subject=subject), 2)))
    await nc.flush()
    n = len(got)
    await asyncio.sleep(0.5)
    assert len(got) == n
    await nc.close()


def start_holding_cluster(spawn, nats_url, redis_url, num_standbys: int,
                          leader_batch_wait_ms: int = 100) -> tuple[object, str, list[str]]:
    """A leader that holds work, and standbys: two workers of one engine slot each (slowed to
    0.2 of real time) and a 100 ms batch window, so most of a few clients' requests are at the
    leader at any moment: admitted and waiting for their batch window, or in its fair queue
    while both slots are taken (the log line handed_over_counts reads says how many of each it
    held at its stop). `leader_batch_wait_ms` long: the leader holds every request it admits.
    Returns the leader's process, its URL and the standbys' URLs."""
    env = {"FLEXLB_NATS_URL": nats_url, "FLEXLB_REDIS_URL": redis_url}
    for w in (_ids("w"), _ids("w")):
        spawn("worker", "--id", w, "--time-scale", "0.2", "--max-num-seqs", "1", env=env, name=w)
    cluster = ("--cluster", _ids("c"), "--batcher", "fixed-window")
    holding = (*cluster, "--batch-wait-ms", "100")
    port = free_port()
    leader = spawn("router", "--router-id", _ids("leader"), "--port", str(port), *cluster, "--batch-wait-ms",
                   str(leader_batch_wait_ms), env=env, name="leader")
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: leader.popen.poll() is None and _ready(url), 60, "leader ready")
    standby_urls = []
    for i in range(num_standbys):
        port = free_port()
        b = spawn("router", "--router-id", _ids(f"standby{i}"), "--port", str(port), *holding, env=env, name=f"standby{i}")
        standby_urls.append(f"http://127.0.0.1:{port}")
        wait_for(lambda: b.popen.poll() is None and _ready(standby_urls[-1]), 60, f"standby {i} ready")
        assert httpx.get(standby_urls[-1] + "/healthz").json()["role"] == "standby"
    return leader, url, standby_urls


async def sigterm_under_load(leader, urls: list[str], clients_per_url: int) -> tuple[float, dict[str, list[str]], list]:
    """Clients send completions through `urls` (each one after the other, no retries); the
    leader gets a SIGTERM 1.5 s in; they go on 1.5 s after a router at one of `urls` leads.
    Returns the seconds to that takeover, the ids served through each URL, and what was not."""
    import signal

    served: dict[str, list[str]] = {u: [] for u in urls}
    refused: list[tuple[int, str]] = []
    stop = asyncio.Event()

    async def load(url: str, k: int) -> None:
        async with httpx.AsyncClient(timeout=30) as c:
            i = 0
            while not stop.is_set():
                r = await c.post(url + "/v1/completions", json={"prompt": f"handoff {k} {i}", "max_tokens": 4})
                if r.status_code != 200:
                    refused.append((r.status_code, r.text))
                else:
                    body = r.json()
                    assert body["choices"][0]["text"] == expected_text(body["id"], 4)
                    served[url].append(body["id"])
                i += 1

    tasks = [asyncio.create_task(load(u, k)) for u in urls for k in range(clients_per_url)]
    await asyncio.sleep(1.5)
    leader.popen.send_signal(signal.SIGTERM)
    takeover_s = await first_to_lead(urls, 5)
    await asyncio.sleep(1.5)
    stop.set()
    await asyncio.gather(*tasks)
    return takeover_s, served, refused


async def first_to_lead(urls: list[str], limit_s: float) -> float:
    """Seconds until a router at one of `urls` leads."""
    races = [asyncio.create_task(seconds_until_leader(u, limit_s)) for u in urls]
    done, pending = await asyncio.wait(races, return_when=asyncio.FIRST_COMPLETED)
    for t in pending:
        t.cancel()
    return min(t.result() for t in done)


def handed_over_counts(leader) -> tuple[int, int, int, int]:
    """The stopped leader's count: handed over, of them a standby's, of them from its fair queue; failed."""
    import re

    [line] = [ln for ln in leader.tail(300).splitlines() if "undispatched requests to the new leader" in ln]
    return tuple(map(int, re.search(r"handed (\d+) undispatched requests to the new leader \((\d+) a standby's, "
                                    r"(\d+) from its fair queue\), failed (\d+)", line).groups()))


async def ran_once(nats_url: str, request_ids: list[str]) -> tuple[list[m.Envelope], dict[str, list]]:
    """The event log, and the requests not dispatched exactly once or not finished exactly once
    by a worker, with their events. (Not "one terminal event": a leader's calibration may add a
    spurious request.failed for a request whose request.finished it had not yet fetched; see
    fold.settle.)"""
    envs = await read_event_log(nats_url)
    dispatches = Counter(rid for e in envs if isinstance(e.payload, m.BatchDispatched) for rid in e.payload.request_ids)
    finishes = Counter(e.payload.request_id for e in envs if isinstance(e.payload, m.RequestFinished))
    wrong = {rid for rid in request_ids if (dispatches[rid], finishes[rid]) != (1, 1)}
    return envs, {rid: [(e.producer, m.tag_of(type(e.payload)), getattr(e.payload, "code", "")) for e in envs
                        if getattr(e.payload, "request_id", None) == rid or rid in getattr(e.payload, "request_ids", ())]
                  for rid in wrong}


async def test_sigterm_to_the_leader_hands_the_lease_to_a_standby_within_1_s(spawn, nats_url, redis_url):
    """A leader told to stop gives its lease up: the standby leads at its next lease cycle
    (not after the 2 s TTL) and dispatches. What the leader held undispatched of the standby's
    clients (in its batcher, in its fair queue) it hands to the standby, which takes it back
    into its clients' handles: every request is served at the first try, each dispatched and
    finished once."""
    leader, _, [b_url] = start_holding_cluster(spawn, nats_url, redis_url, num_standbys=1)
    takeover_s, served, refused = await sigterm_under_load(leader, [b_url], clients_per_url=8)
    assert leader.popen.wait(10) == 0  # a requested stop exits 0
    assert takeover_s < 1.0
    assert not refused, refused[:5]  # no client saw an error, nor needed a retry
    assert len(served[b_url]) >= 20, len(served[b_url])
    handed, of_standbys, from_fair_queue, failed = handed_over_counts(leader)
    async with httpx.AsyncClient(timeout=10) as c:
        records = [(await c.get(b_url + f"/admin/requests/{rid}")).json() for rid in served[b_url]]
    taken_back = [r for r in records if any(e["what"] == "handed_back" for e in r.get("timeline", []))]
    print(f"standby led {takeover_s:.2f} s after the SIGTERM; {len(served[b_url])} requests served, {handed} handed "
          f"over ({from_fair_queue} from the fair queue), {len(taken_back)} taken back by the standby")
    assert failed == 0 and handed == of_standbys == len(taken_back) >= 1
    _, not_once = await ran_once(nats_url, served[b_url])
    assert not_once == {}
    complete(b_url, "after the hand-off")  # the new leader dispatches


async def test_sigterm_to_the_leader_hands_another_standbys_requests_to_the_new_leader_in_that_standbys_name(
        spawn, nats_url, redis_url):
    """Two standbys, clients on both, and a leader that holds every request (a 20 s batch
    window) until it is stopped: the standby that does not take the lease learns where its
    requests went (the old leader relays the new one's SubmitReply), and its clients' tokens
    come to it from the new leader's workers. None fails, none runs twice."""
    leader, _, urls = start_holding_cluster(spawn, nats_url, redis_url, num_standbys=2, leader_batch_wait_ms=20_000)
    takeover_s, served, refused = await sigterm_under_load(leader, urls, clients_per_url=3)
    assert leader.popen.wait(10) == 0
    assert not refused, refused[:5]
    roles = {u: httpx.get(u + "/healthz").json()["role"] for u in urls}
    [follower] = [u for u in urls if roles[u] == "standby"]
    handed, of_standbys, _, failed = handed_over_counts(leader)
    envs, not_once = await ran_once(nats_url, [rid for ids in served.values() for rid in ids])
    relayed = {e.payload.request_id for e in envs if isinstance(e.payload, m.SubmitReply)} & set(served[follower])
    print(f"a standby led {takeover_s:.2f} s after the SIGTERM; served {[len(v) for v in served.values()]}; {handed} "
          f"handed over, {len(relayed)} of them the other standby's, relayed to it")
    assert takeover_s < 1.0 and failed == 0 and handed == of_standbys == 6  # every client's first request
    assert len(relayed) == 3  # the other standby's three
    assert not_once == {}


@pytest.mark.parametrize("drain_timeout_s, long_tokens", [(20.0, 120), (1.0, 2000)], ids=["finishes", "times-out"])
async def test_a_worker_told_to_stop_drains_what_it_holds_and_the_router_says_drained(spawn, nats_url, redis_url,
                                                                                       drain_timeout_s, long_tokens):
    """SIGTERM to a worker under load: it takes no new work, finishes what it holds within
    its drain timeout (the rest it fails retryable, and the router migrates it to the other
    worker: none hangs, none is lost), the router reports it drained, and when it is gone,
    stopped rather than dead."""
    import signal

    env = {"FLEXLB_NATS_URL": nats_url, "FLEXLB_REDIS_URL": redis_url}
    w_stop, w_stay = _ids("wstop"), _ids("wstay")
    victim = spawn("worker", "--id", w_stop, "--time-scale", "0.5", "--drain-timeout-s", str(drain_timeout_s), env=env,
                   name=w_stop)
    spawn("worker", "--id", w_stay, "--time-scale", "0.5", env=env, name=w_stay)
    stack = start_stack(spawn, nats_url, redis_url, num_workers=0)
    url = stack["url"]
    wait_for(lambda: {w["id"] for w in httpx.get(url + "/admin/workers").json()["workers"]
                      if w["liveness"] == "ready"} >= {w_stop, w_stay}, 30, "both workers ready")
    async with httpx.AsyncClient(timeout=120) as c:
        async def one(i: int, max_tokens: int) -> tuple[int, str, str]:
            r = await c.post(url + "/v1/completions", json={"prompt": f"drain {i}", "max_tokens": max_tokens})
            rec = (await c.get(url + f"/admin/requests/{r.headers['x-request-id']}")).json()
            worker = (rec.get("admission") or {}).get("prefill_worker_id", "")
            return r.status_code, r.text[:200], worker

        held = [asyncio.create_task(one(i, long_tokens)) for i in range(8)]
        await wait_async(lambda: _holds(url, w_stop), 30, f"{w_stop} to hold requests")
        victim.popen.send_signal(signal.SIGTERM)
        await wait_async(lambda: _state_in(url, w_stop, ("draining", "drained")), 10, f"{w_stop} reported draining")
        later = [await one(100 + i, 4) for i in range(6)]  # sent while it drains: none goes there
        results = await asyncio.gather(*held)
    assert all(status == 200 and worker != w_stop for status, _, worker in later), later
    mine = [(status, text) for status, text, worker in results if worker == w_stop]
    assert mine, results  # it held some
    if drain_timeout_s > 5:
        assert all(status == 200 for status, _ in mine), mine  # finished, not failed
        await wait_async(lambda: _state_in(url, w_stop, ("drained", "stopped")), 30, f"{w_stop} drained, then stopped")
    else:  # what it could not finish went on at the other worker (migrated mid-stream, or retried)
        assert all(status == 200 for status, _ in mine), mine
    assert victim.popen.wait(drain_timeout_s + 10) == 0
    events = await read_event_log(nats_url)
    if drain_timeout_s <= 5:
        moved = [e.payload for e in events if isinstance(e.payload, (m.RequestMigrated, m.RequestRetried))
                 and e.payload.from_worker_id == w_stop]
        assert moved and all(mv.to_worker_id == w_stay for mv in moved), moved
    drained = [e.payload for e in events if isinstance(e.payload, m.WorkerDrainChanged) and e.payload.worker_id == w_stop]
    if drain_timeout_s > 5:
        assert [(d.action, d.by) for d in drained] == [("drained", "worker")], drained
    await wait_async(lambda: _verdict(nats_url, w_stop), 20, f"the router's verdict on {w_stop}")
    assert await _verdict(nats_url, w_stop) == "stopped"


async def _holds(url: str, worker_id: str) -> bool:
    async with httpx.AsyncClient() as c:
        workers = (await c.get(url + "/admin/workers")).json()["workers"]
    return any(w["id"] == worker_id and w.get("num_running_requests", 0) > 0 for w in workers)


async def _state_in(url: str, worker_id: str, states: tuple[str, ...]) -> bool:
    async with httpx.AsyncClient() as c:
        workers = (await c.get(url + "/admin/workers")).json()["workers"]
    return next((w["state"] for w in workers if w["id"] == worker_id), "unknown") in states


async def _verdict(nats_url: str, worker_id: str) -> str | None:
    events = await read_event_log(nats_url)
    return next((e.payload.liveness for e in events if isinstance(e.payload, m.WorkerLivenessChanged)
                 and e.payload.worker_id == worker_id), None)
