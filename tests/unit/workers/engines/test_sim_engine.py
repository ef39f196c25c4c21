"""The simulated engine: timing profile, scheduling, token stream, KV blocks and prefix cache."""

from __future__ import annotations

import json
from collections import defaultdict

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from schemas.errors import ERROR_CODES
from schemas.messages import ROLES
from schemas.tokens import block_hashes
from workers.engines.sim import (
    EngineBatch,
    EngineRequest,
    SimEngine,
    StepResult,
    TimingProfile,
    load_profile,
    sim_token_id,
)

PROFILE = load_profile(None)


# --------------------------------------------------------------------------- builders
def make_prompt(num_tokens: int, seed: int = 0) -> list[int]:
    """Prompts with the same seed share their leading tokens (hence their leading blocks)."""
    return [(seed * 37 + i) % 256 for i in range(num_tokens)]


def make_request(request_id: str, num_prompt_tokens: int = 8, max_tokens: int = 4, seed: int = 0) -> EngineRequest:
    return EngineRequest(request_id=request_id, prompt_token_ids=make_prompt(num_prompt_tokens, seed),
                         max_tokens=max_tokens)


def make_batch(batch_id: str, *requests: EngineRequest) -> EngineBatch:
    return EngineBatch(batch_id=batch_id, requests=list(requests))


def make_engine(role: str = "pd_fusion", num_kv_blocks: int = 64, block_size_tokens: int = 4,
                max_seq_len_tokens: int = 1024, max_num_batched_tokens: int = 8192, max_num_seqs: int = 256,
                chunked_prefill: bool = True, scheduler: str = "vllm", max_prefill_tokens: int = 16384) -> SimEngine:
    return SimEngine(profile=PROFILE, role=role, num_kv_blocks=num_kv_blocks,
                     block_size_tokens=block_size_tokens, max_seq_len_tokens=max_seq_len_tokens,
                     max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                     chunked_prefill=chunked_prefill, scheduler=scheduler, max_prefill_tokens=max_prefill_tokens)


def prefilled(step: StepResult) -> list[tuple[str, list[str], int, int]]:
    """(batch, request ids, prompt tokens, cached tokens) of the batches whose prefill ended."""
    return [(b.batch_id, b.request_ids, b.num_prompt_tokens, b.num_cached_tokens) for b in step.batches_prefilled]


def chunk_ms(c: int, k: int) -> float:
    """A chunk's own prefill terms: k tokens after c already computed."""
    return PROFILE.prefill_per_token_ms * k + PROFILE.prefill_per_token_sq_ms * ((c + k) ** 2 - c * c)


def run_to_idle(engine: SimEngine, max_steps: int = 10_000) -> list[StepResult]:
    steps = []
    while (step := engine.step()) is not None:
        engine.check_invariants()
        steps.append(step)
        assert len(steps) < max_steps, "engine never went idle"
    return steps


def tokens_by_request(steps: list[StepResult]) -> dict[str, list[tuple[int, int]]]:
    out: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for step in steps:
        for t in step.tokens:
            out[t.request_id].append((t.index, t.token_id))
    return out


def expected_tokens(request_id: str, max_tokens: int) -> list[tuple[int, int]]:
    return [(i, sim_token_id(request_id, i)) for i in range(max_tokens)]


def assert_all_blocks_released(engine: SimEngine) -> None:
    engine.check_invariants()
    assert engine.num_used_kv_blocks == 0
    assert engine.num_free_kv_blocks + engine.num_cached_kv_blocks == engine.num_kv_blocks


# --------------------------------------------------------------------------- profile
def test_default_profile_is_the_fitted_llama2_70b_h100_tp8():
    assert PROFILE.name == "llama2-70b-h100-tp8"
    assert "Splitwise" in PROFILE.source
    assert (PROFILE.prefill_base_ms, PROFILE.decode_base_ms) == (26.45, 29.57)


@pytest.mark.parametrize(
    "prompt_and_cached,expected_ms",
    [
        ([(1000, 0)], 26.45 + 64.14 + 3.635),
        ([(1000, 500)], 26.45 + 0.06414 * 500 + 3.635e-6 * 750_000),
        ([(100, 0), (200, 0)], 26.45 + 0.06414 * 300 + 3.635e-6 * 50_000),
    ],
    ids=["one-1000-token-prompt", "half-cached", "two-prompts"],
)
def test_prefill_ms_by_hand(prompt_and_cached, expected_ms):
    assert PROFILE.prefill_ms(prompt_and_cached) == pytest.approx(expected_ms)


@pytest.mark.parametrize(
    "batch_size,num_context_tokens,expected_ms",
    [(1, 1000, 29.57 + 0.198 + 0.22), (32, 64_000, 29.57 + 6.336 + 14.08)],
    ids=["one-seq", "32-seqs"],
)
def test_decode_step_ms_by_hand(batch_size, num_context_tokens, expected_ms):
    assert PROFILE.decode_step_ms(batch_size, num_context_tokens) == pytest.approx(expected_ms)


