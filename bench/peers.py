"""Side by side with the routers people run: FlexLB, SGLang's router, vLLM's router and no
router at all, each in front of a fresh fleet of simulated engines, under an open-loop
streaming replay of a public trace; SLO attainment against load, and per configuration the
highest load it sustains with at least 90 % of requests within their SLO.

    python bench/peers.py --trace azure-conv --rows 60 --configs flexlb,direct-round-robin --rates 2
    python bench/peers.py --trace mooncake --rows 300 --search --search-start 0.5 --plot bench/results/peers_mooncake
    python bench/peers.py --trace azure-code --configs flexlb,sglang-cache_aware,vllm-cache_aware --rates 0.5,1,2
    python bench/peers.py --configs flexlb --flexlb-args "--slo-mode reject" --name flexlb-reject --rates 1,2
    python bench/peers.py --trace chat --quick --engine-modes vllm,sglang          # the matrix, a first look

The matrix (issue 24): every configuration on every engine mode, on each workload, with
run-to-run spread. One invocation per workload, then one report over all of them:

    C=flexlb,flexlb-openai,sglang-cache_aware,sglang-power_of_two,vllm-cache_aware,vllm-power_of_two,direct-round-robin
    for T in chat azure-conv azure-code mooncake; do
      python bench/peers.py --trace $T --configs $C --engine-modes vllm,sglang --repeat 3 --search \
          --per-request --out bench/results/peers_${T}_matrix.json
    done
    python bench/peers_report.py bench/results/peers_*_matrix.json --workload-target mooncake=0.55 \
        --markdown --plot bench/results/matrix

`--rows` defaults to `auto` (a sustained slice, below); `--quick` (60 rows, two loads at a
quarter and a half of the capacity bound, the key configurations) is for iterating, its
slices are bursts and its table says so. Mooncake's headline is taken at 55 % (only about
60 % of its requests can meet a 2 s TTFT at all).

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
(`--sim-server-cmd` replaces that command, e.g. to try another build; it must take
`--scheduler`). Engine flags (`--num-kv-blocks`, `--block-size-tokens`, `--max-seq-len-tokens`,
`--max-num-batched-tokens`, `--max-num-seqs`, `--max-prefill-tokens`, `--no-chunked-prefill`,
`--profile`) go to every engine of every configuration, and only when given: by default every
engine runs its shipped defaults (`workers/agent.py` WorkerConfig), except `--scheduler MODE`,
the cell's engine mode, which every engine always gets (below). The time scale (default 1, because a router's overhead is
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

Workloads (`--trace`; rows `--start-row S --rows N`), from bench/workloads.py (its docstring
says exactly how each prompt is built): `mooncake`, `azure-conv`, `azure-code` (the public
traces, or a path to one) and `chat` (multi-turn sessions re-sending their history, tenants
with long system prompts, ShareGPT lengths; `--chat-tenants`, `--chat-session-rate`,
`--chat-turns`, `--chat-think-s`, `--chat-seed`). Text prompts: with the byte-level tokenizer
(schemas/tokens.py) one ASCII character is one token, for every router alike. A trace's
prompts longer than `--max-prompt-tokens` (32000; FlexLB refuses more than 32768) are cut to
it, and the report says how many; a chat session ends before its history would exceed it.
The run's facts give the workload's prefix reuse with an unbounded cache shared by the
fleet (`prefix_reuse_unbounded`). max_tokens = max(1, output length). Every body carries the
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

Engine modes (`--engine-modes vllm,sglang`, default vllm): every configuration runs once per
mode, and every engine of the cell (sim-servers, `flexlb up`'s NATS workers) gets `--scheduler
MODE` (workers/engines/sim.py: `vllm` mixes decodes and prompt chunks in each step, `sglang`
runs prefill-first steps). Cells are labelled `CONFIG[MODE]`; ratios (to the best peer, to
direct round-robin) are taken within a mode, and each mode has its own capacity bound.

Two offline figures frame the results (bench/capacity.py): the capacity bound per engine
mode, and the share of requests that could meet the SLO even alone on an idle engine (a
ceiling on attainment at any load: on Mooncake slices with a 2 s TTFT target it is about
60 %, because prefilling a 20k-token prompt alone takes longer; the report warns when it is
below the target). The bound holds only for a sustained load: a slice that arrives within a
few request lifetimes is a burst the fleet absorbs and drains after the last arrival, and
used to pass loads no fleet sustains (bench/capacity.py says how that was found). So
`--rows auto` (the default) replays about the shortest slice that lasts
MIN_SLICE_LIFETIMES (10) request lifetimes at the bound of every mode; a shorter `--rows N`
is allowed, warned about and its headlines are marked "burst slice"; and any headline above
the bound is flagged in the table, in a banner and by the exit status (3).

Loads: `--rates 0.5,1,1.5,2` (multipliers), or `--search`: per cell start at
`--search-start`, multiply by `--search-factor` while attainment ≥ `--target` (down while
it misses), then bisect `--bisect` times between the last pass and the first fail, at most
`--max-runs` loads. `--repeat N` runs every (cell, load) point N times, each on a fresh fleet;
a point's attainment is the mean of its runs (the search steps on it too). The headline per
cell is the highest load with attainment ≥ 90 %, interpolated linearly between the highest
passing load and the lowest failing load above it (`≥ x` when nothing failed, `< x` when
nothing passed); with repeats the table adds, in brackets, the headlines of the per-load
minimum and maximum attainment (the spread's effect on the figure). It is also given as a
fraction of the capacity bound, against the best peer router and against direct round-robin.
Times are ENGINE ms (wall / time scale; = wall at time scale 1).

Output: the runs table (every run: attainment, TTFT and TPOT p50/p90/p99, misses by kind,
hit rate, requests per engine, CPU), the matrix (a row per (mode, workload, configuration):
the headline and its spread, of the bound, the ratios, and at the highest passing load the
prefix hit rate, TTFT and TPOT p50/p90/p99, misses: TTFT only / TPOT only / both, not
completed by error code, requests per engine), and `--out` (default
bench/results/peers_<trace>.json): every run, machine facts, package versions, every command
line, per-request records with `--per-request`. `--plot PREFIX`: PREFIX_attainment.png
(attainment vs load, every configuration; several modes: PREFIX_<mode>_attainment.png) and
PREFIX_cdf.png (TTFT and TPOT CDFs of every configuration at `--cdf-rate`; runs it if
needed). Exit status 0 when every run started and stopped cleanly (request failures are
results), 1 when one did not, 3 when a headline is above the capacity bound.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import multiprocessing
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import msgspec

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench import trace as bt  # noqa: E402  (helpers: ports, /proc CPU, percentiles, JSON)
from bench.capacity import (  # noqa: E402
    MIN_SLICE_LIFETIMES,
    SCHEDULERS,
    CapacityBound,
    EngineLimits,
    StepCosts,
    capacity_bound,
    mean_zero_load_e2e_ms,
    slice_lifetimes,
    zero_load_slo_fraction,
)
from bench.workloads import (  # noqa: E402
    WORKLOADS,
    ChatParams,
    Row,
    load_workload,
    prefix_reuse,
    resolve_trace,
    workload_requests,
)

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
    engine_mode: str = "vllm"  # every engine's --scheduler: "vllm" (mixed steps) | "sglang" (prefill-first)


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
    return dataclasses.replace(config, name=f"{config.name}@{suffix}", flexlb_flags=flags,
                               pd=(num_prefill, num_decode))


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
def build_bodies(rows: list[Row], args: argparse.Namespace) -> list[bytes]:
    enc = msgspec.json.Encoder()
    return [enc.encode({"model": args.model_name, "prompt": r.prompt(), "max_tokens": r.max_tokens,
                        "stream": True, "slo_ttft_ms": args.slo_ttft_ms, "slo_tpot_ms": args.slo_tpot_ms,
                        "request_id": r.request_id}) for r in rows]


def workload_facts(rows: list[Row], span_s: float, block_size_tokens: int = 16) -> dict[str, Any]:
    cut = [r for r in rows if r.input_length < r.recorded_input_length]
    facts: dict[str, Any] = {
        "rows": len(rows),
        "first_row": rows[0].row,
        "recorded_span_s": round(span_s, 3),
        "recorded_rate_req_per_s": round(len(rows) / span_s, 4) if span_s > 0 else None,
        "input_tokens_as_sent": bt.summarize([float(r.input_length) for r in rows], 0),
        "max_tokens": bt.summarize([float(r.max_tokens) for r in rows], 0),
        "prompts_cut": len(cut),
        "prompt_tokens_cut": sum(r.recorded_input_length - r.input_length for r in cut),
        "has_prefix_info": any(r.prefix_block_ids is not None for r in rows),
        # Share of prompt tokens an infinite cache shared by the whole fleet would serve.
        "prefix_reuse_unbounded": round(prefix_reuse(rows, block_size_tokens), 4),
    }
    sessions = {r.session for r in rows if r.session is not None}
    if sessions:
        facts["sessions"] = len(sessions)
        facts["turns_per_session_mean"] = round(len(rows) / len(sessions), 2)
    return facts


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
ENGINE_INT_FLAGS = ("num_kv_blocks", "block_size_tokens", "max_seq_len_tokens", "max_num_batched_tokens",
                    "max_num_seqs", "max_prefill_tokens")


def engine_flags(args: argparse.Namespace, engine_mode: str | None = None) -> list[str]:
    """The engine flags given on our command line, for every engine of every configuration,
    and `--scheduler ENGINE_MODE` (the run's engine mode, passed to every engine always)."""
    out: list[str] = ["--scheduler", engine_mode] if engine_mode else []
    for name in (*ENGINE_INT_FLAGS, "profile"):
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

    def fleet_flags(self) -> list[str]:
        """`flexlb up`'s fleet: K NATS workers running our engine flags and the run's engine mode."""
        a = self.args
        return ["--workers", str(a.workers), "--time-scale", f"{a.time_scale:g}",
                *engine_flags(a, self.config.engine_mode)]

    def start(self) -> None:
        self.start_up(self.fleet_flags())

    def up_argv(self, fleet_flags: list[str], port: int, state_file: Path) -> list[str]:
        """`flexlb up FLEET_FLAGS` + the configuration's flags + --flexlb-args (which win)."""
        return [*flexlb_exe(), "up", *fleet_flags, "--port", str(port), "--state-file", str(state_file),
                *self.config.flexlb_flags, *self.args.flexlb_args_list]

    def start_up(self, fleet_flags: list[str]) -> None:
        """`up_argv(FLEET_FLAGS)`; returns once its router answers /readyz."""
        a = self.args
        self.port = bt.free_port()
        self.state_file = self.workdir / f"state-{self.tag}.json"
        argv = self.up_argv(fleet_flags, self.port, self.state_file)
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
                # The server binds its PUB socket only for `tcp://*:PORT` (vLLM's rule: any other
                # address is connected to, for a proxy) and the agent's SUB connects: given
                # 127.0.0.1 on both sides, both connect and no event ever arrives.
                pub_port, replay = bt.free_port(), f"tcp://127.0.0.1:{bt.free_port()}"
                self.kv_endpoints.append((f"tcp://127.0.0.1:{pub_port}", replay))
                events = ["--kv-events-endpoint", f"tcp://*:{pub_port}", "--kv-events-replay-endpoint", replay]
            argv = self.engine_argv(base, i, role if pd else None, port, events)
            engines.append(Proc(f"worker-w{i}", argv, self.workdir / f"{self.tag}-w{i}.log", env))
            self.engine_urls.append(f"http://127.0.0.1:{port}")
        self.procs = list(engines)
        for p in engines:
            p.start()
        deadline = time.monotonic() + a.startup_timeout_s
        for url in self.engine_urls:
            wait_http(url + "/health", deadline, engines, lambda s, _: s == 200)
        return deadline

    def engine_argv(self, base: list[str], i: int, role: str | None, port: int, events: list[str]) -> list[str]:
        """One sim-server: engine w<i> (a PD role or colocated), our engine flags and the run's engine mode."""
        a = self.args
        return [*base, "--port", str(port), "--worker-id", f"w{i}", "--time-scale", f"{a.time_scale:g}",
                *(["--role", role] if role else []), *(["--host", "127.0.0.1"] if a.sim_server_has_host else []),
                *engine_flags(a, self.config.engine_mode), *events,
                *(["--model-name", a.model_name] if a.model_name != "flexlb-sim" else [])]

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
            "kv_event_batches_published": int(sum(delta(w, "flexlb_sim_kv_event_batches_total") for w in workers)),
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
        # That the servers' KV events reach the router's prefix index (a run without them
        # routes blind to the cache and says nothing else about it).
        kv = {k: v for k, v in (self.router_counters() or {}).items() if k.startswith("flexlb_kv_events_total")}
        published = engines.get("kv_event_batches_published", 0)
        if published > 0 and not sum(kv.values()):
            print(f"    WARNING: the servers published {published} KV event batches and the router took none",
                  file=sys.stderr, flush=True)
        return engines | {"flexlb_" + k: flexlb[k] for k in keep} | {"router_kv_events": kv}


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
    return is_ok(rec, max_tokens) and miss_kind(rec, max_tokens, args) is None


def miss_kind(rec: Rec, max_tokens: int, args: argparse.Namespace) -> str | None:
    """A completed request's miss: "ttft_only", "tpot_only", "both", or None when it attained."""
    ttft_missed = rec.ttft_s * 1000.0 / args.time_scale > args.slo_ttft_ms
    tpot_missed = max_tokens > 1 and tpot_ms(rec, args) > args.slo_tpot_ms
    if ttft_missed and tpot_missed:
        return "both"
    return "ttft_only" if ttft_missed else "tpot_only" if tpot_missed else None


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
    misses = {"ttft_only": 0, "tpot_only": 0, "both": 0}  # of completed requests
    for r in recs:
        if not is_ok(r, rows[r.index].max_tokens):
            code = r.error or ("client_short_stream" if r.done else "client_unknown")
            errors[code] += 1
            if r.error_message and len(samples.setdefault(code, [])) < 3:
                samples[code].append(r.error_message)
            continue
        kind = miss_kind(r, rows[r.index].max_tokens, args)
        if kind is not None:
            misses[kind] += 1
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
        # Why requests missed: completed but late (TTFT only, TPOT only, both), or not completed
        # (by error code: rejections, failures, client timeouts, capped at the run's end).
        "misses": misses | {"not_completed": sum(errors.values())},
        "error_samples": samples,  # up to 3 messages per code
        "send_lateness_wall_ms": bt.summarize(late, 2),
    }


