"""Side by side with the routers people run: FlexLB, SGLang's router, vLLM's router and no
router at all, each in front of a fresh fleet of simulated engines, under an open-loop
streaming replay of a public trace; SLO attainment against load, and per configuration the
highest load it sustains with at least 90 % of requests within their SLO.

    python bench/peers.py --trace azure-conv --rows 60 --configs flexlb,direct-round-robin --rates 2
    python bench/peers.py --trace mooncake --rows 300 --search --search-start 0.5 --plot bench/results/peers_mooncake
    python bench/peers.py --trace azure-code --configs flexlb,sglang-cache_aware,vllm-cache_aware --rates 0.5,1,2
    python bench/peers.py --configs flexlb --flexlb-args "--slo-mode reject" --name flexlb-reject --rates 1,2

Configurations (`--configs a,b,...`, default all; the names are stable):

| name | what runs in front of K engines |
|---|---|
| `flexlb` | `flexlb up --workers K --time-scale T`: the shipped defaults, nothing else |
| `flexlb-fixed-window` | the same with `--batcher fixed-window` |
| `flexlb-slo-budget` | `--batcher slo-budget` |
| `flexlb-cache-aware` | `--prefill-policy cache-aware` |
| `flexlb-round-robin` | `--prefill-policy round-robin` |
| `flexlb-openai` | FlexLB through its OpenAI adapter in front of the peers' very engines: K `flexlb sim-server` processes (each also publishing vLLM's KV events over ZMQ) and `flexlb up --engine openai --engine-url URL --kv-events-endpoint PUB --kv-events-replay-endpoint REPLAY` per server (`AdapterFleet`) |
| `sglang-<policy>` | `python -m sglang_router.launch_router --policy <policy>` (round_robin, cache_aware, power_of_two) |
| `vllm-<policy>` | `python -m vllm_router.launch_router --policy <policy>` (the same three) |
| `direct-round-robin` | no router: the load generator sends request i to engine i mod K |
| `<name>@PpDd` | FlexLB or sglang-router on a disaggregated fleet of P prefill + D decode engines, P + D = K (`with_pd`) |

`--flexlb-args "..."` is appended to every FlexLB command line of the run (after the
configuration's own flags, so it wins), which is then reported as `--name` (or
`<config>+<name>` when several FlexLB configurations run). The FlexLB configurations run
NATS, Redis, the router and K NATS workers (`flexlb up`), except `flexlb-openai`, whose
agents stream from the sim-servers; every other configuration runs K
`flexlb sim-server` processes: the same simulated engine behind an HTTP front
(`--sim-server-cmd` replaces that command, e.g. to try another build). Engine flags
(`--num-kv-blocks`, `--block-size-tokens`, `--max-seq-len-tokens`, `--max-num-batched-tokens`,
`--max-num-seqs`, `--no-chunked-prefill`, `--profile`) go to every engine of every
configuration, and only when given: by default every engine runs its shipped defaults
(`workers/agent.py` WorkerConfig). The time scale (default 1, because a router's overhead is
wall time) is the same for all.

The peer routers run with their defaults except: loopback only (`--host 127.0.0.1`,
`--prometheus-host 127.0.0.1`, free ports), `--log-level warn`, and
`--worker-startup-check-interval 1` (default 30), which in sglang-router 0.3.2 and
vllm-router 0.1.17 is also the period at which power_of_two polls the engines' `/get_load`
(workers/http_front.py): with 30 s its loads would be stale for a whole run. No
`--model-path` / `--tokenizer-path`: neither router needs a tokenizer to route HTTP text
requests; the sim-server reports no model_path (a name there makes sglang-router try to
download a tokenizer), and every child runs with HF_HUB_OFFLINE=1 and HF_ENDPOINT on a closed
loopback port, so an attempt fails at once; the report lists any such log line.
`--peer-args "..."` appends flags to every peer router.

Each run (one configuration at one load) starts a FRESH fleet (empty caches), waits until it
is ready (`flexlb up`: its state file and /readyz; sim-servers: /health; peer routers:
/readiness with all K workers healthy), sends `--warmup` tiny requests (4-character prompts,
shorter than a KV block: they cache nothing) through the router, snapshots the engines'
counters, replays the trace, reads the counters again and stops every process (SIGTERM to
the process group leader, then SIGKILL to the group; each wait bounded).

Workloads (`--trace`; rows `--start-row S --rows N`):
- `mooncake` (../shared/data/mooncake_synthetic_trace.jsonl): each hash id expands to a fixed
  block of 512 printable-ASCII characters (random.Random(hash_id)), concatenated and cut to
  the row's input_length, so prefix sharing is exact. Text prompts: with the byte-level
  tokenizer (schemas/tokens.py) one ASCII character is one token, for every router alike.
- `azure-conv`, `azure-code` (the Azure 2023 CSVs): no prefix information; each row's prompt is
  random printable text seeded by its row index.
Prompts longer than `--max-prompt-tokens` (32000; FlexLB refuses more than 32768) are cut to
it, and the report says how many. max_tokens = max(1, output length). Every body carries the
SLO: `"slo_ttft_ms": 2000, "slo_tpot_ms": 100` (`--slo-ttft-ms`, `--slo-tpot-ms`); the peers and
the sim-servers ignore them. Row i is sent at (ts_i − ts_start) / multiplier (× time scale);
the load of a run is N / span of the scaled arrivals, in req/s, and the multiplier.

The client: open loop, one asyncio task per request (a late answer never delays the next
send), a raw HTTP/1.1 connection per request posting a streamed `/v1/completions`, cheap SSE
parsing (the tokens of a chunk are its characters). TTFT = send → first token chunk; TPOT =
(e2e − TTFT) / (tokens − 1); errors by HTTP status and the code in the body (`429:queue_full`)
or `stream:<code>` for an error event. `--client-procs P` splits the requests over P processes
(sharing one start instant). Each request has a timeout (`--request-timeout-s`); the run a wall
cap (`--run-cap-s`, default the arrival span + `--drain-s`), after which what is left is
cancelled and counted as not completed. The client's CPU and every process's are sampled.

A request attains its SLO when it completed (HTTP 200, [DONE], all max_tokens tokens) and its
TTFT ≤ target and its mean TPOT ≤ target (single-token requests: TTFT only); rejections,
errors and cancelled requests are misses. Goodput = attained requests / arrival span (s).
Prefix hit rate = Σ cached / Σ prompt tokens: from the sim-servers' /metrics counters
(`flexlb_sim_cached_tokens_total` / `flexlb_sim_prompt_tokens_total`, deltas over the replay)
for peers and direct, from FlexLB's event log (`request.finished`) for FlexLB.

Two offline figures frame the results (bench/capacity.py): the capacity bound, and the share
of requests that could meet the SLO even alone on an idle engine (a ceiling on attainment at
any load: on Mooncake slices with a 2 s TTFT target it is about 60 %, because prefilling a
20k-token prompt alone takes longer; the report warns when it is below the target). A
headline above the capacity bound means the slice is too short for queues to build.

Loads: `--rates 0.5,1,1.5,2` (multipliers), or `--search`: per configuration start at
`--search-start`, multiply by `--search-factor` while attainment ≥ `--target` (down while
it misses), then bisect `--bisect` times between the last pass and the first fail, at most
`--max-runs` runs. The headline per configuration is the highest load with attainment ≥ 90 %,
interpolated linearly between the highest passing load and the lowest failing load above it
(`≥ x` when nothing failed, `< x` when nothing passed), also as a fraction of the capacity
bound (bench/capacity.py: every distinct prefix block computed once fleet-wide, work perfectly
balanced; an upper bound, not a prediction), against the best peer router and against
direct round-robin. Times are ENGINE ms (wall / time scale; = wall at time scale 1).

Output: a table, and `--out` (default bench/results/peers_<trace>.json): every run, machine
facts, package versions, every command line, per-request records with `--per-request`.
`--plot PREFIX`: PREFIX_attainment.png (attainment vs load, every configuration) and
PREFIX_cdf.png (TTFT and TPOT CDFs of every configuration at `--cdf-rate`; runs it if needed).
Exit status 0 when every run started and stopped cleanly (request failures are results).
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import math
import multiprocessing
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Callable

import msgspec

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench import trace as bt  # noqa: E402  (helpers: ports, /proc CPU, percentiles, JSON)
from bench.capacity import (  # noqa: E402
    EngineLimits,
    StepCosts,
    WorkloadRequest,
    capacity_bound,
    zero_load_latency_ms,
    zero_load_slo_fraction,
)

HASH_BLOCK_TOKENS = 512  # tokens (= characters) per Mooncake hash id
PRINTABLE = "".join(chr(c) for c in range(32, 127))  # one byte, one token each
TRACES = {
    "mooncake": "../shared/data/mooncake_synthetic_trace.jsonl",
    "azure-conv": "../shared/data/AzureLLMInferenceTrace_conv_2023.csv",
    "azure-code": "../shared/data/AzureLLMInferenceTrace_code_2023.csv",
}
DEFAULT_PROFILE = REPO / "workers" / "profiles" / "llama2-70b-h100-tp8.json"
PEER_POLICIES = ("round_robin", "cache_aware", "power_of_two")
WARMUP_PROMPT = "warm"  # shorter than any KV block: nothing is cached by it
WARMUP_PREFIX = "warmup-"


# --------------------------------------------------------------------------- configurations
@dataclass(frozen=True)
class Config:
    name: str
    kind: str  # "flexlb" | "flexlb-openai" (FlexLB's agents in front of the sim-servers) | "sglang" | "vllm" | "direct"
    policy: str | None = None  # the peer router's --policy
    flexlb_flags: tuple[str, ...] = ()  # added to `flexlb up`
    pd: tuple[int, int] | None = None  # disaggregated: (prefill engines, decode engines); None: colocated


def with_pd(config: Config, suffix: str, workers: int) -> Config:
    """`NAME@PpDd` (e.g. `flexlb@3p1d`, `sglang-cache_aware@3p1d`): the same configuration on
    a disaggregated fleet of P prefill and D decode engines, P + D = K. FlexLB: `flexlb up
    --prefill P --decode D`. sglang-router: `--pd-disaggregation`, each prefill engine given
    with its own HTTP port as the bootstrap port, `--policy` for both stages (SGLang's
    bootstrap protocol, emulated by the sim-server: workers/http_front.py). vllm-router's PD
    protocol (kv_transfer_params) is not emulated, and no-router round-robin has no hand-off."""
    import re

    match = re.fullmatch(r"(\d+)p(\d+)d", suffix)
    if match is None:
        raise ValueError(f"{config.name}@{suffix}: the fleet shape is PpDd, e.g. 3p1d")
    num_prefill, num_decode = int(match[1]), int(match[2])
    if num_prefill < 1 or num_decode < 1 or num_prefill + num_decode != workers:
        raise ValueError(f"{config.name}@{suffix}: P, D >= 1 and P + D = --workers ({workers})")
    if config.kind not in ("flexlb", "sglang"):
        raise ValueError(f"{config.name}@{suffix}: a PD fleet runs with FlexLB or sglang-router only")
    flags = config.flexlb_flags + (("--prefill", str(num_prefill), "--decode", str(num_decode))
                                   if config.kind == "flexlb" else ())
    return Config(f"{config.name}@{suffix}", config.kind, config.policy, flags, (num_prefill, num_decode))


def builtin_configs() -> dict[str, Config]:
    configs = [
        Config("flexlb", "flexlb"),
        Config("flexlb-fixed-window", "flexlb", flexlb_flags=("--batcher", "fixed-window")),
        Config("flexlb-slo-budget", "flexlb", flexlb_flags=("--batcher", "slo-budget")),
        Config("flexlb-cache-aware", "flexlb", flexlb_flags=("--prefill-policy", "cache-aware")),
        Config("flexlb-round-robin", "flexlb", flexlb_flags=("--prefill-policy", "round-robin")),
        Config("flexlb-openai", "flexlb-openai"),
        *(Config(f"sglang-{p}", "sglang", policy=p) for p in PEER_POLICIES),
        *(Config(f"vllm-{p}", "vllm", policy=p) for p in PEER_POLICIES),
        Config("direct-round-robin", "direct"),
    ]
    return {c.name: c for c in configs}


# --------------------------------------------------------------------------- workloads
@dataclass
class Row:
    row: int  # index in the trace file (data rows, from 0)
    ts_ms: float  # timestamp relative to the first replayed row (trace ms)
    recorded_input_length: int
    input_length: int  # as sent: min(recorded, --max-prompt-tokens)
    max_tokens: int  # max(1, output length)
    hash_ids: list[int] | None  # Mooncake prefix blocks; None: no prefix information


def resolve_trace(name_or_path: str) -> tuple[str, Path]:
    """A workload name (mooncake, azure-conv, azure-code) or a path; relative to the repo root."""
    if name_or_path in TRACES:
        return name_or_path, (REPO / TRACES[name_or_path]).resolve()
    p = Path(name_or_path)
    p = p if p.is_absolute() or p.exists() else REPO / p
    return p.stem, p.resolve()


def _azure_ts_ms(text: str) -> float:
    """'2023-11-16 18:15:46.6805900' (7 fractional digits) -> epoch ms."""
    date, _, frac = text.strip().partition(".")
    base = datetime.strptime(date, "%Y-%m-%d %H:%M:%S").timestamp()
    return (base + (float("0." + frac) if frac else 0.0)) * 1000.0


def load_rows(path: Path, start: int, count: int, max_prompt_tokens: int) -> list[Row]:
    rows: list[Row] = []
    if path.suffix == ".jsonl":
        with open(path) as fh:
            for i, line in enumerate(fh):
                if i < start or not line.strip():
                    continue
                if len(rows) >= count:
                    break
                r = json.loads(line)
                n = int(r["input_length"])
                rows.append(Row(i, float(r["timestamp"]), n, min(n, max_prompt_tokens),
                                max(1, int(r["output_length"])), list(r["hash_ids"])))
    else:
        with open(path, newline="") as fh:
            for i, r in enumerate(csv.DictReader(fh)):
                if i < start:
                    continue
                if len(rows) >= count:
                    break
                n = max(1, int(r["ContextTokens"]))
                rows.append(Row(i, _azure_ts_ms(r["TIMESTAMP"]), n, min(n, max_prompt_tokens),
                                max(1, int(r["GeneratedTokens"])), None))
    if rows:
        t0 = rows[0].ts_ms
        for r in rows:
            r.ts_ms -= t0
    return rows


class PromptText:
    """Mooncake hash id -> its fixed 512-character block (cached: shared prefixes repeat)."""

    def __init__(self) -> None:
        self.blocks: dict[int, str] = {}

    def block(self, hash_id: int) -> str:
        b = self.blocks.get(hash_id)
        if b is None:
            b = "".join(random.Random(hash_id).choices(PRINTABLE, k=HASH_BLOCK_TOKENS))
            self.blocks[hash_id] = b
        return b

    def prompt(self, row: Row) -> str:
        n = row.input_length
        if row.hash_ids is None:
            return "".join(random.Random(row.row).choices(PRINTABLE, k=n))
        need = -(-n // HASH_BLOCK_TOKENS)
        if need > len(row.hash_ids):
            raise ValueError(f"row {row.row}: input_length {n} exceeds {len(row.hash_ids)} hash blocks")
        return "".join(self.block(h) for h in row.hash_ids[:need])[:n]


def build_bodies(rows: list[Row], args: argparse.Namespace) -> list[bytes]:
    enc = msgspec.json.Encoder()
    text = PromptText()
    return [enc.encode({"model": args.model_name, "prompt": text.prompt(r), "max_tokens": r.max_tokens,
                        "stream": True, "slo_ttft_ms": args.slo_ttft_ms, "slo_tpot_ms": args.slo_tpot_ms,
                        "request_id": f"row-{r.row:05d}"}) for r in rows]


def workload_facts(rows: list[Row], span_s: float) -> dict[str, Any]:
    cut = [r for r in rows if r.input_length < r.recorded_input_length]
    return {
        "rows": len(rows),
        "first_row": rows[0].row,
        "recorded_span_s": round(span_s, 3),
        "recorded_rate_req_per_s": round(len(rows) / span_s, 4) if span_s > 0 else None,
        "input_tokens_as_sent": bt.summarize([float(r.input_length) for r in rows], 0),
        "max_tokens": bt.summarize([float(r.max_tokens) for r in rows], 0),
        "prompts_cut": len(cut),
        "prompt_tokens_cut": sum(r.recorded_input_length - r.input_length for r in cut),
        "has_prefix_info": rows[0].hash_ids is not None,
    }


# --------------------------------------------------------------------------- the client
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


_DECODER = msgspec.json.Decoder()


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


async def stream_one(host: str, port: int, body: bytes, request_id: str, rec: Rec) -> None:
    """POST a streamed /v1/completions on its own connection and read the SSE stream."""
    t_send = time.perf_counter()
    writer = None
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

        def body_parts():
            return bt.http_body_parts(reader, chunked, length)

        if rec.status != 200:
            rec.error = error_code(rec.status, b"".join([p async for p in body_parts()]))
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
                        code = (err.get("code") or err.get("type")) if isinstance(err, dict) else err
                        rec.error = f"stream:{code}"
                        rec.error_message = str(err.get("message", "") if isinstance(err, dict) else err)[:300]
                        continue
                    n = len(obj["choices"][0].get("text") or "")  # byte tokenizer: one ASCII char, one token
                    if n:
                        rec.tokens += n
                        if rec.ttft_s is None:
                            rec.ttft_s = now - t_send
        if rec.error is None:
            rec.error = "client_no_done"
    except (OSError, asyncio.IncompleteReadError, ValueError, KeyError, TypeError, IndexError) as exc:
        rec.error = rec.error or f"client_{exc.__class__.__name__}"
    finally:
        if writer is not None:
            writer.close()


@dataclass
class Plan:
    """What one client process sends: request indices, their send times and targets."""

    indices: list[int]
    send_at_s: list[float]  # wall seconds after the common start
    targets: list[int]


# The bodies and URLs live in module globals so that forked client processes share them
# without pickling (tens of MB for Mooncake).
_BODIES: list[bytes] = []
_REQUEST_IDS: list[str] = []
_URLS: list[tuple[str, int]] = []


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
        host, port = _URLS[rec.target]
        try:
            await asyncio.wait_for(stream_one(host, port, _BODIES[rec.index], _REQUEST_IDS[rec.index], rec),
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


# --------------------------------------------------------------------------- processes
_LIVE: list["Proc"] = []  # every process started and not yet stopped (stopped on any exit)


class Proc:
    """A child in its own session (process group), logging to a file; stopped by SIGTERM to
    it, SIGKILL to its group after `timeout_s`, and its group's leftovers reaped."""

    def __init__(self, name: str, argv: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.name, self.argv, self.log_path, self.env = name, argv, log_path, env
        self.popen: subprocess.Popen | None = None
        self.exit_code: int | None = None
        self.killed = False

    @property
    def pid(self) -> int:
        return self.popen.pid if self.popen else 0

    def start(self) -> None:
        self.log = open(self.log_path, "w")
        self.popen = subprocess.Popen(self.argv, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, start_new_session=True, env=self.env)
        _LIVE.append(self)

    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self, timeout_s: float) -> int | None:
        """The exit status after SIGTERM; None when it had to be killed."""
        if self.popen is None:
            return None
        p = self.popen
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.killed = True
                _killpg(p.pid, signal.SIGKILL)
                p.wait(10)
        self.exit_code = None if self.killed else p.returncode
        # Children it left behind in its group (e.g. a worker `flexlb up` could not stop).
        if _group_alive(p.pid):
            _killpg(p.pid, signal.SIGTERM)
            deadline = time.monotonic() + 3
            while _group_alive(p.pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            if _group_alive(p.pid):
                _killpg(p.pid, signal.SIGKILL)
        self.log.close()
        if self in _LIVE:
            _LIVE.remove(self)
        return self.exit_code


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def stop_all(timeout_s: float = 10.0) -> None:
    for p in list(reversed(_LIVE)):
        p.stop(timeout_s)


def wait_http(url: str, deadline: float, procs: list[Proc], ok: Callable[[int | None, str], bool]) -> str:
    """Poll a URL until `ok(status, text)`; fail when a process died or the deadline passed."""
    last = "no answer yet"
    while True:
        for p in procs:
            if not p.running():
                raise RuntimeError(f"{p.name} exited with {p.popen.returncode if p.popen else None} during start-up:\n"
                                   f"{p.log_tail()}")
        status, text = bt.http_get(url, timeout=2.0)
        if ok(status, text):
            return text
        last = f"{status} {text[:200]}"
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} not ready in time: {last}")
        time.sleep(0.2)


