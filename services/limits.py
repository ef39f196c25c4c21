"""Per-tenant limits at the router's door: open requests, requests per minute, tokens per minute.

Configured per tenant (settings.py `tenant_limits`; with API keys, a tenant is a key's), the
entry "*" for every tenant not listed; a tenant with no entry and no "*" has no limit:

    {"alpha": {"max_open": 16, "requests_per_minute": 600, "tokens_per_minute": 200000},
     "*": {"max_open": 4, "requests_per_minute": 60}}

- `max_open`: requests of the tenant this router process holds open at once (from the
  arrival of the request to the end of its response);
- `requests_per_minute`, `tokens_per_minute`: token buckets, each holding at most one
  minute's worth and refilled continuously (a tenant idle for a minute may send a minute's
  worth at once, then its rate). A request takes 1 request and its prompt tokens plus its
  `max_tokens` (what it may cost, as OpenAI counts against a TPM limit) when it arrives. A
  request larger than a whole minute's tokens is let through when the bucket is full (it
  leaves the bucket in debt, paid back by the refill): never refused forever.

A request over a limit is refused 429 `rate_limited` with `Retry-After` (when the bucket will
hold what it needs; 1 s for `max_open`), before anything else is done with it: nothing is
queued, routed or logged as a decision (the refusal is a request.rejected event).

Scope: one router process. A tenant that reaches N processes (`--http-workers N`, or N
routers behind a load balancer) gets up to N times these limits: divide them by N.
Time is passed in (`now_s`, a monotonic clock), so the rules are tested with a fake clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

LIMIT_FIELDS = ("max_open", "requests_per_minute", "tokens_per_minute")


@dataclass(frozen=True)
class TenantLimit:
    max_open: int = 0  # 0: no limit
    requests_per_minute: float = 0.0
    tokens_per_minute: float = 0.0


def parse_limits(raw: dict) -> dict[str, TenantLimit]:
    """settings.tenant_limits -> {tenant or "*": TenantLimit}; ValueError names what is wrong."""
    out = {}
    for tenant, spec in raw.items():
        if not isinstance(spec, dict) or not spec:
            raise ValueError(f"{tenant}: an object of {', '.join(LIMIT_FIELDS)}, got {str(spec)[:80]}")
        unknown = set(spec) - set(LIMIT_FIELDS)
        if unknown:
            raise ValueError(f"{tenant}: unknown {', '.join(sorted(unknown))} (known: {', '.join(LIMIT_FIELDS)})")
        for name, value in spec.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{tenant}: {name} must be a number > 0, got {str(value)[:40]}")
        if "max_open" in spec and spec["max_open"] != int(spec["max_open"]):
            raise ValueError(f"{tenant}: max_open must be a whole number, got {spec['max_open']}")
        out[tenant] = TenantLimit(max_open=int(spec.get("max_open", 0)),
                                  requests_per_minute=float(spec.get("requests_per_minute", 0)),
                                  tokens_per_minute=float(spec.get("tokens_per_minute", 0)))
    return out


class _Bucket:
    __slots__ = ("capacity", "level", "at_s")

    def __init__(self, capacity: float, now_s: float) -> None:
        self.capacity, self.level, self.at_s = capacity, capacity, now_s

    def refill(self, now_s: float) -> None:
        if now_s > self.at_s:
            self.level = min(self.capacity, self.level + (now_s - self.at_s) * self.capacity / 60.0)
        self.at_s = now_s

    def wait_s(self, amount: float) -> float:
        """Seconds until it can give `amount` (0: now); a full bucket gives anything."""
        if self.level >= amount or self.level >= self.capacity:
            return 0.0
        return (min(amount, self.capacity) - self.level) * 60.0 / self.capacity


# Tenants with a bucket kept, per kind: past this, the buckets refilled to full (idle a minute)
# are forgotten (a full bucket is what a new one starts as, so nothing changes for them).
# Without API keys a tenant is any header value: this bounds what bogus names can hold.
MAX_TRACKED = 10_000


def _forget_full(kept: dict[str, _Bucket], now_s: float) -> None:
    for tenant in [t for t, b in kept.items() if (b.refill(now_s), b.level >= b.capacity)[1]]:
        del kept[tenant]


class Refusal(Exception):
    """Over a limit: `message` says which; `retry_after_ms` when to come back."""

    def __init__(self, message: str, retry_after_ms: int) -> None:
        super().__init__(message)
        self.message, self.retry_after_ms = message, retry_after_ms


class TenantLimits:
    """The limits of one router process (module docstring). `admit` takes a request in or
    raises Refusal; `release` when its response ended (once per admitted request)."""

    def __init__(self, limits: dict[str, TenantLimit]) -> None:
        self.limits = limits
        self.open: dict[str, int] = {}
        self.requests: dict[str, _Bucket] = {}
        self.tokens: dict[str, _Bucket] = {}

    def limit_of(self, tenant: str) -> TenantLimit | None:
        return self.limits.get(tenant) or self.limits.get("*")

    def admit(self, tenant: str, num_tokens: int, now_s: float) -> bool:
        """True: admitted and counted (call `release` when it ends); False: no limit applies
        (nothing counted). Raises Refusal over a limit (nothing counted)."""
        limit = self.limit_of(tenant)
        if limit is None:
            return False
        if limit.max_open and self.open.get(tenant, 0) >= limit.max_open:
            raise Refusal(f"tenant {tenant} has {limit.max_open} requests open, its limit", 1000)
        buckets = []
        for per_minute, kept, amount, what in ((limit.requests_per_minute, self.requests, 1, "requests"),
                                               (limit.tokens_per_minute, self.tokens, num_tokens, "tokens")):
            if not per_minute:
                continue
            bucket = kept.get(tenant)
            if bucket is None:
                if len(kept) >= MAX_TRACKED:
                    _forget_full(kept, now_s)
                bucket = kept[tenant] = _Bucket(per_minute, now_s)
            bucket.refill(now_s)
            wait = bucket.wait_s(amount)
            if wait > 0:
                raise Refusal(f"tenant {tenant} is over its {per_minute:g} {what} per minute", math.ceil(wait * 1000))
            buckets.append((bucket, amount))
        for bucket, amount in buckets:
            bucket.level -= amount
        self.open[tenant] = self.open.get(tenant, 0) + 1
        return True

    def release(self, tenant: str) -> None:
        n = self.open.get(tenant, 0) - 1
        if n > 0:
            self.open[tenant] = n
        else:
            self.open.pop(tenant, None)