def test_profile_loads_from_a_path(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({**_profile_dict(), "name": "other"}))
    assert load_profile(str(path)) == TimingProfile(**{**_profile_dict(), "name": "other"})


def _profile_dict() -> dict:
    return {f: getattr(PROFILE, f) for f in PROFILE.__struct_fields__}


@pytest.mark.parametrize(
    "content,fragment",
    [
        ("{not json", "malformed"),
        (json.dumps({k: v for k, v in _profile_dict().items() if k != "decode_base_ms"}), "decode_base_ms"),
        (json.dumps({**_profile_dict(), "decode_base_sec": 1.0}), "decode_base_sec"),
        (json.dumps({**_profile_dict(), "prefill_per_token_ms": -1.0}), "prefill_per_token_ms"),
        (None, "cannot read"),
    ],
    ids=["not-json", "missing-field", "unknown-field", "negative-coefficient", "missing-file"],
)
def test_bad_profile_file_raises_value_error_naming_file_and_problem(tmp_path, content, fragment):
    path = tmp_path / "bad-profile.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError) as info:
        load_profile(str(path))
    assert "bad-profile.json" in str(info.value)
    assert fragment.lower() in str(info.value).lower()


# --------------------------------------------------------------------------- token ids
def test_sim_token_id_is_stable_lowercase_words():
    ids = [sim_token_id("r1", i) for i in range(60)]
    assert ids[:3] == [99, 120, 103]  # pinned: the same in every process and Python version
    for i, token_id in enumerate(ids):
        assert token_id == 32 if i % 6 == 5 else 97 <= token_id <= 122
    assert ids != [sim_token_id("r2", i) for i in range(60)]


# --------------------------------------------------------------------------- pd_fusion
def test_pd_fusion_batch_prefills_in_one_step_then_decodes_every_token_in_order():
    engine = make_engine()
    requests = [make_request("a", 10, 1, seed=1), make_request("b", 7, 2, seed=2), make_request("c", 20, 5, seed=3)]
    engine.submit_batch(make_batch("b1", *requests))
    assert engine.running_request_ids() == ["a", "b", "c"] and engine.num_queued_batches == 1

    steps = run_to_idle(engine)

    prefill, decodes = steps[0], steps[1:]
    assert (prefill.kind, prefill.batches_started, prefilled(prefill)) == ("prefill", ["b1"], [("b1", ["a", "b", "c"], 37, 0)])
    assert prefill.duration_ms == pytest.approx(PROFILE.prefill_ms([(10, 0), (7, 0), (20, 0)]))
    assert prefill.prefill_ms_by_batch == {"b1": pytest.approx(prefill.duration_ms)}
    assert [f.request_id for f in prefill.finished] == ["a"]  # max_tokens 1: done at prefill
    assert [s.kind for s in decodes] == ["decode"] * 4
    # first decode step: b and c running, each with prompt + 1 generated token of context
    assert decodes[0].duration_ms == pytest.approx(PROFILE.decode_step_ms(2, (7 + 1) + (20 + 1)))
    assert decodes[1].duration_ms == pytest.approx(PROFILE.decode_step_ms(1, 20 + 2))
    got = tokens_by_request(steps)
    for request in requests:
        assert got[request.request_id] == expected_tokens(request.request_id, request.max_tokens)
    finished = [f for s in steps for f in s.finished]
    assert sorted((f.request_id, f.num_output_tokens, f.num_prompt_tokens) for f in finished) == [
        ("a", 1, 10), ("b", 2, 7), ("c", 5, 20)]
    assert all(f.finish_reason == "length" for f in finished)
    assert engine.step() is None and engine.running_request_ids() == []
    assert_all_blocks_released(engine)


def test_token_budget_merges_two_queued_batches_and_chunks_a_long_prompt_over_three_steps():
    """Budget 10 tokens. b1 = x (6-token prompt, 3 outputs), b2 = y (20-token prompt, 2 outputs).
    step 1: x whole (6) + y's first chunk (4)          -> x0          b1 prefilled
    step 2: x decodes (1) + y's second chunk (9)       -> x1
    step 3: x decodes (1) + y's last chunk (7)         -> x2 (x done), y0   b2 prefilled
    step 4: y decodes                                  -> y1 (y done)"""
    engine = make_engine(max_num_batched_tokens=10)
    engine.submit_batch(make_batch("b1", make_request("x", 6, 3, seed=1)))
    engine.submit_batch(make_batch("b2", make_request("y", 20, 2, seed=2)))
    steps = run_to_idle(engine)
    p = PROFILE

    assert [(s.kind, s.num_prefill_tokens, s.num_decode_tokens) for s in steps] == [
        ("prefill", 10, 0), ("prefill", 9, 1), ("prefill", 7, 1), ("decode", 0, 1)]
    assert [[(t.request_id, t.index) for t in s.tokens] for s in steps] == [
        [("x", 0)], [("x", 1)], [("x", 2), ("y", 0)], [("y", 1)]]
    assert [s.batches_started for s in steps] == [["b1", "b2"], [], [], []]
    assert [prefilled(s) for s in steps] == [[("b1", ["x"], 6, 0)], [], [("b2", ["y"], 20, 0)], []]
    assert [[f.request_id for f in s.finished] for s in steps] == [[], [], ["x"], ["y"]]
    expected_ms = [
        p.prefill_base_ms + chunk_ms(0, 6) + chunk_ms(0, 4),
        p.prefill_base_ms + chunk_ms(4, 9) + p.decode_per_seq_ms + p.decode_per_context_token_ms * (6 + 1),
        p.prefill_base_ms + chunk_ms(13, 7) + p.decode_per_seq_ms + p.decode_per_context_token_ms * (6 + 2),
        p.decode_base_ms + p.decode_per_seq_ms + p.decode_per_context_token_ms * (20 + 1),
    ]
    assert [s.duration_ms for s in steps] == pytest.approx(expected_ms)
    # a batch's share of a step: its own chunk terms plus the base in proportion to its tokens
    assert steps[0].prefill_ms_by_batch == pytest.approx({"b1": chunk_ms(0, 6) + p.prefill_base_ms * 6 / 10,
                                                          "b2": chunk_ms(0, 4) + p.prefill_base_ms * 4 / 10})
    assert steps[1].prefill_ms_by_batch == pytest.approx({"b2": chunk_ms(4, 9) + p.prefill_base_ms})
    assert_all_blocks_released(engine)


