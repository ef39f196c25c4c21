"""The report of bench/peers.py runs: each cell's headline (the highest load at the target
attainment), the runs table, the matrix (a row per engine mode, workload and configuration,
with its ratios to the best peer router and to direct round-robin), the banner for a
headline above the capacity bound, and the plots. Used by bench/peers.py after its runs and
by bench/peers_report.py over saved reports; bench/peers.py's docstring defines every column.

Not a harness: it reads report dicts (bench/results/peers_*.json) and runs nothing.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from bench.capacity import MIN_SLICE_LIFETIMES
from bench.common import fmt


# --------------------------------------------------------------------------- headlines
def load_points(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The successful runs of one cell grouped by load (multiplier): the mean attainment over
    the repeats, and its min and max (the run-to-run spread); sorted by load."""
    by_mult: dict[float, list[dict[str, Any]]] = {}
    for r in runs:
        if r.get("attainment") is not None and r.get("load_req_per_s"):
            by_mult.setdefault(r["multiplier"], []).append(r)
    pts = []
    for mult, rs in by_mult.items():
        atts = [r["attainment"] for r in rs]
        pts.append({"multiplier": mult, "load": rs[0]["load_req_per_s"], "attainment": round(sum(atts) / len(atts), 4),
                    "min": min(atts), "max": max(atts), "runs": len(rs)})
    return sorted(pts, key=lambda p: (p["load"], p["multiplier"]))


def crossing(pts: list[tuple[float, float, float]], target: float) -> dict[str, Any]:
    """Highest load with attainment ≥ target from (load, attainment, multiplier) points:
    linear between the highest passing load and the lowest failing load above it."""
    pts = sorted(pts)
    if not pts:
        return {"value": None, "bound": "none", "note": "no successful run"}
    passing = [p for p in pts if p[1] >= target]
    if not passing:
        lo = pts[0]
        return {"value": None, "bound": "below", "below_req_per_s": lo[0],
                "note": f"< {lo[0]:.3g} req/s: even the lowest load (×{lo[2]:g}) missed"}
    p = passing[-1]
    above = [q for q in pts if q[0] > p[0] and q[1] < target]
    non_monotonic = [q for q in pts if q[0] < p[0] and q[1] < target]
    out: dict[str, Any] = {"pass": {"load": p[0], "attainment": p[1], "multiplier": p[2]}}
    if non_monotonic:
        out["note_non_monotonic"] = f"{len(non_monotonic)} failing point(s) below the highest pass"
    if not above:
        out.update(value=p[0], multiplier=p[2], bound="at_least", note=f"≥ {p[0]:.3g} req/s: nothing higher failed")
        return out
    f = above[0]
    frac = (p[1] - target) / (p[1] - f[1]) if p[1] > f[1] else 0.0
    out.update(value=p[0] + frac * (f[0] - p[0]), multiplier=p[2] + frac * (f[2] - p[2]), bound="interpolated",
               fail={"load": f[0], "attainment": f[1], "multiplier": f[2]})
    return out


def headline(runs: list[dict[str, Any]], target: float) -> dict[str, Any]:
    """The cell's headline: `crossing` of the mean attainment per load. With repeats, `range`
    holds the headlines of the per-load minimum and maximum attainment (the spread's effect)."""
    pts = load_points(runs)
    out = crossing([(p["load"], p["attainment"], p["multiplier"]) for p in pts], target)
    out["points"] = pts
    if any(p["runs"] > 1 for p in pts):
        keep = ("value", "bound", "below_req_per_s")
        out["range"] = {side: {k: v for k, v in crossing([(p["load"], p[key], p["multiplier"]) for p in pts],
                                                         target).items() if k in keep}
                        for side, key in (("low", "min"), ("high", "max"))}
    return out


# --------------------------------------------------------------------------- report


def headline_text(h: dict[str, Any]) -> str:
    if h.get("bound") == "interpolated":
        return f"{h['value']:.3g}"
    if h.get("bound") == "at_least":
        return f"≥{h['value']:.3g}"
    if h.get("bound") == "below":
        return f"<{h['below_req_per_s']:.3g}"
    return "-"


