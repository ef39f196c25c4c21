"""Trace replay: routing policies compared on the Mooncake trace, open loop, one fresh stack each.

    python bench/trace.py --trace ../shared/data/mooncake_synthetic_trace.jsonl --rows 500 --workers 4 \\
        --time-scale 0.1 --policies cost-based,cache-aware,round-robin [--rate-scale 1] [--start-row 0] \\
        [--batcher fixed-window] [--batcher-params JSON] [--batch-wait-ms 10] \\
        [--out bench/results/trace_mooncake500.json]

The trace path is resolved against the current directory, then against the repository root
(the data lives in ../shared/data; it is read in place, never copied).

For each policy it starts `flexlb up --time-scale T --workers N --prefill-policy P` (fresh
NATS, Redis, router and simulated workers, so every policy starts with empty caches), waits
for its state file and /readyz, then replays rows [start, start + R) of the trace open loop:
row i is sent at (timestamp_i − timestamp_start) ms × rate_scale × time_scale after the
start, each by its own asyncio task (a late answer never delays the next send), as a
streamed completion whose prompt is a list of token ids: each of the row's `hash_ids`
expands to a deterministic block of 512 ids (random.Random(hash_id), ids in [0, 50000)),
the concatenation cut to `input_length`, so rows that share leading hash ids share leading
tokens; max_tokens = max(1, output_length).

Measured per request (client side, bench/loadgen.py's asyncio HTTP/1.1 client: one connection
per request, no per-chunk framework overhead): TTFT = send → first SSE token chunk, e2e = send →
`[DONE]`, TPOT = (e2e − TTFT) / (tokens − 1), errors by code. Every time is reported in
ENGINE time: wall seconds ÷ time_scale (the simulated engine sleeps profile_ms × time_scale).

After the replay (or after the per-policy wall-clock cap, when what is left is cancelled and
reported as not completed) it reads the event log (services/eventlog.py read_stream) for: the
prefix hit rate Σ num_cached_tokens / Σ num_prompt_tokens of prefill.completed, batch sizes,
per-worker request counts (request.admitted), the routing decisions' filters (route.decided),
the router's cache-hit prediction vs the engine's actual hit (request.admitted vs
request.finished) and its TTFT prediction; the predictor's per-batch error |predicted −
measured| from the router's request records (GET /admin/requests/{id}, `predicted_batch_ms`
vs `measured_ms` of prefill_completed; batch.dispatched carries no prediction); the router's
own predictor-error histogram (/metrics); and an engine-fidelity check: each batch's measured
prefill vs the timing profile's formula for its (prompt, cached) pairs — a ratio well above 1
means the CPU could not keep the simulated engine's sleeps on time (time scale too small).
CPU of the machine and of every process of the stack is sampled every second from /proc.
Then it SIGTERMs `flexlb up` and checks it exits 0.

Exit status: 0 when every policy ran and its stack stopped with status 0 (request failures
are results, not harness failures), 1 otherwise.

One module over 500 lines: most of it is the analysis of this experiment's event log (TTFT
parts, batches, hit rates), used by no other harness; shared helpers are in bench/common.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import shutil
import sys
import tempfile
import time
from collections import Counter, defaultdict
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
    UpStack,
    dump_json,
    flexlb_exe,
    fmt,
    free_port,
    http_get,
    load_rows,
    machine_facts,
    parse_metrics,
    percentile,
    print_table,
    summarize,
)
from bench.loadgen import stream_one  # noqa: E402

HASH_BLOCK_TOKENS = 512  # tokens per Mooncake hash id
TOKEN_ID_MAX = 50_000  # prompt token ids are drawn from [0, TOKEN_ID_MAX)
DEFAULT_TRACE = "../shared/data/mooncake_synthetic_trace.jsonl"
# Llama2-70B / H100 TP8 prefill fit (the simulated engine's default profile), for the
# fidelity check when the profile file cannot be read.
PROFILE_FALLBACK = {"prefill_base_ms": 26.45, "prefill_per_token_ms": 0.06414, "prefill_per_token_sq_ms": 3.635e-6}


def load_profile() -> dict[str, float]:
    try:
        data = json.loads((REPO / "workers" / "profiles" / "llama2-70b-h100-tp8.json").read_text())
        return {k: float(data[k]) for k in PROFILE_FALLBACK}
    except (OSError, ValueError, KeyError):
        return dict(PROFILE_FALLBACK)


def profile_prefill_ms(profile: dict[str, float], pairs: list[tuple[int, int]]) -> float:
    """The simulated engine's prefill time for (prompt, cached) pairs (workers/engines/sim.py)."""
    return (profile["prefill_base_ms"] + profile["prefill_per_token_ms"] * sum(p - c for p, c in pairs)
            + profile["prefill_per_token_sq_ms"] * sum(p * p - c * c for p, c in pairs))


