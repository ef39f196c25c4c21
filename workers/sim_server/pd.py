"""The sim-server's PD bootstrap (SGLang's protocol, emulated).

PD disaggregation, SGLang's way (`--role prefill` / `--role decode`; sglang-router
`--pd-disaggregation --prefill URL PORT --decode URL`): the router sends the same body to a
prefill server and a decode server at once, with `bootstrap_host`, `bootstrap_port` and
`bootstrap_room` added (observed on sglang-router 0.3.2). The prefill server runs the prompt
on its role-prefill engine; when the engine hands the request off, the room is marked ready
(first token id, cached tokens) and the prefill server answers with that one token. The
decode server long-polls `GET /_sim/bootstrap?room=R` on `bootstrap_host:bootstrap_port`
(the prefill server's own HTTP port: give that port as the router's bootstrap port), then
queues the request on its role-decode engine with `submit_decode` (the KV "arrives": no
prefill compute) and streams every token from the first, as SGLang's decode server does.
KV transfer time is not modelled (as on the NATS path). A room waits `BOOTSTRAP_WAIT_S`; a
prefill that fails or is cancelled resolves its room with the error, which the decode
server returns. A prefill / decode server refuses a generation without `bootstrap_room`
(400 `invalid_request`), since it could not do it alone. Health checks run on either role.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec

from schemas.http import HttpError

BOOTSTRAP_WAIT_S = 120.0  # PD: how long a decode server waits for its prefill's room
MAX_ROOMS = 65536  # PD: rooms kept (ready or awaited); the oldest is dropped beyond

_json_decode = msgspec.json.Decoder().decode


def bootstrap_of(body: dict[str, Any]) -> tuple[str, int, int] | None:
    """SGLang's PD fields (host, port, room), or None when the body has no `bootstrap_room`."""
    room = body.get("bootstrap_room")
    if room is None:
        return None
    host, port = body.get("bootstrap_host"), body.get("bootstrap_port")
    if type(room) is not int or not isinstance(host, str) or type(port) is not int:
        raise HttpError("invalid_request", "bootstrap_room, bootstrap_host and bootstrap_port must be int, str, int")
    return host, port, room


async def fetch_handoff(host: str, port: int, room: int) -> tuple[int, int]:
    """PD, decode side: long-poll the prefill server's `/_sim/bootstrap` for the room; its
    error (or an unreachable server) fails this request with the same code."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout=10)
    except (OSError, asyncio.TimeoutError) as exc:
        raise HttpError("dispatch_failed", f"bootstrap server {host}:{port} unreachable: {exc}") from None
    try:
        writer.write(f"GET /_sim/bootstrap?room={room} HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n\r\n"
                     .encode())
        data = await asyncio.wait_for(reader.read(), timeout=BOOTSTRAP_WAIT_S + 10)
    except (OSError, asyncio.TimeoutError) as exc:
        raise HttpError("dispatch_failed", f"bootstrap of room {room} at {host}:{port} failed: {exc}") from None
    finally:
        writer.close()
    head, _, payload = data.partition(b"\r\n\r\n")
    try:
        status = int(head.split(b" ", 2)[1])
        if b"transfer-encoding: chunked" in head.lower():
            payload = _dechunk(payload)
        obj = _json_decode(payload)
    except (IndexError, ValueError, msgspec.DecodeError):
        raise HttpError("dispatch_failed", f"bootstrap of room {room}: unreadable answer {data[:200]!r}") from None
    if status != 200:
        err = obj.get("error", {}) if isinstance(obj, dict) else {}
        raise HttpError(err.get("code", "dispatch_failed"), f"room {room}: {err.get('message', status)}")
    return int(obj["first_token_id"]), int(obj["num_cached_tokens"])


def _dechunk(payload: bytes) -> bytes:
    out, rest = [], payload
    while rest:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            break
        out.append(rest[:size])
        rest = rest[size + 2:]
    return b"".join(out)
