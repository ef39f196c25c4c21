"""workers/openai/upstream.py, the OpenAI agent's lean HTTP/1.1 client, against a real TCP server
scripted here: split and merged chunks, an error chunk, refusals, a cut stream, a stall,
keep-alive reuse and a server that drops an idle connection."""

from __future__ import annotations

import asyncio
import random

import pytest

from tests.integration.stack import wait_async
from workers.openai.upstream import UpstreamClient, UpstreamFailure


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


async def test_a_requests_trace_context_goes_to_the_server_as_its_traceparent_header():
    async def answer(writer, request, n):
        writer.write(HEAD_OK + chunked(sse(b"{}", b"[DONE]")))
        return True

    traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    script = Script(answer)
    async with script as url:
        client = UpstreamClient(url, 4)
        await client.stream("/v1/completions", b"{}", "r1", lambda data: None, 5.0, traceparent)
        await client.stream("/v1/completions", b"{}", "r2", lambda data: None, 5.0)
        with pytest.raises(ValueError, match="traceparent"):  # never another header's bytes
            await client.stream("/v1/completions", b"{}", "r3", lambda data: None, 5.0, traceparent + "\r\nx-a: b")
    assert f"\r\ntraceparent: {traceparent}\r\n".encode() in script.requests[0]
    assert b"traceparent" not in script.requests[1].lower() and len(script.requests) == 2


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