# --------------------------------------------------------------------------- the trace
@dataclass
class TraceRequest:
    row: int  # row index in the trace file
    request_id: str
    send_at_s: float  # wall seconds after the replay start
    trace_ms: float  # the row's timestamp relative to the first replayed row (trace ms, unscaled)
    input_length: int
    max_tokens: int
    body: bytes


def resolve_trace(path: str) -> Path:
    p = Path(path)
    if p.is_absolute() or p.exists():
        return p.resolve()
    return (REPO / p).resolve()


class PromptBuilder:
    """Hash id -> its deterministic block of 512 token ids (cached: shared prefixes repeat)."""

    def __init__(self) -> None:
        self.blocks: dict[int, list[int]] = {}
        self.population = range(TOKEN_ID_MAX)

    def block(self, hash_id: int) -> list[int]:
        b = self.blocks.get(hash_id)
        if b is None:
            b = random.Random(hash_id).choices(self.population, k=HASH_BLOCK_TOKENS)
            self.blocks[hash_id] = b
        return b

    def prompt(self, hash_ids: list[int], input_length: int) -> list[int]:
        out: list[int] = []
        for h in hash_ids:
            out.extend(self.block(h))
            if len(out) >= input_length:
                break
        if len(out) < input_length:  # more tokens than hash ids cover (not in the Mooncake data)
            raise ValueError(f"input_length {input_length} exceeds {len(hash_ids)} hash blocks of {HASH_BLOCK_TOKENS}")
        return out[:input_length]


def build_requests(rows: list[dict[str, Any]], rate_scale: float, time_scale: float) -> list[TraceRequest]:
    builder = PromptBuilder()
    enc = msgspec.json.Encoder()
    t0 = rows[0]["timestamp"]
    out = []
    for r in rows:
        rel_ms = (r["timestamp"] - t0) * rate_scale
        rid = f"row-{r['_row']:05d}"
        max_tokens = max(1, int(r["output_length"]))
        body = enc.encode({"prompt": builder.prompt(r["hash_ids"], int(r["input_length"])), "max_tokens": max_tokens,
                           "stream": True, "request_id": rid})
        out.append(TraceRequest(r["_row"], rid, rel_ms / 1000.0 * time_scale, rel_ms, int(r["input_length"]),
                                max_tokens, body))
    return out


def trace_facts(rows: list[dict[str, Any]], profile: dict[str, float], workers: int, rate_scale: float) -> dict[str, Any]:
    """What the replayed slice asks for: arrival rate, sizes, the prefill work it needs, and the
    prefix reuse an unbounded single cache would get (an upper bound for any router)."""
    inputs = [int(r["input_length"]) for r in rows]
    outputs = [int(r["output_length"]) for r in rows]
    span_s = (rows[-1]["timestamp"] - rows[0]["timestamp"]) / 1000.0 * rate_scale
    seen: set[int] = set()
    hit = 0
    for r in rows:
        k = 0
        for h in r["hash_ids"]:
            if h not in seen:
                break
            k += 1
        hit += min(k * HASH_BLOCK_TOKENS, int(r["input_length"]))
        seen.update(r["hash_ids"])
    prefill_s = sum(profile_prefill_ms(profile, [(p, 0)]) for p in inputs) / 1000.0
    return {
        "rows": len(rows),
        "span_engine_s": round(span_s, 1),
        "rate_req_per_engine_s": round(len(rows) / span_s, 3) if span_s > 0 else None,
        "input_tokens": summarize([float(x) for x in inputs], 0),
        "output_tokens": summarize([float(x) for x in outputs], 0),
        "prefill_work_engine_s_no_cache": round(prefill_s, 1),
        # > 1: the prefill work alone exceeds what N workers can do in the span (no reuse).
        "prefill_utilization_no_cache": round(prefill_s / workers / span_s, 2) if span_s > 0 else None,
        "reuse_upper_bound_unbounded_cache": round(hit / max(1, sum(inputs)), 4),
    }


# --------------------------------------------------------------------------- the stack
class Stack(UpStack):
    """`flexlb up` for one policy (bench/common.py UpStack)."""

    def __init__(self, args: argparse.Namespace, policy: str, workdir: Path) -> None:
        self.args = args
        self.policy = policy
        self.port = free_port()
        self.state_file = workdir / f"state-{policy}.json"
        up = Proc("up", self.argv(), workdir / f"up-{policy}.log")  # this environment, FLEXLB_* included
        super().__init__(up, self.state_file, args.startup_timeout_s, args.stop_timeout_s)

    def argv(self) -> list[str]:
        a = self.args
        argv = [*flexlb_exe(), "up", "--open-admin", "--time-scale", f"{a.time_scale:g}", "--workers", str(a.workers),
                "--prefill-policy", self.policy, "--port", str(self.port), "--state-file", str(self.state_file),
                "--max-prompt-tokens", str(a.max_prompt_tokens), "--max-seq-len-tokens", str(a.max_seq_len_tokens),
                "--num-kv-blocks", str(a.num_kv_blocks), "--block-size-tokens", str(a.block_size_tokens),
                "--seed", str(a.seed), "--log-level", a.log_level]
        argv += ["--max-batch-tokens", str(a.max_batch_tokens)]
        if a.batcher:
            argv += ["--batcher", a.batcher]
        if a.batcher_params_sent:
            argv += ["--batcher-params", json.dumps(a.batcher_params_sent)]
        if a.router_batch_wait_ms is not None:
            argv += ["--batch-wait-ms", f"{a.router_batch_wait_ms:g}"]
        if a.batch_size_max is not None:
            argv += ["--batch-size-max", str(a.batch_size_max)]
        params = a.policy_params.get(self.policy)
        if params is not None:
            argv += ["--prefill-policy-params", json.dumps(params)]
        return argv

    def pids(self) -> dict[str, int]:
        return {**dict(self.state.get("pids", {})), "up": self.up.pid}