def test_without_chunked_prefill_a_prompt_runs_whole_in_a_later_step():
    # no chunking: the budget is max(max_num_batched_tokens 10, max_seq_len_tokens 12) = 12
    engine = make_engine(max_num_batched_tokens=10, max_seq_len_tokens=12, chunked_prefill=False)
    engine.submit_batch(make_batch("b1", make_request("x", 6, 3, seed=1), make_request("y", 8, 1, seed=2)))
    steps = run_to_idle(engine)
    assert [(s.num_prefill_tokens, s.num_decode_tokens) for s in steps] == [(6, 0), (8, 1), (0, 1)]
    assert steps[1].duration_ms == pytest.approx(
        PROFILE.prefill_ms([(8, 0)]) + PROFILE.decode_per_seq_ms + PROFILE.decode_per_context_token_ms * 7)
    # a prompt longer than max_num_batched_tokens runs whole, never chunked
    engine.submit_batch(make_batch("b2", make_request("long", 11, 1, seed=3)))
    [step] = run_to_idle(engine)
    assert (step.num_prefill_tokens, [f.request_id for f in step.finished]) == (11, ["long"])


def test_kv_overflow_preempts_the_newest_request_which_recomputes_prompt_and_outputs():
    """6 blocks of 4 tokens; a and b (8-token prompts, 8 outputs each) run together. Each holds
    2 blocks after its prefill and 3 from its first decode; at step 6 a needs a 4th block, none
    is free: b (the newest) is preempted, its prompt blocks stay cached (evictable). b cannot
    come back while a runs (it needs 2 new blocks); a finishes at step 8, and at step 9 b
    recomputes its 5 generated tokens on top of its 2 cached prompt blocks and goes on at
    index 5; every index of both is emitted once."""
    engine = make_engine(num_kv_blocks=6, block_size_tokens=4)
    engine.submit_batch(make_batch("b1", make_request("a", 8, 8, seed=1), make_request("b", 8, 8, seed=2)))
    steps = run_to_idle(engine)

    assert [s.num_preemptions for s in steps] == [0] * 5 + [1] + [0] * 5
    assert engine.num_preemptions == 1
    assert [[(t.request_id, t.index) for t in s.tokens] for s in steps] == [
        [("a", 0), ("b", 0)], [("a", 1), ("b", 1)], [("a", 2), ("b", 2)], [("a", 3), ("b", 3)], [("a", 4), ("b", 4)],
        [("a", 5)], [("a", 6)], [("a", 7)], [("b", 5)], [("b", 6)], [("b", 7)]]
    recompute = steps[8]
    assert (recompute.kind, recompute.num_prefill_tokens, recompute.batches_prefilled) == ("prefill", 5, [])
    assert recompute.duration_ms == pytest.approx(PROFILE.prefill_base_ms + chunk_ms(8, 5))
    assert recompute.prefill_ms_by_batch == {}  # recompute belongs to no batch's prefill
    finished = {f.request_id: f for s in steps for f in s.finished}
    assert (finished["b"].num_output_tokens, finished["b"].num_cached_tokens) == (8, 0)  # the hit at first admission
    got = tokens_by_request(steps)
    assert got["a"] == expected_tokens("a", 8) and got["b"] == expected_tokens("b", 8)
    assert_all_blocks_released(engine)


def test_max_num_seqs_caps_the_running_set():
    engine = make_engine(max_num_seqs=2)
    engine.submit_batch(make_batch("b1", *[make_request(r, 4, 3, seed=i) for i, r in enumerate("xyz")]))
    first = engine.step()
    assert [t.request_id for t in first.tokens] == ["x", "y"] and engine.num_running_requests == 2
    steps = [first, *run_to_idle(engine)]
    assert {rid: len(toks) for rid, toks in tokens_by_request(steps).items()} == {"x": 3, "y": 3, "z": 3}


