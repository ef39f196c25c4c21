"""Golden journals: the core's calls in seeded virtual-time runs, kept under
tests/golden/journals/ so that a change meant to leave scheduling as it is (a refactor of the
core, its policies or batchers) is checked against what the code decided before it:
tests/unit/services/core/test_golden_journals.py replays each file and fails at the first decision that
differs.

    python bench/golden_journals.py            # (re)write every file
    python bench/golden_journals.py --check    # replay them (what the test does)

Each case is a slice of a public trace or a generated workload (../shared/data,
bench/workloads.py) re-run by services/whatif.py as bench/tune.py does (4 workers heard as
openai agents in front of simulated engines, SLO TTFT 2 s / TPOT 100 ms), at a load above
the shipped defaults' 90 % crossing so that the hold, its moves, give-ways and refusals,
backpressure and the gates all act. Shipped defaults in both engine modes, and every other
routing policy and batcher once; the `pd-` cases run 2 prefill and 2 decode workers, so that
the decode policies decide too. Rewrite the files only for a change that is meant to
change decisions, and say so in its commit.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.tune import build_settings, load_rows, run  # noqa: E402
from schemas import messages as m  # noqa: E402
from services.core.journal import replay  # noqa: E402

OUT = REPO / "tests" / "golden" / "journals"

# name: (workload, first row, rows, load multiplier, engine scheduler, bench/tune.py settings spec)
CASES: dict[str, tuple[str, int, int, float, str, str]] = {
    "default-vllm-azure-conv": ("azure-conv", 300, 160, 6.0, "vllm", "default"),
    "default-sglang-azure-conv": ("azure-conv", 300, 160, 6.0, "sglang", "default"),
    "default-vllm-long-conv": ("long-conv", 110, 50, 3.0, "vllm", "default"),
    "default-sglang-long-conv": ("long-conv", 110, 50, 3.0, "sglang", "default"),
    "cache-aware-fixed-window": ("chat", 0, 60, 1.5, "vllm",
                                 'cache-aware+fixed-window:{"wait_ms": 20, "batch_size_max": 4}'),
    "power-of-two-slo-budget": ("azure-code", 100, 80, 1.0, "vllm", "power-of-two+slo-budget"),
    "round-robin-least-loaded": ("azure-conv", 0, 120, 2.0, "sglang",
                                 'round-robin+fixed-window|{"decode_policy": "least-loaded"}'),
    "least-loaded-random": ("azure-conv", 0, 120, 2.0, "vllm",
                            'least-loaded+fixed-window|{"decode_policy": "random"}'),
    "random-round-robin": ("azure-code", 100, 80, 1.0, "sglang",
                           'random+slo-budget|{"decode_policy": "round-robin"}'),
    # Disaggregated (2 prefill + 2 decode workers): the decode policies decide too.
    "pd-default": ("azure-conv", 300, 120, 3.0, "vllm", "default"),
    "pd-decode-least-loaded": ("azure-conv", 300, 80, 2.0, "sglang", 'cost-based+slo-budget|{"decode_policy": "least-loaded"}'),
    "pd-decode-random": ("azure-conv", 300, 80, 2.0, "vllm", 'cost-based+slo-budget|{"decode_policy": "random"}'),
    "pd-decode-round-robin": ("azure-conv", 300, 80, 2.0, "vllm", 'cost-based+slo-budget|{"decode_policy": "round-robin"}'),
    "pd-pipeline": ("chat", 0, 40, 1.5, "vllm", 'pipeline+slo-budget|' + json.dumps({
        "prefill_policy_params": {"filters": [{"type": "gated"}, {"type": "tpot"}],
                                  "scorers": [{"type": "prefix-affinity", "weight": 2}, {"type": "predicted-ttft"},
                                              {"type": "fewest-pending", "weight": 0.5}]},
        "decode_policy": "pipeline",
        "decode_policy_params": {"scorers": [{"type": "kv-free"}], "picker": {"type": "power-of-two"}}})),
}


def record(name: str) -> list[bytes]:
    workload, start, rows, rate, scheduler, spec = CASES[name]
    envelopes = m.EnvelopeFactory("golden", "boot")
    out: list[bytes] = []

    def sink(op, now_ns, args, result):
        out.append(m.encode(envelopes.wrap(m.CoreRecorded(router_id="golden", op=op, now_ns=now_ns, args=args, out=result),
                                           now_ns)))

    roles = ["prefill", "prefill", "decode", "decode"] if name.startswith("pd-") else None
    run(load_rows(workload, start, rows), rate, build_settings(spec), 4, 2000.0, 100.0, 16384, roles=roles,
        scheduler=scheduler, journal=sink)
    return out


def read(path: Path) -> list[m.Envelope]:
    with gzip.open(path, "rb") as f:
        return [m.decode(line) for line in f if line.strip()]


def kinds(envs: list[m.Envelope]) -> Counter:
    """What a journal holds: its ops, and the admissions' and ticks' outcomes that matter here."""
    c: Counter = Counter()
    for env in envs:
        rec = env.payload
        c[rec.op] += 1
        if rec.op == "admit" and rec.out.get("ok") is False:
            c["admit.refused"] += 1
        if rec.op == "tick":
            c["tick.batches"] += len(rec.out.get("batches", []))
            c["tick.failures"] += len(rec.out.get("failures", []))
            c["tick.moves"] += len(rec.out.get("moves", []))
    return c


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="replay the files instead of writing them")
    ap.add_argument("cases", nargs="*", help=f"only these (default: all): {', '.join(CASES)}")
    args = ap.parse_args(argv)
    names = args.cases or list(CASES)
    unknown = [n for n in names if n not in CASES]
    if unknown:
        ap.error(f"unknown case(s) {unknown}; known: {', '.join(CASES)}")
    OUT.mkdir(parents=True, exist_ok=True)
    failed = 0
    for name in names:
        path = OUT / f"{name}.jsonl.gz"
        if not args.check:
            with gzip.open(path, "wb", compresslevel=9) as f:
                f.writelines(raw.rstrip(b"\n") + b"\n" for raw in record(name))
        envs = read(path)
        r = replay(envs)
        ok = not r.errors and r.first_divergence is None and r.matched == r.decisions
        failed += not ok
        c = kinds(envs)
        print(f"{name}: {len(envs)} records, {r.decisions} decisions, {r.matched} matched "
              f"({'ok' if ok else 'DIVERGED'}); batches {c['tick.batches']}, queue failures {c['tick.failures']}, "
              f"moves {c['tick.moves']}, refused at admission {c['admit.refused']}; {path.stat().st_size // 1024} KiB")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