# --------------------------------------------------------------------------- the client
@dataclass
class Result:
    request_id: str
    row: int
    input_length: int
    max_tokens: int
    trace_ms: float
    late_s: float | None = None  # how late the send was vs its schedule (load generator lag)
    status: int | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    tokens: int = 0
    done: bool = False
    error: str | None = None  # error code (router's), or a client-side reason
    error_message: str = ""  # the stream's error message (the first 300 characters)

    @property
    def ok(self) -> bool:
        return self.error is None and self.done and self.tokens == self.max_tokens


def router_error_code(status: int, body: bytes) -> str:
    """The router's error code of a non-200 answer (`too_large`), else `http_<status> (<why>)`:
    the names this harness's reports use (bench/TRACE.md)."""
    try:
        return msgspec.json.decode(body)["error"]["code"]
    except (ValueError, KeyError, TypeError) as exc:  # not the router's error body: keep the status
        return f"http_{status} ({exc.__class__.__name__})"


def router_stream_error_code(err: Any) -> str:
    """The code of an error event in the stream, as it is (`too_large`)."""
    return err.get("code", "unknown") if isinstance(err, dict) else str(err)


async def replay(url: str, reqs: list[TraceRequest], args: argparse.Namespace) -> tuple[list[Result], dict[str, Any]]:
    """Open loop: one task per request, each sleeping until its send time. After the cap,
    every unfinished task is cancelled (its connection closes: the router cancels it)."""
    host, port = url.split("//", 1)[1].rsplit(":", 1)
    loop = asyncio.get_running_loop()
    results = [Result(r.request_id, r.row, r.input_length, r.max_tokens, r.trace_ms) for r in reqs]
    t0 = loop.time() + 0.5

    async def one(req: TraceRequest, res: Result) -> None:
        delay = t0 + req.send_at_s - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        res.late_s = loop.time() - (t0 + req.send_at_s)
        try:
            await asyncio.wait_for(stream_one(host, int(port), req.body, res, connect_timeout_s=30,
                                              status_error=router_error_code,
                                              stream_error=router_stream_error_code), args.request_timeout_s)
        except asyncio.TimeoutError:
            res.error = res.error or "client_timeout"

    tasks = [asyncio.create_task(one(r, s)) for r, s in zip(reqs, results)]
    progress = asyncio.create_task(report_progress(results, loop, t0))
    _, pending = await asyncio.wait(tasks, timeout=args.policy_cap_s)
    capped = len(pending)
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    progress.cancel()
    for res in results:
        if not res.done and res.error is None:
            res.error = "capped" if res.late_s is not None else "not_sent"
    return results, {"wall_s": round(loop.time() - t0, 2), "capped_requests": capped}


