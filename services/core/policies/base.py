"""What the policies share beyond the contract (protocol.py): the helpers that build score
cards."""

from __future__ import annotations

from services.core.policies.protocol import Candidate, Pick, Score


def score_components(c: Candidate) -> dict[str, float]:
    """The candidate's inputs, as a score card shows them."""
    return {
        "prefill_ms": c.prefill_ms, "wait_ms": c.wait_ms, "queue_ms": c.queue_ms,
        "cached_tokens": c.num_cached_tokens, "pending": c.num_pending, "tpot_ms": c.tpot_ms,
    }


def no_pick(reason: str, scores: list[Score]) -> Pick:
    return Pick(None, reason, scores)