def one_run(config: Config, label: str, multiplier: float, rows: list[Row], args: argparse.Namespace,
            workdir: Path, seq: int, repeat: int = 0) -> dict[str, Any]:
    span_recorded_s = rows[-1].ts_ms / 1000.0
    span_s = span_recorded_s / multiplier  # engine seconds
    send_at = [r.ts_ms / 1000.0 / multiplier * args.time_scale for r in rows]
    cap_s = args.run_cap_s if args.run_cap_s else send_at[-1] + args.drain_s
    tag = f"{seq:03d}-{label.replace('[', '-').replace(']', '')}"
    fleet = make_fleet(config, args, workdir, tag)
    run: dict[str, Any] = {"config": label, "kind": config.kind, "engine_mode": config.engine_mode,
                           "multiplier": multiplier, "repeat": repeat,
                           "load_req_per_s": round(len(rows) / span_s, 4) if span_s > 0 else None,
                           "span_s": round(span_s, 3), "cap_wall_s": round(cap_s, 1)}
    t_start = time.monotonic()
    print(f"[{label} ×{multiplier:g}{f' #{repeat + 1}' if repeat else ''}] starting a fresh fleet "
          f"({run['load_req_per_s']} req/s, span {span_s:.1f} s)", file=sys.stderr, flush=True)
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
def load_points(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The successful runs of one cell grouped by load (multiplier): the mean attainment over
    the repeats, and its min and max (the run-to-run spread); sorted by load."""
    by_mult: dict[float, list[dict[str, Any]]] = {}
    for r in runs:
        if r.get("attainment") is not None and r.get("load_req_per_s"):
            by_mult.setdefault(r["multiplier"], []).append(r)
    pts = []
    for mult, rs in by_mult.items():
        atts = [r["attainment"] for r in rs]
        pts.append({"multiplier": mult, "load": rs[0]["load_req_per_s"], "attainment": round(sum(atts) / len(atts), 4),
                    "min": min(atts), "max": max(atts), "runs": len(rs)})
    return sorted(pts, key=lambda p: (p["load"], p["multiplier"]))


def crossing(pts: list[tuple[float, float, float]], target: float) -> dict[str, Any]:
    """Highest load with attainment ≥ target from (load, attainment, multiplier) points:
    linear between the highest passing load and the lowest failing load above it."""
    pts = sorted(pts)
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


def headline(runs: list[dict[str, Any]], target: float) -> dict[str, Any]:
    """The cell's headline: `crossing` of the mean attainment per load. With repeats, `range`
    holds the headlines of the per-load minimum and maximum attainment (the spread's effect)."""
    pts = load_points(runs)
    out = crossing([(p["load"], p["attainment"], p["multiplier"]) for p in pts], target)
    out["points"] = pts
    if any(p["runs"] > 1 for p in pts):
        keep = ("value", "bound", "below_req_per_s")
        out["range"] = {side: {k: v for k, v in crossing([(p["load"], p[key], p["multiplier"]) for p in pts],
                                                         target).items() if k in keep}
                        for side, key in (("low", "min"), ("high", "max"))}
    return out


def search_runs(run_point: Callable[[float], list[dict[str, Any]]], args: argparse.Namespace,
                search_max: float) -> list[dict[str, Any]]:
    """Up by --search-factor while passing (down while failing), then bisect the bracket; a
    point passes on its mean attainment over its repeats."""
    runs: list[dict[str, Any]] = []
    m = args.search_start
    lo = hi = None  # multipliers of the highest pass / lowest fail seen
    num_points = 0

    def attempt(mult: float) -> float | None:
        nonlocal num_points
        num_points += 1
        point = run_point(mult)
        runs.extend(point)
        atts = [r["attainment"] for r in point if r.get("attainment") is not None]
        return sum(atts) / len(atts) if atts else None

    while num_points < args.max_runs:
        att = attempt(m)
        if att is None:
            break  # the harness failed: searching on is pointless
        if att >= args.target:
            lo = m if lo is None else max(lo, m)
            if hi is not None:
                break
            m *= args.search_factor
            if m > search_max:
                break
        else:
            hi = m if hi is None else min(hi, m)
            if lo is not None:
                break
            m /= args.search_factor
            if m < args.search_min:
                break
    for _ in range(args.bisect):
        if lo is None or hi is None or num_points >= args.max_runs:
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


def split_label(label: str, run_or_headline: dict[str, Any]) -> tuple[str, str]:
    """(configuration, engine mode) of a cell label `CONFIG[MODE]`; reports from before engine
    modes have neither the suffix nor the field, and ran every engine as "vllm" (its default)."""
    mode = run_or_headline.get("engine_mode")
    if label.endswith("]") and "[" in label:
        base, _, suffix = label[:-1].rpartition("[")
        return base, mode or suffix
    return label, mode or "vllm"


def capacity_of(result: dict[str, Any], mode: str) -> dict[str, Any] | None:
    """The capacity bound of the report's workload under an engine mode."""
    by_mode = result.get("capacity_by_mode")
    if by_mode is not None:
        return by_mode.get(mode)
    return result.get("capacity") if mode == "vllm" else None


def slice_lifetimes_of(result: dict[str, Any], mode: str) -> float | None:
    return (result["workload"].get("slice_lifetimes_by_mode") or {}).get(mode)


def workload_label(result: dict[str, Any]) -> str:
    w = result["workload"]
    return f"{result['trace']} {w['first_row']}+{w['rows']}"


def cell_stats(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Means over the repeats of one (cell, load): prefix hit rate, TTFT / TPOT percentiles,
    misses by kind, requests per engine."""
    ok = [r for r in runs if r.get("attainment") is not None]
    if not ok:
        return {}

    def mean(values: list[float | None]) -> float | None:
        v = [x for x in values if x is not None]
        return sum(v) / len(v) if v else None

    out: dict[str, Any] = {"runs": len(ok), "load": ok[0]["load_req_per_s"], "multiplier": ok[0]["multiplier"],
                           "hit_rate": mean([(r.get("engines") or {}).get("prefix_hit_rate") for r in ok])}
    for key in ("ttft_ms", "tpot_ms"):
        out[key] = {q: mean([(r.get(key) or {}).get(q) for r in ok]) for q in ("p50", "p90", "p99")}
    if all("misses" in r for r in ok):
        out["misses"] = {k: mean([r["misses"][k] for r in ok]) for k in ("ttft_only", "tpot_only", "both",
                                                                          "not_completed")}
    errors: Counter = Counter()
    per_worker: Counter = Counter()
    for r in ok:
        errors.update(r.get("errors") or {})
        per_worker.update((r.get("engines") or {}).get("requests_per_worker") or {})
    out["errors"] = {k: v / len(ok) for k, v in errors.most_common()}
    out["requests_per_worker"] = {k: v / len(ok) for k, v in sorted(per_worker.items())}
    return out


def matrix_rows(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per (engine mode, workload, configuration) cell, with its ratios to the best
    peer router and to direct round-robin of the same (mode, workload) group."""
    records = []
    for result in results:
        target = result["flags"]["target"]
        groups: dict[str, list[tuple[str, str, dict[str, Any]]]] = {}
        for label, h in result["headline"].items():
            base, mode = split_label(label, h)
            groups.setdefault(mode, []).append((label, base, h))
        for mode, cells in groups.items():
            peers = [h["value"] for _, _, h in cells if h.get("kind") in ("sglang", "vllm") and h.get("value")]
            best_peer = max(peers) if peers else None
            direct = next((h.get("value") for _, base, h in cells if base == "direct-round-robin"), None)
            cap = capacity_of(result, mode)
            bound = cap["rate_req_per_s"] if cap else None
            lifetimes = slice_lifetimes_of(result, mode)
            for label, base, h in cells:
                v = h.get("value")
                at = (h.get("pass") or {}).get("multiplier")
                mine = [r for r in result["runs"] if r["config"] == label]
                if at is None and mine:
                    at = min(r["multiplier"] for r in mine)
                stats = cell_stats([r for r in mine if at is not None and abs(r["multiplier"] - at) < 1e-9])
                records.append({
                    "mode": mode, "workload": workload_label(result), "trace": result["trace"], "config": base,
                    "label": label, "kind": h.get("kind"), "target": target, "headline": h,
                    "of_bound": v / bound if v and bound else None, "bound": bound,
                    "above_bound": bool(v and bound and v > bound),
                    "burst": lifetimes is not None and lifetimes < MIN_SLICE_LIFETIMES, "slice_lifetimes": lifetimes,
                    "vs_best_peer": v / best_peer if v and best_peer else None,
                    "vs_direct": v / direct if v and direct else None, "stats": stats,
                })
    return records


def points_text(points: list[dict[str, Any]]) -> str:
    """'LOAD: MEAN (MIN–MAX)' per load of a cell (the range only with repeats)."""
    return "; ".join(f"{p['load']:.3g}: {p['attainment']:.2f}"
                     + (f" ({p['min']:.2f}–{p['max']:.2f})" if p["runs"] > 1 else "") for p in points) or "-"


def matrix_table(records: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """The matrix: a row per (mode, workload, configuration). The load columns are the
    headline (mean attainment per load; with repeats, the headlines of the per-load min and
    max attainment in brackets) and every load's mean attainment (with repeats, its min and
    max); the detail columns are means over the repeats at the headline's highest passing
    load (else the lowest load run)."""
    cols = ["mode", "workload", "config", "target", "highest load at target (req/s)", "of bound", "vs best peer",
            "vs direct-rr", "attainment by load (min–max)", "at req/s", "hit rate", "TTFT p50/p90/p99", "TPOT p50/p90/p99",
            "missed TTFT/TPOT/both", "not completed", "per engine", "runs"]
    rows = []
    for rec in records:
        h, st = rec["headline"], rec["stats"]
        text = headline_text(h)
        if h.get("range"):  # the spread over repeats, when it moves the figure
            low, high = headline_text(h["range"]["low"]), headline_text(h["range"]["high"])
            text += f" ({low}–{high})" if (low, high) != (text, text) else " (no spread)"
        of_bound = f"{rec['of_bound']:.0%}" if rec["of_bound"] is not None else "-"
        if rec["above_bound"]:
            of_bound = f"⚠ {of_bound} ABOVE THE BOUND"
        elif rec["burst"] and rec["of_bound"] is not None:
            of_bound += " (burst slice)"
        m = st.get("misses")
        misses = "/".join(fmt(m[k], 0) for k in ("ttft_only", "tpot_only", "both")) if m else "-"
        errors = ", ".join(f"{k} {v:g}" for k, v in list(st.get("errors", {}).items())[:2])
        rows.append([
            rec["mode"], rec["workload"], rec["config"], f"{rec['target']:.0%}", text, of_bound,
            fmt(rec["vs_best_peer"], 2), fmt(rec["vs_direct"], 2), points_text(h.get("points") or []),
            fmt(st.get("load"), 2),
            fmt(st.get("hit_rate"), 3),
            "/".join(fmt(st["ttft_ms"][q], 0) for q in ("p50", "p90", "p99")) if st else "-",
            "/".join(fmt(st["tpot_ms"][q], 1) for q in ("p50", "p90", "p99")) if st else "-",
            misses, (f"{fmt(m['not_completed'], 0)}" if m else "-") + (f" ({errors})" if errors else ""),
            " ".join(f"{v:.0f}" for v in st.get("requests_per_worker", {}).values()) or "-",
            str(h.get("runs", 0)),
        ])
    return cols, rows


def runs_table(result: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    cols = ["config", "×rate", "#", "req/s", "attain", "goodput", "TTFT p50", "p90", "p99", "TPOT p50", "p90", "p99",
            "missed T/P/both", "hit rate", "per worker", "errors", "client cores", "machine cores (sat.)",
            "others' cores", "wall s"]
    rows = []
    for r in result["runs"]:
        rep = str(r.get("repeat", 0) + 1)
        if "attainment" not in r:
            rows.append([r["config"], fmt(r["multiplier"], 3), rep, fmt(r.get("load_req_per_s"), 2), "FAILED",
                         *["-"] * 14, fmt(r.get("wall_s"), 0)])
            continue
        e = r.get("engines", {})
        per_worker = " ".join(str(v) for v in (e.get("requests_per_worker") or {}).values())
        errors = ", ".join(f"{k} {v}" for k, v in list(r["errors"].items())[:3]) or "-"
        m = r.get("misses")
        cpu = r["cpu"]
        rows.append([r["config"], fmt(r["multiplier"], 3), rep, fmt(r["load_req_per_s"], 2), f"{r['attainment']:.3f}",
                     fmt(r["goodput_req_per_s"], 2), fmt(r["ttft_ms"]["p50"]), fmt(r["ttft_ms"]["p90"]),
                     fmt(r["ttft_ms"]["p99"]), fmt(r["tpot_ms"]["p50"], 1), fmt(r["tpot_ms"]["p90"], 1),
                     fmt(r["tpot_ms"].get("p99"), 1),
                     "/".join(str(m[k]) for k in ("ttft_only", "tpot_only", "both")) if m else "-",
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


def report_header(result: dict[str, Any]) -> str:
    w, f = result["workload"], result["flags"]
    modes = result.get("engine_modes") or ["vllm"]
    bounds = []
    for mode in modes:
        cap = capacity_of(result, mode)
        if cap is None:
            continue
        lifetimes = slice_lifetimes_of(result, mode)
        bounds.append(f"{mode} {cap['rate_req_per_s']:.3g} req/s (×{fmt(cap.get('multiplier'), 3)} the recorded rate, "
                      f"decode batch {fmt(cap.get('decode_batch_size'), 0)} by {cap.get('decode_batch_limited_by')}"
                      + (f"; the slice lasts {lifetimes:.1f} request lifetimes at it" if lifetimes is not None else "")
                      + ")")
    reuse = w.get("prefix_reuse_unbounded")
    return (f"{result['trace']}: {w['rows']} rows from row {w['first_row']} ({w['recorded_rate_req_per_s']} req/s "
            f"recorded; {w['prompts_cut']} prompts cut to {f['max_prompt_tokens']} tokens; prefix reuse with an "
            f"unbounded cache {fmt(reuse, 3)}), {f['workers']} engines, engine modes {', '.join(modes)}, time scale "
            f"{f['time_scale']:g}, SLO TTFT {f['slo_ttft_ms']:g} ms / TPOT {f['slo_tpot_ms']:g} ms, target "
            f"{f['target']:.0%} (reachable alone on an idle engine: {w['zero_load_slo_fraction_infinite_cache']:.1%}); "
            f"capacity bound {'; '.join(bounds) or '-'}; times in engine ms; {result['machine']['cores']} cores shared "
            f"by the client and every process")


def above_bound_banner(records: list[dict[str, Any]]) -> str | None:
    """A loud message naming every headline above its capacity bound; None when there is none."""
    above = [r for r in records if r["above_bound"]]
    if not above:
        return None
    lines = [f"  {r['label']} on {r['workload']}: {headline_text(r['headline'])} req/s > bound {r['bound']:.3g} "
             f"({r['of_bound']:.0%}; the slice lasts {fmt(r['slice_lifetimes'], 1)} request lifetimes at the bound)"
             for r in above]
    return ("!" * 78 + "\nHEADLINE ABOVE THE CAPACITY BOUND: no fleet sustains these loads, so these runs measured a "
            "burst (too short a slice) or the bound is wrong (bench/capacity.py). Replay a longer slice (--rows auto):\n"
            + "\n".join(lines) + "\n" + "!" * 78)


def print_report(result: dict[str, Any], markdown: bool) -> None:
    print("\n" + report_header(result))
    print(render(*runs_table(result), markdown=markdown))
    print()
    records = matrix_rows([result])
    print(render(*matrix_table(records), markdown=markdown))
    for note in result["notes_run"]:
        print(f"note: {note}")
    banner = above_bound_banner(records)
    if banner:
        print(banner)


def plot(result: dict[str, Any], prefix: str, cdf_sets: dict[str, dict[str, list[float]]],
         cdf_rate: float | None) -> list[str]:
    """PREFIX_attainment.png (one engine mode) or PREFIX_<mode>_attainment.png per mode:
    attainment vs load of every configuration, min-max bars over repeats; PREFIX_cdf.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    by_mode: dict[str, list[str]] = {}
    for label in dict.fromkeys(r["config"] for r in result["runs"]):
        run = next(r for r in result["runs"] if r["config"] == label)
        by_mode.setdefault(split_label(label, run)[1], []).append(label)
    for mode, labels in by_mode.items():
        fig, ax = plt.subplots(figsize=(9, 5.5))
        for name in labels:
            pts = load_points([r for r in result["runs"] if r["config"] == name])
            if pts:
                x, y = [p["load"] for p in pts], [p["attainment"] for p in pts]
                if any(p["runs"] > 1 for p in pts):
                    err = [[p["attainment"] - p["min"] for p in pts], [p["max"] - p["attainment"] for p in pts]]
                    ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=split_label(name, {})[0])
                else:
                    ax.plot(x, y, marker="o", label=split_label(name, {})[0])
        ax.axhline(result["flags"]["target"], color="grey", linestyle=":", linewidth=1)
        cap = capacity_of(result, mode)
        xmax = max([r["load_req_per_s"] for r in result["runs"] if r.get("load_req_per_s")] or [1.0])
        if cap is not None:
            bound = cap["rate_req_per_s"]
            if bound <= 2 * xmax:
                ax.axvline(bound, color="black", linestyle="--", linewidth=1, label=f"capacity bound {bound:.3g} req/s")
            else:
                ax.text(0.99, 0.02, f"capacity bound {bound:.3g} req/s (off the chart)", transform=ax.transAxes,
                        ha="right", fontsize=8)
        ax.set_xlabel("load (req/s)")
        ax.set_ylabel(f"SLO attainment (TTFT ≤ {result['flags']['slo_ttft_ms']:g} ms, TPOT ≤ "
                      f"{result['flags']['slo_tpot_ms']:g} ms)")
        ax.set_ylim(-0.02, 1.02)
        ax.set_title(f"{workload_label(result)} rows, {result['flags']['workers']} engines, engine mode {mode}")
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = f"{prefix}_attainment.png" if len(by_mode) == 1 else f"{prefix}_{mode}_attainment.png"
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


def engine_defaults(args: argparse.Namespace) -> tuple[dict[str, EngineLimits], dict[str, Any], list[str]]:
    """The engine limits every engine runs with, per engine mode: our flags, else
    WorkerConfig's defaults."""
    notes = []
    defaults: dict[str, Any] = {"max_num_batched_tokens": 8192, "max_num_seqs": 256, "num_kv_blocks": 16384,
                                "block_size_tokens": 16, "max_seq_len_tokens": 40960, "max_prefill_tokens": 16384}
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
    limits = {mode: EngineLimits(scheduler=mode, chunked_prefill=not args.no_chunked_prefill, **defaults)
              for mode in args.engine_mode_list}
    return limits, defaults, notes


def workload_capacity(rows: list[Row], costs: StepCosts, limits: EngineLimits,
                      workers: int, serve_fraction: float = 1.0) -> tuple[CapacityBound, float]:
    """The capacity bound of `rows` under one engine mode (when only `serve_fraction` of the
    requests must be served: the target), and how many request lifetimes the slice lasts when
    it arrives at the bound for serving all of them (bench/capacity.py)."""
    requests, prefix_block_tokens = workload_requests(rows)
    cap = capacity_bound(requests, costs, limits, workers, recorded_span_s=rows[-1].ts_ms / 1000.0,
                         prefix_block_tokens=prefix_block_tokens, serve_fraction=serve_fraction)
    return cap, slice_lifetimes(requests, cap, costs, limits)


def choose_rows(args: argparse.Namespace, costs: StepCosts, limits: dict[str, EngineLimits]) -> list[Row]:
    """`--rows N`: those rows. `--rows auto`: about the shortest slice from --start-row that
    lasts MIN_SLICE_LIFETIMES request lifetimes at the capacity bound of every engine mode
    (grown from 100 rows by the lifetimes it lacks; the bound moves with the slice), or the
    whole trace when it is shorter."""
    def load(n: int) -> list[Row]:
        return load_workload(args.trace, args.start_row, n, args.max_prompt_tokens, seed=args.chat_seed,
                             chat=args.chat_params)

    if args.rows != "auto":
        return load(args.rows)
    n = 100
    for _ in range(12):
        rows = load(n)
        if len(rows) < n or len(rows) < 2:
            return rows  # the whole rest of the trace
        if rows[-1].ts_ms <= 0:  # no span yet: no rate, no bound
            n *= 2
            continue
        lifetimes = min(workload_capacity(rows, costs, lim, args.workers)[1] for lim in limits.values())
        if lifetimes >= MIN_SLICE_LIFETIMES:
            return rows
        n = math.ceil(n * MIN_SLICE_LIFETIMES / lifetimes * 1.05)
    return rows


# --------------------------------------------------------------------------- main
QUICK_CONFIGS = ("flexlb", "flexlb-openai", "sglang-cache_aware", "vllm-cache_aware", "direct-round-robin")
QUICK_ROWS = 60
QUICK_LOADS_OF_BOUND = (0.25, 0.5)  # --quick's loads, as fractions of the lowest mode's capacity bound


def _rows_arg(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--rows takes a number or auto, got {text!r}") from None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", default="mooncake", help=f"{' | '.join(WORKLOADS)} | a path (default mooncake)")
    p.add_argument("--rows", type=_rows_arg,
                   help=f"requests to replay, or auto: about the shortest slice lasting {MIN_SLICE_LIFETIMES:g} "
                        f"request lifetimes at the capacity bound (default auto; --quick: {QUICK_ROWS})")
    p.add_argument("--start-row", type=int, default=0)
    p.add_argument("--workers", type=int, default=4, help="engines per fleet, K (default 4)")
    p.add_argument("--time-scale", type=float, default=1.0, help="engine time multiplier (default 1: wall = engine)")
    p.add_argument("--configs", help=f"comma-separated (default: all; --quick: {','.join(QUICK_CONFIGS)})")
    p.add_argument("--engine-modes", default="vllm",
                   help=f"comma-separated engine schedulers, each configuration runs on each ({', '.join(SCHEDULERS)}; "
                        f"default vllm): every engine gets --scheduler MODE, cells are labelled CONFIG[MODE]")
    p.add_argument("--repeat", type=int, default=1,
                   help="runs of each (configuration, load) point, each on a fresh fleet (default 1); the headline "
                        "uses the mean attainment per load, the table the min-max spread")
    p.add_argument("--quick", action="store_true",
                   help=f"iteration preset: {QUICK_ROWS} rows, loads "
                        f"{' and '.join(f'{x:g}' for x in QUICK_LOADS_OF_BOUND)} × the capacity bound, configurations "
                        f"{','.join(QUICK_CONFIGS)} (each unless given)")
    p.add_argument("--flexlb-args", default="", help="appended to every `flexlb up` command line")
    p.add_argument("--name", help="label of the FlexLB configuration(s) run with --flexlb-args")
    p.add_argument("--peer-args", default="", help="appended to every peer router's command line")
    loads = p.add_mutually_exclusive_group()
    loads.add_argument("--rates", help="rate multipliers, comma-separated (default 1)")
    loads.add_argument("--search", action="store_true", help="per configuration, search the highest passing load")
    p.add_argument("--search-start", type=float, default=1.0, help="first multiplier of --search (default 1)")
    p.add_argument("--search-factor", type=float, default=1.5, help="step of --search up or down (default 1.5)")
    p.add_argument("--bisect", type=int, default=2, help="bisections after the bracket (default 2)")
    p.add_argument("--max-runs", type=int, default=7,
                   help="most loads per configuration in --search, each run --repeat times (default 7)")
    p.add_argument("--search-min", type=float, default=0.01, help="lowest multiplier --search tries (default 0.01)")
    p.add_argument("--search-max", type=float,
                   help="highest multiplier --search tries (default: 1.5 × the capacity bound's; a pass above the "
                        "bound only says the slice is too short)")
    p.add_argument("--target", type=float, default=0.9, help="attainment a load must reach (default 0.9)")
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=100.0)
    p.add_argument("--max-prompt-tokens", type=int, default=32000,
                   help="traces: longer prompts are cut; chat: a session ends before its history exceeds it "
                        "(default 32000)")
    p.add_argument("--model-name", default="flexlb-sim", help="the body's model field (SGLang's router needs one)")
    chat = p.add_argument_group("the chat workload (--trace chat; bench/workloads.py ChatParams)")
    chat_defaults = ChatParams()
    chat.add_argument("--chat-tenants", type=int, help=f"tenants, each with its own system prompt "
                                                       f"(default {chat_defaults.num_tenants})")
    chat.add_argument("--chat-session-rate", type=float,
                      help=f"sessions starting per second at ×1 (default {chat_defaults.session_rate_per_s:g})")
    chat.add_argument("--chat-turns", type=float, help=f"mean turns per session (default {chat_defaults.mean_turns:g})")
    chat.add_argument("--chat-think-s", type=float,
                      help=f"mean think time between turns, s (default {chat_defaults.mean_think_s:g})")
    chat.add_argument("--chat-seed", type=int, help="the workload's seed (default 0)")
    eng = p.add_argument_group("engine flags (every engine of every configuration; default: the engine's own)")
    for name in ENGINE_INT_FLAGS:
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
    p.add_argument("--plot", metavar="PREFIX",
                   help="write PREFIX_attainment.png (several engine modes: PREFIX_<mode>_attainment.png) and "
                        "PREFIX_cdf.png")
    p.add_argument("--cdf-rate", type=float, help="multiplier of the CDF plot (default: the highest one every "
                                                  "configuration ran; runs it when missing)")
    p.add_argument("--markdown", action="store_true", help="print the tables as markdown")
    p.add_argument("--keep-logs", action="store_true", help="keep the processes' logs (their folder is printed)")
    p.add_argument("--out", help="JSON report (default bench/results/peers_<trace>.json)")
    args = p.parse_args(argv)
    if args.rows is None:
        args.rows = QUICK_ROWS if args.quick else "auto"
    if args.configs is None:
        args.configs = ",".join(QUICK_CONFIGS if args.quick else builtin_configs())
    args.engine_mode_list = list(dict.fromkeys(x.strip() for x in args.engine_modes.split(",") if x.strip()))
    bad_modes = [m for m in args.engine_mode_list if m not in SCHEDULERS]
    if bad_modes or not args.engine_mode_list:
        p.error(f"--engine-modes takes {', '.join(SCHEDULERS)}; got {args.engine_modes!r}")
    chat_knobs = {"num_tenants": args.chat_tenants, "session_rate_per_s": args.chat_session_rate,
                  "mean_turns": args.chat_turns, "mean_think_s": args.chat_think_s}
    if args.trace == "chat":
        try:
            args.chat_params = ChatParams(**{k: v for k, v in chat_knobs.items() if v is not None})
        except ValueError as exc:
            p.error(f"chat workload: {exc}")
        args.chat_seed = args.chat_seed or 0
    else:
        given = [f"--{k}" for k, v in (("chat-tenants", args.chat_tenants),
                                       ("chat-session-rate", args.chat_session_rate), ("chat-turns", args.chat_turns),
                                       ("chat-think-s", args.chat_think_s), ("chat-seed", args.chat_seed))
                 if v is not None]
        if given:
            p.error(f"{', '.join(given)} apply to --trace chat only")
        args.chat_params, args.chat_seed = None, 0
        try:
            resolve_trace(args.trace)
        except ValueError as exc:
            p.error(str(exc))
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
    # One cell per (engine mode, configuration), labelled CONFIG[MODE]; modes in the order given.
    args.selected = [(dataclasses.replace(known[n], engine_mode=mode), f"{label[n]}[{mode}]")
                     for mode in args.engine_mode_list for n in names]
    # --quick without --rates: loads as fractions of the capacity bound, known once the rows are (main).
    args.loads_of_bound = QUICK_LOADS_OF_BOUND if args.quick and not args.rates and not args.search else None
    try:
        args.rate_list = [float(x) for x in (args.rates or "1").split(",") if x.strip()]
    except ValueError:
        p.error("--rates takes numbers")
    if any(r <= 0 for r in args.rate_list) or args.search_start <= 0 or args.search_factor <= 1:
        p.error("rates and --search-start must be > 0, --search-factor > 1")
    if ((args.rows != "auto" and args.rows < 2) or args.workers < 1 or args.start_row < 0 or args.client_procs < 1
            or args.repeat < 1):
        p.error("--rows >= 2 (or auto), --workers >= 1, --start-row >= 0, --client-procs >= 1, --repeat >= 1")
    if args.time_scale <= 0:
        p.error("--time-scale must be > 0")
    return args


def sim_server_check(args: argparse.Namespace) -> str | None:
    """None when the engine server command answers --help and takes --scheduler (and whether
    it takes --host); else why it cannot run."""
    base = shlex.split(args.sim_server_cmd) if args.sim_server_cmd else [*flexlb_exe(), "sim-server"]
    try:
        res = subprocess.run([*base, "--help"], cwd=REPO, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{shlex.join(base)} --help failed: {exc}"
    if res.returncode != 0:
        return f"{shlex.join(base)} --help exited {res.returncode}: {(res.stderr or res.stdout).strip()[-300:]}"
    if "--scheduler" not in res.stdout:
        return f"{shlex.join(base)} does not take --scheduler, which every engine gets (the engine mode)"
    args.sim_server_has_host = "--host" in res.stdout
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.sim_server_has_host = False

    def on_term(signum, frame):  # SIGTERM: unwind through every finally (fleets get stopped)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    costs = StepCosts.from_file(args.profile or DEFAULT_PROFILE)
    limits, engine_cfg, notes = engine_defaults(args)
    modes = args.engine_mode_list
    trace_name, trace_path = ("chat", None) if args.trace == "chat" else resolve_trace(args.trace)
    t_build = time.monotonic()
    rows = choose_rows(args, costs, limits)
    if len(rows) < 2 or rows[-1].ts_ms <= 0:
        print(f"need at least 2 rows with distinct timestamps from {trace_path or trace_name} row {args.start_row}",
              file=sys.stderr)
        return 1
    span_recorded_s = rows[-1].ts_ms / 1000.0
    bodies = build_bodies(rows, args)
    _BODIES[:] = bodies
    _REQUEST_IDS[:] = [r.request_id for r in rows]
    facts = workload_facts(rows, span_recorded_s, engine_cfg["block_size_tokens"])
    facts["rows_chosen"] = "auto" if args.rows == "auto" else "given"
    print(f"{trace_name}: {len(rows)} rows ({facts['rows_chosen']}), {facts['recorded_rate_req_per_s']} req/s "
          f"recorded; bodies {sum(map(len, bodies)) / 1e6:.1f} MB built in {time.monotonic() - t_build:.1f} s; "
          f"{facts['prompts_cut']} prompts cut to {args.max_prompt_tokens} tokens "
          f"({facts['prompt_tokens_cut']} tokens dropped); prefix reuse with an unbounded cache "
          f"{facts['prefix_reuse_unbounded']}", file=sys.stderr, flush=True)

    caps: dict[str, CapacityBound] = {}
    lifetimes: dict[str, float] = {}
    for mode in modes:
        # a headline is checked against the bound at the target (a router may refuse the costliest 1 - target)
        caps[mode], lifetimes[mode] = workload_capacity(rows, costs, limits[mode], args.workers,
                                                        serve_fraction=min(1.0, args.target))
    facts["slice_lifetimes_by_mode"] = {m: round(v, 2) for m, v in lifetimes.items()}
    requests, prefix_block_tokens = workload_requests(rows)
    first = limits[modes[0]]  # alone on an idle engine both schedulers run the same steps
    # Who could meet the SLO alone on an idle engine: a ceiling on attainment at any load.
    for with_cache in (True, False):
        facts[f"zero_load_slo_fraction_{'infinite_cache' if with_cache else 'cold'}"] = round(zero_load_slo_fraction(
            requests, costs, first, args.slo_ttft_ms, args.slo_tpot_ms, with_cache, prefix_block_tokens), 4)
    feasible = facts["zero_load_slo_fraction_infinite_cache"]
    mean_e2e0_s = mean_zero_load_e2e_ms(requests, costs, first) / 1000.0
    facts["mean_zero_load_e2e_s"] = round(mean_e2e0_s, 3)
    # (the slice's length at the bound for serving every request, as slice_lifetimes)
    facts["span_at_bound_s"] = {m: round(c.num_requests * c.mean_work_ms / c.num_workers / 1000, 2)
                                for m, c in caps.items()}
    for mode in modes:
        # Near the bound a slice shorter than MIN_SLICE_LIFETIMES request lifetimes is a burst that
        # drains after the last arrival and passes loads no fleet sustains (bench/capacity.py).
        if lifetimes[mode] < MIN_SLICE_LIFETIMES:
            notes.append(f"{mode}: at the capacity bound these {len(rows)} rows arrive in "
                         f"{facts['span_at_bound_s'][mode]} s, {lifetimes[mode]:.1f} request lifetimes "
                         f"({mean_e2e0_s:.2f} s each alone), under {MIN_SLICE_LIFETIMES:g}: near the bound a run is a "
                         f"burst, not a sustained load, and passes too easily; its headlines are marked as a burst "
                         f"slice (--rows auto replays a sustained one)")
            print(f"warning: {notes[-1]}", file=sys.stderr, flush=True)
        print(f"capacity bound ({mode}, serving {caps[mode].serve_fraction:.0%}): {caps[mode].rate_req_per_s:.3g} req/s "
              f"(×{caps[mode].multiplier:.3g} the recorded rate); the slice lasts {lifetimes[mode]:.1f} request "
              f"lifetimes at the bound for every request", file=sys.stderr,
              flush=True)
    print(f"{feasible:.1%} of the requests could meet the SLO alone on an idle engine", file=sys.stderr, flush=True)
    if args.loads_of_bound:
        lowest = min(c.multiplier for c in caps.values())
        args.rate_list = [round(f * lowest, 3) for f in args.loads_of_bound]
        print(f"--quick: loads ×{', ×'.join(f'{m:g}' for m in args.rate_list)} (of the lowest bound ×{lowest:.3g})",
              file=sys.stderr, flush=True)
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
    cap_facts = {"formula": "bench/capacity.py module docstring", "upper_bound": True,
                 "formula_version": 2}  # 2: issue 24 (bench/peers_report.py recomputes older ones)
    result: dict[str, Any] = {
        "benchmark": "bench/peers.py: FlexLB vs peer routers on simulated engines",
        "command": shlex.join([sys.executable, *sys.argv]),
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": bt.machine_facts() | {"versions": versions()},
        "trace": trace_name,
        "trace_path": str(trace_path) if trace_path else None,
        "chat": ({"seed": args.chat_seed} | {k: (list(v) if isinstance(v, tuple) else str(v) if isinstance(v, Path)
                                               else v) for k, v in dataclasses.asdict(args.chat_params).items()}
                 if args.chat_params else None),
        "flags": {k: v for k, v in vars(args).items()
                  if k not in ("selected", "chat_params", "engine_mode_list") and not callable(v)}
        | {"configs_run": [lbl for _, lbl in args.selected]},
        "engine_modes": modes,
        "engine": engine_cfg | {"chunked_prefill": not args.no_chunked_prefill,
                                "profile": str(args.profile or DEFAULT_PROFILE),
                                "flags_passed": {m: engine_flags(args, m) for m in modes}},
        "workload": facts,
        "capacity": caps[modes[0]].as_dict() | cap_facts,  # the first mode's, as reports before engine modes had
        "capacity_by_mode": {m: c.as_dict() | cap_facts for m, c in caps.items()},
        "notes_run": notes,
        "runs": [],
        "headline": {},
    }
    seq = 0
    failed = False
    cdf_sets: dict[str, dict[str, list[float]]] = {}
    t0 = time.monotonic()
    cdf_rate = args.cdf_rate

    def finish_headline(config: Config, label: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
        mode = config.engine_mode
        h = headline(runs, args.target) | {"kind": config.kind, "engine_mode": mode, "runs": len(runs)}
        if lifetimes[mode] < MIN_SLICE_LIFETIMES:
            h["burst_slice"] = True
        if h.get("value") and h["value"] > caps[mode].rate_req_per_s:
            h["above_bound"] = True
            notes.append(f"{label}: {h['value']:.3g} req/s is ABOVE the capacity bound "
                         f"{caps[mode].rate_req_per_s:.3g}: a burst the slice was too short to tell from a sustained load, or a wrong bound")
            print(f"WARNING: {notes[-1]}", file=sys.stderr, flush=True)
        return h

    try:
        for config, label in args.selected:
            def run_point(mult: float, config=config, label=label) -> list[dict[str, Any]]:
                nonlocal seq, failed
                point = []
                for k in range(args.repeat):
                    seq += 1
                    r = one_run(config, label, mult, rows, args, workdir, seq, k)
                    failed |= not r["harness_ok"] or bool(r.get("stop_note"))
                    result["runs"].append(r)
                    point.append(r)
                return point

            if args.search:
                search_max = (args.search_max if args.search_max is not None
                              else 1.5 * caps[config.engine_mode].multiplier)
                runs = search_runs(run_point, args, search_max)
            else:
                runs = [r for m in args.rate_list for r in run_point(m)]
            for r in runs:
                if r.get("client_bottleneck"):
                    notes.append(f"{label} ×{r['multiplier']:g}: {r['client_bottleneck']}")
                if (r.get("cpu") or {}).get("saturated_fraction", 0) and r["cpu"]["saturated_fraction"] > 0.25:
                    notes.append(f"{label} ×{r['multiplier']:g}: the machine was ≥90 % busy in "
                                 f"{r['cpu']['saturated_fraction']:.0%} of the samples (others' processes "
                                 f"{r['cpu']['foreign_cores']['mean']} cores): engine sleeps and routers ran late")
            result["headline"][label] = finish_headline(config, label, runs)
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
                result["headline"][label] = finish_headline(config, label, runs) | {"note_interrupted": True}
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
    if failed:
        return 1
    return 3 if any(h.get("above_bound") for h in result["headline"].values()) else 0


PER_REQUEST_COLUMNS = ["row", "target", "input_tokens", "max_tokens", "send_at_trace_ms", "late_wall_ms", "status",
                       "error", "ttft_ms", "e2e_ms", "tokens", "attained", "request_id"]


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
                 is_attained(x, rows[x.index].max_tokens, args), rows[x.index].request_id] for x in recs]
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
