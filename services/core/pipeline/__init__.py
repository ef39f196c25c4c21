"""Scheduling as a pipeline: filters, scorers and a picker, composed by configuration.

A decision's candidates (one per live worker of the stage: services/core/policies/protocol.py)
go through the pipeline's filters in order (a worker a filter drops shows that filter's name
on its score card), the survivors are scored by every scorer (each a score in [0, 1], times
its weight, summed), and the picker chooses among them by their totals. The card of every
candidate lists each scorer's score (`score.<name>`) beside the candidate's inputs, so
`flexlb explain` shows why. Every candidate dropped: no pick ("every candidate filtered").

Plugins live one per file in filters/, scorers/ and pickers/ (protocol.py has the contract)
and are found by their `name`: adding one is a file, and naming it in configuration.
Configuration is a `PipelineParams` (the `pipeline` policy's parameters, or one stage of
`--scheduling-config FILE`; services/settings.py):

    {"filters": [{"type": "gated"}], "scorers": [{"type": "prefix-affinity", "weight": 2},
     {"type": "fewest-pending"}], "picker": {"type": "max-score"}}

Named pipelines: every shipped policy is one (services/core/policies/__init__.py registers
them; their parameter Structs stay in services/core/policies/): `least-loaded` (scorer
fewest-pending, picker max-score), `random`, `round-robin`, `power-of-two` (their pickers),
`kv-aware`, `cache-aware` and `cost-based` (`kv_aware`, `cache_aware`, `cost_based` below).
Each decides exactly as its policy class did (tests/unit/services/core/test_golden_journals.py replays
journals recorded before).
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import msgspec

from services.core.pipeline import filters, pickers, scorers
from services.core.pipeline.protocol import Filter, Picker, PluginRef, Scorer
from services.core.policies.base import no_pick, score_components
from services.core.policies.protocol import Pick, PolicyParams, RouteContext, Score


def _discover(package) -> Mapping[str, type]:
    """Every plugin class of a package: one with a `name`, defined in one of its modules."""
    found: dict[str, type] = {}
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        for value in vars(module).values():
            if isinstance(value, type) and value.__module__ == module.__name__ and isinstance(getattr(value, "name", None), str):
                if value.name in found:
                    raise ValueError(f"two pipeline plugins named {value.name!r} in {package.__name__}")
                found[value.name] = value
    return MappingProxyType(found)


FILTERS: Mapping[str, type[Filter]] = _discover(filters)
SCORERS: Mapping[str, type[Scorer]] = _discover(scorers)
PICKERS: Mapping[str, type[Picker]] = _discover(pickers)


class PipelineParams(PolicyParams):
    filters: list[PluginRef] = []
    scorers: list[PluginRef] = []
    picker: PluginRef = PluginRef(type="max-score")
    # Every candidate filtered: "" no pick; "least-waiting" the least predicted wait (then id),
    # its card marked `fallback_from` (the filter lifted), as cost-based does.
    fallback: str = ""
    # The gates the scheduler keeps for this stage, which the `gated` filter reads: as
    # cost-based's (prefill) and kv-aware's (decode), with their defaults.
    pending_gate_high: int = 64
    pending_gate_hysteresis: float = 0.15
    max_kv_usage: float = 0.9
    kv_usage_hysteresis: float = 0.15

    def pending_gate(self) -> tuple[float, float]:
        return self.pending_gate_high, self.pending_gate_hysteresis

    def kv_gate(self) -> tuple[float, float]:
        return self.max_kv_usage, self.kv_usage_hysteresis

    def validate(self) -> "PipelineParams":
        if self.fallback not in ("", "least-waiting"):
            raise ValueError(f"pipeline: fallback must be least-waiting or empty, got {self.fallback!r}")
        if self.pending_gate_high < 1 or not 0 <= self.pending_gate_hysteresis < 1:
            raise ValueError("pipeline: pending_gate_high must be >= 1 and pending_gate_hysteresis in [0, 1)")
        if not 0 < self.max_kv_usage <= 1 or not 0 <= self.kv_usage_hysteresis < 1:
            raise ValueError("pipeline: max_kv_usage in (0, 1] and kv_usage_hysteresis in [0, 1) required")
        for kind, refs, table in (("filter", self.filters, FILTERS), ("scorer", self.scorers, SCORERS),
                                  ("picker", [self.picker], PICKERS)):
            for ref in refs:
                if ref.type not in table:
                    raise ValueError(f"pipeline: unknown {kind} {ref.type!r}; known: {', '.join(sorted(table))}")
                if kind != "scorer" and ref.weight != 1.0:
                    raise ValueError(f"pipeline: a {kind} has no weight ({ref.type!r} was given {ref.weight!r})")
                if not ref.weight >= 0:
                    raise ValueError(f"pipeline: scorer {ref.type!r} weight must be >= 0, got {ref.weight!r}")
                _build(table[ref.type], ref)  # its parameters, checked now
        return self


def _build(cls: type, ref: PluginRef) -> Any:
    try:
        params = msgspec.convert(ref.params, cls.Params).validate()
    except msgspec.ValidationError as exc:
        raise ValueError(f"pipeline: {ref.type!r}: bad parameters: {exc}") from None
    return cls(params)


class Pipeline:
    """A routing policy (RoutingPolicy) made of plugins (module docstring)."""

    def __init__(self, config: PipelineParams, name: str = "pipeline", params: PolicyParams | None = None) -> None:
        """`params`: the policy's parameters, which the scheduler reads its gates from (a named
        pipeline's: its policy's; a composed one's: its PipelineParams)."""
        self.name = name
        self.config = config
        self.params = config if params is None else params
        self.filters: list[Filter] = [_build(FILTERS[r.type], r) for r in config.filters]
        self.scorers: list[tuple[Scorer, float]] = [(_build(SCORERS[r.type], r), r.weight) for r in config.scorers]
        self.picker: Picker = _build(PICKERS[config.picker.type], config.picker)

    def select(self, ctx: RouteContext) -> Pick:
        cands = ctx.candidates
        if not cands:
            return no_pick("no live candidate", [])
        dropped: list[str | None] = [None] * len(cands)
        any_dropped = False
        for f in self.filters:
            flags = f.keep(ctx, cands)
            if all(flags):  # (most decisions: nobody dropped, no per-candidate loop)
                continue
            any_dropped = True
            name = f.name
            for i, keep in enumerate(flags):
                if not keep and dropped[i] is None:
                    dropped[i] = name
        if any_dropped:
            alive = [i for i, d in enumerate(dropped) if d is None]
            kept = [cands[i] for i in alive]
        else:
            alive, kept = list(range(len(cands))), cands
        scorers = self.scorers
        # A picker that does not read the totals (lowest-cost, random, ...) leaves the scoring to
        # the cards, which are built on first read (Pick): the decision's hot path skips it.
        scored: list | None = None
        totals: list[float] = []
        if scorers and kept and self.picker.uses_totals:
            scored = [(s.name, w, s.score(ctx, kept)) for s, w in scorers]
            totals = [sum(w * scores[j] for _, w, scores in scored) for j in range(len(kept))]
        elif not scorers:
            totals = [0.0] * len(kept)

        def cards(fallback: int = -1) -> list[Score]:
            per = scored if scored is not None else [(s.name, w, s.score(ctx, kept) if kept else []) for s, w in scorers]
            tot = totals if scored is not None or not scorers else [
                sum(w * scores[j] for _, w, scores in per) for j in range(len(kept))]
            total_of = dict(zip(alive, tot))
            by_scorer = {i: {f"score.{name}": scores[j] for name, _, scores in per} for j, i in enumerate(alive)}
            out = [Score(c.worker_id, total_of.get(i, 0.0),
                         {**score_components(c), "kv_used_tokens": float(c.kv_used_tokens),
                          "kv_available_tokens": float(c.kv_available_tokens), **by_scorer.get(i, {})}, dropped[i])
                   for i, c in enumerate(cands)]
            if fallback >= 0:  # the fallback's card shows the filter lifted: a pick is never a filtered card
                out[fallback] = Score(out[fallback].worker_id, 0.0, {**out[fallback].components, "fallback_from": 1.0}, None)
            return out

        if not kept and self.config.fallback == "least-waiting":
            fb = min(range(len(cands)), key=lambda i: (cands[i].wait_ms + cands[i].queue_ms, cands[i].worker_id))
            wid = cands[fb].worker_id
            return Pick(wid, f"every candidate filtered; least waiting {wid} (was {dropped[fb]})", cards=lambda: cards(fb))
        if not kept:
            counts: dict[str, int] = {}
            for d in dropped:
                counts[d] = counts.get(d, 0) + 1
            return Pick(None, reason_fn=lambda: "every candidate filtered (" + ", ".join(
                f"{n} by {name}" for name, n in sorted(counts.items())) + ")", cards=cards)
        j, why = self.picker.pick(ctx, kept, totals)
        return Pick(kept[j].worker_id, why, cards=cards)

    def record(self, pick: Pick) -> None:
        if pick.worker_id is not None:
            self.picker.record(pick.worker_id)


