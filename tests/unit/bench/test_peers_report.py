"""bench/peers_report.py and the report side of bench/peers.py: merging reports of one
workload, the headline at another target and over repeats, misses by kind, the matrix of
(engine mode, workload, configuration) cells, the capacity bound's flag. (One tiny
bench/peers.py run end to end: tests/integration/test_peers_report.py.)"""

from __future__ import annotations

import json

import pytest

from bench.loadgen import Rec
from bench.peers import parse_args, summarize_run
from bench.peers_report import ReportMismatch, cdf_sets, main, merge, refresh_capacity
from bench.peers_tables import headline, matrix_rows, matrix_table, points_text
from bench.workloads import load_workload


def report(runs, rows=600, kinds=None, trace="azure-conv", **extra):
    return {
        "trace": trace, "workload": {"rows": rows, "first_row": 0},
        "flags": {"slo_ttft_ms": 2000.0, "slo_tpot_ms": 100.0, "workers": 4, "time_scale": 1.0, "target": 0.9},
        "notes_run": [], "runs": runs,
        "headline": {name: {"kind": kind} for name, kind in (kinds or {}).items()}, **extra,
    }


def run(config, mult, load, att, **kw):
    return {"config": config, "multiplier": mult, "load_req_per_s": load, "attainment": att, **kw}


def test_merge_recomputes_the_headline_at_the_target_and_the_later_file_wins():
    a = report([run("flexlb", 3, 12.0, 0.95), run("flexlb", 4, 16.0, 0.75)], kinds={"flexlb": "flexlb"})
    b = report([run("flexlb", 4, 16.0, 0.85), run("sglang-round_robin", 3, 12.0, 0.5)],
               kinds={"sglang-round_robin": "sglang"})
    m = merge([a, b], 0.9)
    # reports from before engine modes ran every engine as vllm: their cells are CONFIG[vllm]
    h = m["headline"]["flexlb[vllm]"]
    # 3x passes (0.95), 4x fails with the later file's 0.85: 12 + (0.05 / 0.10) * 4 = 14 req/s
    assert h["bound"] == "interpolated" and h["value"] == pytest.approx(14.0) and h["runs"] == 2
    assert m["headline"]["sglang-round_robin[vllm]"]["bound"] == "below"
    assert m["headline"]["sglang-round_robin[vllm]"]["kind"] == "sglang"
    # at a lower target both flexlb loads pass
    assert merge([a, b], 0.8)["headline"]["flexlb[vllm]"]["bound"] == "at_least"


def test_a_later_files_point_replaces_every_repeat_of_the_earlier_one():
    a = report([run("flexlb[vllm]", 3, 12.0, 0.95, repeat=0), run("flexlb[vllm]", 3, 12.0, 0.99, repeat=1),
                run("flexlb[vllm]", 4, 16.0, 0.8, repeat=0), run("flexlb[vllm]", 4, 16.0, 0.9, repeat=1)])
    b = report([run("flexlb[vllm]", 4, 16.0, 0.7, repeat=0)])
    m = merge([a, b], 0.9)
    assert sorted((r["multiplier"], r["attainment"]) for r in m["runs"]) == [(3, 0.95), (3, 0.99), (4, 0.7)]


def test_pooled_reports_keep_every_run_of_a_point_as_repeats():
    a = report([run("flexlb[vllm]", 3, 12.0, 0.96), run("flexlb[vllm]", 4, 16.0, 0.91)])
    b = report([run("flexlb[vllm]", 3, 12.0, 0.92), run("flexlb[vllm]", 4, 16.0, 0.81)])
    m = merge([a, b], 0.9, pool=True)
    assert sorted((r["multiplier"], r["attainment"]) for r in m["runs"]) == [(3, 0.92), (3, 0.96), (4, 0.81), (4, 0.91)]
    h = m["headline"]["flexlb[vllm]"]
    # means 0.94 at 12 and 0.86 at 16: 14 req/s, the range from the per-load minimum and maximum
    assert h["value"] == pytest.approx(14.0) and h["runs"] == 4
    assert h["range"]["high"] == {"value": 16.0, "bound": "at_least"}
    assert merge([a, b], 0.9)["headline"]["flexlb[vllm]"]["value"] == pytest.approx(12 + 0.02 / 0.11 * 4)


