"""Prefill-time predictor: a linear batch-time model, refined online by robust, bounded RLS.

Model. For a batch of requests, each with n prompt tokens of which p are already cached:

    T_ms = a + b·Σ(n − p) + c·Σ(n² − p²) + d·Σp + e·batch_size

- a `base_ms`: fixed cost of one engine step;
- b `per_token_ms`: per computed (uncached) prompt token;
- c `per_token_sq_ms`: per (n² − p²), the attention cost of the computed part;
- d `per_cached_token_ms`: per cached token (reading its KV);
- e `per_request_ms`: per request in the batch.

The prior (`PrefillCoefficients()`) is the Splitwise fit for Llama2-70B on H100 TP8
(../shared/data/README.md): a = 26.45, b = 0.06414, c = 3.635e-6, d = e = 0. The engine
profile or the router configuration may give other values. `predict_ms` is the router's hot
path: one pass over the requests, then five multiply-adds; constant memory (timed in
bench/CORE.md).

Learning. `observe(requests, measured_ms)` takes the measured time of a completed batch and
refines the coefficients by recursive least squares (RLS) with exponential forgetting, on
the logarithm of the batch time (a recursive Gauss-Newton, or extended Kalman, step for
ln T = ln ŷ(θ) + noise):

1. Coefficient i is written θ_i = φ_i · ref_i, where ref_i is a fixed reference scale: the
   prior value when it is > 0; otherwise, for a/b/c, the Splitwise default, for d 0.1 × ref_b
   (a cached token taken as a tenth of a computed one) and for e 0.1 × ref_a. The RLS state
   is φ (the prior is φ_i = 1 where the prior is > 0, else 0), so every parameter is O(1)
   whatever the scale of its feature (1 for a, ~1e8 for c's Σ(n² − p²)).
2. With x the raw features (all ≥ 0), ŷ = Σ θ_i·x_i the current prediction and
   r = max(ŷ, 0.01 · Σ ref_i·x_i) (> 0, since ref_a > 0), the regressors are
   u_i = x_i · ref_i / r = ∂ ln ŷ / ∂φ_i, each in [0, 100], and the residual is
   ε = ln(measured) − ln(r). Errors are thus relative and symmetric (2× too slow and 2× too
   fast weigh the same; batch times span 30 ms to seconds and engine noise is
   multiplicative), the regressors are bounded, which keeps P well-conditioned, and a slow
   outlier weighs ln 5 = 1.6, not 4.
3. Robustness (Huber-like): ε is clipped to ±`outlier_sigmas` · σ, where σ is a running
   robust scale of the residuals (an EMA of 1.2533 · |clipped ε|, which is the standard
   deviation for Gaussian noise; start `initial_residual_scale`, floor `min_residual_scale`,
   ceiling 2.0, so that an endless run of absurd values cannot inflate it without bound).
   A clipped sample still moves the estimate, by a bounded step: an outlier is never fully
   trusted, and a real change of the engine shows up as a run of clipped residuals, each of
   which grows σ by the factor 1 + α·(1.2533·k − 1) = 1.2 (defaults), so the clip opens up
   within about a dozen batches even from the floor.
4. RLS step with forgetting factor λ: K = P·u / (λ + uᵀ·P·u); φ' = φ + K·ε_clipped;
   P = (P − K·(P·u)ᵀ) / λ, symmetrised. Anti-windup: forgetting inflates P in directions
   the data do not excite, so each P_ii is capped at its initial value by the congruence
   D·P·D (D diagonal, ≤ 1 only on the capped coordinates). (A uniform cap of the trace
   was rejected: bench/CORE.md, "Design notes".) A P that
   becomes non-finite or has a non-positive diagonal is reset to P0
   (`num_covariance_resets`; never seen).
5. φ' is projected onto the box [0, `max_coefficient_scale`] in the metric of P⁻¹ (the
   estimate projection of constrained Kalman filtering; see `_project_onto_box`): every
   coefficient stays in [0, max_coefficient_scale × ref_i] (`max_coefficients`), so
   predictions stay finite and ≥ 0 whatever is observed. (Why not clamp each
   coordinate alone: bench/CORE.md, "Design notes".)

The prior covariance is P0 = `prior_variance` · I. RLS measures P in units of one sample's
residual variance, so the default 100 gives each φ a prior standard deviation of about
10 residual standard deviations: 0.5 at 5 % engine noise, i.e. the prior may well be 2× off.
The prior is the starting point and what the predictor answers before any data; the data
override it within tens of batches in the directions they excite. Directions they barely
excite keep it longer: the base cost a is ~1-2 % of a typical batch of thousands of tokens,
and d stays at its prior while nothing is ever cached. (Why not a smaller prior
variance: bench/CORE.md, "Design notes".)

Tracking: once P has converged, a step change of the engine is followed with a time
constant of about 1/(1 − λ) batches (measured: bench/CORE.md, "Design notes").

Error metrics (the shell exports them): `observe` measures the error of the prediction made
*before* it learns from the sample, so they are honest out-of-sample errors. Accepted
measurements count in `num_observations`; `mean_abs_error_ms` and `mean_abs_pct_error`
(percent of the measured time, 10.0 = 10 %) are EMAs with weight `error_ema_alpha`, seeded by
the first sample. A measurement that is NaN, infinite, or below `MIN_MEASURED_MS` (1 µs:
zero, negative, or absurdly small) is counted in `num_rejected_observations` and neither
scored nor learned: no prefill takes no time, such a value is a broken clock or a lost
message (and its percentage error would overflow). Residuals clipped as outliers are
counted in `num_clipped_observations`. With `learning=False` the predictor scores but
never learns.

Inputs: `requests` is a sequence of (num_prompt_tokens, num_cached_tokens) with
0 ≤ cached ≤ prompt; anything else is a caller bug and raises ValueError. An empty batch
predicts 0.0; observing an empty batch raises ValueError. To learn the right thing, pass the
cached tokens the engine actually reported when they are known, not the router's guess.

Parameters (`PredictorParams`, defaults in brackets):
- learning [True]: refine the coefficients from observations.
- forgetting_factor [0.995]: RLS λ in (0.9, 1]; the effective memory is about 1/(1 − λ)
  = 200 batches. 1.0 never forgets (the engine is assumed stationary).
- outlier_sigmas [4.0]: residuals beyond this many robust standard deviations are clipped
  (≥ 1).
- prior_variance [100.0]: diagonal of P0 (> 0): larger trusts the prior less.
- max_coefficient_scale [100.0]: upper bound of each coefficient, in multiples of its
  reference scale (> 1); the lower bound is 0.
- initial_residual_scale [0.25]: robust σ of the log residuals assumed before any data (in
  [min_residual_scale, 2]): the prior may be e^(4 × 0.25) ≈ 2.7× off either way before its
  first residuals are clipped.
- min_residual_scale [0.01]: floor of σ (in (0, 2]), so that a noiseless engine that later
  changes is still followed.
- error_ema_alpha [0.05]: EMA weight of the error metrics and of the robust scale σ, in (0, 1].

There is no separate warm-up phase: the prior covariance and the initial residual scale
already make the first batches count fully without letting a single one dominate.

Pure: no I/O, no clock, no randomness. Not thread-safe (one predictor per prefill worker,
driven by one task).
"""

