"""A lean HTTP/1.1 client for the OpenAI agent's streamed completions (workers/openai/agent.py).

Why not httpx here: its streaming path (httpx -> httpcore -> anyio -> h11, a coroutine hop
per layer for every read, a line iterator over decoded text) was most of the agent's CPU
per relayed token (bench/README.md, "adapter_cost.py"). Here httptools (C; the router's
HTTP parser too) parses the response — status, headers, chunked framing — inside an
asyncio.Protocol, and each server-sent event's data goes to the caller's callback
synchronously, from the event loop's read callback: no task switch and no await per chunk.

`UpstreamClient(base_url, max_idle_connections)` holds keep-alive connections to one server.
`await client.get(path, timeout_s)` -> (status, body): the agent's liveness polls (/metrics,
/health, /v1/models) (httpx's GET per heartbeat was the agent's largest cost after the
streams); `await client.post(path, body, timeout_s)` likewise, for a POST that is not a
stream (SGLang's /abort_request).
`await client.stream(path, body, request_id, on_data, stall_timeout_s)` POSTs `body` (JSON
bytes, `X-Request-Id: request_id`) and returns when the response is over: at `data: [DONE]`
or at the end of the body. `on_data(payload)` gets each event's data (its `data:` lines,
joined by newlines), in order; it may raise UpstreamFailure, which ends the stream with
that failure and closes the connection. Other SSE fields (`event:`, `id:`, comments) are
ignored. Lines may end in LF or CRLF.

Failures, each an UpstreamFailure with a code (schemas/errors.py):
- a non-200 answer: `refusal_of(status, body)` (429, 503 upstream_refused; 400
  invalid_request; 413 too_large; anything else upstream_error);
- no connection within CONNECT_TIMEOUT_S, a refused or reset connection, a connection closed
  before a framed (chunked or sized) body ended, malformed HTTP, and no byte for
  `stall_timeout_s` (a timer re-armed lazily: one per stall period, not one per chunk):
  upstream_error.
A task cancelled while it streams closes its connection: the server sees its client go and
aborts the request. A connection goes back to the pool only after a complete response the
server keeps alive (after `[DONE]` the end of the body is waited for up to DONE_GRACE_S; a
server that does not end it loses the connection, not the answer). A pooled connection idle
for more than IDLE_MAX_S is closed, not reused (servers close idle keep-alive connections
after about 5 s: uvicorn's default, which vLLM and SGLang keep), and a request whose reused
connection the server closes before a byte of the answer is sent once more, on a new one.

Imports: `schemas` only.
"""

from __future__ import annotations

import asyncio
import re
import ssl as ssl_module
from typing import Callable
from urllib.parse import urlsplit

import httptools
import msgspec

from schemas.http import HttpError

CONNECT_TIMEOUT_S = 5.0
IDLE_MAX_S = 2.0  # a pooled connection idle longer than this is closed, not reused
DONE_GRACE_S = 1.0  # after [DONE], how long the end of the body is waited for (to reuse the connection)
ERROR_BODY_MAX_BYTES = 65536  # of a non-200 answer, kept for its message
BODY_MAX_BYTES = 64 << 20  # of a whole (not streamed) answer: /metrics, /v1/models, /v1/embeddings; beyond, upstream_error

_decode_json = msgspec.json.Decoder().decode


class UpstreamFailure(HttpError):
    """The request failed at or on the way to the engine server; `code` is a schemas/errors.py code."""

    def __init__(self, code: str, message: str, status: int = 0) -> None:
        super().__init__(code, message)
        self.status = status  # the server's HTTP status when it answered with one (refusal_of); 0: none


def refusal_of(status: int, body: bytes) -> UpstreamFailure:
    """A non-200 answer of the server -> the failure a request ends with."""
    try:
        detail = _decode_json(body)
        message = detail.get("error", detail) if isinstance(detail, dict) else detail
        if isinstance(message, dict):
            message = message.get("message", message)
    except msgspec.DecodeError:
        message = body[:300].decode(errors="replace")
    text = f"the engine server answered {status}: {message}"
    if status in (429, 503):
        return UpstreamFailure("upstream_refused", text, status)
    if status == 400:
        return UpstreamFailure("invalid_request", text, status)
    if status == 413:
        return UpstreamFailure("too_large", text, status)
    return UpstreamFailure("upstream_error", text, status)