def named(name: str, config: dict[str, Any], params: PolicyParams) -> Pipeline:
    """A shipped policy expressed as a pipeline: `config` under the policy's `name`, with the
    policy's own parameters (what its gates read)."""
    return Pipeline(msgspec.convert(config, PipelineParams).validate(), name, params)


def cost_based(params: Any) -> Pipeline:
    """cost-based (services/core/policies/cost_based.py has its parameters, and why): filters
    gated, late, tpot, slo-ttft, hotspot and imbalance in that order (those its parameters turn
    on), the fallback least-waiting, the scorer predicted-cost for the cards, and the picker
    lowest-cost (its tie window is in milliseconds)."""
    w = params.prefill_weight
    filters: list[dict[str, Any]] = [{"type": "gated"}]
    if w:
        filters.append({"type": "late", "parameters": {"prefill_weight": w}})
    if params.tpot_filter:
        filters.append({"type": "tpot"})
    if params.slo_filter:
        filters.append({"type": "slo-ttft", "parameters": {"margin_ms": params.slo_margin_ms, "prefill_weight": w}})
    filters.append({"type": "hotspot", "parameters": {"factor": params.hotspot_factor,
                                                      "min_excess": params.hotspot_min_excess}})
    if params.imbalance_factor:
        filters.append({"type": "imbalance", "parameters": {"factor": params.imbalance_factor,
                                                            "min_excess_ms": params.imbalance_min_excess_ms}})
    return named("cost-based", {
        "filters": filters, "fallback": "least-waiting",
        "scorers": [{"type": "predicted-cost", "parameters": {"prefill_weight": w}}],
        "picker": {"type": "lowest-cost", "parameters": {"prefill_weight": w, "tie_rel": params.tie_rel,
                                                         "tie_abs_ms": params.tie_abs_ms, "tie_break": params.tie_break}},
    }, params)


def cache_aware(params: Any) -> Pipeline:
    """cache-aware (services/core/policies/cache_aware.py has its parameters): SGLang's rule,
    its picker; the prefix-affinity scorer for the cards."""
    return named("cache-aware", {
        "scorers": [{"type": "prefix-affinity"}],
        "picker": {"type": "cache-aware", "parameters": msgspec.structs.asdict(params)},
    }, params)


def kv_aware(params: Any) -> Pipeline:
    """kv-aware (services/core/policies/kv_aware.py has its parameters): the worker must hold
    the prompt, its KV gate open, its load and KV in use within their factors of the average;
    then a draw weighted toward the least KV in use."""
    return named("kv-aware", {
        "filters": [{"type": "kv-available"}, {"type": "gated"},
                    {"type": "load", "parameters": {"factor": params.load_factor}},
                    {"type": "kv-used", "parameters": {"factor": params.kv_used_factor}}],
        "scorers": [{"type": "least-kv-used", "parameters": {"per_token": params.kv_weight_per_token}}],
        "picker": {"type": "weighted-random"},
    }, params)


__all__ = ["FILTERS", "PICKERS", "SCORERS", "Pipeline", "PipelineParams", "cache_aware", "cost_based", "kv_aware", "named"]