def test_reports_of_different_workloads_are_refused():
    with pytest.raises(ReportMismatch, match="workload_rows"):
        merge([report([]), report([], rows=800)], 0.9)
    with pytest.raises(ReportMismatch, match="chat"):
        merge([report([], chat={"seed": 1}), report([], chat={"seed": 2})], 0.9)


def test_cdf_sets_take_only_complete_requests():
    cols = ["row", "target", "input_tokens", "max_tokens", "send_at_trace_ms", "late_wall_ms", "status", "error",
            "ttft_ms", "e2e_ms", "tokens", "attained"]
    per = [[0, 0, 10, 5, 0, 0, 200, None, 100.0, 500.0, 5, True],  # tpot (500 - 100) / 4 = 100
           [1, 0, 10, 5, 0, 0, 200, "stream:worker_failed", 90.0, None, 2, False],  # failed: left out
           [2, 0, 10, 1, 0, 0, 200, None, 80.0, 80.0, 1, True]]  # one token: TTFT only
    r = run("flexlb", 3, 12.0, 0.6, per_request_columns=cols, per_request=per)
    sets = cdf_sets(report([r]), 3)
    assert sets == {"flexlb": {"ttft": [100.0, 80.0], "tpot": [100.0]}}


def test_repeats_give_the_headline_of_the_mean_and_its_range():
    runs = [run("x", 3, 12.0, a, repeat=k) for k, a in enumerate((0.96, 0.92))] + \
           [run("x", 4, 16.0, a, repeat=k) for k, a in enumerate((0.91, 0.81))]
    h = headline(runs, 0.9)
    # means: 0.94 at 12, 0.86 at 16: 12 + 0.04 / 0.08 × 4 = 14
    assert h["value"] == pytest.approx(14.0)
    assert [(p["load"], p["attainment"], p["min"], p["max"], p["runs"]) for p in h["points"]] == \
        [(12.0, 0.94, 0.92, 0.96, 2), (16.0, 0.86, 0.81, 0.91, 2)]
    # per-load minimum: 0.92 → 0.81: 12 + 0.02 / 0.11 × 4; maximum: both pass: ≥ 16
    assert h["range"]["low"]["value"] == pytest.approx(12 + 0.02 / 0.11 * 4)
    assert h["range"]["high"] == {"value": 16.0, "bound": "at_least"}
    assert "range" not in headline(runs[:1] + runs[2:3], 0.9)
    assert points_text(h["points"]) == "12: 0.94 (0.92–0.96); 16: 0.86 (0.81–0.91)"


def test_misses_are_counted_by_kind():
    args = parse_args(["--slo-ttft-ms", "100", "--slo-tpot-ms", "10"])
    rows = load_workload("azure-code", 100, 6)
    m = [r.max_tokens for r in rows]
    assert all(x > 1 for x in m)

    def done(i, ttft_s, tpot_s):
        return Rec(i, 0, late_s=0.0, status=200, ttft_s=ttft_s, e2e_s=ttft_s + tpot_s * (m[i] - 1), tokens=m[i],
                   done=True)

    recs = [done(0, 0.05, 0.005),  # attained
            done(1, 0.5, 0.005),  # TTFT only
            done(2, 0.05, 0.05),  # TPOT only
            done(3, 0.5, 0.05),  # both
            Rec(4, 0, late_s=0.0, status=429, error="429:slo_unattainable"),
            Rec(5, 0, late_s=0.0, status=200, error="capped", ttft_s=0.01, tokens=1)]
    s = summarize_run(recs, rows, args, span_s=1.0)
    assert s["attained"] == 1
    assert s["misses"] == {"ttft_only": 1, "tpot_only": 1, "both": 1, "not_completed": 2}
    assert s["errors"] == {"429:slo_unattainable": 1, "capped": 1}


