"""Routing policies: FlexLB's rules pinned by unit tests, invariants by property tests."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.core.policies import (
    DECODE_POLICIES,
    PREFILL_POLICIES,
    Candidate,
    RouteContext,
    build_policy,
)
from services.core.view import WorkerInfo


def make_worker(worker_id: str, role: str = "pd_fusion") -> WorkerInfo:
    return WorkerInfo(worker_id=worker_id, role=role, boot_id="b0", num_kv_blocks=1000, num_free_kv_blocks=1000)


def cand(worker_id: str, **kw) -> Candidate:
    defaults = dict(kv_total_tokens=100_000, kv_used_tokens=0, kv_available_tokens=100_000)
    defaults.update(kw)
    return Candidate(worker=make_worker(worker_id), **defaults)


def ctx(cands, seed=0, n=1000, max_tokens=100, slo=0.0) -> RouteContext:
    return RouteContext("r", n, max_tokens, list(cands), 0, random.Random(seed), n // 16, slo)


# ------------------------------------------------------------------ cost-based
def test_cost_based_picks_the_lowest_prefill_plus_wait_plus_queue():
    p = build_policy("prefill", "cost-based", {"tie_abs_ms": 0, "tie_rel": 0})
    pick = p.select(ctx([cand("a", prefill_ms=100, wait_ms=50), cand("b", prefill_ms=60, wait_ms=20, queue_ms=10),
                         cand("c", prefill_ms=80)]))
    assert pick.worker_id == "c"
    # (the card: the least cost over each worker's, 80 / (150, 90, 80) ms)
    scores = {s.worker_id: s.components["score.predicted-cost"] for s in pick.scores}
    assert scores == {"a": 80 / 150, "b": 80 / 90, "c": 1.0}


def test_cost_based_prefers_the_cache_hit_through_a_shorter_prefill():
    p = build_policy("prefill", "cost-based", {"tie_abs_ms": 0, "tie_rel": 0})
    pick = p.select(ctx([cand("hit", prefill_ms=30, num_cached_tokens=900), cand("miss", prefill_ms=95)]))
    assert pick.worker_id == "hit"


def test_tie_window_is_max_of_10_percent_and_20_ms():
    p = build_policy("prefill", "cost-based")
    # min 100: window max(10, 20) = 20 -> 115 ties, 125 does not
    picks = Counter(p.select(ctx([cand("a", prefill_ms=100), cand("b", prefill_ms=115), cand("c", prefill_ms=125)],
                                 seed=s)).worker_id for s in range(400))
    assert set(picks) == {"a", "b"} and min(picks.values()) > 120
    # min 1000: window max(100, 20) = 100 -> 1090 ties, 1110 does not
    picks = Counter(p.select(ctx([cand("a", prefill_ms=1000), cand("b", prefill_ms=1090), cand("c", prefill_ms=1110)],
                                 seed=s)).worker_id for s in range(400))
    assert set(picks) == {"a", "b"}


def test_tie_break_keeps_the_ties_with_fewest_requests_in_flight():
    # a (100 ms) and b (115 ms) tie (window 20 ms); b has fewer requests in flight, so its
    # decode steps are shorter: b every time. c has fewer still but is outside the window.
    p = build_policy("prefill", "cost-based")
    cs = [cand("a", prefill_ms=100, num_pending=5), cand("b", prefill_ms=115, num_pending=2),
          cand("c", prefill_ms=125, num_pending=0)]
    assert {p.select(ctx(cs, seed=s)).worker_id for s in range(50)} == {"b"}
    # equal in flight: drawn among them, as before
    cs = [cand("a", prefill_ms=100, num_pending=2), cand("b", prefill_ms=115, num_pending=2)]
    assert {p.select(ctx(cs, seed=s)).worker_id for s in range(50)} == {"a", "b"}
    # "random" (the reference's behaviour) draws among all ties whatever they hold
    p = build_policy("prefill", "cost-based", {"tie_break": "random"})
    cs = [cand("a", prefill_ms=100, num_pending=5), cand("b", prefill_ms=115, num_pending=2)]
    assert {p.select(ctx(cs, seed=s)).worker_id for s in range(50)} == {"a", "b"}


def test_hotspot_filter_drops_workers_with_3x_average_pending():
    p = build_policy("prefill", "cost-based")
    cs = [cand("hot", prefill_ms=1, num_pending=40)] + [cand(f"w{i}", prefill_ms=500, num_pending=1) for i in range(5)]
    pick = p.select(ctx(cs))
    # average pending = 45/6 = 7.5; 40 > 22.5 -> filtered even though it is cheapest
    assert pick.worker_id != "hot"
    assert {s.worker_id: s.filtered_by for s in pick.scores}["hot"] == "hotspot"


def test_imbalance_filter_drops_workers_with_3x_average_wait():
    p = build_policy("prefill", "cost-based")
    cs = [cand("slow", prefill_ms=1, wait_ms=5000)] + [cand(f"w{i}", prefill_ms=100, wait_ms=100) for i in range(5)]
    pick = p.select(ctx(cs))
    assert pick.worker_id != "slow"
    assert {s.worker_id: s.filtered_by for s in pick.scores}["slow"] == "imbalance"


def test_when_everything_is_filtered_the_least_waiting_worker_is_taken():
    p = build_policy("prefill", "cost-based")
    pick = p.select(ctx([cand("a", gated=True, wait_ms=300), cand("b", gated=True, wait_ms=100)]))
    assert pick.worker_id == "b" and "every candidate filtered" in pick.reason
    card = {s.worker_id: s for s in pick.scores}
    assert card["b"].filtered_by is None and card["a"].filtered_by == "gated"


def test_slo_filter_drops_workers_that_cannot_meet_the_ttft_target():
    p = build_policy("prefill", "cost-based", {"slo_filter": True, "slo_margin_ms": 100})
    pick = p.select(ctx([cand("fast", prefill_ms=100, wait_ms=300), cand("late", prefill_ms=50, wait_ms=10)], slo=500.0))
    assert pick.worker_id == "late"
    pick = p.select(ctx([cand("fast", prefill_ms=100, wait_ms=350), cand("ok", prefill_ms=100, wait_ms=200)], slo=500.0))
    assert {s.worker_id: s.filtered_by for s in pick.scores}["fast"] == "slo-ttft"


# ------------------------------------------------------------------ kv-aware decode
def test_kv_aware_weighted_random_favours_the_emptier_worker_1_5_to_3_times():
    p = build_policy("decode", "kv-aware")
    cs = [cand("light", kv_used_tokens=500), cand("heavy", kv_used_tokens=1500)]
    counts = Counter(p.select(ctx(cs, seed=s, n=100)).worker_id for s in range(20_000))
    ratio = counts["light"] / counts["heavy"]
    assert 1.5 <= ratio <= 3.0, counts
    assert math.isclose(ratio, math.e, rel_tol=0.1)


@pytest.mark.parametrize(
    "bad,why",
    [
        (dict(kv_available_tokens=50), "kv-available"),
        (dict(gated=True), "gated"),
        (dict(num_pending=100), "load"),
        (dict(kv_used_tokens=90_000), "kv-used"),
    ],
    ids=["no-room-for-prompt", "usage-gate", "load-3x", "kv-used-3x"],
)
def test_kv_aware_filters(bad, why):
    p = build_policy("decode", "kv-aware")
    cs = [cand("x", **bad)] + [cand(f"w{i}", kv_used_tokens=1000, num_pending=1) for i in range(4)]
    for s in range(50):
        pick = p.select(ctx(cs, seed=s, n=100))
        assert pick.worker_id != "x"
    assert {s.worker_id: s.filtered_by for s in pick.scores}["x"] == why


def test_kv_aware_has_no_fallback():
    p = build_policy("decode", "kv-aware")
    pick = p.select(ctx([cand("a", kv_available_tokens=10), cand("b", kv_available_tokens=10)], n=100))
    assert pick.worker_id is None and "filtered" in pick.reason


# ------------------------------------------------------------------ cache-aware and the simple ones
def test_cache_aware_follows_the_prefix_unless_load_is_imbalanced():
    p = build_policy("prefill", "cache-aware")
    balanced = [cand("hit", num_cached_tokens=800, num_pending=10), cand("miss", num_pending=2)]
    assert p.select(ctx(balanced)).worker_id == "hit"
    imbalanced = [cand("hit", num_cached_tokens=800, num_pending=60), cand("miss", num_pending=2)]
    assert p.select(ctx(imbalanced)).worker_id == "miss"
    weak = [cand("a", num_cached_tokens=100, num_cache_blocks=500), cand("b", num_cache_blocks=20)]
    assert p.select(ctx(weak)).worker_id == "b"  # match 0.1 <= 0.5: smallest cache


def test_least_loaded_and_power_of_two_prefer_fewer_pending():
    cs = [cand("a", num_pending=5), cand("b", num_pending=1), cand("c", num_pending=9)]
    assert build_policy("prefill", "least-loaded").select(ctx(cs)).worker_id == "b"
    p2 = build_policy("prefill", "power-of-two")
    picks = Counter(p2.select(ctx(cs, seed=s)).worker_id for s in range(300))
    assert picks["c"] == 0 and picks["b"] > picks["a"]


def test_round_robin_only_advances_on_record():
    p = build_policy("prefill", "round-robin")
    cs = [cand("a"), cand("b")]
    first = p.select(ctx(cs))
    assert p.select(ctx(cs)).worker_id == first.worker_id  # select alone changes nothing
    p.record(first)
    assert p.select(ctx(cs)).worker_id != first.worker_id


@pytest.mark.parametrize(
    "stage,name,params,fragment",
    [
        ("prefill", "best", None, "unknown prefill policy"),
        ("decode", "cost-based", None, "unknown decode policy"),
        ("prefill", "cost-based", {"tie_rel": -1}, "tie_rel"),
        ("prefill", "cost-based", {"tie_break": "lowest"}, "tie_break"),
        ("prefill", "cost-based", {"no_such": 1}, "no_such"),
        ("decode", "kv-aware", {"max_kv_usage": 2}, "max_kv_usage"),
        # strict types, as the batchers' parameters: no string for a number, no 64.0 for a count
        ("prefill", "cost-based", {"pending_gate_high": "64"}, "pending_gate_high"),
        ("prefill", "cost-based", {"pending_gate_high": 64.5}, "pending_gate_high"),
        ("prefill", "cost-based", {"slo_filter": "yes"}, "slo_filter"),
    ],
)
def test_bad_policy_configuration_fails_loudly(stage, name, params, fragment):
    with pytest.raises(ValueError, match=fragment):
        build_policy(stage, name, params)


def test_the_gates_are_read_through_the_policies_parameters():
    """The scheduler's gates come from the policy that has them, typed; one without has none."""
    cost = build_policy("prefill", "cost-based", {"pending_gate_high": 9, "pending_gate_hysteresis": 0.5})
    kv = build_policy("decode", "kv-aware", {"max_kv_usage": 0.7, "kv_usage_hysteresis": 0.1, "expected_output_cap": 77})
    rr = build_policy("decode", "round-robin")
    assert cost.params.pending_gate() == (9, 0.5) and cost.params.kv_gate() == (math.inf, 0.0)
    assert kv.params.kv_gate() == (0.7, 0.1) and kv.params.expected_output_cap_tokens() == 77
    assert rr.params.pending_gate() == (math.inf, 0.0) and rr.params.expected_output_cap_tokens() == 1000


