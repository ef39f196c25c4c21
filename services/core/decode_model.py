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

What the router does with it (services/core/scheduler.py): predicts the TPOT a worker gives
now and with one more request (`WorkerLoad.tpot_ms`, `tpot_ms_per_request`), which the
slo-budget batcher's TPOT hold and cost-based's `tpot_filter` read; `/admin/workers` and
`flexlb explain` show the coefficients, the metric `flexlb_decode_model_error_percent` its
error.
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

    def validate(self) -> "DecodeModelParams":
        if not 0.9 < self.forgetting_factor <= 1.0:
            raise ValueError(f"decode model: forgetting_factor must be in (0.9, 1], got {self.forgetting_factor!r}")
        if not 1.0 <= self.outlier_sigmas < math.inf:
            raise ValueError(f"decode model: outlier_sigmas must be finite and >= 1, got {self.outlier_sigmas!r}")
        if not 1.0 < self.max_scale < math.inf:
            raise ValueError(f"decode model: max_scale must be finite and > 1, got {self.max_scale!r}")
        if not 0 < self.error_ema_alpha <= 1:
            raise ValueError(f"decode model: error_ema_alpha must be in (0, 1], got {self.error_ema_alpha!r}")
        return self


class DecodeModel:
    """One worker's decode-step model (module docstring)."""

    __slots__ = ("prior", "params", "_log_scale", "_sigma", "a", "b", "c", "num_observations", "mean_abs_pct_error")

    def __init__(self, prior: DecodeCoefficients = DecodeCoefficients(),
                 params: DecodeModelParams = DecodeModelParams()) -> None:
        self.prior = prior.validate()
        self.params = params.validate()
        self._log_scale = 0.0
        self._sigma = 0.1  # robust std of the log residual
        self.a, self.b, self.c = prior.base_ms, prior.per_request_ms, prior.per_kilotoken_ms
        self.num_observations = 0
        self.mean_abs_pct_error = 0.0

    @property
    def scale(self) -> float:
        """Measured / prior step time, as learned (1: the prior holds)."""
        return math.exp(self._log_scale)

    def predict_ms(self, num_running: float, kv_tokens: float) -> float:
        """The step time at this load (>= the base cost)."""
        return self.a + self.b * num_running + self.c * kv_tokens / _K_SCALE

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
