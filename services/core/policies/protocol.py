"""The routing-policy contract: what a policy is given (`RouteContext`, one `Candidate` per
worker), what it returns (`Pick`, with a `Score` card per candidate) and the two calls it
answers (`RoutingPolicy`).

- The scheduler builds one `Candidate` per live worker of the stage's role, with every input
  a policy may use already computed (prefix hit, predicted prefill, waits, pending, KV,
  gates). It never passes a dead or draining worker.
- `select(ctx) -> Pick` is a pure choice: it does not mutate the policy. It returns the pick
  (or None with a reason) and the score card of every candidate, including which filter
  removed it: the decision is data (`route.decided`), and `explain` needs nothing else.
- `record(pick)` is called once the pick is committed; only stateful policies (round-robin)
  change there. A rejected request leaves no trace.
- `ctx.rng` is the only randomness: a `DecisionRng` (services/core/seeded.py) seeded per
  decision by the scheduler, so a replay re-draws the same numbers (tests may pass a
  `random.Random`).
- Parameters are `PolicyParams` structs: typed, frozen, unknown keys rejected, `validate()`
  naming the policy and the field.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import msgspec

from services.core.seeded import DecisionRng
from services.core.view import WorkerInfo


class _CandidateFields(NamedTuple):
    worker: WorkerInfo
    worker_id: str
    num_cached_tokens: int  # predicted prefix-cache hit of this request on this worker
    prefill_ms: float  # predicted prefill of this request alone, given the hit
    wait_ms: float  # predicted wait for the worker's inflight batches
    queue_ms: float  # predicted wait in the worker's batcher queue
    num_pending: int  # requests we reserved there (inflight) + queued in its batcher
    num_cache_blocks: int  # blocks the prefix index says it holds (its "tree size")
    kv_total_tokens: int
    kv_used_tokens: int  # reported used + Σ expected reservations not yet visible
    kv_available_tokens: int  # reported free − Σ hard reservations not yet visible
    gated: bool  # pending above the hysteresis gate (prefill) / KV usage gate (decode)
    ttft_ms: float  # prefill_ms + wait_ms + queue_ms: predicted time to first token there
    tpot_ms: float  # predicted decode step (TPOT) there with this request added; 0: idle or not predicted


class Candidate(_CandidateFields):
    """One worker as the scheduler scored it for this request: an immutable snapshot (a
    tuple: the scheduler builds one per worker per decision, so it must be cheap; its hot
    path calls `tuple.__new__(Candidate, fields)` with every field, ttft_ms included)."""

    __slots__ = ()

    def __new__(cls, worker: WorkerInfo, num_cached_tokens: int = 0, prefill_ms: float = 0.0, wait_ms: float = 0.0,
                queue_ms: float = 0.0, num_pending: int = 0, num_cache_blocks: int = 0, kv_total_tokens: int = 0,
                kv_used_tokens: int = 0, kv_available_tokens: int = 0, gated: bool = False,
                tpot_ms: float = 0.0) -> "Candidate":
        return tuple.__new__(cls, (worker, worker.worker_id, num_cached_tokens, prefill_ms, wait_ms, queue_ms, num_pending,
                                   num_cache_blocks, kv_total_tokens, kv_used_tokens, kv_available_tokens, gated,
                                   prefill_ms + wait_ms + queue_ms, tpot_ms))

    def __repr__(self) -> str:
        return f"Candidate({self.worker_id}, ttft={self.ttft_ms:.1f}ms)"



class RouteContext:
    """One decision's inputs. `rng` is built on first use from `seed` (most decisions draw
    nothing: seeding a Random costs more than scoring a worker); pass a Random or a seed."""

    __slots__ = ("request_id", "num_prompt_tokens", "max_tokens", "candidates", "now_ns", "_rng", "_seed",
                 "num_prompt_blocks", "slo_ttft_ms", "tpot_limit_ms")

    def __init__(self, request_id: str, num_prompt_tokens: int, max_tokens: int, candidates: list[Candidate],
                 now_ns: int, rng: random.Random | int, num_prompt_blocks: int = 0, slo_ttft_ms: float = 0.0,
                 tpot_limit_ms: float = 0.0) -> None:
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self.max_tokens = max_tokens
        self.candidates = candidates
        self.now_ns = now_ns
        self._rng = rng if isinstance(rng, random.Random) else None
        self._seed = rng if isinstance(rng, int) else None
        self.num_prompt_blocks = num_prompt_blocks  # full blocks of the prompt (for match ratios)
        self.slo_ttft_ms = slo_ttft_ms  # 0: no SLO
        # The decode step above which a worker holds new work for TPOT (the batcher's
        # tpot_headroom x the request's TPOT target); 0: no TPOT hold
        self.tpot_limit_ms = tpot_limit_ms

    @property
    def rng(self) -> random.Random | DecisionRng:
        if self._rng is None:
            self._rng = DecisionRng(self._seed)
        return self._rng


@dataclass(slots=True)
class Score:
    worker_id: str
    score: float
    components: dict[str, float] = field(default_factory=dict)
    filtered_by: str | None = None


class Pick:
    """The choice (None: nothing could be picked, see reason) and the score card of every
    candidate. The cards and the reason text may be built on first read (`scores`,
    `reason`) from a snapshot the policy passed: building them costs more than the
    decision, and most readers are the shell's event encoder, once."""

    __slots__ = ("worker_id", "_reason", "_scores", "_cards", "_reason_fn")

    def __init__(self, worker_id: str | None, reason: str | None = None, scores: list[Score] | None = None,
                 cards: Callable[[], list[Score]] | None = None, reason_fn: Callable[[], str] | None = None) -> None:
        if reason is None and reason_fn is None:
            raise ValueError("a Pick needs a reason")
        self.worker_id = worker_id
        self._reason = reason
        self._reason_fn = reason_fn
        self._scores = scores if scores is not None or cards is not None else []
        self._cards = cards

    @property
    def reason(self) -> str:
        if self._reason is None:
            self._reason = self._reason_fn()
            self._reason_fn = None
        return self._reason

    @property
    def scores(self) -> list[Score]:
        if self._scores is None:
            self._scores = self._cards()
            self._cards = None
        return self._scores

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, Pick) and self.worker_id == other.worker_id and self.reason == other.reason
                and self.scores == other.scores)

    def __repr__(self) -> str:
        return f"Pick({self.worker_id!r}, {self.reason!r})"