def flexlb_exe() -> list[str]:
    exe = shutil.which("flexlb") or str(Path(sys.executable).parent / "flexlb")
    return [exe] if Path(exe).exists() else [sys.executable, "-m", "services.cli"]


def child_env(workdir: Path) -> dict[str, str]:
    """The environment of every child: no FLEXLB_* overrides of ours (a fresh stack each
    time), and Hugging Face pointed at a closed loopback port, offline: a router that tries
    to fetch a tokenizer fails at once and nothing leaves the machine."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEXLB_")}
    env.update(FLEXLB_UP_STATE=str(workdir / "last-up.json"), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               HF_ENDPOINT=f"http://127.0.0.1:{_closed_port()}", HF_HOME=str(workdir / "hf"),
               NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost")
    return env


_CLOSED_PORT: int | None = None


def _closed_port() -> int:
    """A loopback port nobody listens on (picked once, then left closed)."""
    global _CLOSED_PORT
    if _CLOSED_PORT is None:
        _CLOSED_PORT = bt.free_port()
    return _CLOSED_PORT


# --------------------------------------------------------------------------- fleets
def engine_flags(args: argparse.Namespace) -> list[str]:
    """The engine flags given on our command line, for every engine of every configuration."""
    out: list[str] = []
    for name in ("num_kv_blocks", "block_size_tokens", "max_seq_len_tokens", "max_num_batched_tokens", "max_num_seqs",
                 "profile"):
        v = getattr(args, name)
        if v is not None:
            out += [f"--{name.replace('_', '-')}", str(v)]
    if args.no_chunked_prefill:
        out.append("--no-chunked-prefill")
    return out


class Fleet:
    """K engines (and a router or not) for one run."""

    def __init__(self, config: Config, args: argparse.Namespace, workdir: Path, tag: str) -> None:
        self.config, self.args, self.workdir, self.tag = config, args, workdir, tag
        self.procs: list[Proc] = []
        self.urls: list[tuple[str, int]] = []  # where the client sends

    def commands(self) -> list[str]:
        return [shlex.join(p.argv) for p in self.procs]

    def pids(self) -> dict[str, int]:
        return {p.name: p.pid for p in self.procs}

    def target_of(self, i: int) -> int:
        return 0

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> dict[str, int | None]:
        codes = {}
        for p in reversed(self.procs):  # router first, engines last
            codes[p.name] = p.stop(self.args.stop_timeout_s)
        return codes

    def counters(self) -> dict[str, Any] | None:
        return None

    async def after_replay(self, before: dict[str, Any] | None) -> dict[str, Any]:
        return {}


class FlexlbFleet(Fleet):
    """`flexlb up --workers K --time-scale T` (+ the configuration's flags, + --flexlb-args)."""

    def start(self) -> None:
        a = self.args
        self.start_up(["--workers", str(a.workers), "--time-scale", f"{a.time_scale:g}", *engine_flags(a)])

    def start_up(self, fleet_flags: list[str]) -> None:
        """`flexlb up FLEET_FLAGS` (+ the configuration's flags, + --flexlb-args); returns once
        its router answers /readyz."""
        a = self.args
        self.port = bt.free_port()
        self.state_file = self.workdir / f"state-{self.tag}.json"
        argv = [*flexlb_exe(), "up", *fleet_flags, "--port", str(self.port), "--state-file", str(self.state_file),
                *self.config.flexlb_flags, *a.flexlb_args_list]
        up = Proc("up", argv, self.workdir / f"{self.tag}-up.log", child_env(self.workdir))
        self.procs.append(up)
        up.start()
        deadline = time.monotonic() + a.startup_timeout_s
        while not self.state_file.exists():
            if not up.running():
                raise RuntimeError(f"flexlb up exited with {up.popen.returncode} during start-up:\n{up.log_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"no state file from flexlb up after {a.startup_timeout_s}s:\n{up.log_tail()}")
            time.sleep(0.1)
        self.state = json.loads(self.state_file.read_text())
        url = self.state["router_url"]
        wait_http(url + "/readyz", deadline, [up], lambda s, _: s == 200)
        host, port = url.split("//", 1)[1].rsplit(":", 1)
        self.urls = [(host, int(port))]

    def pids(self) -> dict[str, int]:
        pids = {k: v for k, v in self.state.get("pids", {}).items()} if hasattr(self, "state") else {}
        return {**pids, **{p.name: p.pid for p in self.procs}}

    def counters(self) -> dict[str, Any] | None:
        return self.router_counters()

    def router_counters(self) -> dict[str, Any] | None:
        status, text = bt.http_get(self.state["router_url"] + "/metrics")
        return bt.parse_metrics(text) if status == 200 else None

    async def after_replay(self, before: dict[str, Any] | None) -> dict[str, Any]:
        return await self.event_log_facts(before)

    async def event_log_facts(self, before: dict[str, Any] | None) -> dict[str, Any]:
        """Prefix hits and per-worker requests from the event log (warm-ups left out)."""
        from schemas import messages as m
        from tests.stack import read_event_log

        envs = await asyncio.wait_for(read_event_log(self.state["nats_url"]), self.args.startup_timeout_s)
        per_worker: Counter = Counter()
        terminal: Counter = Counter()
        failures: Counter = Counter()  # "code: message" of request.failed events
        prompt = cached = 0
        for env in envs:
            p = env.payload
            rid = getattr(p, "request_id", "")
            if rid.startswith(WARMUP_PREFIX):
                continue
            if isinstance(p, m.RequestAdmitted):
                per_worker[p.prefill_worker_id] += 1
            elif isinstance(p, m.RequestFinished):
                prompt += p.num_prompt_tokens
                cached += p.num_cached_tokens
                terminal["finished"] += 1
            elif isinstance(p, m.RequestFailed):
                terminal[f"failed:{p.code}"] += 1
                failures[f"{p.code}: {p.message[:160]}"] += 1
            elif isinstance(p, m.RequestRejected):
                terminal[f"rejected:{p.code}"] += 1
            elif isinstance(p, m.RequestCancelled):
                terminal["cancelled"] += 1
        after = self.router_counters() or {}
        best_effort = None
        if after and before is not None:
            key = "flexlb_best_effort_admissions_total"
            best_effort = after.get(key, 0.0) - before.get(key, 0.0)
        return {
            "source": "event log: request.finished (prefix), request.admitted (per worker)",
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "prefix_hit_rate": round(cached / prompt, 4) if prompt else None,
            "requests_per_worker": dict(sorted(per_worker.items())),
            "terminal_events": dict(sorted(terminal.items())),
            "failure_messages": dict(failures.most_common(10)),
            "best_effort_admissions": best_effort,
            "events": len(envs),
        }


class SimFleet(Fleet):
    """K `flexlb sim-server` processes, and the peer router in front of them (or none)."""

    def start_engines(self, kv_events: bool = False) -> float:
        """K sim-servers (with vLLM's KV events sockets on loopback when `kv_events`: their
        endpoints in self.kv_endpoints); returns the start-up deadline once all are healthy."""
        a = self.args
        env = child_env(self.workdir)
        base = shlex.split(a.sim_server_cmd) if a.sim_server_cmd else [*flexlb_exe(), "sim-server"]
        engines = []
        self.engine_urls: list[str] = []
        self.kv_endpoints: list[tuple[str, str]] = []  # (PUB, replay) per engine
        pd = self.config.pd
        roles = ["prefill"] * pd[0] + ["decode"] * pd[1] if pd else ["pd_fusion"] * a.workers
        for i, role in enumerate(roles):
            port = bt.free_port()
            events: list[str] = []
            if kv_events:
                pub, replay = f"tcp://127.0.0.1:{bt.free_port()}", f"tcp://127.0.0.1:{bt.free_port()}"
                self.kv_endpoints.append((pub, replay))
                events = ["--kv-events-endpoint", pub, "--kv-events-replay-endpoint", replay]
            argv = [*base, "--port", str(port), "--worker-id", f"w{i}", "--time-scale", f"{a.time_scale:g}",
                    *(["--role", role] if pd else []),
                    *(["--host", "127.0.0.1"] if a.sim_server_has_host else []), *engine_flags(a), *events,
                    *(["--model-name", a.model_name] if a.model_name != "flexlb-sim" else [])]
            engines.append(Proc(f"worker-w{i}", argv, self.workdir / f"{self.tag}-w{i}.log", env))
            self.engine_urls.append(f"http://127.0.0.1:{port}")
        self.procs = list(engines)
        for p in engines:
            p.start()
        deadline = time.monotonic() + a.startup_timeout_s
        for url in self.engine_urls:
            wait_http(url + "/health", deadline, engines, lambda s, _: s == 200)
        return deadline

    def start(self) -> None:
        a = self.args
        env = child_env(self.workdir)
        pd = self.config.pd
        deadline = self.start_engines()
        kind = self.config.kind
        if kind == "direct":
            self.urls = [("127.0.0.1", int(u.rsplit(":", 1)[1])) for u in self.engine_urls]
            return
        port, prom_port = bt.free_port(), bt.free_port()
        module = "sglang_router.launch_router" if kind == "sglang" else "vllm_router.launch_router"
        if pd:  # each prefill engine's own HTTP port is its bootstrap port (workers/http_front.py)
            fleet = ["--pd-disaggregation"]
            for url in self.engine_urls[:pd[0]]:
                fleet += ["--prefill", url, url.rsplit(":", 1)[1]]
            for url in self.engine_urls[pd[0]:]:
                fleet += ["--decode", url]
        else:
            fleet = ["--worker-urls", *self.engine_urls]
        argv = [sys.executable, "-m", module, "--host", "127.0.0.1", "--port", str(port),
                *fleet, "--policy", self.config.policy,
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prom_port),
                "--log-level", "warn" if kind == "sglang" else "warning",
                "--worker-startup-check-interval", "1", *a.peer_args_list]
        self.prometheus_port = prom_port
        router = Proc("router", argv, self.workdir / f"{self.tag}-router.log", env)
        self.procs.append(router)
        router.start()

        def ready(status: int | None, text: str) -> bool:
            if status != 200:
                return False
            try:
                return int(json.loads(text).get("healthy_workers", -1)) >= a.workers
            except (ValueError, AttributeError, TypeError):
                return True  # 200 without the counts: take the router's word

        wait_http(f"http://127.0.0.1:{port}/readiness", deadline, self.procs, ready)
        self.urls = [("127.0.0.1", port)]

    def target_of(self, i: int) -> int:
        return i % len(self.urls) if self.config.kind == "direct" else 0

    def counters(self) -> dict[str, Any] | None:
        out = {}
        for i, url in enumerate(self.engine_urls):
            status, text = bt.http_get(url + "/metrics")
            if status != 200:
                return None
            sums: dict[str, float] = {}
            for key, v in bt.parse_metrics(text).items():
                name = key.split("{", 1)[0]
                sums[name] = sums.get(name, 0.0) + v
            out[f"w{i}"] = sums
        return out

    def router_log_findings(self) -> list[str]:
        """Lines of the router's log that say it tried to fetch a tokenizer or failed requests."""
        router = next((p for p in self.procs if p.name == "router"), None)
        if router is None:
            return []
        try:
            text = router.log_path.read_text(errors="replace")
        except OSError:
            return []
        found: dict[str, int] = {}
        for line in text.splitlines():
            line = _strip_ansi(line)
            low = line.lower()
            if "huggingface" in low or "download" in low or ("tokenizer" in low and "fail" in low):
                at = max(line.find("Failed"), 0)
                msg = line[at:at + 300]
                found[msg] = found.get(msg, 0) + 1
        return [f"{n}x {msg}" for msg, n in list(found.items())[:10]]

    def router_metrics(self) -> dict[str, float]:
        """The peer router's own counters of retries, errors and circuit breaking."""
        if self.config.kind not in ("sglang", "vllm"):
            return {}
        status, text = bt.http_get(f"http://127.0.0.1:{self.prometheus_port}/metrics")
        if status != 200:
            return {}
        out = {}
        for key, v in bt.parse_metrics(text).items():
            name = key.split("{", 1)[0]
            not_ok = 'status_code="' in key and 'status_code="2' not in key
            if v and (not_ok or any(w in name for w in ("retr", "error", "fail", "circuit", "reject"))):
                out[key] = v
        return out

    async def after_replay(self, before: dict[str, Any] | None) -> dict[str, Any]:
        after = self.counters()
        if after is None or before is None:
            return {"source": "sim-server /metrics", "error": "a sim-server's /metrics did not answer"}

        def delta(w: str, name: str) -> float:
            return after[w].get(name, 0.0) - before[w].get(name, 0.0)

        workers = sorted(after)
        prompt = sum(delta(w, "flexlb_sim_prompt_tokens_total") for w in workers)
        cached = sum(delta(w, "flexlb_sim_cached_tokens_total") for w in workers)
        queries = sum(delta(w, "vllm:prefix_cache_queries_total") for w in workers)
        hits = sum(delta(w, "vllm:prefix_cache_hits_total") for w in workers)
        return {
            "source": "sim-server /metrics deltas over the replay",
            "prompt_tokens": int(prompt),
            "cached_tokens": int(cached),
            "prefix_hit_rate": round(cached / prompt, 4) if prompt else None,
            "vllm_prefix_cache_hit_rate": round(hits / queries, 4) if queries else None,
            "requests_per_worker": {w: int(delta(w, "flexlb_sim_requests_total")) for w in workers},
            "preemptions": int(sum(delta(w, "flexlb_sim_preemptions_total") for w in workers)),
            "router_counters": self.router_metrics(),
            "router_log": self.router_log_findings(),
        }


class AdapterFleet(SimFleet, FlexlbFleet):
    """FlexLB through its OpenAI adapter: the same K sim-servers as the peers' (each also
    publishing vLLM's KV events over ZMQ), and `flexlb up --engine openai --engine-url URL
    --kv-events-endpoint PUB --kv-events-replay-endpoint REPLAY` per server in front of them
    (+ the configuration's flags, + --flexlb-args). The engine's facts come from the servers'
    /metrics, as for the peers; the outcome counts from FlexLB's event log."""

    def start(self) -> None:
        self.start_engines(kv_events=True)
        flags = ["--engine", "openai"]
        for url, (pub, replay) in zip(self.engine_urls, self.kv_endpoints):
            flags += ["--engine-url", url, "--kv-events-endpoint", pub, "--kv-events-replay-endpoint", replay]
        self.start_up(flags)

    def target_of(self, i: int) -> int:
        return 0

    def pids(self) -> dict[str, int]:
        """`flexlb up`'s processes (its agents are worker-*), and the servers as engine-*."""
        state = self.state.get("pids", {}) if hasattr(self, "state") else {}
        procs = {("engine-" + p.name.removeprefix("worker-") if p.name.startswith("worker-") else p.name): p.pid
                 for p in self.procs}
        return {**state, **procs}

    def stop(self) -> dict[str, int | None]:
        return Fleet.stop(self)  # `flexlb up` (the last started) first, the servers after

    def counters(self) -> dict[str, Any] | None:
        return SimFleet.counters(self)

    async def after_replay(self, before: dict[str, Any] | None) -> dict[str, Any]:
        engines = await SimFleet.after_replay(self, before)
        flexlb = await self.event_log_facts(None)
        keep = ("terminal_events", "failure_messages", "requests_per_worker", "events")
        return engines | {"flexlb_" + k: flexlb[k] for k in keep}


def _strip_ansi(s: str) -> str:
    import re

    return re.sub(r"\x1b\[[0-9;]*m", "", s)


def make_fleet(config: Config, args: argparse.Namespace, workdir: Path, tag: str) -> Fleet:
    fleets = {"flexlb": FlexlbFleet, "flexlb-openai": AdapterFleet}
    return fleets.get(config.kind, SimFleet)(config, args, workdir, tag)


# --------------------------------------------------------------------------- one run
def warm_up(fleet: Fleet, args: argparse.Namespace, deadline: float) -> int:
    """Tiny requests through every URL until `--warmup` succeed on each (or the deadline)."""
    if args.warmup <= 0:
        return 0
    enc = msgspec.json.Encoder()
    sent = 0

    async def go() -> None:
        nonlocal sent
        for u, (host, port) in enumerate(fleet.urls):
            ok = 0
            while ok < args.warmup:
                rid = f"{WARMUP_PREFIX}{u}-{sent}"
                body = enc.encode({"model": args.model_name, "prompt": WARMUP_PROMPT, "max_tokens": 2, "stream": True,
                                   "request_id": rid})
                rec = Rec(-1, u)
                sent += 1
                try:
                    await asyncio.wait_for(stream_one(host, port, body, rid, rec), 30)
                except asyncio.TimeoutError:
                    rec.error = "client_timeout"
                if rec.done and rec.error is None:
                    ok += 1
                elif time.monotonic() > deadline:
                    raise RuntimeError(f"warm-up through {host}:{port} keeps failing: {rec.error}")
                else:
                    await asyncio.sleep(0.2)

    asyncio.run(go())
    return sent


def make_plans(n: int, send_at_s: list[float], fleet: Fleet, procs: int) -> list[Plan]:
    plans = [Plan([], [], []) for _ in range(procs)]
    for i in range(n):
        p = plans[i % procs]
        p.indices.append(i)
        p.send_at_s.append(send_at_s[i])
        p.targets.append(fleet.target_of(i))
    return [p for p in plans if p.indices]


def run_clients(plans: list[Plan], cap_s: float, args: argparse.Namespace, n: int,
                pids: dict[str, int]) -> tuple[list[Rec], dict[str, Any], dict[str, Any]]:
    """Replay in this process (one plan) or in forked client processes; CPU sampled meanwhile."""
    start_wall = time.time() + 0.5
    if len(plans) == 1:
        sampler = bt.CpuSampler(pids, args.cpu_interval_s)
        sampler.start()
        try:
            recs, info = asyncio.run(replay(plans[0], start_wall, cap_s, args.request_timeout_s))
        finally:
            cpu = sampler.stop()
        infos = [info]
    else:
        ctx = multiprocessing.get_context("fork")
        children = []
        start_wall = time.time() + 1.0
        for k, plan in enumerate(plans):
            parent, child = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_client_main, args=(child, plan, start_wall, cap_s, args.request_timeout_s),
                               daemon=True)
            proc.start()
            child.close()
            children.append((proc, parent))
        sampler = bt.CpuSampler({**pids, **{f"client-{k}": p.pid for k, (p, _) in enumerate(children)}},
                                args.cpu_interval_s)
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


