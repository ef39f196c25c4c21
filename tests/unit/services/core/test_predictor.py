"""The prefill-time predictor: the formula, online learning against a hidden simulated engine,
robustness to outliers and bad measurements, bounds, and parameter validation."""

from __future__ import annotations

import itertools
import math
import random
import statistics
from dataclasses import dataclass

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.core.predictor import (
    MIN_MEASURED_MS,
    PredictorParams,
    PrefillCoefficients,
    PrefillPredictor,
    _project_onto_box,
    _solve,
)
from workers.engines.sim import TimingProfile, load_profile

PRIOR = PrefillCoefficients()
NO_LEARNING = PredictorParams(learning=False)


# --------------------------------------------------------------------------- builders
def make_batch(rng: random.Random) -> list[tuple[int, int]]:
    """A realistic prefill batch: 1-16 requests, prompts 50-8,000 tokens, 0-70 % cached."""
    batch = []
    for _ in range(rng.randint(1, 16)):
        num_prompt_tokens = rng.randint(50, 8000)
        batch.append((num_prompt_tokens, int(num_prompt_tokens * rng.uniform(0.0, 0.7))))
    return batch


def make_engine_profile(scale: float) -> TimingProfile:
    """The hidden engine: the default sim profile with its prefill coefficients × scale."""
    base = load_profile(None)
    return msgspec.structs.replace(
        base,
        name=f"hidden-{scale}x",
        prefill_base_ms=base.prefill_base_ms * scale,
        prefill_per_token_ms=base.prefill_per_token_ms * scale,
        prefill_per_token_sq_ms=base.prefill_per_token_sq_ms * scale,
    )


@dataclass
class Sample:
    batch: list[tuple[int, int]]
    true_ms: float  # the engine's noise-free time
    measured_ms: float  # what the worker reports: noise and outliers included


def make_samples(
    truth, num_batches: int, seed: int, noise: float = 0.05, outlier_rate: float = 0.02, outlier_factor: float = 5.0
) -> list[Sample]:
    """Batches timed by `truth` (anything with prefill_ms(batch)), with seeded ±noise
    multiplicative jitter and a fraction of outliers that take outlier_factor × as long."""
    rng = random.Random(seed)
    samples = []
    for _ in range(num_batches):
        batch = make_batch(rng)
        true_ms = truth.prefill_ms(batch)
        measured_ms = true_ms * rng.uniform(1.0 - noise, 1.0 + noise)
        if rng.random() < outlier_rate:
            measured_ms *= outlier_factor
        samples.append(Sample(batch, true_ms, measured_ms))
    return samples


def drive(predictor: PrefillPredictor, samples: list[Sample]) -> tuple[list[float], list[float]]:
    """Predict each batch before observing it; return the relative errors against the true
    time and against the measured time."""
    errors_vs_true, errors_vs_measured = [], []
    for s in samples:
        predicted_ms = predictor.predict_ms(s.batch)
        errors_vs_true.append(abs(predicted_ms - s.true_ms) / s.true_ms)
        errors_vs_measured.append(abs(predicted_ms - s.measured_ms) / s.measured_ms)
        predictor.observe(s.batch, s.measured_ms)
    return errors_vs_true, errors_vs_measured


def assert_within_bounds(predictor: PrefillPredictor) -> None:
    upper = predictor.max_coefficients.as_tuple()
    for name, value, high in zip(PrefillCoefficients.__struct_fields__, predictor.coefficients.as_tuple(), upper):
        assert math.isfinite(value) and 0.0 <= value <= high, (name, value, high)


class Coefficients:
    """A truth with all five terms (the sim profile has only a, b, c)."""

    def __init__(self, c: PrefillCoefficients) -> None:
        self.predictor = PrefillPredictor(c, NO_LEARNING)

    def prefill_ms(self, batch):
        return self.predictor.predict_ms(batch)


# --------------------------------------------------------------------------- the formula
def test_one_uncached_prompt_matches_the_formula_by_hand():
    # 26.45 + 0.06414 × 1,000 + 3.635e-6 × 1,000,000
    assert PrefillPredictor(PRIOR, NO_LEARNING).predict_ms([(1000, 0)]) == pytest.approx(94.225)


def test_a_cached_prefix_is_not_computed():
    # n − p = 744; n² − p² = 1,000,000 − 65,536 = 934,464
    expected = 26.45 + 0.06414 * 744 + 3.635e-6 * 934_464
    assert expected == pytest.approx(77.56693664)
    assert PrefillPredictor().predict_ms([(1000, 256)]) == pytest.approx(expected)


