"""Events (past-tense facts) and commands (imperatives) on the bus, and their Envelope.

Every message on a FlexLB subject is an `Envelope` whose `payload` is one of the tagged
Structs below. Tags are explicit, stable and dotted; they are the identity of a message kind
on the wire and in the event log, never a Python import path.

Evolution rules (golden payloads under tests/golden/ enforce them):
- additive only: a new field always gets a default, so old readers read new messages and new
  readers read old ones (unknown fields are ignored: events never use forbid_unknown_fields);
- a breaking change is a new tag plus an upcaster in `UPCASTERS`, applied at decode time
  by `schema_version`.

Units are in the names: `*_ms`, `*_ns`, `*_tokens`, `*_blocks`, `num_*`.

One module for every message, though it is over 500 lines: the tagged union `Payload` and
its decoder need every tag in one place, and a reader of the wire looks for a message here.
"""

from __future__ import annotations

from typing import Annotated, Any, Callable, Literal, Union

import msgspec

SCHEMA_VERSION = 1
# The window of WorkerStatusReported.recent_step_ms: a worker means its steps that ended in
# the last this many seconds (3 s: a 1 s window sheds on single long steps); what-if re-runs
# (services/whatif.py) compute the same field the same way.
RECENT_STEPS_WINDOW_S = 3.0

# A free-text field of an event (a refusal's or failure's message, a decision's reason) holds
# at most this many characters: set longer, it is cut at construction and at decode (`_bound`),
# so no event carrying client-influenced text can outgrow the bus's message limit (NATS: 1 MiB
# by default; a message over it is refused, and a fact lost) whatever reaches it.
MAX_TEXT_CHARS = 2000
_CUT = " ...[truncated]"  # the mark a cut text ends with


def _bound(event: Any, *fields: str) -> None:
    """Cut the named str fields of a (frozen) event to MAX_TEXT_CHARS, marking the cut."""
    for name in fields:
        text = getattr(event, name)
        if len(text) > MAX_TEXT_CHARS:
            msgspec.structs.force_setattr(event, name, text[:MAX_TEXT_CHARS - len(_CUT)] + _CUT)


Role = Literal["pd_fusion", "prefill", "decode"]
ROLES: tuple[str, ...] = ("pd_fusion", "prefill", "decode")


def parse_role(text: str) -> str:
    """Parse a role name case-insensitively from its common spellings.

    Accepts `pd_fusion`, `PD_FUSION`, `ROLE_TYPE_PREFILL`, `RoleType.DECODE`, `pd-fusion`.
    An unknown role is a ValueError naming the accepted ones.
    """
    norm = text.strip().lower().replace("-", "_")
    for prefix in ("roletype.", "role_type_"):
        if norm.startswith(prefix):
            norm = norm[len(prefix):]
    if norm not in ROLES:
        raise ValueError(f"unknown worker role {text!r}; expected one of {', '.join(ROLES)}")
    return norm


