"""Virtual-time tuning: the scheduling core against the sim engine, no network, no wall clock.

    python bench/tune.py --trace mooncake --rows 400 --rates 0.5,1,1.5 \\
        --config 'cost-based+fixed-window' --config 'round-robin+fixed-window:{"wait_ms":0}' ...

Each configuration is `PREFILL_POLICY+BATCHER[:BATCHER_PARAMS_JSON][|ROUTER_SETTINGS_JSON]`,
built through `RouterSettings` exactly as `flexlb router` builds it (so the shipped
defaults are what `flexlb` alone means: `--config default`; `default|{...}` changes some
settings), or one of the peers' emulations (`PEERS`: the routers people run, re-built from
the core's own policies with their shipped parameters, dispatching every request at once,
admitting everything):
- `peer-cache_aware`: sglang-router / vllm-router cache_aware (cache_threshold 0.3, balance
  thresholds 64 and 1.5; its tree of routed prompts is the core's pending-prefix index);
- `peer-round_robin`, `peer-power_of_two` (loads fresh at every pick, unlike the real
  routers' 1 s poll of /get_load).
`--engine-scheduler vllm|sglang|both` picks the engine's scheduler (workers/engines/sim.py).
`--headline` prints, per engine mode and configuration, the highest load with attainment
>= 90 % (linear between the highest passing and the lowest failing rate) and its ratio to the
best peer emulation. The loop is
`services.whatif`'s: arrivals at trace time / rate, the core admits, routes and batches,
each formed batch goes to its worker's `SimEngine` (the engine the workers run), status
reports every 200 ms. It answers "which configuration, on which load" in seconds instead
of the minutes a wall-clock run takes (bench/peers.py), and it leaves out what only a real
run has: HTTP, NATS and Redis latency, the router's CPU, the peers' own code. Every
default it suggests is then checked with bench/peers.py.

SLO attainment here is over every arrival (a rejection is a miss): attained / requests,
with TTFT and TPOT targets sent per request (`--slo-ttft-ms` 2000, `--slo-tpot-ms` 100).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.workloads import load_workload  # noqa: E402
from services.core.scheduler import AdmitRequest  # noqa: E402
from services.settings import RouterSettings  # noqa: E402
from services.whatif import Arrival, Outcome, Recording, WorkerSpec, _simulate, refusal_cost, refusal_off  # noqa: E402

MS = 1_000_000


def load_rows(trace: str, start: int, rows: int, seed: int = 0) -> list[tuple[float, int, int, list[int]]]:
    """(arrival ms, prompt tokens, output tokens, block hashes of 16-token blocks) of a workload
    of bench/workloads.py (its prompts' own block hashes: prefix sharing as the engines see it)."""
    return [(r.ts_ms, r.input_length, r.max_tokens, r.block_hashes(16))
            for r in load_workload(trace, start, rows, seed=seed)]


PEERS = {
    "peer-cache_aware": ("cache-aware", {"cache_threshold": 0.3, "balance_abs_threshold": 64, "balance_rel_threshold": 1.5}),
    "peer-round_robin": ("round-robin", {}),
    "peer-power_of_two": ("power-of-two", {}),
}


def build_settings(spec: str) -> RouterSettings:
    if spec in PEERS:
        policy, params = PEERS[spec]
        return RouterSettings(prefill_policy=policy, prefill_policy_params=params, batcher="fixed-window",
                              batcher_params={"wait_ms": 0, "batch_size_max": 1}, slo_mode="best-effort")
    extra = {}
    if "|" in spec:
        spec, extra_json = spec.split("|", 1)
        extra = json.loads(extra_json)
    if spec == "default":
        return RouterSettings(**extra)
    params = {}
    if ":" in spec:
        spec, params_json = spec.split(":", 1)
        params = json.loads(params_json)
    policy, batcher = spec.split("+")
    return RouterSettings(prefill_policy=policy, batcher=batcher, batcher_params=params, **extra)


def net_of_refusal(rec: Recording, outcomes: dict[str, Outcome], agent: str) -> dict[str, int]:
    """The run's slo_unattainable refusals against the same arrivals re-run with refusal off
    (services/whatif.py `refusal_off`): how many of the refused would have met their SLO, how
    many requests that met it would then miss it, and the net change in met requests."""
    off: dict[str, Outcome] = {}
    _simulate(rec, refusal_off(rec.config), None, 200.0, 500.0, None, False, lambda: None, agent, off)
    refused = [r for r, o in outcomes.items() if o.code == "slo_unattainable"]
    return {"refused": len(refused), "would_meet": sum(1 for r in refused if off[r].attained),
            **refusal_cost(outcomes, off)}


def run(rows, rate: float, settings: RouterSettings, workers: int, slo_ttft: float, slo_tpot: float,
        num_kv_blocks: int, roles: list[str] | None = None, scheduler: str = "vllm", agent: str = "openai",
        refusal_net: bool = False, journal=None) -> dict:
    arrivals = [Arrival(int(t / rate * MS), AdmitRequest(request_id=f"r{i}", num_prompt_tokens=n, max_tokens=o,
                                                         block_hashes=tuple(h), slo_ttft_ms=slo_ttft, slo_tpot_ms=slo_tpot))
                for i, (t, n, o, h) in enumerate(rows)]
    roles = roles or ["pd_fusion"] * workers
    specs = [WorkerSpec(f"w{i}", role, num_kv_blocks, 16, 65536, 40960, 1.0, scheduler) for i, role in enumerate(roles)]
    rec = Recording(settings.scheduler_config(), arrivals, specs, [])
    outcomes: dict[str, Outcome] = {}
    res = _simulate(rec, rec.config, None, 200.0, 500.0, None, False, lambda: None, agent, outcomes, journal)
    if refusal_net:
        res["refusal_net"] = net_of_refusal(rec, outcomes, agent)
    span_s = (rows[-1][0] - rows[0][0]) / rate / 1000
    res["load_rps"] = round(len(rows) / span_s, 3) if span_s > 0 else float("nan")
    res["attainment"] = round(res["num_attained"] / len(rows), 4)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default="mooncake")
    ap.add_argument("--rows", type=int, default=400)
    ap.add_argument("--start-row", type=int, default=0)
    ap.add_argument("--rates", default="1")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--num-kv-blocks", type=int, default=16384)
    ap.add_argument("--roles", help="comma-separated role per worker (pd_fusion | prefill | decode); default all pd_fusion")
    ap.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    ap.add_argument("--slo-tpot-ms", type=float, default=100.0)
    ap.add_argument("--seed", type=int, default=0, help="the chat workload's seed")
    ap.add_argument("--config", action="append", default=[])
    ap.add_argument("--engine-scheduler", default="vllm", choices=["vllm", "sglang", "both"])
    ap.add_argument("--agent", default="openai", choices=["openai", "sim"],
                    help="what FlexLB hears: openai agents in front of engine servers (default, as it is judged) or its own sim workers")
    ap.add_argument("--headline", action="store_true", help="highest load at >= --target per config, vs the best peer")
    ap.add_argument("--target", type=float, default=0.9)
    ap.add_argument("--refusal-net", action="store_true",
                    help="per point, also re-run with refusal off: how many refused would have met their SLO, how many "
                         "that met would miss, the net change in met requests")
    ap.add_argument("--json", help="write every result here")
    args = ap.parse_args()
    rows = load_rows(args.trace, args.start_row, args.rows, args.seed)
    results = []
    modes = ["vllm", "sglang"] if args.engine_scheduler == "both" else [args.engine_scheduler]
    for mode, spec in [(m, c) for m in modes for c in args.config or ["default"]]:
        settings = build_settings(spec)
        for rate in [float(x) for x in args.rates.split(",")]:
            t0 = time.monotonic()
            r = run(rows, rate, settings, args.workers, args.slo_ttft_ms, args.slo_tpot_ms, args.num_kv_blocks,
                    args.roles.split(",") if args.roles else None, mode, args.agent, args.refusal_net)
            r.update(config=spec, mode=mode, rate=rate, wall_s=round(time.monotonic() - t0, 1))
            results.append(r)
            print(f"[{mode}] {spec[:60]:<60} x{rate:<5} {r['load_rps']:>7.2f} rps  att {r['attainment']:.3f}  "
                  f"ttft {r['ttft_ms']['mean']:>8.0f}/{r['ttft_ms']['p90']:>8.0f}  tpot {r['tpot_ms']['mean']:>6.1f}/"
                  f"{r['tpot_ms']['p90']:>6.1f}  hit {r['prefix_hit_rate']:.3f}  rej {r['rejected']}  ({r['wall_s']}s)"
                  + (" refusal off: {would_meet} of {refused} refused would meet, {others_lost} that met would miss, "
                     "net {net:+d}".format(**r["refusal_net"]) if "refusal_net" in r else ""), flush=True)
    if args.headline:
        print_headlines(results, modes, args.target)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


