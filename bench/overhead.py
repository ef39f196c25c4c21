"""Control-plane overhead of FlexLB: requests/s and latency with an instant engine.

    python bench/overhead.py [--concurrency 1,8,32,128] [--requests-per-level N] [--workers 2]
                             [--max-tokens 1] [--stream] [--batch-wait-ms default,10,0]
                             [--rev HEAD] [--nice -10] [--out bench/results/overhead.json]

For each batching window in `--batch-wait-ms` ("default": no flag, the router's own default;
a later value equal to it is skipped) it starts `flexlb up --time-scale 0` as a subprocess (simulated workers that take no time,
so every millisecond measured is control plane: HTTP parse, admission, the batching window,
the ledger reservation in Redis, the JetStream dispatch, the worker's pull, the token relay
over core NATS, the response or SSE), waits for its state file and /readyz, then for each
concurrency level C runs a warm-up and a closed loop of C clients (each a keep-alive
httpx.AsyncClient with one connection) that issue a fixed number of requests, bounded by a
wall-clock cap too (`--rev HEAD` runs the stack from a `git archive` of a commit instead of
the working tree).
After each level it waits until the router holds no inflight request, and reads deltas of:
the router's /metrics (batch-size histogram, batch close reasons, router-side TTFT), Redis
INFO commandstats (calls per request, checked against the ledger scripts' arithmetic),
JetStream stream sequences (dispatch messages per batch, events per request) and the CPU
time of every process of the stack and of this load generator (from /proc); it samples the
router's inflight gauge during the level and reads the router's decision records of a sample
of requests (arrival -> dispatch -> first token). At the end it sends SIGTERM to `flexlb up`
and checks it exits 0. bench/README.md explains the numbers.

The load generator runs on the same machine as the stack and competes with it for CPU;
the report says how many cores there are and how much CPU each side used, and marks a level
during which other processes kept the machine busy (`perturbed`; it is rerun up to
`--retries` times).
Exit status: 0 when every level ran without errors and the stack stopped cleanly, 1 otherwise.

One module over 500 lines: the counter probes it reads between levels belong to this one
experiment only; what other harnesses share is in bench/common.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
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

# `python bench/overhead.py` puts bench/ first on sys.path, where sibling harnesses (e.g.
# bench/trace.py) would shadow standard modules: take it off.
if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    del sys.path[0]

import httpx  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.common import (  # noqa: E402
    REPORT_PACKAGES,
    Proc,
    UpStack,
    free_port,
    machine_busy_s,
    parse_metrics,
    percentile,
    print_table,
    proc_cpu_times,
)
from bench.common import fmt as common_fmt  # noqa: E402
from bench.common import machine_facts as common_machine_facts  # noqa: E402

BATCH_BUCKETS = ("1", "2", "4", "8", "16", "32", "64", "+Inf")  # le bounds of flexlb_batch_size_requests


# --------------------------------------------------------------------------- small helpers
def summarize_ms(values_s: list[float]) -> dict[str, float | None]:
    v = sorted(x * 1000.0 for x in values_s)
    out: dict[str, float | None] = {q: percentile(v, p) for q, p in (("p50", 50), ("p90", 90), ("p99", 99))}
    out["mean"] = sum(v) / len(v) if v else None
    out["max"] = v[-1] if v else None
    return {k: (round(x, 3) if x is not None else None) for k, x in out.items()}


def self_cpu_s() -> tuple[float, float]:
    t = os.times()
    return t.user, t.system


def metric_delta(before: dict[str, float], after: dict[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


def labelled(metrics: dict[str, float], name: str) -> dict[str, float]:
    """{'label text': value} of every sample of a metric family with labels."""
    prefix = name + "{"
    return {k[len(prefix):-1]: v for k, v in metrics.items() if k.startswith(prefix)}


def histogram_quantile_le(before: dict[str, float], after: dict[str, float], name: str, q: float) -> float | None:
    """Upper bound of the bucket that holds quantile q (0..1) of a histogram's delta."""
    bounds = []
    for key in after:
        if key.startswith(name + '_bucket{le="'):
            le = key[len(name) + 12:-2]
            bounds.append((float("inf") if le == "+Inf" else float(le), key))
    bounds.sort()
    total = metric_delta(before, after, name + "_count")
    if not total:
        return None
    for le, key in bounds:
        if metric_delta(before, after, key) >= q * total:
            return le
    return None