@pytest.mark.parametrize(
    "num_prompt_tokens,block_size_tokens,expected_cached_tokens",
    [(10, 4, 8), (8, 4, 4), (4, 4, 0), (3, 4, 0), (33, 16, 32), (32, 16, 16)],
    ids=["partial-last-block", "whole-prompt-hit-cut", "one-block-cut-to-zero", "no-full-block",
         "bs16-partial", "bs16-whole-cut"],
)
def test_identical_prompt_hits_the_prefix_cache(num_prompt_tokens, block_size_tokens, expected_cached_tokens):
    engine = make_engine(block_size_tokens=block_size_tokens)
    engine.submit_batch(make_batch("b1", make_request("first", num_prompt_tokens, 2)))
    first = run_to_idle(engine)[0]
    assert first.blocks_stored == block_hashes(make_prompt(num_prompt_tokens), block_size_tokens)
    engine.submit_batch(make_batch("b2", make_request("second", num_prompt_tokens, 2)))
    second = run_to_idle(engine)

    assert prefilled(second[0])[0][3] == expected_cached_tokens
    assert second[-1].finished[0].num_cached_tokens == expected_cached_tokens
    assert second[0].duration_ms == pytest.approx(
        PROFILE.prefill_ms([(num_prompt_tokens, expected_cached_tokens)]))
    if expected_cached_tokens:
        assert second[0].duration_ms < first.duration_ms
    assert second[0].blocks_stored == []  # everything was cached already
    assert_all_blocks_released(engine)


def test_chunks_store_their_full_blocks_as_they_are_computed():
    engine = make_engine(block_size_tokens=4, max_num_batched_tokens=6)
    request = make_request("r", 14, 1)
    hashes = block_hashes(request.prompt_token_ids, 4)  # 3 full blocks
    engine.submit_batch(make_batch("b1", request))
    steps = run_to_idle(engine)
    assert [s.blocks_stored for s in steps] == [hashes[:1], hashes[1:3], []]  # tokens 0-5, 6-11, 12-13


def test_running_requests_share_hit_blocks():
    engine = make_engine(num_kv_blocks=8, block_size_tokens=4)  # a and b fit only by sharing
    engine.submit_batch(make_batch("b1", make_request("a", 16, 8)))  # 6 blocks at its end
    engine.step()
    engine.submit_batch(make_batch("b2", make_request("b", 17, 7)))  # 6 blocks at its end, first 4 shared
    second = engine.step()
    assert (second.kind, prefilled(second)[0][3]) == ("prefill", 16)
    assert engine.num_used_kv_blocks == 4 + 1 + 1  # shared prompt blocks + one private block each
    engine.check_invariants()
    steps = run_to_idle(engine)
    assert sum(s.num_preemptions for s in steps) == 0
    assert_all_blocks_released(engine)


def test_lru_eviction_takes_the_least_recently_used_blocks_tail_first():
    engine = make_engine(num_kv_blocks=4, block_size_tokens=4)
    a, b, c = (make_request(r, 8, 4, seed=i) for i, r in enumerate("abc"))  # 3 blocks at their end, 2 prompt blocks
    hashes_a, hashes_b = block_hashes(a.prompt_token_ids, 4), block_hashes(b.prompt_token_ids, 4)
    engine.submit_batch(make_batch("b1", a))
    run_to_idle(engine)
    assert (engine.num_cached_kv_blocks, engine.num_free_kv_blocks) == (2, 2)

    engine.submit_batch(make_batch("b2", b))
    assert engine.step().blocks_removed == []  # the prompt fits the free blocks
    assert engine.step().blocks_removed == [hashes_a[1]]  # its first decode needs a 3rd: a's tail goes first
    run_to_idle(engine)
    assert set(engine.all_cached_block_hashes()) == {hashes_a[0], *hashes_b}

    engine.submit_batch(make_batch("b3", c))
    assert engine.step().blocks_removed == [hashes_a[0]]  # a was used before b
    assert engine.step().blocks_removed == [hashes_b[1]]
    assert engine.num_free_kv_blocks == 0
    engine.check_invariants()
    run_to_idle(engine)
    assert_all_blocks_released(engine)


@pytest.mark.parametrize(
    "bad_request,code",
    [
        (make_request("bad", 8, 0), "invalid_request"),
        (EngineRequest(request_id="bad", prompt_token_ids=[], max_tokens=4), "invalid_request"),
        (make_request("bad", 30, 10), "too_large"),  # 40 tokens > max_seq_len_tokens 32
        (make_request("bad", 20, 8), "too_large"),  # 7 blocks > num_kv_blocks 6
    ],
    ids=["zero-max-tokens", "empty-prompt", "longer-than-max-seq-len", "more-blocks-than-engine"],
)
def test_a_request_that_can_never_run_fails_without_blocking_the_queue(bad_request, code):
    engine = make_engine(num_kv_blocks=6, block_size_tokens=4, max_seq_len_tokens=32)
    engine.submit_batch(make_batch("b1", bad_request, make_request("good", 8, 2)))
    assert engine.running_request_ids() == ["good"]
    step = engine.step()
    assert [(f.request_id, f.code) for f in step.failed] == [("bad", code)]
    assert code in ERROR_CODES and step.failed[0].message
    assert (step.kind, [ids for _, ids, _, _ in prefilled(step)]) == ("prefill", [["good"]])
    assert tokens_by_request(run_to_idle(engine)).keys() == {"good"}


