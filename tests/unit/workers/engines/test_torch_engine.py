"""The torch engine: a real model under the sim engine's scheduler. Greedy tokens do not
depend on batching, chunking, preemption, prefix hits or PD; the block accounting and KV
events are the sim engine's, step for step; bad input is a failed request with a code."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from workers.engines.sim import EngineBatch, EngineRequest, SimEngine, load_profile
from workers.engines.torch_engine import TorchEngine, kv_from_bytes, kv_to_bytes, load_model
from workers.engines.torch_model import LlamaConfig, build_model

BS = 4
CFG = LlamaConfig(num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=2, intermediate_size=64, max_positions=256)


@pytest.fixture(scope="module")
def model():
    return build_model(CFG, seed=3)


def engine(model, role="pd_fusion", num_kv_blocks=256, budget=8192, **kw) -> TorchEngine:
    return TorchEngine(model, role, num_kv_blocks=num_kv_blocks, block_size_tokens=BS, max_seq_len_tokens=256,
                       max_num_batched_tokens=budget, **kw)


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def req(rid: str, ids: list[int], max_tokens: int = 6, **kw) -> EngineRequest:
    return EngineRequest(request_id=rid, prompt_token_ids=ids, max_tokens=max_tokens, **kw)


def run(eng, batches: list[list[EngineRequest]], max_steps: int = 500):
    """Submit the batches, step to the end; (tokens by request in index order, finished, steps)."""
    for i, reqs in enumerate(batches):
        eng.submit_batch(EngineBatch(batch_id=f"b{i}", requests=reqs))
    out: dict[str, list[int]] = {}
    finished, steps = {}, []
    for _ in range(max_steps):
        step = eng.step()
        if step is None:
            break
        steps.append(step)
        for t in step.tokens:
            assert t.index == len(out.setdefault(t.request_id, [])), (t, out[t.request_id])
            out[t.request_id].append(t.token_id)
        finished.update({f.request_id: f for f in step.finished})
        eng.check_invariants()
    else:
        raise AssertionError("the engine did not drain")
    return out, finished, steps


def alone(model, r: EngineRequest) -> list[int]:
    out, _, _ = run(engine(model), [[r]])
    return out[r.request_id]


PROMPTS = {"a": prompt(3, 1), "b": prompt(17, 2), "c": prompt(40, 3), "d": prompt(9, 4)}


def test_a_batch_of_mixed_lengths_gives_each_request_its_tokens_alone(model):
    reqs = [req(rid, ids, max_tokens=5 + i) for i, (rid, ids) in enumerate(PROMPTS.items())]
    out, finished, steps = run(engine(model), [reqs[:2], reqs[2:]])
    for r in reqs:
        assert out[r.request_id] == alone(model, r) and len(out[r.request_id]) == r.max_tokens
        assert finished[r.request_id].finish_reason == "length"
    assert steps[0].num_prefill_tokens == sum(len(p) for p in PROMPTS.values())  # one packed prefill step
    assert all(s.duration_ms > 0 for s in steps)


def test_chunked_prefill_gives_the_tokens_of_an_unchunked_one(model):
    reqs = [req(rid, ids) for rid, ids in PROMPTS.items()]
    whole, _, _ = run(engine(model, chunked_prefill=False), [reqs])
    chunked, _, steps = run(engine(model, budget=7), [reqs])  # a 40-token prompt takes 6+ steps
    assert chunked == whole
    assert max(s.num_prefill_tokens + s.num_decode_tokens for s in steps) <= 7
    assert sum(1 for s in steps if s.num_prefill_tokens) > 6


def test_a_prefix_cache_hit_skips_the_prefix_and_gives_the_same_tokens(model):
    shared = prompt(24, 9)  # six full blocks
    first, second = req("x", shared + prompt(5, 10)), req("y", shared + prompt(7, 11))
    eng = engine(model)
    run(eng, [[first]])
    out, finished, steps = run(eng, [[second]])
    assert finished["y"].num_cached_tokens == 24
    assert steps[0].num_prefill_tokens == len(second.prompt_token_ids) - 24  # the prefix is not recomputed
    assert out["y"] == alone(model, second)


def test_preemption_and_recompute_give_the_same_tokens(model):
    reqs = [req(f"r{i}", prompt(14, 20 + i), max_tokens=20) for i in range(6)]
    roomy, _, _ = run(engine(model), [reqs])
    eng = engine(model, num_kv_blocks=22)  # 6 × ceil(34 / 4) = 54 blocks wanted at the end
    tight, _, steps = run(eng, [reqs])
    assert sum(s.num_preemptions for s in steps) > 0
    assert tight == roomy


def test_pd_decode_from_the_shipped_kv_gives_the_colocated_tokens(model):
    reqs = [req(rid, ids, max_tokens=7) for rid, ids in PROMPTS.items()]
    colocated, _, _ = run(engine(model), [reqs])
    pre, dec = engine(model, role="prefill"), engine(model, role="decode")
    pre.submit_batch(EngineBatch(batch_id="b0", requests=reqs))
    handoffs = []
    while (step := pre.step()) is not None:
        handoffs += step.handoffs
    assert sorted(h.request_id for h in handoffs) == sorted(PROMPTS) and pre.num_used_kv_blocks == 0
    for h in handoffs:
        r = next(r for r in reqs if r.request_id == h.request_id)
        kv = kv_from_bytes(kv_to_bytes(h.kv))  # through the wire format
        assert torch.equal(kv, h.kv) and kv.shape[2] == len(r.prompt_token_ids)
        dec.submit_decode(r, h.first_token_id, h.num_cached_tokens, kv=kv)
    out: dict[str, list[int]] = {}
    prefill_tokens = 0
    while (step := dec.step()) is not None:
        prefill_tokens += step.num_prefill_tokens
        for t in step.tokens:
            out.setdefault(t.request_id, []).append(t.token_id)
        dec.check_invariants()
    assert out == colocated
    assert prefill_tokens == 0  # decoded from the shipped KV: no prompt was recomputed


def test_a_hand_off_whose_kv_does_not_fit_the_model_fails_dispatch_failed(model):
    dec = engine(model, role="decode")
    r = req("z", prompt(5, 1))
    dec.submit_decode(r, 7, 0, kv=torch.zeros(2, 2, 4, 2, 8))
    step = dec.step()
    assert [f.code for f in step.failed] == ["dispatch_failed"] and "needs" in step.failed[0].message
    with pytest.raises(ValueError, match="not a KV hand-off"):
        kv_from_bytes(b"garbage")


def test_bad_requests_fail_with_a_code_and_the_rest_of_the_batch_runs(model):
    good = req("ok", prompt(5, 1))
    bad = [req("vocab", [1, 2, 999]), req("temp", [1, 2], temperature=-1.0), req("long", prompt(250, 2), max_tokens=10),
           req("empty", [])]
    out, _, steps = run(engine(model), [[good, *bad]])
    codes = {f.request_id: f.code for s in steps for f in s.failed}
    assert codes == {"vocab": "invalid_request", "temp": "invalid_request", "long": "too_large", "empty": "invalid_request"}
    assert len(out["ok"]) == good.max_tokens


def test_seeded_sampling_is_the_same_alone_and_batched_and_seeds_differ(model):
    hot = dict(temperature=1.5, top_p=0.95, max_tokens=12)
    r1, r2 = req("s1", PROMPTS["c"], seed=1, **hot), req("s2", PROMPTS["c"], seed=2, **hot)
    out, _, _ = run(engine(model), [[r1, r2, req("g", PROMPTS["b"])]])
    assert out["s1"] == alone(model, r1) and out["s2"] == alone(model, r2)
    assert out["s1"] != out["s2"]


def test_the_model_end_token_stops_a_request_unless_ignore_eos():
    base = build_model(CFG, seed=3)
    first = alone(base, req("probe", PROMPTS["b"]))[0]
    m = build_model(dataclasses.replace(CFG, eos_token_id=first), seed=3)
    _, finished, _ = run(engine(m), [[req("e", PROMPTS["b"]), req("i", PROMPTS["b"], ignore_eos=True)]])
    assert (finished["e"].finish_reason, finished["e"].num_output_tokens) == ("stop", 1)
    assert (finished["i"].finish_reason, finished["i"].num_output_tokens) == ("length", 6)


def test_blocks_and_kv_events_are_the_sim_engines_step_for_step(model):
    """Same scheduler, same accounting: a workload with prefix sharing, chunking, eviction and
    preemption gives the same stored / removed hashes and block counts on both engines."""
    shared = prompt(16, 5)
    reqs = [req(f"q{i}", (shared if i % 2 else []) + prompt(6 + 5 * i, 30 + i), max_tokens=9) for i in range(8)]
    kw = dict(role="pd_fusion", num_kv_blocks=30, block_size_tokens=BS, max_seq_len_tokens=256, max_num_batched_tokens=24)
    sim, real = SimEngine(load_profile(None), **kw), TorchEngine(model, **kw)
    for eng in (sim, real):
        eng.submit_batch(EngineBatch(batch_id="b0", requests=reqs[:4]))
    steps = 0
    while True:
        if steps == 3:
            for eng in (sim, real):
                eng.submit_batch(EngineBatch(batch_id="b1", requests=reqs[4:]))
        a, b = sim.step(), real.step()
        if a is None or b is None:
            assert a is None and b is None
            break
        steps += 1
        assert (a.kind, a.num_prefill_tokens, a.num_decode_tokens, a.num_preemptions) == \
            (b.kind, b.num_prefill_tokens, b.num_decode_tokens, b.num_preemptions)
        assert (sorted(a.blocks_stored), sorted(a.blocks_removed)) == (sorted(b.blocks_stored), sorted(b.blocks_removed))
        assert (sim.num_free_kv_blocks, sim.num_used_kv_blocks, sim.num_cached_kv_blocks) == \
            (real.num_free_kv_blocks, real.num_used_kv_blocks, real.num_cached_kv_blocks)
        assert sorted(sim.all_cached_block_hashes()) == sorted(real.all_cached_block_hashes())
    assert steps > 10 and sim.num_preemptions > 0 and sim.num_preemptions == real.num_preemptions


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.sampled_from(["submit", "cancel", "step"]), st.integers(0, 7), st.integers(1, 30)),
                max_size=40))
def test_the_engine_keeps_its_invariants_under_random_submits_cancels_and_steps(model, ops):
    eng = engine(model, num_kv_blocks=24, budget=16)
    n = 0
    for op, which, size in ops:
        if op == "submit" and f"r{which}" not in eng.running_request_ids():
            eng.submit_batch(EngineBatch(batch_id=f"b{n}", requests=[req(f"r{which}", [t % 5 for t in range(size)], max_tokens=4)]))
            n += 1
        elif op == "cancel":
            eng.cancel(f"r{which}")
        else:
            eng.step()
        eng.check_invariants()
    while eng.step() is not None:
        eng.check_invariants()
    assert eng.num_used_kv_blocks == 0 and not eng.running_request_ids()


def test_load_model_names_a_preset_or_a_directory(tmp_path):
    assert load_model("tiny").cfg.num_layers == 2
    with pytest.raises(ValueError, match="neither a preset"):
        load_model(str(tmp_path / "nowhere"))