def is_attained(rec: Rec, max_tokens: int, args: argparse.Namespace) -> bool:
    if not is_ok(rec, max_tokens):
        return False
    inv = 1.0 / args.time_scale
    if rec.ttft_s * inv * 1000.0 > args.slo_ttft_ms:
        return False
    if max_tokens > 1 and tpot_ms(rec, args) > args.slo_tpot_ms:
        return False
    return True


def is_ok(rec: Rec, max_tokens: int) -> bool:
    return rec.done and rec.error is None and rec.tokens == max_tokens and rec.ttft_s is not None


def tpot_ms(rec: Rec, args: argparse.Namespace) -> float:
    return (rec.e2e_s - rec.ttft_s) / args.time_scale * 1000.0 / (rec.tokens - 1)


def summarize_run(recs: list[Rec], rows: list[Row], args: argparse.Namespace, span_s: float) -> dict[str, Any]:
    inv_ms = 1000.0 / args.time_scale
    ok = [(r, rows[r.index]) for r in recs if is_ok(r, rows[r.index].max_tokens)]
    ttft = [r.ttft_s * inv_ms for r, _ in ok]
    tpot = [tpot_ms(r, args) for r, row in ok if row.max_tokens > 1]
    e2e = [r.e2e_s * inv_ms for r, _ in ok]
    attained = sum(1 for r in recs if is_attained(r, rows[r.index].max_tokens, args))
    errors = Counter()
    samples: dict[str, list[str]] = {}
    for r in recs:
        if not is_ok(r, rows[r.index].max_tokens):
            code = r.error or ("client_short_stream" if r.done else "client_unknown")
            errors[code] += 1
            if r.error_message and len(samples.setdefault(code, [])) < 3:
                samples[code].append(r.error_message)
    late = [max(0.0, r.late_s) * 1000.0 for r in recs if r.late_s is not None]
    n = len(recs)
    return {
        "requests": n,
        "completed": len(ok),
        "attained": attained,
        "attainment": round(attained / n, 4) if n else None,
        "goodput_req_per_s": round(attained / span_s, 4) if span_s > 0 else None,
        "ttft_within_slo_of_all": round(sum(1 for x in ttft if x <= args.slo_ttft_ms) / n, 4) if n else None,
        "tpot_within_slo_of_multi_token": round(sum(1 for x in tpot if x <= args.slo_tpot_ms) / len(tpot), 4)
        if tpot else None,
        "ttft_ms": bt.summarize(ttft),
        "tpot_ms": bt.summarize(tpot, 2),
        "e2e_ms": bt.summarize(e2e),
        "errors": dict(errors.most_common()),
        "error_samples": samples,  # up to 3 messages per code
        "send_lateness_wall_ms": bt.summarize(late, 2),
    }


