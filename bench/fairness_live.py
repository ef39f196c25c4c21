"""The noisy neighbour behind a real router (issue 27, 4): `flexlb up` on sim engines, a quiet
tenant at 0.25 x the fleet's capacity beside a noisy one at 2 x, with the fair queue (the
shipped default) and without it (`--fair-queue false`), in real time.

Runs, each on a fresh stack (`--workers` sim workers of `--max-num-seqs` sequences):
1. capacity: a closed loop of 2 x (workers x max_num_seqs) clients for `--capacity-s`; the
   completions per second it reaches;
2. quiet alone: the quiet tenant's Poisson arrivals at 0.25 x capacity for `--duration-s`;
3. noisy neighbour, fair queue on, for each `--buffers` (fair_engine_buffer): both tenants;
4. the same with the fair queue off.
With `--scenario backlogged` instead: four tenants of different request sizes (SIZES), each
at 1 x capacity, with the queue and without, then two tenants at 2 x weighted 4:1; per 60 s
window the cost tokens (input + 2 x output) of the requests each finished, Jain's index over
the tenants, and the weighted ratio.
Per run: the quiet tenant's TTFT p50 / p99 (of the requests sent after `--warmup-s`), its
refusals, the noisy tenant's refusals, and utilisation (completions per second over the
run against the capacity). Tenants by the `X-Flexlb-Tenant` header. Prompts of
`--prompt-chars` characters (the byte tokenizer: one token each), `--output-tokens` each.

    python bench/fairness_live.py [--workers 4] [--max-num-seqs 4] [--duration-s 60] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import Proc, UpStack, child_env, flexlb_exe, percentile, print_table  # noqa: E402
from services.infra import free_port  # noqa: E402


class Stack:
    def __init__(self, args, workdir: Path, *flags: str) -> None:
        state = workdir / f"state-{time.monotonic_ns()}.json"
        cmd = [*flexlb_exe(), "up", "--open-admin", "--port", str(free_port()), "--state-file", str(state), "--workers", str(args.workers),
               "--time-scale", str(args.time_scale), "--max-num-seqs", str(args.max_num_seqs), *flags]
        self.stack = UpStack(Proc("up", cmd, workdir / f"up-{time.monotonic_ns()}.log", child_env(workdir)), state, 120, 20)

    def __enter__(self) -> str:
        self.stack.start()
        return self.stack.url

    def __exit__(self, *exc) -> None:
        self.stack.stop()


# Scenario "backlogged": four tenants with different request sizes (prompt characters, output
# tokens), each sending at 1 x capacity, then two at 2 x with weights 4:1.
SIZES = {"t0": (1_500, 32), "t1": (3_000, 16), "t2": (500, 64), "t3": (1_000, 32), "heavy": (1_500, 32),
         "light": (1_500, 32)}


async def one(c: httpx.AsyncClient, url: str, tenant: str, i: int, args, out: list) -> None:
    chars, max_tokens = SIZES.get(tenant, (args.prompt_chars, args.output_tokens))
    prompt = f"{tenant} {i} " + "x" * chars
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True}
    t0 = time.perf_counter()
    rec = {"tenant": tenant, "sent": t0, "status": None, "ttft_s": None, "done": False, "prompt": len(prompt), "output": 0}
    out.append(rec)
    try:
        async with c.stream("POST", url + "/v1/completions", json=body, headers={"x-flexlb-tenant": tenant}) as r:
            rec["status"] = r.status_code
            rec["id"] = r.headers.get("x-request-id")
            if r.status_code != 200:
                rec["code"] = (await r.aread()).decode()[:120]
                return
            async for line in r.aiter_lines():
                if line.startswith("data: ") and '"text"' in line:
                    text = json.loads(line[6:])["choices"][0]["text"]
                    rec["output"] += len(text)  # (the byte tokenizer: one character is one token)
                    if rec["ttft_s"] is None and text:
                        rec["ttft_s"] = time.perf_counter() - t0
                if line == "data: [DONE]":
                    rec["done"] = True
                    rec["end"] = time.perf_counter()
    except httpx.HTTPError as exc:
        rec["code"] = f"client {exc.__class__.__name__}"


async def open_loop(url: str, rates: dict[str, float], args, seed: int) -> tuple[list[dict], float]:
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=4000, max_keepalive_connections=200)
    out: list[dict] = []
    async with httpx.AsyncClient(timeout=args.duration_s + 120, limits=limits) as c:
        tasks = []
        start = time.perf_counter()
        arrivals = []
        for tenant, rate in rates.items():
            t = rng.expovariate(rate)
            while t < args.duration_s:
                arrivals.append((t, tenant))
                t += rng.expovariate(rate)
        arrivals.sort()
        for i, (at, tenant) in enumerate(arrivals):
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(c, url, tenant, i, args, out)))
        await asyncio.gather(*tasks)
    for r in out:
        r["sent"] -= start
        if "end" in r:
            r["end"] -= start
    return out, start


async def closed_loop(url: str, clients: int, seconds: float, args) -> float:
    done = 0
    stop = time.perf_counter() + seconds
    limits = httpx.Limits(max_connections=clients + 10, max_keepalive_connections=clients + 10)
    async with httpx.AsyncClient(timeout=120, limits=limits) as c:
        async def loop(k: int) -> None:
            nonlocal done
            i = 0
            while time.perf_counter() < stop:
                out: list = []
                await one(c, url, "capacity", k * 100_000 + i, args, out)
                done += out[0]["done"] and out[0].get("end", stop + 1) <= stop
                i += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(loop(k) for k in range(clients)))
    return done / (time.perf_counter() - t0)


def summarize(recs: list[dict], args, capacity: float) -> dict:
    quiet = [r for r in recs if r["tenant"] == "quiet" and r["sent"] >= args.warmup_s]
    ttft = sorted(r["ttft_s"] for r in quiet if r["ttft_s"] is not None)
    done_in_window = sum(1 for r in recs if r["done"] and args.warmup_s <= r["end"] <= args.duration_s)
    util = done_in_window / max(args.duration_s - args.warmup_s, 1e-9) / capacity
    refused = {t: sum(1 for r in recs if r["tenant"] == t and r["status"] != 200) for t in ("quiet", "noisy")}
    return {"quiet_sent": len(quiet), "quiet_ttft_p50_s": percentile(ttft, 50), "quiet_ttft_p99_s": percentile(ttft, 99),
            "quiet_refused": refused["quiet"], "noisy_refused": refused["noisy"],
            "noisy_sent": sum(1 for r in recs if r["tenant"] == "noisy"), "utilisation": round(util, 4),
            "codes": sorted({r.get("code", "")[:60] for r in recs if r["status"] not in (200, None)})[:5]}


def served_cost(recs: list[dict], lo: float, hi: float, w_out: float = 2.0) -> dict[str, float]:
    """Cost tokens (input + w_out x output) of the requests finished in [lo, hi), per tenant."""
    out: dict[str, float] = {}
    for r in recs:
        if r["done"] and lo <= r["end"] < hi:
            out[r["tenant"]] = out.get(r["tenant"], 0.0) + r["prompt"] + w_out * r["output"]
    return out


def jain(values: list[float]) -> float:
    return sum(values) ** 2 / (len(values) * sum(v * v for v in values)) if any(values) else 0.0


def backlogged(args, workdir: Path, capacity: float, report: dict) -> None:
    """Four backlogged tenants of different sizes; then weights 4:1 (module docstring)."""
    window = 60.0
    args.duration_s = args.warmup_s + 2 * window
    for name, flags, rates in (
            ("four tenants", [], {t: capacity for t in ("t0", "t1", "t2", "t3")}),
            ("four tenants, queue off", ["--fair-queue", "false"], {t: capacity for t in ("t0", "t1", "t2", "t3")}),
            ("weights 4:1", ["--tenant-weights", json.dumps({"heavy": 4})], {"heavy": 2 * capacity, "light": 2 * capacity})):
        with Stack(args, workdir, *flags) as url:
            recs, _ = asyncio.run(open_loop(url, rates, args, args.seed))
        windows = []
        for k in range(2):
            lo = args.warmup_s + k * window
            cost = served_cost(recs, lo, lo + window)
            windows.append({t: round(cost.get(t, 0.0)) for t in rates})
        row = {"windows": windows, "jain": [round(jain(list(w.values())), 4) for w in windows]}
        if "heavy" in rates:
            row["heavy_to_light"] = [round(w["heavy"] / max(w["light"], 1), 3) for w in windows]
        report["runs"][name] = row
        print(f"{name}: {row}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--max-num-seqs", type=int, default=4)
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--prompt-chars", type=int, default=1500)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--duration-s", type=float, default=60.0)
    ap.add_argument("--warmup-s", type=float, default=10.0)
    ap.add_argument("--capacity-s", type=float, default=20.0)
    ap.add_argument("--buffers", default="0,2")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--scenario", choices=["noisy", "backlogged"], default="noisy")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="fairness-live-"))
    report: dict = {"bench": "fairness_live", "args": {k: str(v) for k, v in vars(args).items()}, "runs": {}}
    with Stack(args, workdir) as url:
        capacity = asyncio.run(closed_loop(url, 2 * args.workers * args.max_num_seqs, args.capacity_s, args))
    print(f"capacity: {capacity:.2f} completions/s", flush=True)
    report["capacity_per_s"] = round(capacity, 3)
    if args.scenario == "backlogged":
        backlogged(args, workdir, capacity, report)
        if args.out:
            args.out.write_text(json.dumps(report, indent=2) + "\n")
            print(f"wrote {args.out}")
        return
    quiet_rate, noisy_rate = 0.25 * capacity, 2.0 * capacity
    with Stack(args, workdir) as url:
        recs, _ = asyncio.run(open_loop(url, {"quiet": quiet_rate}, args, args.seed))
    alone = summarize(recs, args, capacity)
    report["runs"]["alone"] = alone
    print(f"alone: {alone}", flush=True)
    configs = [(f"fair buffer {b}", ["--fair-engine-buffer", b]) for b in args.buffers.split(",")]
    configs.append(("fair queue off", ["--fair-queue", "false"]))
    for name, flags in configs:
        with Stack(args, workdir, *flags) as url:
            recs, _ = asyncio.run(open_loop(url, {"quiet": quiet_rate, "noisy": noisy_rate}, args, args.seed))
        row = summarize(recs, args, capacity)
        row["p99_vs_alone"] = round(row["quiet_ttft_p99_s"] / alone["quiet_ttft_p99_s"], 2) if row["quiet_ttft_p99_s"] else None
        report["runs"][name] = row
        print(f"{name}: {row}", flush=True)
    rows = [[name, f"{r['quiet_ttft_p50_s']:.3f}", f"{r['quiet_ttft_p99_s']:.3f}", str(r.get("p99_vs_alone", 1.0)),
             f"{r['quiet_refused']} / {r['quiet_sent']}", f"{r.get('noisy_refused', 0)}", f"{r['utilisation'] * 100:.1f} %"]
            for name, r in report["runs"].items()]
    print_table(f"noisy neighbour on {args.workers} sim workers x {args.max_num_seqs} seqs, capacity {capacity:.2f}/s",
                ["run", "quiet p50 s", "quiet p99 s", "p99 / alone", "quiet refused", "noisy refused", "util"], rows,
                left=("run",))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