def highest_passing_load(points: list[tuple[float, float]], target: float) -> tuple[float | None, str]:
    """(load, how): linear between the highest passing load and the lowest failing one above it."""
    points = sorted(points)
    passing = [p for p in points if p[1] >= target]
    if not passing:
        return None, f"< {points[0][0]:.3g}"
    p = passing[-1]
    above = [q for q in points if q[0] > p[0] and q[1] < target]
    if not above:
        return p[0], f">= {p[0]:.3g}"
    f = above[0]
    return p[0] + (p[1] - target) / (p[1] - f[1]) * (f[0] - p[0]), "interpolated"


def print_headlines(results: list[dict], modes: list[str], target: float) -> None:
    for mode in modes:
        heads = {}
        for spec in dict.fromkeys(r["config"] for r in results if r["mode"] == mode):
            pts = [(r["load_rps"], r["attainment"]) for r in results if r["mode"] == mode and r["config"] == spec]
            heads[spec] = highest_passing_load(pts, target)
        best_peer = max((v for k, (v, _) in heads.items() if k in PEERS and v is not None), default=None)
        print(f"[{mode}] highest load at >= {target:.0%} (best peer emulation: {best_peer})")
        for spec, (v, how) in heads.items():
            ratio = f"{v / best_peer:.3f}" if v is not None and best_peer else "-"
            print(f"  {spec[:70]:<70} {('%.2f' % v) if v is not None else '-':>8} rps  {how:<14} x best peer {ratio}")


if __name__ == "__main__":
    sys.exit(main())
