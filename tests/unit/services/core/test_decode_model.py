"""The decode-step model (services/core/decode_model.py): prior, online learning from status
reports, robustness, bounds, determinism; and what the scheduler makes of it (a seeded RNG,
no clock)."""

from __future__ import annotations

import random

import pytest

from schemas.messages import WorkerStatusReported
from services.core.decode_model import DecodeCoefficients, DecodeModel, DecodeModelParams
from services.core.scheduler import AdmitRequest, Scheduler, SchedulerConfig


def samples(rng: random.Random, n: int, a: float, b: float, c: float, noise: float = 0.03):
    """(running, kv tokens, measured step ms) of an engine with step = a + b·R + c·K/1000."""
    out = []
    for _ in range(n):
        running = rng.randint(1, 120)
        kv = running * rng.randint(300, 3000)
        out.append((running, kv, (a + b * running + c * kv / 1000) * (1 + rng.gauss(0, noise))))
    return out


def mean_abs_pct_error(model: DecodeModel, data) -> float:
    return 100 * sum(abs(model.predict_ms(r, k) - y) / y for r, k, y in data) / len(data)


def test_the_prior_is_the_default_profiles_decode_fit():
    m = DecodeModel()
    assert m.predict_ms(10, 20_000) == pytest.approx(29.57 + 0.198 * 10 + 0.220 * 20)


@pytest.mark.parametrize("scale", [0.5, 2.0, 3.0])
def test_it_learns_an_engine_unlike_its_prior(scale):
    rng = random.Random(7)
    truth = (29.57 * scale, 0.198 * scale, 0.22 * scale)
    m = DecodeModel()
    held_out = samples(random.Random(99), 200, *truth, noise=0.0)
    before = mean_abs_pct_error(m, held_out)
    for r, k, y in samples(rng, 400, *truth):
        m.observe(r, k, y)
    after = mean_abs_pct_error(m, held_out)
    assert after < 6.0 < before, (before, after)
    assert m.num_observations == 400 and m.mean_abs_pct_error < 10


def test_reports_without_load_or_time_teach_nothing():
    m = DecodeModel()
    for running, kv, step in [(0, 0, 50.0), (3, 1000, 0.0), (3, 1000, float("nan")), (3, -1, 50.0)]:
        assert m.observe(running, kv, step) is False
    assert m.num_observations == 0 and m.coefficients == DecodeCoefficients()


def test_learning_off_keeps_the_prior_but_scores_it():
    m = DecodeModel(params=DecodeModelParams(learning=False))
    for r, k, y in samples(random.Random(1), 50, 60, 0.5, 0.5):
        m.observe(r, k, y)
    assert m.coefficients == DecodeCoefficients() and m.mean_abs_pct_error > 20


def test_an_absurd_report_moves_the_prediction_a_bounded_step_and_coefficients_stay_in_bounds():
    m = DecodeModel()
    for r, k, y in samples(random.Random(3), 300, 29.57, 0.198, 0.22):
        m.observe(r, k, y)
    before = m.predict_ms(50, 60_000)
    m.observe(50, 60_000, before * 100)
    assert m.predict_ms(50, 60_000) < 1.5 * before
    for _ in range(500):  # a stream of garbage
        m.observe(1, 0, 1e9)
        m.observe(200, 10**7, 1e-6)
    c = m.coefficients
    for value, prior in zip((c.base_ms, c.per_request_ms, c.per_kilotoken_ms), (29.57, 0.198, 0.22)):
        assert prior / 10 <= value <= 10 * prior


def test_prefill_pauses_that_grow_with_the_context_do_not_become_a_context_cost():
    """A prefill-first engine with long histories: few requests, much context, token gaps
    that carry whole prefill steps. The model must stay near what the engine gives at that
    load, not read the pauses as a per-token cost (a 3-coefficient fit predicted 2.2x)."""
    rng = random.Random(11)
    m = DecodeModel()
    for _ in range(300):
        running = rng.randint(2, 8)
        kv = running * rng.randint(4000, 12000)
        base = DecodeModel().predict_ms(running, kv)
        m.observe(running, kv, base * (1.0 + (1.5 if rng.random() < 0.1 else 0.0)))  # 1 report in 10 caught a prefill
    assert 0.9 < m.predict_ms(4, 38_000) / DecodeModel().predict_ms(4, 38_000) < 1.4


def test_the_same_reports_give_the_same_model():
    data = samples(random.Random(5), 100, 40, 0.3, 0.3)
    a, b = DecodeModel(), DecodeModel()
    for r, k, y in data:
        a.observe(r, k, y)
        b.observe(r, k, y)
    assert a.coefficients == b.coefficients


