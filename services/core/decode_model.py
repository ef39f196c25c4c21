"""Decode-time model: how long one decode step (the time between two tokens of a running
request, its TPOT) takes on a worker, as a function of its load, learned online.

Model, per worker:

    step_ms = a + b·R + c·K/1000

R the requests the engine runs, K the KV tokens they hold (their context). a is the step's
fixed cost (the weights read once), b the per-sequence cost, c the attention cost per
thousand context tokens. What the engine also does between two tokens of a request (prompt
chunks mixed into its steps, or prefill steps that pause every decode, as SGLang's default
scheduler runs them) is part of the measured time, so the fit absorbs the prefill load that
comes with a given decode load on that worker: that is what a request placed there will see.

The prior's shape is the decode fit of the default engine profile (Llama2-70B on H100 TP8,
Splitwise: 29.57 + 0.198·bs + 2.20e-4·ctx ms, ../shared/data/README.md; `decode_coefficients`
of the scheduler config). What is learned is one scale on it: each status report of a worker
that runs something (`num_running_requests` >= 1, `recent_step_ms` > 0: the worker's mean
step time, or the OpenAI agent's mean gap between tokens, over its last 3 s) moves the log of
the scale toward log(measured / prior) by (1 − `forgetting_factor`), the residual clipped at
`outlier_sigmas` robust standard deviations, the scale kept in [1/`max_scale`, `max_scale`].
One scale (rather than a fitted a, b, c: bench/CORE.md, "Design notes") cannot be
mis-attributed: an engine that is uniformly slower or faster than the prior (another model
or GPU) is followed, and the prefill load mixed into the decodes raises it as much as it
raises every request's TPOT.
Deterministic: the same reports, the same model (the journal replays them).

TPOT calibration (the hold's headroom, learned). The step time now is not the TPOT a request
placed now gets: its TPOT is the mean of every step of its life (tens of seconds), while the
step time now swings with the prompts mixed into the last few steps, and regresses to the
worker's mean over that life (measured: requests dispatched at a predicted step 10-20 % above
the worker's mean got 0.6-0.85 of it). So each worker also learns, from its finished
requests, the TPOT they actually got (y) against the step time predicted for them when their
batch was dispatched (x): a least-squares line y = intercept + slope·x over exponentially
weighted finished requests (weight `tpot_calibration_alpha` for the newest), the slope kept in
[0, `max_tpot_slope`]; through the origin (slope = mean y / mean x) while the predictions seen
vary by less than 5 % (no line to fit), and the identity (the prediction as it is) until the
first finished request. `predict_tpot_ms` is the step time through that line. Beside it, the
TPOT the worker's requests recently got (`recent_tpot_ms`: an EMA over finished requests with
weight `recent_tpot_alpha` for the newest; 0 until the first), the hold's sign of a saturated
worker (services/core/scheduler.py `_may_give_way`). A journal
recorded before this learning (no measured TPOT on its terminal records) replays with the
identity, as it ran.

What the router does with it (services/core/scheduler.py): predicts the TPOT a worker gives
now and with one more request (`WorkerLoad.tpot_ms`, `tpot_ms_per_request`, calibrated by
the calibration), which the slo-budget batcher's TPOT hold, the routing of held requests and
cost-based's `tpot_filter` read; `/admin/workers` and `flexlb explain` show the coefficients
and the calibration, the metric `flexlb_decode_model_error_percent` its error.
"""

from __future__ import annotations

import math

import msgspec

_K_SCALE = 1000.0  # K is taken in thousands of tokens
_GAUSSIAN_STD_PER_MEAN_ABS = 1.2533
_MAX_SCALE = 100.0


class DecodeCoefficients(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """step_ms = base_ms + per_request_ms·R + per_kilotoken_ms·K/1000 (module docstring)."""

    base_ms: float = 29.57
    per_request_ms: float = 0.198
    per_kilotoken_ms: float = 0.220

    def validate(self) -> "DecodeCoefficients":
        for name in self.__struct_fields__:
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"decode coefficients: {name} must be finite and >= 0, got {value!r}")
        if self.base_ms <= 0:
            raise ValueError("decode coefficients: base_ms must be > 0")
        return self


class DecodeModelParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    learning: bool = True
    forgetting_factor: float = 0.98  # per status report with load (5 a second): a time constant of ~10 s
    outlier_sigmas: float = 3.0  # a report further than this many robust std devs from the model is clipped
    max_scale: float = 10.0  # the learned scale stays in [1 / this, this]
    error_ema_alpha: float = 0.05
    tpot_calibration_alpha: float = 0.03  # weight of the newest finished request in the TPOT calibration (0: off)
    max_tpot_slope: float = 1.5  # the calibration line's slope stays in [0, this]
    recent_tpot_alpha: float = 0.2  # weight of the newest finished request in recent_tpot_ms
    # whose finished requests a worker's TPOT calibration learns from: "worker" (its own) or
    # "pool" (every worker of its model and role: the scheduler feeds each finished request to
    # all of them; `recent_tpot_ms` stays the worker's own)
    tpot_calibration_scope: str = "worker"

    def validate(self) -> "DecodeModelParams":
        if not 0.9 < self.forgetting_factor <= 1.0:
            raise ValueError(f"decode model: forgetting_factor must be in (0.9, 1], got {self.forgetting_factor!r}")
        if not 1.0 <= self.outlier_sigmas < math.inf:
            raise ValueError(f"decode model: outlier_sigmas must be finite and >= 1, got {self.outlier_sigmas!r}")
        if not 1.0 < self.max_scale < math.inf:
            raise ValueError(f"decode model: max_scale must be finite and > 1, got {self.max_scale!r}")
        if not 0 < self.error_ema_alpha <= 1:
            raise ValueError(f"decode model: error_ema_alpha must be in (0, 1], got {self.error_ema_alpha!r}")
        if not 0 <= self.tpot_calibration_alpha <= 1:
            raise ValueError(f"decode model: tpot_calibration_alpha must be in [0, 1] (0: off), got {self.tpot_calibration_alpha!r}")
        if not 0 < self.max_tpot_slope < math.inf:
            raise ValueError(f"decode model: max_tpot_slope must be finite and > 0, got {self.max_tpot_slope!r}")
        if self.tpot_calibration_scope not in ("worker", "pool"):
            raise ValueError(f"decode model: tpot_calibration_scope must be worker or pool, got {self.tpot_calibration_scope!r}")
        if not 0 < self.recent_tpot_alpha <= 1:
            raise ValueError(f"decode model: recent_tpot_alpha must be in (0, 1], got {self.recent_tpot_alpha!r}")
        return self