def full_run(config, mult, load, att, **kw):
    """A run with every field bench/peers.py writes for a successful one."""
    fields = {"ttft_ms": {"p50": 100.0, "p90": 200.0, "p99": 300.0}, "tpot_ms": {"p50": 30.0, "p90": 40.0, "p99": 50.0},
              "goodput_req_per_s": load * att, "errors": {}, "wall_s": 30.0, "client": {"cores": 0.1},
              "misses": {"ttft_only": 0, "tpot_only": 0, "both": 0, "not_completed": 0},
              "cpu": {"machine_busy_cores": {"mean": 0.5}, "saturated_fraction": 0.0, "foreign_cores": {"mean": 0.1}}}
    return run(config, mult, load, att, **(fields | kw))


def matrix_report(trace="azure-conv", lifetimes=12.0):
    """Two engine modes, a peer, direct round-robin and FlexLB; flexlb[sglang] above its bound."""
    runs = []
    for mode, values in (("vllm", {"flexlb": 0.95, "sglang-cache_aware": 0.91, "direct-round-robin": 0.93}),
                         ("sglang", {"flexlb": 0.97, "sglang-cache_aware": 0.7, "direct-round-robin": 0.95})):
        for config, att in values.items():
            runs.append(full_run(f"{config}[{mode}]", 2, 10.0, att, engine_mode=mode, repeat=0,
                                 engines={"prefix_hit_rate": 0.5, "requests_per_worker": {"w0": 5, "w1": 7}},
                                 misses={"ttft_only": 1, "tpot_only": 2, "both": 0, "not_completed": 1},
                                 errors={"429:slo_unattainable": 1}))
            runs.append(full_run(f"{config}[{mode}]", 4, 20.0, 0.5, engine_mode=mode, repeat=0))
    kinds = {"flexlb": "flexlb", "sglang-cache_aware": "sglang", "direct-round-robin": "direct"}
    return {
        "trace": trace, "machine": {"cores": 2},
        "workload": {"rows": 100, "first_row": 0, "recorded_rate_req_per_s": 5.0, "prompts_cut": 0,
                     "zero_load_slo_fraction_infinite_cache": 1.0,
                     "slice_lifetimes_by_mode": {"vllm": lifetimes, "sglang": lifetimes}},
        "flags": {"slo_ttft_ms": 2000.0, "slo_tpot_ms": 100.0, "workers": 2, "time_scale": 1.0, "target": 0.9,
                  "max_prompt_tokens": 32000},
        "notes_run": [], "runs": runs, "engine_modes": ["vllm", "sglang"],
        "capacity_by_mode": {"vllm": {"rate_req_per_s": 30.0, "formula_version": 2},
                             "sglang": {"rate_req_per_s": 11.0, "formula_version": 2}},
        "headline": {f"{c}[{m}]": {"kind": k, "engine_mode": m} for c, k in kinds.items() for m in ("vllm", "sglang")},
    }