def one_run(config: Config, label: str, multiplier: float, rows: list[Row], args: argparse.Namespace,
            workdir: Path, seq: int) -> dict[str, Any]:
    span_recorded_s = rows[-1].ts_ms / 1000.0
    span_s = span_recorded_s / multiplier  # engine seconds
    send_at = [r.ts_ms / 1000.0 / multiplier * args.time_scale for r in rows]
    cap_s = args.run_cap_s if args.run_cap_s else send_at[-1] + args.drain_s
    tag = f"{seq:03d}-{label}"
    fleet = make_fleet(config, args, workdir, tag)
    run: dict[str, Any] = {"config": label, "kind": config.kind, "multiplier": multiplier,
                           "load_req_per_s": round(len(rows) / span_s, 4) if span_s > 0 else None,
                           "span_s": round(span_s, 3), "cap_wall_s": round(cap_s, 1)}
    t_start = time.monotonic()
    print(f"[{label} ×{multiplier:g}] starting a fresh fleet ({run['load_req_per_s']} req/s, span {span_s:.1f} s)",
          file=sys.stderr, flush=True)
    ok = True
    try:
        fleet.start()
        run["startup_s"] = round(time.monotonic() - t_start, 2)
        run["warmup_requests"] = warm_up(fleet, args, time.monotonic() + args.startup_timeout_s)
        before = fleet.counters()
        _URLS[:] = fleet.urls
        plans = make_plans(len(rows), send_at, fleet, args.client_procs)
        recs, client, cpu = run_clients(plans, cap_s, args, len(rows), fleet.pids())
        time.sleep(0.5)  # let the last counters and events land
        run["engines"] = asyncio.run(fleet.after_replay(before))
        run.update(summarize_run(recs, rows, args, span_s))
        run["client"] = client
        run["cpu"] = cpu
        run["_recs"] = recs  # in memory: CDFs and --per-request
        c = run
        print(f"[{label} ×{multiplier:g}] attainment {c['attainment']:.3f} goodput {c['goodput_req_per_s']} req/s; "
              f"TTFT p50/p90 {c['ttft_ms']['p50']}/{c['ttft_ms']['p90']} ms; TPOT p50 {c['tpot_ms']['p50']} ms; "
              f"hit {run['engines'].get('prefix_hit_rate')}; errors {c['errors'] or 0}; "
              f"CPU machine {cpu['machine_busy_cores']['mean']} cores (others {cpu['foreign_cores']['mean']}), "
              f"client {client['cores']}, send lateness p99 {c['send_lateness_wall_ms']['p99']} ms",
              file=sys.stderr, flush=True)
        late_p99 = c["send_lateness_wall_ms"]["p99"] or 0.0
        if (client["cores"] or 0.0) > 0.7 * client["processes"] or late_p99 > 50.0:
            run["client_bottleneck"] = (f"the client may have been a bottleneck: {client['cores']} cores over "
                                        f"{client['processes']} process(es), send lateness p99 {late_p99} ms; "
                                        f"try --client-procs")
    except Exception as exc:  # one run's failure is reported; the sweep goes on
        ok = False
        run["error"] = f"{exc.__class__.__name__}: {exc}"
        print(f"[{label} ×{multiplier:g}] failed: {run['error']}", file=sys.stderr, flush=True)
        run["log_tails"] = {p.name: p.log_tail(15) for p in fleet.procs}
    finally:
        run["commands"] = fleet.commands()
        codes = fleet.stop()
        run["exit_codes"] = codes
        # 0, or death by the SIGTERM we sent (uvicorn re-raises it after a graceful shutdown).
        bad = {k: v for k, v in codes.items() if v not in (0, -signal.SIGTERM, 128 + signal.SIGTERM)}
        if bad:
            run["stop_note"] = (f"exit status after SIGTERM not 0 or SIGTERM: {bad} (None: killed after "
                                f"{args.stop_timeout_s}s)")
            print(f"[{label} ×{multiplier:g}] {run['stop_note']}", file=sys.stderr, flush=True)
        run["wall_s"] = round(time.monotonic() - t_start, 1)
    run["harness_ok"] = ok
    return run


