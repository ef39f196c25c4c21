"""The plugin contract of a scheduling pipeline (services/core/pipeline/__init__.py): the
candidates of one decision go through `Filter`s (workers in -> workers out), are scored by
`Scorer`s (each worker a score in [0, 1], summed with the scorer's weight) and one `Picker`
chooses among the survivors by their total. Each plugin is a small class in its own file
under filters/, scorers/ or pickers/, found by its `name`; its parameters are a frozen
Struct (`Params`, unknown keys and wrong types refused), as a policy's are.

Pure, as the whole core: a plugin reads the decision's context (`RouteContext`: the request,
its targets, `ctx.rng` for any draw) and the candidates, nothing else. Only a picker may keep
state, folded in `record` once a pick is committed (round-robin).
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol

import msgspec

from services.core.policies.protocol import Candidate, PolicyParams, RouteContext


class NoPluginParams(PolicyParams):
    """The parameters of a plugin that has none."""


class Plugin:
    """What every plugin shares: its `name` (how configuration names it), its parameter Struct
    and the parameters it was built with. A picker without state inherits `record`."""

    name: ClassVar[str] = ""
    Params: ClassVar[type[PolicyParams]] = NoPluginParams
    uses_totals: ClassVar[bool] = True  # (pickers) False: it chooses by its own rule, not by the scores

    def __init__(self, params: Any) -> None:
        self.params = params

    def record(self, worker_id: str) -> None:
        """A committed pick: a stateless picker has nothing to fold (pickers only)."""


class Filter(Protocol):
    name: ClassVar[str]
    Params: ClassVar[type[PolicyParams]]

    def __init__(self, params: Any) -> None: ...

    def keep(self, ctx: RouteContext, cands: list[Candidate]) -> list[bool]:
        """For every candidate of the decision (all of them, so that a filter may compare a
        worker with the average), whether it stays in; one the filter drops shows the filter's
        name on its card, unless a filter before it dropped it already."""


class Scorer(Protocol):
    name: ClassVar[str]
    Params: ClassVar[type[PolicyParams]]

    def __init__(self, params: Any) -> None: ...

    def score(self, ctx: RouteContext, cands: list[Candidate]) -> list[float]:
        """One score per candidate (those the filters left), each in [0, 1]: higher is better."""


class Picker(Protocol):
    name: ClassVar[str]
    Params: ClassVar[type[PolicyParams]]

    def __init__(self, params: Any) -> None: ...

    def pick(self, ctx: RouteContext, cands: list[Candidate], totals: list[float]) -> tuple[int, str]:
        """The index (into `cands`) of the choice, and why, in a few words."""

    def record(self, worker_id: str) -> None:
        """The pick was committed (stateless pickers: nothing to do)."""


class PluginRef(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One plugin of a pipeline as configuration names it (the Gateway API Inference
    Extension's plugin config style): its type, its weight (scorers only) and its parameters."""

    type: str
    weight: float = 1.0
    params: dict[str, Any] = msgspec.field(default_factory=dict, name="parameters")
