"""The scheduler's input and output records: a request to admit, and the decisions, batches
and failures it returns. Plain data (the shell encodes them as events; `explain` and `replay`
read them); the core never reads them back to decide.

Hot-path records (`AdmitRequest`, `Admitted`, `RouteDecision`) are immutable by convention
rather than frozen: a frozen dataclass costs about a microsecond to build, and the router and
a replay build one per request.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.core.policies.protocol import Pick


@dataclass
class QueuedRequest:
    """An admitted request waiting in a batcher (field names match `Batchable`)."""

    request_id: str
    num_prompt_tokens: int
    num_cached_tokens: int  # predicted prefix hit on the prefill worker
    kv_tokens: int  # KV the engine needs to admit it: the prompt (its output's KV grows as it decodes)
    max_tokens: int
    enqueued_ns: int
    deadline_ns: int  # arrival + TTFT SLO
    tpot_target_ms: float  # its TPOT SLO
    strict_deadline: bool  # refused rather than served past its TTFT target (its SLO mode: see admit)
    prefill_worker_id: str
    decode_worker_id: str
    payload: object = None  # the shell's request handle; the core never looks inside
    lora_adapter: str = ""  # the LoRA adapter it runs with ("": the base model; BatchRequest.lora_adapter)
    block_hashes: tuple[int, ...] = ()  # its prompt's chained block hashes (a move scores other workers' hits)
    model: str = ""  # the pool it was routed in (the resolved model name)
    openai_only: bool = False  # only workers whose engine takes OpenAI bodies (AdmitRequest.engine_fields)
    embeddings: bool = False  # only workers whose engine serves embeddings (AdmitRequest.embeddings)


@dataclass(slots=True)
class AdmitRequest:
    """(Immutable by convention: not frozen, as a frozen dataclass costs a microsecond to build,
    and a replay builds one per recorded arrival.)"""

    request_id: str
    num_prompt_tokens: int
    max_tokens: int
    block_hashes: tuple[int, ...] = ()
    priority: int | None = None
    slo_ttft_ms: float | None = None  # override
    slo_tpot_ms: float | None = None  # override
    payload: object = None
    # The model the request names ("": none, the router's default `model_name`): only workers
    # serving it are candidates.
    model: str = ""
    # The fair queue (admission.py): who sent it ("": the default tenant) and its class
    # ("": from `priority`; else critical | standard | sheddable).
    tenant: str = ""
    priority_class: str = ""
    # Served late rather than refused: never slo_unattainable, its TTFT deadline not strict
    # (what-if's "serve this one" replays, services/whatif.py marginal_over_refusal).
    best_effort: bool = False
    # Workers it may not go to (a retry: those that failed it before its first token).
    excluded_workers: tuple[str, ...] = ()
    # Fields of its body only an engine server taking OpenAI bodies honours (ForEngine.extra_body:
    # logprobs, response_format, ...): only workers whose engine protocol is "openai" serve it.
    engine_fields: tuple[str, ...] = ()
    # An embeddings request (ForEngine.embed): only workers whose engine server answers
    # /v1/embeddings (EngineSignals.embeddings) serve it.
    embeddings: bool = False


class RouteDecision:
    """One routing decision (immutable by convention; a plain slots class: one per request)."""

    __slots__ = ("stage", "policy", "decision_seq", "seed", "pick")

    def __init__(self, stage: str, policy: str, decision_seq: int, seed: int, pick: Pick) -> None:
        self.stage = stage  # "prefill" | "decode"
        self.policy = policy
        self.decision_seq = decision_seq
        self.seed = seed
        self.pick = pick

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RouteDecision) and (self.stage, self.policy, self.decision_seq, self.seed, self.pick) == (
            other.stage, other.policy, other.decision_seq, other.seed, other.pick)

    def __repr__(self) -> str:
        return f"RouteDecision({self.stage}, {self.policy}, seq={self.decision_seq}, {self.pick!r})"


@dataclass(slots=True)
class Admitted:
    """(Immutable by convention: not frozen, as a frozen dataclass costs a microsecond to build.)"""

    request: QueuedRequest
    decisions: list[RouteDecision]
    predicted_ttft_ms: float
    slo_ttft_ms: float
    slo_tpot_ms: float
    priority: int
    best_effort: bool

    @property
    def prefill_pick(self) -> Pick:
        return next(d.pick for d in self.decisions if d.stage == "prefill")

    @property
    def decode_pick(self) -> Pick:
        return next((d.pick for d in self.decisions if d.stage == "decode"), self.prefill_pick)

    @property
    def policy(self) -> str:
        return "/".join(d.policy for d in self.decisions)


@dataclass(frozen=True)
class Rejected:
    code: str
    message: str
    decisions: list[RouteDecision] = field(default_factory=list)
    predicted_ttft_ms: float = 0.0
    slo_ttft_ms: float = 0.0
    retry_after_ms: int = 0  # the fair queue's hint for a refusal it made (0: none; the API's default)
    # slo_unattainable: the best worker for it and the TPOT it predicted there, against the target
    best_worker_id: str = ""
    predicted_tpot_ms: float = 0.0
    slo_tpot_ms: float = 0.0


@dataclass(frozen=True)
class FormedBatch:
    batch_id: str
    worker_id: str
    items: list[QueuedRequest]
    reason: str
    predicted_ms: float

    @property
    def num_prompt_tokens(self) -> int:
        return sum(i.num_prompt_tokens for i in self.items)


@dataclass(frozen=True)
class QueueFailure:
    item: QueuedRequest
    code: str  # queue_timeout | too_large | no_worker | slo_unattainable
    message: str
    # slo_unattainable: why, as the router saw it (the journal keeps it): the best worker for it
    # at that moment and its predicted TTFT (from arrival) and TPOT there, against the targets
    best_worker_id: str = ""
    predicted_ttft_ms: float = 0.0
    predicted_tpot_ms: float = 0.0
    slo_ttft_ms: float = 0.0
    slo_tpot_ms: float = 0.0


@dataclass(frozen=True)
class SyncResult:
    dead: list[str]  # workers that just became dead
    expired: list[str]  # workers removed
    orphans: list[QueuedRequest]  # queued at the router for a dead/expired worker: re-admit or fail


@dataclass(frozen=True)
class Moved:
    """A request the TPOT hold kept on one worker up to its emergency point, moved to another
    worker that can still meet both its targets (Scheduler.tick)."""

    item: QueuedRequest  # as it is queued now (its new worker)
    from_worker_id: str
    decision: "RouteDecision"  # stage "move": the candidates and the pick


@dataclass(frozen=True)
class TickResult:
    batches: list[FormedBatch]
    failures: list[QueueFailure]
    moves: list[Moved] = field(default_factory=list)
