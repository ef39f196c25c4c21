"""The token path, cheaper: workers send a router the chunks of many requests in one message
(TokensBatch) when the dispatch names the router's batch subject, and the OpenAI agent reads
its servers' SSE streams with a lean HTTP/1.1 client (workers/upstream_http.py).

The client is driven against a real TCP server scripted here (split and merged chunks, an
error chunk, refusals, a cut stream, a stall, keep-alive reuse and a server that drops an
idle connection). The workers run as real processes (the NATS sim worker, and the OpenAI
agent in front of `flexlb sim-server`) on the session's nats-server, commanded directly on
their dispatch subject; the router's side runs as `flexlb up`."""

from __future__ import annotations

import asyncio
import random
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
from tests.stack import expected_text, start_sim_server, wait_async
from workers.engines.sim import sim_token_id
from workers.upstream_http import UpstreamClient, UpstreamFailure


# --------------------------------------------------------------------------- the lean client
class Script:
    """A scripted HTTP server: each request (head and body read) is answered by `answer`
    (an async function of the writer, the request's bytes, and its number on the
    connection). Counts connections; keeps every request it read."""

    def __init__(self, answer) -> None:
        self.answer = answer
        self.num_connections = 0
        self.requests: list[bytes] = []
        self.closed_by_client = asyncio.Event()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.num_connections += 1
        self.reader = reader  # the latest connection's, for an answer that waits for the client to go
        n = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                request = head + await reader.readexactly(length)
                self.requests.append(request)
                n += 1
                if not await self.answer(writer, request, n):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            self.closed_by_client.set()
        finally:
            writer.close()

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc) -> None:
        self.server.close()


def sse(*payloads: bytes, crlf: bool = False) -> bytes:
    end = b"\r\n" if crlf else b"\n"
    return b"".join(b"data: " + p + end + end for p in payloads)


def chunked(body: bytes, cut: int | None = None) -> bytes:
    """`body` as one HTTP chunk and the terminator; `cut`: only the first `cut` bytes of it."""
    out = b"%x\r\n" % len(body) + body + b"\r\n0\r\n\r\n"
    return out if cut is None else out[:cut]


HEAD_OK = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
EVENTS = [b'{"n": %d}' % i for i in range(12)]


async def write_in_pieces(writer, data: bytes, sizes) -> None:
    at = 0
    for size in sizes:
        if at >= len(data):
            break
        writer.write(data[at:at + size])
        await writer.drain()
        await asyncio.sleep(0.001)  # separate reads on the client's side
        at += size
    writer.write(data[at:])
    await writer.drain()


async def collect(client: UpstreamClient, stall_timeout_s: float = 5.0) -> list[bytes]:
    got: list[bytes] = []
    await asyncio.wait_for(client.stream("/v1/completions", b"{}", "r1", got.append, stall_timeout_s), 10)
    return got


@pytest.mark.parametrize("pieces,crlf", [
    ("one write", False), ("1-byte writes", False), ("random splits", False), ("random splits", True),
], ids=["merged", "bytewise", "random", "random-crlf"])
async def test_events_split_or_merged_anyhow_arrive_whole_and_in_order(pieces, crlf):
    body = sse(*EVENTS, b"[DONE]", crlf=crlf)
    response = HEAD_OK + chunked(body)
    sizes = {"one write": [], "1-byte writes": [1] * len(response),
             "random splits": [random.Random(7).randint(1, 40) for _ in range(len(response))]}[pieces]

    async def answer(writer, request, n):
        await write_in_pieces(writer, response, sizes)
        return True

    async with Script(answer) as url:
        assert await collect(UpstreamClient(url, 4)) == EVENTS


async def test_multi_line_data_comments_and_other_fields():
    body = b": a comment\nevent: message\nid: 7\ndata: first\ndata: second\n\ndata:{\"tight\": 1}\n\ndata: [DONE]\n\n"

    async def answer(writer, request, n):
        writer.write(HEAD_OK + chunked(body))
        return True

    async with Script(answer) as url:
        assert await collect(UpstreamClient(url, 4)) == [b"first\nsecond", b'{"tight": 1}']


async def test_the_request_carries_the_body_and_the_request_id_and_keep_alive_reuses_the_connection():
    async def answer(writer, request, n):
        writer.write(HEAD_OK + chunked(sse(b'{"answer": %d}' % n, b"[DONE]")))
        return True

    script = Script(answer)
    async with script as url:
        client = UpstreamClient(url + "/prefix", 4)
        got = [await collect(client) for _ in range(3)]
    assert got == [[b'{"answer": 1}'], [b'{"answer": 2}'], [b'{"answer": 3}']]
    assert script.num_connections == 1
    first = script.requests[0]
    assert first.startswith(b"POST /prefix/v1/completions HTTP/1.1\r\n") and first.endswith(b"\r\n\r\n{}")
    assert b"X-Request-Id: r1\r\n" in first


async def test_done_without_the_end_of_the_body_returns_at_once_and_the_connection_is_not_reused():
    async def answer(writer, request, n):
        writer.write(HEAD_OK + b"%x\r\n" % len(sse(b"a", b"[DONE]")) + sse(b"a", b"[DONE]") + b"\r\n")
        await asyncio.sleep(30)  # the terminating chunk never comes
        return False

    script = Script(answer)
    async with script as url:
        client = UpstreamClient(url, 4)
        t0 = asyncio.get_running_loop().time()
        assert await collect(client) == [b"a"]
        assert asyncio.get_running_loop().time() - t0 < 5  # the grace (1 s), not the 30 s
        assert client.idle == []


