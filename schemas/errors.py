"""Error codes shared by API bodies, events and metric labels.

Each code has one meaning, an HTTP status and a retryable flag. Add codes when needed;
never reuse one for two meanings.
"""

from __future__ import annotations

import msgspec


class ErrorCode(msgspec.Struct, frozen=True):
    code: str
    http_status: int
    retryable: bool


_CODES = [
    ErrorCode("invalid_request", 400, False),
    ErrorCode("duplicate_request", 409, False),
    ErrorCode("too_large", 413, False),
    ErrorCode("queue_full", 429, True),
    ErrorCode("shed", 429, True),  # sheddable work refused first under overload (the fair queue)
    # The tenant is at one of its limits: open requests, requests or tokens per minute
    # (services/limits.py); Retry-After says when it will be under it again.
    ErrorCode("rate_limited", 429, True),
    ErrorCode("slo_unattainable", 429, True),
    ErrorCode("no_worker", 503, True),
    ErrorCode("draining", 503, True),
    ErrorCode("not_ready", 503, True),
    ErrorCode("not_found", 404, False),
    ErrorCode("adapter_not_found", 404, False),  # a LoRA adapter the worker cannot load
    ErrorCode("model_not_found", 404, False),  # a request names a model no worker serves (nor the default)
    ErrorCode("unauthorized", 401, False),
    # API keys are configured and the request has none, or one that is not known.
    ErrorCode("invalid_api_key", 401, False),
    # --strict-priority: the request asked a priority class its tenant is not granted.
    ErrorCode("priority_not_granted", 403, False),
    # An admin state change that a browser could have sent cross-site: not JSON, or an Origin
    # (or Sec-Fetch-Site) naming another site than the Host it was sent to.
    ErrorCode("forbidden", 403, False),
    ErrorCode("conflict", 409, False),
    ErrorCode("queue_timeout", 504, True),
    ErrorCode("timed_out", 504, True),
    ErrorCode("dispatch_failed", 502, True),
    ErrorCode("worker_failed", 502, True),
    ErrorCode("stream_overflow", 502, True),
    # Its worker died or failed it mid-stream more times than the router's --migration-limit.
    ErrorCode("migration_limit_exceeded", 502, True),
    # An OpenAI-compatible engine server (workers/openai/agent.py) refused the request (429,
    # 503: busy or not up) / failed it or broke its stream (a 5xx, a cut connection, a stall).
    ErrorCode("upstream_refused", 503, True),
    ErrorCode("upstream_error", 502, True),
    ErrorCode("cancelled", 499, False),
    ErrorCode("internal", 500, True),
]

ERROR_CODES: dict[str, ErrorCode] = {c.code: c for c in _CODES}


def error_code(code: str) -> ErrorCode:
    """Look up a code; an unknown code is a programming error, so it raises."""
    try:
        return ERROR_CODES[code]
    except KeyError:
        raise ValueError(f"unknown error code {code!r}") from None


class ErrorDetail(msgspec.Struct, frozen=True, kw_only=True):
    code: str
    message: str
    retryable: bool


class ErrorBody(msgspec.Struct, frozen=True, kw_only=True):
    """The body of every API error: {"error": {"code", "message", "retryable"}}."""

    error: ErrorDetail

    @classmethod
    def of(cls, code: str, message: str) -> "ErrorBody":
        return cls(error=ErrorDetail(code=code, message=message, retryable=error_code(code).retryable))