def split_label(label: str, run_or_headline: dict[str, Any]) -> tuple[str, str]:
    """(configuration, engine mode) of a cell label `CONFIG[MODE]`; reports from before engine
    modes have neither the suffix nor the field, and ran every engine as "vllm" (its default)."""
    mode = run_or_headline.get("engine_mode")
    if label.endswith("]") and "[" in label:
        base, _, suffix = label[:-1].rpartition("[")
        return base, mode or suffix
    return label, mode or "vllm"


def capacity_of(result: dict[str, Any], mode: str) -> dict[str, Any] | None:
    """The capacity bound of the report's workload under an engine mode."""
    by_mode = result.get("capacity_by_mode")
    if by_mode is not None:
        return by_mode.get(mode)
    return result.get("capacity") if mode == "vllm" else None


def slice_lifetimes_of(result: dict[str, Any], mode: str) -> float | None:
    return (result["workload"].get("slice_lifetimes_by_mode") or {}).get(mode)


def workload_label(result: dict[str, Any]) -> str:
    w = result["workload"]
    return f"{result['trace']} {w['first_row']}+{w['rows']}"


def cell_stats(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Means over the repeats of one (cell, load): prefix hit rate, TTFT / TPOT percentiles,
    misses by kind, requests per engine."""
    ok = [r for r in runs if r.get("attainment") is not None]
    if not ok:
        return {}

    def mean(values: list[float | None]) -> float | None:
        v = [x for x in values if x is not None]
        return sum(v) / len(v) if v else None

    out: dict[str, Any] = {"runs": len(ok), "load": ok[0]["load_req_per_s"], "multiplier": ok[0]["multiplier"],
                           "hit_rate": mean([(r.get("engines") or {}).get("prefix_hit_rate") for r in ok])}
    for key in ("ttft_ms", "tpot_ms"):
        out[key] = {q: mean([(r.get(key) or {}).get(q) for r in ok]) for q in ("p50", "p90", "p99")}
    if all("misses" in r for r in ok):
        out["misses"] = {k: mean([r["misses"][k] for r in ok]) for k in ("ttft_only", "tpot_only", "both",
                                                                          "not_completed")}
    errors: Counter = Counter()
    per_worker: Counter = Counter()
    for r in ok:
        errors.update(r.get("errors") or {})
        per_worker.update((r.get("engines") or {}).get("requests_per_worker") or {})
    out["errors"] = {k: v / len(ok) for k, v in errors.most_common()}
    out["requests_per_worker"] = {k: v / len(ok) for k, v in sorted(per_worker.items())}
    return out


def matrix_rows(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per (engine mode, workload, configuration) cell, with its ratios to the best
    peer router and to direct round-robin of the same (mode, workload) group."""
    records = []
    for result in results:
        target = result["flags"]["target"]
        groups: dict[str, list[tuple[str, str, dict[str, Any]]]] = {}
        for label, h in result["headline"].items():
            base, mode = split_label(label, h)
            groups.setdefault(mode, []).append((label, base, h))
        for mode, cells in groups.items():
            peers = [h["value"] for _, _, h in cells if h.get("kind") in ("sglang", "vllm") and h.get("value")]
            best_peer = max(peers) if peers else None
            direct = next((h.get("value") for _, base, h in cells if base == "direct-round-robin"), None)
            cap = capacity_of(result, mode)
            bound = cap["rate_req_per_s"] if cap else None
            lifetimes = slice_lifetimes_of(result, mode)
            for label, base, h in cells:
                v = h.get("value")
                at = (h.get("pass") or {}).get("multiplier")
                mine = [r for r in result["runs"] if r["config"] == label]
                if at is None and mine:
                    at = min(r["multiplier"] for r in mine)
                stats = cell_stats([r for r in mine if at is not None and abs(r["multiplier"] - at) < 1e-9])
                records.append({
                    "mode": mode, "workload": workload_label(result), "trace": result["trace"], "config": base,
                    "label": label, "kind": h.get("kind"), "target": target, "headline": h,
                    "of_bound": v / bound if v and bound else None, "bound": bound,
                    "above_bound": bool(v and bound and v > bound),
                    "burst": lifetimes is not None and lifetimes < MIN_SLICE_LIFETIMES, "slice_lifetimes": lifetimes,
                    "vs_best_peer": v / best_peer if v and best_peer else None,
                    "vs_direct": v / direct if v and direct else None, "stats": stats,
                })
    return records


def points_text(points: list[dict[str, Any]]) -> str:
    """'LOAD: MEAN (MIN–MAX)' per load of a cell (the range only with repeats)."""
    return "; ".join(f"{p['load']:.3g}: {p['attainment']:.2f}"
                     + (f" ({p['min']:.2f}–{p['max']:.2f})" if p["runs"] > 1 else "") for p in points) or "-"


def matrix_table(records: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """The matrix: a row per (mode, workload, configuration). The load columns are the
    headline (mean attainment per load; with repeats, the headlines of the per-load min and
    max attainment in brackets) and every load's mean attainment (with repeats, its min and
    max); the detail columns are means over the repeats at the headline's highest passing
    load (else the lowest load run)."""
    cols = ["mode", "workload", "config", "target", "highest load at target (req/s)", "of bound", "vs best peer",
            "vs direct-rr", "attainment by load (min–max)", "at req/s", "hit rate", "TTFT p50/p90/p99", "TPOT p50/p90/p99",
            "missed TTFT/TPOT/both", "not completed", "per engine", "runs"]
    rows = []
    for rec in records:
        h, st = rec["headline"], rec["stats"]
        text = headline_text(h)
        if h.get("range"):  # the spread over repeats, when it moves the figure
            low, high = headline_text(h["range"]["low"]), headline_text(h["range"]["high"])
            text += f" ({low}–{high})" if (low, high) != (text, text) else " (no spread)"
        of_bound = f"{rec['of_bound']:.0%}" if rec["of_bound"] is not None else "-"
        if rec["above_bound"]:
            of_bound = f"⚠ {of_bound} ABOVE THE BOUND"
        elif rec["burst"] and rec["of_bound"] is not None:
            of_bound += " (burst slice)"
        m = st.get("misses")
        misses = "/".join(fmt(m[k], 0) for k in ("ttft_only", "tpot_only", "both")) if m else "-"
        errors = ", ".join(f"{k} {v:g}" for k, v in list(st.get("errors", {}).items())[:2])
        rows.append([
            rec["mode"], rec["workload"], rec["config"], f"{rec['target']:.0%}", text, of_bound,
            fmt(rec["vs_best_peer"], 2), fmt(rec["vs_direct"], 2), points_text(h.get("points") or []),
            fmt(st.get("load"), 2),
            fmt(st.get("hit_rate"), 3),
            "/".join(fmt(st["ttft_ms"][q], 0) for q in ("p50", "p90", "p99")) if st else "-",
            "/".join(fmt(st["tpot_ms"][q], 1) for q in ("p50", "p90", "p99")) if st else "-",
            misses, (f"{fmt(m['not_completed'], 0)}" if m else "-") + (f" ({errors})" if errors else ""),
            " ".join(f"{v:.0f}" for v in st.get("requests_per_worker", {}).values()) or "-",
            str(h.get("runs", 0)),
        ])
    return cols, rows


def refusals(engines: dict[str, Any]) -> str:
    """A FlexLB run's slo_unattainable refusals and how many of them would have met their SLO
    with refusal off (services/whatif.py over_refusal), as "N (M = x %)", and, where the run has
    it, the net change in requests meeting their SLO with refusal off ("; net -K") and, judged one
    by one (--marginal-over-refusal), how many would have met at no cost ("; alone F free");
    "-" for the peers."""
    over = engines.get("flexlb_over_refusal") or engines.get("over_refusal")
    if not over:
        return "-"
    net = f"; net {over['net']:+d}" if "net" in over else ""
    alone = f"; alone {over['marginal']['at_no_cost']} free" if over.get("marginal") else ""
    return f"{over['refused']} ({over['would_meet']} = {over['over_refusal_rate']:.1%}{net}{alone})"


def runs_table(result: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    cols = ["config", "×rate", "#", "req/s", "attain", "goodput", "TTFT p50", "p90", "p99", "TPOT p50", "p90", "p99",
            "missed T/P/both", "refused (would meet)", "hit rate", "per worker", "errors", "client cores",
            "machine cores (sat.)", "others' cores", "wall s"]
    rows = []
    for r in result["runs"]:
        rep = str(r.get("repeat", 0) + 1)
        if "attainment" not in r:
            rows.append([r["config"], fmt(r["multiplier"], 3), rep, fmt(r.get("load_req_per_s"), 2), "FAILED",
                         *["-"] * 15, fmt(r.get("wall_s"), 0)])
            continue
        e = r.get("engines", {})
        per_worker = " ".join(str(v) for v in (e.get("requests_per_worker") or {}).values())
        errors = ", ".join(f"{k} {v}" for k, v in list(r["errors"].items())[:3]) or "-"
        m = r.get("misses")
        cpu = r["cpu"]
        rows.append([r["config"], fmt(r["multiplier"], 3), rep, fmt(r["load_req_per_s"], 2), f"{r['attainment']:.3f}",
                     fmt(r["goodput_req_per_s"], 2), fmt(r["ttft_ms"]["p50"]), fmt(r["ttft_ms"]["p90"]),
                     fmt(r["ttft_ms"]["p99"]), fmt(r["tpot_ms"]["p50"], 1), fmt(r["tpot_ms"]["p90"], 1),
                     fmt(r["tpot_ms"].get("p99"), 1),
                     "/".join(str(m[k]) for k in ("ttft_only", "tpot_only", "both")) if m else "-",
                     refusals(e), fmt(e.get("prefix_hit_rate"), 3), per_worker or "-", errors, fmt(r["client"]["cores"], 2),
                     f"{fmt(cpu['machine_busy_cores']['mean'], 2)} ({fmt(cpu['saturated_fraction'], 2)})",
                     fmt(cpu["foreign_cores"]["mean"], 2), fmt(r["wall_s"], 0)])
    return cols, rows


def render(cols: list[str], rows: list[list[str]], markdown: bool = False) -> str:
    if markdown:
        lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" if i == 0 else "---:" for i in range(len(cols))) + "|"]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])
    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(cols)]
    out = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cols, widths)))]
    out += ["  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(r, widths))) for r in rows]
    return "\n".join(out)


def report_header(result: dict[str, Any]) -> str:
    w, f = result["workload"], result["flags"]
    modes = result.get("engine_modes") or ["vllm"]
    bounds = []
    for mode in modes:
        cap = capacity_of(result, mode)
        if cap is None:
            continue
        lifetimes = slice_lifetimes_of(result, mode)
        bounds.append(f"{mode} {cap['rate_req_per_s']:.3g} req/s (×{fmt(cap.get('multiplier'), 3)} the recorded rate, "
                      f"decode batch {fmt(cap.get('decode_batch_size'), 0)} by {cap.get('decode_batch_limited_by')}"
                      + (f"; the slice lasts {lifetimes:.1f} request lifetimes at it" if lifetimes is not None else "")
                      + ")")
    reuse = w.get("prefix_reuse_unbounded")
    return (f"{result['trace']}: {w['rows']} rows from row {w['first_row']} ({w['recorded_rate_req_per_s']} req/s "
            f"recorded; {w['prompts_cut']} prompts cut to {f['max_prompt_tokens']} tokens; prefix reuse with an "
            f"unbounded cache {fmt(reuse, 3)}), {f['workers']} engines, engine modes {', '.join(modes)}, time scale "
            f"{f['time_scale']:g}, SLO TTFT {f['slo_ttft_ms']:g} ms / TPOT {f['slo_tpot_ms']:g} ms, target "
            f"{f['target']:.0%} (reachable alone on an idle engine: {w['zero_load_slo_fraction_infinite_cache']:.1%}); "
            f"capacity bound {'; '.join(bounds) or '-'}; times in engine ms; {result['machine']['cores']} cores shared "
            f"by the client and every process")


def above_bound_banner(records: list[dict[str, Any]]) -> str | None:
    """A loud message naming every headline above its capacity bound; None when there is none."""
    above = [r for r in records if r["above_bound"]]
    if not above:
        return None
    lines = [f"  {r['label']} on {r['workload']}: {headline_text(r['headline'])} req/s > bound {r['bound']:.3g} "
             f"({r['of_bound']:.0%}; the slice lasts {fmt(r['slice_lifetimes'], 1)} request lifetimes at the bound)"
             for r in above]
    return ("!" * 78 + "\nHEADLINE ABOVE THE CAPACITY BOUND: no fleet sustains these loads, so these runs measured a "
            "burst (too short a slice) or the bound is wrong (bench/capacity.py). Replay a longer slice (--rows auto):\n"
            + "\n".join(lines) + "\n" + "!" * 78)


def print_report(result: dict[str, Any], markdown: bool) -> None:
    print("\n" + report_header(result))
    print(render(*runs_table(result), markdown=markdown))
    print()
    records = matrix_rows([result])
    print(render(*matrix_table(records), markdown=markdown))
    for note in result["notes_run"]:
        print(f"note: {note}")
    banner = above_bound_banner(records)
    if banner:
        print(banner)


def plot(result: dict[str, Any], prefix: str, cdf_sets: dict[str, dict[str, list[float]]],
         cdf_rate: float | None) -> list[str]:
    """PREFIX_attainment.png (one engine mode) or PREFIX_<mode>_attainment.png per mode:
    attainment vs load of every configuration, min-max bars over repeats; PREFIX_cdf.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    by_mode: dict[str, list[str]] = {}
    for label in dict.fromkeys(r["config"] for r in result["runs"]):
        run = next(r for r in result["runs"] if r["config"] == label)
        by_mode.setdefault(split_label(label, run)[1], []).append(label)
    for mode, labels in by_mode.items():
        fig, ax = plt.subplots(figsize=(9, 5.5))
        for name in labels:
            pts = load_points([r for r in result["runs"] if r["config"] == name])
            if pts:
                x, y = [p["load"] for p in pts], [p["attainment"] for p in pts]
                if any(p["runs"] > 1 for p in pts):
                    err = [[p["attainment"] - p["min"] for p in pts], [p["max"] - p["attainment"] for p in pts]]
                    ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=split_label(name, {})[0])
                else:
                    ax.plot(x, y, marker="o", label=split_label(name, {})[0])
        ax.axhline(result["flags"]["target"], color="grey", linestyle=":", linewidth=1)
        cap = capacity_of(result, mode)
        xmax = max([r["load_req_per_s"] for r in result["runs"] if r.get("load_req_per_s")] or [1.0])
        if cap is not None:
            bound = cap["rate_req_per_s"]
            if bound <= 2 * xmax:
                ax.axvline(bound, color="black", linestyle="--", linewidth=1, label=f"capacity bound {bound:.3g} req/s")
            else:
                ax.text(0.99, 0.02, f"capacity bound {bound:.3g} req/s (off the chart)", transform=ax.transAxes,
                        ha="right", fontsize=8)
        ax.set_xlabel("load (req/s)")
        ax.set_ylabel(f"SLO attainment (TTFT ≤ {result['flags']['slo_ttft_ms']:g} ms, TPOT ≤ "
                      f"{result['flags']['slo_tpot_ms']:g} ms)")
        ax.set_ylim(-0.02, 1.02)
        ax.set_title(f"{workload_label(result)} rows, {result['flags']['workers']} engines, engine mode {mode}")
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = f"{prefix}_attainment.png" if len(by_mode) == 1 else f"{prefix}_{mode}_attainment.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    if cdf_sets:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 5))
        for name, s in cdf_sets.items():
            for ax, key in ((a1, "ttft"), (a2, "tpot")):
                v = sorted(s[key])
                if v:
                    ax.plot(v, [(i + 1) / len(v) for i in range(len(v))], label=name)
        a1.set_xscale("log")
        a1.axvline(result["flags"]["slo_ttft_ms"], color="grey", linestyle=":")
        a2.axvline(result["flags"]["slo_tpot_ms"], color="grey", linestyle=":")
        a1.set_xlabel("TTFT (ms)")
        a2.set_xlabel("mean TPOT per request (ms)")
        for ax in (a1, a2):
            ax.set_ylabel("fraction of completed requests")
            ax.legend(fontsize=8)
        fig.suptitle(f"{result['trace']} at ×{cdf_rate:.3g} the recorded rate")
        fig.tight_layout()
        path = f"{prefix}_cdf.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written