def test_every_term_of_the_formula():
    c = PrefillCoefficients(base_ms=10.0, per_token_ms=0.1, per_token_sq_ms=1e-5, per_cached_token_ms=0.01,
                            per_request_ms=2.0)
    batch = [(1000, 200), (500, 0), (300, 300)]
    computed = 800 + 500 + 0
    computed_sq = (1_000_000 - 40_000) + 250_000 + 0
    cached = 200 + 0 + 300
    expected = 10.0 + 0.1 * computed + 1e-5 * computed_sq + 0.01 * cached + 2.0 * 3
    assert PrefillPredictor(c).predict_ms(batch) == pytest.approx(expected)


def test_the_default_prior_is_the_default_sim_profile():
    profile = load_profile(None)
    batch = [(4000, 1000), (120, 0), (7000, 6000)]
    assert PrefillPredictor().predict_ms(batch) == pytest.approx(profile.prefill_ms(batch))


def test_an_empty_batch_takes_no_time():
    assert PrefillPredictor().predict_ms([]) == 0.0


@pytest.mark.parametrize("bad", [(100, 101), (100, -1)], ids=["cached>prompt", "negative-cached"])
def test_impossible_requests_are_caller_bugs(bad):
    predictor = PrefillPredictor()
    with pytest.raises(ValueError, match="cached"):
        predictor.predict_ms([bad])
    with pytest.raises(ValueError, match="cached"):
        predictor.observe([bad], 100.0)
    with pytest.raises(ValueError, match="empty"):
        predictor.observe([], 100.0)


# --------------------------------------------------------------------------- acceptance
@pytest.mark.parametrize("engine_scale", [2.0, 0.5], ids=["engine-2x-slower", "engine-2x-faster"])
def test_the_predictor_learns_a_hidden_engine_that_starts_2x_off(engine_scale):
    """Acceptance: the router's prior is the default profile; the engine's real profile is 2×
    (or ½×) of it and hidden; measurements carry ±5 % noise and 2 % outliers (×5). The mean
    absolute error over batches 200-300, each predicted before it is observed, is <= 10 %."""
    samples = make_samples(make_engine_profile(engine_scale), num_batches=300, seed=7)
    learner = PrefillPredictor()
    errors, errors_vs_measured = drive(learner, samples)
    frozen_errors, _ = drive(PrefillPredictor(params=NO_LEARNING), samples)

    mape_before = statistics.mean(frozen_errors[200:300])
    mape_after = statistics.mean(errors[200:300])
    print(f"{engine_scale}x: MAPE before learning {mape_before:.1%}, first 20 batches "
          f"{statistics.mean(errors[:20]):.1%}, batches 200-300 {mape_after:.2%} vs true, "
          f"{statistics.mean(errors_vs_measured[200:300]):.2%} vs measured; metric "
          f"{learner.mean_abs_pct_error:.2f} %; {learner.coefficients}")

    assert mape_before >= 0.40, "the prior must start far off, or this test could not fail"
    assert errors[0] >= 0.40
    assert mape_after <= 0.10
    # Against the noisy, outlier-laden measurements too (what an operator sees).
    assert statistics.mean(errors_vs_measured[200:300]) <= 0.10
    # The exported metric tells the same story.
    assert learner.num_observations == 300
    assert learner.mean_abs_pct_error <= 10.0
    assert_within_bounds(learner)


@pytest.mark.parametrize("engine_scale", [2.0, 0.5], ids=["engine-2x-slower", "engine-2x-faster"])
def test_it_learns_on_every_one_of_40_seeded_runs(engine_scale):
    """The acceptance bound on the worst of 40 seeds, not just one lucky seed. (Clamping each
    coefficient into its bounds alone, instead of projecting in the metric of P⁻¹, failed
    this on 4 of these 40 seeds of the faster engine, the worst at 250 %.)"""
    worst = 0.0
    for seed in range(40):
        errors, _ = drive(PrefillPredictor(), make_samples(make_engine_profile(engine_scale), num_batches=300,
                                                           seed=1000 + seed))
        worst = max(worst, statistics.mean(errors[200:300]))
    assert worst <= 0.10


def test_it_learns_the_shape_not_just_the_scale():
    """A truth whose terms are off in different directions, with d and e the prior lacks;
    judged on the training mix and on small batches, where the base cost dominates."""
    truth = Coefficients(PrefillCoefficients(base_ms=3 * 26.45, per_token_ms=0.06414, per_token_sq_ms=0.5 * 3.635e-6,
                                             per_cached_token_ms=0.3 * 0.06414, per_request_ms=2.0))
    learner = PrefillPredictor()
    errors, _ = drive(learner, make_samples(truth, num_batches=300, seed=11))
    assert statistics.mean(errors[200:300]) <= 0.05
    for small in ([(100, 0)], [(500, 0)], [(300, 0)] * 4):
        assert learner.predict_ms(small) == pytest.approx(truth.prefill_ms(small), rel=0.10), small


