"""LoRA-adapter affinity (services/core/lora.py): table-driven stories, the LRU step, and
properties (the pick is an offered worker, deterministic, scores in [0, 1])."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.core.lora import AdapterWorker, LoraParams, pick, score_candidates, state_of, touch


def w(worker_id: str, loaded: str = "", slots: int = 4, outstanding: int = 0) -> AdapterWorker:
    return AdapterWorker(worker_id, tuple(loaded.split()), slots, outstanding)


# (story, workers, adapter, chosen worker, chosen state, words in the reason)
STORIES = [
    ("loaded beats a free slot and an eviction",
     [w("w0", "b c d e"), w("w1", "b"), w("w2", "a b")], "a", "w2", "loaded", "loaded"),
    ("a free slot beats an eviction",
     [w("w0", "b c d e"), w("w1", "b")], "a", "w1", "free_slot", "not loaded"),
    ("an eviction names the least recently used adapter",
     [w("w0", "b c d e"), w("w1", "c d e f")], "a", "w0", "evict", "evicts b"),
    ("loaded wins over an idle worker while under the cap: mean 1.75, cap 4.125, w0 would hold 4",
     [w("w0", "a", outstanding=3), w("w1", outstanding=0), w("w2", outstanding=2), w("w3", outstanding=2)], "a", "w0", "loaded", "loaded"),
    ("the load cap sends work elsewhere: mean 2, cap 1.5 x 3 = 4.5, w0 would hold 6",
     [w("w0", "a", outstanding=5), w("w1", outstanding=1), w("w2", outstanding=1), w("w3", outstanding=1)], "a", "w1", "free_slot",
     "over the load cap"),
    ("over the cap, an eviction under the cap still wins",
     [w("w0", "a", outstanding=5), w("w1", "b c d e", outstanding=1), w("w2", "b c d e", outstanding=0)], "a", "w2", "evict", "over the load cap"),
    ("of two loaded workers, the less loaded",
     [w("w0", "a", outstanding=3), w("w1", "a", outstanding=2)], "a", "w1", "loaded", "loaded"),
    ("ties go by worker id",
     [w("w2", "a", outstanding=1), w("w1", "a", outstanding=1), w("w3", "a", outstanding=1)], "a", "w1", "loaded", "loaded"),
    ("a worker with no slots is never picked for an adapter it lacks",
     [w("w0", slots=0), w("w1", "b c d e", outstanding=9)], "a", "w1", "evict", "every worker that can serve it over the load cap"),
    ("a worker with no slots may serve an adapter it has (preloaded)",
     [w("w0", "a", slots=0), w("w1")], "a", "w0", "loaded", "loaded"),
]


@pytest.mark.parametrize("workers,adapter,chosen,state,why", [s[1:] for s in STORIES], ids=[s[0] for s in STORIES])
def test_stories(workers, adapter, chosen, state, why):
    d = pick(workers, adapter)
    assert (d.worker_id, d.state) == (chosen, state), d
    assert why in d.reason
    assert [c.worker_id for c in d.candidates] == [x.worker_id for x in workers]


def test_a_higher_cap_keeps_the_loaded_worker():
    workers = [w("w0", "a", outstanding=5), w("w1", outstanding=1), w("w2", outstanding=1), w("w3", outstanding=1)]
    assert pick(workers, "a").worker_id == "w1"
    assert pick(workers, "a", LoraParams(max_load_ratio=2.0)).worker_id == "w0"


def test_a_worker_at_the_mean_is_never_over_the_cap():
    # With max_load_ratio >= 1 some worker is at or below the mean, so not every worker is over.
    d = pick([w("w0", "a", outstanding=2), w("w1", outstanding=2)], "a", LoraParams(max_load_ratio=1.0))
    assert (d.worker_id, d.state) == ("w0", "loaded")


def test_no_worker():
    assert pick([], "a").worker_id is None
    d = pick([w("w0", slots=0)], "a")
    assert d.worker_id is None and d.reason.startswith("no_worker")
    assert d.candidates[0].state == "cannot_load" and d.candidates[0].score == 0.0


def test_params_are_checked():
    with pytest.raises(ValueError):
        LoraParams(max_load_ratio=0.9)


@pytest.mark.parametrize("loaded,adapter,slots,after,evicted,did_load", [
    ((), "a", 2, ("a",), None, True),
    (("a", "b"), "a", 2, ("b", "a"), None, False),
    (("a", "b"), "c", 2, ("b", "c"), "a", True),
    (("a", "b", "c"), "d", 2, ("c", "d"), "b", True),  # slots shrank: down to the slots
])
def test_touch_is_lru(loaded, adapter, slots, after, evicted, did_load):
    assert touch(loaded, adapter, slots) == (after, evicted, did_load)


def test_touch_without_slots_refuses():
    with pytest.raises(ValueError):
        touch((), "a", 0)


def test_state_of():
    assert [state_of(x, "a") for x in (w("0", "a"), w("1", "b"), w("2", "b c d e"), w("3", slots=0))] == \
        ["loaded", "free_slot", "evict", "cannot_load"]


ADAPTERS = ["a", "b", "c", "d", "e", "f"]
worker_st = st.builds(
    lambda loaded, slots, outstanding: (tuple(loaded[:slots]) if slots else tuple(loaded[:1]), slots, outstanding),
    st.lists(st.sampled_from(ADAPTERS), unique=True, max_size=4), st.integers(0, 4), st.integers(0, 50))


@settings(max_examples=300, deadline=None)
@given(st.lists(worker_st, min_size=0, max_size=10), st.sampled_from(ADAPTERS), st.floats(1.0, 4.0))
def test_pick_is_an_offered_worker_and_deterministic(specs, adapter, ratio):
    workers = [AdapterWorker(f"w{i}", loaded, slots, out) for i, (loaded, slots, out) in enumerate(specs)]
    params = LoraParams(max_load_ratio=ratio)
    d = pick(workers, adapter, params)
    able = [x for x in workers if state_of(x, adapter) != "cannot_load"]
    if not able:
        assert d.worker_id is None
        return
    assert d.worker_id in {x.worker_id for x in able}
    assert pick(list(workers), adapter, params) == d
    # The offered order does not matter.
    assert pick(list(reversed(workers)), adapter, params).worker_id == d.worker_id
    _, cands = score_candidates(workers, adapter, params)
    assert all(0.0 <= c.score <= 1.0 for c in cands)
    chosen = next(c for c in cands if c.worker_id == d.worker_id)
    # A loaded worker under the cap is always taken over any load.
    if any(c.state == "loaded" and not c.over_cap for c in cands):
        assert chosen.state == "loaded" and not chosen.over_cap
    # Never a worker over the cap while one under it can serve.
    if any(not c.over_cap and c.state != "cannot_load" for c in cands):
        assert not chosen.over_cap