def test_a_batch_larger_than_the_kv_is_released_together_and_runs_by_preemption():
    engine = make_engine(num_kv_blocks=6, block_size_tokens=4)  # 3 requests x 3 blocks at their end
    engine.submit_batch(make_batch("b1", *[make_request(r, 8, 4, seed=i) for i, r in enumerate("xyz")]))
    steps = run_to_idle(engine)
    assert [f for s in steps for f in s.failed] == []
    assert sum(s.num_preemptions for s in steps) >= 1
    got = tokens_by_request(steps)
    assert all(got[r] == expected_tokens(r, 4) for r in "xyz")
    assert_all_blocks_released(engine)


def test_failures_alone_are_reported_in_a_zero_duration_report_step():
    engine = make_engine(max_seq_len_tokens=16)
    engine.submit_batch(make_batch("b1", make_request("bad", 16, 1)))
    assert engine.num_queued_batches == 0
    step = engine.step()
    assert (step.kind, step.duration_ms, [f.code for f in step.failed]) == ("report", 0.0, ["too_large"])
    assert engine.step() is None


@pytest.mark.parametrize("when", ["queued", "running"])
def test_cancel_removes_the_request_and_frees_its_blocks(when):
    engine = make_engine(num_kv_blocks=32, block_size_tokens=4)
    engine.submit_batch(make_batch("b1", make_request("keep", 8, 6, seed=1), make_request("drop", 8, 6, seed=2)))
    if when == "running":
        engine.step()
        engine.step()
    assert engine.cancel("drop") is True
    assert engine.cancel("drop") is False and engine.cancel("never-seen") is False
    engine.check_invariants()
    assert engine.running_request_ids() == ["keep"]
    steps = run_to_idle(engine)
    assert "drop" not in tokens_by_request(steps)
    assert [f.request_id for s in steps for f in s.finished] == ["keep"]
    assert_all_blocks_released(engine)


def test_cancelling_every_request_of_a_queued_batch_drops_the_batch():
    engine = make_engine()
    engine.submit_batch(make_batch("b1", make_request("only")))
    assert engine.cancel("only") and engine.num_queued_batches == 0
    step = engine.step()  # says the batch left (so callers can forget it), with no member
    assert (step.kind, step.duration_ms, prefilled(step)) == ("report", 0.0, [("b1", [], 0, 0)])
    assert engine.step() is None


# --------------------------------------------------------------------------- prefill / decode roles
def test_prefill_role_hands_off_after_prefill_and_keeps_only_the_prompt_cached():
    engine = make_engine(role="prefill", num_kv_blocks=32, block_size_tokens=4)
    engine.submit_batch(make_batch("b1", make_request("a", 10, 1, seed=1), make_request("b", 8, 50, seed=2)))
    step = engine.step()
    assert step.kind == "prefill" and step.tokens == [] and step.finished == []
    assert [(h.request_id, h.batch_id, h.first_token_id, h.num_cached_tokens) for h in step.handoffs] == [
        ("a", "b1", sim_token_id("a", 0), 0), ("b", "b1", sim_token_id("b", 0), 0)]
    assert engine.num_running_requests == 0 and engine.running_request_ids() == []
    assert engine.num_cached_kv_blocks == 2 + 2  # full prompt blocks only
    assert_all_blocks_released(engine)
    assert engine.step() is None


def test_prefill_role_reserves_only_the_prompt_blocks():
    engine = make_engine(role="prefill", num_kv_blocks=2, block_size_tokens=4, max_seq_len_tokens=1024)
    engine.submit_batch(make_batch("b1", make_request("r", 8, 500)))  # 127 blocks with its output
    step = engine.step()
    assert ([h.request_id for h in step.handoffs], step.failed) == (["r"], [])
    assert_all_blocks_released(engine)


@pytest.mark.parametrize("max_tokens", [1, 2, 5])
def test_decode_role_emits_exactly_max_tokens_beginning_with_the_first_token(max_tokens):
    engine = make_engine(role="decode")
    engine.submit_decode(make_request("r", 9, max_tokens), first_token_id=111, num_cached_tokens=4)
    steps = run_to_idle(engine)
    assert all(s.kind == "decode" for s in steps)
    assert tokens_by_request(steps)["r"] == [(0, 111)] + expected_tokens("r", max_tokens)[1:]
    assert len(steps) == max(1, max_tokens - 1)  # index 0 and 1 come in the admission step
    finished = [f for s in steps for f in s.finished]
    assert [(f.request_id, f.num_output_tokens, f.num_cached_tokens) for f in finished] == [("r", max_tokens, 4)]
    if max_tokens == 1:
        assert steps[0].duration_ms == 0.0  # nothing to compute
    else:
        assert steps[0].duration_ms == pytest.approx(PROFILE.decode_step_ms(1, 9 + 1))
    assert_all_blocks_released(engine)