class RoutingPolicy(Protocol):
    name: str  # its kebab-case registry name
    params: "PolicyParams"  # its validated parameters (the scheduler reads the gates' from them)

    def select(self, ctx: RouteContext) -> Pick:
        """Choose among `ctx.candidates`; pure (no state changes)."""
        ...

    def record(self, pick: Pick) -> None:
        """The pick was committed: fold it into the policy's state, if it has any."""
        ...


# The expected decode KV of a request (prompt + min(max_tokens, this)) where the decode policy
# has no `expected_output_cap` of its own: FlexLB's.
DEFAULT_EXPECTED_OUTPUT_CAP = 1000


class PolicyParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A policy's typed parameters; `validate()` raises ValueError naming the policy and field.

    The gates the scheduler keeps (services/core/scheduler.py) are parameters of the policy
    that has them, read through these methods; a policy without one inherits "none"."""

    def validate(self) -> "PolicyParams":
        return self

    def pending_gate(self) -> tuple[float, float]:
        """(high, hysteresis) of the prefill gate on a worker's pending requests: inf, none."""
        return math.inf, 0.0

    def kv_gate(self) -> tuple[float, float]:
        """(max usage, hysteresis) of the decode gate on a worker's KV usage: inf, none."""
        return math.inf, 0.0

    def expected_output_cap_tokens(self) -> int:
        return DEFAULT_EXPECTED_OUTPUT_CAP


class NoParams(PolicyParams):
    """The parameters of a policy that has none."""
