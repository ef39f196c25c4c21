"""bench/peers.py's configurations: which fleet each name starts, and which flags reach it."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.peers import AdapterFleet, FlexlbFleet, SimFleet, make_fleet, parse_args


def fleet_of(argv: list[str]):
    args = parse_args(argv)
    return [(label, make_fleet(config, args, Path("/nonexistent"), "t")) for config, label in args.selected]


def test_flexlb_openai_runs_flexlb_in_front_of_the_peers_sim_servers():
    fleets = dict(fleet_of(["--configs", "flexlb,flexlb-openai,sglang-cache_aware"]))
    assert type(fleets["flexlb"]) is FlexlbFleet
    assert type(fleets["flexlb-openai"]) is AdapterFleet
    assert isinstance(fleets["flexlb-openai"], SimFleet)  # the same engines (and /metrics facts) as the peers
    assert type(fleets["sglang-cache_aware"]) is SimFleet


def test_flexlb_args_reach_the_adapter_configuration_and_label_it():
    labels = [label for label, _ in fleet_of(["--configs", "flexlb-openai", "--flexlb-args", "--batcher slo-budget",
                                              "--name", "slo"])]
    assert labels == ["slo"]
    both = [label for label, _ in fleet_of(["--configs", "flexlb,flexlb-openai", "--flexlb-args", "--batcher slo-budget",
                                            "--name", "slo"])]
    assert both == ["flexlb+slo", "flexlb-openai+slo"]


def test_the_adapter_serves_colocated_fleets_only():
    with pytest.raises(SystemExit):
        parse_args(["--configs", "flexlb-openai@3p1d"])
