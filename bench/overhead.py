"""Control-plane overhead of FlexLB: requests/s and latency with an instant engine.

    python bench/overhead.py [--concurrency 1,8,32,128] [--requests-per-level N] [--workers 2]
                             [--max-tokens 1] [--stream] [--batch-wait-ms 10,0]
                             [--out bench/results/overhead.json]

For each batching window in `--batch-wait-ms` (default: the router's default 10 ms, then 0)
it starts `flexlb up --time-scale 0` as a subprocess (simulated workers that take no time,
so every millisecond measured is control plane: HTTP parse, admission, the batching window,
the ledger reservation in Redis, the JetStream dispatch, the worker's pull, the token relay
over core NATS, the response or SSE), waits for its state file and /readyz, then for each
concurrency level C runs a warm-up and a closed loop of C clients (one keep-alive
httpx.AsyncClient) that issue a fixed number of requests, bounded by a wall-clock cap too.
After each level it waits until the router holds no inflight request, and reads deltas of:
the router's /metrics (batch-size histogram, batch close reasons, router-side TTFT), Redis
INFO commandstats (calls per request), JetStream stream sequences (dispatch messages per
batch, events per request) and the CPU time of every process of the stack and of this load
generator (from /proc). At the end it sends SIGTERM to `flexlb up` and checks it exits 0.

The load generator runs on the same machine as the stack and competes with it for CPU;
the report says how many cores there are and how much CPU each side used.
Exit status: 0 when every level ran without errors and the stack stopped cleanly, 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shutil
import signal
import string
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
CLK_TCK = os.sysconf("SC_CLK_TCK")
BATCH_BUCKETS = ("1", "2", "4", "8", "16", "32", "64", "+Inf")  # le bounds of flexlb_batch_size_requests


# --------------------------------------------------------------------------- small helpers
def percentile(sorted_values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in [0, 100]) of an ascending list."""
    if not sorted_values:
        return None
    if len(sorted_values) == 1:
        return sorted_values[0]
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def summarize_ms(values_s: list[float]) -> dict[str, float | None]:
    v = sorted(x * 1000.0 for x in values_s)
    out: dict[str, float | None] = {q: percentile(v, p) for q, p in (("p50", 50), ("p90", 90), ("p99", 99))}
    out["mean"] = sum(v) / len(v) if v else None
    out["max"] = v[-1] if v else None
    return {k: (round(x, 3) if x is not None else None) for k, x in out.items()}


