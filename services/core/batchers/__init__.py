"""Batchers: one module per algorithm, the contract in protocol.py, and the one registry.

A batcher holds the requests routed to one prefill worker until they leave as a batch
(protocol.py has the calling contract and the batch-shape rules shared by every algorithm;
base.py the queue and poll loop they share). Algorithms: `fixed-window` (fixed_window.py)
and `slo-budget` (slo_budget.py).

Registry: `BATCHERS` maps a kebab-case name to a `BatcherSpec` (parameter struct, factory,
one-line summary), read-only and built here. `build_batcher(name, params, predict_ms)` is the
one construction path; `parse_params` and `default_params` give a batcher's validated
parameters. Every error is a ValueError naming the batcher and the field. The CLI's
`--batcher` help is built from the summaries.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import msgspec

from services.core.batchers.fixed_window import FixedWindowBatcher, FixedWindowParams
from services.core.batchers.protocol import Batchable, Batcher, Closed, PollResult, PredictFn, WorkerLoad
from services.core.batchers.slo_budget import SloBudgetBatcher, SloBudgetParams

__all__ = [
    "BATCHERS", "DEFAULT_BATCHER", "Batchable", "Batcher", "BatcherSpec", "Closed", "FixedWindowBatcher",
    "FixedWindowParams", "PollResult", "PredictFn", "SloBudgetBatcher", "SloBudgetParams", "WorkerLoad",
    "build_batcher", "default_params", "parse_params",
]


@dataclass(frozen=True)
class BatcherSpec:
    params_type: type[FixedWindowParams] | type[SloBudgetParams]
    factory: Callable[[Any, PredictFn], Batcher[Any]]  # (params, predict_ms) -> batcher
    summary: str  # one line, for the CLI's help


BATCHERS: Mapping[str, BatcherSpec] = MappingProxyType({
    "fixed-window": BatcherSpec(FixedWindowParams, FixedWindowBatcher,
                                "FIFO; leaves when full, capped or the head has waited its window"),
    "slo-budget": BatcherSpec(SloBudgetParams, SloBudgetBatcher,
                              "most urgent first; waits for arrivals only within the head's TTFT slack"),
})

# The core's default (SchedulerConfig.batcher: tests, benchmarks and recorded configurations
# that name none): FlexLB's fixed-window. Changing it changes their decisions, so only on
# purpose. The router ships slo-budget (services/settings.py, SHIPPED_BATCHER).
DEFAULT_BATCHER = "fixed-window"


def _spec(name: str) -> BatcherSpec:
    spec = BATCHERS.get(name)
    if spec is None:
        raise ValueError(f"unknown batcher {name!r}; known: {', '.join(sorted(BATCHERS))}")
    return spec


def default_params(name: str) -> FixedWindowParams | SloBudgetParams:
    """The default parameters of batcher `name` (ValueError for an unknown name)."""
    return _spec(name).params_type().validate()


def build_batcher(
    name: str, params: Mapping[str, Any] | msgspec.Struct | None, predict_ms: PredictFn,
) -> Batcher[Any]:
    """A batcher by name. `params`: a mapping (unknown keys and wrong types are rejected), a
    params struct of that batcher, or None for the defaults. Every error is a ValueError
    naming the batcher and the field."""
    return _spec(name).factory(parse_params(name, params), predict_ms)


def parse_params(name: str, params: Mapping[str, Any] | msgspec.Struct | None) -> FixedWindowParams | SloBudgetParams:
    """Batcher `name`'s validated parameters (build_batcher's rules)."""
    spec = _spec(name)
    parsed: FixedWindowParams | SloBudgetParams
    if params is None:
        parsed = spec.params_type()
    elif isinstance(params, spec.params_type):
        parsed = params
    elif isinstance(params, Mapping):
        try:
            parsed = msgspec.convert(dict(params), spec.params_type)
        except msgspec.ValidationError as e:
            raise ValueError(f"{name}: invalid parameters: {e}") from None
    else:
        raise ValueError(f"{name}: parameters must be a mapping or {spec.params_type.__name__}, "
                         f"got {type(params).__name__}")
    return parsed.validate()
