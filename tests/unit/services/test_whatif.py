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


# ------------------------------------------------------------------ over-refusal (issue 34, 3)
def _journal(records: list[tuple[str, dict, dict]]) -> list:
    from schemas import messages as m

    return [m.Envelope(event_id=f"r:b:{i}", producer="r", seq=i + 1, time_ns=0,
                       payload=m.CoreRecorded(router_id="r", op=op, now_ns=0, args=args, out=out))
            for i, (op, args, out) in enumerate(records)]


def refused_recording(slo_ttft_ms: float | None) -> Recording:
    """A light load (every request fits on its own) whose journal says two requests were
    refused slo_unattainable: one at admission, one held by the TPOT hold (a tick's failure);
    a third failed otherwise (queue_timeout), which is no SLO refusal."""
    rec = recording(n=60)
    rec.arrivals = [dataclasses.replace(a, request=dataclasses.replace(a.request, slo_ttft_ms=slo_ttft_ms, slo_tpot_ms=100.0))
                    for a in rec.arrivals]
    rec.envs = _journal([
        ("admit", {"request": {"request_id": "r3"}}, {"ok": False, "code": "slo_unattainable"}),
        ("tick", {}, {"batches": [], "failures": [["r5", "slo_unattainable", {"worker": "w0"}], ["r7", "queue_timeout"]]}),
    ])
    return rec


def test_over_refusal_counts_the_refused_requests_that_meet_their_slo_with_refusal_off():
    from services.whatif import over_refusal, refused_in

    rec = refused_recording(slo_ttft_ms=2000.0)
    assert refused_in(rec) == ["r3", "r5"]
    out = over_refusal(rec)
    # served with refusal off, r5 meets both targets; r3 decodes at ~190 ms a token (its worker
    # busy with a burst): it would have missed its TPOT target, so refusing it lost nothing
    assert out["refused"] == 2 and out["would_meet"] == 1 and out["would_meet_ids"] == ["r5"]
    assert out["over_refusal_rate"] == round(1 / 60, 4)


def test_a_refusal_that_would_have_missed_anyway_is_not_counted():
    from services.whatif import over_refusal

    out = over_refusal(refused_recording(slo_ttft_ms=0.001))  # no prefill meets a microsecond TTFT target
    assert out["refused"] == 2 and out["would_meet"] == 0 and out["over_refusal_rate"] == 0.0


def test_refusal_off_admits_best_effort_and_keeps_everything_else():
    from services.whatif import refusal_off

    cfg = SchedulerConfig(batcher="slo-budget", batcher_params={"tpot_headroom": 0.9}).validate()
    off = refusal_off(cfg)
    assert off.slo.mode == "best-effort" and cfg.slo.mode == "reject-explicit"
    assert dataclasses.replace(off, slo=cfg.slo) == cfg


def test_over_refusal_weighs_what_serving_the_refused_costs_the_others():
    """Beside "would have met", the re-run with refusals on in the same virtual world: on a load
    where refusing changes nothing the two agree (net 0); on an overload where the TPOT hold
    refuses, `net` is the difference of met requests between the two re-runs, and
    `others_lost` the requests that meet with refusals on and miss with them off."""
    from services.whatif import over_refusal, refusal_off, simulate

    light = over_refusal(refused_recording(slo_ttft_ms=2000.0))
    assert light["net"] == 0 and light["others_lost"] == 0
    assert light["refusal_on_attainment"] == light["rerun_attainment"]

    rec = recording(n=300)
    rec.arrivals = [Arrival(10**12 + (a.t_ns - 10**12) // 6, dataclasses.replace(
        a.request, max_tokens=a.request.max_tokens * 8, slo_ttft_ms=800.0, slo_tpot_ms=40.0)) for a in rec.arrivals]
    rec.config = SchedulerConfig(batcher="slo-budget", batcher_params={"tpot_headroom": 0.9}).validate()
    on, off = simulate(rec, rec.config), simulate(rec, refusal_off(rec.config))
    assert on["rejected"].get("slo_unattainable", 0) > 0 and off["rejected"] == {}
    heavy = over_refusal(rec)
    assert heavy["net"] == off["num_attained"] - on["num_attained"]
    assert heavy["refusal_on_attainment"] == on["slo_attainment"] and heavy["rerun_attainment"] == off["slo_attainment"]
    assert 0 <= heavy["others_lost"] <= on["num_attained"]
    assert heavy["others_lost"] >= on["num_attained"] - off["num_attained"]  # at least the net loss, if any


def test_marginal_over_refusal_serves_each_refused_request_alone_and_weighs_the_others():
    """Each refusal judged alone (the question the router asked at the time): the run's
    arrivals re-run with that one request best effort. Checked here by re-running each by hand."""
    from services.whatif import _simulate, marginal_over_refusal

    rec = recording(n=16)
    rec.arrivals = [Arrival(10**12 + (a.t_ns - 10**12) // 6, dataclasses.replace(
        a.request, max_tokens=a.request.max_tokens * 8, slo_ttft_ms=800.0, slo_tpot_ms=40.0)) for a in rec.arrivals]
    rec.config = SchedulerConfig(batcher="slo-budget", batcher_params={"tpot_headroom": 0.9}).validate()

    def run(arrivals) -> dict:
        outcomes: dict = {}
        _simulate(dataclasses.replace(rec, arrivals=arrivals), rec.config, None, 200.0, 500.0, None, False, lambda: None,
                  "sim", outcomes)
        return outcomes

    on = run(rec.arrivals)
    refused = [r for r, o in on.items() if o.code == "slo_unattainable"]
    out = marginal_over_refusal(rec)
    assert out["refused"] == len(refused) > 0 and len(out["others_delta"]) == len(refused)
    assert out["at_no_cost"] + out["at_a_cost"] + out["would_miss"] == len(refused)
    met_on = sum(o.attained for o in on.values())
    for rid, delta in zip(refused, out["others_delta"]):
        one = run([Arrival(a.t_ns, dataclasses.replace(a.request, best_effort=True)) if a.request.request_id == rid else a
                   for a in rec.arrivals])
        assert one[rid].code != "slo_unattainable"  # served, late or not
        assert delta == sum(o.attained for r, o in one.items() if r != rid) - met_on
        assert (rid in out["at_no_cost_ids"]) == (one[rid].attained and delta >= 0)
    assert out["marginal_over_refusal_rate"] == round(out["at_no_cost"] / 16, 4)
    # a light load refuses nothing: nothing to judge
    light = marginal_over_refusal(refused_recording(slo_ttft_ms=2000.0))
    assert light["refused"] == 0 and light["marginal_over_refusal_rate"] == 0.0
