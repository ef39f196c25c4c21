"""The open-loop streaming load generator of bench/peers.py and bench/trace.py, and the
client that bench/adapter_cost.py's closed loop uses.

Not a harness: it measures what a harness asks it to send. The client (`stream_one`) posts
a streamed `/v1/completions` over its own raw HTTP/1.1 connection (no client framework, no
per-chunk overhead beyond finding `data:` lines) and records, in wall seconds from the send:
TTFT (the first chunk with text), e2e (`[DONE]`), the tokens received (one character of text
is one token: the byte tokenizer of schemas/tokens.py) and, on failure, an error code.

Open loop (`replay`): one asyncio task per request sleeping until its send time (a late
answer never delays the next send); after `cap_s` every unfinished request is cancelled (its
connection closes, so the router cancels it) and marked `capped`, or `not_sent`.
`run_clients` runs the plans in this process or in forked client processes sharing one start
instant, with a `CpuSampler` (bench/common.py) over the given pids meanwhile.

Error codes: `<status>:<code>` for a non-200 answer (`error_code`), `stream:<code>` for an
error event in the stream (`stream_error_code`) (both replaceable per call), `client_*` for
the client's own failures (`client_timeout`, `client_no_done`, `client_bad_status_line`,
`client_<Exception>`), `capped` and `not_sent`.

The SSE chunks are decoded as plain dicts, not as schemas/api.py's CompletionResponse: the
stream mixes completion chunks with error events whose shape differs between FlexLB, the
peer routers and the engines (`{"error": {...}}` or `{"error": "text"}`), and this loop is
the hot path of the load generator.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

import msgspec

from bench.common import CpuSampler, http_body_parts

_DECODER = msgspec.json.Decoder()


@dataclass
class Rec:
    """One request of one run, as the client saw it (times: wall seconds)."""

    index: int
    target: int  # index of the URL it was sent to
    late_s: float | None = None  # send lateness vs its schedule (None: never sent)
    status: int | None = None
    error: str | None = None  # "<status>:<code>", "stream:<code>", "client_*", "capped", "not_sent", ...
    error_message: str = ""  # the error event's message (the first 300 characters), for the run's samples
    ttft_s: float | None = None
    e2e_s: float | None = None
    tokens: int = 0
    done: bool = False


def error_code(status: int, body: bytes) -> str:
    """'<status>:<code>' from an error body: FlexLB's {"error": {"code"}}, OpenAI-style
    {"error": {"type"}}, FastAPI's {"detail"}, or the first words of a text body."""
    code = None
    try:
        obj = _DECODER.decode(body)
    except (msgspec.DecodeError, ValueError):
        obj = None
    if isinstance(obj, dict):
        err = obj.get("error", obj)
        if isinstance(err, dict):
            code = err.get("code") or err.get("type") or err.get("detail")
        elif isinstance(err, str):
            code = err
    if code is None:
        code = body.decode(errors="replace").strip() or "empty_body"
    code = "_".join(str(code).split()[:6])[:60]
    return f"{status}:{code}"


def stream_error_code(err: Any) -> str:
    """'stream:<code>' of an error event's `error` (a dict with a code or type, or a text)."""
    code = (err.get("code") or err.get("type")) if isinstance(err, dict) else err
    return f"stream:{code}"


