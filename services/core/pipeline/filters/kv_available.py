"""`kv-available`: drops a worker whose free KV (reported free less what we reserved there and
it does not show yet) cannot hold the prompt."""

from __future__ import annotations

from services.core.pipeline.protocol import Plugin
from services.core.policies.protocol import Candidate, RouteContext


class KvAvailable(Plugin):
    name = "kv-available"

    def keep(self, ctx: RouteContext, cands: list[Candidate]) -> list[bool]:
        return [c.kv_available_tokens >= ctx.num_prompt_tokens for c in cands]
