"""`prefix-affinity`: the share of the prompt the worker holds in its prefix cache (predicted
cached tokens / prompt tokens): 1 where the whole prompt is cached, 0 where none of it is."""

from __future__ import annotations

from services.core.pipeline.protocol import Plugin
from services.core.policies.protocol import Candidate, RouteContext


class PrefixAffinity(Plugin):
    name = "prefix-affinity"

    def score(self, ctx: RouteContext, cands: list[Candidate]) -> list[float]:
        n = ctx.num_prompt_tokens
        return [min(c.num_cached_tokens / n, 1.0) if n > 0 else 0.0 for c in cands]
