"""Routing policies: one module per policy, the contract in protocol.py, and the one registry.

A policy picks one worker from candidates the scheduler scored (protocol.py has the contract:
`select` is pure, `record` folds a committed pick, `ctx.rng` is the only randomness).

Registry: `PREFILL_POLICIES` and `DECODE_POLICIES` map a kebab-case name to a `PolicySpec`
(factory, typed parameter struct, one-line summary); both are read-only, built here and
nowhere else. `build_policy(stage, name, params)` is the one construction path: an unknown
name, an unknown parameter key or a bad value raises ValueError naming the policy and the
field. The CLI's `--prefill-policy` / `--decode-policy` help is built from the summaries.

Prefill stage (colocated pd_fusion workers too): cost-based (cost_based.py), cache-aware,
least-loaded, power-of-two, round-robin, random, pipeline. Decode stage (disaggregated):
kv-aware, least-loaded, round-robin, random, pipeline (load = running + reserved requests).
Each is a named pipeline of filters, scorers and a picker (services/core/pipeline/), built
from its parameters; `pipeline` is one composed from configuration. The
scheduler's defaults are cost-based and kv-aware (SchedulerConfig).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import msgspec

from services.core.policies.cache_aware import CacheAwareParams
from services.core.policies.cost_based import CostBasedParams
from services.core.policies.kv_aware import KvAwareParams
from services.core.policies.protocol import Candidate, NoParams, Pick, PolicyParams, RouteContext, RoutingPolicy, Score
from services.core.seeded import DecisionRng

__all__ = [
    "DECODE_POLICIES", "PREFILL_POLICIES", "CacheAwareParams", "Candidate", "CostBasedParams",
    "DecisionRng", "KvAwareParams", "NoParams", "Pick", "PolicyParams", "PolicySpec", "RouteContext",
    "RoutingPolicy", "Score", "UnknownPolicyError",
    "build_policy",
]


@dataclass(frozen=True)
class PolicySpec:
    factory: Callable[[Any], RoutingPolicy]  # params struct -> policy
    params: type[PolicyParams]
    summary: str  # one line, for the CLI's help and `explain`


def _pipeline(name: str, config: dict[str, Any]) -> Callable[[Any], RoutingPolicy]:
    """A policy shipped as a named pipeline (services/core/pipeline/): built on first use, as
    the pipeline package imports this one's contract."""

    def factory(params: NoParams) -> RoutingPolicy:
        from services.core.pipeline import named

        return named(name, config, params)
    return factory


def _cost_based(params: CostBasedParams) -> RoutingPolicy:
    from services.core.pipeline import cost_based

    return cost_based(params)


def _cache_aware(params: CacheAwareParams) -> RoutingPolicy:
    from services.core.pipeline import cache_aware

    return cache_aware(params)


def _kv_aware(params: KvAwareParams) -> RoutingPolicy:
    from services.core.pipeline import kv_aware

    return kv_aware(params)


def _pipeline_policy(params: Any) -> RoutingPolicy:
    from services.core.pipeline import Pipeline

    return Pipeline(params)


def _pipeline_params() -> type[PolicyParams]:
    from services.core.pipeline import PipelineParams

    return PipelineParams


_LEAST_LOADED = PolicySpec(_pipeline("least-loaded", {"scorers": [{"type": "fewest-pending"}],
                                                      "picker": {"type": "max-score"}}),
                           NoParams, "fewest pending requests (pipeline: fewest-pending, max-score)")
_ROUND_ROBIN = PolicySpec(_pipeline("round-robin", {"picker": {"type": "round-robin"}}), NoParams,
                          "next worker id after the last pick (pipeline: picker round-robin)")
_RANDOM = PolicySpec(_pipeline("random", {"picker": {"type": "random"}}), NoParams, "uniform (pipeline: picker random)")
_PIPELINE = PolicySpec(_pipeline_policy, PolicyParams, "filters, scorers and a picker from configuration "
                       "(services/core/pipeline/; --scheduling-config)")

PREFILL_POLICIES: Mapping[str, PolicySpec] = MappingProxyType({
    "cost-based": PolicySpec(_cost_based, CostBasedParams,
                             "lowest predicted TTFT (prefix hit, prefill, waits) after load filters"),
    "cache-aware": PolicySpec(_cache_aware, CacheAwareParams,
                              "SGLang's rule: best prefix match, else smallest cache; shortest queue when imbalanced"),
    "least-loaded": _LEAST_LOADED,
    "power-of-two": PolicySpec(_pipeline("power-of-two", {"picker": {"type": "power-of-two"}}), NoParams,
                               "the less loaded of two drawn at random (pipeline: picker power-of-two)"),
    "pipeline": _PIPELINE,
    "round-robin": _ROUND_ROBIN,
    "random": _RANDOM,
})
DECODE_POLICIES: Mapping[str, PolicySpec] = MappingProxyType({
    "kv-aware": PolicySpec(_kv_aware, KvAwareParams, "weighted random toward the least KV in use, among those that fit "
                           "(pipeline: kv-available, gated, load, kv-used; least-kv-used; weighted-random)"),
    "least-loaded": _LEAST_LOADED,
    "round-robin": _ROUND_ROBIN,
    "random": _RANDOM,
    "pipeline": _PIPELINE,
})


class UnknownPolicyError(ValueError):
    pass


def build_policy(stage: str, name: str, params: dict[str, Any] | None = None) -> RoutingPolicy:
    """Construct a policy; unknown names, unknown parameters and bad values raise ValueError."""
    table = {"prefill": PREFILL_POLICIES, "decode": DECODE_POLICIES}[stage]
    spec = table.get(name)
    if spec is None:
        raise UnknownPolicyError(f"unknown {stage} policy {name!r}; known: {', '.join(sorted(table))}")
    params_type = _pipeline_params() if spec is _PIPELINE else spec.params
    try:
        typed = msgspec.convert(params or {}, params_type).validate()  # strict: types checked, as batchers'
    except msgspec.ValidationError as exc:
        raise ValueError(f"{stage} policy {name}: bad parameters: {exc}") from None
    return spec.factory(typed)
