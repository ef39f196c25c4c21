"""The router's hot path beside sglang-router's: requests/s in front of instant engines, in one run.

    python bench/hotpath.py [--concurrency 1,32,256] [--duration-s 10] [--workers 2]
                            [--targets flexlb,sglang] [--flexlb-args "..."] [--out bench/results/hotpath.json]

Needs `wrk` (Debian/Ubuntu: `apt-get install wrk`), a compiled HTTP load generator, so the
generator is not the bottleneck: its own CPU time is measured (wait4 rusage of the wrk
process) and printed beside every figure; on this 2-core machine one wrk thread stays far
below one core while the router under test is at one core.

Targets, each started fresh, on this machine, with the same wrk command lines:
- `flexlb`: `flexlb up --workers K --time-scale 0` (NATS, Redis, the router, K simulated workers
  that take no time: every millisecond is control plane), plus `--flexlb-args`;
- `sglang`: K `flexlb sim-server --time-scale 0` processes (the same engine code behind its
  HTTP front, instant) and `python -m sglang_router.launch_router --policy round_robin`.

Workloads: a non-streaming 1-token completion, and a streaming 16-token one
(`"stream": true`; wrk reads the chunked SSE body to its end), at every `--concurrency` C
(wrk -t1 -cC, keep-alive). Printed per level: requests/s, latency p50/p99 (wrk's), non-2xx
responses and socket errors, tokens/s for streaming, and the CPU cores of wrk, the router
and the engines. The last table is FlexLB's requests/s over sglang-router's.
With `--router-time N` (FlexLB only), N more requests are sent one at a time (C = 1) after
the levels, and the router's own time of each is read from its decision record
(`/admin/requests/ID`): from its arrival at intake to the JetStream ack of its batch's
dispatch (`batch_dispatched`'s t_ms + `dispatch_ms`: admission, the batching window, the
Redis ledger reservation and the acked publish). Printed as p50/p90/p99; run it with
`--flexlb-args "--batch-wait-ms 0"` for the router's latency without a batching window.
Exit status 0 when every target started and every level ran.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

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
    machine_facts,
    proc_cpu_s,
    wait_http,
    wait_up_state,
)

MODEL = "flexlb-sim"
WORKLOADS = {
    "plain-1": {"prompt": "hello, instant engine", "max_tokens": 1, "stream": False},
    "stream-16": {"prompt": "hello, instant engine", "max_tokens": 16, "stream": True, "ignore_eos": True},
}


def wrk_script(body: dict, path: Path) -> Path:
    payload = json.dumps({**body, "model": MODEL})
    path.write_text('wrk.method = "POST"\n'
                    f"wrk.body = {json.dumps(payload)}\n"
                    'wrk.headers["Content-Type"] = "application/json"\n')
    return path


def parse_wrk(text: str) -> dict[str, Any]:
    def num(pattern: str) -> float | None:
        mo = re.search(pattern, text)
        return float(mo.group(1)) if mo else None

    def ms(value: str, unit: str) -> float:
        return float(value) * {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 6e4}[unit]

    lat = {f"p{q}": ms(v, u) for q, v, u in re.findall(r"^\s+(50|90|99)(?:\.000)?%\s+([\d.]+)(us|ms|s|m)\s*$", text, re.M)}
    errors = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", text)
    return {
        "requests_per_s": num(r"Requests/sec:\s+([\d.]+)"),
        "requests": num(r"(\d+) requests in"),
        "non_2xx": int(num(r"Non-2xx or 3xx responses: (\d+)") or 0),
        "socket_errors": sum(map(int, errors.groups())) if errors else 0,
        "latency_ms": lat,
    }


def proc_tree_cpu_s(pids: list[int]) -> float:
    return sum(proc_cpu_s(p) or 0.0 for p in pids)


def run_wrk(url: str, script: Path, c: int, duration_s: float, watch: dict[str, list[int]]) -> dict[str, Any]:
    argv = ["wrk", "-t1", f"-c{c}", f"-d{duration_s:g}s", "--latency", "-s", str(script), url + "/v1/completions"]
    before = {k: proc_tree_cpu_s(v) for k, v in watch.items()}
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.monotonic() - t0
    res = parse_wrk(out)
    res["wrk_exit"] = os.waitstatus_to_exitcode(status)
    res["cores"] = {"wrk": round((usage.ru_utime + usage.ru_stime) / wall, 3)}
    for k, v in watch.items():
        res["cores"][k] = round((proc_tree_cpu_s(v) - before[k]) / wall, 3)
    res["command"] = shlex.join(argv)
    if res["requests_per_s"] is None:
        res["raw"] = out[-2000:]
    return res


class Target:
    def __init__(self, name: str, args: argparse.Namespace, workdir: Path) -> None:
        self.name, self.args, self.workdir = name, args, workdir
        self.procs: list[Proc] = []
        self.url = ""
        self.watch: dict[str, list[int]] = {}

    def start(self) -> None:
        a, env = self.args, child_env(self.workdir)
        deadline = time.monotonic() + 120
        if self.name == "flexlb":
            state_file = self.workdir / "state.json"
            up = Proc("up", [*flexlb_exe(), "up", "--open-admin", "--workers", str(a.workers), "--time-scale", "0", "--port",
                             str(free_port()), "--state-file", str(state_file), *shlex.split(a.flexlb_args)],
                      self.workdir / "up.log", env)
            self.procs = [up]
            up.start()
            state = wait_up_state(up, state_file, deadline, 120)
            self.url = state["router_url"]
            wait_http(self.url + "/readyz", deadline, self.procs, lambda s, _: s == 200)
            pids = state.get("pids", {})
            self.watch = {"router": [p for k, p in pids.items() if k.startswith("router")],
                          "engines": [p for k, p in pids.items() if k.startswith("worker-")],
                          "nats+redis": [p for k, p in pids.items() if k in ("nats-server", "redis-server")]}
            return
        urls = []
        for i in range(a.workers):
            port = free_port()
            p = Proc(f"engine-{i}", [*flexlb_exe(), "sim-server", "--port", str(port), "--time-scale", "0",
                                     "--worker-id", f"w{i}", "--model-name", MODEL], self.workdir / f"sim-{i}.log", env)
            p.start()
            self.procs.append(p)
            urls.append(f"http://127.0.0.1:{port}")
        for u in urls:
            wait_http(u + "/health", deadline, self.procs, lambda s, _: s == 200)
        port = free_port()
        router = Proc("router", [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port",
                                 str(port), "--worker-urls", *urls, "--policy", "round_robin", "--log-level", "warn",
                                 "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
                                 "--worker-startup-check-interval", "1"], self.workdir / "router.log", env)
        router.start()
        self.procs.append(router)
        self.url = f"http://127.0.0.1:{port}"

        def ready(status, text):
            try:
                return status == 200 and int(json.loads(text).get("healthy_workers", -1)) >= a.workers
            except (ValueError, AttributeError, TypeError):
                return status == 200

        wait_http(self.url + "/readiness", deadline, self.procs, ready)
        self.watch = {"router": [router.pid], "engines": [p.pid for p in self.procs if p.name.startswith("engine-")]}

    def router_time(self, n: int) -> dict[str, Any]:
        """The router's own time per request at C = 1, from the decision records (module docstring)."""
        import httpx

        body = {**WORKLOADS["plain-1"], "model": MODEL}
        ms: list[float] = []
        with httpx.Client(timeout=30) as c:
            for i in range(n):
                rid = f"hotpath-{i}"
                r = c.post(self.url + "/v1/completions", json={**body, "request_id": rid})
                r.raise_for_status()
                rec = c.get(self.url + f"/admin/requests/{rid}").json()
                disp = [e for e in rec["timeline"] if e["event"] == "batch_dispatched"]
                ms.append(disp[0]["t_ms"] + disp[0]["dispatch_ms"])
        ms.sort()

        def q(p: float) -> float:
            return round(ms[min(len(ms) - 1, int(p * len(ms)))], 3)

        return {"requests": n, "router_ms": {"p50": q(0.5), "p90": q(0.9), "p99": q(0.99), "max": round(ms[-1], 3)}}

    def stop(self) -> dict[str, int | None]:
        return {p.name: p.stop(20) for p in reversed(self.procs)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--concurrency", default="1,32,256")
    p.add_argument("--duration-s", type=float, default=10.0)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--targets", default="flexlb,sglang")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--flexlb-args", default="", help="appended to `flexlb up`")
    p.add_argument("--router-time", type=int, default=0, metavar="N",
                   help="FlexLB: N sequential requests after the levels, the router's own time from their records")
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "hotpath.json"))
    args = p.parse_args(argv)
    if shutil.which("wrk") is None:
        print("bench/hotpath.py needs wrk (a compiled load generator): apt-get install wrk", file=sys.stderr)
        return 2
    levels = [int(x) for x in args.concurrency.split(",")]
    workloads = [w for w in args.workloads.split(",") if w]
    unknown = [w for w in workloads if w not in WORKLOADS]
    if unknown:
        p.error(f"unknown workloads {unknown}; known: {', '.join(WORKLOADS)}")
    workdir = Path(tempfile.mkdtemp(prefix="flexlb-hotpath-"))
    result: dict[str, Any] = {"benchmark": "bench/hotpath.py", "command": shlex.join([sys.executable, *sys.argv]),
                              "machine": machine_facts(), "levels": []}
    ok = True
    for name in args.targets.split(","):
        target = Target(name, args, workdir / name)
        (workdir / name).mkdir(parents=True)
        try:
            target.start()
            for wl in workloads:
                script = wrk_script(WORKLOADS[wl], workdir / name / f"{wl}.lua")
                run_wrk(target.url, script, 8, 2.0, target.watch)  # warm-up
                for c in levels:
                    res = run_wrk(target.url, script, c, args.duration_s, target.watch)
                    res |= {"target": name, "workload": wl, "concurrency": c}
                    if WORKLOADS[wl]["stream"] and res["requests_per_s"]:
                        res["tokens_per_s"] = round(res["requests_per_s"] * WORKLOADS[wl]["max_tokens"], 1)
                    ok &= res["requests_per_s"] is not None and res["wrk_exit"] == 0
                    result["levels"].append(res)
                    print(f"[{name} {wl} C={c}] {res['requests_per_s']} req/s, p50/p99 "
                          f"{res['latency_ms'].get('p50')}/{res['latency_ms'].get('p99')} ms, non-2xx {res['non_2xx']}, "
                          f"socket errors {res['socket_errors']}, cores {res['cores']}", flush=True)
            if name == "flexlb" and args.router_time > 0:
                result["router_time"] = target.router_time(args.router_time)
                print(f"[flexlb router time, C=1, {args.router_time} requests] {result['router_time']['router_ms']} ms",
                      flush=True)
        except Exception as exc:  # a target that does not start is a failed run, said so
            ok = False
            print(f"[{name}] failed: {exc!r}", file=sys.stderr)
        finally:
            result.setdefault("exit_codes", {})[name] = target.stop()
    by = {(r["target"], r["workload"], r["concurrency"]): r for r in result["levels"]}
    print("\nworkload   C     flexlb req/s  sglang req/s  ratio   wrk cores (flexlb/sglang)")
    for wl in workloads:
        for c in levels:
            f, s = by.get(("flexlb", wl, c)), by.get(("sglang", wl, c))
            fr, sr = (f or {}).get("requests_per_s"), (s or {}).get("requests_per_s")
            ratio = f"{fr / sr:.3f}" if fr and sr else "-"
            print(f"{wl:10s} {c:<5d} {fr or '-':>12} {sr or '-':>13} {ratio:>6}   "
                  f"{(f or {}).get('cores', {}).get('wrk', '-')}/{(s or {}).get('cores', {}).get('wrk', '-')}")
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