from __future__ import annotations

import math
from itertools import chain
from typing import Any, Sequence

import msgspec

MIN_MEASURED_MS = 1e-3  # a batch measured faster than 1 µs is a broken clock: rejected
_NUM_FEATURES = 5
_UPPER_PAIRS = tuple((i, j) for i in range(_NUM_FEATURES) for j in range(i + 1, _NUM_FEATURES))  # (i < j)
_GAUSSIAN_STD_PER_MEAN_ABS = 1.2533  # sqrt(pi/2): std / mean |x| of a zero-mean Gaussian
_MIN_SCALE_FRACTION_OF_REF = 0.01  # r >= 1 % of the reference prediction (bounds u by 100)
_FALLBACK_CACHED_FRACTION = 0.1  # ref_d = 0.1 × ref_b when the prior d is 0
_FALLBACK_REQUEST_FRACTION = 0.1  # ref_e = 0.1 × ref_a when the prior e is 0
_MAX_RESIDUAL_SCALE = 2.0  # ceiling of the robust std of log residuals (a factor e² ≈ 7.4)


class PrefillCoefficients(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Coefficients of T_ms = a + b·Σ(n−p) + c·Σ(n²−p²) + d·Σp + e·batch_size (n prompt
    tokens, p cached tokens of each request). Defaults: the Splitwise llama2-70b H100 TP8 fit."""

    base_ms: float = 26.45  # a: per batch
    per_token_ms: float = 0.06414  # b: per computed (uncached) prompt token
    per_token_sq_ms: float = 3.635e-6  # c: per (n² − p²) token² of each request
    per_cached_token_ms: float = 0.0  # d: per cached prompt token
    per_request_ms: float = 0.0  # e: per request in the batch

    def validate(self) -> "PrefillCoefficients":
        for name in self.__struct_fields__:
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"prefill coefficients: {name} must be finite and >= 0, got {value!r}")
        return self

    def as_tuple(self) -> tuple[float, float, float, float, float]:
        return (self.base_ms, self.per_token_ms, self.per_token_sq_ms, self.per_cached_token_ms, self.per_request_ms)


_DEFAULT_COEFFICIENTS = PrefillCoefficients()


class PredictorParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Learning parameters; see the module docstring for their meaning and defaults."""

    learning: bool = True
    forgetting_factor: float = 0.995  # RLS λ in (0.9, 1]
    outlier_sigmas: float = 4.0  # clip residuals beyond this many robust std devs (>= 1)
    prior_variance: float = 100.0  # diagonal of P0 (φ² per residual variance), > 0
    max_coefficient_scale: float = 100.0  # coefficient_i <= this × reference_i (> 1)
    initial_residual_scale: float = 0.25  # robust std of log residuals before any data
    min_residual_scale: float = 0.01  # floor of that std, in (0, 2]
    error_ema_alpha: float = 0.05  # EMA weight of error metrics and residual scale, (0, 1]

    def validate(self) -> "PredictorParams":
        def bad(name: str, rule: str) -> ValueError:
            return ValueError(f"predictor: {name} must be {rule}, got {getattr(self, name)!r}")

        if not isinstance(self.learning, bool):
            raise bad("learning", "a bool")
        checks = (
            ("forgetting_factor", "in (0.9, 1]", lambda v: 0.9 < v <= 1.0),
            ("outlier_sigmas", "finite and >= 1", lambda v: 1.0 <= v < math.inf),
            ("prior_variance", "finite and > 0", lambda v: 0.0 < v < math.inf),
            ("max_coefficient_scale", "finite and > 1", lambda v: 1.0 < v < math.inf),
            ("min_residual_scale", "in (0, 2]", lambda v: 0.0 < v <= _MAX_RESIDUAL_SCALE),
            ("initial_residual_scale", "in [min_residual_scale, 2]",
             lambda v: self.min_residual_scale <= v <= _MAX_RESIDUAL_SCALE),
            ("error_ema_alpha", "in (0, 1]", lambda v: 0.0 < v <= 1.0),
        )
        for name, rule, ok in checks:
            value = getattr(self, name)
            # NaN fails every comparison, so it fails every rule.
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
                raise bad(name, rule)
        return self


class PredictorStats(msgspec.Struct, frozen=True, kw_only=True):
    """Error metrics of one predictor (out-of-sample: scored before learning)."""

    num_observations: int  # accepted measurements
    num_rejected_observations: int  # NaN / infinite / <= 0 measurements, ignored
    num_clipped_observations: int  # accepted, but the residual was clipped as an outlier
    num_covariance_resets: int  # numerical guard fired (should stay 0)
    mean_abs_error_ms: float  # EMA of |measured − predicted| ms
    mean_abs_pct_error: float  # EMA of 100 × |measured − predicted| / measured, percent
    residual_scale: float  # robust std of log residuals (≈ relative: 0.05 ≈ 5 %)


def _batch_features(requests: Sequence[tuple[int, int]]) -> tuple[int, int, int]:
    """(Σ(n − p), Σ(n² − p²), Σp) of a batch; ValueError unless 0 <= p <= n for each."""
    num_computed_tokens = 0
    num_computed_sq_tokens = 0
    num_cached_tokens = 0
    for num_prompt, num_cached in requests:
        if num_cached < 0 or num_cached > num_prompt:
            raise ValueError(
                f"prefill predictor: need 0 <= cached <= prompt tokens, got ({num_prompt}, {num_cached})"
            )
        num_computed_tokens += num_prompt - num_cached
        num_computed_sq_tokens += num_prompt * num_prompt - num_cached * num_cached
        num_cached_tokens += num_cached
    return num_computed_tokens, num_computed_sq_tokens, num_cached_tokens


def _reference_scales(prior: PrefillCoefficients) -> tuple[float, ...]:
    default = _DEFAULT_COEFFICIENTS
    ref_a = prior.base_ms if prior.base_ms > 0 else default.base_ms
    ref_b = prior.per_token_ms if prior.per_token_ms > 0 else default.per_token_ms
    ref_c = prior.per_token_sq_ms if prior.per_token_sq_ms > 0 else default.per_token_sq_ms
    ref_d = prior.per_cached_token_ms if prior.per_cached_token_ms > 0 else _FALLBACK_CACHED_FRACTION * ref_b
    ref_e = prior.per_request_ms if prior.per_request_ms > 0 else _FALLBACK_REQUEST_FRACTION * ref_a
    return (ref_a, ref_b, ref_c, ref_d, ref_e)


class PrefillPredictor:
    """Predicts a prefill batch's duration and learns from measured ones (module docstring)."""

    def __init__(
        self,
        coefficients: PrefillCoefficients = _DEFAULT_COEFFICIENTS,
        params: PredictorParams = PredictorParams(),
    ) -> None:
        self.prior = coefficients.validate()
        self.params = params.validate()
        self._ref = _reference_scales(coefficients)
        prior_values = coefficients.as_tuple()
        # φ_i = θ_i / ref_i; exactly 1.0 or 0.0 for the prior.
        self._phi = [v / r for v, r in zip(prior_values, self._ref)]
        self._max_phi = params.max_coefficient_scale
        self._initial_p = params.prior_variance
        self._p = self._initial_covariance()
        self._residual_scale = params.initial_residual_scale
        # Absolute coefficients for the hot path, refreshed after every learning step.
        self._a, self._b, self._c, self._d, self._e = prior_values
        self.hot_coefficients = prior_values  # (a, b, c, d, e) now: for the scheduler's inlined one-request prediction
        self._coefficients: PrefillCoefficients | None = coefficients
        self.num_observations = 0
        self.num_rejected_observations = 0
        self.num_clipped_observations = 0
        self.num_covariance_resets = 0
        self.mean_abs_error_ms = 0.0
        self.mean_abs_pct_error = 0.0  # percent

    # ------------------------------------------------------------------ reading
    def predict_ms(self, requests: Sequence[tuple[int, int]]) -> float:
        """Predicted prefill ms of a batch of (num_prompt_tokens, num_cached_tokens); >= 0,
        finite; 0.0 for an empty batch."""
        if not requests:
            return 0.0
        computed, computed_sq, cached = _batch_features(requests)
        t = self._a + self._b * computed + self._c * computed_sq + self._d * cached + self._e * len(requests)
        return t if t > 0.0 else 0.0

    def predict_items_ms(self, items: Sequence[Any]) -> float:
        """`predict_ms` of queued requests (objects with num_prompt_tokens and
        num_cached_tokens), without building the (n, p) pairs: the batcher's hot path."""
        if not items:
            return 0.0
        computed = computed_sq = cached = 0
        for item in items:
            n, p = item.num_prompt_tokens, item.num_cached_tokens
            if p < 0 or p > n:
                raise ValueError(f"prefill predictor: need 0 <= cached <= prompt tokens, got ({n}, {p})")
            computed += n - p
            computed_sq += n * n - p * p
            cached += p
        t = self._a + self._b * computed + self._c * computed_sq + self._d * cached + self._e * len(items)
        return t if t > 0.0 else 0.0

    @property
    def coefficients(self) -> PrefillCoefficients:
        """The current (learned) coefficients."""
        if self._coefficients is None:
            self._coefficients = PrefillCoefficients(
                base_ms=self._a, per_token_ms=self._b, per_token_sq_ms=self._c,
                per_cached_token_ms=self._d, per_request_ms=self._e,
            )
        return self._coefficients

    @property
    def max_coefficients(self) -> PrefillCoefficients:
        """Upper bounds of the coefficients (the lower bounds are 0)."""
        a, b, c, d, e = (self._max_phi * r for r in self._ref)
        return PrefillCoefficients(
            base_ms=a, per_token_ms=b, per_token_sq_ms=c, per_cached_token_ms=d, per_request_ms=e
        )

    @property
    def residual_scale(self) -> float:
        """Robust std of the log residuals (≈ a relative error: 0.05 ≈ 5 %)."""
        return self._residual_scale

    def stats(self) -> PredictorStats:
        return PredictorStats(
            num_observations=self.num_observations,
            num_rejected_observations=self.num_rejected_observations,
            num_clipped_observations=self.num_clipped_observations,
            num_covariance_resets=self.num_covariance_resets,
            mean_abs_error_ms=self.mean_abs_error_ms,
            mean_abs_pct_error=self.mean_abs_pct_error,
            residual_scale=self._residual_scale,
        )

    # ------------------------------------------------------------------ learning
    def observe(self, requests: Sequence[tuple[int, int]], measured_ms: float) -> None:
        """Score the prediction for a completed batch against its measured ms, then learn."""
        if not requests:
            raise ValueError("prefill predictor: cannot observe an empty batch")
        computed, computed_sq, cached = _batch_features(requests)
        if not isinstance(measured_ms, (int, float)) or not MIN_MEASURED_MS <= measured_ms < math.inf:  # NaN fails
            self.num_rejected_observations += 1
            return
        measured_ms = float(measured_ms)
        x = (1.0, float(computed), float(computed_sq), float(cached), float(len(requests)))
        predicted_ms = self._a + self._b * x[1] + self._c * x[2] + self._d * x[3] + self._e * x[4]
        abs_error_ms = abs(measured_ms - predicted_ms)
        self._score(abs_error_ms, 100.0 * (abs_error_ms / measured_ms))
        if self.params.learning:
            self._learn(x, predicted_ms, measured_ms)

    def _score(self, abs_error_ms: float, abs_pct_error: float) -> None:
        self.num_observations += 1
        if self.num_observations == 1:
            self.mean_abs_error_ms = abs_error_ms
            self.mean_abs_pct_error = abs_pct_error
            return
        alpha = self.params.error_ema_alpha
        self.mean_abs_error_ms += alpha * (abs_error_ms - self.mean_abs_error_ms)
        self.mean_abs_pct_error += alpha * (abs_pct_error - self.mean_abs_pct_error)

    def _learn(self, x: tuple[float, ...], predicted_ms: float, measured_ms: float) -> None:
        params = self.params
        ref = self._ref
        reference_ms = sum([xi * ri for xi, ri in zip(x, ref)])  # >= ref_a > 0
        scale_ms = max(predicted_ms, _MIN_SCALE_FRACTION_OF_REF * reference_ms)
        u = [xi * ri / scale_ms for xi, ri in zip(x, ref)]  # ∂ ln ŷ / ∂φ_i, each in [0, 100]
        residual = math.log(measured_ms) - math.log(scale_ms)  # finite: both > 0 and finite
        clip = params.outlier_sigmas * self._residual_scale
        if residual > clip or residual < -clip:
            self.num_clipped_observations += 1
            residual = clip if residual > 0 else -clip

        n = _NUM_FEATURES
        p = self._p
        lam = params.forgetting_factor
        # (The 5×5 algebra written out: the same operations in the same order as the loops
        # over range(n) it replaces, so the same floats, at a fraction of the cost; a batch
        # completion is a replay's second heaviest record.)
        u0, u1, u2, u3, u4 = u
        pu = [r[0] * u0 + r[1] * u1 + r[2] * u2 + r[3] * u3 + r[4] * u4 for r in p]
        pu0, pu1, pu2, pu3, pu4 = pu
        denominator = lam + (u0 * pu0 + u1 * pu1 + u2 * pu2 + u3 * pu3 + u4 * pu4)  # >= λ > 0.9
        gain = [v / denominator for v in pu]
        phi_unconstrained = [f + g * residual for f, g in zip(self._phi, gain)]
        new_p = [[(r[0] - g * pu0) / lam, (r[1] - g * pu1) / lam, (r[2] - g * pu2) / lam, (r[3] - g * pu3) / lam,
                  (r[4] - g * pu4) / lam] for r, g in zip(p, gain)]
        for i, j in _UPPER_PAIRS:
            new_p[i][j] = new_p[j][i] = 0.5 * (new_p[i][j] + new_p[j][i])
        if not all(map(math.isfinite, chain.from_iterable(new_p))) or any(new_p[i][i] <= 0.0 for i in range(n)):
            self.num_covariance_resets += 1
            new_p = self._initial_covariance()
        else:
            # Anti-windup: P_ii <= P0_ii, by the congruence D·P·D (keeps P positive definite
            # and leaves the coordinates within the cap, hence their forgetting, alone).
            initial_p, sqrt = self._initial_p, math.sqrt
            shrink = [min(1.0, sqrt(initial_p / new_p[i][i])) for i in range(n)]
            if min(shrink) < 1.0:
                new_p = [[v * si * sj for v, sj in zip(row, shrink)] for row, si in zip(new_p, shrink)]
        self._p = new_p
        self._phi = _project_onto_box(phi_unconstrained, new_p, self._max_phi)

        alpha = params.error_ema_alpha
        target_scale = _GAUSSIAN_STD_PER_MEAN_ABS * abs(residual)
        self._residual_scale = min(
            _MAX_RESIDUAL_SCALE,
            max(params.min_residual_scale, self._residual_scale + alpha * (target_scale - self._residual_scale)),
        )
        self._a, self._b, self._c, self._d, self._e = (f * r for f, r in zip(self._phi, ref))
        self.hot_coefficients = (self._a, self._b, self._c, self._d, self._e)
        self._coefficients = None

    def _initial_covariance(self) -> list[list[float]]:
        return [[self._initial_p if i == j else 0.0 for j in range(_NUM_FEATURES)] for i in range(_NUM_FEATURES)]


def _project_onto_box(phi: list[float], p: list[list[float]], max_phi: float) -> list[float]:
    """The point of the box [0, max_phi]^n nearest to `phi` in the metric of P⁻¹ (the
    estimate projection of constrained Kalman filtering), by the primal active-set method
    for a strictly convex QP.

    With the set A of coordinates pinned to a bound b_A, the nearest point is
    φ − P[:, A]·w with w = P[A, A]⁻¹·(φ_A − b_A): the free coordinates move along their
    covariance with the pinned ones, and w are the multipliers (a lower bound needs
    w_i <= 0, an upper one w_i >= 0: else moving off the bound is nearer). Start from the
    clamp of φ (feasible) with the clamped coordinates pinned; each round moves toward the
    nearest point for the current pins, stopping at the first free coordinate that would
    leave the box (it is pinned there), or, when that point is inside the box, releases the
    pin whose multiplier has the wrong sign; when none has, that is the optimum (KKT).
    Clamping each coordinate alone instead keeps the compensating moves of its correlated
    partners (b up when c goes down) without the move itself, and can drive the prediction
    the wrong way, batch after batch. Rounds are capped (n pins and releases each, with
    room); a final clamp guarantees the box whatever happens."""
    n = len(phi)
    x = [min(max(v, 0.0), max_phi) for v in phi]
    pinned: dict[int, float] = {i: x[i] for i in range(n) if x[i] != phi[i]}
    if not pinned:  # inside the box: the one round below moves x by 1.0 × (phi − x) = 0, then clamps
        return [min(max(v + 0.0, 0.0), max_phi) for v in x]
    for _ in range(8 * n + 8):
        active = sorted(pinned)
        if active:
            w = _solve([[p[i][j] for j in active] for i in active], [phi[i] - pinned[i] for i in active])
            if w is None:  # P[A, A] numerically singular: keep the feasible point we have
                break
            target = [phi[k] - sum([pk[i] * wi for i, wi in zip(active, w)]) for k, pk in enumerate(p)]
            for i in active:
                target[i] = pinned[i]
        else:
            w = []
            target = list(phi)
        # Step from x toward target, up to the first free coordinate that hits a bound.
        step, blocking = 1.0, None
        for k in range(n):
            if k in pinned:
                continue
            d = target[k] - x[k]
            if d < 0.0 and target[k] < 0.0:
                t = (0.0 - x[k]) / d
                bound = 0.0
            elif d > 0.0 and target[k] > max_phi:
                t = (max_phi - x[k]) / d
                bound = max_phi
            else:
                continue
            if t < step:
                step, blocking = t, (k, bound)
        x = [xk + step * (tk - xk) for xk, tk in zip(x, target)]
        if blocking is not None:
            x[blocking[0]] = blocking[1]
            pinned[blocking[0]] = blocking[1]
            continue
        wrong = [(abs(wi), i) for i, wi in zip(active, w) if (wi > 0.0 if pinned[i] == 0.0 else wi < 0.0)]
        if not wrong:
            break
        del pinned[max(wrong)[1]]
    return [min(max(v, 0.0), max_phi) for v in x]


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """x with a·x = b by Gaussian elimination with partial pivoting (a is at most 5×5);
    None when a pivot is not clearly nonzero."""
    n = len(b)
    if n == 1:  # (the usual case: one coordinate pinned; the same pivot test and division as below)
        return [b[0] / a[0][0]] if abs(a[0][0]) > 1e-12 * abs(a[0][0]) else None
    m = [row[:] + [rhs] for row, rhs in zip(a, b)]
    tiny = 1e-12 * max(abs(m[i][i]) for i in range(n))
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if not abs(m[pivot][col]) > tiny:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= f * m[col][c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x