# ------------------------------------------------------------------ properties
candidate_st = st.builds(
    dict,
    prefill_ms=st.floats(0, 1e5), wait_ms=st.floats(0, 1e5), queue_ms=st.floats(0, 1e5),
    num_pending=st.integers(0, 200), num_cached_tokens=st.integers(0, 5000), num_cache_blocks=st.integers(0, 10_000),
    kv_used_tokens=st.integers(0, 200_000), kv_available_tokens=st.integers(-1000, 200_000), gated=st.booleans(),
)


@settings(max_examples=300, deadline=None)
@given(
    name=st.sampled_from(sorted(PREFILL_POLICIES) + [f"decode:{d}" for d in DECODE_POLICIES]),
    specs=st.lists(candidate_st, min_size=0, max_size=8),
    seed=st.integers(0, 2**32),
    n=st.integers(1, 8000),
)
def test_policies_pick_only_offered_unfiltered_workers_with_finite_scores(name, specs, seed, n):
    stage, policy_name = ("decode", name[7:]) if name.startswith("decode:") else ("prefill", name)
    p = build_policy(stage, policy_name)
    cs = [cand(f"w{i}", **spec) for i, spec in enumerate(specs)]
    pick = p.select(ctx(cs, seed=seed, n=n))
    offered = {c.worker_id for c in cs}
    if pick.worker_id is not None:
        assert pick.worker_id in offered
        card = {s.worker_id: s for s in pick.scores}
        assert card[pick.worker_id].filtered_by is None
    else:
        assert not cs or stage == "decode"
    for s in pick.scores:
        assert math.isfinite(s.score)
        assert all(math.isfinite(v) for v in s.components.values())


