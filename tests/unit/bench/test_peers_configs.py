"""bench/peers.py's configurations: which fleet each name starts, which flags reach it, the
engine modes, the presets and how a slice and a search are chosen."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.capacity import MIN_SLICE_LIFETIMES, StepCosts
from bench.peers import (
    DEFAULT_PROFILE,
    QUICK_CONFIGS,
    QUICK_ROWS,
    choose_rows,
    engine_defaults,
    parse_args,
    search_runs,
    workload_capacity,
)
from bench.peers_fleet import AdapterFleet, FlexlbFleet, SimFleet, make_fleet


def fleet_of(argv: list[str]):
    args = parse_args(argv)
    args.sim_server_has_host = True
    return [(label, make_fleet(config, args, Path("/nonexistent"), "t")) for config, label in args.selected]


def test_flexlb_openai_runs_flexlb_in_front_of_the_peers_sim_servers():
    fleets = dict(fleet_of(["--configs", "flexlb,flexlb-openai,sglang-cache_aware"]))
    assert type(fleets["flexlb[vllm]"]) is FlexlbFleet
    assert type(fleets["flexlb-openai[vllm]"]) is AdapterFleet
    assert isinstance(fleets["flexlb-openai[vllm]"], SimFleet)  # the same engines (and /metrics facts) as the peers
    assert type(fleets["sglang-cache_aware[vllm]"]) is SimFleet


def test_flexlb_args_reach_the_adapter_configuration_and_label_it():
    labels = [label for label, _ in fleet_of(["--configs", "flexlb-openai", "--flexlb-args", "--batcher slo-budget",
                                              "--name", "slo"])]
    assert labels == ["slo[vllm]"]
    both = [label for label, _ in fleet_of(["--configs", "flexlb,flexlb-openai", "--flexlb-args", "--batcher slo-budget",
                                            "--name", "slo"])]
    assert both == ["flexlb+slo[vllm]", "flexlb-openai+slo[vllm]"]


def test_the_adapter_serves_colocated_fleets_only():
    with pytest.raises(SystemExit):
        parse_args(["--configs", "flexlb-openai@3p1d"])


def scheduler_of(argv: list[str]) -> str:
    return argv[argv.index("--scheduler") + 1]


def test_every_engine_of_a_cell_runs_the_cells_engine_mode():
    fleets = fleet_of(["--configs", "flexlb,flexlb-openai,sglang-cache_aware,flexlb@3p1d", "--engine-modes",
                       "vllm,sglang", "--max-prefill-tokens", "4096"])
    assert [label for label, _ in fleets] == [f"{c}[{m}]" for m in ("vllm", "sglang")
                                              for c in ("flexlb", "flexlb-openai", "sglang-cache_aware", "flexlb@3p1d")]
    for label, fleet in fleets:
        mode = label[label.index("[") + 1:-1]
        assert fleet.config.engine_mode == mode
        if type(fleet) is FlexlbFleet:  # `flexlb up` hands the flags to each of its NATS workers
            argv = fleet.up_argv(fleet.fleet_flags(), 8000, Path("/nonexistent/state.json"))
        else:  # each sim-server, the adapter's too (its `flexlb up --engine openai` runs no engine)
            argv = fleet.engine_argv(["flexlb", "sim-server"], 0, None, 9000, [])
        assert scheduler_of(argv) == mode
        assert argv[argv.index("--max-prefill-tokens") + 1] == "4096"
    pd = dict(fleets)["flexlb@3p1d[sglang]"]
    argv = pd.up_argv(pd.fleet_flags(), 8000, Path("/nonexistent/state.json"))
    assert argv[argv.index("--prefill") + 1] == "3" and scheduler_of(argv) == "sglang"


def test_the_default_engine_mode_is_vllm_and_a_bad_one_stops():
    assert [c.engine_mode for c, _ in parse_args(["--configs", "flexlb"]).selected] == ["vllm"]
    assert [lbl for _, lbl in parse_args(["--configs", "flexlb", "--engine-modes", "sglang,vllm,sglang"]).selected] \
        == ["flexlb[sglang]", "flexlb[vllm]"]
    for bad in ("fcfs", "vllm,fcfs", ","):
        with pytest.raises(SystemExit):
            parse_args(["--engine-modes", bad])


def test_quick_presets_only_what_was_not_given():
    args = parse_args(["--quick", "--trace", "azure-conv"])
    assert args.rows == QUICK_ROWS
    assert [c.name for c, _ in args.selected] == list(QUICK_CONFIGS)
    assert args.loads_of_bound is not None  # two loads as fractions of the bound, set once it is known
    mine = parse_args(["--quick", "--trace", "azure-conv", "--rows", "30", "--configs", "flexlb", "--rates", "2"])
    assert (mine.rows, [c.name for c, _ in mine.selected], mine.rate_list, mine.loads_of_bound) == \
        (30, ["flexlb"], [2.0], None)
    assert parse_args(["--trace", "azure-conv"]).rows == "auto"


def test_chat_knobs_build_its_parameters_and_refuse_other_traces():
    args = parse_args(["--trace", "chat", "--chat-tenants", "2", "--chat-turns", "3", "--chat-seed", "5"])
    assert (args.chat_params.num_tenants, args.chat_params.mean_turns, args.chat_seed) == (2, 3.0, 5)
    for bad in (["--trace", "azure-conv", "--chat-tenants", "2"], ["--trace", "chat", "--chat-tenants", "0"],
                ["--trace", "no-such-trace"], ["--repeat", "0"], ["--rows", "many"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


@pytest.mark.parametrize("trace", ["azure-conv", "chat"])
def test_auto_rows_replay_a_slice_that_lasts_the_minimum_lifetimes_at_every_modes_bound(trace):
    args = parse_args(["--trace", trace, "--engine-modes", "vllm,sglang"])
    costs = StepCosts.from_file(DEFAULT_PROFILE)
    limits, _, _ = engine_defaults(args)
    rows = choose_rows(args, costs, limits)
    for lim in limits.values():
        assert workload_capacity(rows, costs, lim, args.workers)[1] >= MIN_SLICE_LIFETIMES
    # and it is about the shortest: a quarter fewer rows fall short
    args.rows = int(len(rows) * 0.75)
    shorter = choose_rows(args, costs, limits)
    assert len(shorter) == args.rows
    assert min(workload_capacity(shorter, costs, lim, args.workers)[1] for lim in limits.values()) < MIN_SLICE_LIFETIMES


def test_a_search_steps_on_the_mean_attainment_of_each_points_repeats():
    args = parse_args(["--search", "--repeat", "2", "--search-start", "1", "--bisect", "1"])
    attainment = {1.0: (0.95, 0.93), 1.5: (0.97, 0.79), 1.25: (0.91, 0.92)}  # 1.5: mean 0.88 fails
    asked = []

    def run_point(mult):
        asked.append(mult)
        return [{"multiplier": mult, "attainment": a} for a in attainment[mult]]

    runs = search_runs(run_point, args, search_max=10.0)
    assert asked == [1.0, 1.5, 1.25]
    assert len(runs) == 6