def test_the_matrix_compares_cells_within_their_engine_mode_and_flags_the_bound():
    m = merge([matrix_report()], 0.9)
    recs = {(r["mode"], r["config"]): r for r in matrix_rows([m])}
    # vllm: flexlb 10 + 0.05 / 0.45 × 10 = 11.1; the peer 10 + 0.01 / 0.41 × 10; direct 10 + 0.03 / 0.43 × 10
    f, peer, direct = recs["vllm", "flexlb"], recs["vllm", "sglang-cache_aware"], recs["vllm", "direct-round-robin"]
    assert f["vs_best_peer"] == pytest.approx((10 + 0.05 / 0.45 * 10) / (10 + 0.01 / 0.41 * 10))
    assert f["vs_direct"] == pytest.approx((10 + 0.05 / 0.45 * 10) / (10 + 0.03 / 0.43 * 10))
    assert not f["above_bound"] and f["of_bound"] == pytest.approx(f["headline"]["value"] / 30.0)
    assert peer["vs_best_peer"] == pytest.approx(1.0) and direct["headline"]["bound"] == "interpolated"
    # sglang: the peer never passed (no best peer); flexlb's 10 + 0.07 / 0.47 × 10 = 11.5 is above the
    # bound of that mode, 11
    s = recs["sglang", "flexlb"]
    assert s["vs_best_peer"] is None and s["vs_direct"] == pytest.approx(
        (10 + 0.07 / 0.47 * 10) / (10 + 0.05 / 0.45 * 10))
    assert s["above_bound"] and s["of_bound"] == pytest.approx((10 + 0.07 / 0.47 * 10) / 11.0)
    assert s["stats"]["misses"] == {"ttft_only": 1, "tpot_only": 2, "both": 0, "not_completed": 1}
    cols, rows = matrix_table(list(recs.values()))
    text = {(r[0], r[2]): dict(zip(cols, r)) for r in rows}
    assert "ABOVE THE BOUND" in text["sglang", "flexlb"]["of bound"]
    assert text["vllm", "flexlb"]["TTFT p50/p90/p99"] == "100/200/300"
    assert text["vllm", "flexlb"]["missed TTFT/TPOT/both"] == "1/2/0"
    assert text["vllm", "flexlb"]["per engine"] == "5 7"
    assert text["vllm", "flexlb"]["attainment by load (min–max)"] == "10: 0.95; 20: 0.50"


def test_a_burst_slice_is_marked(tmp_path):
    m = merge([matrix_report(lifetimes=4.0)], 0.9)
    cols, rows = matrix_table(matrix_rows([m]))
    of_bound = {(r[0], r[2]): dict(zip(cols, r))["of bound"] for r in rows}
    assert of_bound["vllm", "flexlb"].endswith("(burst slice)")


def test_the_report_exits_3_and_says_so_when_a_headline_is_above_the_bound(tmp_path, capsys):
    path = tmp_path / "r.json"
    path.write_text(json.dumps(matrix_report()))
    other = tmp_path / "o.json"
    other.write_text(json.dumps(matrix_report(trace="chat")))
    assert main([str(path), str(other), "--markdown"]) == 3
    out = capsys.readouterr().out
    assert "HEADLINE ABOVE THE CAPACITY BOUND" in out and "flexlb[sglang]" in out
    matrix = [line for line in out.splitlines() if line.startswith("| sglang | chat 0+100 | flexlb |")]
    assert len(matrix) == 1  # one matrix over both workloads
    # below every bound: exit 0
    ok = matrix_report()
    ok["capacity_by_mode"]["sglang"]["rate_req_per_s"] = 40.0
    path.write_text(json.dumps(ok))
    assert main([str(path)]) == 0


def test_a_workload_can_have_its_own_target(tmp_path, capsys):
    paths = []
    for trace in ("azure-conv", "chat"):
        paths.append(tmp_path / f"{trace}.json")
        paths[-1].write_text(json.dumps(matrix_report(trace=trace)))
    main([*map(str, paths), "--workload-target", "chat=0.5", "--markdown"])
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines() if line.startswith("| vllm |")]
    assert {(r[1], r[3]) for r in rows} == {("azure-conv 0+100", "90%"), ("chat 0+100", "50%")}
    with pytest.raises(SystemExit):
        main([*map(str, paths), "--workload-target", "mooncake=0.55"])