def test_decode_role_admits_fifo_when_blocks_free_up():
    engine = make_engine(role="decode", num_kv_blocks=4, block_size_tokens=4)
    engine.submit_decode(make_request("first", 8, 4, seed=1), first_token_id=100, num_cached_tokens=0)
    engine.submit_decode(make_request("second", 8, 4, seed=2), first_token_id=101, num_cached_tokens=0)
    steps = run_to_idle(engine)
    starts = {t.request_id: i for i, s in enumerate(steps) for t in s.tokens if t.index == 0}
    ends = {f.request_id: i for i, s in enumerate(steps) for f in s.finished}
    assert starts["second"] > ends["first"]


def test_block_events_follow_what_the_cache_holds():
    # a max_tokens == 1 hand-off finishes at admission and leaves its blocks evictable; the
    # next one needs 3 of the 4 blocks and evicts the first one's tail block
    engine = make_engine(role="decode", num_kv_blocks=4, block_size_tokens=4)
    short, long = make_request("short", 8, 1, seed=1), make_request("long", 8, 4, seed=2)
    for request in (short, long):
        engine.submit_decode(request, first_token_id=100, num_cached_tokens=0)
    hashes_short, hashes_long = block_hashes(short.prompt_token_ids, 4), block_hashes(long.prompt_token_ids, 4)
    first, second = engine.step(), engine.step()
    assert (first.blocks_stored, first.blocks_removed) == (hashes_short, [])
    assert (second.blocks_stored, second.blocks_removed) == (hashes_long, [hashes_short[1]])
    assert set(engine.all_cached_block_hashes()) == {hashes_short[0], *hashes_long}
    engine.check_invariants()


@pytest.mark.parametrize(
    "role,call",
    [
        ("decode", lambda e: e.submit_batch(make_batch("b", make_request("r")))),
        ("pd_fusion", lambda e: e.submit_decode(make_request("r"), first_token_id=1, num_cached_tokens=0)),
        ("pd_fusion", lambda e: e.submit_batch(make_batch("b"))),
        ("pd_fusion", lambda e: e.submit_batch(make_batch("b", make_request("r"), make_request("r")))),
        ("pd_fusion", lambda e: [e.submit_batch(make_batch(b, make_request("r"))) for b in ("b1", "b2")]),
    ],
    ids=["batch-on-decode", "decode-on-pd-fusion", "empty-batch", "duplicate-in-batch", "duplicate-live"],
)
def test_caller_bugs_raise_value_error(role, call):
    engine = make_engine(role=role)
    with pytest.raises(ValueError):
        call(engine)


def test_unknown_role_is_a_value_error():
    with pytest.raises(ValueError, match="unknown worker role"):
        make_engine(role="vit")


# --------------------------------------------------------------------------- prefill-first (sglang)
def test_prefill_first_batches_two_prompts_chunks_a_long_one_over_prefill_steps_then_resumes_decodes():
    """Scheduler sglang, chunk budget 10. b1 = x (6-token prompt, 3 outputs) + y (4, 2); b2 = z
    (25, 2) submitted after the first step.
    step 1: prefill x (6) + y (4), batched                 -> x0 y0        b1 prefilled
    step 2: prefill z's first chunk (10): x and y wait      -> nothing
    step 3: prefill z's second chunk (10)                   -> nothing
    step 4: prefill z's last chunk (5)                      -> z0           b2 prefilled
    step 5: decode x, y, z                                  -> x1 y1 z1     (y, z done)
    step 6: decode x                                        -> x2           (x done)"""
    engine = make_engine(max_num_batched_tokens=10, scheduler="sglang")
    engine.submit_batch(make_batch("b1", make_request("x", 6, 3, seed=1), make_request("y", 4, 2, seed=2)))
    first = engine.step()
    engine.submit_batch(make_batch("b2", make_request("z", 25, 2, seed=3)))
    steps = [first, *run_to_idle(engine)]
    p = PROFILE

    assert [(s.kind, s.num_prefill_tokens, s.num_decode_tokens) for s in steps] == [
        ("prefill", 10, 0), ("prefill", 10, 0), ("prefill", 10, 0), ("prefill", 5, 0), ("decode", 0, 3), ("decode", 0, 1)]
    assert [[(t.request_id, t.index) for t in s.tokens] for s in steps] == [
        [("x", 0), ("y", 0)], [], [], [("z", 0)], [("x", 1), ("y", 1), ("z", 1)], [("x", 2)]]
    assert [s.batches_started for s in steps] == [["b1"], ["b2"], [], [], [], []]
    assert [prefilled(s) for s in steps] == [[("b1", ["x", "y"], 10, 0)], [], [], [("b2", ["z"], 25, 0)], [], []]
    assert [sorted(f.request_id for f in s.finished) for s in steps] == [[], [], [], [], ["y", "z"], ["x"]]
    expected_ms = [
        p.prefill_base_ms + chunk_ms(0, 6) + chunk_ms(0, 4),
        p.prefill_base_ms + chunk_ms(0, 10),
        p.prefill_base_ms + chunk_ms(10, 10),
        p.prefill_base_ms + chunk_ms(20, 5),
        p.decode_step_ms(3, (6 + 1) + (4 + 1) + (25 + 1)),
        p.decode_step_ms(1, 6 + 2),
    ]
    assert [s.duration_ms for s in steps] == pytest.approx(expected_ms)
    assert steps[1].prefill_ms_by_batch == pytest.approx({"b2": p.prefill_base_ms + chunk_ms(0, 10)})
    got = tokens_by_request(steps)
    assert got["x"] == expected_tokens("x", 3) and got["y"] == expected_tokens("y", 2) and got["z"] == expected_tokens("z", 2)
    assert_all_blocks_released(engine)


