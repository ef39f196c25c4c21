"""The token path, cheaper: workers send a router the chunks of many requests in one message
(TokensBatch) when the dispatch names the router's batch subject. The workers run as real
processes (the NATS sim worker, and the OpenAI agent in front of `flexlb sim-server`) on the
session's nats-server, commanded directly on their dispatch subject; the router's side runs
as `flexlb up`. (The agent's HTTP client: tests/integration/test_upstream_http.py.)"""

from __future__ import annotations

import asyncio
import secrets

import httpx
import msgspec
import nats
import pytest

from schemas import messages as m
from schemas.subjects import (
    STATUS_STREAM,
    dispatch_subject,
    resend_subject,
    status_subject,
    token_batch_subject,
    token_subject,
)
from tests.integration.stack import expected_text, start_sim_server, wait_async
from workers.engines.sim import sim_token_id


# --------------------------------------------------------------------------- workers, coalesced
def _ids(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(3)}"


async def ready_worker(nc, worker: str, timeout_s: float = 60) -> None:
    js = nc.jetstream()

    async def ready():
        try:
            raw = await js.get_last_msg(STATUS_STREAM.name, status_subject(worker))
        except Exception:  # no report yet
            return False
        return m.decode(raw.data).payload.state == "ready"

    await wait_async(ready, timeout_s, f"worker {worker} ready")


def start_worker(spawn, nats_url: str, engine: str) -> str:
    worker = _ids("w")
    env = {"FLEXLB_NATS_URL": nats_url}
    if engine == "openai":
        url, _ = start_sim_server(spawn, "--time-scale", "0.05")
        spawn("worker", "--id", worker, "--engine", "openai", "--engine-url", url, env=env, name=worker)
    else:
        spawn("worker", "--id", worker, "--time-scale", "0.05", env=env, name=worker)
    return worker


class Tap:
    """Every token message on a test router's subjects, decoded."""

    def __init__(self, router: str) -> None:
        self.router = router
        self.batches: list[m.TokensBatch] = []
        self.singles: list[m.TokensGenerated] = []

    async def on_msg(self, msg) -> None:
        payload = m.decode(msg.data).payload
        if isinstance(payload, m.TokensBatch):
            assert msg.subject == token_batch_subject(self.router)
            self.batches.append(payload)
        else:
            assert msg.subject.startswith(token_subject(self.router, ""))
            self.singles.append(payload)

    def chunks(self) -> list[m.TokensGenerated]:
        return [c for b in self.batches for c in b.chunks] + self.singles


def check_every_request_whole_and_in_order(chunks: list[m.TokensGenerated], rids: list[str], max_tokens: int) -> None:
    by_request: dict[str, list[m.TokensGenerated]] = {}
    for c in chunks:
        by_request.setdefault(c.request_id, []).append(c)
    assert set(by_request) == set(rids)
    for rid, cs in by_request.items():
        starts = [c.start_index for c in cs]
        assert starts[0] == 0 and all(b.start_index == a.start_index + len(a.token_ids) for a, b in zip(cs, cs[1:])), starts
        assert [t for c in cs for t in c.token_ids] == [sim_token_id(rid, i) for i in range(max_tokens)]
        assert "".join(c.text for c in cs) == expected_text(rid, max_tokens)
        assert [c.finish_reason for c in cs][-1] == "length" and not any(c.finish_reason for c in cs[:-1])


async def dispatch(nc, worker: str, router: str, rids: list[str], max_tokens: int, batched: bool) -> None:
    f = m.EnvelopeFactory(router, "b")
    cmd = m.DispatchBatch(batch_id=_ids("b"), router_id=router, worker_id=worker, epoch=10**6, requests=[
        m.BatchRequest(request_id=r, prompt_token_ids=[5, 6, 7, i], max_tokens=max_tokens, decode_worker_id=worker,
                       token_subject=token_subject(router, r),
                       token_batch_subject=token_batch_subject(router) if batched else "") for i, r in enumerate(rids)])
    await nc.jetstream().publish(dispatch_subject(worker), m.encode(f.wrap(cmd, 1)))