def free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def proc_cpu_s(pid: int) -> float | None:
    """user + system CPU seconds of a process (Linux /proc), None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime (fields 14, 15)
    except (OSError, IndexError, ValueError):
        return None


def self_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text format -> {'name{labels}': value} (labels as printed)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        try:
            out[key] = float(value)
        except ValueError:
            continue
    return out


def metric_delta(before: dict[str, float], after: dict[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


def labelled(metrics: dict[str, float], name: str) -> dict[str, float]:
    """{'label text': value} of every sample of a metric family with labels."""
    prefix = name + "{"
    return {k[len(prefix):-1]: v for k, v in metrics.items() if k.startswith(prefix)}


def machine_facts() -> dict[str, Any]:
    facts: dict[str, Any] = {
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
    }
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    facts["cpu_model"] = line.split(":", 1)[1].strip()
                    break
        with open("/proc/meminfo") as fh:
            facts["mem_total_gib"] = round(int(fh.readline().split()[1]) / 2**20, 1)
    except OSError:
        pass
    versions = {}
    from importlib import metadata

    for pkg in ("httpx", "uvicorn", "fastapi", "nats-py", "redis", "msgspec", "uvloop", "httptools"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = None
    facts["packages"] = versions
    for binary in ("nats-server", "redis-server"):
        try:
            from services.infra import find_binary

            out = subprocess.run([find_binary(binary), "--version"], capture_output=True, text=True, timeout=10)
            facts[binary] = (out.stdout or out.stderr).strip().splitlines()[0]
        except Exception as exc:  # a fact we could not read is reported, not fatal
            facts[binary] = f"unknown ({exc.__class__.__name__})"
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=10)
        facts["git_commit"] = commit.stdout.strip()
        facts["git_dirty_files"] = [ln[3:] for ln in dirty.stdout.splitlines()]
    except (OSError, subprocess.SubprocessError):
        pass
    return facts


# --------------------------------------------------------------------------- the stack
class Stack:
    """`flexlb up` as a subprocess in its own session: started, probed, stopped."""

    def __init__(self, args: argparse.Namespace, batch_wait_ms: float, workdir: Path) -> None:
        self.args = args
        self.batch_wait_ms = batch_wait_ms
        self.port = free_port()
        self.state_file = workdir / f"state-{batch_wait_ms:g}.json"
        self.log_path = workdir / f"up-{batch_wait_ms:g}.log"
        self.proc: subprocess.Popen | None = None
        self.state: dict[str, Any] = {}
        self.exit_code: int | None = None

    def argv(self) -> list[str]:
        exe = shutil.which("flexlb")
        base = [exe] if exe else [sys.executable, "-m", "services.cli"]
        return [*base, "up", "--time-scale", "0", "--workers", str(self.args.workers), "--port", str(self.port),
                "--batch-wait-ms", f"{self.batch_wait_ms:g}", "--state-file", str(self.state_file)]

    def start(self) -> None:
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.argv(), cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + self.args.startup_timeout_s
        while not self.state_file.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"flexlb up exited with {self.proc.returncode} during start-up:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"no state file after {self.args.startup_timeout_s}s:\n{self.log_tail()}")
            time.sleep(0.1)
        self.state = json.loads(self.state_file.read_text())
        url = self.state["router_url"]
        while True:
            try:
                r = httpx.get(url + "/readyz", timeout=2)
                if r.status_code == 200:
                    break
                last = r.text
            except httpx.HTTPError as exc:
                last = str(exc)
            if time.monotonic() > deadline:
                raise RuntimeError(f"/readyz not 200 after {self.args.startup_timeout_s}s: {last}")
            time.sleep(0.1)

    @property
    def url(self) -> str:
        return self.state["router_url"]

    def pids(self) -> dict[str, int]:
        return dict(self.state.get("pids", {}))

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> int | None:
        """SIGTERM `flexlb up`; returns its exit status (None: it had to be killed)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.exit_code = self.proc.wait(self.args.stop_timeout_s)
            except subprocess.TimeoutExpired:
                # Only the process group this harness started (flexlb up and its children).
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
                self.exit_code = None
        else:
            self.exit_code = self.proc.returncode
        self.log.close()
        return self.exit_code


# --------------------------------------------------------------------------- counters
class Probe:
    """Reads the counters whose deltas describe one level."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.redis = None
        self.nc = None
        self.js = None

    async def open(self) -> None:
        import nats
        import redis.asyncio as aioredis

        self.redis = aioredis.from_url(self.stack.state["redis_url"])
        self.nc = await nats.connect(self.stack.state["nats_url"], name="flexlb-bench-probe")
        self.js = self.nc.jetstream()

    async def close(self) -> None:
        if self.redis is not None:
            await self.redis.aclose()
        if self.nc is not None:
            await self.nc.close()

    async def metrics(self, client: httpx.AsyncClient) -> dict[str, float]:
        r = await client.get(self.stack.url + "/metrics")
        r.raise_for_status()
        return parse_metrics(r.text)

    async def redis_calls(self) -> dict[str, int]:
        stats = await self.redis.info("commandstats")
        return {k[len("cmdstat_"):]: int(v["calls"]) for k, v in stats.items()}

    async def stream_seqs(self) -> dict[str, int]:
        out = {}
        for name in ("FLEXLB_DISPATCH", "FLEXLB_EVENTS"):
            info = await self.js.stream_info(name)
            out[name] = info.state.last_seq
        # Per-subject counts of the event log: router events vs worker events.
        info = await self.js.stream_info("FLEXLB_EVENTS", subjects_filter="flexlb.evt.>")
        subjects = info.state.subjects or {}
        out["router_events"] = sum(n for s, n in subjects.items() if s.startswith("flexlb.evt.router."))
        out["worker_events"] = sum(n for s, n in subjects.items() if s.startswith("flexlb.evt.req."))
        return out

    def cpu(self) -> dict[str, float | None]:
        out = {name: proc_cpu_s(pid) for name, pid in self.stack.pids().items()}
        out["loadgen"] = self_cpu_s()
        return out

    async def snapshot(self, client: httpx.AsyncClient) -> dict[str, Any]:
        return {"metrics": await self.metrics(client), "redis": await self.redis_calls(),
                "streams": await self.stream_seqs(), "cpu": self.cpu()}

    async def settle(self, client: httpx.AsyncClient, timeout_s: float) -> bool:
        """Wait until the router holds no inflight request (every terminal event handled)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if (await self.metrics(client)).get("flexlb_inflight_requests", 1.0) == 0.0:
                return True
            await asyncio.sleep(0.05)
        return False