def test_prefill_first_input_budget_ends_a_batch_but_the_first_prompt_always_goes():
    """Chunk budget 64, input budget 8: x (6) fits, y (4) is beyond the 2 left and waits for the
    next prefill step, which runs before any decode; without chunking a prompt beyond the input
    budget still goes whole when it is first."""
    engine = make_engine(max_num_batched_tokens=64, max_prefill_tokens=8, scheduler="sglang")
    engine.submit_batch(make_batch("b1", make_request("x", 6, 2, seed=1), make_request("y", 4, 2, seed=2)))
    steps = run_to_idle(engine)
    assert [(s.kind, [(t.request_id, t.index) for t in s.tokens]) for s in steps] == [
        ("prefill", [("x", 0)]), ("prefill", [("y", 0)]), ("decode", [("x", 1), ("y", 1)])]
    engine = make_engine(max_num_batched_tokens=4, max_prefill_tokens=8, chunked_prefill=False, scheduler="sglang")
    engine.submit_batch(make_batch("b1", make_request("long", 12, 1, seed=3), make_request("s", 3, 1, seed=4)))
    steps = run_to_idle(engine)
    assert [(s.num_prefill_tokens, [f.request_id for f in s.finished]) for s in steps] == [(12, ["long"]), (3, ["s"])]


def test_prefill_first_decode_step_preempts_the_newest_which_waits_for_kv_while_the_older_decodes():
    """6 blocks of 4 tokens. a (8-token prompt, 8 outputs) prefills alone (2 blocks); b (12, 4)
    arrives and prefills at once in its own step (3 more blocks: 5 used), pausing a. Step 3 is a
    decode step: a grows to its 3rd block (the last free one), b needs a 4th and none is free, so
    b, the newest, is preempted: its 3 prompt blocks stay cached (evictable) and it waits at the
    front. It cannot come back while a holds 3 blocks (its one new block would have to evict its
    own hit), so the next steps are decode steps of a alone; a's 4th block evicts b's tail, and
    once a finishes b recomputes what it lost. Every index of both is emitted once, in order."""
    engine = make_engine(num_kv_blocks=6, block_size_tokens=4, scheduler="sglang")
    engine.submit_batch(make_batch("b1", make_request("a", 8, 8, seed=1)))
    first = engine.step()
    engine.submit_batch(make_batch("b2", make_request("b", 12, 4, seed=2)))
    steps = [first, *run_to_idle(engine)]

    assert [(s.kind, [(t.request_id, t.index) for t in s.tokens]) for s in steps[:4]] == [
        ("prefill", [("a", 0)]), ("prefill", [("b", 0)]), ("decode", [("a", 1)]), ("decode", [("a", 2)])]
    assert [s.num_preemptions for s in steps[:4]] == [0, 0, 1, 0]
    assert engine.num_preemptions == 1
    assert steps[2].duration_ms == pytest.approx(PROFILE.decode_step_ms(1, 8 + 1))
    a_tokens = [t.index for s in steps for t in s.tokens if t.request_id == "a"]
    last_a_step = max(i for i, s in enumerate(steps) if any(t.request_id == "a" for t in s.tokens))
    assert a_tokens == list(range(8)) and all(t.request_id == "a" for s in steps[2:last_a_step + 1] for t in s.tokens)
    recompute = steps[last_a_step + 1]
    assert recompute.kind == "prefill" and [(t.request_id, t.index) for t in recompute.tokens] == [("b", 1)]
    got = tokens_by_request(steps)
    assert got["a"] == expected_tokens("a", 8) and got["b"] == expected_tokens("b", 4)
    assert_all_blocks_released(engine)


def test_prefill_first_a_prefill_step_holds_no_decode_and_a_decode_step_no_prefill():
    """The defining difference from the vLLM scheduler on the same arrivals: there, a prompt
    arriving while another decodes shares its steps; here it has a step of its own."""
    for scheduler, expected in [("vllm", [("prefill", 4, 1), ("decode", 0, 2)]), ("sglang", [("prefill", 4, 0), ("decode", 0, 2)])]:
        engine = make_engine(scheduler=scheduler)
        engine.submit_batch(make_batch("b1", make_request("x", 4, 5, seed=1)))
        engine.step()
        engine.submit_batch(make_batch("b2", make_request("y", 4, 5, seed=2)))
        got = []
        while not got or got[-1][0] == "prefill":
            s = engine.step()
            got.append((s.kind, s.num_prefill_tokens, s.num_decode_tokens))
        assert got == expected, scheduler