async def stream_one(host: str, port: int, body: bytes, rec: Any, request_id: str | None = None,
                     connect_timeout_s: float | None = None,
                     status_error: Callable[[int, bytes], str] = error_code,
                     stream_error: Callable[[Any], str] = stream_error_code) -> None:
    """POST a streamed /v1/completions on its own connection and read the SSE stream into
    `rec` (a Rec, or any object with its status, error, error_message, ttft_s, e2e_s, tokens
    and done fields). `request_id` also goes in an X-Request-Id header when given."""
    t_send = time.perf_counter()
    writer = None
    try:
        connect = asyncio.open_connection(host, port, limit=1 << 20)
        reader, writer = await (asyncio.wait_for(connect, connect_timeout_s) if connect_timeout_s else connect)
        rid_header = f"X-Request-Id: {request_id}\r\n" if request_id is not None else ""
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                f"Accept: text/event-stream\r\n{rid_header}Content-Length: {len(body)}\r\n"
                f"Connection: close\r\n\r\n").encode()
        writer.write(head + body)
        await writer.drain()
        parts = (await reader.readline()).split()
        if len(parts) < 2:
            rec.error = "client_bad_status_line"
            return
        rec.status = int(parts[1])
        chunked, length = False, None
        while True:
            line = await reader.readline()
            if line in (b"\r\n", b"\n", b""):
                break
            k, _, v = line.partition(b":")
            k = k.strip().lower()
            if k == b"transfer-encoding" and b"chunked" in v.lower():
                chunked = True
            elif k == b"content-length":
                length = int(v.strip())

        def body_parts():
            return http_body_parts(reader, chunked, length)

        if rec.status != 200:
            rec.error = status_error(rec.status, b"".join([p async for p in body_parts()]))
            return
        buf = b""
        async for chunk in body_parts():
            now = time.perf_counter()
            buf += chunk.replace(b"\r\n", b"\n") if b"\r" in chunk else chunk
            while True:
                cut = buf.find(b"\n\n")
                if cut < 0:
                    break
                event, buf = buf[:cut], buf[cut + 2:]
                for line in event.split(b"\n"):
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        rec.done = True
                        rec.e2e_s = now - t_send
                        return
                    obj = _DECODER.decode(data)
                    if "error" in obj:
                        err = obj["error"]
                        rec.error = stream_error(err)
                        rec.error_message = str(err.get("message", "") if isinstance(err, dict) else err)[:300]
                        continue
                    usage = obj.get("usage")
                    if COUNT_TOKENS == "usage" and usage:  # the server's count (include_usage: after the last text)
                        rec.tokens = int(usage.get("completion_tokens") or rec.tokens)
                    choices = obj.get("choices")
                    if not choices:
                        continue
                    text = choices[0].get("text") or ""
                    # byte tokenizer: one ASCII char, one token; else one chunk, one token until the usage says
                    n = len(text) if COUNT_TOKENS == "chars" else (1 if text else 0)
                    if n:
                        rec.tokens += n
                    if rec.ttft_s is None and (n or COUNT_TOKENS == "usage"):  # (usage: a token's chunk, text or not)
                        rec.ttft_s = now - t_send
        if rec.error is None:
            rec.error = "client_no_done"
    except (OSError, asyncio.IncompleteReadError, ValueError, KeyError, TypeError, IndexError) as exc:
        rec.error = rec.error or f"client_{exc.__class__.__name__}"
    finally:
        if writer is not None:
            writer.close()


# --------------------------------------------------------------------------- open loop
@dataclass
class Plan:
    """What one client process sends: request indices, their send times and targets."""

    indices: list[int]
    send_at_s: list[float]  # wall seconds after the common start
    targets: list[int]


# The bodies and URLs live in module globals so that forked client processes share them
# without pickling (tens of MB for Mooncake); a harness fills them before `run_clients`.
BODIES: list[bytes] = []
# How stream_one counts a request's tokens: "chars" (the byte tokenizer of FlexLB's engines: one
# ASCII character, one token) or "usage" (another tokenizer: one per chunk with text, then the
# server's usage.completion_tokens when the stream has it: stream_options.include_usage).
COUNT_TOKENS = "chars"
REQUEST_IDS: list[str] = []
URLS: list[tuple[str, int]] = []


def make_plans(n: int, send_at_s: list[float], target_of: Callable[[int], int], procs: int) -> list[Plan]:
    """Requests 0..n-1 dealt round-robin over `procs` client processes."""
    plans = [Plan([], [], []) for _ in range(procs)]
    for i in range(n):
        p = plans[i % procs]
        p.indices.append(i)
        p.send_at_s.append(send_at_s[i])
        p.targets.append(target_of(i))
    return [p for p in plans if p.indices]