def read_autogroup_nice() -> int | None:
    try:
        with open("/proc/self/autogroup") as fh:
            return int(fh.read().split()[-1])  # "/autogroup-4 nice 0"
    except (OSError, ValueError, IndexError):
        return None


def renice(pids: list[int], value: int, autogroup_value: int | None = None) -> list[str]:
    """Give processes this harness started (and itself) nice `value`, and their scheduling
    autogroups (one per session, where the kernel groups by session) the same: on a shared
    machine a session's share of the CPU is set by its autogroup, not by per-process nice.
    Best effort (negative values need root); returns what could not be set."""
    problems = []
    sessions_done: set[int] = set()
    for pid in pids:
        try:
            os.setpriority(os.PRIO_PROCESS, pid, value)
        except OSError as exc:
            problems.append(f"nice of {pid}: {exc.strerror}")
        try:
            sid = os.getsid(pid)
        except OSError:
            continue
        if sid in sessions_done or not os.path.exists(f"/proc/{pid}/autogroup"):
            continue
        sessions_done.add(sid)
        try:
            with open(f"/proc/{pid}/autogroup", "w") as fh:
                fh.write(str(value if autogroup_value is None else autogroup_value))
        except OSError as exc:
            problems.append(f"autogroup of {pid}: {exc.strerror}")
    return problems


def export_rev(rev: str, dest: Path) -> str:
    """Extract `git archive <rev>` of this repository into dest; return the commit id."""
    commit = subprocess.run(["git", "rev-parse", "--verify", rev + "^{commit}"], cwd=REPO, capture_output=True,
                            text=True, timeout=30, check=True).stdout.strip()
    dest.mkdir(parents=True)
    archive = subprocess.Popen(["git", "archive", commit], cwd=REPO, stdout=subprocess.PIPE)
    subprocess.run(["tar", "-x", "-C", str(dest)], stdin=archive.stdout, check=True, timeout=60)
    archive.stdout.close()
    if archive.wait(60) != 0:
        raise RuntimeError(f"git archive {commit} failed")
    return commit


def machine_facts() -> dict[str, Any]:
    """The shared facts (bench/common.py), with httpx's version and the servers' versions."""
    return common_machine_facts(("httpx", *REPORT_PACKAGES), ("nats-server", "redis-server"))


