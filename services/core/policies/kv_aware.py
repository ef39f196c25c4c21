"""`kv-aware` (decode stage, disaggregated fleets): a decode worker weighted toward the one
with the least KV in use, among those that can hold the request.

The scheduler reserves on the picked worker the request's expected KV = prompt +
min(max_tokens, `expected_output_cap`) (read from these parameters), and passes per worker
its KV used (reported + expected reservations it does not show yet) and available (reported
free − hard reservations). It is a pipeline (services/core/pipeline/ `kv_aware`). Filters, in order:
- `kv-available`: available KV < the prompt's tokens;
- `gated`: the usage gate is closed (the scheduler keeps it: closes at KV usage >=
  `max_kv_usage`, reopens at <= max_kv_usage × (1 − `kv_usage_hysteresis`));
- `load`: pending > `load_factor` × the average pending;
- `kv-used`: KV used > `kv_used_factor` × the average KV used.
Nothing left: no pick (`no_worker`; no fallback). Pick: weighted random (`ctx.rng`, worker-id
order; picker weighted-random), weight (scorer least-kv-used) = exp(−`kv_weight_per_token` × (kv used − the least kv used)): with the
default, a worker with 500 tokens used is picked e ≈ 2.7 times as often as one with 1,500.

Parameters (`KvAwareParams`, defaults): expected_output_cap 1000, kv_weight_per_token 0.001,
max_kv_usage 0.9, kv_usage_hysteresis 0.15, load_factor 3, kv_used_factor 3.
"""

from __future__ import annotations

from services.core.policies.protocol import DEFAULT_EXPECTED_OUTPUT_CAP, PolicyParams


class KvAwareParams(PolicyParams):
    expected_output_cap: int = DEFAULT_EXPECTED_OUTPUT_CAP  # expected KV = prompt + min(max_tokens, this)
    kv_weight_per_token: float = 0.001  # weight = exp(−this × (kv_used − min kv_used))
    max_kv_usage: float = 0.9  # a worker above this usage is gated (hysteresis below)
    kv_usage_hysteresis: float = 0.15
    load_factor: float = 3.0  # load > factor × average: filtered
    kv_used_factor: float = 3.0  # kv used > factor × average: filtered

    def kv_gate(self) -> tuple[float, float]:
        return self.max_kv_usage, self.kv_usage_hysteresis

    def expected_output_cap_tokens(self) -> int:
        return self.expected_output_cap

    def validate(self) -> "KvAwareParams":
        if self.expected_output_cap < 0 or self.kv_weight_per_token < 0:
            raise ValueError("kv-aware: expected_output_cap and kv_weight_per_token must be >= 0")
        if not 0 < self.max_kv_usage <= 1 or not 0 <= self.kv_usage_hysteresis < 1:
            raise ValueError("kv-aware: max_kv_usage in (0, 1] and kv_usage_hysteresis in [0, 1) required")
        if self.load_factor <= 1 or self.kv_used_factor <= 1:
            raise ValueError("kv-aware: load_factor and kv_used_factor must be > 1")
        return self