class _StaleConnection(Exception):
    """A reused connection closed by the server before a byte of the answer: send again."""


class _Exchange:
    """One request and its response on a connection."""

    __slots__ = ("on_data", "future", "status", "framed", "body", "buf", "data_lines", "got_bytes",
                 "reused", "ended", "done_seen")

    def __init__(self, on_data: Callable[[bytes], None] | None, future: asyncio.Future, reused: bool) -> None:
        self.on_data = on_data  # None: not a stream; the body is kept and the future's result is (status, body)
        self.future = future  # stream: None when it is over; an UpstreamFailure when it failed
        self.status = 0
        self.framed = False  # chunked or Content-Length: a cut body is an error, not an end
        self.body = bytearray()  # a non-200 answer's body, or the whole body when not a stream
        self.buf = b""  # the current line's bytes so far (no line break yet)
        self.data_lines: list[bytes] = []  # the current event's data lines
        self.got_bytes = False
        self.reused = reused
        self.ended = False  # [DONE] or a failure: the rest of the body is not read
        self.done_seen = False


class _Connection(asyncio.Protocol):
    """One keep-alive connection: the protocol callbacks and httptools' parser callbacks."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.exchange: _Exchange | None = None
        self.closed = False
        self.reusable = False  # the last response ended whole and the server keeps the connection
        self.idle_since_s = 0.0
        self.last_data_s = 0.0
        self.stall_timeout_s = 0.0
        self.stall_timer: asyncio.TimerHandle | None = None
        self.done_timer: asyncio.TimerHandle | None = None

    # ------------------------------------------------------------------ asyncio.Protocol
    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        ex = self.exchange
        if ex is None:  # bytes nobody asked for: the connection's state is unknown
            self.close()
            return
        self.last_data_s = self.loop.time()
        ex.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:  # a bug in a callback below: fail the request, say which
            self.fail(UpstreamFailure("upstream_error", f"reading the engine server's answer failed: {exc.__context__!r}"))
            return
        except httptools.HttpParserError as exc:
            self.fail(UpstreamFailure("upstream_error", f"malformed HTTP from the engine server: {exc}"))
            return
        if ex.done_seen and not ex.future.done() and self.done_timer is None:
            # [DONE] came and the end of the body did not (yet): wait a little for it, so the
            # connection can be reused, but never hold the answer on it.
            self.done_timer = self.loop.call_later(DONE_GRACE_S, self._resolve, ex)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.reusable = False
        self._cancel_timers()
        ex = self.exchange
        if ex is None or ex.future.done():
            return
        if ex.reused and not ex.got_bytes:
            ex.future.set_exception(_StaleConnection())
            return
        if ex.status and not ex.framed:  # a body that ends with the connection: over
            self.on_message_complete()
            return
        why = f": {exc}" if exc else ""
        self.fail(UpstreamFailure("upstream_error", f"the engine server's stream broke: the connection closed "
                                                    f"before the response ended{why}"))

    # ------------------------------------------------------------------ httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"content-length" or (name == b"transfer-encoding" and b"chunked" in value.lower()):
            self.exchange.framed = True

    def on_headers_complete(self) -> None:
        self.exchange.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        ex = self.exchange
        if ex.on_data is None:
            if len(ex.body) + len(body) > BODY_MAX_BYTES:
                self.fail(UpstreamFailure("upstream_error", f"the engine server's answer exceeds {BODY_MAX_BYTES >> 20} MiB"))
                return
            ex.body += body
            return
        if ex.status != 200:
            if len(ex.body) < ERROR_BODY_MAX_BYTES:
                ex.body += body
            return
        if ex.ended:
            return
        buf = ex.buf + body if ex.buf else body
        start = 0
        find = buf.find
        while True:
            end = find(b"\n", start)
            if end < 0:
                break
            line = buf[start:end]
            start = end + 1
            if line[-1:] == b"\r":
                line = line[:-1]
            if line:
                if line[:5] == b"data:":
                    ex.data_lines.append(line[6:] if line[5:6] == b" " else line[5:])
                continue
            if ex.data_lines:  # a blank line ends an event
                self._dispatch(ex)
                if ex.ended:
                    return
        ex.buf = buf[start:] if start < len(buf) else b""

    def on_message_complete(self) -> None:
        ex = self.exchange
        self.reusable = self.parser.should_keep_alive()
        if ex is None or ex.future.done():
            return
        if ex.on_data is None:
            ex.future.set_result((ex.status, bytes(ex.body)))
            return
        if ex.status != 200:
            self.fail(refusal_of(ex.status, bytes(ex.body)))
            return
        self._dispatch_pending(ex)
        self._resolve(ex)

    # ------------------------------------------------------------------ the exchange
    def _dispatch(self, ex: _Exchange) -> None:
        lines, ex.data_lines = ex.data_lines, []
        payload = lines[0] if len(lines) == 1 else b"\n".join(lines)
        if payload == b"[DONE]":
            ex.ended = ex.done_seen = True  # the end of the body resolves it (or data_received's timer)
            return
        try:
            ex.on_data(payload)
        except UpstreamFailure as exc:
            self.fail(exc)

    def _dispatch_pending(self, ex: _Exchange) -> None:
        """The body ended: an event it did not close with a blank line still counts."""
        if ex.buf and not ex.ended:
            line = ex.buf[:-1] if ex.buf[-1:] == b"\r" else ex.buf
            ex.buf = b""
            if line[:5] == b"data:":
                ex.data_lines.append(line[6:] if line[5:6] == b" " else line[5:])
        if ex.data_lines and not ex.ended:
            self._dispatch(ex)

    def _resolve(self, ex: _Exchange) -> None:
        if not ex.future.done():
            ex.future.set_result(None)

    def fail(self, failure: UpstreamFailure) -> None:
        ex = self.exchange
        if ex is not None:
            ex.ended = True
            if not ex.future.done():
                ex.future.set_exception(failure)
        self.close()

    def _check_stall(self) -> None:
        self.stall_timer = None
        ex = self.exchange
        if ex is None or ex.future.done():
            return
        quiet_s = self.loop.time() - self.last_data_s
        if quiet_s >= self.stall_timeout_s:
            self.fail(UpstreamFailure("upstream_error", f"no data from the engine server for {self.stall_timeout_s:g} s"))
        else:
            self.stall_timer = self.loop.call_later(self.stall_timeout_s - quiet_s, self._check_stall)

    def start(self, request: bytes, on_data: Callable[[bytes], None] | None, stall_timeout_s: float,
              reused: bool) -> asyncio.Future:
        future = self.loop.create_future()
        self.exchange = _Exchange(on_data, future, reused)
        self.reusable = False
        self.stall_timeout_s = stall_timeout_s
        self.last_data_s = self.loop.time()
        self.stall_timer = self.loop.call_later(stall_timeout_s, self._check_stall)
        self.transport.write(request)
        return future

    def finish(self) -> bool:
        """The exchange is over (its future done): True if the connection may be reused."""
        self._cancel_timers()
        self.exchange = None
        if self.closed or not self.reusable:
            self.close()
            return False
        self.idle_since_s = self.loop.time()
        return True

    def _cancel_timers(self) -> None:
        for timer in (self.stall_timer, self.done_timer):
            if timer is not None:
                timer.cancel()
        self.stall_timer = self.done_timer = None

    def close(self) -> None:
        self.reusable = False
        if not self.closed:
            self.closed = True
            self.transport.close()


TRACEPARENT_00 = re.compile(r"00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}")

class UpstreamClient:
    """Keep-alive connections to one server, for streamed POSTs (module docstring)."""

    def __init__(self, base_url: str, max_idle_connections: int) -> None:
        url = urlsplit(base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"not an http:// or https:// URL: {base_url!r}")
        self.host = url.hostname
        self.port = url.port or (443 if url.scheme == "https" else 80)
        self.ssl = ssl_module.create_default_context() if url.scheme == "https" else None
        self.host_header = url.netloc
        self.path_prefix = url.path.rstrip("/")
        self.max_idle_connections = max_idle_connections
        self.idle: list[_Connection] = []  # most recently used last

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(loop.create_connection(
                lambda: _Connection(loop), self.host, self.port, ssl=self.ssl), CONNECT_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise UpstreamFailure("upstream_error", f"no connection to the engine server {self.host}:{self.port} "
                                                    f"within {CONNECT_TIMEOUT_S:g} s") from None
        except OSError as exc:
            raise UpstreamFailure("upstream_error", f"cannot connect to the engine server {self.host}:{self.port}: "
                                                    f"{exc}") from None
        return conn

    def _idle_connection(self) -> _Connection | None:
        now = asyncio.get_running_loop().time()
        while self.idle:
            conn = self.idle.pop()
            if not conn.closed and now - conn.idle_since_s < IDLE_MAX_S:
                return conn
            conn.close()
        return None

    async def stream(self, path: str, body: bytes, request_id: str, on_data: Callable[[bytes], None],
                     stall_timeout_s: float, traceparent: str = "", output_offset: int = 0) -> None:
        """`traceparent`: the client's W3C trace context (checked by the router's API), sent as
        that header so the server's spans join the client's trace; "": none sent.
        `output_offset` > 0: a migrated request's continuation, said in `X-Flexlb-Output-Offset`
        (FlexLB's sim-server continues its simulated output from there; other servers ignore it)."""
        if traceparent and not TRACEPARENT_00.fullmatch(traceparent):
            raise ValueError("a traceparent of version 00 only (the router's API checks it): never another header's bytes")
        trace = f"traceparent: {traceparent}\r\n" if traceparent else ""
        if output_offset:
            trace += f"X-Flexlb-Output-Offset: {int(output_offset)}\r\n"
        request = (f"POST {self.path_prefix}{path} HTTP/1.1\r\nHost: {self.host_header}\r\n"
                   f"Content-Type: application/json\r\nAccept: text/event-stream\r\nX-Request-Id: {request_id}\r\n"
                   f"{trace}Content-Length: {len(body)}\r\n\r\n").encode() + body
        await self._exchange(request, on_data, stall_timeout_s)

    async def get(self, path: str, timeout_s: float) -> tuple[int, bytes]:
        """GET `path`: (status, body), whatever the status. UpstreamFailure (upstream_error)
        when there is no connection or no whole answer within `timeout_s`."""
        request = f"GET {self.path_prefix}{path} HTTP/1.1\r\nHost: {self.host_header}\r\n\r\n".encode()
        try:
            return await asyncio.wait_for(self._exchange(request, None, timeout_s), timeout_s)
        except asyncio.TimeoutError:
            raise UpstreamFailure("upstream_error", f"GET {path}: no answer from the engine server within "
                                                    f"{timeout_s:g} s") from None

    async def post(self, path: str, body: bytes, timeout_s: float) -> tuple[int, bytes]:
        """POST `body` (JSON) to `path`, not a stream: (status, body), whatever the status;
        failures as get()'s (SGLang's /abort_request)."""
        request = (f"POST {self.path_prefix}{path} HTTP/1.1\r\nHost: {self.host_header}\r\n"
                   f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body
        try:
            return await asyncio.wait_for(self._exchange(request, None, timeout_s), timeout_s)
        except asyncio.TimeoutError:
            raise UpstreamFailure("upstream_error", f"POST {path}: no answer from the engine server within "
                                                    f"{timeout_s:g} s") from None

    async def _exchange(self, request: bytes, on_data: Callable[[bytes], None] | None, stall_timeout_s: float):
        conn = self._idle_connection()
        while True:
            reused = conn is not None
            if conn is None:
                conn = await self._connect()
            try:
                result = await conn.start(request, on_data, stall_timeout_s, reused)
            except _StaleConnection:
                conn.finish()
                conn = None  # once more, on a new connection
                continue
            except BaseException:  # a failure, or cancelled: the connection is not reused
                conn.reusable = False
                conn.finish()
                raise
            if conn.finish():
                if len(self.idle) < self.max_idle_connections:
                    self.idle.append(conn)
                else:
                    conn.close()
            return result

    def close(self) -> None:
        while self.idle:
            self.idle.pop().close()
