"""Virtual-time tuning: the scheduling core against the sim engine, no network, no wall clock.

    python bench/tune.py --trace mooncake --rows 400 --rates 0.5,1,1.5 \\
        --config 'cost-based+fixed-window' --config 'round-robin+fixed-window:{"wait_ms":0}' ...

Each configuration is `PREFILL_POLICY+BATCHER[:BATCHER_PARAMS_JSON][|ROUTER_SETTINGS_JSON]`,
built through `RouterSettings` exactly as `flexlb router` builds it (so the shipped
defaults are what `flexlb` alone means: `--config default`). The loop is
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
import csv
import hashlib
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from services.core.scheduler import AdmitRequest  # noqa: E402
from services.settings import RouterSettings  # noqa: E402
from services.whatif import Arrival, Recording, WorkerSpec, _simulate  # noqa: E402

TRACES = {
    "mooncake": "../shared/data/mooncake_synthetic_trace.jsonl",
    "azure-conv": "../shared/data/AzureLLMInferenceTrace_conv_2023.csv",
    "azure-code": "../shared/data/AzureLLMInferenceTrace_code_2023.csv",
}
MS = 1_000_000


def _h(*parts: object) -> int:
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little") >> 1


def load_rows(trace: str, start: int, rows: int) -> list[tuple[float, int, int, list[int]]]:
    """(arrival ms, prompt tokens, output tokens, block hashes of 16-token blocks)."""
    path = (REPO / TRACES.get(trace, trace)).resolve()
    out = []
    if path.suffix == ".jsonl":
        with open(path) as f:
            lines = f.readlines()[start:start + rows]
        for line in lines:
            r = json.loads(line)
            n = min(int(r["input_length"]), 32000)
            ids = r["hash_ids"]
            # 16-token blocks inside 512-token hash blocks: shared exactly when the ids are
            hashes = [_h(tuple(ids[: b * 16 // 512 + 1]), b % 32) for b in range(n // 16)]
            out.append((float(r["timestamp"]), n, max(1, int(r["output_length"])), hashes))
    else:
        with open(path) as f:
            reader = list(csv.DictReader(f))[start:start + rows]
        t0 = None
        from datetime import datetime
        for i, r in enumerate(reader):
            ts = datetime.fromisoformat(r["TIMESTAMP"][:26]).timestamp() * 1000
            t0 = ts if t0 is None else t0
            n = min(int(r["ContextTokens"]), 32000)
            out.append((ts - t0, max(1, n), max(1, int(r["GeneratedTokens"])), [_h("row", start + i, b) for b in range(n // 16)]))
    t_first = out[0][0]
    return [(t - t_first, n, o, h) for t, n, o, h in out]


def build_settings(spec: str) -> RouterSettings:
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


def run(rows, rate: float, settings: RouterSettings, workers: int, slo_ttft: float, slo_tpot: float,
        num_kv_blocks: int, roles: list[str] | None = None) -> dict:
    arrivals = [Arrival(int(t / rate * MS), AdmitRequest(request_id=f"r{i}", num_prompt_tokens=n, max_tokens=o,
                                                         block_hashes=tuple(h), slo_ttft_ms=slo_ttft, slo_tpot_ms=slo_tpot))
                for i, (t, n, o, h) in enumerate(rows)]
    roles = roles or ["pd_fusion"] * workers
    specs = [WorkerSpec(f"w{i}", role, num_kv_blocks, 16, 65536, 40960, 1.0) for i, role in enumerate(roles)]
    rec = Recording(settings.scheduler_config(), arrivals, specs, [])
    res = _simulate(rec, rec.config, None, 200.0, 500.0, None, False, lambda: None)
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
    ap.add_argument("--config", action="append", default=[])
    ap.add_argument("--json", help="write every result here")
    args = ap.parse_args()
    rows = load_rows(args.trace, args.start_row, args.rows)
    results = []
    for spec in args.config or ["default"]:
        settings = build_settings(spec)
        for rate in [float(x) for x in args.rates.split(",")]:
            t0 = time.monotonic()
            r = run(rows, rate, settings, args.workers, args.slo_ttft_ms, args.slo_tpot_ms, args.num_kv_blocks,
                    args.roles.split(",") if args.roles else None)
            r.update(config=spec, rate=rate, wall_s=round(time.monotonic() - t0, 1))
            results.append(r)
            print(f"{spec[:60]:<60} x{rate:<5} {r['load_rps']:>7.2f} rps  att {r['attainment']:.3f}  "
                  f"ttft {r['ttft_ms']['mean']:>8.0f}/{r['ttft_ms']['p90']:>8.0f}  tpot {r['tpot_ms']['mean']:>6.1f}/"
                  f"{r['tpot_ms']['p90']:>6.1f}  hit {r['prefix_hit_rate']:.3f}  rej {r['rejected']}  ({r['wall_s']}s)",
                  flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