class _Event(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    pass


# --------------------------------------------------------------------------- worker facts
class WorkerRegistered(_Event, tag="worker.registered"):
    """A worker process started (or restarted: a new `boot_id`)."""

    worker_id: str
    role: Role
    boot_id: str  # new on every process start; a change means the worker restarted
    engine: str  # "sim" | "torch"
    pid: int
    host: str
    block_size_tokens: int
    num_kv_blocks: int  # KV capacity of the worker, in blocks
    max_batch_tokens: int  # most prompt tokens one prefill batch may hold
    max_seq_len_tokens: int  # longest prompt + output one sequence may have
    heartbeat_interval_ms: int
    # The model it serves (the name requests give as `model`); "": a worker before this field,
    # which serves the router's default model (its `model_name`).
    model: str = ""
    # The LoRA adapters it can serve (names requests may give as `model`): loaded now or
    # loadable on demand (vLLM's --lora-modules, the sim engine's --lora-adapters).
    lora_adapters: list[str] = []
    # Most sequences its engine runs at once (vLLM's max_num_seqs); 0: unknown. The router
    # holds work beyond it (plus a small buffer) in its own fair queue (services/core/fairness.py).
    max_num_seqs: int = 0
    max_loras: int = 0  # adapters its engine holds loaded at once (vLLM's --max-loras); 0: unknown or none


class WorkerStatusReported(_Event, tag="worker.status_reported"):
    """Periodic heartbeat; authoritative about what the worker holds right now."""

    worker_id: str
    role: Role
    boot_id: str
    state: str = "ready"  # "ready" | "not_ready" (not_ready_reason says why) | "draining" | "stopping"
    engine: str = "sim"
    pid: int = 0
    host: str = ""
    block_size_tokens: int = 16
    num_kv_blocks: int = 0
    num_free_kv_blocks: int = 0
    num_cached_kv_blocks: int = 0  # free-able blocks held only by the prefix cache
    max_batch_tokens: int = 0
    max_seq_len_tokens: int = 0
    num_running_requests: int = 0
    num_queued_batches: int = 0
    running_request_ids: list[str] = []
    num_batches_executed: int = 0
    num_requests_finished: int = 0
    num_undecodable_messages: int = 0
    num_stale_commands_refused: int = 0
    fencing_epoch: int = 0  # the highest router epoch this worker has accepted (a new leader's floor)
    num_stream_overflows: int = 0  # requests stopped: their tokens did not fit the outbound buffer
    time_scale: float = 1.0  # simulated engines: wall time = profile time × this (1.0 for real engines)
    last_step_ms: float = 0.0
    # Mean duration (engine ms) of the steps that ended in the last RECENT_STEPS_WINDOW_S: the
    # time per output token its running requests see now; 0 when it ran no step in that window.
    recent_step_ms: float = 0.0
    heartbeat_interval_ms: int = 200
    # Why the worker is not ready, in one line (state "not_ready"): "engine server
    # http://10.0.0.5:8000 unreachable: connection refused", ...; "" when ready.
    not_ready_reason: str = ""
    # What the worker learns from its engine (None: a worker before this field; read it as
    # EngineSignals()): /admin/workers shows it per worker.
    signals: EngineSignals | None = None
    model: str = ""  # the model it serves; "": a worker before this field (the router's default model)
    lora_adapters: list[str] = []  # the LoRA adapters it can serve (as WorkerRegistered)
    max_num_seqs: int = 0  # as WorkerRegistered (0: unknown)
    max_loras: int = 0  # as WorkerRegistered (0: unknown or none)
    # The adapters loaded in its engine now, least recently used first; None: unknown (an
    # engine that does not say). The router's LoRA affinity prefers workers holding the
    # request's adapter (services/core/lora.py).
    loaded_lora_adapters: list[str] | None = None


class EngineSignals(msgspec.Struct, frozen=True, kw_only=True):
    """Which signals a worker has from its engine. FlexLB's own engines (sim, torch) have every
    one natively; the openai agent has what its server gives (workers/openai/agent.py)."""

    protocol: str = "native"  # native (sim, torch) | openai (/v1/completions, /v1/chat/completions) | sglang (/generate)
    # Load and KV usage: native | vllm | sglang (the server's Prometheus /metrics) | none (no
    # /metrics: the agent's own in-flight counts and measured token gaps)
    metrics: str = "native"
    liveness: str = "native"  # native | metrics | health | models: which endpoint says the server is up
    token_ids: bool | None = True  # the output stream carries token ids; False: text only; None: not seen yet
    kv_events: bool = True  # exact KV-cache events reach the router (else it learns prefixes from decisions)
    # The server answers POST /v1/embeddings (the agent asks it once at its start: llama-server
    # --embeddings, an embedding model behind vLLM or SGLang); FlexLB's own engines do not.
    embeddings: bool = False


class WorkerLivenessChanged(_Event, tag="worker.liveness_changed"):
    """The router's verdict on a worker's liveness (dead, expired) and what it recovered."""

    worker_id: str
    router_id: str
    liveness: str  # "dead" | "stopped" (silent after reporting "stopping") | "expired" | "removed" (by an operator, with force)
    num_missed_syncs: int = 0
    num_rerouted: int = 0  # requests not yet started there, re-routed
    num_failed: int = 0  # requests started there that could not go on: failed (worker_failed, migration_limit_exceeded)
    num_migrated: int = 0  # requests started there that went on elsewhere: migrated, or retried before their first token
    num_purged_commands: int = 0  # dispatch commands removed from its work queue


class WorkerDrainChanged(_Event, tag="worker.drain_changed"):
    """An operator action on a worker, or its outcome: drain, undrain, drained (a draining
    worker finished everything it held), removed."""

    worker_id: str
    router_id: str
    action: str  # "drain" | "undrain" | "drained" | "removed"
    by: str = ""  # who asked (the admin client's address)
    num_requests_moved: int = 0  # removed with force: requests re-routed or failed


class WorkerBreakerChanged(_Event, tag="worker.breaker_changed"):
    """A worker's circuit breaker moved (closed -> open -> half_open -> closed or open again):
    consecutive request failures opened it, a probe request half-opened it, the probe's outcome
    closed or re-opened it (services/core/breaker.py)."""

    worker_id: str
    router_id: str
    from_state: str  # "closed" | "open" | "half_open"
    to_state: str
    reason: str = ""  # bounded (the router cuts it to 200 characters)
    open_ms: float = 0.0  # its back-off now: how long it stays open before the next probe
    num_failures: int = 0  # consecutive counted failures


class RequestRetried(_Event, tag="request.retried"):
    """A request a worker failed before any of its tokens reached the client was routed again,
    excluding the workers that failed it (the router's --retry-limit)."""

    request_id: str
    router_id: str
    from_worker_id: str
    to_worker_id: str
    code: str  # the failure that caused it
    attempt: int = 1  # 1 for the first retry


class RequestMigrated(_Event, tag="request.migrated"):
    """A request whose worker died or failed it mid-stream goes on elsewhere as a continuation:
    its prompt plus the `num_tokens_carried` output tokens its client already has, the rest of
    its max_tokens, from that output index (the router's --migration-limit)."""

    request_id: str
    router_id: str
    from_worker_id: str
    to_worker_id: str
    num_tokens_carried: int
    reason: str = ""  # bounded (200 characters)
    attempt: int = 1  # 1 for the first migration


class LedgerEntryEvicted(_Event, tag="ledger.entry_evicted"):
    """A reservation was removed from the ledger without a terminal event: nobody confirmed
    it within its TTL ("ttl"), or the worker stopped reporting a request it had reported
    running ("calibration")."""

    worker_id: str
    router_id: str
    field: str  # "pf:<batch id>" | "kv:<request id>"
    ttl_s: float
    reason: str = "ttl"  # "ttl" | "calibration"


# --------------------------------------------------------------------------- request life
class RequestAdmitted(_Event, tag="request.admitted"):
    request_id: str
    router_id: str
    prefill_worker_id: str
    decode_worker_id: str
    num_prompt_tokens: int
    max_tokens: int
    policy: str = ""  # the routing policy that picked the workers
    reason: str = ""  # why these workers (human readable, from the decision)
    predicted_ttft_ms: float = 0.0  # at admission: wait + queue + prefill on the chosen worker
    slo_ttft_ms: float = 0.0  # the request's TTFT target (0: none)
    slo_tpot_ms: float = 0.0  # the request's time-per-output-token target (0: none)
    priority: int = 50
    best_effort: bool = False  # admitted although the SLO looked unattainable
    num_cached_tokens: int = 0  # predicted prefix-cache hit on the prefill worker
    model: str = ""  # the pool it was routed in: the model its workers serve ("": an event before pools)
    tenant: str = ""  # who sent it ("": the default tenant, or an event before tenants were recorded)
    priority_class: str = ""  # the class it ran at ("": an event before classes were recorded)
    priority_class_asked: str = ""  # what it asked, when its tenant's grant lowered it ("": not lowered)

    def __post_init__(self) -> None:
        _bound(self, "reason")


class CandidateScore(msgspec.Struct, frozen=True, kw_only=True):
    """One worker as a routing policy saw it."""

    worker_id: str
    score: float  # lower is better for cost policies; see `components`
    components: dict[str, float] = {}  # e.g. prefill_ms, wait_ms, queue_ms, cached_tokens
    filtered_by: str | None = None  # the filter that removed it, or None if it stayed eligible


class RouteDecided(_Event, tag="route.decided"):
    """A routing decision as data: who was considered, how each scored, why the pick."""

    request_id: str
    router_id: str
    decision_seq: int  # the router's decision counter; with `seed`, enough to re-draw
    seed: int  # seed of the random.Random this decision drew from
    stage: str  # "prefill" | "decode"
    policy: str
    picked_worker_id: str | None
    reason: str
    candidates: list[CandidateScore] = []

    def __post_init__(self) -> None:
        _bound(self, "reason")


class RequestRejected(_Event, tag="request.rejected"):
    """Terminal: the router refused the request before it was dispatched."""

    request_id: str
    router_id: str
    code: str
    message: str

    def __post_init__(self) -> None:
        _bound(self, "message")


class BatchDispatched(_Event, tag="batch.dispatched"):
    batch_id: str
    router_id: str
    worker_id: str
    epoch: int
    request_ids: list[str]
    num_prompt_tokens: int
    reason: str = ""  # why the batcher closed the batch: "full" | "window" | "shutdown"


class BatchStarted(_Event, tag="batch.started"):
    batch_id: str
    worker_id: str
    request_ids: list[str]


class PrefillCompleted(_Event, tag="prefill.completed"):
    batch_id: str
    worker_id: str
    request_ids: list[str]
    measured_ms: float  # wall time of the batch's prefill as executed
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens served from the prefix cache


class TokensGenerated(_Event, tag="tokens.generated"):
    """Tokens of one request, on its core-NATS token subject (not the event log).

    `start_index` is the index of `token_ids[0]` in the request's output, so the router can
    detect a gap or a duplicate. The last chunk has `finish_reason` set.
    """

    request_id: str
    worker_id: str
    start_index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None = None  # "length" | "stop" on the last chunk
    # Output tokens this chunk stands for when `token_ids` is empty because the engine server
    # streams text without ids (the openai agent counts them from the server's chunks and
    # usage); 0: len(token_ids). `start_index` counts in the same tokens.
    num_tokens: int = 0
    # On the last chunk: the prompt tokens the engine found in its prefix cache (the client's
    # usage.prompt_tokens_details.cached_tokens comes from it); None: not known.
    num_cached_tokens: int | None = None
    # What the engine server's chunk said that FlexLB does not make itself, as JSON text of
    # {"delta": {...}, "choice": {...}, "chunk": {...}} (each key only where it has fields):
    # a chat delta's tool_calls, reasoning_content, a choice's logprobs, a finish_reason other
    # than length or stop ("tool_calls"), fields of the server's own. The router puts each
    # field, its bytes unchanged, into the client's chunk (schemas/openai_bodies.py). "": none.
    extra: str = ""

    @property
    def num_chunk_tokens(self) -> int:
        """How far this chunk moves the request's output index."""
        return len(self.token_ids) or self.num_tokens


class TokensBatch(_Event, tag="tokens.batch"):
    """Token chunks of several requests from one worker to one router, in one core-NATS
    message on the router's token subject (`BatchRequest.token_batch_subject`).

    A worker sends a request's chunks this way only when its dispatch named that subject (a
    router that names none gets one TokensGenerated per chunk on the request's own
    subject). What a worker coalesces: one engine step's chunks (the
    NATS worker), or what its streams brought within a flush interval (the OpenAI agent).
    Each chunk keeps its request's `start_index`, so the router finds gaps and duplicates
    per request; a ResendTokens is answered with plain TokensGenerated on the
    request's own subject. A request's chunks are in order within a message and across the
    messages of one worker.
    """

    worker_id: str
    chunks: list[TokensGenerated]


class RequestFinished(_Event, tag="request.finished"):
    """Terminal: every output token was generated and published."""

    request_id: str
    worker_id: str
    finish_reason: str
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int = 0
    first_token_ns: int = 0  # when the worker produced its first output token (wall clock; 0: unknown)


class RequestFailed(_Event, tag="request.failed"):
    """Terminal: the request could not be completed."""

    request_id: str
    worker_id: str  # or the router id when the router failed it
    code: str
    message: str
    retryable: bool = False

    def __post_init__(self) -> None:
        _bound(self, "message")


class RequestCancelled(_Event, tag="request.cancelled"):
    """Terminal: cancelled by the client or an operator."""

    request_id: str
    worker_id: str
    reason: str = ""

    def __post_init__(self) -> None:
        _bound(self, "reason")


class RequestTimedOut(_Event, tag="request.timed_out"):
    """Terminal: the request passed its deadline."""

    request_id: str
    worker_id: str
    phase: str = ""  # "queued" | "prefill" | "decode"


# --------------------------------------------------------------------------- KV cache
class KvBlocksStored(_Event, tag="kv.blocks_stored"):
    """Blocks entered the worker's prefix cache. `kv_seq` counts KV events per worker boot,
    from 1, without gaps: a reader that sees a gap asks for a snapshot."""

    worker_id: str
    boot_id: str
    kv_seq: int
    block_hashes: list[int]
    block_size_tokens: int = 16


class KvBlocksRemoved(_Event, tag="kv.blocks_removed"):
    worker_id: str
    boot_id: str
    kv_seq: int
    block_hashes: list[int]


class KvAllCleared(_Event, tag="kv.all_cleared"):
    worker_id: str
    boot_id: str
    kv_seq: int


class KvSnapshot(_Event, tag="kv.snapshot"):
    """Every block the worker's cache holds, consistent with its KV events up to `kv_seq`."""

    worker_id: str
    boot_id: str
    kv_seq: int
    block_hashes: list[int]
    block_size_tokens: int = 16


# --------------------------------------------------------------------------- commands
class Sampling(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How a request's tokens are drawn (the torch engine; the sim engine ignores it).
    temperature 0: greedy. seed None: the engine derives one from the request id, so the same
    request gives the same output."""

    temperature: Annotated[float, msgspec.Meta(ge=0, le=100)] = 0.0
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] = 1.0
    seed: Annotated[int, msgspec.Meta(ge=0)] | None = None
    ignore_eos: bool = False


class ChatForward(msgspec.Struct, frozen=True, kw_only=True):
    """A chat completion as the client sent it, for an engine that renders chat itself: the
    openai agent forwards it to its server's `/v1/chat/completions`, so tool calls, reasoning
    parsers and the server's own rendering stay the server's. The request's
    `prompt_token_ids` are the router's rendering (what it routed on); engines that run ids
    (sim, torch, SGLang's /generate) run those and ignore this."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class EmbedForward(msgspec.Struct, frozen=True, kw_only=True):
    """An embeddings request (`POST /v1/embeddings`) as its engine server gets it: the client's
    inputs, each a text or a list of token ids (a single one made a list of one). The rest of
    the client's fields (`encoding_format`, `dimensions`, `user`, ...) travel in
    ForEngine.extra_body; the router's own tokenization of the inputs is `prompt_token_ids`
    (what it sizes, routes and admits on)."""

    input: list[str | list[int]]  # (all texts or all token lists: the API checks)


class ForEngine(msgspec.Struct, frozen=True, kw_only=True):
    """What of a client's request travels to the engine that runs it. A Request has it, and so
    does each BatchRequest of a dispatch, which copies it whole (engine_part): a field added
    here is set by the API and read by the worker, with nothing between naming it."""

    prompt_token_ids: list[int]
    max_tokens: int
    sampling: Sampling | None = None  # None: greedy
    # The client's prompt as it sent it, when it sent text to /v1/completions ("": ids, or chat).
    # The router routes on its own tokenization (`prompt_token_ids`); an openai agent whose
    # server should tokenize the text itself (`engine_prompt` text: a llama-server whose model's
    # tokenizer the router does not have) sends this instead of the ids.
    prompt_text: str = ""
    # OpenAI `stop` strings: the router ends the request at the first one in its output text
    # (and cuts the text there); an engine server is given them too, so it stops early.
    stop: list[str] = []
    chat: ChatForward | None = None  # a chat completion (ChatForward); None: a completion
    # The client's W3C trace context (`traceparent`, version 00, checked by the API; "": none):
    # the openai agent sends it to its engine server, whose spans then join the client's trace.
    traceparent: str = ""
    # The index in the request's output of the first token this dispatch generates (0: from the
    # start). A migrated request's continuation (its worker died mid-stream) has its prompt end
    # with the output its client already has, and draws each new token as that output index
    # (the sim engine's token, the torch sampler's seed), so a greedy or seeded request goes on
    # exactly as it would have; its tokens' start_index and its num_output_tokens count from
    # the request's first output token.
    output_offset: int = 0
    # Fields of the client's body FlexLB does not use itself (logprobs, response_format, an
    # extension it does not know, ...), as the client sent them: the openai agent adds them to
    # its server's body (never over a field it sets itself); the router routes such a request
    # only to workers whose engine takes OpenAI bodies (AdmitRequest.engine_fields). None: none.
    extra_body: dict[str, Any] | None = None
    # An embeddings request (EmbedForward): the engine returns vectors, not tokens; only workers
    # whose server answers /v1/embeddings run it (EngineSignals.embeddings). None: a generation.
    embed: EmbedForward | None = None


ENGINE_FIELDS = ForEngine.__struct_fields__


def engine_part(request: ForEngine) -> dict[str, Any]:
    """`request`'s ForEngine fields, by name (to build a BatchRequest from a Request)."""
    return {f: getattr(request, f) for f in ENGINE_FIELDS}


class BatchRequest(ForEngine, frozen=True, kw_only=True):
    """One request inside a DispatchBatch command."""

    request_id: str
    decode_worker_id: str  # == the prefill worker in pd_fusion mode
    token_subject: str  # core-NATS subject the router listens on for this request's tokens
    deadline_ns: int = 0  # 0: none
    # The router takes this request's tokens coalesced with other requests' (TokensBatch) on
    # this subject; "" (a router before it, or a request a standby forwarded): one
    # TokensGenerated per chunk on token_subject.
    token_batch_subject: str = ""
    # The LoRA adapter to run it with ("" : the base model). The request named it as its
    # `model`; the worker serves it if it can (an engine that cannot fails it `adapter_not_found`).
    lora_adapter: str = ""


class DispatchBatch(_Event, tag="cmd.dispatch_batch"):
    """Run this batch's prefill as one unit, then decode (or hand off in PD mode)."""

    batch_id: str
    router_id: str
    worker_id: str
    epoch: int  # fencing epoch of the scheduling router
    requests: list[BatchRequest]


class StartDecode(_Event, tag="cmd.start_decode"):
    """PD hand-off: a prefill worker asks a decode worker to continue a request."""

    request_id: str
    prefill_worker_id: str
    decode_worker_id: str
    batch_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    token_subject: str
    first_token_id: int  # produced by the prefill
    output_offset: int = 0  # a continuation's (ForEngine.output_offset): the first token's index in the output
    num_cached_tokens: int = 0
    deadline_ns: int = 0
    sampling: Sampling | None = None
    # The torch engine: the prompt's K/V, an object in the JetStream object store KV_BUCKET
    # (schemas.subjects); the decode worker reads and deletes it. "": no KV shipped (sim).
    kv_object: str = ""
    token_batch_subject: str = ""  # BatchRequest's: where the router takes coalesced tokens ("": none)


class CancelRequest(_Event, tag="cmd.cancel_request"):
    request_id: str
    worker_id: str
    reason: str = ""
    # withdraw: the router has already ended this request (failed, re-routed elsewhere): drop
    # it silently — now, or when its command arrives later — and publish no terminal event.
    withdraw: bool = False
    # The batch (a DispatchBatch's, or for a decode worker the StartDecode's) the withdrawal
    # is of: a later dispatch of the same request in another batch (re-routed, possibly back
    # to this worker) is run. "" (a router before this field): every batch of the request.
    batch_id: str = ""

    def __post_init__(self) -> None:
        _bound(self, "reason")


class Request(ForEngine, frozen=True, kw_only=True):
    """One client request as the API parsed it (services/api.py): made once there and passed
    whole, to the admission of the leader (a standby forwards it inside `SubmitRequest`, which
    is a Request), into the request's handle, and from there into its dispatch. A new field of
    a request goes here (or in ForEngine, if the engine needs it), where the API sets it, and
    where it is read: nothing between names it."""

    request_id: str
    priority: int | None = None
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    timeout_s: float | None = None  # None: the router's request_timeout_s
    model: str = ""  # the model the client named ("": none, the default pool)
    tenant: str = ""  # who sent it ("": the default tenant): its share in the leader's fair queue
    priority_class: str = ""  # critical | standard | sheddable ("": by priority)
    # the class it asked for (by name or by its priority's band) when its tenant's grant lowered
    # it to `priority_class` ("": it got what it asked, or grants are off)
    priority_class_asked: str = ""


REQUEST_FIELDS = Request.__struct_fields__


class SubmitRequest(Request, _Event, tag="cmd.submit_request"):
    """A standby router forwards a client's request to the leader (NATS request-reply), or a
    leader that stops hands one over. Tokens go straight to the forwarder's `token_subject`."""

    router_id: str  # the forwarding router
    token_subject: str

    @classmethod
    def of(cls, request: Request, router_id: str, token_subject: str) -> "SubmitRequest":
        return cls(**{f: getattr(request, f) for f in REQUEST_FIELDS}, router_id=router_id, token_subject=token_subject)


class SubmitReply(_Event, tag="cmd.submit_reply"):
    request_id: str
    router_id: str  # the leader
    admitted: bool
    # when not admitted: why; when admitted, "queued": it waits in the leader's fair queue (no
    # worker yet): its request.admitted or request.rejected event follows on the leader's events
    code: str = ""
    message: str = ""
    prefill_worker_id: str = ""
    decode_worker_id: str = ""
    slo_ttft_ms: float = 0.0  # the targets it was admitted with (the standby counts SLO attainment)
    slo_tpot_ms: float = 0.0

    def __post_init__(self) -> None:
        _bound(self, "message")


class ResendTokens(_Event, tag="cmd.resend_tokens"):
    """Router -> worker: the token chunks of `request_id` from `from_index` on did not all
    arrive (a NATS node it was connected to was lost with them in flight); publish them again
    on `token_subject`. A worker keeps what it sent of its recent requests for this."""

    request_id: str
    worker_id: str
    from_index: int
    token_subject: str


class FenceEpoch(_Event, tag="cmd.fence_epoch"):
    """The newest scheduling epoch: a worker refuses dispatches carrying an older one, so a
    router that was replaced (restarted, or a stale replica) can no longer command it."""

    worker_id: str
    router_id: str
    epoch: int


class RequestKvSnapshot(_Event, tag="cmd.request_kv_snapshot"):
    """Ask a worker to publish a `KvSnapshot` (after a gap in its KV events, or a restart)."""

    worker_id: str
    requester: str
    reason: str = ""


class CoreRecorded(_Event, tag="core.recorded"):
    """One call into a router's scheduling core, in call order: the journal from which
    `flexlb replay` rebuilds the core's state at any instant and re-makes every decision.
    `op` names the call (`config` first: the configuration in force), `args` its inputs as
    builtins, `out` a summary of what it decided (compared at replay). The envelope's seq
    is gap-free per router process, so a lost record is detected, never skipped silently."""

    router_id: str
    op: str
    now_ns: int = 0
    args: dict[str, Any] = {}
    out: dict[str, Any] = {}


Payload = Union[
    CoreRecorded,
    WorkerRegistered,
    WorkerStatusReported,
    WorkerLivenessChanged,
    WorkerDrainChanged,
    WorkerBreakerChanged,
    RequestRetried,
    RequestMigrated,
    LedgerEntryEvicted,
    RequestAdmitted,
    RouteDecided,
    RequestRejected,
    BatchDispatched,
    BatchStarted,
    PrefillCompleted,
    TokensGenerated,
    TokensBatch,
    RequestFinished,
    RequestFailed,
    RequestCancelled,
    RequestTimedOut,
    KvBlocksStored,
    KvBlocksRemoved,
    KvAllCleared,
    KvSnapshot,
    DispatchBatch,
    StartDecode,
    CancelRequest,
    SubmitRequest,
    SubmitReply,
    FenceEpoch,
    RequestKvSnapshot,
    ResendTokens,
]

PAYLOAD_TYPES: tuple[type, ...] = Payload.__args__  # type: ignore[attr-defined]
TERMINAL_TYPES: tuple[type, ...] = (
    RequestRejected,
    RequestFinished,
    RequestFailed,
    RequestCancelled,
    RequestTimedOut,
)


def tag_of(cls: type) -> str:
    return cls.__struct_config__.tag  # type: ignore[attr-defined]


class Envelope(msgspec.Struct, frozen=True, kw_only=True):
    """The frame of every message: who said it, in which order, when, in which version."""

    event_id: str  # unique; "<producer>:<boot>:<seq>"
    producer: str  # worker or router id
    seq: int  # per-producer sequence, from 1, gap-free within one boot
    time_ns: int  # producer's clock, ns since the Unix epoch
    payload: Payload
    schema_version: int = SCHEMA_VERSION


class DecodeError(Exception):
    """An undecodable message: the reason is kept for the dead-letter record."""


# Upcasters: schema_version -> function(raw envelope dict) -> raw envelope dict of version+1.
UPCASTERS: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = {}

_ENCODER = msgspec.json.Encoder()
_DECODER = msgspec.json.Decoder(Envelope)
_RAW_DECODER = msgspec.json.Decoder()


def encode(envelope: Envelope) -> bytes:
    return _ENCODER.encode(envelope)


def decode(data: bytes) -> Envelope:
    """Decode one message, upcasting old schema versions; raise DecodeError with a reason."""
    try:
        env = _DECODER.decode(data)
    except msgspec.DecodeError as exc:
        raise DecodeError(str(exc)) from None
    if env.schema_version > SCHEMA_VERSION:
        # Newer writers are additive within a version; a higher version we cannot read.
        raise DecodeError(f"schema_version {env.schema_version} is newer than {SCHEMA_VERSION}")
    if env.schema_version < SCHEMA_VERSION:
        raw = _RAW_DECODER.decode(data)
        for version in range(env.schema_version, SCHEMA_VERSION):
            if version not in UPCASTERS:
                raise DecodeError(f"no upcaster from schema_version {version}")
            raw = UPCASTERS[version](raw)
        env = msgspec.convert(raw, Envelope)
    return env


def decode_as(data: bytes, *kinds: type) -> Envelope:
    """Decode a message that must carry one of `kinds`; anything else is a DecodeError
    (a well-formed message of the wrong kind on a subject is as undecodable as garbage)."""
    env = decode(data)
    if not isinstance(env.payload, kinds):
        raise DecodeError(f"unexpected {type(env.payload).__name__}; expected {' or '.join(k.__name__ for k in kinds)}")
    return env


class EnvelopeFactory:
    """Stamps payloads with producer, a gap-free sequence and a time given by the caller."""

    def __init__(self, producer: str, boot_id: str) -> None:
        self.producer = producer
        self.boot_id = boot_id
        self.seq = 0

    def wrap(self, payload: Any, time_ns: int) -> Envelope:
        self.seq += 1
        return Envelope(
            event_id=f"{self.producer}:{self.boot_id}:{self.seq}",
            producer=self.producer,
            seq=self.seq,
            time_ns=time_ns,
            payload=payload,
        )


def json_schema() -> dict[str, Any]:
    """JSON Schema of the Envelope and every payload (for non-Python consumers)."""
    return msgspec.json.schema(Envelope)
