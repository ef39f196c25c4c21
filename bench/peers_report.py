"""Merge bench/peers.py reports of one workload and print their tables again, at any target.

    python bench/peers_report.py bench/results/peers_azure-code.json bench/results/peers_azure-code_pd.json \\
        --markdown --plot bench/results/peers_azure-code --cdf-rate 0.5
    python bench/peers_report.py bench/results/peers_mooncake.json --target 0.55   # 90 % of its 61 % ceiling

Why: configurations are run in several invocations (a PD fleet added later, a rerun of one
configuration), and where no configuration can reach 90 % (Mooncake with a 2 s TTFT: only
61 % of its requests could meet it alone on an idle engine) the headline is taken at a target
relative to that ceiling. The reports must describe the same workload (trace, rows, first row,
SLO, engines, time scale): a mismatch is an error, not a silent merge. Runs of the same
configuration label at the same multiplier: the later file wins. The CDF plot is drawn from
the per-request records (`--per-request` when the runs were made).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.peers import headline, plot, print_report  # noqa: E402

SAME = ("trace", "workload_rows", "first_row", "slo_ttft_ms", "slo_tpot_ms", "workers", "time_scale")


class ReportMismatch(ValueError):
    """Two reports describe different workloads."""


def identity(result: dict[str, Any]) -> dict[str, Any]:
    w, f = result["workload"], result["flags"]
    return {"trace": result["trace"], "workload_rows": w["rows"], "first_row": w["first_row"],
            "slo_ttft_ms": f["slo_ttft_ms"], "slo_tpot_ms": f["slo_tpot_ms"], "workers": f["workers"],
            "time_scale": f["time_scale"]}


def merge(results: list[dict[str, Any]], target: float) -> dict[str, Any]:
    base = dict(results[0])
    ident = identity(base)
    runs: dict[tuple[str, float], dict[str, Any]] = {}
    notes = list(base.get("notes_run", []))
    for res in results:
        other = identity(res)
        diff = {k: (ident[k], other[k]) for k in SAME if ident[k] != other[k]}
        if diff:
            raise ReportMismatch(f"reports differ in {diff}")
        for r in res["runs"]:
            if r.get("purpose") == "cdf" and (r["config"], r["multiplier"]) in runs:
                continue
            runs[(r["config"], r["multiplier"])] = r
        notes += [n for n in res.get("notes_run", []) if n not in notes]
    base["runs"] = list(runs.values())
    base["notes_run"] = notes
    base["flags"] = {**base["flags"], "target": target}
    kinds = {}
    for res in results:
        kinds.update({name: h.get("kind") for name, h in res.get("headline", {}).items()})
    base["headline"] = {}
    for label in dict.fromkeys(r["config"] for r in base["runs"]):
        mine = [r for r in base["runs"] if r["config"] == label]
        base["headline"][label] = headline(mine, target) | {"kind": kinds.get(label) or mine[0].get("kind"),
                                                            "runs": len(mine)}
    return base


def cdf_sets(result: dict[str, Any], rate: float) -> dict[str, dict[str, list[float]]]:
    out = {}
    for r in result["runs"]:
        if abs(r["multiplier"] - rate) > 1e-9 or "per_request" not in r:
            continue
        col = {c: i for i, c in enumerate(r["per_request_columns"])}
        ttft, tpot = [], []
        for x in r["per_request"]:
            ok = x[col["status"]] == 200 and x[col["error"]] is None and x[col["tokens"]] >= x[col["max_tokens"]]
            if not ok or x[col["ttft_ms"]] is None:
                continue
            ttft.append(x[col["ttft_ms"]])
            if x[col["max_tokens"]] > 1 and x[col["e2e_ms"]] is not None:
                tpot.append((x[col["e2e_ms"]] - x[col["ttft_ms"]]) / (x[col["tokens"]] - 1))
        out[r["config"]] = {"ttft": ttft, "tpot": tpot}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("reports", nargs="+", help="JSON reports of bench/peers.py (same workload)")
    ap.add_argument("--target", type=float, default=0.9, help="attainment a load must reach (default 0.9)")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--plot", metavar="PREFIX", help="PREFIX_attainment.png and (with --cdf-rate) PREFIX_cdf.png")
    ap.add_argument("--cdf-rate", type=float)
    ap.add_argument("--out", help="write the merged report here")
    args = ap.parse_args(argv)
    results = []
    for path in args.reports:
        try:
            results.append(json.loads(Path(path).read_text()))
        except (OSError, json.JSONDecodeError) as exc:
            print(f"error: cannot read report {path}: {exc}", file=sys.stderr)
            return 2
    try:
        merged = merge(results, args.target)
    except ReportMismatch as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print_report(merged, args.markdown)
    if args.plot:
        sets = cdf_sets(merged, args.cdf_rate) if args.cdf_rate is not None else {}
        print("plots:", ", ".join(plot(merged, args.plot, sets, args.cdf_rate)))
    if args.out:
        Path(args.out).write_text(json.dumps(merged, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