async def report_progress(results: list[Result], loop, t0: float) -> None:
    while True:
        await asyncio.sleep(10)
        sent = sum(1 for r in results if r.late_s is not None)
        done = sum(1 for r in results if r.done)
        first = sum(1 for r in results if r.ttft_s is not None)
        print(f"    t={loop.time() - t0:6.1f}s sent {sent} first-token {first} done {done} of {len(results)}",
              file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- the event log
async def read_events(nats_url: str) -> list[Any]:
    from services.eventlog import read_stream

    return await read_stream(nats_url)


def fetch_records(url: str, request_ids: list[str]) -> dict[str, dict[str, Any]]:
    """The router's decision records (GET /admin/requests/{id}) of the given requests."""
    out = {}
    for rid in request_ids:
        status, text = http_get(f"{url}/admin/requests/{rid}")
        if status == 200:
            try:
                out[rid] = json.loads(text)
            except ValueError:
                pass
    return out


def analyze_events(envs: list[Any], reqs: list[TraceRequest], records: dict[str, dict[str, Any]],
                   profile: dict[str, float]) -> dict[str, Any]:
    from schemas import messages as m

    prompt_len = {r.request_id: r.input_length for r in reqs}
    admitted: dict[str, Any] = {}
    finished: dict[str, Any] = {}
    terminal_codes: Counter = Counter()
    dispatched: list[Any] = []
    completed: list[Any] = []
    prefill_filters: Counter = Counter()
    prefill_reasons: Counter = Counter()
    for env in envs:
        p = env.payload
        if isinstance(p, m.RequestAdmitted):
            admitted[p.request_id] = p
        elif isinstance(p, m.RouteDecided) and p.stage == "prefill":
            prefill_reasons[p.reason.split(" ", 1)[0].rstrip(":;,")] += 1
            for c in p.candidates:
                if c.filtered_by:
                    prefill_filters[c.filtered_by] += 1
        elif isinstance(p, m.BatchDispatched):
            dispatched.append(p)
        elif isinstance(p, m.PrefillCompleted):
            completed.append(p)
        elif isinstance(p, m.RequestFinished):
            finished[p.request_id] = p
            terminal_codes["finished"] += 1
        elif isinstance(p, m.RequestFailed):
            terminal_codes[f"failed:{p.code}"] += 1
        elif isinstance(p, m.RequestRejected):
            terminal_codes[f"rejected:{p.code}"] += 1
        elif isinstance(p, m.RequestCancelled):
            terminal_codes["cancelled"] += 1
        elif isinstance(p, m.RequestTimedOut):
            terminal_codes["timed_out"] += 1

    sum_prompt = sum(c.num_prompt_tokens for c in completed)
    sum_cached = sum(c.num_cached_tokens for c in completed)
    sizes = [len(b.request_ids) for b in dispatched]

    # Per worker: requests admitted to it, prompt tokens and busy prefill time it ran.
    per_worker: dict[str, dict[str, float]] = defaultdict(lambda: {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0,
                                                                    "prefill_busy_engine_s": 0.0})
    for a in admitted.values():
        per_worker[a.prefill_worker_id]["requests"] += 1
    for c in completed:
        w = per_worker[c.worker_id]
        w["prompt_tokens"] += c.num_prompt_tokens
        w["cached_tokens"] += c.num_cached_tokens
        w["prefill_busy_engine_s"] += c.measured_ms / 1000.0
    for w in per_worker.values():
        w["prefill_busy_engine_s"] = round(w["prefill_busy_engine_s"], 1)
        w["hit_rate"] = round(w["cached_tokens"] / w["prompt_tokens"], 4) if w["prompt_tokens"] else None

    # Engine fidelity: measured prefill vs the profile's formula for the batch's (prompt, cached).
    fidelity = []
    fid_measured = fid_expected = 0.0
    for c in completed:
        pairs = []
        for rid in c.request_ids:
            f = finished.get(rid)
            if f is None or rid not in prompt_len:
                pairs = None
                break
            pairs.append((prompt_len[rid], f.num_cached_tokens))
        if pairs:
            expected = profile_prefill_ms(profile, pairs)
            if expected > 0:
                fidelity.append(c.measured_ms / expected)
                fid_measured += c.measured_ms
                fid_expected += expected

    # Predictor: per-batch predicted vs measured. batch.dispatched carries no prediction (as
    # of this writing; a field named predicted_ms / predicted_batch_ms is used if it appears),
    # so the router's request records are read: prefill_completed has both numbers.
    pred_err_ms, pred_err_pct = [], []
    predicted_by_batch = {b.batch_id: getattr(b, "predicted_ms", None) or getattr(b, "predicted_batch_ms", None)
                          for b in dispatched}
    measured_by_batch = {c.batch_id: c.measured_ms for c in completed}
    source = "batch.dispatched" if any(v for v in predicted_by_batch.values()) else "admin/requests records"
    if source == "admin/requests records":
        predicted_by_batch = {}
        for rec in records.values():
            for ev in rec.get("timeline", []):
                if ev.get("event") == "prefill_completed" and ev.get("predicted_batch_ms") is not None:
                    predicted_by_batch[ev["batch_id"]] = ev["predicted_batch_ms"]
    for bid, pred in predicted_by_batch.items():
        meas = measured_by_batch.get(bid)
        if pred is None or not meas:
            continue
        pred_err_ms.append(abs(pred - meas))
        pred_err_pct.append(100.0 * abs(pred - meas) / meas)

    # Router's predictions at admission vs what happened: cache hit (tokens) and TTFT.
    hit_err = []
    hit_pred_sum = hit_act_sum = 0
    for rid, a in admitted.items():
        f = finished.get(rid)
        if f is None:
            continue
        hit_err.append(abs(a.num_cached_tokens - f.num_cached_tokens))
        hit_pred_sum += a.num_cached_tokens
        hit_act_sum += f.num_cached_tokens
    return {
        "events": len(envs),
        "terminal_events": dict(sorted(terminal_codes.items())),
        "prefix_hit_rate": round(sum_cached / sum_prompt, 4) if sum_prompt else None,
        "prefill_prompt_tokens": sum_prompt,
        "prefill_cached_tokens": sum_cached,
        "batches": len(dispatched),
        "prefill_batches_completed": len(completed),
        "mean_batch_size": round(sum(sizes) / len(sizes), 3) if sizes else None,
        "batch_size_histogram": dict(sorted(Counter(sizes).items())),
        "batch_close_reasons": dict(Counter(b.reason for b in dispatched)),
        "per_worker": {k: per_worker[k] for k in sorted(per_worker)},
        "prefill_decision_reasons": dict(prefill_reasons.most_common()),
        "prefill_candidates_filtered": dict(prefill_filters.most_common()),
        "predictor": {
            "source": source,
            "batches_scored": len(pred_err_ms),
            "abs_error_engine_ms": summarize(pred_err_ms),
            "abs_error_pct": summarize(pred_err_pct),
        },
        "cache_hit_prediction": {
            "requests": len(hit_err),
            "predicted_cached_tokens": hit_pred_sum,
            "actual_cached_tokens": hit_act_sum,
            "abs_error_tokens": summarize([float(x) for x in hit_err], 0),
        },
        "admitted_predicted_ttft_ms": {rid: a.predicted_ttft_ms for rid, a in admitted.items()},
        "engine_fidelity_measured_over_profile": summarize(fidelity, 3),
        # Σ measured / Σ profile over all batches: the share of prefill time lost to late wake-ups.
        "engine_fidelity_weighted": round(fid_measured / fid_expected, 4) if fid_expected else None,
    }


# --------------------------------------------------------------------------- one policy
def client_summary(results: list[Result], time_scale: float) -> dict[str, Any]:
    inv = 1.0 / time_scale if time_scale > 0 else 1.0
    ok = [r for r in results if r.ok]
    ttft = [r.ttft_s * inv * 1000 for r in ok]
    e2e = [r.e2e_s * inv * 1000 for r in ok]
    tpot = [(r.e2e_s - r.ttft_s) * inv * 1000 / (r.tokens - 1) for r in ok if r.tokens > 1]
    late = [max(0.0, r.late_s) * 1000 for r in results if r.late_s is not None]  # wall ms: a loadgen fact
    errors = Counter(r.error or ("short_stream" if not r.ok else None) for r in results if not r.ok)
    # Does TTFT grow without bound? Compare the first and the last quarter of the arrivals.
    by_arrival = sorted(ok, key=lambda r: r.trace_ms)
    q = max(1, len(by_arrival) // 4)
    first_q = sorted(r.ttft_s * inv * 1000 for r in by_arrival[:q])
    last_q = sorted(r.ttft_s * inv * 1000 for r in by_arrival[-q:])
    slope = None
    if len(by_arrival) >= 10:  # least-squares slope of TTFT (engine s) over arrival (engine s)
        xs = [r.trace_ms / 1000.0 for r in by_arrival]
        ys = [r.ttft_s * inv for r in by_arrival]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        var = sum((x - mx) ** 2 for x in xs)
        slope = round(sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var, 3) if var > 0 else None
    return {
        "requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": dict(errors.most_common()),
        "ttft_ms": summarize(ttft),
        "tpot_ms": summarize(tpot, 2),
        "e2e_ms": summarize(e2e),
        "ttft_p50_first_quarter_ms": round(percentile(first_q, 50), 1) if first_q else None,
        "ttft_p50_last_quarter_ms": round(percentile(last_q, 50), 1) if last_q else None,
        # Seconds of TTFT gained per second of trace: ~0 keeps up; ~1 - (capacity/demand) when overloaded.
        "ttft_growth_s_per_s": slope,
        "send_lateness_wall_ms": summarize(late, 2),
    }


async def router_metrics(url: str) -> dict[str, float]:
    status, text = await asyncio.to_thread(http_get, url + "/metrics")
    return parse_metrics(text) if status == 200 else {}


async def run_policy(stack: Stack, reqs: list[TraceRequest], args: argparse.Namespace,
                     profile: dict[str, float]) -> dict[str, Any]:
    sampler = CpuSampler(stack.pids(), args.cpu_interval_s)
    sampler.start()
    try:
        results, wall = await replay(stack.url, reqs, args)
    finally:
        cpu = sampler.stop()
    await asyncio.sleep(1.0)  # let cancellations and the last events land
    metrics = await router_metrics(stack.url)
    client = client_summary(results, args.time_scale)
    print("  reading the event log ...", file=sys.stderr, flush=True)
    envs = await read_events(stack.state["nats_url"])
    if args.export_dir:  # the flight recorder's export, for `flexlb replay` / `flexlb whatif`
        from services.eventlog import DEFAULT_STREAMS, export

        path = str(Path(args.export_dir) / f"{stack.policy}.jsonl.gz")
        Path(args.export_dir).mkdir(parents=True, exist_ok=True)
        await export(stack.state["nats_url"], path, DEFAULT_STREAMS, progress=False)
        print(f"  exported the event log to {path}", file=sys.stderr, flush=True)
    records = await asyncio.to_thread(fetch_records, stack.url, [r.request_id for r in reqs])
    events = analyze_events(envs, reqs, records, profile)
    predicted_ttft = events.pop("admitted_predicted_ttft_ms")
    # TTFT prediction at admission vs measured (engine ms), for completed requests.
    inv = 1.0 / args.time_scale if args.time_scale > 0 else 1.0
    ttft_err = [abs(predicted_ttft[r.request_id] - r.ttft_s * inv * 1000) for r in results
                if r.ok and r.request_id in predicted_ttft]
    events["ttft_prediction_abs_error_ms"] = summarize(ttft_err)
    pe_count = metrics.get("flexlb_prefill_prediction_error_percent_count", 0.0)
    router_side = {
        "prediction_error_pct_mean": (round(metrics.get("flexlb_prefill_prediction_error_percent_sum", 0.0) / pe_count, 2)
                                      if pe_count else None),
        "prediction_error_batches": int(pe_count),
        "best_effort_admissions": metrics.get("flexlb_best_effort_admissions_total"),
        "inflight_at_end": metrics.get("flexlb_inflight_requests"),
        "requests_by_outcome": {k.split("{", 1)[1].rstrip("}"): v for k, v in metrics.items()
                                if k.startswith("flexlb_requests_total{")},
    }
    return {"client": client, "events": events, "router_metrics": router_side, "cpu": cpu, "replay": wall,
            "per_request_columns": PER_REQUEST_COLUMNS,
            "per_request": [
                [r.request_id, r.row, r.input_length, r.max_tokens, r.trace_ms,
                 round(r.ttft_s * inv * 1000, 1) if r.ttft_s is not None else None,
                 round(r.e2e_s * inv * 1000, 1) if r.e2e_s is not None else None,
                 r.tokens, r.error, round(r.late_s * 1000, 2) if r.late_s is not None else None]
                for r in results]}


PER_REQUEST_COLUMNS = ["id", "row", "input_tokens", "max_tokens", "trace_ms", "ttft_engine_ms", "e2e_engine_ms",
                       "tokens", "error", "send_late_wall_ms"]


# --------------------------------------------------------------------------- report
def table(result: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    cols = ["policy", "done/failed", "TTFT mean", "p50", "p90", "p99", "TPOT mean", "p90", "e2e mean",
            "hit rate", "mean batch", "TTFT growth s/s", "pred err % p50/p90", "per-worker requests",
            "engine fidelity", "CPU stack/all (sat.)", "exit"]
    rows = []
    for run in result["runs"]:
        if "client" not in run:
            rows.append([run["policy"], "error", *["-"] * (len(cols) - 3), fmt(run.get("stack_exit_code"))])
            continue
        c, e, cpu = run["client"], run["events"], run["cpu"]
        workers = " ".join(f"{v['requests']}" for _, v in e["per_worker"].items())
        rows.append([
            run["policy"], f"{c['completed']}/{c['failed']}",
            fmt(c["ttft_ms"]["mean"]), fmt(c["ttft_ms"]["p50"]), fmt(c["ttft_ms"]["p90"]), fmt(c["ttft_ms"]["p99"]),
            fmt(c["tpot_ms"]["mean"], 1), fmt(c["tpot_ms"]["p90"], 1), fmt(c["e2e_ms"]["mean"]),
            fmt(e["prefix_hit_rate"], 3), fmt(e["mean_batch_size"], 2), fmt(c["ttft_growth_s_per_s"], 2),
            f"{fmt(e['predictor']['abs_error_pct']['p50'], 1)}/{fmt(e['predictor']['abs_error_pct']['p90'], 1)}", workers,
            fmt(e["engine_fidelity_weighted"], 3),
            f"{fmt(cpu['stack_and_loadgen_cores_mean'], 2)}/{fmt(cpu['machine_busy_cores']['mean'], 2)} "
            f"({fmt(cpu['saturated_fraction'], 2)})",
            fmt(run.get("stack_exit_code")),
        ])
    return cols, rows


def print_report(result: dict[str, Any]) -> None:
    cols, rows = table(result)
    f, t = result["flags"], result["trace"]
    title = (f"FlexLB trace replay: {t['rows']} rows of {Path(f['trace']).name} from row {f['start_row']}, "
             f"{f['workers']} sim workers, time-scale {f['time_scale']:g}, rate-scale {f['rate_scale']:g} "
             f"({t['rate_req_per_engine_s']} req/s, no-cache prefill utilization {t['prefill_utilization_no_cache']}, "
             f"reuse upper bound {t['reuse_upper_bound_unbounded_cache']}); times in ENGINE ms (wall / time-scale); "
             f"{result['machine']['cores']} cores shared by the load generator and the stack")
    print_table(title, cols, rows, left=("policy", "per-worker requests"))
    for run in result["runs"]:
        if "client" not in run:
            print(f"{run['policy']}: {run.get('error')}")
            continue
        c, e = run["client"], run["events"]
        print(f"{run['policy']}: errors {c['errors'] or 0}; terminal events {e['terminal_events']}; "
              f"engine fidelity (measured/profile) p50 {e['engine_fidelity_measured_over_profile']['p50']} "
              f"p90 {e['engine_fidelity_measured_over_profile']['p90']}; send lateness p99 "
              f"{c['send_lateness_wall_ms']['p99']} wall ms; filters {e['prefill_candidates_filtered'] or 0}; "
              f"CPU by process {run['cpu']['mean_cores_by_process']}")


def markdown_table(result: dict[str, Any]) -> str:
    cols, rows = table(result)
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---:" if i else "---" for i in range(len(cols))) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


# --------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", default=DEFAULT_TRACE, help=f"Mooncake JSONL trace (default {DEFAULT_TRACE}, from the repo root)")
    p.add_argument("--rows", type=int, default=500, help="rows to replay (default 500)")
    p.add_argument("--start-row", type=int, default=0, help="first row to replay (timestamps rebased to it; default 0)")
    p.add_argument("--workers", type=int, default=4, help="simulated pd_fusion workers (default 4)")
    p.add_argument("--time-scale", type=float, default=0.1,
                   help="engine time multiplier of the workers (wall = engine × this; default 0.1)")
    p.add_argument("--rate-scale", type=float, default=1.0,
                   help="multiply the trace's inter-arrival times by this (2 = half the rate; default 1)")
    p.add_argument("--policies", default="cost-based,cache-aware,round-robin", help="prefill policies, comma-separated")
    p.add_argument("--policy-params", default="{}",
                   help='JSON {"policy": {params}} passed as --prefill-policy-params to that policy')
    p.add_argument("--batcher", help="router batcher (default: the router's)")
    p.add_argument("--batcher-params",
                   help="JSON batcher parameters; every key ending in _ms is taken as ENGINE ms and sent to the "
                        "router (whose clock is the wall clock) multiplied by time-scale; see --verbatim-batcher-params")
    p.add_argument("--verbatim-batcher-params", action="store_true",
                   help="send --batcher-params unchanged (its _ms values are then wall ms)")
    p.add_argument("--batch-wait-ms", type=float, default=10.0,
                   help="fixed-window batch window in ENGINE ms (default 10, the router's default); sent to the "
                        "router as this × time-scale; ignored when --batcher-params sets wait_ms; negative: not sent")
    p.add_argument("--batch-size-max", type=int, help="fixed-window: most requests per batch (default: the router's)")
    p.add_argument("--num-kv-blocks", type=int, default=196_608,
                   help="KV blocks per worker (default 196608 = 3 M tokens of 16-token blocks)")
    p.add_argument("--block-size-tokens", type=int, default=16)
    p.add_argument("--max-batch-tokens", type=int,
                   help="most prompt tokens per prefill batch (default: --max-prompt-tokens, so that every accepted "
                        "prompt fits a batch; the worker's own default, 65536, fails longer prompts as too_large)")
    p.add_argument("--max-prompt-tokens", type=int, default=131_072)
    p.add_argument("--max-seq-len-tokens", type=int, default=140_000)
    p.add_argument("--seed", type=int, default=0, help="the router's seed")
    p.add_argument("--log-level", default="warning", help="router log level (default warning)")
    p.add_argument("--policy-cap-s", type=float, default=600.0,
                   help="wall-clock cap of one policy's replay; what is left is cancelled (default 600)")
    p.add_argument("--request-timeout-s", type=float, default=900.0, help="client timeout of one request (wall s)")
    p.add_argument("--startup-timeout-s", type=float, default=120.0)
    p.add_argument("--stop-timeout-s", type=float, default=60.0)
    p.add_argument("--cpu-interval-s", type=float, default=1.0)
    p.add_argument("--markdown", action="store_true", help="also print the table as markdown")
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "trace_mooncake500.json"), help="JSON report path")
    p.add_argument("--export-dir", help="also export each run's event log and core journal here (<policy>.jsonl.gz)")
    args = p.parse_args(argv)
    args.policy_list = [x.strip() for x in args.policies.split(",") if x.strip()]
    if not args.policy_list:
        p.error("--policies is empty")
    if args.rows < 1 or args.workers < 1 or args.start_row < 0:
        p.error("--rows and --workers must be >= 1, --start-row >= 0")
    if args.time_scale <= 0 or args.rate_scale <= 0:
        p.error("--time-scale and --rate-scale must be > 0 (time-scale 0 makes engine times meaningless)")
    try:
        args.policy_params = json.loads(args.policy_params)
        batcher_params = json.loads(args.batcher_params) if args.batcher_params else {}
    except ValueError as exc:
        p.error(f"bad JSON: {exc}")
    if not isinstance(args.policy_params, dict) or not isinstance(batcher_params, dict):
        p.error("--policy-params and --batcher-params take JSON objects")
    if args.max_batch_tokens is None:
        args.max_batch_tokens = args.max_prompt_tokens
    args.batcher_params_given = batcher_params
    args.batcher_params_sent = batcher_params if args.verbatim_batcher_params else {
        k: (round(v * args.time_scale, 6) if k.endswith("_ms") and isinstance(v, (int, float)) and not isinstance(v, bool)
            else v)
        for k, v in batcher_params.items()}
    args.router_batch_wait_ms = None
    if args.batch_wait_ms >= 0 and "wait_ms" not in batcher_params:
        args.router_batch_wait_ms = round(args.batch_wait_ms * args.time_scale, 6)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, str(REPO))
    trace_path = resolve_trace(args.trace)
    rows = load_rows(trace_path, args.start_row, args.rows)
    if not rows:
        print(f"no rows in {trace_path} from row {args.start_row}", file=sys.stderr)
        return 1
    profile = load_profile()
    t_build = time.monotonic()
    reqs = build_requests(rows, args.rate_scale, args.time_scale)
    print(f"built {len(reqs)} requests in {time.monotonic() - t_build:.1f}s "
          f"({sum(len(r.body) for r in reqs) / 1e6:.1f} MB of bodies); replay span "
          f"{reqs[-1].send_at_s:.1f} wall s per policy", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    result: dict[str, Any] = {
        "benchmark": "flexlb trace replay (bench/trace.py)",
        "command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine_facts(),
        "flags": {k: getattr(args, k) for k in (
            "rows", "start_row", "workers", "time_scale", "rate_scale", "policy_list", "policy_params", "batcher",
            "batcher_params_given", "batcher_params_sent", "batch_wait_ms", "router_batch_wait_ms", "batch_size_max", "num_kv_blocks",
            "block_size_tokens", "max_batch_tokens", "max_prompt_tokens", "max_seq_len_tokens", "seed",
            "policy_cap_s", "request_timeout_s")} | {"trace": str(trace_path)},
        "trace": trace_facts(rows, profile, args.workers, args.rate_scale),
        "engine_profile": profile,
        "notes": [
            "all latencies are ENGINE time: wall time divided by time_scale (the simulated engine sleeps "
            "profile_ms × time_scale); router-side overheads (HTTP, NATS, Redis, Python) are therefore "
            "magnified by 1/time_scale in these numbers",
            "open loop: each request is sent at its (rebased) trace timestamp × rate_scale × time_scale, "
            "whatever happened to earlier ones",
            "the router's own clocks are wall clocks: its batch window is sent scaled (router_batch_wait_ms), "
            "but its heartbeat/liveness timeouts, SLO deadlines and the elapsed time it subtracts from "
            "inflight batches' predicted waits are not scaled",
            "the load generator and the whole stack share the machine's cores (see cpu)",
            "prompt tokens: each Mooncake hash id expands to random.Random(hash_id).choices(range(50000), k=512)",
        ],
        "runs": [],
    }
    workdir = Path(tempfile.mkdtemp(prefix="flexlb-trace-"))
    failed = False
    for policy in args.policy_list:
        stack = Stack(args, policy, workdir)
        run: dict[str, Any] = {"policy": policy, "argv": stack.argv()}
        print(f"[{policy}] starting: {' '.join(stack.argv())}", file=sys.stderr, flush=True)
        try:
            stack.start()
            print(f"[{policy}] router {stack.url} up; replaying {len(reqs)} requests", file=sys.stderr, flush=True)
            run.update(asyncio.run(run_policy(stack, reqs, args, profile)))
            c = run["client"]
            print(f"[{policy}] {c['completed']} done, {c['failed']} failed {c['errors']}; TTFT mean "
                  f"{c['ttft_ms']['mean']} p90 {c['ttft_ms']['p90']} engine ms; hit rate "
                  f"{run['events']['prefix_hit_rate']}; CPU {run['cpu']['machine_busy_cores']}",
                  file=sys.stderr, flush=True)
        except Exception as exc:  # report what ran, then fail
            failed = True
            run["error"] = f"{exc.__class__.__name__}: {exc}"
            print(f"[{policy}] failed: {run['error']}\n--- flexlb up log ---\n{stack.log_tail()}", file=sys.stderr)
        finally:
            code = stack.stop()
            run["stack_exit_code"] = code
            if code != 0:
                failed = True
                run["stack_log_tail"] = stack.log_tail()
                print(f"[{policy}] flexlb up exited with {code} after SIGTERM (expected 0)\n{stack.log_tail()}",
                      file=sys.stderr)
        result["runs"].append(run)
    result["total_wall_s"] = round(time.monotonic() - t0, 1)
    result["machine"]["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    out = Path(args.out)
    if not out.is_absolute() and not out.parent.exists():
        out = REPO / out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(dump_json(result) + "\n")
    os.replace(tmp, out)
    print_report(result)
    if args.markdown:
        print(markdown_table(result))
    print(f"wrote {out} ({result['total_wall_s']} s)")
    shutil.rmtree(workdir, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
