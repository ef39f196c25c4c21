"""Routing policies: one module per policy, the contract in protocol.py, and the one registry.

A policy picks one worker from candidates the scheduler scored (protocol.py has the contract:
`select` is pure, `record` folds a committed pick, `ctx.rng` is the only randomness).

Registry: `PREFILL_POLICIES` and `DECODE_POLICIES` map a kebab-case name to a `PolicySpec`
(factory, typed parameter struct, one-line summary); both are read-only, built here and
nowhere else. `build_policy(stage, name, params)` is the one construction path: an unknown
name, an unknown parameter key or a bad value raises ValueError naming the policy and the
field. The CLI's `--prefill-policy` / `--decode-policy` help is built from the summaries.

Prefill stage (colocated pd_fusion workers too): cost-based (cost_based.py), cache-aware,
least-loaded, power-of-two, round-robin, random. Decode stage (disaggregated): kv-aware,
least-loaded, round-robin, random (load = running + reserved requests). The scheduler's
defaults are cost-based and kv-aware (SchedulerConfig).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import msgspec

from services.core.policies.cache_aware import CacheAware, CacheAwareParams
from services.core.policies.cost_based import CostBased, CostBasedParams
from services.core.policies.kv_aware import KvAware, KvAwareParams
from services.core.policies.least_loaded import LeastLoaded
from services.core.policies.power_of_two import PowerOfTwo
from services.core.policies.protocol import Candidate, NoParams, Pick, PolicyParams, RouteContext, RoutingPolicy, Score
from services.core.policies.random_policy import RandomPolicy
from services.core.policies.round_robin import RoundRobin
from services.core.seeded import DecisionRng

__all__ = [
    "DECODE_POLICIES", "PREFILL_POLICIES", "CacheAware", "CacheAwareParams", "Candidate", "CostBased", "CostBasedParams",
    "DecisionRng", "KvAware", "KvAwareParams", "LeastLoaded", "NoParams", "Pick", "PolicyParams", "PolicySpec",
    "PowerOfTwo", "RandomPolicy", "RoundRobin", "RouteContext", "RoutingPolicy", "Score", "UnknownPolicyError",
    "build_policy",
]


@dataclass(frozen=True)
class PolicySpec:
    factory: Callable[[Any], RoutingPolicy]  # params struct -> policy
    params: type[PolicyParams]
    summary: str  # one line, for the CLI's help and `explain`


_LEAST_LOADED = PolicySpec(LeastLoaded, NoParams, "fewest pending requests")
_ROUND_ROBIN = PolicySpec(RoundRobin, NoParams, "next worker id after the last pick")
_RANDOM = PolicySpec(RandomPolicy, NoParams, "uniform")

PREFILL_POLICIES: Mapping[str, PolicySpec] = MappingProxyType({
    "cost-based": PolicySpec(CostBased, CostBasedParams,
                             "lowest predicted TTFT (prefix hit, prefill, waits) after load filters"),
    "cache-aware": PolicySpec(CacheAware, CacheAwareParams,
                              "SGLang's rule: best prefix match, else smallest cache; shortest queue when imbalanced"),
    "least-loaded": _LEAST_LOADED,
    "power-of-two": PolicySpec(PowerOfTwo, NoParams, "the less loaded of two drawn at random"),
    "round-robin": _ROUND_ROBIN,
    "random": _RANDOM,
})
DECODE_POLICIES: Mapping[str, PolicySpec] = MappingProxyType({
    "kv-aware": PolicySpec(KvAware, KvAwareParams, "weighted random toward the least KV in use, among those that fit"),
    "least-loaded": _LEAST_LOADED,
    "round-robin": _ROUND_ROBIN,
    "random": _RANDOM,
})


class UnknownPolicyError(ValueError):
    pass


def build_policy(stage: str, name: str, params: dict[str, Any] | None = None) -> RoutingPolicy:
    """Construct a policy; unknown names, unknown parameters and bad values raise ValueError."""
    table = {"prefill": PREFILL_POLICIES, "decode": DECODE_POLICIES}[stage]
    spec = table.get(name)
    if spec is None:
        raise UnknownPolicyError(f"unknown {stage} policy {name!r}; known: {', '.join(sorted(table))}")
    try:
        typed = msgspec.convert(params or {}, spec.params).validate()  # strict: types checked, as batchers'
    except msgspec.ValidationError as exc:
        raise ValueError(f"{stage} policy {name}: bad parameters: {exc}") from None
    return spec.factory(typed)
