"""Per-request latency targets (SLOs): TTFT and TPOT from input-length buckets × priority.

Defaults are FlexLB's: TTFT base by input length (≤256: 150 ms, ≤1,024: 300, ≤4,096: 600,
≤16,384: 1,200, else 2,400) times a priority multiplier (priority 30: 2.0, 40: 1.5,
50: 1.0, 60: 0.75, 70: 0.5; linear in between, clamped outside; priorities 1–100, default
50). TPOT base is 100 ms for every length (the original sets none; 100 ms is about three
decode steps of the default simulated engine), times the same multiplier. A request may
override either target (body fields `slo_ttft_ms` / `slo_tpot_ms`, or the headers
`X-Flexlb-Slo-Ttft-Ms` / `X-Flexlb-Slo-Tpot-Ms`) and set its priority.

Admission mode (what to do with a request whose best predicted TTFT exceeds its target):
- `reject-explicit` (default): refuse it with `slo_unattainable` when the request set its TTFT
  target itself (body `slo_ttft_ms` or the header); a target from the buckets is admitted
  best-effort (marked so). A client that states a deadline gets a fast, retryable "no"
  instead of an answer that is late anyway, and the fleet's time goes to requests that can
  still make it. Chosen on goodput (README "Defaults, and the numbers that chose them";
  bench/CORE.md, "Design notes").
- `best-effort`: admit it and mark it best-effort (what FlexLB did before).
- `reject`: refuse it, whatever set the target. The bucket targets are below the idle
  prefill time of long prompts on the default engine profile (a 16k-token prompt needs about
  2 s on Llama2-70B/H100), so `reject` refuses those even on an idle cluster.
- `shed`: as `reject-explicit`, and a bucket target too when the miss comes from load (its
  prefill alone would fit the bucket's target: a target that the prompt's own prefill
  exceeds says the bucket is wrong for it, not that the fleet is busy). With `tpot_guard`
  > 0 it also refuses any request while the worker that would decode it has a recent step
  time (`recent_step_ms` of its status: the engine's own step time, i.e. the time per output
  token its running requests get now) above `tpot_guard` × the request's TPOT target. The
  guard is off by default (0; why: bench/CORE.md, "Design notes").
Rejections count as misses for the client; under overload they keep the admitted requests
inside their targets instead of letting every request miss.
"""

from __future__ import annotations

import msgspec

SLO_MODES = ("reject-explicit", "best-effort", "reject", "shed")


class SloParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    ttft_buckets: tuple[tuple[int, float], ...] = ((256, 150.0), (1024, 300.0), (4096, 600.0), (16384, 1200.0))
    ttft_beyond_ms: float = 2400.0  # inputs longer than the last bucket
    tpot_ms: float = 100.0
    priority_points: tuple[tuple[int, float], ...] = ((30, 2.0), (40, 1.5), (50, 1.0), (60, 0.75), (70, 0.5))
    default_priority: int = 50
    mode: str = "reject-explicit"  # "reject-explicit" | "best-effort" | "reject" | "shed"
    # shed: refuse new work while the decoding worker's recent step time (the TPOT its running
    # requests get) is above this fraction of the request's TPOT target; 0 = off
    tpot_guard: float = 0.0

    def validate(self) -> "SloParams":
        if self.mode not in SLO_MODES:
            raise ValueError(f"slo mode must be one of {', '.join(SLO_MODES)}, got {self.mode!r}")
        if not 0 <= self.tpot_guard:
            raise ValueError(f"slo tpot_guard must be >= 0 (0: off), got {self.tpot_guard}")
        bounds = [b for b, _ in self.ttft_buckets]
        if bounds != sorted(bounds) or any(ms <= 0 for _, ms in self.ttft_buckets) or self.ttft_beyond_ms <= 0:
            raise ValueError("slo ttft_buckets must be ascending with positive targets")
        prios = [p for p, _ in self.priority_points]
        if not prios or prios != sorted(prios) or any(m <= 0 for _, m in self.priority_points):
            raise ValueError("slo priority_points must be ascending with positive multipliers")
        if not 1 <= self.default_priority <= 100 or self.tpot_ms <= 0:
            raise ValueError("slo default_priority must be in 1..100 and tpot_ms > 0")
        return self


def priority_multiplier(params: SloParams, priority: int) -> float:
    pts = params.priority_points
    if priority <= pts[0][0]:
        return pts[0][1]
    for (p0, m0), (p1, m1) in zip(pts, pts[1:]):
        if priority <= p1:
            return m0 + (m1 - m0) * (priority - p0) / (p1 - p0)
    return pts[-1][1]


def slo_targets(
    params: SloParams, num_prompt_tokens: int, priority: int | None = None,
    ttft_override_ms: float | None = None, tpot_override_ms: float | None = None,
) -> tuple[float, float]:
    """(TTFT ms, TPOT ms) for a request; overrides win over buckets."""
    mult = priority_multiplier(params, params.default_priority if priority is None else priority)
    base = next((ms for bound, ms in params.ttft_buckets if num_prompt_tokens <= bound), params.ttft_beyond_ms)
    ttft = ttft_override_ms if ttft_override_ms is not None else base * mult
    tpot = tpot_override_ms if tpot_override_ms is not None else params.tpot_ms * mult
    return ttft, tpot