# --------------------------------------------------------------------------- load
def make_bodies(n: int, prompt_chars: int, max_tokens: int, stream: bool, seed: int) -> list[bytes]:
    """Pre-encoded request bodies (distinct prompts of one fixed length)."""
    rng = random.Random(seed)
    alphabet = string.ascii_letters + " "
    return [
        json.dumps({"prompt": "".join(rng.choice(alphabet) for _ in range(prompt_chars)),
                    "max_tokens": max_tokens, "stream": stream}).encode()
        for _ in range(n)
    ]


class Results:
    def __init__(self) -> None:
        self.latency_s: list[float] = []  # arrival of the full response / of [DONE]
        self.ttft_s: list[float] = []  # stream only: first token chunk
        self.errors: dict[str, int] = {}

    def error(self, key: str) -> None:
        self.errors[key] = self.errors.get(key, 0) + 1


async def one_request(client: httpx.AsyncClient, url: str, body: bytes, stream: bool, res: Results | None) -> None:
    headers = {"content-type": "application/json"}
    t0 = time.perf_counter()
    try:
        if not stream:
            r = await client.post(url, content=body, headers=headers)
            if r.status_code != 200:
                if res is not None:
                    res.error(f"http_{r.status_code}")
                return
            if b'"finish_reason":"length"' not in r.content:
                if res is not None:
                    res.error("bad_body")
                return
            if res is not None:
                res.latency_s.append(time.perf_counter() - t0)
            return
        first = None
        done = False
        async with client.stream("POST", url, content=body, headers=headers) as r:
            if r.status_code != 200:
                await r.aread()
                if res is not None:
                    res.error(f"http_{r.status_code}")
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                if line.startswith('data: {"error"'):
                    if res is not None:
                        code = json.loads(line[6:])["error"].get("code", "unknown")
                        res.error(f"sse_{code}")
                    return
                if first is None:
                    first = time.perf_counter() - t0
        if res is None:
            return
        if not done or first is None:
            res.error("no_done" if not done else "no_tokens")
            return
        res.ttft_s.append(first)
        res.latency_s.append(time.perf_counter() - t0)
    except httpx.HTTPError as exc:
        if res is not None:
            res.error(f"exc_{exc.__class__.__name__}")


async def closed_loop(client: httpx.AsyncClient, url: str, bodies: list[bytes], concurrency: int, total: int,
                      cap_s: float, stream: bool, res: Results | None) -> tuple[int, float]:
    """C clients, each issuing its next request when the previous one ends; stops after
    `total` requests or when `cap_s` has passed (no new request starts after that)."""
    issued = 0
    t_start = time.perf_counter()
    deadline = t_start + cap_s

    async def client_loop() -> None:
        nonlocal issued
        while issued < total and time.perf_counter() < deadline:
            body = bodies[issued % len(bodies)]
            issued += 1
            await one_request(client, url, body, stream, res)

    await asyncio.gather(*(client_loop() for _ in range(concurrency)))
    return issued, time.perf_counter() - t_start


