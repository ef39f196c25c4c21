"""`kv-free`: the share of the worker's KV cache still free for this request (available / total
tokens; 0 for a worker that reported none)."""

from __future__ import annotations

from services.core.pipeline.protocol import Plugin
from services.core.policies.protocol import Candidate, RouteContext


class KvFree(Plugin):
    name = "kv-free"

    def score(self, ctx: RouteContext, cands: list[Candidate]) -> list[float]:
        return [min(max(c.kv_available_tokens / c.kv_total_tokens, 0.0), 1.0) if c.kv_total_tokens > 0 else 0.0
                for c in cands]