# --------------------------------------------------------------------------- the stack
class Stack(UpStack):
    """`flexlb up` with one batch window, from this tree or a `git archive` (bench/common.py UpStack)."""

    def __init__(self, args: argparse.Namespace, batch_wait_ms: float | None, workdir: Path, source: Path | None) -> None:
        self.args = args
        self.source = source  # a `git archive` of --rev, or None: this working tree
        self.batch_wait_ms = batch_wait_ms  # None: the router's default (no flag passed)
        self.port = free_port()
        name = "default" if batch_wait_ms is None else f"{batch_wait_ms:g}"
        self.state_file = workdir / f"state-{name}.json"
        self.label = name  # what the report calls this window; set from the router once it runs
        up = Proc("up", self.argv(), workdir / f"up-{name}.log", self.env(), cwd=source or REPO)
        super().__init__(up, self.state_file, args.startup_timeout_s, args.stop_timeout_s)

    def argv(self) -> list[str]:
        exe = shutil.which("flexlb")
        base = [exe] if exe and self.source is None else [sys.executable, "-m", "services.cli"]
        window = [] if self.batch_wait_ms is None else ["--batch-wait-ms", f"{self.batch_wait_ms:g}"]
        # the admin API (its request records) open, in a tree that closes it by default
        cli = (self.source or REPO) / "services" / "cli.py"
        open_admin = ["--open-admin"] if "--open-admin" in cli.read_text() else []
        return [*base, "up", *open_admin, "--time-scale", "0", "--workers", str(self.args.workers), "--port", str(self.port),
                *window, "--state-file", str(self.state_file)]

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        if self.source is not None:  # the snapshot's packages shadow the editable install
            env["PYTHONPATH"] = os.pathsep.join([str(self.source), *filter(None, [env.get("PYTHONPATH")])])
        return env

    def router_argv(self) -> list[str]:
        try:
            with open(f"/proc/{self.pids()['router']}/cmdline", "rb") as fh:
                return [a.decode(errors="replace") for a in fh.read().split(b"\0") if a]
        except (OSError, KeyError):
            return []

    def effective_window_ms(self) -> float | None:
        """The router's fixed-window wait: from its command line, else the batcher's default
        as the code under test defines it (None when neither says)."""
        argv = self.router_argv()
        for i, a in enumerate(argv[:-1]):
            if a == "--batch-wait-ms":
                return float(argv[i + 1])
            if a == "--batcher-params":
                try:
                    params = json.loads(argv[i + 1])
                    if "wait_ms" in params:
                        return float(params["wait_ms"])
                except ValueError:
                    pass
        code = "from services.core.batchers import FixedWindowParams as P; print(P().wait_ms)"
        try:
            out = subprocess.run([sys.executable, "-c", code], cwd=self.source or REPO, env=self.env(),
                                 capture_output=True, text=True, timeout=30)
            return float(out.stdout.strip())
        except (OSError, ValueError, subprocess.SubprocessError):
            return None

    def pids(self) -> dict[str, int]:
        return dict(self.state.get("pids", {}))


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

    def cpu(self) -> dict[str, tuple[float, float] | None]:
        out = {name: proc_cpu_times(pid) for name, pid in self.stack.pids().items()}
        out["loadgen"] = self_cpu_s()
        return out

    async def snapshot(self, client: httpx.AsyncClient) -> dict[str, Any]:
        return {"metrics": await self.metrics(client), "redis": await self.redis_calls(),
                "streams": await self.stream_seqs(), "cpu": self.cpu(), "wall": time.monotonic(),
                "machine_busy": machine_busy_s()}

    async def settle(self, client: httpx.AsyncClient, timeout_s: float) -> bool:
        """Wait until the router holds no inflight request (every terminal event handled)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if (await self.metrics(client)).get("flexlb_inflight_requests", 1.0) == 0.0:
                return True
            await asyncio.sleep(0.05)
        return False

    async def sample_inflight(self, client: httpx.AsyncClient, every_s: float, out: list[float]) -> None:
        """Append the router's flexlb_inflight_requests every `every_s` until cancelled. With C
        clients at most C requests are really outstanding; more means the router has not yet
        handled the terminal events of requests whose clients already have their answer."""
        while True:
            try:
                out.append((await self.metrics(client)).get("flexlb_inflight_requests", float("nan")))
            except httpx.HTTPError:
                pass
            await asyncio.sleep(every_s)


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
        self.request_ids: list[str] = []  # of successful requests, for the router's decision records

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
                res.request_ids.append(r.headers.get("x-request-id", ""))
            return
        first = None
        done = False
        request_id = ""
        async with client.stream("POST", url, content=body, headers=headers) as r:
            request_id = r.headers.get("x-request-id", "")
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
        res.request_ids.append(request_id)
    except httpx.HTTPError as exc:
        if res is not None:
            res.error(f"exc_{exc.__class__.__name__}")


async def closed_loop(clients: list[httpx.AsyncClient], url: str, bodies: list[bytes], total: int, cap_s: float,
                      stream: bool, res: Results | None) -> tuple[int, float]:
    """One virtual user per client, each issuing its next request when the previous one
    ends; stops after `total` requests or when `cap_s` has passed (no new request starts
    after that; one in flight ends by its own timeout at worst)."""
    issued = 0
    t_start = time.perf_counter()
    deadline = t_start + cap_s

    async def user(client: httpx.AsyncClient) -> None:
        nonlocal issued
        while issued < total and time.perf_counter() < deadline:
            body = bodies[issued % len(bodies)]
            issued += 1
            await one_request(client, url, body, stream, res)

    await asyncio.gather(*(user(c) for c in clients))
    return issued, time.perf_counter() - t_start


def user_clients(n: int, timeout_s: float) -> list[httpx.AsyncClient]:
    """One keep-alive AsyncClient (one connection) per virtual user. One client shared by
    C users would scan its whole pool on every request and release (httpcore), which made
    the load generator's CPU grow with C and steal the stack's cores."""
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    return [httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout_s)) for _ in range(n)]


async def timeline_phases(admin: httpx.AsyncClient, base: str, request_ids: list[str], n: int) -> dict | None:
    """Where a request's time went, from the router's decision records (GET
    /admin/requests/{id}, where the router has it; None where not): arrival -> batch
    dispatched (admission + batching window + queue), dispatched -> first token at the
    router (JetStream publish, worker pull, engine, token relay). Read after the level."""
    ids = [i for i in request_ids if i]
    if not ids or n <= 0:
        return None
    step = max(1, len(ids) // n)
    queued, to_first = [], []
    for request_id in ids[::step][:n]:
        r = await admin.get(f"{base}/admin/requests/{request_id}")
        if r.status_code == 404 and "no live or recent" not in r.text:
            return None  # this router has no such endpoint
        if r.status_code != 200:
            continue
        t = {e["event"]: e["t_ms"] for e in reversed(r.json().get("timeline", []))}  # first occurrence wins
        if "batch_dispatched" in t and "first_token" in t:
            queued.append(t["batch_dispatched"] / 1000)
            to_first.append((t["first_token"] - t["batch_dispatched"]) / 1000)
    if not queued:
        return None
    return {"samples": len(queued), "arrival_to_dispatch": summarize_ms(queued),
            "dispatch_to_first_token": summarize_ms(to_first)}


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


def expected_in_script_calls(num_batches: int, num_requests: int) -> dict[str, int]:
    """What the ledger scripts run inside Redis for B batches and N requests, when every one
    finished: reserve writes pf:<batch> + kv:<request> (HSETNX, HSET index, ZADD); releases
    look up pf once at PrefillCompleted and again with the batch's last terminal event, and
    kv once per request (HGET), and remove what they find (HDEL x2, ZREM)."""
    b, n = num_batches, num_requests
    return {"hsetnx": b + n, "hset": b + n, "zadd": b + n, "hget": 2 * b + n, "hdel": 2 * (b + n), "zrem": b + n}


CONNECTION_SETUP = ("hello", "client", "select", "auth", "command")  # a client opening a connection


def unexplained_redis_calls(calls: dict[str, int], num_batches: int, num_requests: int) -> dict[str, int]:
    expected = expected_in_script_calls(num_batches, num_requests)
    expected.update({k: calls[k] for k in CONNECTION_SETUP if k in calls})
    expected["evalsha"] = calls.get("evalsha", 0)
    expected["eval"] = calls.get("eval", 0)
    out = {k: v - expected.get(k, 0) for k, v in calls.items()}
    out.update({k: -v for k, v in expected.items() if k not in calls and v})
    return {k: v for k, v in out.items() if v}


async def run_level(stack: Stack, probe: Probe, args: argparse.Namespace, concurrency: int,
                    bodies: list[bytes]) -> dict[str, Any]:
    url = stack.url + "/v1/completions"
    clients = user_clients(concurrency, args.request_timeout_s)
    try:
        async with httpx.AsyncClient(timeout=httpx.Timeout(10.0)) as admin:
            warm = max(args.warmup, 2 * concurrency)
            await closed_loop(clients, url, bodies, warm, args.warmup_cap_s, args.stream, None)
            settled_before = await probe.settle(admin, args.settle_timeout_s)
            before = await probe.snapshot(admin)
            res = Results()
            inflight: list[float] = []
            sampler = asyncio.create_task(probe.sample_inflight(admin, 0.25, inflight))
            try:
                issued, elapsed = await asyncio.wait_for(
                    closed_loop(clients, url, bodies, args.requests_per_level, args.level_cap_s, args.stream, res),
                    args.level_cap_s + args.request_timeout_s + 10,
                )
            finally:
                sampler.cancel()
            t_settle = time.monotonic()
            settled_after = await probe.settle(admin, args.settle_timeout_s)
            settle_s = time.monotonic() - t_settle
            after = await probe.snapshot(admin)
            phases = await timeline_phases(admin, stack.url, res.request_ids, args.timeline_samples)
    finally:
        await asyncio.gather(*(c.aclose() for c in clients), return_exceptions=True)

    n_ok = len(res.latency_s)
    bm, am = before["metrics"], after["metrics"]
    batches = batch_stats(bm, am)
    nb = batches["batches"] or 0
    router_ttft_n = metric_delta(bm, am, "flexlb_ttft_seconds_count")
    router_ttft_mean_ms = metric_delta(bm, am, "flexlb_ttft_seconds_sum") / router_ttft_n * 1000 if router_ttft_n else None
    ttft_q = {f"p{int(q * 100)}_le_ms": histogram_quantile_le(bm, am, "flexlb_ttft_seconds", q) for q in (0.5, 0.99)}
    redis_delta = {k: after["redis"].get(k, 0) - before["redis"].get(k, 0) for k in after["redis"]}
    redis_delta = {k: v for k, v in sorted(redis_delta.items()) if v and k != "info"}  # INFO: this probe's own
    script_calls = redis_delta.get("evalsha", 0) + redis_delta.get("eval", 0)
    rel_b, rel_a = labelled(bm, "flexlb_ledger_releases_total"), labelled(am, "flexlb_ledger_releases_total")
    releases = {k.split('"')[1]: int(rel_a[k] - rel_b.get(k, 0.0)) for k in rel_a}
    s_b, s_a = before["streams"], after["streams"]
    dispatch_msgs = s_a["FLEXLB_DISPATCH"] - s_b["FLEXLB_DISPATCH"]
    cpu_b, cpu_a = before["cpu"], after["cpu"]
    both = [k for k in cpu_a if cpu_a.get(k) is not None and cpu_b.get(k) is not None]
    cpu_s = {k: round(sum(cpu_a[k]) - sum(cpu_b[k]), 3) for k in both}
    cpu_sys_s = {k: round(cpu_a[k][1] - cpu_b[k][1], 3) for k in both}
    wall = after["wall"] - before["wall"]
    n_req = max(issued, 1)
    level = {
        "concurrency": concurrency,
        "requests": issued,
        "ok": n_ok,
        "errors": res.errors and dict(sorted(res.errors.items())),
        "capped": issued < args.requests_per_level,
        "duration_s": round(elapsed, 3),
        "requests_per_s": round(n_ok / elapsed, 1) if elapsed > 0 else None,
        "latency_ms": summarize_ms(res.latency_s),
        # The router's own view: admission (after HTTP parse) to the first token chunk.
        "router_ttft_ms": {"mean": round(router_ttft_mean_ms, 3) if router_ttft_mean_ms is not None else None,
                           **{k: (v * 1000 if v not in (None, float("inf")) else v) for k, v in ttft_q.items()}},
        "batching": batches,
        # Terminal events the router had not handled yet show as inflight beyond C.
        "router_inflight": {"max": max(inflight, default=None), "samples": len(inflight),
                            "drain_after_level_s": round(settle_s, 3)},
        "redis": {
            "calls": redis_delta,
            "script_calls": script_calls,
            "script_calls_per_request": round(script_calls / n_req, 3),
            # Read off the code: reserve per batch, release per PrefillCompleted (per batch),
            # release per terminal event (per request).
            "expected_script_calls": 2 * nb + issued,
            # Commands the ledger scripts run inside Redis (INFO counts them too); anything
            # left over is a client round trip the model does not know about.
            "unexplained_calls": unexplained_redis_calls(redis_delta, nb, issued),
            "connection_setup_calls": sum(redis_delta.get(k, 0) for k in CONNECTION_SETUP),
        },
        "ledger_fields_released": releases,
        "jetstream": {
            "dispatch_msgs": dispatch_msgs,
            "dispatch_msgs_per_batch": round(dispatch_msgs / nb, 3) if nb else None,
            "router_events_per_request": round((s_a["router_events"] - s_b["router_events"]) / n_req, 3),
            "worker_events_per_request": round((s_a["worker_events"] - s_b["worker_events"]) / n_req, 3),
        },
        "cpu_s": cpu_s,
        "cpu_sys_s": cpu_sys_s,
        "cpu_ms_per_request": {k: round(v * 1000 / n_req, 3) for k, v in cpu_s.items()},
        "cores_busy": round(sum(cpu_s.values()) / wall, 2) if wall > 0 else None,
        # Busy cores of the whole machine minus those of the stack and this process: others' load.
        "foreign_cores_busy": (round((after["machine_busy"] - before["machine_busy"] - sum(cpu_s.values())) / wall, 2)
                               if wall > 0 and after["machine_busy"] is not None and before["machine_busy"] is not None
                               else None),
        "settled": settled_before and settled_after,
    }
    if phases is not None:
        level["router_timeline_ms"] = phases
    if args.stream:
        level["ttft_ms"] = summarize_ms(res.ttft_s)
    return level


# --------------------------------------------------------------------------- report
def fmt(x: Any, nd: int = 1) -> str:
    """A table cell with no thousands separator."""
    return common_fmt(x, nd, sep="")


def table_rows(result: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    stream = result["flags"]["stream"]
    cols = ["window ms", "C", "ok", "errors", "req/s", "p50 ms", "p90 ms", "p99 ms"]
    if stream:
        cols += ["TTFT p50", "TTFT p99"]
    cols += ["router TTFT mean", "mean batch", "batch sizes", "router inflight max", "redis calls/req",
             "CPU ms/req router / loadgen / all", "cores busy"]
    rows = []
    for run in result["runs"]:
        for lv in run["levels"]:
            lat, cpu, b = lv["latency_ms"], lv["cpu_ms_per_request"], lv["batching"]
            row = [run["window_label"], str(lv["concurrency"]), str(lv["ok"]),
                   " ".join(f"{k}:{v}" for k, v in lv["errors"].items()) or "0",
                   fmt(lv["requests_per_s"], 0), fmt(lat["p50"], 1), fmt(lat["p90"], 1), fmt(lat["p99"], 1)]
            if stream:
                row += [fmt(lv["ttft_ms"]["p50"], 1), fmt(lv["ttft_ms"]["p99"], 1)]
            row += [fmt(lv["router_ttft_ms"]["mean"], 1), fmt(b["mean_size"], 2),
                    " ".join(f"{k}:{v}" for k, v in b["size_histogram"].items()),
                    fmt(lv["router_inflight"]["max"], 0), fmt(lv["redis"]["script_calls_per_request"], 2),
                    f"{fmt(cpu.get('router'), 2)} / {fmt(cpu.get('loadgen'), 2)} / {fmt(sum(cpu.values()), 2)}",
                    fmt(lv["cores_busy"], 2)]
            rows.append(row)
    return cols, rows


def print_report(result: dict[str, Any]) -> None:
    cols, rows = table_rows(result)
    m, f = result["machine"], result["flags"]
    title = (f"FlexLB control-plane overhead: {m['cores']} cores, Python {m['python']}, {f['workers']} sim workers "
             f"(time-scale 0), max_tokens {f['max_tokens']}, prompt {f['prompt_chars']} chars, "
             f"{'stream' if f['stream'] else 'non-stream'}; the load generator shares the cores")
    print_table(title, cols, rows, left=("errors", "batch sizes"))
    for run in result["runs"]:
        idle = run.get("idle", {}).get("idle_cpu_ms_per_s", {})
        checks = []
        for lv in run["levels"]:
            js = lv["jetstream"]
            checks.append(f"C={lv['concurrency']}: dispatch msgs/batch {js['dispatch_msgs_per_batch']}, redis script "
                          f"calls {lv['redis']['script_calls']} (model {lv['redis']['expected_script_calls']}), "
                          f"unexplained redis calls {lv['redis']['unexplained_calls'] or 0}")
        print(f"window {run['window_label']} ms: flexlb up exit status {run['stack_exit_code']}; idle stack CPU "
              f"{sum(idle.values()):.0f} ms/s ({', '.join(f'{k} {v:g}' for k, v in idle.items())})")
        for c in checks:
            print("  " + c)


def markdown_table(result: dict[str, Any]) -> str:
    """The table as GitHub markdown (for bench/README.md)."""
    cols, rows = table_rows(result)
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---:" for _ in cols) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


# --------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", default="1,8,32,128", help="comma-separated client counts (default 1,8,32,128)")
    p.add_argument("--requests-per-level", type=int, default=1500, help="measured requests per level (default 1500)")
    p.add_argument("--warmup", type=int, default=30, help="warm-up requests per level, at least 2x C (default 30)")
    p.add_argument("--workers", type=int, default=2, help="simulated pd_fusion workers (default 2)")
    p.add_argument("--max-tokens", type=int, default=1, help="max_tokens of every request (default 1)")
    p.add_argument("--prompt-chars", type=int, default=128, help="prompt length in characters = tokens (default 128)")
    p.add_argument("--stream", action="store_true", help="SSE streaming: time to first token and to [DONE]")
    p.add_argument("--batch-wait-ms", default="default,10,0",
                   help="router fixed-window waits (ms) to compare, one stack each; 'default' passes no flag "
                        "(the router's own default) (default: default,10,0)")
    p.add_argument("--level-cap-s", type=float, default=20.0, help="wall-clock cap of one level's loop (default 20)")
    p.add_argument("--warmup-cap-s", type=float, default=3.0, help="wall-clock cap of one level's warm-up (default 3)")
    p.add_argument("--request-timeout-s", type=float, default=30.0, help="client timeout of one request (default 30)")
    p.add_argument("--settle-timeout-s", type=float, default=15.0, help="wait for inflight == 0 after a level")
    p.add_argument("--startup-timeout-s", type=float, default=120.0, help="wait for the state file and /readyz")
    p.add_argument("--stop-timeout-s", type=float, default=30.0, help="wait for flexlb up to exit after SIGTERM")
    p.add_argument("--idle-s", type=float, default=2.0, help="idle CPU baseline before the levels (default 2 s)")
    p.add_argument("--seed", type=int, default=0, help="prompt RNG seed")
    p.add_argument("--timeline-samples", type=int, default=200,
                   help="requests per level whose router decision record is read after it (default 200; 0: none)")
    p.add_argument("--foreign-max", type=float, default=0.15,
                   help="a level during which other processes used more cores than this is marked perturbed")
    p.add_argument("--retries", type=int, default=1, help="reruns of a perturbed level (default 1)")
    p.add_argument("--quiet-wait-s", type=float, default=15.0,
                   help="before a level, wait at most this long for other processes to go quiet (default 15)")
    p.add_argument("--nice", type=int,
                   help="on a shared machine: give this process and the stack this nice value, and their "
                        "scheduling autogroups too (e.g. -10; negative needs root)")
    p.add_argument("--markdown", action="store_true", help="also print the table as markdown")
    p.add_argument("--rev", help="run the stack from `git archive REV` of this repo (e.g. HEAD) instead of the "
                                 "working tree, so edits in progress do not change what is measured")
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "overhead.json"), help="JSON report path")
    args = p.parse_args(argv)
    try:
        args.levels = [int(x) for x in args.concurrency.split(",") if x.strip()]
        args.windows = [None if x.strip() == "default" else float(x) for x in args.batch_wait_ms.split(",") if x.strip()]
    except ValueError:
        p.error("--concurrency and --batch-wait-ms take comma-separated numbers")
    if not args.levels or min(args.levels) < 1 or not args.windows or min(w or 0 for w in args.windows) < 0:
        p.error("concurrency levels must be >= 1 and windows >= 0")
    if args.requests_per_level < 1 or args.workers < 1 or args.max_tokens < 1 or args.prompt_chars < 1:
        p.error("--requests-per-level, --workers, --max-tokens and --prompt-chars must be >= 1")
    return args


async def run_window(stack: Stack, args: argparse.Namespace, bodies: list[bytes]) -> list[dict[str, Any]]:
    probe = Probe(stack)
    await probe.open()
    levels = []
    try:
        levels.append(await idle_baseline(probe, args.idle_s))
        for c in args.levels:
            for attempt in range(1, args.retries + 2):
                await wait_quiet(probe, args)
                print(f"  window {stack.label} ms, concurrency {c} ...", file=sys.stderr, flush=True)
                lv = await run_level(stack, probe, args, c, bodies)
                lv["attempt"] = attempt
                foreign = lv["foreign_cores_busy"] or 0.0
                lv["perturbed"] = foreign > args.foreign_max
                if not lv["perturbed"]:
                    break
                print(f"    other processes kept {foreign} cores busy during this level"
                      f"{': running it again' if attempt <= args.retries else ''}", file=sys.stderr, flush=True)
            print(f"    {lv['ok']} ok, {sum(lv['errors'].values())} errors, {lv['requests_per_s']} req/s, "
                  f"p50 {lv['latency_ms']['p50']} ms, mean batch {lv['batching']['mean_size']}", file=sys.stderr, flush=True)
            levels.append(lv)
    finally:
        await probe.close()
    return levels


async def wait_quiet(probe: Probe, args: argparse.Namespace) -> None:
    """Wait (at most --quiet-wait-s) until processes outside the stack use < --foreign-max cores."""
    deadline = time.monotonic() + args.quiet_wait_s
    while True:
        b_cpu, b_m, t0 = probe.cpu(), machine_busy_s(), time.monotonic()
        await asyncio.sleep(0.5)
        a_cpu, a_m, wall = probe.cpu(), machine_busy_s(), time.monotonic() - t0
        if a_m is None or b_m is None:
            return
        ours = sum(sum(a_cpu[k]) - sum(b_cpu[k]) for k in a_cpu if a_cpu.get(k) and b_cpu.get(k))
        if (a_m - b_m - ours) / wall < args.foreign_max or time.monotonic() > deadline:
            return


async def idle_baseline(probe: Probe, seconds: float) -> dict[str, Any]:
    """CPU the stack burns with no traffic (heartbeats, polls): the floor under every level."""
    before, t0 = probe.cpu(), time.monotonic()
    await asyncio.sleep(seconds)
    after, wall = probe.cpu(), time.monotonic() - t0
    cpu = {k: round((sum(after[k]) - sum(before[k])) / wall * 1000, 1) for k in after
           if after.get(k) is not None and before.get(k) is not None and k != "loadgen"}
    return {"idle_cpu_ms_per_s": cpu, "idle_seconds": round(wall, 2)}


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt  # SIGTERM like Ctrl-C: the finally blocks stop the stack


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)
    sys.path.insert(0, str(REPO))  # services.infra (binary versions) when run from elsewhere
    workdir = Path(tempfile.mkdtemp(prefix="flexlb-bench-"))
    own_nice = os.getpriority(os.PRIO_PROCESS, 0)
    own_autogroup = read_autogroup_nice()
    try:
        return run_all(args, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        if args.nice is not None:  # this session outlives the harness: give its share back
            renice([os.getpid()], own_nice, autogroup_value=own_autogroup)


def run_all(args: argparse.Namespace, workdir: Path) -> int:
    t0 = time.monotonic()
    result: dict[str, Any] = {
        "benchmark": "flexlb control-plane overhead (bench/overhead.py)",
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine_facts(),
        "flags": {k: getattr(args, k) for k in (
            "levels", "requests_per_level", "warmup", "workers", "max_tokens", "prompt_chars", "stream", "windows",
            "level_cap_s", "warmup_cap_s", "request_timeout_s", "seed", "rev", "nice", "foreign_max")},
        "notes": [
            "time-scale 0: the simulated engine takes no time; latency is control-plane overhead only",
            "the load generator (httpx, one asyncio loop) shares the machine's cores with the whole stack",
            "closed loop: each of C clients sends its next request when the previous one ends",
            "latency_ms: to the full response (non-stream) or to [DONE] (stream); ttft_ms: to the first token chunk",
        ],
        "runs": [],
    }
    source = None
    if args.rev:
        source = workdir / "src"
        result["source"] = {"rev": args.rev, "commit": export_rev(args.rev, source)}
    else:
        result["source"] = {"working_tree": str(REPO), "commit": result["machine"].get("git_commit"),
                            "dirty_files": result["machine"].get("git_dirty_files")}
    bodies = make_bodies(max(256, args.requests_per_level // 4), args.prompt_chars, args.max_tokens, args.stream, args.seed)
    failed = False
    measured: set[float] = set()  # effective windows already run (the default may equal an explicit one)
    result["skipped_windows"] = []
    for window in args.windows:
        if window is not None and window in measured:
            print(f"window {window:g} ms: already measured as the router's default; skipped", file=sys.stderr)
            result["skipped_windows"].append(window)
            continue
        stack = Stack(args, window, workdir, source)
        run: dict[str, Any] = {"batch_wait_ms_flag": window, "levels": []}
        print(f"starting flexlb up (batch window {stack.label} ms): {' '.join(stack.argv())}", file=sys.stderr, flush=True)
        run["window_label"] = stack.label
        try:
            stack.start()
            effective = stack.effective_window_ms()
            run["batch_wait_ms"] = effective
            if effective is not None:
                measured.add(effective)
            run["router_argv"] = stack.router_argv()[1:]
            if window is None:
                stack.label = f"{effective:g} (default)" if effective is not None else "default"
            run["window_label"] = stack.label
            print(f"  router {stack.url} pids {stack.pids()}; fixed-window wait {effective} ms", file=sys.stderr, flush=True)
            if args.nice is not None:
                problems = renice([os.getpid(), stack.up.pid, *stack.pids().values()], args.nice)
                run["renice_problems"] = problems
                for problem in problems:
                    print(f"  --nice: {problem}", file=sys.stderr)
            levels = asyncio.run(run_window(stack, args, bodies))
            run["idle"] = levels[0]
            run["levels"] = levels[1:]
        except Exception as exc:  # report what ran, then fail
            failed = True
            run["error"] = f"{exc.__class__.__name__}: {exc}"
            print(f"bench failed: {run['error']}\n--- flexlb up log ---\n{stack.log_tail()}", file=sys.stderr)
        finally:
            code = stack.stop()
            run["stack_exit_code"] = code
            if code != 0:
                failed = True
                print(f"flexlb up exited with {code} after SIGTERM (expected 0)\n{stack.log_tail()}", file=sys.stderr)
        result["runs"].append(run)
        if any(lv["errors"] or not lv["settled"] for lv in run["levels"]):
            failed = True
        for lv in run["levels"]:
            if lv.get("perturbed"):
                print(f"warning: window {stack.label} ms, C={lv['concurrency']}: other processes used "
                      f"{lv['foreign_cores_busy']} cores during the level; its numbers are perturbed", file=sys.stderr)
    result["total_wall_s"] = round(time.monotonic() - t0, 1)
    result["machine"]["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    os.replace(tmp, out)
    if any(run["levels"] for run in result["runs"]):
        print_report(result)
    if args.markdown:
        print(markdown_table(result))
    print(f"wrote {out} ({result['total_wall_s']} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