async def replay(plan: Plan, start_wall: float, cap_s: float, request_timeout_s: float,
                 progress_s: float = 10.0) -> tuple[list[Rec], dict[str, Any]]:
    """Open loop: one task per request sleeping until its send time; after `cap_s` from the
    start every unfinished task is cancelled (its connection closes) and marked `capped`."""
    loop = asyncio.get_running_loop()
    t0 = loop.time() + (start_wall - time.time())
    recs = [Rec(i, t) for i, t in zip(plan.indices, plan.targets)]
    cpu0 = time.process_time()

    async def one(at: float, rec: Rec) -> None:
        delay = t0 + at - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        rec.late_s = loop.time() - (t0 + at)
        host, port = URLS[rec.target]
        try:
            await asyncio.wait_for(stream_one(host, port, BODIES[rec.index], rec, REQUEST_IDS[rec.index]),
                                   request_timeout_s)
        except asyncio.TimeoutError:
            rec.error = rec.error or "client_timeout"
        except Exception as exc:  # noqa: BLE001 - a client bug is one request's error, never the run's
            rec.error = rec.error or f"client_{exc.__class__.__name__}"

    async def report() -> None:
        while True:
            await asyncio.sleep(progress_s)
            sent = sum(1 for r in recs if r.late_s is not None)
            print(f"    t={loop.time() - t0:6.1f}s sent {sent} first-token {sum(1 for r in recs if r.ttft_s is not None)} "
                  f"done {sum(1 for r in recs if r.done)} of {len(recs)}", file=sys.stderr, flush=True)

    tasks = [asyncio.create_task(one(at, r)) for at, r in zip(plan.send_at_s, recs)]
    reporter = asyncio.create_task(report()) if progress_s > 0 else None
    remaining = max(0.1, t0 + cap_s - loop.time())
    _, pending = await asyncio.wait(tasks, timeout=remaining)
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    if reporter is not None:
        reporter.cancel()
    for r in recs:
        if not r.done and r.error is None:
            r.error = "capped" if r.late_s is not None else "not_sent"
    return recs, {"wall_s": round(loop.time() - t0, 2), "capped_requests": len(pending),
                  "client_cpu_s": round(time.process_time() - cpu0, 3)}


def _client_main(conn, plan: Plan, start_wall: float, cap_s: float, request_timeout_s: float) -> None:
    """A forked client process: replay its share and send the records back."""
    try:
        recs, info = asyncio.run(replay(plan, start_wall, cap_s, request_timeout_s, progress_s=0))
        conn.send(([(r.index, r.target, r.late_s, r.status, r.error, r.ttft_s, r.e2e_s, r.tokens, r.done, r.error_message) for r in recs],
                   info))
    except BaseException as exc:  # report, never hang the parent
        conn.send(exc.__class__.__name__ + ": " + str(exc))
    finally:
        conn.close()


def run_clients(plans: list[Plan], cap_s: float, request_timeout_s: float, cpu_interval_s: float, n: int,
                pids: dict[str, int]) -> tuple[list[Rec], dict[str, Any], dict[str, Any]]:
    """Replay in this process (one plan) or in forked client processes; CPU sampled meanwhile.
    Returns the n records (by index), the client's facts and the CPU summary."""
    start_wall = time.time() + 0.5
    if len(plans) == 1:
        sampler = CpuSampler(pids, cpu_interval_s)
        sampler.start()
        try:
            recs, info = asyncio.run(replay(plans[0], start_wall, cap_s, request_timeout_s))
        finally:
            cpu = sampler.stop()
        infos = [info]
    else:
        ctx = multiprocessing.get_context("fork")
        children = []
        start_wall = time.time() + 1.0
        for k, plan in enumerate(plans):
            parent, child = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_client_main, args=(child, plan, start_wall, cap_s, request_timeout_s),
                               daemon=True)
            proc.start()
            child.close()
            children.append((proc, parent))
        sampler = CpuSampler({**pids, **{f"client-{k}": p.pid for k, (p, _) in enumerate(children)}}, cpu_interval_s)
        sampler.start()
        recs, infos = [], []
        try:
            for proc, conn in children:
                if not conn.poll(cap_s + 60):
                    raise RuntimeError("a client process sent nothing back in time")
                got = conn.recv()
                if isinstance(got, str):
                    raise RuntimeError(f"a client process failed: {got}")
                rows, info = got
                recs += [Rec(*r[:2], late_s=r[2], status=r[3], error=r[4], ttft_s=r[5], e2e_s=r[6], tokens=r[7],
                             done=r[8], error_message=r[9]) for r in rows]
                infos.append(info)
        finally:
            cpu = sampler.stop()
            for proc, _ in children:
                proc.join(5)
                if proc.is_alive():
                    proc.kill()
        recs.sort(key=lambda r: r.index)
    client = {
        "processes": len(plans),
        "wall_s": max(i["wall_s"] for i in infos),
        "capped_requests": sum(i["capped_requests"] for i in infos),
        "cpu_s": round(sum(i["client_cpu_s"] for i in infos), 2),
    }
    client["cores"] = round(client["cpu_s"] / client["wall_s"], 3) if client["wall_s"] > 0 else None
    assert len(recs) == n
    return recs, client, cpu
