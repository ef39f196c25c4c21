"""Merge bench/peers.py reports and render the benchmark matrix, at any target.

    python bench/peers_report.py bench/results/peers_azure-code.json bench/results/peers_azure-code_pd.json \\
        --markdown --plot bench/results/peers_azure-code --cdf-rate 0.5
    python bench/peers_report.py bench/results/peers_mooncake.json --target 0.55   # 90 % of its 61 % ceiling
    python bench/peers_report.py bench/results/peers_*_matrix.json --workload-target mooncake=0.55 \
        --markdown --plot bench/results/matrix

Why: configurations are run in several invocations (a PD fleet added later, a rerun of one
configuration, one workload per invocation), and where no configuration can reach 90 %
(Mooncake with a 2 s TTFT: only 61 % of its requests could meet it alone on an idle engine)
the headline is taken at a target relative to that ceiling (`--target`, or per workload
`--workload-target mooncake=0.55`).

Reports are grouped by workload (the trace, or `chat`, `long-conv`). The reports of one workload must
describe the same workload (rows, first row, prompt cap, chat parameters, SLO, engines, time
scale): a mismatch is an error, not a silent merge. Runs of the same cell (configuration and
engine mode) at the same load: the later file's runs replace the earlier file's (all its
repeats); with `--pool` they are kept as repeats of one another (a rerun made to measure the
spread: the headline then uses the mean, with the range beside it). Reports from before
engine modes (labels without `[MODE]`) ran every engine with the vLLM-like scheduler, and are
read as `CONFIG[vllm]`.

Output: per workload its runs table; then the matrix, a row per (engine mode, workload,
configuration): the headline (mean attainment per load; with repeats, the headlines of the
per-load min and max attainment in brackets), its fraction of the capacity bound (a headline
above the bound is flagged, and the exit status is 3), its ratio to the best peer router and
to direct round-robin of the same (mode, workload), and, at the highest passing load, the
prefix hit rate, TTFT and TPOT p50/p90/p99, misses by kind, requests per engine. The capacity
bound is recomputed with the current formula (bench/capacity.py) when a report carries an
older one or one for another target (the bound at a target t < 1 lets a router refuse the
costliest 1 - t of the requests), and its workload can be loaded again. `--plot PREFIX`:
attainment against load per (mode, workload) (bench/peers.py `plot`); the CDF plot is drawn from the per-request records
(`--per-request` when the runs were made).
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

from bench.capacity import EngineLimits, StepCosts  # noqa: E402
from bench.peers import DEFAULT_PROFILE, workload_capacity  # noqa: E402
from bench.peers_tables import (  # noqa: E402
    above_bound_banner,
    headline,
    matrix_rows,
    matrix_table,
    plot,
    render,
    report_header,
    runs_table,
    split_label,
)
from bench.workloads import CHAT_WORKLOADS, ChatParams, load_workload  # noqa: E402

SAME = ("trace", "workload_rows", "first_row", "max_prompt_tokens", "chat", "slo_ttft_ms", "slo_tpot_ms", "workers",
        "time_scale")
CAPACITY_FORMULA_VERSION = 2  # bench/capacity.py since issue 24 (one base per mixed step, prefill-first mode)


class ReportMismatch(ValueError):
    """Two reports describe different workloads."""


def identity(result: dict[str, Any]) -> dict[str, Any]:
    w, f = result["workload"], result["flags"]
    return {"trace": result["trace"], "workload_rows": w["rows"], "first_row": w["first_row"],
            "max_prompt_tokens": f.get("max_prompt_tokens", 32000), "chat": result.get("chat"),
            "slo_ttft_ms": f["slo_ttft_ms"], "slo_tpot_ms": f["slo_tpot_ms"], "workers": f["workers"],
            "time_scale": f["time_scale"]}


def normalized(result: dict[str, Any]) -> dict[str, Any]:
    """The report with every run and headline labelled CONFIG[MODE] and carrying its mode."""
    runs = []
    for r in result["runs"]:
        base, mode = split_label(r["config"], r)
        runs.append(r | {"config": f"{base}[{mode}]", "engine_mode": mode})
    heads = {}
    for label, h in result.get("headline", {}).items():
        base, mode = split_label(label, h)
        heads[f"{base}[{mode}]"] = h | {"engine_mode": mode}
    modes = list(dict.fromkeys([*(result.get("engine_modes") or []), *(r["engine_mode"] for r in runs)])) or ["vllm"]
    return result | {"runs": runs, "headline": heads, "engine_modes": modes}


def merge(results: list[dict[str, Any]], target: float, pool: bool = False) -> dict[str, Any]:
    """The reports of one workload as one report, headlines recomputed at `target`; with
    `pool`, runs of the same cell and load in several reports are repeats of one another."""
    results = [normalized(r) for r in results]
    base = dict(results[0])
    ident = identity(base)
    points: dict[tuple[str, float], list[dict[str, Any]]] = {}
    # (a run's own above-the-bound notes are dropped: the bound is re-checked below, at the target)
    notes = [n for n in base.get("notes_run", []) if "ABOVE the capacity bound" not in n]
    modes: list[str] = []
    capacity_by_mode: dict[str, Any] = {}
    lifetimes: dict[str, float] = {}
    for res in results:
        other = identity(res)
        diff = {k: (ident[k], other[k]) for k in SAME if ident[k] != other[k]}
        if diff:
            raise ReportMismatch(f"reports differ in {diff}")
        mine: dict[tuple[str, float], list[dict[str, Any]]] = {}
        for r in res["runs"]:
            if r.get("purpose") == "cdf" and (r["config"], r["multiplier"]) in points:
                continue
            mine.setdefault((r["config"], r["multiplier"]), []).append(r)
        if pool:
            for key, runs in mine.items():
                points.setdefault(key, []).extend(runs)
        else:
            points.update(mine)  # a later file's point replaces every repeat of the earlier one
        notes += [n for n in res.get("notes_run", []) if n not in notes and "ABOVE the capacity bound" not in n]
        modes += [m for m in res["engine_modes"] if m not in modes]
        capacity_by_mode.update(res.get("capacity_by_mode") or {})
        lifetimes.update(res["workload"].get("slice_lifetimes_by_mode") or {})
    if "vllm" in modes and "vllm" not in capacity_by_mode and base.get("capacity"):
        capacity_by_mode["vllm"] = base["capacity"]  # a report from before engine modes
    base["runs"] = [r for point in points.values() for r in point]
    base["notes_run"] = notes
    base["engine_modes"] = modes
    base["capacity_by_mode"] = capacity_by_mode
    base["workload"] = base["workload"] | {"slice_lifetimes_by_mode": lifetimes}
    base["flags"] = {**base["flags"], "target": target}
    kinds = {}
    for res in results:
        kinds.update({name: h.get("kind") for name, h in res.get("headline", {}).items()})
    base["headline"] = {}
    for label in dict.fromkeys(r["config"] for r in base["runs"]):
        mine = [r for r in base["runs"] if r["config"] == label]
        base["headline"][label] = headline(mine, target) | {"kind": kinds.get(label) or mine[0].get("kind"),
                                                            "engine_mode": mine[0]["engine_mode"], "runs": len(mine)}
    return base


def refresh_capacity(result: dict[str, Any]) -> list[str]:
    """Recompute, with the current bench/capacity.py, the bound of every engine mode whose
    figure is missing, from an older formula or for another target, when the workload loads
    again; the notes say what was recomputed or could not be."""
    # The bound at the report's target: a router need serve only that share of the requests.
    fraction = min(1.0, float(result["flags"].get("target", 1.0)))
    caps = {m: result["capacity_by_mode"].get(m) or {} for m in result["engine_modes"]}
    stale = [m for m, cap in caps.items() if cap.get("formula_version", 1) < CAPACITY_FORMULA_VERSION
             or cap.get("serve_fraction", 1.0) != fraction]
    if not stale:
        return []
    w, f, engine = result["workload"], result["flags"], result.get("engine", {})
    chat = result.get("chat")
    try:
        params = None
        if chat:
            knobs = {k: (tuple(v) if isinstance(v, list) else Path(v) if k == "lengths_path" else v)
                     for k, v in chat.items() if k != "seed"}
            params = ChatParams(**knobs)
        # a chat-family report (chat, long-conv): its own name with the stored params (fields a
        # report predates keep their defaults, which leave the workload as it was then)
        name = result["trace"] if chat else result.get("trace_path") or result["trace"]
        if chat and name not in CHAT_WORKLOADS:
            raise ValueError(f"chat parameters stored for {name!r}, not one of {', '.join(CHAT_WORKLOADS)}")
        rows = load_workload(name, w["first_row"], w["rows"], f.get("max_prompt_tokens", 32000),
                             seed=chat["seed"] if chat else 0, chat=params)
        costs = StepCosts.from_file(engine.get("profile") or DEFAULT_PROFILE)
        keys = ("max_num_batched_tokens", "max_num_seqs", "num_kv_blocks", "block_size_tokens", "max_seq_len_tokens",
                "max_prefill_tokens")
        limits = {k: engine[k] for k in keys if engine.get(k) is not None}
        for mode in stale:
            cap, lifetimes = workload_capacity(rows, costs, EngineLimits(
                scheduler=mode, chunked_prefill=engine.get("chunked_prefill", True), **limits), f["workers"],
                serve_fraction=fraction)
            result["capacity_by_mode"][mode] = cap.as_dict() | {"formula_version": CAPACITY_FORMULA_VERSION,
                                                                "recomputed_by": "bench/peers_report.py"}
            result["workload"]["slice_lifetimes_by_mode"][mode] = round(lifetimes, 2)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return [f"{result['trace']}: the capacity bound of {', '.join(stale)} is from an older formula and could not "
                f"be recomputed ({exc.__class__.__name__}: {exc})"]
    return [f"{result['trace']}: capacity bound of {', '.join(stale)} recomputed with the current formula "
            f"(bench/capacity.py), serving {fraction:.0%} of the requests (the target)"]


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


def group_by_workload(results: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    groups: dict[str, list[dict[str, Any]]] = {}
    for res in results:
        groups.setdefault(res["trace"], []).append(res)
    return groups


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("reports", nargs="+", help="JSON reports of bench/peers.py")
    ap.add_argument("--target", type=float, default=0.9, help="attainment a load must reach (default 0.9)")
    ap.add_argument("--workload-target", action="append", default=[], metavar="WORKLOAD=X",
                    help="another target for one workload, e.g. mooncake=0.55 (repeatable)")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--plot", metavar="PREFIX",
                    help="attainment plots per (mode, workload) and (with --cdf-rate) CDF plots; with several "
                         "workloads PREFIX_<workload>_...")
    ap.add_argument("--cdf-rate", type=float)
    ap.add_argument("--pool", action="store_true",
                    help="runs of one cell at one load in several reports are repeats (default: the later replaces)")
    ap.add_argument("--out", help="write the merged report(s) here (one workload: its report; several: a list)")
    args = ap.parse_args(argv)
    targets: dict[str, float] = {}
    for spec in args.workload_target:
        name, _, value = spec.partition("=")
        try:
            targets[name] = float(value)
        except ValueError:
            ap.error(f"--workload-target takes WORKLOAD=X, got {spec!r}")
    results = []
    for path in args.reports:
        try:
            results.append(json.loads(Path(path).read_text()))
        except (OSError, json.JSONDecodeError) as exc:
            print(f"error: cannot read report {path}: {exc}", file=sys.stderr)
            return 2
    merged = []
    notes: list[str] = []
    try:
        groups = group_by_workload(results)
        unknown = sorted(set(targets) - set(groups))
        if unknown:
            ap.error(f"--workload-target names {unknown}, which no report holds; reports: {sorted(groups)}")
        for name, group in groups.items():
            m = merge(group, targets.get(name, args.target), pool=args.pool)
            notes += refresh_capacity(m)
            merged.append(m)
    except ReportMismatch as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for m in merged:
        print("\n" + report_header(m))
        print(render(*runs_table(m), markdown=args.markdown))
    records = matrix_rows(merged)
    print()
    print(render(*matrix_table(records), markdown=args.markdown))
    for m in merged:
        for note in m["notes_run"]:
            print(f"note: {m['trace']}: {note}")
    for note in notes:
        print(f"note: {note}")
    if args.plot:
        written = []
        for m in merged:
            prefix = args.plot if len(merged) == 1 else f"{args.plot}_{m['trace']}"
            sets = cdf_sets(m, args.cdf_rate) if args.cdf_rate is not None else {}
            written += plot(m, prefix, sets, args.cdf_rate)
        print("plots:", ", ".join(written))
    if args.out:
        Path(args.out).write_text(json.dumps(merged[0] if len(merged) == 1 else merged, indent=1) + "\n")
    banner = above_bound_banner(records)
    if banner:
        print(banner)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