async def test_a_body_that_ends_with_the_connection_is_read_to_its_end():
    async def answer(writer, request, n):
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n"
                     + b"data: x\n\ndata: y")  # the last event's blank line is cut by the close
        return False

    async with Script(answer) as url:
        assert await collect(UpstreamClient(url, 4)) == [b"x", b"y"]


@pytest.mark.parametrize("status,body,code", [
    (503, b'{"error": {"message": "busy"}}', "upstream_refused"),
    (429, b"slow down", "upstream_refused"),
    (400, b'{"error": {"message": "bad prompt"}}', "invalid_request"),
    (413, b"{}", "too_large"),
    (500, b"boom", "upstream_error"),
], ids=["503", "429", "400", "413", "500"])
async def test_a_refusal_fails_with_its_code_and_the_servers_message(status, body, code):
    async def answer(writer, request, n):
        writer.write(b"HTTP/1.1 %d X\r\ncontent-length: %d\r\n\r\n" % (status, len(body)) + body)
        return True

    async with Script(answer) as url:
        with pytest.raises(UpstreamFailure) as info:
            await collect(UpstreamClient(url, 4))
    assert info.value.code == code and str(status) in info.value.message
    if code != "too_large":
        assert body.decode().split('"message": "')[-1].rstrip('"}') in info.value.message


async def test_a_stream_cut_mid_body_is_an_upstream_error():
    async def answer(writer, request, n):
        writer.write(HEAD_OK + chunked(sse(*EVENTS), cut=200))
        return False  # and close

    got: list[bytes] = []
    async with Script(answer) as url:
        with pytest.raises(UpstreamFailure) as info:
            await UpstreamClient(url, 4).stream("/v1/completions", b"{}", "r1", got.append, 5)
    assert info.value.code == "upstream_error" and "broke" in info.value.message
    assert got and got == EVENTS[:len(got)]  # what came before the cut was delivered, in order


async def test_a_stalled_stream_fails_after_the_stall_timeout():
    async def answer(writer, request, n):
        writer.write(HEAD_OK + chunked(sse(b"one"))[:-5])  # the event, then silence
        await asyncio.sleep(30)
        return False

    async with Script(answer) as url:
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(UpstreamFailure) as info:
            await collect(UpstreamClient(url, 4), stall_timeout_s=0.5)
        waited = asyncio.get_running_loop().time() - t0
    assert info.value.code == "upstream_error" and "no data" in info.value.message
    assert 0.4 < waited < 5


async def test_a_callback_failure_ends_the_stream_and_closes_the_connection():
    def on_data(payload: bytes) -> None:
        if payload == EVENTS[2]:
            raise UpstreamFailure("upstream_error", "an error chunk")

    async def answer(writer, request, n):
        writer.write(HEAD_OK + chunked(sse(*EVENTS)))
        return True

    script = Script(answer)
    async with script as url:
        client = UpstreamClient(url, 4)
        with pytest.raises(UpstreamFailure, match="an error chunk"):
            await client.stream("/v1/completions", b"{}", "r1", on_data, 5)
        await asyncio.wait_for(script.closed_by_client.wait(), 5)
    assert client.idle == []


async def test_cancelling_the_stream_closes_its_connection():
    async def answer(writer, request, n):
        writer.write(HEAD_OK + b"%x\r\n" % len(sse(b"a")) + sse(b"a") + b"\r\n")
        if await asyncio.wait_for(script.reader.read(1), 30) == b"":  # EOF: the client went
            script.closed_by_client.set()
        return False

    script = Script(answer)
    got: list[bytes] = []
    async with script as url:
        client = UpstreamClient(url, 4)
        task = asyncio.create_task(client.stream("/v1/completions", b"{}", "r1", got.append, 30))
        await wait_async(lambda: asyncio.sleep(0, got == [b"a"]), 5, "the first event")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(script.closed_by_client.wait(), 5)  # the server sees its client go


async def test_a_reused_connection_the_server_dropped_is_replaced_and_the_request_sent_again():
    async def answer(writer, request, n):
        writer.write(HEAD_OK + chunked(sse(b"ok", b"[DONE]")))
        await writer.drain()
        return False  # one request per connection: the server closes it (the client may still hold it idle)

    script = Script(answer)
    async with script as url:
        client = UpstreamClient(url, 4)
        assert await collect(client) == [b"ok"]
        await asyncio.sleep(0.2)
        assert await collect(client) == [b"ok"]
    assert script.num_connections == 2


async def test_get_answers_status_and_body_on_the_pooled_connection_and_times_out_on_silence():
    async def answer(writer, request, n):
        if n == 3:
            await asyncio.sleep(30)  # no answer
            return False
        body = b"# HELP x\nvllm:num_requests_running 3\n" if n == 1 else b"not here"
        writer.write(b"HTTP/1.1 %d X\r\ncontent-length: %d\r\n\r\n" % (200 if n == 1 else 404, len(body)) + body)
        return True

    script = Script(answer)
    async with script as url:
        client = UpstreamClient(url, 4)
        assert await client.get("/metrics", 5) == (200, b"# HELP x\nvllm:num_requests_running 3\n")
        assert await client.get("/nope", 5) == (404, b"not here")
        assert script.num_connections == 1 and script.requests[0].startswith(b"GET /metrics HTTP/1.1\r\n")
        with pytest.raises(UpstreamFailure) as info:
            await client.get("/metrics", 0.5)
    assert info.value.code == "upstream_error" and "within 0.5 s" in info.value.message


async def test_a_server_that_does_not_listen_fails_with_a_code():
    from services.infra import free_port

    with pytest.raises(UpstreamFailure) as info:
        await collect(UpstreamClient(f"http://127.0.0.1:{free_port()}", 4))
    assert info.value.code == "upstream_error" and "cannot connect" in info.value.message


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
