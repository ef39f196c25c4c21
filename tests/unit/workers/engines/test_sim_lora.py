"""LoRA adapters in the engines (workers/engines/scheduler.py, "LoRA adapters"; the sim's load
cost, workers/engines/sim.py) and their settings (workers/config.py).

Stories, each on the engine itself, step by step (its time is modelled: no clock):
- every load is counted and listed in its step, and a full set of slots evicts the least
  recently used adapter that nothing running uses;
- the step that loads an adapter takes lora_load_ms longer (and its batch's prefill too);
- a sequence whose adapter finds every slot busy waits; base-model sequences behind it go
  on, adapter sequences behind it wait too; when a slot frees it is the first to take it
  (both schedulers);
- an adapter the engine does not serve fails `adapter_not_found` (the torch engine serves
  none);
- a random workload never breaks the slot invariants and every request finishes (no
  sequence starves behind the slots).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from workers.config import DEFAULT_MAX_LORAS, WorkerConfig, make_engine
from workers.engines.sim import (
    DEFAULT_LORA_LOAD_MS,
    EngineBatch,
    EngineRequest,
    SimEngine,
    StepResult,
    load_profile,
)

PROFILE = load_profile(None)
ADAPTERS = ("a", "b", "c")


# --------------------------------------------------------------------------- builders
def make_engine_with(adapters=ADAPTERS, max_loras: int = 2, lora_load_ms: float = DEFAULT_LORA_LOAD_MS,
                     max_num_seqs: int = 256, scheduler: str = "vllm") -> SimEngine:
    return SimEngine(profile=PROFILE, role="pd_fusion", num_kv_blocks=256, block_size_tokens=4,
                     max_seq_len_tokens=1024, max_num_seqs=max_num_seqs, scheduler=scheduler,
                     lora_adapters=list(adapters), max_loras=max_loras if adapters else 0, lora_load_ms=lora_load_ms)


def req(request_id: str, adapter: str = "", max_tokens: int = 2, num_prompt_tokens: int = 8) -> EngineRequest:
    prompt = [(hash(request_id) + i) % 200 for i in range(num_prompt_tokens)]  # distinct: no prefix hits
    return EngineRequest(request_id=request_id, prompt_token_ids=prompt, max_tokens=max_tokens, lora_adapter=adapter)


def submit(engine: SimEngine, *requests: EngineRequest) -> None:
    for r in requests:  # one batch each: a request's batch is its own
        engine.submit_batch(EngineBatch(batch_id=f"b-{r.request_id}", requests=[r]))


def step(engine: SimEngine) -> StepResult:
    result = engine.step()
    assert result is not None
    engine.check_invariants()
    return result


def run_to_idle(engine: SimEngine) -> list[StepResult]:
    steps = []
    while (result := engine.step()) is not None:
        engine.check_invariants()
        steps.append(result)
        assert len(steps) < 10_000, "the engine never went idle"
    return steps


def running_ids(engine: SimEngine) -> list[str]:
    return [s.request.request_id for s in engine._running]


def waiting_ids(engine: SimEngine) -> list[str]:
    return [s.request.request_id for s in engine._waiting]


# --------------------------------------------------------------------------- loads and LRU eviction
def test_loads_are_counted_and_a_full_set_of_slots_evicts_the_least_recently_used_idle_adapter():
    engine = make_engine_with(max_loras=2)
    # (request's adapter, the loads of its run, the slots after it, least recently used first)
    story = [
        ("a", ["a"], ["a"]),
        ("b", ["b"], ["a", "b"]),
        ("c", ["c"], ["b", "c"]),  # a was used least recently: evicted
        ("b", [], ["c", "b"]),  # loaded: no load, b becomes the most recent
        ("a", ["a"], ["b", "a"]),  # c evicted
        ("", [], ["b", "a"]),  # the base model touches no slot
    ]
    for i, (adapter, loads, slots) in enumerate(story):
        submit(engine, req(f"r{i}", adapter))
        steps = run_to_idle(engine)
        assert [a for s in steps for a in s.lora_loads] == loads, (i, adapter)
        assert engine.loaded_lora_adapters() == slots, (i, adapter)
        assert all(f.request_id == f"r{i}" for s in steps for f in s.finished)
    assert engine.num_lora_loads == 4


def test_an_adapter_in_use_is_not_evicted_even_when_least_recently_used():
    engine = make_engine_with(max_loras=2)
    submit(engine, req("long-a", "a", max_tokens=50))
    step(engine)
    submit(engine, req("b1", "b", max_tokens=1))
    run_until_finished(engine, "b1")
    assert engine.loaded_lora_adapters() == ["a", "b"]  # a, touched before b in each step, is the least recent
    submit(engine, req("c1", "c", max_tokens=1))
    result = step(engine)
    assert result.lora_loads == ["c"]
    assert engine.loaded_lora_adapters() == ["a", "c"]  # b went: a is running
    assert "long-a" in running_ids(engine)


def run_until_finished(engine: SimEngine, request_id: str) -> list[StepResult]:
    steps = []
    while not any(f.request_id == request_id for s in steps for f in s.finished):
        steps.append(step(engine))
        assert len(steps) < 1000
    return steps


# --------------------------------------------------------------------------- the load's cost
@pytest.mark.parametrize("scheduler", ["vllm", "sglang"])
def test_the_step_that_loads_an_adapter_takes_lora_load_ms_longer_and_its_batch_carries_it(scheduler):
    with_adapter, base = make_engine_with(lora_load_ms=35.0, scheduler=scheduler), make_engine_with(scheduler=scheduler)
    submit(with_adapter, req("r1", "a"))
    submit(base, req("r1"))
    loading, plain = step(with_adapter), step(base)
    assert loading.lora_loads == ["a"] and plain.lora_loads == []
    assert loading.duration_ms == pytest.approx(plain.duration_ms + 35.0)
    assert loading.prefill_ms_by_batch["b-r1"] == pytest.approx(plain.prefill_ms_by_batch["b-r1"] + 35.0)
    # The same request again: the adapter is loaded, the steps cost the same.
    run_to_idle(with_adapter), run_to_idle(base)
    submit(with_adapter, req("r2", "a"))
    submit(base, req("r2"))
    again, plain = step(with_adapter), step(base)
    assert again.lora_loads == [] and again.duration_ms == pytest.approx(plain.duration_ms)


def test_lora_load_ms_is_set_by_the_config_and_zero_costs_nothing():
    cfg = WorkerConfig(worker_id="w0", lora_adapters="a", lora_load_ms=0).validate()
    free, base = make_engine(cfg), make_engine(WorkerConfig(worker_id="w0").validate())
    submit(free, req("r1", "a"))
    submit(base, req("r1"))
    loading, plain = step(free), step(base)
    assert loading.lora_loads == ["a"] and loading.duration_ms == pytest.approx(plain.duration_ms)


# --------------------------------------------------------------------------- waiting for a slot
@pytest.mark.parametrize("scheduler", ["vllm", "sglang"])
def test_a_sequence_waits_while_every_slot_is_in_use_and_takes_the_first_that_frees(scheduler):
    engine = make_engine_with(max_loras=1, scheduler=scheduler)
    submit(engine, req("a1", "a", max_tokens=3), req("b1", "b", max_tokens=2), req("base", "", max_tokens=2),
           req("a2", "a", max_tokens=2))
    first = step(engine)
    # a1 holds the only slot; b1 waits for it; the base request goes past; a2 (its adapter is
    # loaded) waits behind b1, or b1 could wait forever behind a stream of a's.
    assert first.lora_loads == ["a"]
    assert running_ids(engine) == ["a1", "base"]
    assert waiting_ids(engine) == ["b1", "a2"]
    steps = run_until_finished(engine, "a1")
    assert [a for s in steps for a in s.lora_loads] == []
    loads_b = step(engine)  # a1 finished: the slot is free, b1 takes it (a is evicted)
    assert loads_b.lora_loads == ["b"] and running_ids(engine)[-1] == "b1"
    assert engine.loaded_lora_adapters() == ["b"] and waiting_ids(engine) == ["a2"]
    rest = run_to_idle(engine)
    assert [a for s in rest for a in s.lora_loads] == ["a"]  # a2, once b1 is done
    finished = [f.request_id for s in [first, *steps, loads_b, *rest] for f in s.finished]
    assert sorted(finished) == ["a1", "a2", "b1", "base"]
    assert finished.index("b1") < finished.index("a2")
    assert engine.num_lora_loads == 3


def test_max_num_seqs_still_bounds_the_running_set_with_adapters():
    engine = make_engine_with(max_loras=2, max_num_seqs=2)
    submit(engine, *(req(f"r{i}", ADAPTERS[i % 2], max_tokens=3) for i in range(5)))
    step(engine)
    assert running_ids(engine) == ["r0", "r1"] and engine.loaded_lora_adapters() == ["a", "b"]
    assert len([f for s in run_to_idle(engine) for f in s.finished]) == 5


# --------------------------------------------------------------------------- adapters not served
@pytest.mark.parametrize("adapters,adapter,words", [
    (ADAPTERS, "zzz", ["'zzz'", "it serves a, b, c"]),
    ((), "a", ["'a'", "serves no LoRA adapters"]),
], ids=["unknown-adapter", "engine-without-adapters"])
def test_an_adapter_the_engine_does_not_serve_fails_adapter_not_found(adapters, adapter, words):
    engine = make_engine_with(adapters=adapters)
    submit(engine, req("bad", adapter), req("good"))
    result = step(engine)
    assert [(f.request_id, f.code) for f in result.failed] == [("bad", "adapter_not_found")]
    assert all(w in result.failed[0].message for w in words), result.failed[0].message
    assert engine.num_lora_loads == 0 and engine.loaded_lora_adapters() == []
    assert [f.request_id for s in [result, *run_to_idle(engine)] for f in s.finished] == ["good"]


def test_the_torch_engine_serves_no_adapter():
    pytest.importorskip("torch")
    from workers.engines.torch_engine import TorchEngine, load_model

    engine = TorchEngine(load_model("tiny"), role="pd_fusion", num_kv_blocks=64, block_size_tokens=4,
                         max_seq_len_tokens=256)
    assert (engine.lora_adapters, engine.max_loras, engine.loaded_lora_adapters()) == ([], 0, [])
    engine.submit_batch(EngineBatch(batch_id="b1", requests=[req("r1", "a")]))
    result = engine.step()
    assert [(f.request_id, f.code) for f in result.failed] == [("r1", "adapter_not_found")]
    assert "serves no LoRA adapters" in result.failed[0].message
    engine.check_invariants()


def test_engine_arguments_are_checked():
    with pytest.raises(ValueError, match="max_loras"):
        make_engine_with(adapters=ADAPTERS, max_loras=0)
    with pytest.raises(ValueError, match="distinct"):
        make_engine_with(adapters=("a", "a"))
    with pytest.raises(ValueError, match="lora_load_ms"):
        make_engine_with(lora_load_ms=-1)


# --------------------------------------------------------------------------- invariants, no starvation
@settings(max_examples=60, deadline=None)
@given(workload=st.lists(st.tuples(st.sampled_from(["", "a", "b", "c", "d"]), st.integers(1, 6), st.integers(1, 12)),
                         min_size=1, max_size=30),
       max_loras=st.integers(1, 3), max_num_seqs=st.sampled_from([2, 4, 256]),
       scheduler=st.sampled_from(["vllm", "sglang"]), num_per_step=st.integers(1, 4))
def test_random_workloads_keep_the_slot_invariants_and_every_request_finishes(workload, max_loras, max_num_seqs,
                                                                              scheduler, num_per_step):
    engine = make_engine_with(adapters=("a", "b", "c", "d"), max_loras=max_loras, max_num_seqs=max_num_seqs,
                              scheduler=scheduler)
    pending = [req(f"r{i}", adapter, max_tokens, prompt) for i, (adapter, max_tokens, prompt) in enumerate(workload)]
    steps: list[StepResult] = []
    while pending:  # arrivals while the engine runs: a few per step
        submit(engine, *pending[:num_per_step])
        pending = pending[num_per_step:]
        if (result := engine.step()) is not None:
            engine.check_invariants()
            steps.append(result)
    steps += run_to_idle(engine)  # fails if a request waits forever
    assert sorted(f.request_id for s in steps for f in s.finished) == sorted(f"r{i}" for i in range(len(workload)))
    assert sum(len(s.lora_loads) for s in steps) == engine.num_lora_loads
    assert len(engine.loaded_lora_adapters()) <= max_loras


# --------------------------------------------------------------------------- settings
@pytest.mark.parametrize("fields,adapters,max_loras", [
    ({}, [], 0),
    ({"lora_adapters": "a, b,"}, ["a", "b"], DEFAULT_MAX_LORAS),
    ({"lora_adapters": "a", "max_loras": 1}, ["a"], 1),
], ids=["none", "default-slots", "one-slot"])
def test_the_sim_engine_is_built_with_the_configured_adapters(fields, adapters, max_loras):
    engine = make_engine(WorkerConfig(worker_id="w0", **fields).validate())
    assert (engine.lora_adapters, engine.max_loras) == (adapters, max_loras)


@pytest.mark.parametrize("fields,words", [
    ({"max_loras": 2}, "without lora_adapters"),
    ({"lora_adapters": "a,a"}, "twice"),
    ({"lora_adapters": "flexlb-sim"}, "served model"),
    ({"lora_adapters": "a", "lora_load_ms": -1}, "lora_load_ms"),
    ({"max_loras": -1}, "max_loras"),
    ({"engine": "openai", "engine_url": "http://127.0.0.1:9", "engine_max_num_seqs": -1}, "engine_max_num_seqs"),
], ids=["slots-without-adapters", "twice", "the-served-model", "negative-load", "negative-slots", "negative-server-seqs"])
def test_bad_lora_settings_stop_the_worker_naming_the_field(fields, words):
    with pytest.raises(ValueError, match=words):
        WorkerConfig(worker_id="w0", **fields).validate()