def test_small_absolute_differences_are_not_hotspots():
    # FlexLB's pure ratio would call a worker with 2 pending among idle ones a hotspot.
    p = build_policy("prefill", "cost-based", {"tie_abs_ms": 0, "tie_rel": 0})
    cs = [cand("warm", prefill_ms=10, num_pending=2)] + [cand(f"w{i}", prefill_ms=90) for i in range(3)]
    pick = p.select(ctx(cs))
    assert pick.worker_id == "warm" and all(s.filtered_by is None for s in pick.scores)
    strict = build_policy("prefill", "cost-based", {"hotspot_min_excess": 0})
    assert strict.select(ctx(cs)).worker_id != "warm"


# ------------------------------------------------------------------ cost-based: prefill weight, imbalance off
def test_a_weighted_prefill_never_picks_a_worker_that_would_miss_the_ttft_target_over_one_that_meets_it():
    """The cached worker saves 400 ms of prefill (800 of 1,000 tokens; x3: 1,200 ms in the score) but its wait makes
    its TTFT 2,100 ms against a 2,000 ms target: the uncached worker, which meets it, wins."""
    from services.core.policies import build_policy
    from services.core.policies.protocol import Candidate, RouteContext
    from services.core.view import WorkerInfo

    def c(wid, **kw):
        return Candidate(worker=WorkerInfo(worker_id=wid, role="pd_fusion", boot_id="b"), **kw)

    policy = build_policy("prefill", "cost-based", {"prefill_weight": 3.0})
    cands = [c("cached", prefill_ms=100, wait_ms=2000, num_cached_tokens=800), c("cold", prefill_ms=500)]
    assert policy.select(RouteContext("r", 1000, 10, cands, 0, 0, 60, 2000.0)).worker_id == "cold"
    cands = [c("cached", prefill_ms=100, wait_ms=1300, num_cached_tokens=800), c("cold", prefill_ms=500)]  # 1,400 vs 1,700
    assert policy.select(RouteContext("r", 1000, 10, cands, 0, 0, 60, 2000.0)).worker_id == "cached"


def test_imbalance_factor_zero_turns_the_imbalance_filter_off():
    from services.core.policies import build_policy
    from services.core.policies.protocol import Candidate, RouteContext
    from services.core.view import WorkerInfo

    def c(wid, **kw):
        return Candidate(worker=WorkerInfo(worker_id=wid, role="pd_fusion", boot_id="b"), **kw)

    # w0: 100 ms prefill (cached) behind 400 ms of queue (> 3 x the average 100); w1-w3 idle, 1,000 ms prefill
    cands = [c("w0", prefill_ms=100, queue_ms=400), c("w1", prefill_ms=1000), c("w2", prefill_ms=1000),
             c("w3", prefill_ms=1000)]
    on = build_policy("prefill", "cost-based", {}).select(RouteContext("r", 1000, 10, cands, 0, 0, 60, 0.0))
    off = build_policy("prefill", "cost-based", {"imbalance_factor": 0}).select(RouteContext("r", 1000, 10, cands, 0, 0, 60, 0.0))
    assert on.worker_id != "w0" and off.worker_id == "w0"
    with pytest.raises(ValueError, match="imbalance_factor"):
        build_policy("prefill", "cost-based", {"imbalance_factor": 0.5})