@pytest.mark.parametrize("bad", [{"forgetting_factor": 0.5}, {"max_scale": 1}, {"outlier_sigmas": 0.5},
                                 {"error_ema_alpha": 0}])
def test_bad_parameters_are_refused(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        DecodeModelParams(**bad).validate()


def status(worker_id: str, running: int, used_blocks: int, step_ms: float, role: str = "pd_fusion") -> WorkerStatusReported:
    return WorkerStatusReported(worker_id=worker_id, role=role, boot_id="b0", block_size_tokens=16, num_kv_blocks=10_000,
                                num_free_kv_blocks=10_000 - used_blocks, max_batch_tokens=65536, max_seq_len_tokens=8192,
                                num_running_requests=running, recent_step_ms=step_ms)


def test_the_scheduler_learns_each_workers_model_from_its_reports_and_predicts_its_tpot_with_what_it_sent():
    s = Scheduler(SchedulerConfig(), id_prefix="r")
    for i in range(200):  # w0 decodes twice as slowly as the prior says
        running = 10 + i % 50
        s.on_worker_event(status("w0", running, running * 100, 2 * DecodeModel().predict_ms(running, running * 1600)), i)
        s.on_worker_event(status("w1", running, running * 100, DecodeModel().predict_ms(running, running * 1600)), i)
    s.on_worker_event(status("w0", 20, 2000, 0.0), 300)
    s.on_worker_event(status("w1", 20, 2000, 0.0), 300)
    slow, fast = s.load("w0", 300), s.load("w1", 300)
    assert slow.tpot_ms == pytest.approx(2 * fast.tpot_ms, rel=0.1)
    assert fast.tpot_ms == pytest.approx(DecodeModel().predict_ms(20, 32_000), rel=0.05)
    # a request admitted and dispatched to w1 counts there before w1 reports it
    a = s.admit(AdmitRequest(request_id="x", num_prompt_tokens=3200, max_tokens=10, slo_ttft_ms=60_000), 300)
    worker = a.request.prefill_worker_id
    before = s.load(worker, 300).tpot_ms
    assert len(s.tick(300 + 2 * 10**9).batches) == 1  # past the 1 s window: dispatched
    assert s.engine_load(worker)[0] == 21
    assert s.load(worker, 300 + 2 * 10**9).tpot_ms > before


def test_an_idle_worker_or_a_prefill_worker_reports_no_tpot_to_hold_for():
    s = Scheduler(SchedulerConfig(), id_prefix="r")
    s.on_worker_event(status("idle", 0, 0, 0.0), 0)
    s.on_worker_event(status("p0", 5, 500, 40.0, role="prefill"), 0)
    assert s.load("idle", 0).tpot_ms == 0.0 and s.load("p0", 0).tpot_ms == 0.0
    assert "p0" not in s.decode_models


# ------------------------------------------------------------------ the TPOT calibration
def test_the_calibration_is_the_identity_until_a_request_finishes():
    model = DecodeModel()
    assert model.tpot_slope == 1.0 and model.tpot_intercept_ms == 0.0 and model.num_tpot_observations == 0
    assert model.predict_tpot_ms(10, 20_000) == pytest.approx(model.predict_ms(10, 20_000))


def test_it_learns_the_line_from_predicted_steps_to_the_tpot_requests_got():
    """Requests dispatched at a high predicted step regress to the worker's mean over their
    life: TPOT = 40 + 0.5 x predicted (noise 3 %). The line is learned, and a prediction well
    above the mean becomes the TPOT such a request really gets."""
    rng = random.Random(7)
    model = DecodeModel()
    for _ in range(400):
        x = rng.uniform(50, 120)
        model.observe_tpot(x, (40 + 0.5 * x) * (1 + rng.gauss(0, 0.03)))
    assert model.tpot_slope == pytest.approx(0.5, abs=0.08)
    assert model.tpot_intercept_ms == pytest.approx(40, abs=7)
    assert model.calibrated_ms(110) == pytest.approx(95, abs=3)  # not 110: the hold would have held it


def test_without_spread_in_the_predictions_it_scales_through_the_origin():
    model = DecodeModel()
    for _ in range(50):
        model.observe_tpot(80.0, 60.0)
    assert model.tpot_intercept_ms == 0.0 and model.tpot_slope == pytest.approx(0.75)


@pytest.mark.parametrize("predicted, measured", [(0.0, 50.0), (50.0, 0.0), (float("nan"), 50.0), (50.0, float("inf"))])
def test_an_unusable_sample_teaches_nothing(predicted, measured):
    model = DecodeModel()
    assert not model.observe_tpot(predicted, measured)
    assert model.num_tpot_observations == 0 and model.tpot_slope == 1.0


def test_calibration_off_keeps_the_identity():
    model = DecodeModel(params=DecodeModelParams(tpot_calibration_alpha=0.0))
    assert not model.observe_tpot(80.0, 40.0)
    assert model.tpot_slope == 1.0


def test_the_slope_stays_within_its_bound():
    model = DecodeModel(params=DecodeModelParams(max_tpot_slope=1.2))
    for x in (50, 60, 70, 80, 90, 100) * 10:
        model.observe_tpot(float(x), 3.0 * x)
    assert model.tpot_slope == 1.2


def loaded_report(worker_id: str, **fields) -> WorkerStatusReported:
    """A colocated worker running 8 requests at 40 ms a step."""
    return WorkerStatusReported(worker_id=worker_id, role="pd_fusion", boot_id="b", block_size_tokens=16,
                                num_kv_blocks=10_000, num_free_kv_blocks=9_000, max_batch_tokens=65536,
                                max_seq_len_tokens=40960, num_running_requests=8, recent_step_ms=40.0, **fields)


def dispatch(s: Scheduler, n: int) -> None:
    """Admit n small requests and tick (100 ms at a time) until every batch has left."""
    for i in range(n):
        s.admit(AdmitRequest(request_id=f"r{i}", num_prompt_tokens=100, max_tokens=50), 1_000 * i)
    t = 0
    while s.queued:
        t += 100_000_000
        s.tick(t)


def test_the_scheduler_calibrates_a_worker_from_the_tpot_its_finished_requests_got():
    """The step predicted when a batch formed, then the TPOT each member got (on_terminal):
    the worker's calibration moves; a request without a measured TPOT teaches nothing."""
    s = Scheduler(SchedulerConfig(), id_prefix="t")
    s.on_worker_event(loaded_report("w0", time_scale=2.0), 0)
    dispatch(s, 6)
    predicted = {rid: step for rid, (_, step) in s.tpot_predicted.items()}
    assert len(predicted) == 6 and all(step > 0 for step in predicted.values())
    model = s.decode_model("w0")
    s.on_terminal("r0", 50)  # no TPOT measured: nothing learned, and it is forgotten
    assert model.num_tpot_observations == 0 and "r0" not in s.tpot_predicted
    for rid in ("r1", "r2", "r3", "r4", "r5"):
        s.on_terminal(rid, 50, tpot_ms=predicted[rid])  # wall ms at time scale 2: half the engine's step
    assert model.num_tpot_observations == 5
    assert model.calibrated_ms(predicted["r1"]) == pytest.approx(predicted["r1"] / 2, rel=0.01)
    assert not s.tpot_predicted


def test_pool_scope_teaches_every_worker_of_the_pool_but_keeps_recent_tpot_its_own():
    """tpot_calibration_scope "pool": a request finished on w0 moves the calibration of w0 and
    of w1 (same model and role) alike, not that of w2 (another model); `recent_tpot_ms`, the
    hold's sign of a saturated worker, stays w0's. "worker" (the default): w1 learns nothing."""
    for scope in ("pool", "worker"):
        s = Scheduler(SchedulerConfig(decode_model_params=DecodeModelParams(tpot_calibration_scope=scope)), id_prefix="t")
        for wid, model in (("w0", ""), ("w1", ""), ("w2", "other")):
            s.on_worker_event(loaded_report(wid, model=model), 0)
            s.decode_model(wid)
        dispatch(s, 4)
        on_w0 = [rid for rid, (wid, _) in s.tpot_predicted.items() if wid == "w0"]
        assert on_w0
        for rid in on_w0:
            s.on_terminal(rid, 50, tpot_ms=2 * s.tpot_predicted[rid][1])
        w0, w1, w2 = (s.decode_model(w) for w in ("w0", "w1", "w2"))
        assert w0.num_tpot_observations == len(on_w0) and w0.recent_tpot_ms > 0
        assert w2.num_tpot_observations == 0
        assert w1.recent_tpot_ms == 0
        if scope == "pool":
            assert w1.num_tpot_observations == len(on_w0)
            assert (w1.tpot_slope, w1.tpot_intercept_ms) == (w0.tpot_slope, w0.tpot_intercept_ms)
        else:
            assert w1.num_tpot_observations == 0 and w1.tpot_slope == 1.0


def test_an_unknown_calibration_scope_is_refused():
    with pytest.raises(ValueError, match="tpot_calibration_scope"):
        DecodeModelParams(tpot_calibration_scope="fleet").validate()
