"""The HTTP side of the contract: error bodies by code, and the raw-ASGI helpers both HTTP
fronts use (the router's completions path, services/api.py; `flexlb sim-server`,
workers/sim_server/http.py). Both answer on the hot path without a framework, so they share one
way to read a bounded body, send JSON, an error, or server-sent events.

Errors: every refusal is `{"error": {"code", "message", "retryable"}}` (schemas/errors.py
`ErrorBody`) with the code's HTTP status. A code outside schemas/errors.py (an engine's own,
relayed) is answered 502 and retryable: the engine's fault, not the client's.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable

import msgspec

from schemas.errors import ERROR_CODES, ErrorBody, ErrorDetail

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

JSON_TYPE = b"application/json"
SSE_TYPE = b"text/event-stream; charset=utf-8"
SSE_DONE = b"data: [DONE]\n\n"

_encode = msgspec.json.Encoder().encode


class HttpError(Exception):
    """A request refused with a code (schemas/errors.py) and a message for the client."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class ClientGone(Exception):
    """The client closed the connection before its request was read."""


def error_status(code: str) -> int:
    """The HTTP status of an error code; an unknown code (an engine's) is 502."""
    known = ERROR_CODES.get(code)
    return known.http_status if known else 502


def error_body(code: str, message: str) -> bytes:
    """`{"error": {"code", "message", "retryable"}}`; an unknown code counts as retryable."""
    known = ERROR_CODES.get(code)
    return _encode(ErrorBody(error=ErrorDetail(code=code, message=message,
                                               retryable=known.retryable if known else True)))


def sse(payload: bytes) -> bytes:
    """One server-sent event carrying `payload` (JSON bytes)."""
    return b"data: " + payload + b"\n\n"


async def read_body(receive: Receive, limit: int, declared: bytes | None = None) -> bytes:
    """The request body from ASGI `receive`, refused `too_large` past `limit` bytes (at once
    by its declared content-length, or as it arrives); ClientGone if the client leaves."""
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise HttpError("too_large", f"body of {declared.decode()} bytes exceeds the limit of {limit}")
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise HttpError("too_large", f"body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def send_bytes(send: Send, status: int, body: bytes, content_type: bytes = JSON_TYPE,
                     headers: list[tuple[bytes, bytes]] | None = None) -> None:
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", content_type), (b"content-length", str(len(body)).encode()), *(headers or []),
    ]})
    await send({"type": "http.response.body", "body": body})


async def send_json(send: Send, status: int, obj: Any, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    await send_bytes(send, status, _encode(obj), headers=headers)


async def send_error(send: Send, code: str, message: str, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    await send_bytes(send, error_status(code), error_body(code, message), headers=headers)