# --------------------------------------------------------------------------- loads
def headline(runs: list[dict[str, Any]], target: float) -> dict[str, Any]:
    """Highest load with attainment ≥ target: linear between the highest passing load and the
    lowest failing load above it."""
    pts = sorted((r["load_req_per_s"], r["attainment"], r["multiplier"]) for r in runs
                 if r.get("attainment") is not None and r.get("load_req_per_s"))
    if not pts:
        return {"value": None, "bound": "none", "note": "no successful run"}
    passing = [p for p in pts if p[1] >= target]
    if not passing:
        lo = pts[0]
        return {"value": None, "bound": "below", "below_req_per_s": lo[0],
                "note": f"< {lo[0]:.3g} req/s: even the lowest load (×{lo[2]:g}) missed"}
    p = passing[-1]
    above = [q for q in pts if q[0] > p[0] and q[1] < target]
    non_monotonic = [q for q in pts if q[0] < p[0] and q[1] < target]
    out: dict[str, Any] = {"pass": {"load": p[0], "attainment": p[1], "multiplier": p[2]}}
    if non_monotonic:
        out["note_non_monotonic"] = f"{len(non_monotonic)} failing point(s) below the highest pass"
    if not above:
        out.update(value=p[0], multiplier=p[2], bound="at_least", note=f"≥ {p[0]:.3g} req/s: nothing higher failed")
        return out
    f = above[0]
    frac = (p[1] - target) / (p[1] - f[1]) if p[1] > f[1] else 0.0
    out.update(value=p[0] + frac * (f[0] - p[0]), multiplier=p[2] + frac * (f[2] - p[2]), bound="interpolated",
               fail={"load": f[0], "attainment": f[1], "multiplier": f[2]})
    return out


