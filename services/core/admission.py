"""Holding work at the router under overload: the fair queue (fairness.py) per model pool,
released into routing as the pool's engines have room.

Pure like the rest of the core: the scheduler owns one `FairAdmission` and calls it from
`offer`, `release`, `cancel_waiting`, `drain_waiting` and `on_terminal` (all journaled).

Room. A pool's engines have room for `Σ max(0, max_num_seqs + engine_buffer - outstanding)`
over its live workers that run decode (colocated or decode role), where `max_num_seqs` is
what the worker reports its engine runs at once and `outstanding` the requests the router
routed to it that have not ended (its decode reservations: exact, and free the moment the
terminal event folds). Not the running count the worker reports: that lags by up to a
heartbeat (200 ms), and counting it held every release until the next report (measured:
the quiet tenant's queue wait p50 354 ms with it). Work the router does not know of (a
previous incarnation's, after a restart) waits in the engine's own queue meanwhile. Each engine thus gets what it can
run plus `engine_buffer` (default 0) waiting; everything beyond waits here, where the
classes and tenants are ordered (an engine's own queue is FCFS, whoever sent the request).
Why 0: a buffer refills a freed slot at once while the router's release is on its way (a
fold and a batch window, tens of ms), but every buffered request is served FCFS ahead of
what the queue orders later. Measured with bench/fairness_live.py (4 sim workers x 4
sequences behind `flexlb up`, a quiet tenant at 0.25 x capacity beside a noisy one at 2 x,
60 s): the quiet tenant's TTFT p99 1.87x its p99 alone with no buffer, 4.32x with 2, 90x
with the queue off (bench/CORE.md, run 1); utilisation stayed above capacity measured closed-loop either way (the
slot idles for the release's tens of ms, against seconds of decode). In virtual time
(bench/fairness.py, 8 engines x 32): 1.50x with none, 1.61x with 2, 1.93x with 8.

A worker that reports no `max_num_seqs` (0: an OpenAI-compatible server that did not say
and has not shown its limit yet) makes its pool's room unknown: the router holds nothing
back for that pool (the engines queue), and the queue stays empty.
The room counts concurrency only: an engine bound by its KV cache before `max_num_seqs`
queues the excess itself (the openai agent's learned limit, the most it ran while requests
waited, covers that case for vLLM and SGLang servers).

Offer. A request whose pool has an empty queue and room (or unknown room) is admitted at
once (routed now, as without the queue: the common case costs one room computation). Else
it is offered to the pool's queue (`Queued`, or `Refused` when a bound says so). A request
naming no known model is admitted at once: admission refuses it with its own code.

Release. `release(now)` expires what waited too long (`queue_timeout`), then pops as many as
each pool has room for, in the queue's order (classes by strict priority with the
starvation bound, tenants by VTC), and admits each (routes it; admission may still refuse
it, e.g. `slo_unattainable`). The batchers receive them in that order, so their per-worker
FIFO keeps it. Each admitted request's VTC charge is settled when it ends, with the output
tokens it produced (`on_terminal`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from services.core.fairness import (
    CLASSES,
    Dispatched,
    FairnessParams,
    FairQueue,
    FairRequest,
    PriorityClass,
    Refused,
    class_of_priority,
)

if TYPE_CHECKING:
    from services.core.inflight import InflightLedger
    from services.core.records import AdmitRequest
    from services.core.view import WorkerView

DEFAULT_TENANT = "default"  # the tenant of a request that names none


@dataclass(frozen=True, kw_only=True)
class FairAdmissionConfig:
    """The router's queue settings (`fair_queue`, `fair_engine_buffer`, `fairness_*`)."""

    enabled: bool = True
    engine_buffer: int = 0  # requests each engine may hold waiting beyond max_num_seqs (module docstring)
    params: FairnessParams = field(default_factory=FairnessParams)

    def __post_init__(self) -> None:
        if self.engine_buffer < 0:
            raise ValueError(f"fair_engine_buffer must be >= 0, got {self.engine_buffer}")


@dataclass(frozen=True, slots=True)
class Released:
    """One request that left a pool's queue: popped (`dispatched`, then `outcome` is what
    admission made of it: the scheduler's Admitted or Rejected) or refused while waiting."""

    pool: str
    record: Dispatched | Refused
    outcome: object = None  # Admitted | Rejected for a dispatched one; None for a refused one

    @property
    def request_id(self) -> str:
        return self.record.request_id


def priority_class_of(req: "AdmitRequest") -> PriorityClass:
    """The request's class: the one it names, else its numeric priority's band."""
    if req.priority_class:
        if req.priority_class not in CLASSES:
            raise ValueError(f"priority class must be one of {', '.join(CLASSES)}, got {req.priority_class!r}")
        return req.priority_class  # type: ignore[return-value]
    return class_of_priority(req.priority)


class FairAdmission:
    def __init__(self, config: FairAdmissionConfig) -> None:
        self.config = config
        self.queues: dict[str, FairQueue] = {}  # pool -> its queue (made on first use)
        self.dispatched: dict[str, tuple[str, Dispatched]] = {}  # request id -> (pool, its dispatch) until it ends
        self.waiting: dict[str, tuple[str, PriorityClass]] = {}  # request id -> (pool, class) while queued

    def queue(self, pool: str) -> FairQueue:
        q = self.queues.get(pool)
        if q is None:
            q = self.queues[pool] = FairQueue(self.config.params)
        return q

    def num_waiting(self) -> int:
        return sum(q.num_queued() for q in self.queues.values())

    def room(self, pool: str, view: "WorkerView", ledger: "InflightLedger") -> int | None:
        """How many more requests the pool's engines take now; None: unknown (module docstring)."""
        buffer = self.config.engine_buffer
        total = 0
        seen = False
        routable = view.routable(pool)
        for w in routable.colocated + routable.decode:
            if w.max_num_seqs <= 0:
                return None
            seen = True
            inf = ledger.workers.get(w.worker_id)
            outstanding = len(inf.reservations) if inf is not None else 0
            free = w.max_num_seqs + buffer - outstanding
            if free > 0:
                total += free
        return total if seen else None

    def to_fair(self, req: "AdmitRequest") -> FairRequest:
        return FairRequest(request_id=req.request_id, tenant=req.tenant or DEFAULT_TENANT, priority_class=priority_class_of(req),
                           num_input_tokens=req.num_prompt_tokens, num_est_output_tokens=req.max_tokens, payload=req)

    def settle(self, request_id: str, num_output_tokens: int | None):
        """The request ended: correct its tenant's charge by what it produced (None: unknown,
        the estimate stands). Returns the Settled record, or None if it was not charged here."""
        entry = self.dispatched.pop(request_id, None)
        if entry is None or num_output_tokens is None:
            return None
        pool, d = entry
        return self.queues[pool].settle(d, num_output_tokens)
