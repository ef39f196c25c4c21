"""Faults, side by side: FlexLB and the peer routers, each on its own fresh fleet of K
simulated engine servers, replaying the same trace rows at the same load while one of the
servers goes bad; what the clients saw.

    python bench/faults.py                                    # both scenarios, the three routers below
    python bench/faults.py --trace azure-conv --rows 200 --rate 1.5 --out bench/results/faults/faults_azure-conv.json
    python bench/faults.py --scenarios kill --configs flexlb-openai --rows 20       # a smoke run
    python bench/faults.py --configs flexlb-openai --flexlb-args "--retry-limit 0 --migration-limit 0" --name no-recovery

Scenarios (`--scenarios`, default both), each run once per configuration (`--configs`,
default `flexlb-openai,sglang-cache_aware,vllm-cache_aware`: bench/peers.py's names; FlexLB
runs its shipped defaults plus --flexlb-args), each cell on a FRESH fleet of `--workers` (4)
`flexlb sim-server` processes started by bench/peers_fleet.py exactly as bench/peers.py
starts them (FlexLB: its OpenAI agents in front of the servers, `AdapterFleet`; the peers:
`python -m sglang_router.launch_router` / `vllm_router.launch_router`, `SimFleet`):

- `kill`: engine server w<V> (`--victim`, default 1) is SIGKILLed (the sim-server process,
  not a router or an agent) at `--kill-at` (0.5) of the send span, i.e. in the middle of the
  replay; it stays dead.
- `fail-fast`: engine server w<V> runs with `--fail-generations`: it answers every
  generation 500 at once while its /health and /metrics answer as usual.

Who was "moved". The victim's URL, as handed to the router (or to FlexLB's agent), is a tiny
TCP proxy in this file (`_proxy`, its own process) in front of the server: it pipes bytes
both ways and notes the first time each request id crosses it (the `X-Request-Id` header
or the body's `request_id` / `rid`, whichever the router forwards). After the kill it stops
listening, so a dead server's port refuses connections as it would without it; when the
server's side closes or resets, it closes or resets the router's side alike.
- kill: a request was moved when it reached the victim before the kill and its client had
  not finished reading it (no `[DONE]`, no error, connection open) at the kill: the requests
  in flight on the killed server. The JSON also gives the requests in flight anywhere at the
  kill (sent before, not finished by it), `in_flight_at_kill_any_server`.
- fail-fast: a request was moved when it reached the bad server at least once. The good
  servers fail nothing, so that was its first attempt (a router's retry that lands on the bad
  server again counts once).
Kill cells send `--warmup` (2) tiny requests through the router before the replay, as
bench/peers.py does; fail-fast cells none (`--fail-fast-warmup`, 0), or the warm-ups meet the
bad server first (a first run did that: vllm-router's two failed warm-ups opened its circuit
breaker and none of the replay reached the server). Warm-ups are left out of everything.

Per cell: requests sent; completed OK (HTTP 200, every max_tokens token, a `finish_reason`,
`[DONE]`, no error event); failed, by error code (bench/loadgen.py's codes: `<status>:<code>`,
`stream:<code>`, `client_*`, `capped`; plus `client_short_stream` (done, tokens missing) and
`client_no_finish_reason`); SLO attainment as bench/peers.py computes it (an OK request with
TTFT ≤ `--slo-ttft-ms` 2000 and mean TPOT ≤ `--slo-tpot-ms` 100; every request counts,
failures are misses); and for the moved requests: how many, how many completed OK, the p99
TTFT of those that completed OK, and the p99 of their longest gap between two token chunks
(a migration or a retry mid-stream shows there, not in the TTFT). TTFT over all OK requests
is given for scale. FlexLB cells add its event log's counts (request.retried by code,
request.migrated, request.failed by code and message, worker.breaker_changed) and its
retry / migration / breaker counters; the peers' cells their routers' error, retry and
circuit-breaker counters (deltas over the replay).

Load: rows `--start-row`..+`--rows` of `--trace` (default azure-conv, 200 rows), row i sent
at (ts_i - ts_0) / `--rate` (1.5) seconds, time scale 1 as bench/peers.py: 200 azure-conv
rows at ×1.5 arrive over 41 s at 4.9 req/s, about a quarter of 4 servers' capacity bound for
this trace (bench/capacity.py; ~18 req/s at 4 servers, bench/results/peers_azure-conv.json),
a third of 3 servers': failures, not overload, are what the cells differ by. Open loop, one
connection per request (the client is this file's, bench/loadgen.py's protocol plus the
finish reason, send and end times and the longest token gap); the run is capped at the
last send + `--drain-s` (30 s).

Output: `--out` (default bench/results/faults/faults_<trace>.json: every cell, its fleet's
commands, the moved requests' records) and a markdown table on stdout. bench/README.md
("faults.py") has the results.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shlex
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.common import (  # noqa: E402
    CpuSampler,
    Proc,
    child_env,
    dump_json,
    free_port,
    http_body_parts,
    machine_facts,
    percentile,
    stop_all,
    wait_http,
)
from bench.loadgen import Rec, error_code, stream_error_code  # noqa: E402
from bench.peers import build_bodies, miss_kind, versions  # noqa: E402
from bench.peers_fleet import Fleet, builtin_configs, make_fleet, sim_server_check, warm_up  # noqa: E402
from bench.workloads import CHAT_WORKLOADS, Row, load_workload  # noqa: E402

SCENARIOS = ("kill", "fail-fast")
DEFAULT_CONFIGS = ("flexlb-openai", "sglang-cache_aware", "vllm-cache_aware")
WARMUP_PREFIX = "warmup-"
_DECODER = msgspec.json.Decoder()


# --------------------------------------------------------------------------- the victim's proxy
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/generate")  # as the sim-server's
_BODY_ID_RE = re.compile(rb'"(?:request_id|rid)"\s*:\s*"([^"\\]+)"')


class RequestSniffer:
    """Reads the HTTP/1.1 requests of one connection as its bytes go by (Content-Length or
    chunked bodies) and returns the request id of each generation request: its X-Request-Id,
    else its body's `request_id` / `rid`. Other requests (/health, /metrics, vLLM's
    /v1/completions/render, which vllm-router sends to a worker to tokenize a prompt it may
    route elsewhere) are skipped. A request it cannot frame ends the sniffing of that
    connection (the bytes still go through)."""

    def __init__(self) -> None:
        self.buf = b""
        self.head: tuple[bool, bytes | None] | None = None  # (a generation?, its header id) while in a body
        self.left = 0  # Content-Length bytes of the body still to come
        self.chunked = False
        self.body = b""
        self.broken = False

    def feed(self, data: bytes) -> list[str]:
        if self.broken:
            return []
        self.buf += data
        out: list[str] = []
        try:
            while self._step(out):
                pass
        except ValueError:
            self.broken = True
        return out

    def _step(self, out: list[str]) -> bool:
        if self.head is None:
            cut = self.buf.find(b"\r\n\r\n")
            if cut < 0:
                return False
            lines = self.buf[:cut].split(b"\r\n")
            self.buf = self.buf[cut + 4:]
            parts = lines[0].split()
            gen = len(parts) >= 2 and parts[0] == b"POST" and parts[1].split(b"?")[0].decode("latin-1") in GENERATION_PATHS
            rid = None
            self.left, self.chunked, self.body = 0, False, b""
            for line in lines[1:]:
                k, _, v = line.partition(b":")
                k, v = k.strip().lower(), v.strip()
                if k == b"x-request-id":
                    rid = v
                elif k == b"content-length":
                    self.left = int(v)
                elif k == b"transfer-encoding" and b"chunked" in v.lower():
                    self.chunked = True
            self.head = (gen, rid)
            return True
        if self.chunked:
            cut = self.buf.find(b"\r\n")
            if cut < 0:
                return False
            size = int(self.buf[:cut].split(b";")[0].strip() or b"0", 16)
            if len(self.buf) < cut + 2 + size + 2:
                return False
            self.body += self.buf[cut + 2:cut + 2 + size]
            self.buf = self.buf[cut + 2 + size + 2:]
            if size:
                return True
        else:
            take = min(self.left, len(self.buf))
            self.body += self.buf[:take]
            self.buf, self.left = self.buf[take:], self.left - take
            if self.left:
                return False
        gen, rid = self.head
        if gen:
            if rid is None and (m := _BODY_ID_RE.search(self.body)):
                rid = m.group(1)
            if rid:
                out.append(rid.decode("latin-1"))
        self.head, self.body = None, b""
        return True


async def _proxy(listen_port: int, upstream_port: int, ids_path: str) -> None:
    """Pipe 127.0.0.1:listen_port <-> 127.0.0.1:upstream_port, one upstream connection per
    downstream one; note the first time each generation request's id goes by ("<wall s> <id>"
    lines). SIGUSR1: stop listening (a killed server's port refuses). SIGTERM: exit."""
    loop = asyncio.get_running_loop()
    seen: set[str] = set()
    out = open(ids_path, "a", buffering=1)
    done = asyncio.Event()

    async def one_way(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, sniffer: RequestSniffer | None) -> None:
        try:
            while data := await reader.read(1 << 16):
                if sniffer is not None:
                    for rid in sniffer.feed(data):
                        if rid not in seen:
                            seen.add(rid)
                            out.write(f"{time.time():.6f} {rid}\n")
                writer.write(data)
                await writer.drain()
            writer.close()  # its side closed: close ours (FIN)
        except (OSError, asyncio.IncompleteReadError):
            writer.transport.abort()  # its side reset: reset ours (RST)

    async def handle(down_r: asyncio.StreamReader, down_w: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.open_connection("127.0.0.1", upstream_port)
        except OSError:
            down_w.transport.abort()
            return
        await asyncio.gather(one_way(down_r, up_w, RequestSniffer()), one_way(up_r, down_w, None))

    server = await asyncio.start_server(handle, "127.0.0.1", listen_port, backlog=1024)
    loop.add_signal_handler(signal.SIGUSR1, server.close)
    loop.add_signal_handler(signal.SIGTERM, done.set)
    await done.wait()
    server.close()
    out.close()


class VictimProxy:
    """`_proxy` in front of engine `victim` of a fleet: `fleet.engine_front` (bench/peers_fleet.py)."""

    def __init__(self, fleet: Fleet, victim: int, workdir: Path, tag: str) -> None:
        self.fleet, self.victim = fleet, victim
        self.ids_path = workdir / f"{tag}-victim-ids.txt"
        self.proc: Proc | None = None
        fleet.engine_front = self.front

    def front(self, i: int, url: str) -> str:
        if i != self.victim:
            return url
        port = free_port()
        argv = [sys.executable, str(Path(__file__).resolve()), "_proxy", str(port), url.rsplit(":", 1)[1],
                str(self.ids_path)]
        self.proc = Proc(f"proxy-w{i}", argv, self.ids_path.with_suffix(".log"), child_env(self.ids_path.parent))
        self.fleet.procs.append(self.proc)  # stopped with the fleet (after its router)
        self.proc.start()
        front = f"http://127.0.0.1:{port}"
        wait_http(front + "/health", time.monotonic() + 30, [self.proc], lambda s, _: s == 200)
        return front

    def seen(self) -> dict[str, float]:
        """Request id -> the wall time it first reached the victim."""
        out: dict[str, float] = {}
        try:
            for line in self.ids_path.read_text().splitlines():
                t, _, rid = line.partition(" ")
                out.setdefault(rid, float(t))
        except OSError:
            pass
        return out


# --------------------------------------------------------------------------- the client
@dataclass
class FaultRec(Rec):
    """Rec (bench/loadgen.py) plus what a fault needs: send and end times (s after the
    replay's start), the finish reason and the longest gap between two token chunks."""

    t_send: float | None = None
    t_end: float | None = None
    finish_reason: str | None = None
    max_gap_s: float = 0.0


async def stream_request(host: str, port: int, body: bytes, rec: FaultRec, request_id: str, t0: float) -> None:
    """bench/loadgen.py's `stream_one` (a streamed /v1/completions on its own connection, the
    same error codes), also keeping the finish reason, the end time and the longest token gap."""
    loop = asyncio.get_running_loop()
    rec.t_send = loop.time() - t0
    writer = None
    last_token: float | None = None
    try:
        reader, writer = await asyncio.open_connection(host, port, limit=1 << 20)
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                f"Accept: text/event-stream\r\nX-Request-Id: {request_id}\r\nContent-Length: {len(body)}\r\n"
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
        if rec.status != 200:
            rec.error = error_code(rec.status, b"".join([p async for p in http_body_parts(reader, chunked, length)]))
            return
        buf = b""
        t_req = t0 + rec.t_send
        async for chunk in http_body_parts(reader, chunked, length):
            now = loop.time()
            buf += chunk.replace(b"\r\n", b"\n") if b"\r" in chunk else chunk
            while (cut := buf.find(b"\n\n")) >= 0:
                event, buf = buf[:cut], buf[cut + 2:]
                for line in event.split(b"\n"):
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        rec.done = True
                        rec.e2e_s = now - t_req
                        return
                    obj = _DECODER.decode(data)
                    if "error" in obj:
                        err = obj["error"]
                        rec.error = stream_error_code(err)
                        rec.error_message = str(err.get("message", "") if isinstance(err, dict) else err)[:300]
                        continue
                    choices = obj.get("choices") or [{}]
                    n = len(choices[0].get("text") or "")  # byte tokenizer: one character, one token
                    if choices[0].get("finish_reason"):
                        rec.finish_reason = choices[0]["finish_reason"]
                    if n:
                        rec.tokens += n
                        if rec.ttft_s is None:
                            rec.ttft_s = now - t_req
                        else:
                            rec.max_gap_s = max(rec.max_gap_s, now - last_token)
                        last_token = now
        if rec.error is None:
            rec.error = "client_no_done"
    except (OSError, asyncio.IncompleteReadError, ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
        rec.error = rec.error or f"client_{exc.__class__.__name__}"
    finally:
        rec.t_end = loop.time() - t0
        if writer is not None:
            writer.close()


async def replay_with_fault(bodies: list[bytes], ids: list[str], send_at: list[float], url: tuple[str, int],
                            start_wall: float, cap_s: float, request_timeout_s: float,
                            fault_at_s: float | None, fault: Any) -> tuple[list[FaultRec], dict[str, Any]]:
    """Open loop as bench/loadgen.py's `replay` (one task per request, capped at `cap_s`),
    and `fault()` called at `fault_at_s` after the start (None: never)."""
    loop = asyncio.get_running_loop()
    t0 = loop.time() + (start_wall - time.time())
    recs = [FaultRec(i, 0) for i in range(len(bodies))]
    info: dict[str, Any] = {}

    async def one(at: float, rec: FaultRec) -> None:
        delay = t0 + at - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        rec.late_s = loop.time() - (t0 + at)
        try:
            await asyncio.wait_for(stream_request(*url, bodies[rec.index], rec, ids[rec.index], t0), request_timeout_s)
        except asyncio.TimeoutError:
            rec.error = rec.error or "client_timeout"

    async def inject() -> None:
        await asyncio.sleep(max(0.0, t0 + fault_at_s - loop.time()))
        info["fault_at_s"] = round(loop.time() - t0, 4)
        info["fault_at_wall"] = time.time()
        info["fault"] = fault()
        print(f"    t={info['fault_at_s']:.1f}s fault: {info['fault']}", file=sys.stderr, flush=True)

    async def report() -> None:
        while True:
            await asyncio.sleep(10)
            print(f"    t={loop.time() - t0:6.1f}s sent {sum(r.late_s is not None for r in recs)} done "
                  f"{sum(r.done for r in recs)} errors {sum(r.error is not None for r in recs)} of {len(recs)}",
                  file=sys.stderr, flush=True)

    tasks = [asyncio.create_task(one(at, r)) for at, r in zip(send_at, recs)]
    side = [asyncio.create_task(report())]
    if fault_at_s is not None:
        side.append(asyncio.create_task(inject()))
    _, pending = await asyncio.wait(tasks, timeout=max(0.1, t0 + cap_s - loop.time()))
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    for t in side:
        if not t.done():
            t.cancel()
    await asyncio.gather(*side, return_exceptions=True)
    for r in recs:
        if not r.done and r.error is None:
            r.error = "capped" if r.late_s is not None else "not_sent"
    info |= {"wall_s": round(loop.time() - t0, 2), "capped_requests": len(pending)}
    return recs, info


# --------------------------------------------------------------------------- outcomes
def is_ok(rec: FaultRec, max_tokens: int) -> bool:
    """Completed: 200, [DONE], no error event, every max_tokens token, a finish reason."""
    return (rec.done and rec.error is None and rec.ttft_s is not None and rec.tokens == max_tokens
            and rec.finish_reason is not None)


def failure_code(rec: FaultRec, max_tokens: int) -> str:
    if rec.error:
        return rec.error
    if rec.done and rec.tokens != max_tokens:
        return "client_short_stream"
    if rec.done and rec.finish_reason is None:
        return "client_no_finish_reason"
    return "client_unknown"


def p99_ms(values: list[float]) -> float | None:
    return round(percentile(sorted(values), 99) * 1000.0, 1) if values else None


def outcome(recs: list[FaultRec], rows: list[Row], args: argparse.Namespace) -> dict[str, Any]:
    ok = [r for r in recs if is_ok(r, rows[r.index].max_tokens)]
    attained = sum(1 for r in ok if miss_kind(r, rows[r.index].max_tokens, args) is None)
    errors = Counter(failure_code(r, rows[r.index].max_tokens) for r in recs if not is_ok(r, rows[r.index].max_tokens))
    samples: dict[str, list[str]] = {}
    for r in recs:
        if r.error and r.error_message and len(samples.setdefault(r.error, [])) < 3:
            samples[r.error].append(r.error_message)
    n = len(recs)
    return {
        "requests": n,
        "sent": sum(1 for r in recs if r.late_s is not None),
        "ok": len(ok),
        "failed": n - len(ok),
        "errors": dict(errors.most_common()),
        "error_samples": {k: v for k, v in samples.items() if v},
        "attained": attained,
        "slo_attainment": round(attained / n, 4) if n else None,
        "ttft_p99_ms": p99_ms([r.ttft_s for r in ok]),
        "ttft_p50_ms": round(percentile(sorted(r.ttft_s for r in ok), 50) * 1000.0, 1) if ok else None,
        "max_gap_p99_ms": p99_ms([r.max_gap_s for r in ok]),
    }


def moved_records(recs: list[FaultRec], rows: list[Row], start_wall: float, seen: dict[str, float]) -> list[dict[str, Any]]:
    out = []
    for r in recs:
        rid = rows[r.index].request_id
        out.append({"request_id": rid, "reached_victim_s": round(seen[rid] - start_wall, 3) if rid in seen else None,
                    "sent_s": None if r.t_send is None else round(r.t_send, 3),
                    "ended_s": None if r.t_end is None else round(r.t_end, 3),
                    "ttft_ms": None if r.ttft_s is None else round(r.ttft_s * 1000, 1),
                    "e2e_ms": None if r.e2e_s is None else round(r.e2e_s * 1000, 1),
                    "max_gap_ms": round(r.max_gap_s * 1000, 1), "tokens": r.tokens,
                    "max_tokens": rows[r.index].max_tokens, "finish_reason": r.finish_reason, "error": r.error})
    return out


# --------------------------------------------------------------------------- the routers' own facts
async def flexlb_facts(nats_url: str, victim_worker: str, watch: list[str], start_wall: float) -> dict[str, Any]:
    """What FlexLB's event log says of the replay (warm-ups left out), and the request events
    of the requests in `watch` (s after the replay's start, the producer's clock)."""
    from schemas import messages as m
    from services.eventlog import read_stream

    envs = await asyncio.wait_for(read_stream(nats_url), 120)
    watched = set(watch)
    timelines: dict[str, list[str]] = {rid: [] for rid in watch}
    skip = (m.TokensGenerated, m.TokensBatch)
    for env in envs:
        p = env.payload
        if isinstance(p, skip):
            continue
        rid = getattr(p, "request_id", None)
        for r in [rid] if rid in watched else watched.intersection(getattr(p, "request_ids", ())):
            who = getattr(p, "to_worker_id", None) or getattr(p, "prefill_worker_id", None) or getattr(p, "worker_id", "")
            timelines[r].append(f"{env.time_ns / 1e9 - start_wall:.3f} {type(p).__name__} {who}"
                                + (f" {p.code}" if hasattr(p, "code") else "")
                                + (f" ({p.reason})" if isinstance(p, m.BatchDispatched) else ""))
    c: Counter = Counter()
    failures: Counter = Counter()
    retried_by_code: Counter = Counter()
    breaker: list[str] = []
    liveness: list[str] = []
    for env in envs:
        p = env.payload
        if getattr(p, "request_id", "").startswith(WARMUP_PREFIX):
            continue
        if isinstance(p, m.RequestFinished):
            c["finished"] += 1
        elif isinstance(p, m.RequestFailed):
            c["failed"] += 1
            failures[f"{p.code}: {p.message[:160]}"] += 1
        elif isinstance(p, m.RequestRejected):
            c[f"rejected:{p.code}"] += 1
        elif isinstance(p, m.RequestRetried):
            c["retried"] += 1
            c["retried_from_victim"] += p.from_worker_id == victim_worker
            retried_by_code[p.code] += 1
        elif isinstance(p, m.RequestMigrated):
            c["migrated"] += 1
            c["migrated_from_victim"] += p.from_worker_id == victim_worker
        elif isinstance(p, m.WorkerBreakerChanged):
            breaker.append(f"{p.worker_id} {p.from_state}->{p.to_state}")
        elif isinstance(p, m.WorkerLivenessChanged):
            liveness.append(f"{p.worker_id} {p.liveness} (rerouted {p.num_rerouted}, migrated {p.num_migrated}, "
                            f"failed {p.num_failed})")
    for events in timelines.values():
        events.sort(key=lambda e: float(e.split(" ", 1)[0]))
    return {"victim_worker": victim_worker, "events": dict(sorted(c.items())),
            "retried_by_code": dict(retried_by_code), "failure_messages": dict(failures.most_common(10)),
            "breaker_transitions": len(breaker), "breaker_first": breaker[:12], "liveness_changes": liveness,
            "moved_timelines": timelines}


def counter_delta(before: dict[str, float], after: dict[str, float], words: tuple[str, ...]) -> dict[str, float]:
    def wanted(key: str) -> bool:  # counters and gauges, not a histogram's or summary's parts
        name = key.split("{", 1)[0]
        return (any(w in name for w in words) and not name.endswith(("_bucket", "_sum", "_created"))
                and "quantile=" not in key)

    keys = {k for k in after if wanted(k)}
    return {k: after[k] - before.get(k, 0.0) for k in sorted(keys) if after[k] - before.get(k, 0.0)}


def router_counters(fleet: Fleet) -> dict[str, float]:
    if fleet.config.kind.startswith("flexlb"):
        return fleet.router_counters() or {}
    return fleet.router_metrics()


FLEXLB_WORDS = ("retries", "migrations", "breaker", "failed", "errors")
PEER_WORDS = ("",)  # every counter router_metrics keeps (errors, retries, circuit breaking, non-2xx)


# --------------------------------------------------------------------------- one cell
def run_cell(scenario: str, config: Any, label: str, rows: list[Row], bodies: list[bytes], args: argparse.Namespace,
             workdir: Path, seq: int) -> dict[str, Any]:
    send_at = [r.ts_ms / 1000.0 / args.rate for r in rows]
    span_s = send_at[-1]
    cap_s = span_s + args.drain_s
    tag = f"{seq:02d}-{scenario}-{label}"
    fleet = make_fleet(config, args, workdir, tag)
    proxy = VictimProxy(fleet, args.victim, workdir, tag)
    if scenario == "fail-fast":
        fleet.engine_args[args.victim] = ["--fail-generations"]
    cell: dict[str, Any] = {"scenario": scenario, "config": label, "kind": config.kind, "victim": f"w{args.victim}"}
    print(f"[{scenario} / {label}] starting a fresh fleet", file=sys.stderr, flush=True)
    t_start = time.monotonic()
    try:
        fleet.start()
        cell["startup_s"] = round(time.monotonic() - t_start, 1)
        # fail-fast: no warm-up by default, or a router's warm-ups meet the bad server before the
        # replay (vllm-router's two failed ones opened its circuit breaker: the replay never reached it)
        warm = args.warmup if scenario == "kill" else args.fail_fast_warmup
        cell["warmup_requests"] = warm_up(fleet, argparse.Namespace(**{**vars(args), "warmup": warm}),
                                          time.monotonic() + args.startup_timeout_s)
        victim_proc = next(p for p in fleet.procs if p.name == f"worker-w{args.victim}")
        before = router_counters(fleet)

        def kill() -> str:
            os.kill(victim_proc.pid, signal.SIGKILL)
            os.kill(proxy.proc.pid, signal.SIGUSR1)  # its port refuses from now on, as a dead server's
            return f"SIGKILL to engine server w{args.victim} (pid {victim_proc.pid})"

        fault_at = args.kill_at * span_s if scenario == "kill" else None
        sampler = CpuSampler(fleet.pids(), 1.0)
        sampler.start()
        start_wall = time.time() + 0.5
        try:
            recs, client = asyncio.run(replay_with_fault(bodies, [r.request_id for r in rows], send_at, fleet.urls[0],
                                                         start_wall, cap_s, args.request_timeout_s, fault_at, kill))
        finally:
            cpu = sampler.stop()
        time.sleep(1.0)  # the last events land
        seen = {rid: t for rid, t in proxy.seen().items() if not rid.startswith(WARMUP_PREFIX)}
        cell |= outcome(recs, rows, args)
        if scenario == "kill":
            t_kill, wall_kill = client["fault_at_s"], client["fault_at_wall"]
            cell["kill_at_s"] = t_kill
            moved = [r for r in recs if seen.get(rows[r.index].request_id, float("inf")) < wall_kill
                     and (r.t_end is None or r.t_end > t_kill)]
            cell["in_flight_at_kill_any_server"] = sum(1 for r in recs if r.t_send is not None and r.t_send < t_kill
                                                       and (r.t_end is None or r.t_end > t_kill))
            cell["moved_definition"] = "reached the killed server before the kill and not finished at the kill"
        else:
            moved = [r for r in recs if rows[r.index].request_id in seen]
            cell["moved_definition"] = "reached the failing server (first attempt)"
        cell["reached_victim"] = len(seen)
        mo = outcome(moved, rows, args) if moved else {}
        cell["moved"] = {"n": len(moved), "ok": mo.get("ok", 0), "errors": mo.get("errors", {}),
                         "slo_attainment": mo.get("slo_attainment"), "ttft_p99_ms": mo.get("ttft_p99_ms"),
                         "max_gap_p99_ms": mo.get("max_gap_p99_ms")}
        cell["moved_requests"] = moved_records(moved, rows, start_wall, seen)
        cell["client"] = {k: v for k, v in client.items() if k != "fault_at_wall"}
        cell["cpu"] = {k: cpu.get(k) for k in ("machine_busy_cores", "saturated_fraction", "foreign_cores",
                                               "mean_cores_by_process")}
        after = router_counters(fleet)
        if config.kind.startswith("flexlb"):
            cell["router_counters"] = counter_delta(before, after, FLEXLB_WORDS)
            watch = [rows[r.index].request_id for r in moved][:12]
            cell["flexlb_events"] = asyncio.run(flexlb_facts(fleet.state["nats_url"], f"w{args.victim}", watch,
                                                             start_wall))
        else:
            cell["router_counters"] = counter_delta(before, after, PEER_WORDS)
            cell["router_log"] = fleet.router_log_findings()
        m = cell["moved"]
        print(f"[{scenario} / {label}] sent {cell['sent']} ok {cell['ok']} failed {cell['failed']} {cell['errors']}; "
              f"SLO {cell['slo_attainment']}; moved {m['n']} ok {m['ok']} TTFT p99 {m['ttft_p99_ms']} ms, gap p99 "
              f"{m['max_gap_p99_ms']} ms; CPU busy {cpu['machine_busy_cores']['mean']} cores",
              file=sys.stderr, flush=True)
        cell["harness_ok"] = True
    except Exception as exc:  # one cell's failure is reported; the others go on
        cell["harness_ok"] = False
        cell["error"] = f"{exc.__class__.__name__}: {exc}"
        print(f"[{scenario} / {label}] failed: {cell['error']}", file=sys.stderr, flush=True)
        cell["log_tails"] = {p.name: p.log_tail(15) for p in fleet.procs}
    finally:
        cell["commands"] = fleet.commands()
        codes = fleet.stop()
        cell["exit_codes"] = codes
        ok_codes = (0, -signal.SIGTERM, 128 + signal.SIGTERM)
        bad = {k: v for k, v in codes.items() if v not in ok_codes
               and not (scenario == "kill" and k == f"worker-w{args.victim}" and v == -signal.SIGKILL)}
        if bad:
            cell["stop_note"] = f"exit status after SIGTERM not 0 or SIGTERM: {bad} (None: killed after the timeout)"
            print(f"[{scenario} / {label}] {cell['stop_note']}", file=sys.stderr, flush=True)
        cell["wall_s"] = round(time.monotonic() - t_start, 1)
    return cell


# --------------------------------------------------------------------------- report
def cell_text(x: Any) -> str:
    return "—" if x is None else f"{x:,.0f}" if isinstance(x, float) else str(x)


def markdown_table(cells: list[dict[str, Any]]) -> str:
    head = ("| scenario | router | sent | OK | failed (codes) | SLO attainment | moved | moved OK | "
            "moved TTFT p99 ms | moved max gap p99 ms | TTFT p99 ms, all OK |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for c in cells:
        if not c.get("harness_ok"):
            lines.append(f"| {c['scenario']} | {c['config']} | harness failed: {c.get('error', '')[:80]} |")
            continue
        codes = ", ".join(f"{k} {v}" for k, v in c["errors"].items())
        m = c["moved"]
        lines.append(f"| {c['scenario']} | {c['config']} | {c['sent']} | {c['ok']} | {c['failed']}"
                     f"{f' ({codes})' if codes else ''} | {c['slo_attainment']:.3f} | {m['n']} | {m['ok']} | "
                     f"{cell_text(m['ttft_p99_ms'])} | {cell_text(m['max_gap_p99_ms'])} | {cell_text(c['ttft_p99_ms'])} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", default="azure-conv", help="a bench/workloads.py workload or a trace path (default azure-conv)")
    p.add_argument("--rows", type=int, default=200)
    p.add_argument("--start-row", type=int, default=0)
    p.add_argument("--rate", type=float, default=1.5, help="the trace's rate multiplier (default 1.5)")
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma-separated: {', '.join(SCENARIOS)}")
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS), help="bench/peers.py's configuration names")
    p.add_argument("--flexlb-args", default="", help="appended to every `flexlb up` command line")
    p.add_argument("--name", help="label suffix of the FlexLB configurations when --flexlb-args is given")
    p.add_argument("--peer-args", default="", help="appended to every peer router's command line")
    p.add_argument("--workers", type=int, default=4, help="engine servers per fleet (default 4)")
    p.add_argument("--victim", type=int, default=1, help="the engine server killed or failing: w<VICTIM> (default 1)")
    p.add_argument("--kill-at", type=float, default=0.5, help="kill: when, as a fraction of the send span (default 0.5)")
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=100.0)
    p.add_argument("--max-prompt-tokens", type=int, default=32000)
    p.add_argument("--drain-s", type=float, default=30.0, help="wall s allowed after the last send (default 30)")
    p.add_argument("--request-timeout-s", type=float, default=90.0)
    p.add_argument("--startup-timeout-s", type=float, default=120.0)
    p.add_argument("--stop-timeout-s", type=float, default=20.0)
    p.add_argument("--warmup", type=int, default=2, help="kill: tiny requests through the router before the replay (2)")
    p.add_argument("--fail-fast-warmup", type=int, default=0,
                   help="fail-fast: the same (default 0: the replay's requests are the first to meet the bad server)")
    p.add_argument("--model-name", default="flexlb-sim")
    p.add_argument("--sim-server-cmd", help="command starting one engine server (default: `flexlb sim-server`)")
    p.add_argument("--keep-logs", action="store_true", help="keep the processes' logs (the folder is printed)")
    p.add_argument("--out", help="JSON report (default bench/results/faults/faults_<trace>.json)")
    args = p.parse_args(argv)
    args.scenario_list = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    if not args.scenario_list or any(s not in SCENARIOS for s in args.scenario_list):
        p.error(f"--scenarios takes {', '.join(SCENARIOS)}")
    known = builtin_configs()
    names = [x.strip() for x in args.configs.split(",") if x.strip()]
    bad = [n for n in names if n not in known or known[n].kind == "flexlb"]
    if bad or not names:
        p.error(f"--configs: {bad} (these run sim-server fleets: "
                f"{', '.join(n for n, c in known.items() if c.kind != 'flexlb')})")
    args.flexlb_args_list = shlex.split(args.flexlb_args)
    args.peer_args_list = shlex.split(args.peer_args)
    args.selected = [(known[n], f"{n}+{args.name or 'custom'}" if known[n].kind.startswith("flexlb")
                      and args.flexlb_args_list else n) for n in names]
    if not 0 <= args.victim < args.workers or args.workers < 2 or args.rows < 2 or not 0 < args.kill_at < 1:
        p.error("--workers >= 2, 0 <= --victim < --workers, --rows >= 2, 0 < --kill-at < 1")
    # what bench/peers_fleet.py's fleets read (engine flags: none given, every engine's defaults)
    args.time_scale = 1.0
    for k in ("num_kv_blocks", "block_size_tokens", "max_seq_len_tokens", "max_num_batched_tokens", "max_num_seqs",
              "max_prefill_tokens", "profile"):
        setattr(args, k, None)
    args.no_chunked_prefill = False
    args.marginal_over_refusal = False
    args.sim_server_has_host = False
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    def on_term(signum, frame):  # SIGTERM: unwind through every finally (fleets get stopped)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    problem = sim_server_check(args)
    if problem:
        print(f"cannot run: {problem}", file=sys.stderr)
        return 1
    chat = CHAT_WORKLOADS.get(args.trace)
    rows = load_workload(args.trace, args.start_row, args.rows, args.max_prompt_tokens, seed=0, chat=chat)
    if len(rows) < 2 or rows[-1].ts_ms <= 0:
        print("need at least 2 rows with distinct timestamps", file=sys.stderr)
        return 1
    bodies = build_bodies(rows, args)
    span_s = rows[-1].ts_ms / 1000.0 / args.rate
    trace_name = Path(args.trace).stem if args.trace not in CHAT_WORKLOADS and os.sep in args.trace else args.trace
    out = Path(args.out) if args.out else REPO / "bench" / "results" / "faults" / f"faults_{trace_name}.json"
    print(f"{args.trace}: {len(rows)} rows at ×{args.rate:g}: {len(rows) / span_s:.2f} req/s over {span_s:.1f} s; "
          f"scenarios {', '.join(args.scenario_list)}; {', '.join(lbl for _, lbl in args.selected)}",
          file=sys.stderr, flush=True)
    workdir = Path(tempfile.mkdtemp(prefix="flexlb-faults-"))
    result: dict[str, Any] = {
        "benchmark": "bench/faults.py: a killed and a failing engine server, FlexLB vs the peer routers",
        "command": shlex.join([sys.executable, *sys.argv]),
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine_facts() | {"versions": versions()},
        "trace": args.trace, "rows": len(rows), "start_row": args.start_row, "rate_multiplier": args.rate,
        "load_req_per_s": round(len(rows) / span_s, 3), "send_span_s": round(span_s, 2),
        "slo": {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms},
        "flags": {k: v for k, v in vars(args).items() if k not in ("selected",)}
        | {"configs_run": [lbl for _, lbl in args.selected]},
        "max_tokens_total": sum(r.max_tokens for r in rows),
        "cells": [],
    }
    t0 = time.monotonic()
    failed = False
    seq = 0
    try:
        for scenario in args.scenario_list:
            for config, label in args.selected:
                seq += 1
                cell = run_cell(scenario, config, label, rows, bodies, args, workdir, seq)
                failed |= not cell["harness_ok"] or bool(cell.get("stop_note"))
                result["cells"].append(cell)
                write_json(result, out)
    except KeyboardInterrupt:
        failed = True
        result["interrupted"] = True
    finally:
        stop_all(args.stop_timeout_s)
    result["total_wall_s"] = round(time.monotonic() - t0, 1)
    result["table_markdown"] = markdown_table(result["cells"])
    write_json(result, out)
    print(result["table_markdown"])
    print(f"wrote {out} ({result['total_wall_s']} s)")
    if args.keep_logs or failed:
        print(f"process logs: {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    return 1 if failed else 0


def write_json(result: dict[str, Any], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(dump_json(result) + "\n")
    os.replace(tmp, out)


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "_proxy":
        asyncio.run(_proxy(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]))
        sys.exit(0)
    try:
        sys.exit(main())
    finally:
        stop_all()