def search_runs(run_at: Callable[[float], dict[str, Any]], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Up by --search-factor while passing (down while failing), then bisect the bracket."""
    runs: list[dict[str, Any]] = []
    m = args.search_start
    lo = hi = None  # multipliers of the highest pass / lowest fail seen

    def attempt(mult: float) -> float | None:
        r = run_at(mult)
        runs.append(r)
        return r.get("attainment")

    while len(runs) < args.max_runs:
        att = attempt(m)
        if att is None:
            break  # the harness failed: searching on is pointless
        if att >= args.target:
            lo = m if lo is None else max(lo, m)
            if hi is not None:
                break
            m *= args.search_factor
            if m > args.search_max:
                break
        else:
            hi = m if hi is None else min(hi, m)
            if lo is not None:
                break
            m /= args.search_factor
            if m < args.search_min:
                break
    for _ in range(args.bisect):
        if lo is None or hi is None or len(runs) >= args.max_runs:
            break
        mid = (lo + hi) / 2
        att = attempt(mid)
        if att is None:
            break
        if att >= args.target:
            lo = mid
        else:
            hi = mid
    return runs


# --------------------------------------------------------------------------- report
fmt = bt.fmt  # "-" for None, thousands separators for floats


def headline_text(h: dict[str, Any]) -> str:
    if h.get("bound") == "interpolated":
        return f"{h['value']:.3g}"
    if h.get("bound") == "at_least":
        return f"≥{h['value']:.3g}"
    if h.get("bound") == "below":
        return f"<{h['below_req_per_s']:.3g}"
    return "-"


def summary_table(result: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    bound = result["capacity"]["rate_req_per_s"]
    heads = result["headline"]
    peers = [h["value"] for name, h in heads.items() if h.get("kind") in ("sglang", "vllm") and h.get("value")]
    best_peer = max(peers) if peers else None
    direct = heads.get("direct-round-robin", {}).get("value")
    cols = ["config", "highest load ≥90% (req/s)", "×trace rate", "of capacity", "vs best peer", "vs direct-rr", "runs"]
    rows = []
    for name, h in heads.items():
        v = h.get("value")
        rows.append([name, headline_text(h), fmt(h.get("multiplier"), 2),
                     f"{v / bound:.1%}" if v and bound else "-",
                     f"{v / best_peer:.2f}" if v and best_peer else "-",
                     f"{v / direct:.2f}" if v and direct else "-", str(h.get("runs", 0))])
    return cols, rows


def runs_table(result: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    cols = ["config", "×rate", "req/s", "attain", "goodput", "TTFT p50", "p90", "p99", "TPOT p50", "p90",
            "hit rate", "per worker", "errors", "client cores", "machine cores (sat.)", "others' cores", "wall s"]
    rows = []
    for r in result["runs"]:
        if "attainment" not in r:
            rows.append([r["config"], fmt(r["multiplier"], 3), fmt(r.get("load_req_per_s"), 2), "FAILED", *["-"] * 12,
                         fmt(r.get("wall_s"), 0)])
            continue
        e = r.get("engines", {})
        per_worker = " ".join(str(v) for v in (e.get("requests_per_worker") or {}).values())
        errors = ", ".join(f"{k} {v}" for k, v in list(r["errors"].items())[:3]) or "-"
        cpu = r["cpu"]
        rows.append([r["config"], fmt(r["multiplier"], 3), fmt(r["load_req_per_s"], 2), f"{r['attainment']:.3f}",
                     fmt(r["goodput_req_per_s"], 2), fmt(r["ttft_ms"]["p50"]), fmt(r["ttft_ms"]["p90"]),
                     fmt(r["ttft_ms"]["p99"]), fmt(r["tpot_ms"]["p50"], 1), fmt(r["tpot_ms"]["p90"], 1),
                     fmt(e.get("prefix_hit_rate"), 3), per_worker or "-", errors, fmt(r["client"]["cores"], 2),
                     f"{fmt(cpu['machine_busy_cores']['mean'], 2)} ({fmt(cpu['saturated_fraction'], 2)})",
                     fmt(cpu["foreign_cores"]["mean"], 2), fmt(r["wall_s"], 0)])
    return cols, rows


def render(cols: list[str], rows: list[list[str]], markdown: bool = False) -> str:
    if markdown:
        lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" if i == 0 else "---:" for i in range(len(cols))) + "|"]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])
    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(cols)]
    out = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cols, widths)))]
    out += ["  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(r, widths))) for r in rows]
    return "\n".join(out)


def print_report(result: dict[str, Any], markdown: bool) -> None:
    w, cap, f = result["workload"], result["capacity"], result["flags"]
    print(f"\n{result['trace']}: {w['rows']} rows from row {w['first_row']} ({w['recorded_rate_req_per_s']} req/s "
          f"recorded; {w['prompts_cut']} prompts cut to {f['max_prompt_tokens']} tokens), {f['workers']} engines, "
          f"time scale {f['time_scale']:g}, SLO TTFT {f['slo_ttft_ms']:g} ms / TPOT {f['slo_tpot_ms']:g} ms, "
          f"target {f['target']:.0%} (reachable alone on an idle engine: "
          f"{w['zero_load_slo_fraction_infinite_cache']:.1%}); capacity bound {cap['rate_req_per_s']:.3g} req/s "
          f"(×{cap['multiplier']:.3g} the recorded rate; reuse {cap['reuse']:.3f}, decode batch "
          f"{cap['decode_batch_size']} by {cap['decode_batch_limited_by']}); times in engine ms; "
          f"{result['machine']['cores']} cores shared by the client and every process")
    print(render(*runs_table(result), markdown=markdown))
    print()
    print(render(*summary_table(result), markdown=markdown))
    for note in result["notes_run"]:
        print(f"note: {note}")


def plot(result: dict[str, Any], prefix: str, cdf_sets: dict[str, dict[str, list[float]]],
         cdf_rate: float | None) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for name in dict.fromkeys(r["config"] for r in result["runs"]):
        pts = sorted((r["load_req_per_s"], r["attainment"]) for r in result["runs"]
                     if r["config"] == name and r.get("attainment") is not None)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    ax.axhline(result["flags"]["target"], color="grey", linestyle=":", linewidth=1)
    bound = result["capacity"]["rate_req_per_s"]
    xmax = max([r["load_req_per_s"] for r in result["runs"] if r.get("load_req_per_s")] or [1.0])
    if bound <= 2 * xmax:
        ax.axvline(bound, color="black", linestyle="--", linewidth=1, label=f"capacity bound {bound:.3g} req/s")
    else:
        ax.text(0.99, 0.02, f"capacity bound {bound:.3g} req/s (off the chart)", transform=ax.transAxes, ha="right",
                fontsize=8)
    ax.set_xlabel("load (req/s)")
    ax.set_ylabel(f"SLO attainment (TTFT ≤ {result['flags']['slo_ttft_ms']:g} ms, TPOT ≤ "
                  f"{result['flags']['slo_tpot_ms']:g} ms)")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(f"{result['trace']}: {result['workload']['rows']} rows, {result['flags']['workers']} engines")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = f"{prefix}_attainment.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    written.append(path)
    if cdf_sets:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 5))
        for name, s in cdf_sets.items():
            for ax, key in ((a1, "ttft"), (a2, "tpot")):
                v = sorted(s[key])
                if v:
                    ax.plot(v, [(i + 1) / len(v) for i in range(len(v))], label=name)
        a1.set_xscale("log")
        a1.axvline(result["flags"]["slo_ttft_ms"], color="grey", linestyle=":")
        a2.axvline(result["flags"]["slo_tpot_ms"], color="grey", linestyle=":")
        a1.set_xlabel("TTFT (ms)")
        a2.set_xlabel("mean TPOT per request (ms)")
        for ax in (a1, a2):
            ax.set_ylabel("fraction of completed requests")
            ax.legend(fontsize=8)
        fig.suptitle(f"{result['trace']} at ×{cdf_rate:.3g} the recorded rate")
        fig.tight_layout()
        path = f"{prefix}_cdf.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written


def versions() -> dict[str, str | None]:
    from importlib import metadata

    out = {}
    for pkg in ("flexlb", "sglang-router", "vllm-router", "msgspec", "matplotlib"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def engine_defaults(args: argparse.Namespace) -> tuple[EngineLimits, dict[str, Any], list[str]]:
    """The engine limits every engine runs with: our flags, else WorkerConfig's defaults."""
    notes = []
    defaults: dict[str, Any] = {"max_num_batched_tokens": 8192, "max_num_seqs": 256, "num_kv_blocks": 16384,
                                "block_size_tokens": 16, "max_seq_len_tokens": 40960}
    try:
        import msgspec.structs

        from workers.agent import WorkerConfig

        for f in msgspec.structs.fields(WorkerConfig):
            if f.name in defaults and f.default is not msgspec.NODEFAULT:
                defaults[f.name] = f.default
    except Exception as exc:  # noqa: BLE001 - the report says which defaults were assumed
        notes.append(f"could not read WorkerConfig defaults ({exc}); assumed {defaults}")
    for k in list(defaults):
        if getattr(args, k, None) is not None:
            defaults[k] = getattr(args, k)
    limits = EngineLimits(max_num_batched_tokens=defaults["max_num_batched_tokens"], max_num_seqs=defaults["max_num_seqs"],
                          num_kv_blocks=defaults["num_kv_blocks"], block_size_tokens=defaults["block_size_tokens"])
    return limits, defaults, notes


# --------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", default="mooncake", help="mooncake | azure-conv | azure-code | a path (default mooncake)")
    p.add_argument("--rows", type=int, default=200, help="rows to replay (default 200)")
    p.add_argument("--start-row", type=int, default=0)
    p.add_argument("--workers", type=int, default=4, help="engines per fleet, K (default 4)")
    p.add_argument("--time-scale", type=float, default=1.0, help="engine time multiplier (default 1: wall = engine)")
    p.add_argument("--configs", default=",".join(builtin_configs()), help="comma-separated (default: all)")
    p.add_argument("--flexlb-args", default="", help="appended to every `flexlb up` command line")
    p.add_argument("--name", help="label of the FlexLB configuration(s) run with --flexlb-args")
    p.add_argument("--peer-args", default="", help="appended to every peer router's command line")
    loads = p.add_mutually_exclusive_group()
    loads.add_argument("--rates", help="rate multipliers, comma-separated (default 1)")
    loads.add_argument("--search", action="store_true", help="per configuration, search the highest passing load")
    p.add_argument("--search-start", type=float, default=1.0, help="first multiplier of --search (default 1)")
    p.add_argument("--search-factor", type=float, default=1.5, help="step of --search up or down (default 1.5)")
    p.add_argument("--bisect", type=int, default=2, help="bisections after the bracket (default 2)")
    p.add_argument("--max-runs", type=int, default=7, help="most runs per configuration in --search (default 7)")
    p.add_argument("--search-min", type=float, default=0.01, help="lowest multiplier --search tries (default 0.01)")
    p.add_argument("--search-max", type=float,
                   help="highest multiplier --search tries (default: 1.5 × the capacity bound's; a pass above the "
                        "bound only says the slice is too short)")
    p.add_argument("--target", type=float, default=0.9, help="attainment a load must reach (default 0.9)")
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=100.0)
    p.add_argument("--max-prompt-tokens", type=int, default=32000, help="longer prompts are cut (default 32000)")
    p.add_argument("--model-name", default="flexlb-sim", help="the body's model field (SGLang's router needs one)")
    eng = p.add_argument_group("engine flags (every engine of every configuration; default: the engine's own)")
    for name in ("num_kv_blocks", "block_size_tokens", "max_seq_len_tokens", "max_num_batched_tokens", "max_num_seqs"):
        eng.add_argument(f"--{name.replace('_', '-')}", type=int)
    eng.add_argument("--no-chunked-prefill", action="store_true")
    eng.add_argument("--profile", help="timing profile JSON (also used by the capacity bound)")
    p.add_argument("--sim-server-cmd", help="command starting one engine server (default: `flexlb sim-server`)")
    p.add_argument("--client-procs", type=int, default=1, help="client processes (default 1)")
    p.add_argument("--request-timeout-s", type=float, default=120.0, help="client timeout per request (wall s)")
    p.add_argument("--run-cap-s", type=float, help="wall cap of one replay (default: arrival span + --drain-s)")
    p.add_argument("--drain-s", type=float, default=60.0, help="wall s allowed after the last send (default 60)")
    p.add_argument("--startup-timeout-s", type=float, default=120.0)
    p.add_argument("--stop-timeout-s", type=float, default=20.0)
    p.add_argument("--warmup", type=int, default=2, help="tiny requests per router URL before the replay (default 2)")
    p.add_argument("--cpu-interval-s", type=float, default=1.0)
    p.add_argument("--per-request", action="store_true", help="write every request's record to the JSON")
    p.add_argument("--plot", metavar="PREFIX", help="write PREFIX_attainment.png and PREFIX_cdf.png")
    p.add_argument("--cdf-rate", type=float, help="multiplier of the CDF plot (default: the highest one every "
                                                  "configuration ran; runs it when missing)")
    p.add_argument("--markdown", action="store_true", help="print the tables as markdown")
    p.add_argument("--keep-logs", action="store_true", help="keep the processes' logs (their folder is printed)")
    p.add_argument("--out", help="JSON report (default bench/results/peers_<trace>.json)")
    args = p.parse_args(argv)
    known = builtin_configs()
    names = [x.strip() for x in args.configs.split(",") if x.strip()]
    for n in names:
        base, at, suffix = n.partition("@")
        if at and base in known:
            try:
                known[n] = with_pd(known[base], suffix, args.workers)
            except ValueError as exc:
                p.error(str(exc))
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        p.error(f"unknown configuration(s) {unknown}; known: {', '.join(known)}")
    args.flexlb_args_list = shlex.split(args.flexlb_args)
    args.peer_args_list = shlex.split(args.peer_args)
    if args.name and not args.flexlb_args_list:
        p.error("--name labels a --flexlb-args variant; give --flexlb-args too")
    flexlb_selected = [n for n in names if known[n].kind.startswith("flexlb")]
    if args.flexlb_args_list and not flexlb_selected:
        p.error("--flexlb-args given but no FlexLB configuration selected")
    label = {}
    for n in names:
        if known[n].kind.startswith("flexlb") and args.flexlb_args_list:
            custom = args.name or "custom"
            label[n] = custom if len(flexlb_selected) == 1 else f"{n}+{custom}"
        else:
            label[n] = n
    args.selected = [(known[n], label[n]) for n in names]
    try:
        args.rate_list = [float(x) for x in (args.rates or "1").split(",") if x.strip()]
    except ValueError:
        p.error("--rates takes numbers")
    if any(r <= 0 for r in args.rate_list) or args.search_start <= 0 or args.search_factor <= 1:
        p.error("rates and --search-start must be > 0, --search-factor > 1")
    if args.rows < 2 or args.workers < 1 or args.start_row < 0 or args.client_procs < 1:
        p.error("--rows >= 2, --workers >= 1, --start-row >= 0, --client-procs >= 1")
    if args.time_scale <= 0:
        p.error("--time-scale must be > 0")
    return args


