"""The llama.cpp cell: FlexLB beside sglang-router and vllm-router in front of the same
llama.cpp `llama-server` processes, an engine none of them wrote (issue 38).

    python bench/peers_llamacpp.py --trace mooncake --rows 120 --rates 0.2,0.3,0.4 --out bench/results/peers_llamacpp.json

Each run (one configuration at one load) starts K FRESH llama-servers (empty prompt caches),
all alike: the same binary (services/llamacpp.py `server_binary`), the same model, `--parallel
S --threads T --ctx-size S x 4096 --metrics --slots --jinja` (services/llamacpp.py
`server_argv`), then the router in front of them, two warm-up requests, the replay, and
stops everything. Configurations (`--configs`):

| name | in front of the K servers |
|---|---|
| `flexlb-openai` | `flexlb up --engine openai --engine-url URL ...` (shipped defaults) |
| `flexlb-llamacpp` | `flexlb up --engine llamacpp --workers K --gguf MODEL`, the same `--parallel`, `--threads` |
| `sglang-<policy>` | sglang-router (`cache_aware`, `round_robin`, `power_of_two`) |
| `vllm-<policy>` | vllm-router (the same) |

What the peers can use of llama-server: it has `/health` and `/v1/completions`, but not
SGLang's `/get_load` (power_of_two's load poll) nor vLLM's `/v1/completions/render`
(vllm-router's cache_aware tokenizes through it): where a peer's policy needs one, the
run's router log and errors say what happened, and the table shows it as measured.

The model: `--gguf FILE`, else a random-weight Llama made here with services/llamacpp.py
`write_tiny_model` at `--model-shape` (default 512x8: 512 wide, 8 layers, 8 heads, 4 KV
heads, 1536 FFN; about 100 MB), big enough that the engines, not the routers, are the
bottleneck: on this machine's cores one server prefills about 1,100 tokens/s and decodes a
token in about 6 ms on one thread. Its tokenizer is byte-level BPE (a character is about one
token); its output is noise, and every request asks `ignore_eos` so it runs to max_tokens.

Workloads: bench/workloads.py's (`--trace`; the shared traces' arrival times and lengths),
scaled to what these servers can serve: prompts cut to `--max-prompt-tokens` (default 1536;
a slot holds 4,096), outputs to `--max-output-tokens` (default 64); arrivals at trace time /
the rate multiplier. Every body is a streamed /v1/completions with `stream_options.
include_usage` (a request's tokens are the server's usage count), `ignore_eos`, and the SLO
fields (`--slo-ttft-ms`, default 5000: a 1,536-token prompt takes 1.4 s alone on one thread,
about twice that while the four servers share two cores; `--slo-tpot-ms`, default 80: a decode
step is 6-15 ms alone to loaded). A request attains when it completed with all max_tokens tokens within both targets;
refusals and errors are misses. Prefix hit rate: the servers' own counters (`llamacpp:
prompt_tokens_total`, processed, and `llamacpp:prompt_tokens_cached_total`... the deltas over
the replay: cached / (processed + cached)). Goodput: attained requests / arrival span.

The machine is stated in the report (bench/common.py `machine_facts`): on 2 cores, 4 servers
of one thread each, the routers' own processes and the client share the cores, so a router
that costs more CPU takes it from the engines (issue 40), which is part of what is measured.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import loadgen  # noqa: E402
from bench.common import (  # noqa: E402
    Proc,
    child_env,
    flexlb_exe,
    http_get,
    machine_facts,
    parse_metrics,
    percentile,
    wait_http,
    wait_up_state,
)
from bench.peers_fleet import peer_router_ready  # noqa: E402
from bench.workloads import load_workload  # noqa: E402
from services import llamacpp as lc  # noqa: E402
from services.infra import free_port  # noqa: E402

CONFIGS = ("flexlb-openai", "flexlb-llamacpp", "sglang-cache_aware", "sglang-round_robin", "vllm-cache_aware",
           "vllm-round_robin")
WARMUP = 2


def bench_model(shape: str) -> str:
    """The random-weight model of `shape` (WIDTHxLAYERS), made once and cached beside the tiny one."""
    width, layers = (int(x) for x in shape.lower().split("x"))
    path = lc.CACHE / "models" / f"bench-{width}x{layers}.gguf"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        lc.write_tiny_model(str(path) + ".tmp", n_embd=width, n_layer=layers, n_head=max(1, width // 64),
                            n_kv_head=max(1, width // 128), n_ff=3 * width)
        Path(str(path) + ".tmp").replace(path)
    return str(path)


def server_counters(urls: list[str]) -> dict[str, dict[str, float]] | None:
    out = {}
    for url in urls:
        status, text = http_get(url + "/metrics")
        if status != 200:
            return None
        out[url] = parse_metrics(text)
    return out


class Run:
    """One configuration at one load: its processes, where the client sends, the servers' URLs."""

    def __init__(self, config: str, args: argparse.Namespace, workdir: Path, tag: str) -> None:
        self.config, self.args, self.workdir, self.tag = config, args, workdir, tag
        self.procs: list[Proc] = []
        self.server_urls: list[str] = []
        self.url: tuple[str, int] = ("", 0)
        self.state: dict[str, Any] = {}

    def _proc(self, name: str, argv: list[str]) -> Proc:
        p = Proc(name, argv, self.workdir / f"{self.tag}-{name}.log", child_env(self.workdir))
        self.procs.append(p)
        p.start()
        return p

    def start(self) -> None:
        a = self.args
        deadline = time.monotonic() + a.startup_timeout_s
        if self.config == "flexlb-llamacpp":
            self._up(["--engine", "llamacpp", "--workers", str(a.workers), "--gguf", a.model,
                      "--llama-server-arg=--parallel", f"--llama-server-arg={a.parallel}",
                      "--llama-server-arg=--threads", f"--llama-server-arg={a.threads}"], deadline)
            self.server_urls = [s["url"] for s in self.state["servers"] if s["name"].startswith("llama-server-")]
            return
        for i in range(a.workers):
            port = free_port()
            self._proc(f"llama-w{i}", lc.server_argv(a.binary, a.model, port, a.parallel, [], a.threads))
            self.server_urls.append(f"http://127.0.0.1:{port}")
        for url in self.server_urls:
            wait_http(url + "/health", deadline, self.procs, lambda s, _: s == 200)
        if self.config == "flexlb-openai":
            flags = ["--engine", "openai"]
            for url in self.server_urls:
                flags += ["--engine-url", url]
            self._up(flags, deadline)
            return
        kind, policy = self.config.split("-", 1)
        port, prom = free_port(), free_port()
        module = "sglang_router.launch_router" if kind == "sglang" else "vllm_router.launch_router"
        self._proc("router", [sys.executable, "-m", module, "--host", "127.0.0.1", "--port", str(port),
                              "--worker-urls", *self.server_urls, "--policy", policy, "--prometheus-host", "127.0.0.1",
                              "--prometheus-port", str(prom), "--log-level", "warn" if kind == "sglang" else "warning",
                              "--worker-startup-check-interval", "1"])

        wait_http(f"http://127.0.0.1:{port}/readiness", deadline, self.procs, peer_router_ready(a.workers))
        self.url = ("127.0.0.1", port)

    def _up(self, flags: list[str], deadline: float) -> None:
        port = free_port()
        state_file = self.workdir / f"state-{self.tag}.json"
        up = self._proc("up", [*flexlb_exe(), "up", "--open-admin", *flags, "--port", str(port),
                               "--state-file", str(state_file), *shlex.split(self.args.flexlb_args)])
        self.state = wait_up_state(up, state_file, deadline, self.args.startup_timeout_s)
        wait_http(self.state["router_url"] + "/readyz", deadline, [up], lambda s, _: s == 200)
        self.url = ("127.0.0.1", port)

    def pids(self) -> dict[str, int]:
        return {**self.state.get("pids", {}), **{p.name: p.pid for p in self.procs}}

    def stop(self) -> dict[str, int | None]:
        return {p.name: p.stop(self.args.stop_timeout_s) for p in reversed(self.procs)}


