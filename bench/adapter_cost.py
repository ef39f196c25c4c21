"""CPU per relayed token: FlexLB through its OpenAI adapter beside FlexLB on its own NATS workers.

    python bench/adapter_cost.py [--configs adapter,nats] [--engines 4] [--concurrency 64]
                                 [--max-tokens 200] [--time-scale 1] [--warmup-s 5] [--duration-s 30]
                                 [--kv-events] [--flexlb-args "..."] [--out bench/results/adapter_cost.json]

Every output token of a streamed completion crosses, through the adapter: the engine server
(`flexlb sim-server`: the simulated engine behind its HTTP front, one SSE chunk per request
per engine step), the worker agent (workers/openai/agent.py: parses that chunk, publishes
the tokens on core NATS), nats-server, the router (services/shell/relay.py: decodes them,
queues them for the client) and the router's HTTP stream to the client. On FlexLB's own
workers the engine and the agent are one process and the SSE hop is not there. This bench
puts a number on each process's share of that path.

Configurations, each started fresh on this machine:
- `adapter`: K `flexlb sim-server --time-scale T` processes, then `flexlb up --engine openai
  --engine-url URL ...` (one agent per server; with `--kv-events` each server also publishes
  vLLM's KV events and its agent subscribes, as in bench/peers.py's flexlb-openai);
- `nats`: `flexlb up --workers K --time-scale T` (the same engine inside each worker).

Load, closed loop: `--concurrency` C client tasks, each sending one streamed completion after
another (a 64-token prompt of ids, `max_tokens` M, `ignore_eos`), over a fresh HTTP/1.1
connection each (bench/loadgen.py's client). After `--warmup-s` (streams under way, start-up
done) the CPU time of every process (/proc/PID/stat: user + system) and the number of tokens
the clients have received so far are read; again after `--duration-s`; the differences give,
per process kind, CPU-microseconds per relayed token (a token counted once, when its text
reaches the client) and the cores it used. Before the load, `--idle-s` of the fleet at rest
give each kind's idle cores (heartbeats, the agents' /metrics polls, the router's liveness
cycles); `above idle` is the per-token figure less that: what the tokens themselves cost.
The JSON also has each kind's system (kernel) time per token, `sys_us_per_token`: the
socket reads and writes of the path. Kinds: `agents` (the adapter's worker agents),
`engines` (the sim-servers), `workers` (FlexLB's NATS workers: engine + agent in one
process), `router`, `nats` (nats-server), `redis` (redis-server), `loadgen` (this process).
The pids come from `flexlb up`'s state file. Wall throughput on a shared machine moves with
other load; CPU time per token is what to compare between code versions.

Printed: one table (kinds as rows, configurations as columns) and the requests/s, tokens/s
and failures of each; written as JSON to `--out`. Exit status 0 when every configuration ran
with no failed request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec

REPO = Path(__file__).resolve().parent.parent
if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    del sys.path[0]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.common import (  # noqa: E402
    Proc,
    child_env,
    flexlb_exe,
    free_port,
    http_get,
    machine_facts,
    proc_cpu_s,
    proc_cpu_times,
    stop_all,
    wait_http,
    wait_up_state,
)
from bench.loadgen import Rec, stream_one  # noqa: E402

PROMPT_TOKENS = 64
KINDS = ("agents", "engines", "workers", "router", "nats", "redis", "loadgen")


def kind_of(name: str, config: str) -> str | None:
    """A state-file pid name (or one of ours) -> its kind; None: not measured (`up` itself)."""
    if name.startswith("engine-"):
        return "engines"
    if name.startswith("worker-"):
        return "agents" if config == "adapter" else "workers"
    if name == "router" or name.startswith("router-"):
        return "router"
    if name.startswith("nats"):
        return "nats"
    if name.startswith("redis"):
        return "redis"
    if name == "loadgen":
        return "loadgen"
    return None


class Fleet:
    """The processes of one configuration; stop() stops them all (flexlb up first)."""

    def __init__(self, config: str, args: argparse.Namespace, workdir: Path) -> None:
        self.config, self.args, self.workdir = config, args, workdir
        self.procs: list[Proc] = []
        self.engine_pids: dict[str, int] = {}
        self.state: dict[str, Any] = {}

    def start(self) -> None:
        a = self.args
        env = child_env(self.workdir)
        deadline = time.monotonic() + a.startup_timeout_s
        flags: list[str]
        if self.config == "adapter":
            flags = ["--engine", "openai"]
            engines = []
            for i in range(a.engines):
                port = free_port()
                events: list[str] = []
                pub_replay: list[str] = []
                if a.kv_events:
                    pub, replay = free_port(), free_port()
                    events = ["--kv-events-endpoint", f"tcp://127.0.0.1:{pub}",
                              "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{replay}"]
                    pub_replay = events
                argv = [*flexlb_exe(), "sim-server", "--port", str(port), "--worker-id", f"w{i}",
                        "--time-scale", f"{a.time_scale:g}", *events]
                engines.append(Proc(f"engine-w{i}", argv, self.workdir / f"{self.config}-engine-w{i}.log", env))
                flags += ["--engine-url", f"http://127.0.0.1:{port}", *pub_replay]
            self.procs += engines
            for p in engines:
                p.start()
            for p in engines:
                port = p.argv[p.argv.index("--port") + 1]
                wait_http(f"http://127.0.0.1:{port}/health", deadline, engines, lambda s, _: s == 200)
                self.engine_pids[p.name] = p.pid
        else:
            flags = ["--workers", str(a.engines), "--time-scale", f"{a.time_scale:g}"]
        self.port = free_port()
        state_file = self.workdir / f"state-{self.config}.json"
        argv = [*flexlb_exe(), "up", "--open-admin", *flags, "--port", str(self.port), "--state-file", str(state_file),
                *shlex.split(a.flexlb_args)]
        up = Proc("up", argv, self.workdir / f"{self.config}-up.log", env)
        self.procs.append(up)
        up.start()
        self.state = wait_up_state(up, state_file, deadline, a.startup_timeout_s)
        url = self.state["router_url"]

        def all_ready(status: int | None, _text: str) -> bool:
            if status != 200:
                return False
            code, text = http_get(url + "/admin/workers")
            try:
                return code == 200 and sum(w["state"] == "ready" for w in json.loads(text)["workers"]) == a.engines
            except (ValueError, KeyError, TypeError):
                return False

        wait_http(url + "/readyz", deadline, [up], all_ready)
        self.url = url

    def pids(self) -> dict[str, int]:
        return {**self.state.get("pids", {}), **self.engine_pids, "loadgen": os.getpid()}

    def stop(self) -> dict[str, int | None]:
        return {p.name: p.stop(self.args.stop_timeout_s) for p in reversed(self.procs)}


def cpu_by_pid(pids: dict[str, int]) -> dict[str, float | None]:
    return {name: proc_cpu_s(pid) for name, pid in pids.items()}


def sys_cpu_s(pid: int) -> float | None:
    """System (kernel) CPU seconds of a process: its socket writes and reads, mostly."""
    times = proc_cpu_times(pid)
    return None if times is None else times[1]


def cores_by_kind(before: dict[str, float | None], after: dict[str, float | None], wall_s: float,
                  config: str) -> dict[str, float]:
    """CPU seconds between two readings / wall seconds, summed by process kind."""
    out: dict[str, float] = {}
    for name, b in before.items():
        a = after.get(name)
        kind = kind_of(name, config)
        if kind is None or a is None or b is None:
            continue
        out[kind] = out.get(kind, 0.0) + (a - b) / wall_s
    return dict(sorted(out.items()))


async def drive(fleet: Fleet, args: argparse.Namespace) -> dict[str, Any]:
    """C closed-loop clients; CPU and tokens read at the end of the warm-up and of the window."""
    host, port = fleet.url.split("//", 1)[1].rsplit(":", 1)
    enc = msgspec.json.Encoder()
    results: list[Rec] = []
    stop_at = 0.0
    counter = 0

    async def client(c: int) -> None:
        nonlocal counter
        while time.monotonic() < stop_at:
            counter += 1
            rid = f"cost-{c}-{counter}"
            prompt = [(counter * 7919 + i * 31) % 50_000 for i in range(PROMPT_TOKENS)]
            # A dict, not schemas/api.py's CompletionRequest: the Struct would also send its ~15
            # unset fields as nulls, which the router would parse on every request measured here.
            body = enc.encode({"prompt": prompt, "max_tokens": args.max_tokens, "stream": True, "ignore_eos": True,
                               "request_id": rid})
            res = Rec(counter, 0)
            results.append(res)
            await asyncio.wait_for(stream_one(host, int(port), body, res, connect_timeout_s=30), args.request_timeout_s)

    def snapshot() -> tuple[float, int, int, dict[str, float | None], dict[str, float | None]]:
        pids = fleet.pids()
        return (time.monotonic(), sum(r.tokens for r in results), sum(r.done for r in results), cpu_by_pid(pids),
                {name: sys_cpu_s(pid) for name, pid in pids.items()})

    idle0 = cpu_by_pid(fleet.pids())
    t_idle = time.monotonic()
    await asyncio.sleep(args.idle_s)
    idle_cores = cores_by_kind(idle0, cpu_by_pid(fleet.pids()), time.monotonic() - t_idle, fleet.config)
    stop_at = time.monotonic() + args.warmup_s + args.duration_s
    tasks = [asyncio.create_task(client(c)) for c in range(args.concurrency)]
    await asyncio.sleep(args.warmup_s)
    t0, tok0, done0, cpu0, sys0 = snapshot()
    await asyncio.sleep(args.duration_s)
    t1, tok1, done1, cpu1, sys1 = snapshot()
    try:
        await asyncio.wait_for(asyncio.gather(*tasks), args.request_timeout_s + 5)
    except asyncio.TimeoutError:
        for t in tasks:
            t.cancel()
    failed = [r for r in results if r.error is not None or (r.done and r.tokens != args.max_tokens)]
    wall = t1 - t0
    tokens = tok1 - tok0
    cores = cores_by_kind(cpu0, cpu1, wall, fleet.config)
    sys_cores = cores_by_kind(sys0, sys1, wall, fleet.config)
    busy = {k: max(0.0, v - idle_cores.get(k, 0.0)) for k, v in cores.items()}
    return {
        "window_s": round(wall, 2),
        "tokens": tokens,
        "tokens_per_s": round(tokens / wall, 1),
        "requests_per_s": round((done1 - done0) / wall, 2),
        "requests": len(results),
        "failed": len(failed),
        "failures": sorted({f"{r.error}" for r in failed})[:10],
        "cpu_us_per_token": {k: round(v * wall * 1e6 / tokens, 1) for k, v in cores.items()} if tokens else {},
        # The same less each kind's idle cores (heartbeats, /metrics polls, liveness: what it
        # costs with nothing to relay), measured for --idle-s before the load.
        "cpu_us_per_token_above_idle": {k: round(v * wall * 1e6 / tokens, 1) for k, v in busy.items()} if tokens else {},
        # Of cpu_us_per_token, what the kernel spent (system time: socket reads and writes).
        "sys_us_per_token": {k: round(v * wall * 1e6 / tokens, 1) for k, v in sys_cores.items()} if tokens else {},
        "cores": {k: round(v, 3) for k, v in cores.items()},
        "idle_cores": {k: round(v, 3) for k, v in idle_cores.items()},
    }


def table(results: dict[str, dict[str, Any]]) -> str:
    """Kinds as rows, configurations as columns: CPU-µs per token (above idle), cores."""
    configs = list(results)
    lines = ["| CPU-µs per relayed token (above idle; cores) | " + " | ".join(configs) + " |",
             "|---|" + "---:|" * len(configs)]

    def cell(r: dict[str, Any], kind: str) -> str:
        if kind not in r["cpu_us_per_token"]:
            return ""
        return f"{r['cpu_us_per_token'][kind]:.1f} ({r['cpu_us_per_token_above_idle'][kind]:.1f}; {r['cores'][kind]:.2f})"

    for kind in KINDS:
        if any(kind in r["cpu_us_per_token"] for r in results.values()):
            lines.append(f"| {kind} | " + " | ".join(cell(r, kind) for r in results.values()) + " |")

    def total(r: dict[str, Any], key: str) -> float:
        return sum(v for k, v in r[key].items() if k != "loadgen")

    lines.append("| all but loadgen | " + " | ".join(
        f"{total(r, 'cpu_us_per_token'):.1f} ({total(r, 'cpu_us_per_token_above_idle'):.1f})" for r in results.values()) + " |")
    for label, key in (("tokens/s", "tokens_per_s"), ("requests/s", "requests_per_s"), ("failed requests", "failed")):
        lines.append(f"| {label} | " + " | ".join(f"{r[key]:g}" for r in results.values()) + " |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="adapter,nats", help="comma-separated: adapter, nats")
    p.add_argument("--engines", type=int, default=4, help="engine servers (adapter) or NATS workers (nats)")
    p.add_argument("--concurrency", type=int, default=64, help="streams open at once (closed loop)")
    p.add_argument("--max-tokens", type=int, default=200, help="output tokens per request")
    p.add_argument("--time-scale", type=float, default=1.0, help="the simulated engine's speed (1: the profile's)")
    p.add_argument("--idle-s", type=float, default=5.0, help="the fleet's CPU with no load, measured first")
    p.add_argument("--warmup-s", type=float, default=5.0)
    p.add_argument("--duration-s", type=float, default=30.0, help="the measured window")
    p.add_argument("--kv-events", action="store_true", help="adapter: the servers publish vLLM KV events, agents read them")
    p.add_argument("--flexlb-args", default="", help="more flags for every `flexlb up`")
    p.add_argument("--request-timeout-s", type=float, default=120.0)
    p.add_argument("--startup-timeout-s", type=float, default=90.0)
    p.add_argument("--stop-timeout-s", type=float, default=20.0)
    p.add_argument("--label", default="", help="a name for this run, kept in the JSON (e.g. the code version)")
    p.add_argument("--out", default="bench/results/adapter_cost.json")
    args = p.parse_args(argv)
    args.configs_list = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = set(args.configs_list) - {"adapter", "nats"}
    if unknown:
        p.error(f"unknown configs {sorted(unknown)}; known: adapter, nats")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out: dict[str, Any] = {"label": args.label, "command": shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]]),
                           "machine": machine_facts(),
                           "params": {k: getattr(args, k) for k in ("engines", "concurrency", "max_tokens", "time_scale",
                                                                    "warmup_s", "duration_s", "kv_events", "flexlb_args")},
                           "results": {}}
    ok = True
    with tempfile.TemporaryDirectory(prefix="flexlb-adapter-cost-") as tmp:
        for config in args.configs_list:
            fleet = Fleet(config, args, Path(tmp))
            try:
                fleet.start()
                print(f"{config}: {args.concurrency} streams of {args.max_tokens} tokens, "
                      f"{args.warmup_s:g} s warm-up + {args.duration_s:g} s measured", flush=True)
                res = asyncio.run(drive(fleet, args))
            except Exception as exc:  # a configuration that did not run: reported, the others still run
                print(f"{config}: FAILED: {exc}", file=sys.stderr, flush=True)
                ok = False
                continue
            finally:
                res_stop = fleet.stop()
                stop_all()
            res["exit_codes"] = res_stop
            out["results"][config] = res
            ok = ok and res["failed"] == 0
            print(json.dumps(res), flush=True)
    if out["results"]:
        print(table(out["results"]))
    path = Path(args.out)
    if not path.is_absolute():
        path = REPO / path
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
