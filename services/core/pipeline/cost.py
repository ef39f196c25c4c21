"""The cost of a worker for a request, as cost-based scores it (services/core/policies/
cost_based.py): its predicted TTFT, plus `prefill_weight` x the prefill it spends for lack of
the best-cached candidate's prefix (its own prefill's share of the tokens that candidate has
cached and it has not: 0 where the caches match). Shared by the filters, scorer and picker
that take a `prefill_weight`."""

from __future__ import annotations

from services.core.policies.protocol import Candidate, RouteContext


def most_cached(ctx: RouteContext) -> int:
    """The most cached tokens among every candidate of the decision (not only those left)."""
    return max((c.num_cached_tokens for c in ctx.candidates), default=0)


def cost_of(c: Candidate, most: int, num_prompt_tokens: int, prefill_weight: float) -> float:
    if not prefill_weight:
        return c.ttft_ms
    extra = 0.0
    if most > c.num_cached_tokens and num_prompt_tokens > c.num_cached_tokens:
        extra = c.prefill_ms * (most - c.num_cached_tokens) / (num_prompt_tokens - c.num_cached_tokens)
    return c.ttft_ms + prefill_weight * extra


def costs(ctx: RouteContext, cands: list[Candidate], prefill_weight: float) -> list[float]:
    most = most_cached(ctx) if prefill_weight else 0
    return [cost_of(c, most, ctx.num_prompt_tokens, prefill_weight) for c in cands]