def bodies(rows, args: argparse.Namespace) -> list[bytes]:
    enc = msgspec.json.Encoder()
    return [enc.encode({"model": args.model_name, "prompt": r.prompt()[:args.max_prompt_tokens],
                        "max_tokens": min(r.max_tokens, args.max_output_tokens), "stream": True,
                        "stream_options": {"include_usage": True}, "ignore_eos": True,
                        "slo_ttft_ms": args.slo_ttft_ms, "slo_tpot_ms": args.slo_tpot_ms, "request_id": r.request_id})
            for r in rows]


def warm_up(url: tuple[str, int], args: argparse.Namespace) -> None:
    async def go() -> None:
        for i in range(WARMUP):
            rec = loadgen.Rec(i, 0)
            body = json.dumps({"model": args.model_name, "prompt": "warm", "max_tokens": 2, "stream": True,
                               "ignore_eos": True}).encode()
            await asyncio.wait_for(loadgen.stream_one(url[0], url[1], body, rec, f"warmup-{i}"), 60)
            if rec.error:
                raise RuntimeError(f"warm-up request failed: {rec.error} {rec.error_message}")

    asyncio.run(go())


def summarize(recs: list[loadgen.Rec], max_tokens: list[int], args: argparse.Namespace, span_s: float) -> dict[str, Any]:
    n = len(recs)
    ttft = sorted(r.ttft_s * 1000 for r in recs if r.ttft_s is not None and r.done)
    tpots: list[float] = []
    attained = 0
    errors: dict[str, int] = {}
    for r in recs:
        if r.error:
            errors[r.error] = errors.get(r.error, 0) + 1
        ok = r.done and r.error is None and r.ttft_s is not None and r.tokens >= max_tokens[r.index]
        tpot = ((r.e2e_s - r.ttft_s) * 1000 / (r.tokens - 1)) if ok and r.tokens > 1 else 0.0
        if ok and r.tokens > 1:
            tpots.append(tpot)
        if ok and r.ttft_s * 1000 <= args.slo_ttft_ms and tpot <= args.slo_tpot_ms:
            attained += 1
    tpots.sort()
    refused = sum(v for k, v in errors.items() if k.startswith(("429", "503")))
    return {"requests": n, "attained": attained, "attainment": round(attained / n, 4) if n else None,
            "goodput_req_per_s": round(attained / span_s, 3) if span_s else None, "refused": refused,
            "errors": errors, "ttft_ms": {"p50": _p(ttft, 50), "p90": _p(ttft, 90)},
            "tpot_ms": {"p50": _p(tpots, 50), "p90": _p(tpots, 90)}}