def test_unknown_engine_scheduler_is_a_value_error():
    with pytest.raises(ValueError, match="unknown engine scheduler 'orca'"):
        make_engine(scheduler="orca")


# --------------------------------------------------------------------------- property
_request_spec = st.tuples(st.integers(0, 2), st.integers(0, 24), st.integers(0, 8))  # seed, prompt, max
_operation = st.one_of(
    st.tuples(st.just("submit"), st.lists(_request_spec, min_size=1, max_size=3)),
    st.tuples(st.just("cancel"), st.integers(0, 20)),
    st.tuples(st.just("step"), st.none()),
)


@settings(max_examples=800, deadline=None)
@given(role=st.sampled_from(ROLES), num_kv_blocks=st.integers(4, 16), operations=st.lists(_operation, max_size=60),
       max_num_batched_tokens=st.sampled_from([3, 8, 64]), max_num_seqs=st.sampled_from([2, 256]),
       chunked_prefill=st.booleans(), scheduler=st.sampled_from(["vllm", "sglang"]),
       max_prefill_tokens=st.sampled_from([5, 16384]))
def test_random_workloads_keep_the_block_invariant_and_end_every_request_once(role, num_kv_blocks, operations,
                                                                             max_num_batched_tokens, max_num_seqs,
                                                                             chunked_prefill, scheduler,
                                                                             max_prefill_tokens):
    engine = make_engine(role=role, num_kv_blocks=num_kv_blocks, block_size_tokens=4, max_seq_len_tokens=28,
                         max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                         chunked_prefill=chunked_prefill, scheduler=scheduler, max_prefill_tokens=max_prefill_tokens)
    submitted: dict[str, EngineRequest] = {}
    outcomes: dict[str, list[str]] = defaultdict(list)
    steps: list[StepResult] = []

    cached_mirror: set[int] = set()  # what a consumer of blocks_stored / blocks_removed sees

    def record(step: StepResult | None) -> None:
        if step is None:
            return
        steps.append(step)
        assert not set(step.blocks_stored) & set(step.blocks_removed)
        cached_mirror.difference_update(step.blocks_removed)
        cached_mirror.update(step.blocks_stored)
        assert step.duration_ms >= 0
        num_cached_tokens = sum(b.num_cached_tokens for b in step.batches_prefilled)
        for label, happened in [("eviction", step.blocks_removed), ("prefix hit", num_cached_tokens),
                                ("preemption", step.num_preemptions), ("chunked", step.num_prefill_tokens
                                                                       and step.num_prefill_tokens == max_num_batched_tokens)]:
            if happened:
                event(label)
        assert cached_mirror == set(engine.all_cached_block_hashes())
        for kind, items in [("finished", step.finished), ("failed", step.failed), ("handoff", step.handoffs)]:
            for item in items:
                outcomes[item.request_id].append(kind)

    for op, arg in operations:
        if op == "submit":
            requests = [make_request(f"r{len(submitted) + i}", n, m, seed) for i, (seed, n, m) in enumerate(arg)]
            submitted.update((r.request_id, r) for r in requests)
            if role == "decode":
                for r in requests:
                    engine.submit_decode(r, first_token_id=sim_token_id(r.request_id, 0), num_cached_tokens=0)
            else:
                engine.submit_batch(make_batch(f"b{len(submitted)}", *requests))
        elif op == "cancel" and arg < len(submitted):
            if engine.cancel(f"r{arg}"):
                outcomes[f"r{arg}"].append("cancelled")
        elif op == "step":
            record(engine.step())
        engine.check_invariants()
    for _ in range(10_000):
        step = engine.step()
        if step is None:
            break
        record(step)
        engine.check_invariants()
    else:
        pytest.fail("engine never went idle")

    assert_all_blocks_released(engine)
    assert engine.running_request_ids() == []
    assert {rid: len(o) for rid, o in outcomes.items()} == {rid: 1 for rid in submitted}
    got = tokens_by_request(steps)
    for rid, [outcome] in outcomes.items():
        event(f"outcome {outcome}")
        request = submitted[rid]
        if outcome == "finished":
            assert got[rid] == expected_tokens(rid, request.max_tokens)
        elif outcome == "cancelled":
            assert got[rid] == expected_tokens(rid, len(got[rid]))
        else:
            assert rid not in got
        if outcome == "handoff":
            assert role == "prefill"
    for failure in (f for step in steps for f in step.failed):
        request = submitted[failure.request_id]
        num_prompt_tokens = len(request.prompt_token_ids)
        blocks_needed = -(-(num_prompt_tokens + (0 if role == "prefill" else request.max_tokens)) // 4)
        can_never_run = {
            "invalid_request": request.max_tokens < 1 or num_prompt_tokens == 0,
            "too_large": num_prompt_tokens + request.max_tokens > 28 or blocks_needed > num_kv_blocks,
        }
        assert can_never_run[failure.code], failure
        event(f"failure {failure.code}")