@pytest.mark.parametrize("engine", ["sim", "openai"])
async def test_coalesced_messages_carry_every_requests_tokens_in_order_and_a_resend_answers_from_them(
        spawn, nats_url, engine):
    worker = start_worker(spawn, nats_url, engine)
    router = _ids("router")
    nc = await nats.connect(nats_url)
    tap = Tap(router)
    await nc.subscribe(token_batch_subject(router), cb=tap.on_msg)
    await nc.subscribe(token_subject(router, "*"), cb=tap.on_msg)
    await ready_worker(nc, worker)
    rids, max_tokens = [_ids("r") for _ in range(12)], 24
    await dispatch(nc, worker, router, rids, max_tokens, batched=True)
    await wait_async(lambda: asyncio.sleep(0, sum(c.finish_reason is not None for c in tap.chunks()) == len(rids)),
                     60, "every request's last chunk")
    assert tap.singles == []  # the router named its batch subject: nothing one chunk a message
    assert all(b.worker_id == worker and all(c.worker_id == worker for c in b.chunks) for b in tap.batches)
    check_every_request_whole_and_in_order(tap.chunks(), rids, max_tokens)
    # Coalesced: 12 requests decoding together share their messages (one per step for the
    # sim worker; for the agent what its streams brought within the flush interval).
    assert max(len({c.request_id for c in b.chunks}) for b in tap.batches) >= 4
    assert len(tap.batches) < len(tap.chunks()) / 2

    # A router that lost some asks again: plain chunks on the subject it names, from the index on.
    rid, mine = rids[3], f"flexlb.tok.{router}.again"
    again: list[m.TokensGenerated] = []

    async def on_again(msg):
        again.append(m.decode_as(msg.data, m.TokensGenerated).payload)

    await nc.subscribe(mine, cb=on_again)
    await nc.publish(resend_subject(worker), m.encode(m.EnvelopeFactory(router, "b").wrap(
        m.ResendTokens(request_id=rid, worker_id=worker, from_index=10, token_subject=mine), 2)))
    await wait_async(lambda: asyncio.sleep(0, bool(again) and again[-1].finish_reason is not None), 10, "the resent tail")
    assert again[0].start_index == 10
    check_every_request_whole_and_in_order(
        [c for c in tap.chunks() if c.request_id == rid and c.start_index < 10] + again, [rid], max_tokens)
    await nc.close()


@pytest.mark.parametrize("engine", ["sim", "openai"])
async def test_a_dispatch_without_a_batch_subject_gets_one_message_a_chunk_on_the_requests_subject(
        spawn, nats_url, engine):
    """A router from before TokensBatch: its dispatches name no batch subject, and it reads
    TokensGenerated on each request's subject only."""
    worker = start_worker(spawn, nats_url, engine)
    router = _ids("router")
    nc = await nats.connect(nats_url)
    tap = Tap(router)
    await nc.subscribe(token_batch_subject(router), cb=tap.on_msg)
    await nc.subscribe(token_subject(router, "*"), cb=tap.on_msg)
    await ready_worker(nc, worker)
    rids, max_tokens = [_ids("r") for _ in range(6)], 10
    await dispatch(nc, worker, router, rids, max_tokens, batched=False)
    await wait_async(lambda: asyncio.sleep(0, sum(c.finish_reason is not None for c in tap.chunks()) == len(rids)),
                     60, "every request's last chunk")
    assert tap.batches == []
    check_every_request_whole_and_in_order(tap.singles, rids, max_tokens)
    await nc.close()