def test_without_learning_it_scores_but_never_changes():
    predictor = PrefillPredictor(params=NO_LEARNING)
    drive(predictor, make_samples(make_engine_profile(2.0), num_batches=50, seed=1))
    assert predictor.coefficients == PRIOR
    assert predictor.num_observations == 50
    assert predictor.mean_abs_pct_error >= 40.0


def test_errors_are_scored_before_learning():
    predictor = PrefillPredictor()
    batch = [(1000, 0)]
    predictor.observe(batch, 2 * 94.225)
    assert predictor.mean_abs_error_ms == pytest.approx(94.225)  # the prior's error, not the refit's
    assert predictor.mean_abs_pct_error == pytest.approx(50.0)
    assert predictor.predict_ms(batch) > 94.225  # ... and then it learned


# --------------------------------------------------------------------------- robustness
def test_a_burst_of_absurd_measurements_does_not_wreck_it():
    """10 batches reported 100× too slow after convergence: the predictions move a little,
    recover within 100 batches, and the coefficients stay finite and within bounds."""
    truth = make_engine_profile(2.0)
    learner = PrefillPredictor()
    drive(learner, make_samples(truth, num_batches=200, seed=3))
    burst = make_samples(truth, num_batches=10, seed=4, outlier_rate=1.0, outlier_factor=100.0)
    burst_errors, _ = drive(learner, burst)
    assert_within_bounds(learner)
    assert learner.num_clipped_observations >= 10
    after, _ = drive(learner, make_samples(truth, num_batches=100, seed=5))

    # Measured: 6 % at most during the burst, 8 % just after, 3 % at the end. Without the
    # clipping (outlier_sigmas=1e6): 39 %, 47 % and still 25 %.
    assert max(burst_errors) <= 0.25, "each absurd value moves the prediction by a bounded step"
    assert max(after[:10]) <= 0.25
    assert statistics.mean(after[80:100]) <= 0.10
    assert_within_bounds(learner)


@pytest.mark.parametrize("bad_ms", [math.nan, math.inf, -math.inf, -5.0, 0.0, 1e-300, 0.000999],
                         ids=["nan", "inf", "-inf", "negative", "zero", "denormal-ish", "under-1us"])
def test_bad_measurements_are_rejected_and_counted(bad_ms):
    predictor = PrefillPredictor()
    predictor.observe([(1000, 0)], bad_ms)
    predictor.observe([(2000, 500), (100, 0)], bad_ms)
    assert predictor.num_rejected_observations == 2
    assert predictor.num_observations == 0
    assert predictor.coefficients == PRIOR
    assert predictor.mean_abs_error_ms == 0.0 and predictor.mean_abs_pct_error == 0.0
    predictor.observe([(1000, 0)], 100.0)
    assert predictor.num_observations == 1 and predictor.num_rejected_observations == 2
    stats = predictor.stats()
    assert stats.num_rejected_observations == 2 and stats.num_observations == 1


@pytest.mark.parametrize(
    "forgetting_factor,num_batches,max_error",
    [(0.995, 400, 0.10), (0.98, 200, 0.05)],
    ids=["default-memory-200", "memory-50"],
)
def test_a_step_change_of_a_noiseless_engine_is_followed(forgetting_factor, num_batches, max_error):
    """After converging on a noiseless engine (σ at its floor), the engine becomes 1.5×
    slower. The first residuals look like outliers and are clipped, but the robust scale
    opens up and the change is learned, with a time constant of about 1/(1 − λ) batches."""
    learner = PrefillPredictor(params=PredictorParams(forgetting_factor=forgetting_factor))
    drive(learner, make_samples(make_engine_profile(1.0), num_batches=200, seed=8, noise=0.0, outlier_rate=0.0))
    assert learner.residual_scale < 0.02
    errors, _ = drive(learner, make_samples(make_engine_profile(1.5), num_batches=num_batches, seed=9, noise=0.0,
                                            outlier_rate=0.0))
    assert errors[0] >= 0.30
    assert learner.num_clipped_observations >= 1
    assert statistics.mean(errors[num_batches - 50:]) <= max_error


batches = st.lists(
    st.integers(min_value=0, max_value=200_000).flatmap(
        lambda n: st.tuples(st.just(n), st.integers(min_value=0, max_value=n))
    ),
    min_size=1, max_size=64,
)
measurements = st.one_of(
    st.floats(min_value=MIN_MEASURED_MS, max_value=1e12, allow_nan=False, allow_infinity=False),
    st.sampled_from([MIN_MEASURED_MS, 1e300, 1.7e308]),
)