# --------------------------------------------------------------------------- one level
def batch_stats(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    cum = [metric_delta(before, after, f'flexlb_batch_size_requests_bucket{{le="{b if b == "+Inf" else b + ".0"}"}}')
           for b in BATCH_BUCKETS]
    count = metric_delta(before, after, "flexlb_batch_size_requests_count")
    total = metric_delta(before, after, "flexlb_batch_size_requests_sum")
    hist: dict[str, int] = {}
    prev_le, prev_cum = 0, 0.0
    for b, c in zip(BATCH_BUCKETS, cum):
        n = int(round(c - prev_cum))
        if b == "+Inf":
            label = f">{prev_le}"
        else:
            le = int(b)
            label = str(le) if le - prev_le == 1 else f"{prev_le + 1}-{le}"
            prev_le = le
        if n:
            hist[label] = n
        prev_cum = c
    rb, ra = labelled(before, "flexlb_batches_dispatched_total"), labelled(after, "flexlb_batches_dispatched_total")
    reasons = {k.split('"')[1]: int(ra[k] - rb.get(k, 0.0)) for k in ra if ra[k] - rb.get(k, 0.0)}
    return {"batches": int(count), "requests": int(total), "mean_size": round(total / count, 2) if count else None,
            "size_histogram": hist, "close_reasons": reasons}


async def run_level(stack: Stack, probe: Probe, args: argparse.Namespace, concurrency: int,
                    bodies: list[bytes]) -> dict[str, Any]:
    url = stack.url + "/v1/completions"
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    timeout = httpx.Timeout(args.request_timeout_s)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client, \
            httpx.AsyncClient(timeout=httpx.Timeout(10.0)) as admin:
        warm = max(args.warmup, 2 * concurrency)
        await closed_loop(client, url, bodies, concurrency, warm, args.level_cap_s, args.stream, None)
        settled_before = await probe.settle(admin, args.settle_timeout_s)
        before = await probe.snapshot(admin)
        res = Results()
        issued, elapsed = await asyncio.wait_for(
            closed_loop(client, url, bodies, concurrency, args.requests_per_level, args.level_cap_s, args.stream, res),
            args.level_cap_s + args.request_timeout_s + 10,
        )
        settled_after = await probe.settle(admin, args.settle_timeout_s)
        after = await probe.snapshot(admin)

    n_ok = len(res.latency_s)
    n_err = sum(res.errors.values())
    bm, am = before["metrics"], after["metrics"]
    batches = batch_stats(bm, am)
    nb = batches["batches"] or 0
    router_ttft_n = metric_delta(bm, am, "flexlb_ttft_seconds_count")
    router_ttft_mean_ms = metric_delta(bm, am, "flexlb_ttft_seconds_sum") / router_ttft_n * 1000 if router_ttft_n else None
    redis_delta = {k: after["redis"].get(k, 0) - before["redis"].get(k, 0) for k in after["redis"]}
    redis_delta = {k: v for k, v in redis_delta.items() if v and k != "info"}  # INFO is this probe's own call
    script_calls = redis_delta.get("evalsha", 0) + redis_delta.get("eval", 0)
    terminal_releases = redis_delta  # noqa: F841 (kept readable below)
    rel_b, rel_a = labelled(bm, "flexlb_ledger_releases_total"), labelled(am, "flexlb_ledger_releases_total")
    releases = {k.split('"')[1]: int(rel_a[k] - rel_b.get(k, 0.0)) for k in rel_a}
    s_b, s_a = before["streams"], after["streams"]
    dispatch_msgs = s_a["FLEXLB_DISPATCH"] - s_b["FLEXLB_DISPATCH"]
    cpu_b, cpu_a = before["cpu"], after["cpu"]
    cpu_s = {k: round(cpu_a[k] - cpu_b[k], 3) for k in cpu_a if cpu_a.get(k) is not None and cpu_b.get(k) is not None}
    n_done = issued if issued else 1
    per_req = lambda x: round(x / n_done, 3)  # noqa: E731
    level = {
        "concurrency": concurrency,
        "requests": issued,
        "ok": n_ok,
        "errors": dict(sorted(res.errors.items())),
        "capped": issued < args.requests_per_level,
        "duration_s": round(elapsed, 3),
        "requests_per_s": round(n_ok / elapsed, 1) if elapsed > 0 else None,
        "latency_ms": summarize_ms(res.latency_s),
        "router_ttft_mean_ms": round(router_ttft_mean_ms, 3) if router_ttft_mean_ms is not None else None,
        "batching": batches,
        "redis_calls": redis_delta,
        "redis_script_calls_per_request": per_req(script_calls),
        "redis_script_calls_per_batch_plus_request": (
            {"per_batch": round((script_calls - releases.get("terminal", 0) * 0 - issued) / nb, 3) if nb else None}
        ),
        "ledger_fields_released": releases,
        "jetstream": {
            "dispatch_msgs": dispatch_msgs,
            "dispatch_msgs_per_batch": round(dispatch_msgs / nb, 3) if nb else None,
            "router_events_per_request": per_req(s_a["router_events"] - s_b["router_events"]),
            "worker_events_per_request": per_req(s_a["worker_events"] - s_b["worker_events"]),
        },
        "cpu_s": cpu_s,
        "cpu_ms_per_request": {k: round(v * 1000 / n_done, 3) for k, v in cpu_s.items()},
        "cores_busy": round(sum(cpu_s.values()) / (after["_wall"] - before["_wall"]), 2) if "_wall" in after else None,
        "settled": settled_before and settled_after,
    }
    if args.stream:
        level["ttft_ms"] = summarize_ms(res.ttft_s)
    return level
