"""Scheduling as a pipeline (services/core/pipeline/): filters drop with their names on the
cards, scorers' weighted scores sum, the picker chooses; configuration is strict; plugins are
found by name, one per file; a scheduling config file sets a stage's pipeline."""

from __future__ import annotations

import json
import random

import pytest

from services.core.pipeline import FILTERS, PICKERS, SCORERS, Pipeline, PipelineParams
from services.core.policies import build_policy
from services.core.policies.protocol import Candidate, RouteContext
from services.settings import RouterSettings, SettingsError, load
from tests import REPO
from tests.unit.services.core.test_policies import make_worker

PIPELINE_DIR = REPO / "services" / "core" / "pipeline"


def cand(worker_id: str, **kw) -> Candidate:
    return Candidate(worker=make_worker(worker_id), **{"kv_total_tokens": 1000, "kv_available_tokens": 1000, **kw})


def ctx(cands, n=1000, slo=0.0, tpot_limit=0.0, seed=0) -> RouteContext:
    return RouteContext("r", n, 10, list(cands), 0, random.Random(seed), n // 16, slo, tpot_limit)


def pipeline(**config) -> Pipeline:
    return build_policy("prefill", "pipeline", config)


def test_every_plugin_file_holds_one_plugin_found_by_its_name():
    """Adding a plugin is adding its file: the registries hold one per module of their folder."""
    for table, folder in ((FILTERS, "filters"), (SCORERS, "scorers"), (PICKERS, "pickers")):
        modules = {p.stem for p in (PIPELINE_DIR / folder).glob("*.py")} - {"__init__"}
        assert len(table) == len(modules), (folder, sorted(table), sorted(modules))
        assert all(cls.__module__.rsplit(".", 1)[1] in modules for cls in table.values())


def test_a_new_scorer_is_one_file_and_one_line_of_configuration():
    """The README's example: kv-free (scorers/kv_free.py) named in the configuration moves the
    pick to the worker with the most free KV; without it, fewest pending decides."""
    cands = [cand("a", num_pending=0, kv_available_tokens=100), cand("b", num_pending=1, kv_available_tokens=900)]
    base = {"scorers": [{"type": "fewest-pending"}]}
    assert pipeline(**base).select(ctx(cands)).worker_id == "a"
    with_kv = {"scorers": [{"type": "fewest-pending"}, {"type": "kv-free", "weight": 2}]}  # the one line
    pick = pipeline(**with_kv).select(ctx(cands))
    assert pick.worker_id == "b"
    card = {s.worker_id: s for s in pick.scores}
    assert card["b"].components["score.kv-free"] == 0.9 and card["a"].components["score.fewest-pending"] == 1.0
    assert card["b"].score == pytest.approx(0.5 + 2 * 0.9)


def test_filters_drop_in_order_and_name_themselves_on_the_cards():
    cands = [cand("a", gated=True, tpot_ms=500), cand("b", tpot_ms=500), cand("c", tpot_ms=10, num_pending=3),
             cand("d", prefill_ms=3000)]
    p = pipeline(filters=[{"type": "gated"}, {"type": "tpot"}, {"type": "slo-ttft", "parameters": {"margin_ms": 0}}],
                 scorers=[{"type": "fewest-pending"}])
    pick = p.select(ctx(cands, slo=2000, tpot_limit=90))
    assert pick.worker_id == "c"
    assert {s.worker_id: s.filtered_by for s in pick.scores} == {"a": "gated", "b": "tpot", "c": None, "d": "slo-ttft"}
    none = p.select(ctx(cands[:2], tpot_limit=90))
    assert none.worker_id is None and none.reason == "every candidate filtered (1 by gated, 1 by tpot)"


def test_the_picker_breaks_ties_by_wait_then_id_and_round_robin_keeps_its_place():
    cands = [cand("b", wait_ms=5), cand("a", wait_ms=5), cand("c", wait_ms=1)]
    assert pipeline(scorers=[{"type": "fewest-pending"}]).select(ctx(cands)).worker_id == "c"
    assert pipeline(scorers=[{"type": "fewest-pending"}]).select(ctx(cands[:2])).worker_id == "a"
    rr = pipeline(picker={"type": "round-robin"})
    first = rr.select(ctx(cands))
    assert rr.select(ctx(cands)).worker_id == first.worker_id == "a"  # select alone changes nothing
    rr.record(first)
    assert rr.select(ctx(cands)).worker_id == "b"


@pytest.mark.parametrize("config,fragment", [
    ({"scorers": [{"type": "nope"}]}, "unknown scorer 'nope'"),
    ({"filters": [{"type": "gated", "weight": 2}]}, "a filter has no weight"),
    ({"scorers": [{"type": "kv-free", "weight": -1}]}, "weight must be >= 0"),
    ({"filters": [{"type": "slo-ttft", "parameters": {"margin_ms": "1"}}]}, "margin_ms"),
    ({"filters": [{"type": "slo-ttft", "parameters": {"margin": 1}}]}, "margin"),
    ({"picker": {"type": "max-score", "extra": 1}}, "extra"),
])
def test_bad_pipeline_configuration_fails_naming_what(config, fragment):
    with pytest.raises(ValueError, match=fragment):
        build_policy("prefill", "pipeline", config)


def test_a_scheduling_config_file_sets_a_stages_pipeline(tmp_path):
    path = tmp_path / "scheduling.yaml"
    path.write_text("prefill:\n  filters: [{type: gated}]\n  scorers:\n    - {type: prefix-affinity, weight: 2}\n"
                    "    - {type: fewest-pending}\n  picker: {type: max-score}\n")
    s = load(RouterSettings, {"FLEXLB_SCHEDULING_CONFIG": str(path)})
    assert s.prefill_policy == "pipeline" and s.decode_policy == "kv-aware"
    assert s.prefill_policy_params["scorers"][0] == {"type": "prefix-affinity", "weight": 2}
    cfg = s.scheduler_config()
    assert cfg.prefill_policy == "pipeline" and s.validate().prefill_policy_params == cfg.prefill_policy_params
    json_path = tmp_path / "s.json"
    json_path.write_text(json.dumps({"decode": {"scorers": [{"type": "kv-free"}]}}))
    assert load(RouterSettings, {}, {"scheduling_config": str(json_path)}).decode_policy == "pipeline"


@pytest.mark.parametrize("text,extra,fragment", [
    ("prefill: {scorers: [{type: nope}]}", {}, "unknown scorer"),
    ("routing: {}", {}, "prefill` and / or a `decode"),
    ("prefill: [", {}, "not YAML or JSON"),
    ("prefill: {}", {"FLEXLB_PREFILL_POLICY_PARAMS": '{"tie_rel": 0.2}'}, "both given"),
])
def test_a_bad_scheduling_config_stops_the_router_naming_the_file(tmp_path, text, extra, fragment):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(SettingsError, match=fragment):
        load(RouterSettings, {"FLEXLB_SCHEDULING_CONFIG": str(path), **extra})
    with pytest.raises(SettingsError, match="cannot read"):
        load(RouterSettings, {"FLEXLB_SCHEDULING_CONFIG": str(tmp_path / "missing.yaml")})


def test_pipeline_params_default_to_the_max_score_picker():
    assert PipelineParams().validate().picker.type == "max-score"