def test_an_older_reports_bound_is_recomputed_with_the_current_formula():
    old = report([run("flexlb", 1, 4.0, 0.95)], rows=50, capacity={"rate_req_per_s": 18.4},
                 engine={"max_num_batched_tokens": 8192, "max_num_seqs": 256, "num_kv_blocks": 16384,
                         "block_size_tokens": 16, "max_seq_len_tokens": 40960, "chunked_prefill": True})
    old["flags"]["max_prompt_tokens"] = 32000
    m = merge([old], 0.9)
    notes = refresh_capacity(m)
    assert "recomputed" in notes[0]
    cap = m["capacity_by_mode"]["vllm"]
    assert cap["formula_version"] == 2 and cap["rate_req_per_s"] != 18.4 and cap["scheduler"] == "vllm"
    assert m["workload"]["slice_lifetimes_by_mode"]["vllm"] > 0
    # the bound is taken at the report's target: a router need serve only that share
    assert cap["serve_fraction"] == 0.9
    low = merge([old], 0.55)
    refresh_capacity(low)
    assert low["capacity_by_mode"]["vllm"]["serve_fraction"] == 0.55
    assert low["capacity_by_mode"]["vllm"]["rate_req_per_s"] > cap["rate_req_per_s"]


@pytest.mark.parametrize("trace", ["chat", "long-conv", "chat-before-long-conv"])
def test_a_chat_family_reports_rows_are_rebuilt_from_its_trace_name_and_stored_params(trace):
    import dataclasses

    from bench.capacity import EngineLimits, StepCosts
    from bench.peers import DEFAULT_PROFILE, chat_field, workload_capacity
    from bench.workloads import CHAT_WORKLOADS

    name = trace.removesuffix("-before-long-conv")
    params = dataclasses.replace(CHAT_WORKLOADS[name], mean_turns=5.0)
    stored = json.loads(json.dumps(chat_field(params, 3)))  # as the JSON file holds it
    if trace != name:  # a chat report written before ChatParams had long-conv's fields
        for k in ("session_context_tokens", "max_user_tokens", "max_session_prompt_tokens", "request_id_prefix"):
            del stored[k]
    engine = {"max_num_batched_tokens": 8192, "max_num_seqs": 256, "num_kv_blocks": 16384, "block_size_tokens": 16,
              "max_seq_len_tokens": 40960, "chunked_prefill": True}
    old = report([run("flexlb", 1, 4.0, 0.95)], rows=80, trace=name, capacity={"rate_req_per_s": 1.0},
                 engine=engine, chat=stored)
    old["flags"]["max_prompt_tokens"] = 32000
    m = merge([old], 0.9)
    assert "recomputed" in refresh_capacity(m)[0]
    costs, limits = StepCosts.from_file(DEFAULT_PROFILE), EngineLimits(scheduler="vllm", **engine)
    expected, _ = workload_capacity(load_workload(name, 0, 80, 32000, seed=3, chat=params), costs, limits, 4,
                                    serve_fraction=0.9)
    assert m["capacity_by_mode"]["vllm"]["rate_req_per_s"] == expected.rate_req_per_s
    # the other chat-family workload with the same seed is another workload, with another bound
    other = "chat" if name == "long-conv" else "long-conv"
    others, _ = workload_capacity(load_workload(other, 0, 80, 32000, seed=3), costs, limits, 4, serve_fraction=0.9)
    assert others.rate_req_per_s != expected.rate_req_per_s


def test_a_flexlb_runs_refusals_read_with_and_without_their_judgement_alone():
    from bench.peers import over_refusal_note
    from bench.peers_tables import refusals

    over = {"requests": 300, "refused": 21, "would_meet": 16, "over_refusal_rate": 0.0533, "others_lost": 36, "net": -15}
    assert refusals({"over_refusal": over}) == "21 (16 = 5.3%; net -15)"
    assert refusals({}) == "-"
    assert over_refusal_note({"over_refusal": over}).endswith("net -15 met)")
    over["marginal"] = {"at_no_cost": 7, "at_a_cost": 11, "would_miss": 3, "marginal_over_refusal_rate": 0.0233}
    assert refusals({"over_refusal": over}) == "21 (16 = 5.3%; net -15; alone 7 free)"
    assert over_refusal_note({"over_refusal": over}).endswith(
        "; each alone: 7 would have met at no cost to the others (2.33%), 11 at a cost")
    assert parse_args(["--marginal-over-refusal"]).marginal_over_refusal and not parse_args([]).marginal_over_refusal
