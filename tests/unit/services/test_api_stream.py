"""A streaming response starts only at its request's dispatch or its first token or outcome
(issue 34, 2: no refusal after 200): what CompletionsFront.stream sends, and when, driven
through its handle as the shell drives it (mark_dispatched, the inbox, finish_router), with
a stand-in for the router service that records cancels. The shell itself, on real NATS and
Redis, is tests/integration/test_stream_start.py."""

from __future__ import annotations

import asyncio
import json

import pytest

from schemas import messages as m
from schemas.openai_bodies import CompletionShape
from services.api import RETRY_AFTER_CODES, CompletionsFront, error_headers
from services.settings import RouterSettings
from services.shell.handle import RequestHandle, Terminal


class RecordingService:
    """What CompletionsFront.stream asks of the router: its settings, and cancel (which, like
    Intake.cancel of a request not yet dispatched, ends the handle)."""

    def __init__(self) -> None:
        self.settings = RouterSettings()
        self.cancels: list[str] = []

    async def cancel(self, handle: RequestHandle, reason: str) -> None:
        self.cancels.append(reason)
        handle.done = True


class Client:
    """The ASGI side of one client: what was sent to it, and a disconnect it can make."""

    def __init__(self) -> None:
        self.sent: list[dict] = []
        self.gone = asyncio.Event()

    async def receive(self) -> dict:
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict) -> None:
        self.sent.append(message)

    @property
    def status(self) -> int | None:
        return self.sent[0]["status"] if self.sent else None

    @property
    def headers(self) -> dict[str, str]:
        return {k.decode(): v.decode() for k, v in self.sent[0]["headers"]}

    @property
    def body(self) -> bytes:
        return b"".join(x.get("body", b"") for x in self.sent[1:])


def make_handle(request_id: str = "r1", timeout_s: float = 60.0) -> RequestHandle:
    return RequestHandle(m.Request(request_id=request_id, prompt_token_ids=[1, 2, 3], max_tokens=2), 0, timeout_s=timeout_s)


def tokens(request_id: str, start: int, text: str, finish_reason: str | None = None) -> m.TokensGenerated:
    return m.TokensGenerated(request_id=request_id, worker_id="w0", start_index=start, token_ids=[65] * len(text),
                             text=text, finish_reason=finish_reason)


async def settle() -> None:
    for _ in range(5):  # let the stream's task run as far as it can
        await asyncio.sleep(0)


def start_stream(handle: RequestHandle, deadline_s: float | None = None) -> tuple[RecordingService, Client, asyncio.Task]:
    service, client = RecordingService(), Client()
    front = CompletionsFront(service, tokenizer=None, app=None)
    if deadline_s is not None:  # the router's own deadline, shortened (its request timeout + 2 s)
        front._deadline = lambda h: asyncio.get_running_loop().time() + deadline_s
    shape = CompletionShape(handle.request_id, 0, "flexlb-sim")
    task = asyncio.get_running_loop().create_task(front.stream(handle, client.receive, client.send, shape))
    return service, client, task


@pytest.mark.parametrize("code, retry_after", [
    ("queue_full", "1"), ("shed", "1"), ("slo_unattainable", "1"), ("no_worker", "1"), ("not_ready", "1"),
    ("queue_timeout", "1"), ("timed_out", None), ("too_large", None), ("dispatch_failed", None),
    ("invalid_request", None), ("cancelled", None),
], ids=lambda v: str(v))
def test_refusals_that_ask_the_client_back_carry_retry_after(code, retry_after):
    headers = dict(error_headers("r1", code))
    assert headers[b"x-request-id"] == b"r1"
    assert headers.get(b"retry-after") == (retry_after.encode() if retry_after else None)


def test_retry_after_is_the_refusals_hint_rounded_up_to_whole_seconds():
    assert dict(error_headers(None, "shed", 750))[b"retry-after"] == b"1"
    assert dict(error_headers(None, "queue_full", 2001))[b"retry-after"] == b"3"
    assert error_headers(None, "too_large", 5000) == []  # no Retry-After for a request that cannot succeed
    assert {"queue_full", "shed", "slo_unattainable", "no_worker", "not_ready", "queue_timeout"} <= RETRY_AFTER_CODES


def test_nothing_is_sent_until_dispatch_then_200_and_the_tokens():
    async def run():
        handle = make_handle()
        _, client, task = start_stream(handle)
        await settle()
        assert client.sent == [], "the response started before the request was dispatched"
        handle.mark_dispatched()
        await settle()
        assert client.status == 200 and client.headers["content-type"].startswith("text/event-stream")
        handle.queue.put_nowait(tokens("r1", 0, "hi", "length"))
        handle.queue.put_nowait(Terminal("finished", finish_reason="length"))
        await asyncio.wait_for(task, 5)
        assert b'"text":"hi"' in client.body and client.body.endswith(b"data: [DONE]\n\n")

    asyncio.run(run())


def test_a_first_token_starts_the_response_without_a_dispatch_mark():
    async def run():  # (a standby whose batch.dispatched event was lost: the worker's tokens come anyway)
        handle = make_handle()
        _, client, task = start_stream(handle)
        await settle()
        assert client.sent == []
        handle.queue.put_nowait(tokens("r1", 0, "x"))
        await settle()
        assert client.status == 200
        handle.queue.put_nowait(Terminal("finished", finish_reason="length"))
        await asyncio.wait_for(task, 5)

    asyncio.run(run())


@pytest.mark.parametrize("code, status, retry_after", [
    ("slo_unattainable", 429, "1"), ("queue_timeout", 504, "1"), ("not_ready", 503, "1"), ("too_large", 413, None),
    ("dispatch_failed", 502, None),
])
def test_a_failure_before_dispatch_is_an_http_status_not_an_event_in_a_200_stream(code, status, retry_after):
    async def run():
        handle = make_handle()
        _, client, task = start_stream(handle)
        await settle()
        handle.queue.put_nowait(Terminal("failed", code, "the batcher gave up on it"))  # (as finish_router does)
        await asyncio.wait_for(task, 5)
        assert client.status == status
        assert client.headers.get("retry-after") == retry_after
        assert client.headers["x-request-id"] == "r1"
        assert json.loads(client.body)["error"]["code"] == code

    asyncio.run(run())


def test_a_failure_after_dispatch_arrives_in_the_stream():
    async def run():
        handle = make_handle()
        _, client, task = start_stream(handle)
        handle.mark_dispatched()
        await settle()
        handle.queue.put_nowait(Terminal("failed", "worker_failed", "worker w0 dead while running it"))
        await asyncio.wait_for(task, 5)
        assert client.status == 200
        assert b'"code":"worker_failed"' in client.body and client.body.endswith(b"data: [DONE]\n\n")

    asyncio.run(run())


def test_a_client_gone_before_dispatch_cancels_the_request_and_gets_nothing():
    async def run():
        handle = make_handle()
        service, client, task = start_stream(handle)
        await settle()
        client.gone.set()
        await asyncio.wait_for(task, 5)
        assert client.sent == []
        assert service.cancels == ["client disconnected"]

    asyncio.run(run())


def test_the_routers_deadline_before_dispatch_is_a_504_status():
    async def run():
        handle = make_handle()
        service, client, task = start_stream(handle, deadline_s=0.05)
        await asyncio.wait_for(task, 5)
        assert client.status == 504 and json.loads(client.body)["error"]["code"] == "timed_out"
        assert service.cancels == ["router request timeout"]

    asyncio.run(run())