def sim_server_check(args: argparse.Namespace) -> str | None:
    """None when the engine server command answers --help (and whether it takes --host)."""
    base = shlex.split(args.sim_server_cmd) if args.sim_server_cmd else [*flexlb_exe(), "sim-server"]
    try:
        res = subprocess.run([*base, "--help"], cwd=REPO, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{shlex.join(base)} --help failed: {exc}"
    if res.returncode != 0:
        return f"{shlex.join(base)} --help exited {res.returncode}: {(res.stderr or res.stdout).strip()[-300:]}"
    args.sim_server_has_host = "--host" in res.stdout
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.sim_server_has_host = False

    def on_term(signum, frame):  # SIGTERM: unwind through every finally (fleets get stopped)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    trace_name, trace_path = resolve_trace(args.trace)
    rows = load_rows(trace_path, args.start_row, args.rows, args.max_prompt_tokens)
    if len(rows) < 2 or rows[-1].ts_ms <= 0:
        print(f"need at least 2 rows with distinct timestamps from {trace_path} row {args.start_row}", file=sys.stderr)
        return 1
    span_recorded_s = rows[-1].ts_ms / 1000.0
    t_build = time.monotonic()
    bodies = build_bodies(rows, args)
    _BODIES[:] = bodies
    _REQUEST_IDS[:] = [f"row-{r.row:05d}" for r in rows]
    facts = workload_facts(rows, span_recorded_s)
    print(f"{trace_name}: {len(rows)} rows, {facts['recorded_rate_req_per_s']} req/s recorded; bodies "
          f"{sum(map(len, bodies)) / 1e6:.1f} MB built in {time.monotonic() - t_build:.1f} s; "
          f"{facts['prompts_cut']} prompts cut to {args.max_prompt_tokens} tokens "
          f"({facts['prompt_tokens_cut']} tokens dropped)", file=sys.stderr, flush=True)

    limits, engine_cfg, notes = engine_defaults(args)
    costs = StepCosts.from_file(args.profile or DEFAULT_PROFILE)
    wreqs = [WorkloadRequest(r.input_length, r.max_tokens, tuple(r.hash_ids) if r.hash_ids else None) for r in rows]
    cap = capacity_bound(wreqs, costs, limits, args.workers, recorded_span_s=span_recorded_s,
                         prefix_block_tokens=HASH_BLOCK_TOKENS)
    # Who could meet the SLO alone on an idle engine: a ceiling on attainment at any load.
    for with_cache in (True, False):
        facts[f"zero_load_slo_fraction_{'infinite_cache' if with_cache else 'cold'}"] = round(zero_load_slo_fraction(
            wreqs, costs, limits, args.slo_ttft_ms, args.slo_tpot_ms, with_cache, HASH_BLOCK_TOKENS), 4)
    feasible = facts["zero_load_slo_fraction_infinite_cache"]
    if args.search_max is None:
        args.search_max = 1.5 * cap.multiplier
    # Steady state: near the bound, the slice should last many request lifetimes, else it is a
    # burst that drains after the last arrival and passes loads no fleet sustains.
    e2e0 = [t + (r.max_tokens - 1) * (p or 0.0) for r, (t, p) in
            ((r, zero_load_latency_ms(r, 0, costs, limits)) for r in wreqs)]
    mean_e2e0_s = sum(e2e0) / len(e2e0) / 1000.0
    facts["mean_zero_load_e2e_s"] = round(mean_e2e0_s, 3)
    facts["span_at_bound_s"] = round(len(rows) / cap.rate_req_per_s, 2)
    if facts["span_at_bound_s"] < 10 * mean_e2e0_s:
        want = math.ceil(10 * mean_e2e0_s * cap.rate_req_per_s)
        notes.append(f"at the capacity bound these {len(rows)} rows arrive in {facts['span_at_bound_s']} s, under 10 "
                     f"request lifetimes ({mean_e2e0_s:.2f} s each alone): near the bound a run is a burst, not a "
                     f"sustained load, and passes too easily; about {want} rows would reach steady state")
        print(f"warning: {notes[-1]}", file=sys.stderr, flush=True)
    print(f"capacity bound: {cap.rate_req_per_s:.3g} req/s (×{cap.multiplier:.3g} the recorded rate); "
          f"{feasible:.1%} of the requests could meet the SLO alone on an idle engine", file=sys.stderr, flush=True)
    if feasible < args.target:
        notes.append(f"only {feasible:.1%} of these requests could meet TTFT ≤ {args.slo_ttft_ms:g} ms and TPOT ≤ "
                     f"{args.slo_tpot_ms:g} ms even alone on an idle engine with every shared prefix cached "
                     f"(long prompts: prefill alone takes longer): no configuration can reach {args.target:.0%} at "
                     f"any load; loosen --slo-ttft-ms or lower --target")
        print(f"warning: {notes[-1]}", file=sys.stderr, flush=True)

    need_sim = any(c.kind != "flexlb" for c, _ in args.selected)
    if need_sim:
        problem = sim_server_check(args)
        if problem:
            skipped = [lbl for c, lbl in args.selected if c.kind != "flexlb"]
            notes.append(f"skipped {', '.join(skipped)}: {problem}")
            print(f"note: {notes[-1]}", file=sys.stderr, flush=True)
            args.selected = [(c, lbl) for c, lbl in args.selected if c.kind == "flexlb"]
            if not args.selected:
                return 1
    if any(r.input_length < r.recorded_input_length for r in rows):
        notes.append(f"{facts['prompts_cut']} prompts longer than {args.max_prompt_tokens} tokens were cut to it "
                     f"({facts['prompt_tokens_cut']} tokens dropped); the capacity bound uses the cut prompts")
    if args.time_scale != 1:
        notes.append(f"time scale {args.time_scale:g}: times are engine ms (wall / {args.time_scale:g}), so router "
                     f"overheads (wall time) are magnified by {1 / args.time_scale:g}")

    workdir = Path(tempfile.mkdtemp(prefix="flexlb-peers-"))
    out = Path(args.out) if args.out else REPO / "bench" / "results" / f"peers_{trace_name}.json"
    result: dict[str, Any] = {
        "benchmark": "bench/peers.py: FlexLB vs peer routers on simulated engines",
        "command": shlex.join([sys.executable, *sys.argv]),
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": bt.machine_facts() | {"versions": versions()},
        "trace": trace_name,
        "trace_path": str(trace_path),
        "flags": {k: v for k, v in vars(args).items() if k not in ("selected",) and not callable(v)}
        | {"configs_run": [lbl for _, lbl in args.selected]},
        "engine": engine_cfg | {"chunked_prefill": not args.no_chunked_prefill,
                                "profile": str(args.profile or DEFAULT_PROFILE), "flags_passed": engine_flags(args)},
        "workload": facts,
        "capacity": cap.as_dict() | {"formula": "bench/capacity.py module docstring", "upper_bound": True},
        "notes_run": notes,
        "runs": [],
        "headline": {},
    }
    seq = 0
    failed = False
    cdf_sets: dict[str, dict[str, list[float]]] = {}
    t0 = time.monotonic()
    cdf_rate = args.cdf_rate
    try:
        for config, label in args.selected:
            def run_at(mult: float, config=config, label=label) -> dict[str, Any]:
                nonlocal seq, failed
                seq += 1
                r = one_run(config, label, mult, rows, args, workdir, seq)
                failed |= not r["harness_ok"] or bool(r.get("stop_note"))
                result["runs"].append(r)
                return r

            runs = search_runs(run_at, args) if args.search else [run_at(m) for m in args.rate_list]
            for r in runs:
                if r.get("client_bottleneck"):
                    notes.append(f"{label} ×{r['multiplier']:g}: {r['client_bottleneck']}")
                if (r.get("cpu") or {}).get("saturated_fraction", 0) and r["cpu"]["saturated_fraction"] > 0.25:
                    notes.append(f"{label} ×{r['multiplier']:g}: the machine was ≥90 % busy in "
                                 f"{r['cpu']['saturated_fraction']:.0%} of the samples (others' processes "
                                 f"{r['cpu']['foreign_cores']['mean']} cores): engine sleeps and routers ran late")
            h = headline(runs, args.target)
            if h.get("value") and h["value"] > cap.rate_req_per_s:
                h["note_above_bound"] = ("above the capacity bound: the slice is too short for queues to build "
                                         "(a burst, not a sustained load); replay more rows")
                notes.append(f"{label}: {h['value']:.3g} req/s is {h['note_above_bound']}")
            h["kind"] = config.kind
            h["runs"] = len(runs)
            result["headline"][label] = h
            write_json(result, out)  # after every configuration: a partial report survives a crash
        if args.plot:
            if cdf_rate is None:
                common = set.intersection(*[{r["multiplier"] for r in result["runs"] if r["config"] == lbl
                                             and "attainment" in r} for _, lbl in args.selected] or [set()])
                cdf_rate = max(common) if common else None
            if cdf_rate is not None:
                for config, label in args.selected:
                    run = next((r for r in result["runs"] if r["config"] == label and "_recs" in r
                                and abs(r["multiplier"] - cdf_rate) < 1e-9), None)
                    if run is None:
                        seq += 1
                        run = one_run(config, label, cdf_rate, rows, args, workdir, seq)
                        run["purpose"] = "cdf"
                        result["runs"].append(run)
                    if "_recs" in run:
                        recs = [r for r in run["_recs"] if is_ok(r, rows[r.index].max_tokens)]
                        cdf_sets[label] = {
                            "ttft": [r.ttft_s * 1000.0 / args.time_scale for r in recs],
                            "tpot": [tpot_ms(r, args) for r in recs if rows[r.index].max_tokens > 1]}
    except KeyboardInterrupt:
        failed = True
        result["interrupted"] = True
        print("interrupted: stopping every process", file=sys.stderr)
        for config, label in args.selected:  # what ran of the configuration cut short still counts
            runs = [r for r in result["runs"] if r["config"] == label]
            if runs and label not in result["headline"]:
                result["headline"][label] = headline(runs, args.target) | {"kind": config.kind, "runs": len(runs),
                                                                            "note_interrupted": True}
    finally:
        stop_all(args.stop_timeout_s)
    result["total_wall_s"] = round(time.monotonic() - t0, 1)
    result["machine"]["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    if args.plot and result["runs"]:
        try:
            result["plots"] = plot(result, args.plot, cdf_sets, cdf_rate)
        except Exception as exc:  # noqa: BLE001 - the numbers matter more than the pictures
            notes.append(f"plotting failed: {exc.__class__.__name__}: {exc}")
    write_json(result, out, args.per_request, rows, args)
    if result["headline"]:
        print_report(result, args.markdown)
    plots = f" and {', '.join(result['plots'])}" if result.get("plots") else ""
    print(f"wrote {out} ({result['total_wall_s']} s){plots}")
    if args.keep_logs or failed:
        print(f"process logs: {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    return 1 if failed else 0


PER_REQUEST_COLUMNS = ["row", "target", "input_tokens", "max_tokens", "send_at_trace_ms", "late_wall_ms", "status",
                       "error", "ttft_ms", "e2e_ms", "tokens", "attained"]


def write_json(result: dict[str, Any], out: Path, per_request: bool = False, rows: list[Row] | None = None,
               args: argparse.Namespace | None = None) -> None:
    runs = []
    for r in result["runs"]:
        recs = r.get("_recs")
        r = {k: v for k, v in r.items() if k != "_recs"}
        if per_request and recs is not None and rows is not None:
            inv = 1000.0 / args.time_scale
            r["per_request_columns"] = PER_REQUEST_COLUMNS
            r["per_request"] = [
                [rows[x.index].row, x.target, rows[x.index].input_length, rows[x.index].max_tokens, rows[x.index].ts_ms,
                 round(x.late_s * 1000, 2) if x.late_s is not None else None, x.status, x.error,
                 round(x.ttft_s * inv, 1) if x.ttft_s is not None else None,
                 round(x.e2e_s * inv, 1) if x.e2e_s is not None else None, x.tokens,
                 is_attained(x, rows[x.index].max_tokens, args)] for x in recs]
        runs.append(r)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(bt.dump_json({**result, "runs": runs}) + "\n")
    os.replace(tmp, out)


if __name__ == "__main__":
    try:
        sys.exit(main())
    finally:
        stop_all()
