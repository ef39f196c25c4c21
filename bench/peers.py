"""Side by side with the routers people run: FlexLB, SGLang's router, vLLM's router and no
router at all, each in front of a fresh fleet of simulated engines, under an open-loop
streaming replay of a public trace; SLO attainment against load, and per configuration the
highest load it sustains with at least 90 % of requests within their SLO.

    python bench/peers.py --trace azure-conv --rows 60 --configs flexlb,direct-round-robin --rates 2
    python bench/peers.py --trace mooncake --rows 300 --search --search-start 0.5 --plot bench/results/peers_mooncake
    python bench/peers.py --trace azure-code --configs flexlb,sglang-cache_aware,vllm-cache_aware --rates 0.5,1,2
    python bench/peers.py --configs flexlb --flexlb-args "--slo-mode reject" --name flexlb-reject --rates 1,2
    python bench/peers.py --trace chat --quick --engine-modes vllm,sglang          # the matrix, a first look
    python bench/peers.py --trace long-conv --quick --chat-turns 4                   # long prompts, one knob changed

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
slices are bursts and its table says so. Mooncake's headline is taken at a lower target
(bench/PEERS.md: few of its requests can meet a 2 s TTFT at all).

Configurations (`--configs a,b,...`, default all; the names are stable):

| name | what runs in front of K engines |
|---|---|
| `flexlb` | `flexlb up --workers K --time-scale T`: the shipped defaults, nothing else |
| `flexlb-fixed-window` | the same with `--batcher fixed-window` |
| `flexlb-slo-budget` | `--batcher slo-budget` |
| `flexlb-cache-aware` | `--prefill-policy cache-aware` |
| `flexlb-round-robin` | `--prefill-policy round-robin` |
| `flexlb-openai` | FlexLB through its OpenAI adapter in front of the peers' very engines (`AdapterFleet`) |
| `sglang-<policy>` | `python -m sglang_router.launch_router --policy <policy>` (round_robin, cache_aware, power_of_two) |
| `vllm-<policy>` | `python -m vllm_router.launch_router --policy <policy>` (the same three) |
| `direct-round-robin` | no router: the load generator sends request i to engine i mod K |
| `<name>@PpDd` | FlexLB or sglang-router on a disaggregated fleet of P prefill + D decode engines, P + D = K (`with_pd`) |

`flexlb-openai` runs K `flexlb sim-server` processes (each also publishing vLLM's KV events
over ZMQ) and `flexlb up --engine openai --engine-url URL --kv-events-endpoint PUB
--kv-events-replay-endpoint REPLAY` per server.

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
engine runs its shipped defaults (`workers/config.py` WorkerConfig), except `--scheduler MODE`,
the cell's engine mode, which every engine always gets (below). The time scale (default 1, because a router's overhead is
wall time) is the same for all.

The peer routers run with their defaults except: loopback only (`--host 127.0.0.1`,
`--prometheus-host 127.0.0.1`, free ports), `--log-level warn`, and
`--worker-startup-check-interval 1` (default 30), which in sglang-router 0.3.2 and
vllm-router 0.1.17 is also the period at which power_of_two polls the engines' `/get_load`
(workers/sim_server/http.py): with 30 s its loads would be stale for a whole run. No
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
traces, or a path to one) and the generated chat family: `chat` (multi-turn sessions
re-sending their history, tenants with long system prompts, ShareGPT lengths) and `long-conv`
(Mooncake-like long-prompt conversations: a document of its own per session, prompts up to
16000 tokens, little cross-session sharing). For either, `--chat-tenants`,
`--chat-session-rate`, `--chat-turns`, `--chat-think-s` replace the workload's own value when
given, `--chat-seed` picks the seed; the report's "chat" field holds the parameters used
(bench/peers_report.py rebuilds the rows from it). Text prompts: with the byte-level tokenizer
(schemas/tokens.py) one ASCII character is one token, for every router alike. A trace's
prompts longer than `--max-prompt-tokens` (32000; FlexLB refuses more than 32768) are cut to
it, and the report says how many; a chat-family session ends before its history would exceed
it (long-conv: before it would exceed 16000 tokens, or this when lower).
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
ceiling on attainment at any load: low on Mooncake slices with a 2 s TTFT target
(bench/PEERS.md), because prefilling a 20k-token prompt alone takes longer; the report warns when it is
below the target). The bound holds only for a sustained load: a slice that arrives within a
few request lifetimes is a burst the fleet absorbs and drains after the last arrival, and
used to pass loads no fleet sustains (bench/PEERS.md, "The capacity bound", says how that was found). So
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

This file holds the experiment (workload, runs, load search, main); the fleets are in
bench/peers_fleet.py, the client in bench/loadgen.py, the tables and plots in
bench/peers_tables.py.

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

One module over 500 lines: it is one experiment end to end (slice choice, the runs, the load
search, main); its fleets (bench/peers_fleet.py), load generator (bench/loadgen.py) and
tables (bench/peers_tables.py) are their own modules.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import os
import shlex
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import msgspec

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench import loadgen  # noqa: E402
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
from bench.common import dump_json, machine_facts, stop_all, summarize  # noqa: E402
from bench.loadgen import Rec  # noqa: E402
from bench.peers_fleet import (  # noqa: E402
    ENGINE_INT_FLAGS,
    Config,
    builtin_configs,
    engine_flags,
    make_fleet,
    sim_server_check,
    warm_up,
    with_pd,
)
from bench.peers_tables import headline, plot, print_report  # noqa: E402
from bench.workloads import (  # noqa: E402
    CHAT_WORKLOADS,
    WORKLOADS,
    ChatParams,
    Row,
    load_workload,
    prefix_reuse,
    resolve_trace,
    workload_requests,
)

DEFAULT_PROFILE = REPO / "workers" / "profiles" / "llama2-70b-h100-tp8.json"


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
        "input_tokens_as_sent": summarize([float(r.input_length) for r in rows], 0),
        "max_tokens": summarize([float(r.max_tokens) for r in rows], 0),
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


# --------------------------------------------------------------------------- one run
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
        "ttft_ms": summarize(ttft),
        "tpot_ms": summarize(tpot, 2),
        "e2e_ms": summarize(e2e),
        "errors": dict(errors.most_common()),
        # Why requests missed: completed but late (TTFT only, TPOT only, both), or not completed
        # (by error code: rejections, failures, client timeouts, capped at the run's end).
        "misses": misses | {"not_completed": sum(errors.values())},
        "error_samples": samples,  # up to 3 messages per code
        "send_lateness_wall_ms": summarize(late, 2),
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
        loadgen.URLS[:] = fleet.urls
        plans = loadgen.make_plans(len(rows), send_at, fleet.target_of, args.client_procs)
        recs, client, cpu = loadgen.run_clients(plans, cap_s, args.request_timeout_s, args.cpu_interval_s, len(rows),
                                                fleet.pids())
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
              f"client {client['cores']}, send lateness p99 {c['send_lateness_wall_ms']['p99']} ms"
              + over_refusal_note(run["engines"]), file=sys.stderr, flush=True)
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

        from workers.config import WorkerConfig

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
                   help="traces: longer prompts are cut; chat, long-conv: a session ends before its history "
                        "exceeds it (default 32000)")
    p.add_argument("--model-name", default="flexlb-sim", help="the body's model field (SGLang's router needs one)")
    chat = p.add_argument_group(f"the chat workloads (--trace {' | '.join(CHAT_WORKLOADS)}; bench/workloads.py "
                                f"ChatParams); each knob replaces the workload's own value")

    def defaults(field: str) -> str:
        return "default " + ", ".join(f"{n} {getattr(c, field):g}" for n, c in CHAT_WORKLOADS.items())

    chat.add_argument("--chat-tenants", type=int,
                      help=f"tenants, each with its own system prompt ({defaults('num_tenants')})")
    chat.add_argument("--chat-session-rate", type=float,
                      help=f"sessions starting per second at ×1 ({defaults('session_rate_per_s')})")
    chat.add_argument("--chat-turns", type=float, help=f"mean turns per session ({defaults('mean_turns')})")
    chat.add_argument("--chat-think-s", type=float,
                      help=f"mean think time between turns, s ({defaults('mean_think_s')})")
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
    p.add_argument("--keep-logs", action="store_true",
                   help="keep the processes' logs and each FlexLB run's journal (`flexlb whatif` reads it; the folder is printed)")
    p.add_argument("--marginal-over-refusal", action="store_true",
                   help="also judge each FlexLB refusal alone (flexlb whatif --refusal marginal): would it have met its SLO "
                        "served, at no cost to the others? A virtual re-run per refusal: seconds each")
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
    if args.trace in CHAT_WORKLOADS:
        try:
            args.chat_params = dataclasses.replace(CHAT_WORKLOADS[args.trace],
                                                   **{k: v for k, v in chat_knobs.items() if v is not None})
        except ValueError as exc:
            p.error(f"{args.trace} workload: {exc}")
        args.chat_seed = args.chat_seed or 0
    else:
        given = [f"--{k}" for k, v in (("chat-tenants", args.chat_tenants),
                                       ("chat-session-rate", args.chat_session_rate), ("chat-turns", args.chat_turns),
                                       ("chat-think-s", args.chat_think_s), ("chat-seed", args.chat_seed))
                 if v is not None]
        if given:
            p.error(f"{', '.join(given)} apply to --trace {' / '.join(CHAT_WORKLOADS)} only, not {args.trace}")
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


def over_refusal_note(engines: dict[str, Any]) -> str:
    """'; refused N, M would have met their SLO (x % of requests)' for a FlexLB run."""
    over = engines.get("over_refusal") or engines.get("flexlb_over_refusal")
    if not over:
        return ""
    net = (f"; with refusal off {over['others_lost']} that met would miss, net {over['net']:+d} met"
           if "net" in over else "")
    alone = over.get("marginal")
    each = (f"; each alone: {alone['at_no_cost']} would have met at no cost to the others "
            f"({alone['marginal_over_refusal_rate']:.2%}), {alone['at_a_cost']} at a cost" if alone else "")
    return (f"; refused {over['refused']} slo_unattainable, {over['would_meet']} would have met their SLO "
            f"(over-refusal {over['over_refusal_rate']:.2%} of requests{net}){each}")


def chat_field(params: ChatParams | None, seed: int) -> dict[str, Any] | None:
    """The report's "chat" field: the chat-family workload's seed and every parameter, as JSON
    (bench/peers_report.py rebuilds the rows from it and the report's "trace"); None: a trace."""
    if params is None:
        return None
    return {"seed": seed} | {k: (list(v) if isinstance(v, tuple) else str(v) if isinstance(v, Path) else v)
                             for k, v in dataclasses.asdict(params).items()}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.sim_server_has_host = False

    def on_term(signum, frame):  # SIGTERM: unwind through every finally (fleets get stopped)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    costs = StepCosts.from_file(args.profile or DEFAULT_PROFILE)
    limits, engine_cfg, notes = engine_defaults(args)
    modes = args.engine_mode_list
    trace_name, trace_path = (args.trace, None) if args.trace in CHAT_WORKLOADS else resolve_trace(args.trace)
    t_build = time.monotonic()
    rows = choose_rows(args, costs, limits)
    if len(rows) < 2 or rows[-1].ts_ms <= 0:
        print(f"need at least 2 rows with distinct timestamps from {trace_path or trace_name} row {args.start_row}",
              file=sys.stderr)
        return 1
    span_recorded_s = rows[-1].ts_ms / 1000.0
    bodies = build_bodies(rows, args)
    loadgen.BODIES[:] = bodies
    loadgen.REQUEST_IDS[:] = [r.request_id for r in rows]
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
        "machine": machine_facts() | {"versions": versions()},
        "trace": trace_name,
        "trace_path": str(trace_path) if trace_path else None,
        "chat": chat_field(args.chat_params, args.chat_seed),
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
    tmp.write_text(dump_json({**result, "runs": runs}) + "\n")
    os.replace(tmp, out)


if __name__ == "__main__":
    try:
        sys.exit(main())
    finally:
        stop_all()