def _p(values: list[float], q: float) -> float | None:
    v = percentile(values, q)
    return round(v, 1) if v is not None else None


def hit_rate(before, after) -> dict[str, Any]:
    if before is None or after is None:
        return {"prefix_hit_rate": None, "error": "a server's /metrics did not answer"}

    def delta(name: str) -> float:
        return sum(after[u].get(name, 0.0) - before.get(u, {}).get(name, 0.0) for u in after)

    processed, cached = delta("llamacpp:prompt_tokens_total"), delta("llamacpp:prompt_tokens_cached_total")
    return {"prompt_tokens_processed": int(processed), "prompt_tokens_cached": int(cached),
            "prefix_hit_rate": round(cached / (processed + cached), 4) if processed + cached else None}


def one_run(config: str, multiplier: float, rows, args: argparse.Namespace, workdir: Path, seq: int) -> dict[str, Any]:
    send_at = [r.ts_ms / 1000.0 / multiplier for r in rows]
    span_s = send_at[-1] or 1e-9
    out: dict[str, Any] = {"config": config, "multiplier": multiplier, "load_req_per_s": round(len(rows) / span_s, 3)}
    run = Run(config, args, workdir, f"{seq:03d}-{config}")
    t0 = time.monotonic()
    print(f"[{config} x{multiplier:g}] {out['load_req_per_s']} req/s: starting", file=sys.stderr, flush=True)
    try:
        run.start()
        warm_up(run.url, args)
        before = server_counters(run.server_urls)
        loadgen.URLS[:] = [run.url]
        plans = loadgen.make_plans(len(rows), send_at, lambda i: 0, 1)
        recs, client, cpu = loadgen.run_clients(plans, send_at[-1] + args.drain_s, args.request_timeout_s, 1.0,
                                                len(rows), run.pids())
        time.sleep(0.5)
        out.update(summarize(recs, [min(r.max_tokens, args.max_output_tokens) for r in rows], args, span_s))
        out["engines"] = hit_rate(before, server_counters(run.server_urls))
        out["cpu"] = {"machine_busy_cores": cpu.get("machine_busy_cores"), "by_process": cpu.get("mean_cores_by_process")}
        print(f"[{config} x{multiplier:g}] attainment {out['attainment']} goodput {out['goodput_req_per_s']} "
              f"refused {out['refused']} errors {out['errors']} TTFT p50/p90 {out['ttft_ms']} TPOT {out['tpot_ms']} "
              f"hit {out['engines']['prefix_hit_rate']}", file=sys.stderr, flush=True)
    except Exception as exc:  # one run's failure is reported; the sweep goes on
        out["error"] = f"{exc.__class__.__name__}: {exc}"
        out["log_tails"] = {p.name: p.log_tail(15) for p in run.procs}
        print(f"[{config} x{multiplier:g}] failed: {out['error']}", file=sys.stderr, flush=True)
    finally:
        out["commands"] = [" ".join(p.argv) for p in run.procs]
        out["exit_codes"] = run.stop()
        out["wall_s"] = round(time.monotonic() - t0, 1)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", default="mooncake")
    p.add_argument("--rows", type=int, default=120)
    p.add_argument("--start-row", type=int, default=0)
    p.add_argument("--rates", default="0.2,0.3,0.4", help="rate multipliers of the trace's own arrival rate")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--parallel", type=int, default=4, help="slots per server (default 4)")
    p.add_argument("--threads", type=int, default=0, help="threads per server (default: the cores / K, at least 1)")
    p.add_argument("--gguf", help="the model (default: a random-weight Llama of --model-shape, made and cached)")
    p.add_argument("--model-shape", default="512x8", help="WIDTHxLAYERS of the made model (default 512x8)")
    p.add_argument("--max-prompt-tokens", type=int, default=1536)
    p.add_argument("--max-output-tokens", type=int, default=64)
    p.add_argument("--slo-ttft-ms", type=float, default=5000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=80.0)
    p.add_argument("--request-timeout-s", type=float, default=120.0)
    p.add_argument("--drain-s", type=float, default=60.0)
    p.add_argument("--startup-timeout-s", type=float, default=180.0)
    p.add_argument("--stop-timeout-s", type=float, default=20.0)
    p.add_argument("--flexlb-args", default="", help="appended to every `flexlb up` command line (a variant)")
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "peers_llamacpp.json"))
    args = p.parse_args(argv)
    import os

    args.binary = lc.server_binary()
    args.model = args.gguf or bench_model(args.model_shape)
    args.model_name = Path(args.model).stem  # the servers' --alias
    args.threads = args.threads or max(1, (os.cpu_count() or 1) // args.workers)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGS and not c.startswith(("sglang-", "vllm-"))]
    if unknown:
        p.error(f"unknown configurations {unknown}; known: {', '.join(CONFIGS)}")
    rows = load_workload(args.trace, args.start_row, args.rows)
    loadgen.BODIES[:] = bodies(rows, args)
    loadgen.REQUEST_IDS[:] = [r.request_id for r in rows]
    loadgen.COUNT_TOKENS = "usage"
    workdir = Path(tempfile.mkdtemp(prefix="flexlb-llamacpp-"))
    runs = []
    seq = 0
    for mult in [float(x) for x in args.rates.split(",")]:
        for config in configs:
            seq += 1
            runs.append(one_run(config, mult, rows, args, workdir, seq))
    report = {"machine": machine_facts(), "model": args.model, "trace": args.trace,
              "rows": len(rows), "start_row": args.start_row, "workers": args.workers, "parallel": args.parallel,
              "threads": args.threads, "slo_ttft_ms": args.slo_ttft_ms, "slo_tpot_ms": args.slo_tpot_ms,
              "max_prompt_tokens": args.max_prompt_tokens, "max_output_tokens": args.max_output_tokens,
              "logs": str(workdir), "runs": runs}
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"\n{'config':<20} {'x':>5} {'req/s':>7} {'attain':>7} {'goodput':>8} {'refused':>7} {'hit':>6} "
          f"{'TTFT p90':>9} {'TPOT p90':>9}")
    for r in runs:
        print(f"{r['config']:<20} {r['multiplier']:>5g} {r['load_req_per_s']:>7} {r.get('attainment')!s:>7} "
              f"{r.get('goodput_req_per_s')!s:>8} {r.get('refused')!s:>7} "
              f"{(r.get('engines') or {}).get('prefix_hit_rate')!s:>6} {(r.get('ttft_ms') or {}).get('p90')!s:>9} "
              f"{(r.get('tpot_ms') or {}).get('p90')!s:>9}" + (f"  {r['error']}" if "error" in r else ""))
    print(f"(report: {args.out}; logs: {workdir})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
