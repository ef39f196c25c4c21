"""Routing policies as plugins: filters narrow the candidates, a policy picks one.

Contract: `select(ctx) -> Pick | None` is a pure choice that never mutates the policy;
`record(pick)` is called by the caller once the pick is committed (choosing and recording
are two steps, so a rolled-back pick leaves no trace). `ctx.rng` is the only randomness.

Registry: `build_policy(kind, name, params)` constructs from an explicit table; unknown
names fail at start with the list of known ones. Issue 4 adds cost-based, cache-aware,
least-loaded, power-of-two and kv-aware here.

Policies in this module:
- `round-robin`: the candidates sorted by id, the next one after the last recorded pick.
- `random`: uniform over the candidates, from ctx.rng.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable, Protocol

from services.core.view import WorkerInfo


@dataclass(frozen=True)
class RouteContext:
    request_id: str
    num_prompt_tokens: int
    max_tokens: int
    candidates: list[WorkerInfo]  # already filtered to live workers of the right role
    now_ns: int
    rng: random.Random
    block_hashes: tuple[int, ...] = ()


@dataclass(frozen=True)
class Pick:
    worker_id: str
    reason: str
    scores: dict[str, float] = field(default_factory=dict)  # candidate id -> score, for explain


class RoutingPolicy(Protocol):
    name: str

    def select(self, ctx: RouteContext) -> Pick | None: ...

    def record(self, pick: Pick) -> None: ...


class RoundRobin:
    name = "round-robin"

    def __init__(self) -> None:
        self.last_worker_id: str | None = None

    def select(self, ctx: RouteContext) -> Pick | None:
        if not ctx.candidates:
            return None
        ids = sorted(w.worker_id for w in ctx.candidates)
        nxt = next((i for i in ids if self.last_worker_id is None or i > self.last_worker_id), ids[0])
        return Pick(nxt, reason=f"next after {self.last_worker_id or '(start)'} in id order of {len(ids)} candidates")

    def record(self, pick: Pick) -> None:
        self.last_worker_id = pick.worker_id


class RandomPolicy:
    name = "random"

    def select(self, ctx: RouteContext) -> Pick | None:
        if not ctx.candidates:
            return None
        ids = sorted(w.worker_id for w in ctx.candidates)
        return Pick(ctx.rng.choice(ids), reason=f"uniform random of {len(ids)} candidates")

    def record(self, pick: Pick) -> None:
        pass  # stateless: nothing to record


PREFILL_POLICIES: dict[str, Callable[[], RoutingPolicy]] = {"round-robin": RoundRobin, "random": RandomPolicy}
DECODE_POLICIES: dict[str, Callable[[], RoutingPolicy]] = {"round-robin": RoundRobin, "random": RandomPolicy}


class UnknownPolicyError(ValueError):
    pass


def build_policy(kind: str, name: str) -> RoutingPolicy:
    table = {"prefill": PREFILL_POLICIES, "decode": DECODE_POLICIES}[kind]
    if name not in table:
        raise UnknownPolicyError(f"unknown {kind} policy {name!r}; known: {', '.join(sorted(table))}")
    return table[name]()
