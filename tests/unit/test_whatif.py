"""`flexlb whatif`'s simulation: deterministic, and it tells policies apart the way the
running stack does (cost-based reuses shared prefixes that round-robin scatters)."""

from __future__ import annotations

import dataclasses
import random

from services.core.scheduler import AdmitRequest, SchedulerConfig
from services.whatif import Arrival, Recording, WorkerSpec, simulate, with_overrides

MS = 1_000_000


def recording(seed: int = 1, n: int = 300) -> Recording:
    rng = random.Random(seed)
    prefixes = [tuple(rng.getrandbits(60) for _ in range(rng.randint(100, 400))) for _ in range(60)]
    arrivals, t = [], 10**12
    for i in range(n):
        t += int(rng.expovariate(1 / 40) * MS)  # ~25 arrivals/s of engine time
        p = rng.choice(prefixes)
        hashes = p[: rng.randint(len(p) // 2, len(p))] + tuple(rng.getrandbits(60) for _ in range(rng.randint(1, 20)))
        arrivals.append(Arrival(t, AdmitRequest(request_id=f"r{i}", num_prompt_tokens=len(hashes) * 16 + 3,
                                                max_tokens=rng.randint(5, 60), block_hashes=hashes)))
    workers = [WorkerSpec(f"w{i}", "pd_fusion", 200_000, 16, 131_072, 140_000, 1.0) for i in range(4)]
    cfg = SchedulerConfig(batcher_params={"wait_ms": 10.0}).validate()
    return Recording(cfg, arrivals, workers, [])


def test_a_rerun_is_deterministic_and_serves_every_arrival():
    rec = recording()
    a, b = simulate(rec, rec.config), simulate(rec, rec.config)
    assert a == b
    assert a["ttft_ms"]["n"] == len(rec.arrivals) and a["rejected"] == {}
    assert 0 < a["ttft_ms"]["mean"] < a["ttft_ms"]["p99"]


def test_cost_based_reuses_shared_prefixes_that_round_robin_scatters():
    rec = recording()
    cost = simulate(rec, rec.config)
    rr = simulate(rec, with_overrides(rec.config, "round-robin", None, None))
    assert cost["prefix_hit_rate"] > rr["prefix_hit_rate"] + 0.1, (cost["prefix_hit_rate"], rr["prefix_hit_rate"])
    assert cost["ttft_ms"]["mean"] < rr["ttft_ms"]["mean"]


def test_more_workers_cut_the_wait():
    rec = recording(n=400)
    two, eight = simulate(rec, rec.config, num_workers=2), simulate(rec, rec.config, num_workers=8)
    assert eight["ttft_ms"]["p90"] < two["ttft_ms"]["p90"]


def test_more_workers_keep_every_recorded_pool():
    """Rescaling a recording of two pools takes the recorded workers as templates in turn: each
    pool keeps workers, so its requests are still served (copying the first worker's model
    would leave pool b's requests with none)."""
    rec = recording(n=120)
    for i, w in enumerate(rec.workers):
        w.model = "a" if i % 2 == 0 else "b"
    rec.config = dataclasses.replace(rec.config, model_name="a")
    for i, arrival in enumerate(rec.arrivals):
        arrival.request.model = "a" if i % 2 == 0 else "b"
    out = simulate(rec, rec.config, num_workers=6)
    assert out["ttft_ms"]["n"] == len(rec.arrivals) and out["rejected"] == {}