class DecodeModel:
    """One worker's decode-step model (module docstring)."""

    __slots__ = ("prior", "params", "_log_scale", "_sigma", "a", "b", "c", "num_observations", "mean_abs_pct_error",
                 "_tpot_sums", "tpot_intercept_ms", "tpot_slope", "num_tpot_observations", "recent_tpot_ms")

    def __init__(self, prior: DecodeCoefficients = DecodeCoefficients(),
                 params: DecodeModelParams = DecodeModelParams()) -> None:
        self.prior = prior.validate()
        self.params = params.validate()
        self._log_scale = 0.0
        self._sigma = 0.1  # robust std of the log residual
        self.a, self.b, self.c = prior.base_ms, prior.per_request_ms, prior.per_kilotoken_ms
        self.num_observations = 0
        self.mean_abs_pct_error = 0.0
        # TPOT calibration (module docstring): weighted means of x, y, x², xy; the line
        self._tpot_sums = (0.0, 0.0, 0.0, 0.0)
        self.tpot_intercept_ms = 0.0
        self.tpot_slope = 1.0
        self.num_tpot_observations = 0
        self.recent_tpot_ms = 0.0  # EMA of the TPOT its finished requests got (0: none yet)

    @property
    def scale(self) -> float:
        """Measured / prior step time, as learned (1: the prior holds)."""
        return math.exp(self._log_scale)

    def predict_ms(self, num_running: float, kv_tokens: float) -> float:
        """The step time at this load (>= the base cost)."""
        return self.a + self.b * num_running + self.c * kv_tokens / _K_SCALE

    def predict_tpot_ms(self, num_running: float, kv_tokens: float) -> float:
        """The TPOT a request placed at this load gets: the step time through the calibration."""
        return self.calibrated_ms(self.a + self.b * num_running + self.c * kv_tokens / _K_SCALE)

    def calibrated_ms(self, step_ms: float) -> float:
        """A predicted step time as the TPOT the worker's requests get at it (>= 1 ms)."""
        out = self.tpot_intercept_ms + self.tpot_slope * step_ms
        return out if out > 1.0 else 1.0

    def observe_tpot(self, predicted_step_ms: float, measured_tpot_ms: float, own: bool = True) -> bool:
        """Learn from one finished request: the step time predicted when it was dispatched
        (uncalibrated) and the TPOT it got: `recent_tpot_ms` (only if `own`: it ran here, not
        on another worker of the pool) and the calibration. False: the calibration learned
        nothing (an unusable sample, or `tpot_calibration_alpha` 0)."""
        alpha = self.params.tpot_calibration_alpha
        x, y = predicted_step_ms, measured_tpot_ms
        if not (math.isfinite(x) and x > 0 and math.isfinite(y) and y > 0):
            return False
        recent = self.params.recent_tpot_alpha
        if own:
            self.recent_tpot_ms = y if self.recent_tpot_ms == 0 else (1 - recent) * self.recent_tpot_ms + recent * y
        if alpha <= 0:
            return False
        if self.num_tpot_observations == 0:
            sx, sy, sxx, sxy = x, y, x * x, x * y
        else:
            sx, sy, sxx, sxy = self._tpot_sums
            keep = 1.0 - alpha
            sx, sy, sxx, sxy = keep * sx + alpha * x, keep * sy + alpha * y, keep * sxx + alpha * x * x, keep * sxy + alpha * x * y
        self._tpot_sums = (sx, sy, sxx, sxy)
        self.num_tpot_observations += 1
        var = sxx - sx * sx
        if var > (0.05 * sx) ** 2:  # the predictions vary: fit the line
            slope = max(0.0, min(self.params.max_tpot_slope, (sxy - sx * sy) / var))
            self.tpot_slope, self.tpot_intercept_ms = slope, sy - slope * sx
        else:  # no spread to fit a line on: through the origin
            self.tpot_slope, self.tpot_intercept_ms = min(self.params.max_tpot_slope, sy / sx), 0.0
        return True

    def observe(self, num_running: int, kv_tokens: int, step_ms: float) -> bool:
        """Learn from one report; False (nothing learned) for a sample without load or time."""
        if num_running < 1 or not (math.isfinite(step_ms) and step_ms > 0) or kv_tokens < 0:
            return False
        predicted = self.predict_ms(num_running, kv_tokens)
        rel = (step_ms - predicted) / step_ms
        alpha = self.params.error_ema_alpha
        self.mean_abs_pct_error = (100 * abs(rel) if self.num_observations == 0
                                   else (1 - alpha) * self.mean_abs_pct_error + alpha * 100 * abs(rel))
        self.num_observations += 1
        if not self.params.learning:
            return True
        p = self.prior
        prior_ms = p.base_ms + p.per_request_ms * num_running + p.per_kilotoken_ms * kv_tokens / _K_SCALE
        residual = math.log(step_ms / prior_ms) - self._log_scale
        clip = self.params.outlier_sigmas * self._sigma
        residual = max(-clip, min(clip, residual))
        self._sigma = min(2.0, max(0.01, (1 - alpha) * self._sigma + alpha * _GAUSSIAN_STD_PER_MEAN_ABS * abs(residual)))
        bound = math.log(self.params.max_scale)
        self._log_scale = max(-bound, min(bound, self._log_scale + (1 - self.params.forgetting_factor) * residual))
        scale = math.exp(self._log_scale)
        self.a, self.b, self.c = p.base_ms * scale, p.per_request_ms * scale, p.per_kilotoken_ms * scale
        return True

    @property
    def coefficients(self) -> DecodeCoefficients:
        return DecodeCoefficients(base_ms=self.a, per_request_ms=self.b, per_kilotoken_ms=self.c)