@settings(max_examples=100, deadline=None)
@given(observations=st.lists(st.tuples(batches, measurements), min_size=1, max_size=40), probe=batches)
def test_predictions_stay_finite_and_coefficients_bounded_whatever_is_observed(observations, probe):
    predictor = PrefillPredictor()
    for batch, measured_ms in observations:
        predictor.observe(batch, measured_ms)
        assert_within_bounds(predictor)
        for b in (batch, probe):
            predicted_ms = predictor.predict_ms(b)
            assert math.isfinite(predicted_ms) and predicted_ms >= 0.0
    assert predictor.num_observations == len(observations)
    assert predictor.num_covariance_resets == 0
    stats = predictor.stats()
    assert all(math.isfinite(v) for v in (stats.mean_abs_error_ms, stats.mean_abs_pct_error, stats.residual_scale))


def make_covariance(draw_row) -> list[list[float]]:
    a = [draw_row() for _ in range(5)]
    return [[sum(a[i][k] * a[j][k] for k in range(5)) + 0.01 * (i == j) for j in range(5)] for i in range(5)]


def nearest_in_box_by_brute_force(phi, p, max_phi):
    """Reference model: try every assignment of each coordinate to free / lower / upper;
    keep the feasible point nearest to phi in the metric of P⁻¹ (|x − φ|² = wᵀ·P[A, A]·w)."""
    best = None
    for bounds in itertools.product((None, 0.0, max_phi), repeat=len(phi)):
        active = [i for i, b in enumerate(bounds) if b is not None]
        if not active:
            x, distance = list(phi), 0.0
        else:
            w = _solve([[p[i][j] for j in active] for i in active], [phi[i] - bounds[i] for i in active])
            if w is None:
                continue
            x = [phi[k] - sum(p[k][i] * wi for i, wi in zip(active, w)) for k in range(len(phi))]
            for i in active:
                x[i] = bounds[i]
            distance = sum(w[a] * p[active[a]][active[b]] * w[b] for a in range(len(w)) for b in range(len(w)))
        if all(-1e-9 <= v <= max_phi + 1e-9 for v in x) and (best is None or distance < best[0] - 1e-12):
            best = (distance, x)
    return best[1]


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_the_box_projection_is_the_nearest_point_in_the_covariance_metric(seed):
    rng = random.Random(seed)
    p = make_covariance(lambda: [rng.gauss(0.0, 1.0) for _ in range(5)])
    phi = [rng.uniform(-3.0, 5.0) for _ in range(5)]
    projected = _project_onto_box(phi, p, 3.0)
    assert all(0.0 <= v <= 3.0 for v in projected)
    assert projected == pytest.approx(nearest_in_box_by_brute_force(phi, p, 3.0), abs=1e-6)


# --------------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    "field,value",
    [
        ("forgetting_factor", 0.9), ("forgetting_factor", 1.01), ("forgetting_factor", math.nan),
        ("outlier_sigmas", 0.5), ("outlier_sigmas", math.inf),
        ("prior_variance", 0.0), ("prior_variance", -1.0),
        ("max_coefficient_scale", 1.0),
        ("initial_residual_scale", 0.001), ("initial_residual_scale", 2.5),
        ("min_residual_scale", 0.0),
        ("error_ema_alpha", 0.0), ("error_ema_alpha", 1.5),
        ("learning", 1),
    ],
    ids=lambda v: str(v),
)
def test_bad_params_name_the_field(field, value):
    params = PredictorParams(**{field: value})
    with pytest.raises(ValueError, match=field):
        params.validate()
    with pytest.raises(ValueError, match=field):
        PrefillPredictor(params=params)


@pytest.mark.parametrize("field", PrefillCoefficients.__struct_fields__)
@pytest.mark.parametrize("value", [-1.0, math.nan, math.inf], ids=["negative", "nan", "inf"])
def test_bad_coefficients_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        PrefillPredictor(PrefillCoefficients(**{field: value}))


def test_params_and_coefficients_decode_from_config_and_forbid_unknown_fields():
    params = msgspec.convert({"forgetting_factor": 0.99, "learning": False}, PredictorParams).validate()
    assert params.forgetting_factor == 0.99 and params.learning is False
    coefficients = msgspec.convert({"base_ms": 10.0, "per_request_ms": 1.5}, PrefillCoefficients).validate()
    assert PrefillPredictor(coefficients).predict_ms([(0, 0), (0, 0)]) == pytest.approx(13.0)
    with pytest.raises(msgspec.ValidationError, match="forgeting_factor"):
        msgspec.convert({"forgeting_factor": 0.99}, PredictorParams)


def test_defaults_are_valid():
    assert PredictorParams().validate() == PredictorParams()
    assert PrefillCoefficients().validate() == PRIOR
