"""Per-tenant limits (services/limits.py) on a fake clock, and at the API's door: 429
rate_limited with Retry-After, counted per tenant, the open count released when a response ends."""

from __future__ import annotations

import json

import pytest

from schemas.tokens import ByteTokenizer
from services.api import CompletionsFront
from services.limits import MAX_TRACKED, Refusal, TenantLimit, TenantLimits, parse_limits
from services.settings import RouterSettings, SettingsError
from tests.unit.services.test_api_headers import SubmitRecorder, post


def test_requests_per_minute_is_a_bucket_of_a_minutes_worth_refilled_continuously():
    limits = TenantLimits({"a": TenantLimit(requests_per_minute=60)})
    t = 100.0
    for _ in range(60):  # a minute's worth at once
        assert limits.admit("a", 10, t)
        limits.release("a")
    with pytest.raises(Refusal) as exc:
        limits.admit("a", 10, t)
    assert exc.value.retry_after_ms == 1000 and "60 requests per minute" in exc.value.message
    t += 0.5
    with pytest.raises(Refusal) as exc:
        limits.admit("a", 10, t)
    assert exc.value.retry_after_ms == 500
    t += 0.5  # one request's worth refilled
    assert limits.admit("a", 10, t)
    limits.release("a")
    assert not limits.admit("b", 10, t)  # no entry, no "*": no limit, nothing counted


def test_tokens_per_minute_counts_prompt_and_max_tokens_and_a_huge_request_passes_a_full_bucket():
    limits = TenantLimits({"*": TenantLimit(tokens_per_minute=1200)})
    assert limits.admit("x", 1000, 0.0)
    with pytest.raises(Refusal) as exc:
        limits.admit("x", 500, 0.0)  # 200 left, 300 short: 300 tokens at 20/s
    assert exc.value.retry_after_ms == 15_000 and "tokens per minute" in exc.value.message
    assert limits.admit("y", 5000, 0.0)  # another tenant under "*": its own full bucket, even for 5,000
    with pytest.raises(Refusal) as exc:
        limits.admit("y", 1, 1.0)  # in debt: wait until it is paid back
    assert exc.value.retry_after_ms == 189_050  # (-3,800 + 20 refilled, to 1: 3,781 tokens at 20 a second)


def test_max_open_counts_what_is_open_and_a_refusal_counts_nothing():
    limits = TenantLimits({"a": TenantLimit(max_open=2, requests_per_minute=100)})
    assert limits.admit("a", 1, 0.0) and limits.admit("a", 1, 0.0)
    with pytest.raises(Refusal, match="2 requests open"):
        limits.admit("a", 1, 0.0)
    assert limits.requests["a"].level == 98  # the refused one took no request from the bucket
    limits.release("a")
    assert limits.admit("a", 1, 0.0)
    limits.release("a"), limits.release("a")
    assert limits.open == {}


def test_buckets_of_bogus_tenants_are_bounded():
    limits = TenantLimits({"*": TenantLimit(requests_per_minute=60)})
    for i in range(MAX_TRACKED + 500):
        limits.admit(f"bogus-{i}", 1, i * 2.0)  # each idle long enough to be full again later
        limits.release(f"bogus-{i}")
    assert len(limits.requests) <= MAX_TRACKED


@pytest.mark.parametrize("raw, why", [
    ({"a": {"max_open": 0}}, "> 0"), ({"a": {"rpm": 5}}, "unknown rpm"), ({"a": {}}, "an object"),
    ({"a": {"max_open": 1.5}}, "whole number"), ({"a": {"tokens_per_minute": "many"}}, "number"),
])
def test_a_bad_limit_is_refused_naming_it(raw, why):
    with pytest.raises(ValueError, match=why):
        parse_limits(raw)
    with pytest.raises(SettingsError, match="tenant_limits"):
        RouterSettings(tenant_limits=raw).validate()


def test_the_api_answers_429_rate_limited_with_retry_after_and_releases_the_open_count():
    service = SubmitRecorder()
    service.settings = RouterSettings(tenant_limits={"gamma": {"requests_per_minute": 2}, "*": {"max_open": 5}}).validate()
    front = CompletionsFront(service, ByteTokenizer(), app=None)
    for _ in range(2):
        sent = post(front, [(b"x-flexlb-tenant", b"gamma")])
        assert sent[0]["status"] == 503  # (SubmitRecorder refuses no_worker: it reached the router)
    sent = post(front, [(b"x-flexlb-tenant", b"gamma")])
    body = json.loads(sent[1]["body"])
    assert sent[0]["status"] == 429 and body["error"]["code"] == "rate_limited" and body["error"]["retryable"]
    assert dict(sent[0]["headers"])[b"retry-after"] == b"30"
    assert service.rejected == ["rate_limited"] and len(service.submitted) == 2
    for _ in range(8):  # "*": max_open 5, but each request ended: nothing stays open
        assert post(front, [(b"x-flexlb-tenant", b"delta")])[0]["status"] == 503
    assert front.limits.open == {}