async def test_a_step_over_the_servers_max_payload_goes_in_several_batches_in_order(spawn, tmp_path):
    """A nats-server whose max_payload (4 KiB) is below one step's chunks of 40 requests
    (~130 bytes each): the worker splits the step's TokensBatch in halves, in order, and
    every request's tokens still arrive whole."""
    import subprocess

    from services.infra import find_binary, free_port, wait_port

    port = free_port()
    conf = tmp_path / "small.conf"
    conf.write_text(f'port: {port}\nmax_payload: 4096\njetstream {{ store_dir: "{tmp_path / "js"}" }}\n')
    server = subprocess.Popen([find_binary("nats-server"), "-c", str(conf)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        wait_port(port, 10, server)
        nats_url = f"nats://127.0.0.1:{port}"
        worker, router = _ids("w"), _ids("router")
        spawn("worker", "--id", worker, "--time-scale", "0.05", env={"FLEXLB_NATS_URL": nats_url}, name=worker)
        nc = await nats.connect(nats_url)
        tap = Tap(router)
        sizes: list[int] = []

        async def on_batch(msg):
            sizes.append(len(msg.data))
            await tap.on_msg(msg)

        await nc.subscribe(token_batch_subject(router), cb=on_batch)
        await ready_worker(nc, worker)
        rids, max_tokens = [_ids("r") for _ in range(40)], 8
        for i in range(0, len(rids), 10):  # 10 a command: a command of 40 would be over the limit itself
            await dispatch(nc, worker, router, rids[i:i + 10], max_tokens, batched=True)
        await wait_async(lambda: asyncio.sleep(0, sum(c.finish_reason is not None for c in tap.chunks()) == len(rids)),
                         60, "every request's last chunk")
        check_every_request_whole_and_in_order(tap.chunks(), rids, max_tokens)
        assert max(sizes) <= 4096 and max(len(b.chunks) for b in tap.batches) >= 10
        await nc.close()
    finally:
        server.terminate()
        server.wait(10)


# --------------------------------------------------------------------------- the router's side
async def test_the_router_finds_a_duplicate_and_a_gap_inside_a_batch_by_start_index(flexlb_up):
    """Chunks that come in a TokensBatch are checked one by one, as if each had come alone:
    a copy of one the router has is dropped (the client's text is untouched), and one past a
    missing index makes the router ask the worker again and, unfilled, fail the request."""
    _, state = flexlb_up("--workers", "1", "--time-scale", "1")
    url, nats_url = state["router_url"], state["nats_url"]
    nc = await nats.connect(nats_url)
    rid_dup, rid_gap = _ids("dup"), _ids("gap")
    async with httpx.AsyncClient(timeout=120) as client:
        async def stream(rid: str, max_tokens: int, seen: asyncio.Event) -> dict:
            out: dict = {"texts": [], "errors": []}
            async with client.stream("POST", url + "/v1/completions", json={
                    "prompt": "tell me", "max_tokens": max_tokens, "stream": True, "request_id": rid}) as resp:
                assert resp.status_code == 200
                async for line in resp.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    obj = msgspec.json.decode(line[6:])
                    if "error" in obj:
                        out["errors"].append(obj["error"])
                    else:
                        out["texts"].append(obj["choices"][0]["text"])
                        seen.set()
            return out

        first_dup, first_gap = asyncio.Event(), asyncio.Event()
        dup_task = asyncio.create_task(stream(rid_dup, 300, first_dup))
        gap_task = asyncio.create_task(stream(rid_gap, 3000, first_gap))
        await asyncio.wait_for(asyncio.gather(first_dup.wait(), first_gap.wait()), 60)
        forged = m.TokensBatch(worker_id="w0", chunks=[
            m.TokensGenerated(request_id=rid_dup, worker_id="w0", start_index=0, token_ids=[90], text="Z"),
            m.TokensGenerated(request_id=rid_gap, worker_id="w0", start_index=2500, token_ids=[90], text="Z"),
        ])
        await nc.publish(token_batch_subject("router-0"), m.encode(m.EnvelopeFactory("w0", "forged").wrap(forged, 1)))
        dup, gap = await asyncio.wait_for(asyncio.gather(dup_task, gap_task), 90)
    assert not dup["errors"] and "".join(dup["texts"]) == expected_text(rid_dup, 300)
    assert [e["code"] for e in gap["errors"]] == ["worker_failed"] and "gap" in gap["errors"][0]["message"]
    assert "Z" not in "".join(gap["texts"])
    metrics = httpx.get(url + "/metrics").text
    assert any(line.startswith("flexlb_token_resends_total") and float(line.split()[-1]) >= 1
               for line in metrics.splitlines())
    await nc.close()
