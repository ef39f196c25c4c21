"""LoRA-adapter affinity (services/core/lora.py) against random and round-robin placement, in
virtual time, with no servers.

The fleet: `--workers` workers (8), each with `--slots` adapter slots (4, LRU) and no limit on
concurrent sequences (a continuous-batching engine: a request's time does not depend on the
others'). `--adapters` adapters (32) with Zipf popularity p(k) ~ 1 / k^s, s = `--zipf` (1.0:
the most popular adapter gets 24.6 % of requests, about two workers' share of eight).
Arrivals are Poisson at each of `--rates` requests/s (8, 32, 96: 2, 8 and 24 requests in
flight per worker); each request's service time is exponential with mean `--service-s` (2 s),
plus `--load-s` (0.5 s) when its worker had to load the adapter. Every policy sees the same
arrivals, adapters and service times (one seed).

Policies: random (a uniform worker), round-robin, and affinity (`pick` with
`--max-load-ratio`, default LoraParams' 1.5, then a sweep of it; outstanding = requests in
flight on the worker). Every policy loads the adapter on the chosen worker when it
is missing (LRU eviction when the slots are full). Measured after `--warmup-s`: adapter loads
(count and per 1,000 requests), and max/mean over workers of requests served and of busy time
(the integral of requests in flight).

    python bench/lora.py [--rates 8,32,96] [--duration-s 3600] [--seed 1] [--out bench/results/lora.json]
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import print_table  # noqa: E402
from services.core.lora import AdapterWorker, LoraParams, pick, touch  # noqa: E402


def run(policy: str, args: argparse.Namespace, max_load_ratio: float) -> dict:
    rng = random.Random(args.seed)  # same arrivals, adapters and service times for every policy
    place_rng = random.Random(args.seed + 1)
    weights = [1.0 / (k ** args.zipf) for k in range(1, args.adapters + 1)]
    names = [f"a{k:02d}" for k in range(args.adapters)]
    ids = [f"w{i}" for i in range(args.workers)]
    loaded: list[tuple[str, ...]] = [() for _ in ids]
    inflight = [0] * args.workers
    served = [0] * args.workers
    busy = [0.0] * args.workers
    loads = 0
    requests = 0
    params = LoraParams(max_load_ratio=max_load_ratio)
    rr = itertools.cycle(range(args.workers))
    ends: list[tuple[float, int]] = []
    t = 0.0
    last = 0.0
    while t < args.duration_s:
        t += rng.expovariate(args.rate)
        adapter = rng.choices(names, weights)[0]
        service = rng.expovariate(1.0 / args.service_s)
        while ends and ends[0][0] <= t:
            end, w = heapq.heappop(ends)
            if end > args.warmup_s:
                for i in range(args.workers):
                    busy[i] += inflight[i] * (end - max(last, args.warmup_s))
                last = end
            inflight[w] -= 1
        if t > args.warmup_s:
            for i in range(args.workers):
                busy[i] += inflight[i] * (t - max(last, args.warmup_s))
            last = t
        if policy == "random":
            w = place_rng.randrange(args.workers)
        elif policy == "round-robin":
            w = next(rr)
        else:
            d = pick([AdapterWorker(ids[i], loaded[i], args.slots, inflight[i]) for i in range(args.workers)], adapter, params)
            w = ids.index(d.worker_id)
        loaded[w], _, did_load = touch(loaded[w], adapter, args.slots)
        if did_load:
            service += args.load_s
        inflight[w] += 1
        heapq.heappush(ends, (t + service, w))
        if t > args.warmup_s:
            requests += 1
            served[w] += 1
            loads += did_load
    mean_served = sum(served) / len(served)
    mean_busy = sum(busy) / len(busy)
    return {
        "policy": policy, "requests": requests, "adapter_loads": loads, "loads_per_1000": 1000 * loads / requests,
        "served_max_over_mean": max(served) / mean_served, "busy_max_over_mean": max(busy) / mean_busy,
        "served": served, "mean_in_flight": sum(busy) / (args.duration_s - args.warmup_s),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--adapters", type=int, default=32)
    p.add_argument("--zipf", type=float, default=1.0)
    p.add_argument("--rates", type=lambda v: [float(x) for x in v.split(",")], default=[8.0, 32.0, 96.0])
    p.add_argument("--max-load-ratio", type=float, default=LoraParams().max_load_ratio)
    p.add_argument("--service-s", type=float, default=2.0)
    p.add_argument("--load-s", type=float, default=0.5)
    p.add_argument("--duration-s", type=float, default=3600.0)
    p.add_argument("--warmup-s", type=float, default=60.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path("bench/results/lora.json"))
    a = p.parse_args()
    t0 = time.perf_counter()
    result: dict = {"params": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()}, "by_rate": {}}
    for rate in a.rates:
        a.rate = rate
        runs = [run(pol, a, a.max_load_ratio) for pol in ("random", "round-robin", "affinity")]
        sweep = [dict(run("affinity", a, r), max_load_ratio=r) for r in (1.1, 1.25, 1.5, 1.75, 2.0)]
        base = runs[0]["adapter_loads"]
        rows = []
        for r in runs + sweep:
            name = r["policy"] + (f" (max_load_ratio {r['max_load_ratio']})" if "max_load_ratio" in r else "")
            r["loads_vs_random"] = r["adapter_loads"] / base
            rows.append([name, f"{r['requests']:,}", f"{r['adapter_loads']:,}", f"{r['loads_per_1000']:.1f}", f"{100 * r['loads_vs_random']:.1f} %",
                         f"{r['served_max_over_mean']:.3f}", f"{r['busy_max_over_mean']:.3f}"])
        title = (f"LoRA placement: {a.adapters} adapters (Zipf {a.zipf}), {a.workers} workers x {a.slots} slots, "
                 f"{rate} req/s x {a.service_s} s ({rate * a.service_s / a.workers:.0f} in flight per worker)")
        print_table(title, ["policy", "requests", "adapter loads", "per 1,000", "vs random", "served max/mean", "busy max/mean"], rows,
                    left=("policy",))
        aff = runs[2]
        targets = {"loads_vs_random_le_0.2": aff["loads_vs_random"] <= 0.2, "served_max_over_mean_le_1.3": aff["served_max_over_mean"] <= 1.3,
                   "busy_max_over_mean_le_1.3": aff["busy_max_over_mean"] <= 1.3}
        print(f"targets (affinity, max_load_ratio {a.max_load_ratio}):", targets)
        result["by_rate"][str(rate)] = {"runs": runs, "sweep": sweep, "targets": targets}
    result["wall_s"] = time.perf_counter() - t0
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {a.out} ({result['wall_s']:.0f} s)")

if __name__ == "__main__":
    main()
