"""bench/peers_report.py: merging reports of one workload, the headline at another target."""

from __future__ import annotations

import pytest

from bench.peers_report import ReportMismatch, cdf_sets, merge


def report(runs, rows=600, kinds=None):
    return {
        "trace": "azure-conv", "workload": {"rows": rows, "first_row": 0},
        "flags": {"slo_ttft_ms": 2000.0, "slo_tpot_ms": 100.0, "workers": 4, "time_scale": 1.0, "target": 0.9},
        "notes_run": [], "runs": runs,
        "headline": {name: {"kind": kind} for name, kind in (kinds or {}).items()},
    }


def run(config, mult, load, att, **kw):
    return {"config": config, "multiplier": mult, "load_req_per_s": load, "attainment": att, **kw}


def test_merge_recomputes_the_headline_at_the_target_and_the_later_file_wins():
    a = report([run("flexlb", 3, 12.0, 0.95), run("flexlb", 4, 16.0, 0.75)], kinds={"flexlb": "flexlb"})
    b = report([run("flexlb", 4, 16.0, 0.85), run("sglang-round_robin", 3, 12.0, 0.5)],
               kinds={"sglang-round_robin": "sglang"})
    m = merge([a, b], 0.9)
    h = m["headline"]["flexlb"]
    # 3x passes (0.95), 4x fails with the later file's 0.85: 12 + (0.05 / 0.10) * 4 = 14 req/s
    assert h["bound"] == "interpolated" and h["value"] == pytest.approx(14.0) and h["runs"] == 2
    assert m["headline"]["sglang-round_robin"]["bound"] == "below"
    assert m["headline"]["sglang-round_robin"]["kind"] == "sglang"
    # at a lower target both flexlb loads pass
    assert merge([a, b], 0.8)["headline"]["flexlb"]["bound"] == "at_least"


def test_reports_of_different_workloads_are_refused():
    with pytest.raises(ReportMismatch, match="workload_rows"):
        merge([report([]), report([], rows=800)], 0.9)


def test_cdf_sets_take_only_complete_requests():
    cols = ["row", "target", "input_tokens", "max_tokens", "send_at_trace_ms", "late_wall_ms", "status", "error",
            "ttft_ms", "e2e_ms", "tokens", "attained"]
    per = [[0, 0, 10, 5, 0, 0, 200, None, 100.0, 500.0, 5, True],  # tpot (500 - 100) / 4 = 100
           [1, 0, 10, 5, 0, 0, 200, "stream:worker_failed", 90.0, None, 2, False],  # failed: left out
           [2, 0, 10, 1, 0, 0, 200, None, 80.0, 80.0, 1, True]]  # one token: TTFT only
    r = run("flexlb", 3, 12.0, 0.6, per_request_columns=cols, per_request=per)
    sets = cdf_sets(report([r]), 3)
    assert sets == {"flexlb": {"ttft": [100.0, 80.0], "tpot": [100.0]}}
