"""The capacity bound (bench/capacity.py) on small traces worked out by hand.

The made-up profile keeps the arithmetic readable: prefill 8 ms per step + 0.5 ms per token
+ 0.001 ms per (n² - c²); decode 10 ms per step + 1 ms per sequence + 0.01 ms per context
token. Engine: 16-token steps, at most 4 sequences, 100 KV blocks of 4 tokens (400 tokens).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from bench.capacity import (
    CapacityBound,
    EngineLimits,
    StepCosts,
    WorkloadRequest,
    capacity_bound,
    decode_batch_size,
    infinite_cache_hits,
    zero_load_latency_ms,
    zero_load_slo_fraction,
)

REPO = Path(__file__).resolve().parent.parent

COSTS = StepCosts(prefill_base_ms=8.0, prefill_per_token_ms=0.5, prefill_per_token_sq_ms=0.001,
                  decode_base_ms=10.0, decode_per_seq_ms=1.0, decode_per_context_token_ms=0.01)
LIMITS = EngineLimits(max_num_batched_tokens=16, max_num_seqs=4, num_kv_blocks=100, block_size_tokens=4)


def req(n: int, m: int = 1, ids: tuple[int, ...] | None = None) -> WorkloadRequest:
    return WorkloadRequest(num_prompt_tokens=n, max_tokens=m, prefix_block_ids=ids)


def bound(requests, limits=LIMITS, workers=1, span_s=None) -> CapacityBound:
    return capacity_bound(requests, COSTS, limits, workers, recorded_span_s=span_s, prefix_block_tokens=8)


def test_one_request_prefill_and_decode_by_hand():
    # prefill: 8 computed tokens × (0.5 + 8 ms base / 16-token step) + 0.001 × 8² = 8.064
    # decode: tokens 1 and 2 see contexts 9 and 10 (mean 9.5, KV fits 42 > 4 seqs: B = 4)
    #         2 × (1 + 10/4) + 0.01 × (9 + 10) = 7.19
    b = bound([req(8, 3)], workers=2)
    assert b.mean_prefill_ms == pytest.approx(8.064)
    assert b.mean_decode_ms == pytest.approx(7.19)
    assert b.mean_work_ms == pytest.approx(15.254)
    assert (b.decode_batch_size, b.decode_batch_limited_by) == (4, "max_num_seqs")
    assert b.mean_decode_context_tokens == pytest.approx(9.5)
    assert b.rate_req_per_s == pytest.approx(2 * 1000 / 15.254)  # K × 1000 / mean work
    assert b.num_cached_tokens == 0 and b.reuse == 0.0


def test_a_shared_prefix_is_computed_once():
    # 8-token prefix blocks. A computes blocks 1, 2 (16 tokens); B shares both and computes
    # 4 new tokens; C shares block 1 only (block 4 is new): 8 cached tokens.
    #   A: 16 × 1.0 + 0.001 × 256                = 16.256
    #   B:  4 × 1.0 + 0.001 × (20² − 16²) = 4 + 0.144 = 4.144
    #   C:  4 × 1.0 + 0.001 × (12² −  8²) = 4 + 0.080 = 4.080
    requests = [req(16, ids=(1, 2)), req(20, ids=(1, 2, 3)), req(12, ids=(1, 4))]
    assert infinite_cache_hits(requests, prefix_block_tokens=8, block_size_tokens=4) == [0, 16, 8]
    b = bound(requests)
    assert b.mean_prefill_ms == pytest.approx((16.256 + 4.144 + 4.08) / 3)
    assert b.mean_decode_ms == 0.0  # max_tokens 1: the only token comes out of the prefill
    assert b.rate_req_per_s == pytest.approx(1000 / 8.16)
    assert (b.num_cached_tokens, b.num_prompt_tokens, b.reuse) == (24, 48, 0.5)


def test_the_same_requests_without_prefix_ids_share_nothing():
    requests = [req(16), req(20), req(12)]
    b = bound(requests)
    assert b.num_cached_tokens == 0
    # A + (20 + 0.4) + (12 + 0.144): every token computed
    assert b.mean_prefill_ms == pytest.approx((16.256 + 20.4 + 12.144) / 3)


@pytest.mark.parametrize("requests,hits", [
    pytest.param([req(8, ids=(7,)), req(8, ids=(7,))], [0, 4], id="whole-prompt-hit-still-computes-its-last-block"),
    pytest.param([req(6, ids=(5,)), req(8, ids=(5,))], [0, 4], id="shorter-form-first-shares-only-its-6-tokens"),
    pytest.param([req(6, ids=(5,)), req(8, ids=(5,)), req(8, ids=(5,))], [0, 4, 4], id="then-the-longer-form-is-cached"),
    pytest.param([req(8, ids=(5,)), req(6, ids=(5,))], [0, 4], id="longer-form-first-then-a-cut-one"),
    pytest.param([req(16, ids=(1, 2)), req(16, ids=(9, 2))], [0, 0], id="a-later-block-alone-is-no-prefix"),
    pytest.param([req(3, ids=(1,)), req(3, ids=(1,))], [0, 0], id="shorter-than-a-kv-block-caches-nothing"),
    pytest.param([req(24, ids=(1, 2, 3)), req(10, ids=(1, 2, 3))], [0, 8], id="a-cut-prompt-uses-only-its-own-blocks"),
])
def test_infinite_cache_hits(requests, hits):
    assert infinite_cache_hits(requests, prefix_block_tokens=8, block_size_tokens=4) == hits


def test_a_kv_limited_decode_batch_pays_the_whole_step_base():
    # contexts 301 and 302: mean 301.5; 400 KV tokens hold one such sequence: B = 1
    #   prefill: 300 × 1.0 + 0.001 × 300² = 390
    #   decode:  2 × (1 + 10/1) + 0.01 × (301 + 302) = 28.03
    b = bound([req(300, 3)])
    assert (b.decode_batch_size, b.decode_batch_limited_by) == (1, "kv_cache")
    assert b.mean_prefill_ms == pytest.approx(390.0)
    assert b.mean_decode_ms == pytest.approx(28.03)


def test_the_token_budget_caps_the_decode_batch_and_amortizes_the_prefill_base():
    limits = EngineLimits(max_num_batched_tokens=2, max_num_seqs=4, num_kv_blocks=100, block_size_tokens=4)
    b = bound([req(8, 3)], limits=limits)
    assert (b.decode_batch_size, b.decode_batch_limited_by) == (2, "max_num_batched_tokens")
    assert b.mean_prefill_ms == pytest.approx(8 * (0.5 + 8 / 2) + 0.064)  # 36.064
    assert b.mean_decode_ms == pytest.approx(2 * (1 + 10 / 2) + 0.19)  # 12.19


def test_the_mean_decode_context_is_weighted_by_decode_steps():
    # n=10, m=2: one step at context 11; n=100, m=4: steps at 101, 102, 103 -> 317 / 4
    size, why, mean_context = decode_batch_size([req(10, 2), req(100, 4)], LIMITS)
    assert mean_context == pytest.approx(79.25)
    assert (size, why) == (4, "max_num_seqs")  # 400 / 79.25 = 5 sequences would fit


def test_the_bound_as_a_multiplier_of_the_recorded_rate():
    requests = [req(16, ids=(1, 2)), req(20, ids=(1, 2, 3)), req(12, ids=(1, 4))]
    b = bound(requests, span_s=2.0)  # 3 requests over 2 s: 1.5 req/s recorded
    assert b.recorded_rate_req_per_s == pytest.approx(1.5)
    assert b.multiplier == pytest.approx(1000 / 8.16 / 1.5)
    assert bound(requests).multiplier is None  # no span: no recorded rate


def test_more_workers_scale_the_bound_linearly():
    requests = [req(8, 3), req(16, 2, ids=(1, 2))]
    assert bound(requests, workers=4).rate_req_per_s == pytest.approx(4 * bound(requests, workers=1).rate_req_per_s)


def test_bad_inputs_fail_loudly():
    with pytest.raises(ValueError):
        bound([])
    with pytest.raises(ValueError):
        bound([req(8)], workers=0)
    with pytest.raises(ValueError):
        bound([req(8, 0)])
    with pytest.raises(ValueError):
        EngineLimits(max_num_seqs=0)


def test_the_shipped_profile_reads_and_gives_its_formula():
    costs = StepCosts.from_file(REPO / "workers" / "profiles" / "llama2-70b-h100-tp8.json")
    b = capacity_bound([req(1000)], costs, EngineLimits(), 1)
    # 1000 × (0.06414 + 26.45 / 8192) + 3.635e-6 × 1000²
    assert b.mean_work_ms == pytest.approx(1000 * (0.06414 + 26.45 / 8192) + 3.635)
    assert math.isclose(b.rate_req_per_s, 1000 / b.mean_work_ms)


def test_zero_load_latency_pays_one_base_per_chunk():
    # n = 40 in 16-token steps: 3 chunks (16, 16, 8): 3 × 8 + 0.5 × 40 + 0.001 × 1600 = 45.6
    # TPOT alone: 10 + 1 + 0.01 × (40 + 4/2) = 11.42
    ttft, tpot = zero_load_latency_ms(req(40, 4), 0, COSTS, LIMITS)
    assert ttft == pytest.approx(45.6)
    assert tpot == pytest.approx(11.42)
    # 32 cached: 8 computed in one chunk: 8 + 0.5 × 8 + 0.001 × (1600 − 1024) = 12.576
    assert zero_load_latency_ms(req(40, 1), 32, COSTS, LIMITS) == (pytest.approx(12.576), None)


def test_zero_load_slo_fraction_counts_who_could_make_it_alone():
    # Target 15 ms. A: 16 tokens, one chunk: 8 + 0.5 × 16 + 0.256 = 16.256 ms: misses.
    # B shares A's 16 tokens and computes 4: 8 + 0.5 × 4 + 0.001 × (400 − 256) = 10.144 ms.
    requests = [req(16, ids=(1, 2)), req(20, ids=(1, 2, 3))]
    costs_args = dict(costs=COSTS, limits=LIMITS, slo_ttft_ms=15.0, slo_tpot_ms=1000.0, prefix_block_tokens=8)
    assert zero_load_slo_fraction(requests, **costs_args) == 0.5
    # B cold: 20 tokens in 2 chunks: 2 × 8 + 0.5 × 20 + 0.4 = 26.4 ms
    assert zero_load_slo_fraction(requests, with_cache=False, **costs_args) == 0.0
    # TPOT: a 2-token request alone decodes at 10 + 1 + 0.01 × 17 = 11.17 ms: over an 11 ms target
    assert zero_load_slo_fraction([req(16, 2)], COSTS, LIMITS, slo_ttft_ms=100.0, slo_tpot_ms=11.0) == 0.0
