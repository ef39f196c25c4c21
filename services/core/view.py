"""The router's view of the fleet: a fold of worker registration and status events.

`WorkerView.apply(event, now_ns)` folds one event; `sync(now_ns, ...)` runs one liveness
cycle (the shell calls it every `liveness_sync_ms`). A worker whose `boot_id` changes has
restarted: its counters reset.

Liveness, per worker, kept across sync cycles (a missed-beat counter that restarted every
cycle would never reach N):
- pending: registered, no status report yet; gets no work.
- ready: reported during the last cycle; gets work.
- suspect: missed 1..N−1 consecutive cycles; still gets work (one late beat must not move
  load), shown as suspect.
- dead: missed N (`dead_after_missed_syncs`, default 3) consecutive cycles; gets no work; its requests are recovered
  by the shell (re-routed if not started, failed retryable if started).
- expired: no report for `expire_after_ms` (default 10,000): removed from the view (and by the
  scheduler from every other structure).
A report moves a pending, suspect or dead worker back to ready.
"state" (what the worker says: ready | draining | stopping) is separate from liveness.

Models (pools): each worker serves one model (`WorkerInfo.model`; a worker that reports none
serves `default_model`, the router's `model_name`). `routable(model)` partitions the live
workers of that model only, and lists the live workers of other models apart (the scheduler
shows them filtered by "model" on its score cards). `models_seen` is every model a worker
has ever reported to this view (never shrinks): a request for a model outside it (and not
the default) names no pool, while one inside it whose workers are all gone names an empty one.
The default names the pool of that name; but while no worker has reported it and every worker
has reported one same model (a torch or openai fleet of one model behind a router left at its
default name), it names that model's pool: a single-model fleet takes requests that name no
model, or the default, and `resolve_model` says which pool a name is.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from schemas.messages import EngineSignals, WorkerRegistered, WorkerStatusReported

LIVE_STATES = frozenset(("ready", "suspect"))  # liveness states that get new work


@dataclass(frozen=True)
class Routable:
    """Live workers by role (lists owned by the view: read, never mutate) and the smallest
    positive limits among them (0: none set): a request within both fits every one."""

    colocated: list["WorkerInfo"]
    prefill: list["WorkerInfo"]
    decode: list["WorkerInfo"]
    num_live: int
    min_seq_len_tokens: int
    min_batch_tokens: int
    other_models: list["WorkerInfo"] = field(default_factory=list)  # live workers serving another model


@dataclass
class WorkerInfo:
    worker_id: str
    role: str
    boot_id: str
    engine: str = "sim"
    model: str = ""  # the model it serves (the view's default_model when it reports none)
    lora_adapters: list[str] = field(default_factory=list)  # the LoRA adapters it can serve
    max_num_seqs: int = 0  # most sequences its engine runs at once (0: unknown)
    max_loras: int = 0  # adapters its engine holds loaded at once (0: unknown or none)
    loaded_lora_adapters: list[str] | None = None  # loaded now, least recently used first (None: unknown)
    pid: int = 0
    host: str = ""
    state: str = "ready"  # as the worker reports it: ready | not_ready | draining | stopping
    not_ready_reason: str = ""  # its one-line reason when state is not ready ("" if it gave none)
    # What it has from its engine (metrics flavour, liveness, token ids, KV events); None
    # until its first status (a worker before the field: EngineSignals() when read)
    signals: EngineSignals | None = None
    block_size_tokens: int = 16
    num_kv_blocks: int = 0
    num_free_kv_blocks: int = 0
    num_cached_kv_blocks: int = 0  # evictable: held only by the prefix cache, reclaimed on demand
    max_batch_tokens: int = 0
    max_seq_len_tokens: int = 0
    num_running_requests: int = 0
    num_queued_batches: int = 0
    recent_step_ms: float = 0.0  # its reported mean step time over the last second (the TPOT it gives now)
    time_scale: float = 1.0  # simulated engines: wall time = engine time x this (1.0 for real engines)
    first_seen_ns: int = 0
    last_heartbeat_ns: int = 0  # router's receive time of the last report
    num_restarts: int = 0
    liveness: str = "pending"  # pending | ready | suspect | dead (expired workers are removed)
    num_missed_syncs: int = 0  # consecutive sync cycles without a report (never reset by a cycle)
    heard_since_sync: bool = False
    draining: bool = False  # an operator drain flag (admin API, kept in Redis): no new work

    @property
    def num_allocatable_kv_blocks(self) -> int:
        """Blocks a new request can get: free ones plus those only the prefix cache holds
        (the engine evicts them on demand, as vLLM does; its usage gauge counts them free).
        Counting them as used made a decode worker look full once its cache had filled."""
        return self.num_free_kv_blocks + self.num_cached_kv_blocks

    def is_live(self) -> bool:
        """Eligible for new work: liveness ready or suspect (state folded by `sync`, not a clock
        comparison), reporting ready, not drained."""
        return self.liveness in LIVE_STATES and self.state == "ready" and not self.draining

    def serves_prefill(self) -> bool:
        return self.role in ("pd_fusion", "prefill")

    def serves_decode(self) -> bool:
        return self.role in ("pd_fusion", "decode")


class WorkerView:
    def __init__(self, default_model: str = "") -> None:
        self.default_model = default_model  # the model of a worker that reports none (module docstring)
        self.workers: dict[str, WorkerInfo] = {}  # worker id -> info
        self.roles_seen: set[str] = set()
        self.models_seen: set[str] = set()  # every model a worker ever reported here (never shrinks)
        self.drain_flags: set[str] = set()  # worker ids an operator drained (may not be known yet)
        # Bumped whenever who may get work, or what a request must fit, can have changed
        # (liveness, state, drain, role, limits, membership): keys the scheduler's cache of
        # routable workers. Every write of those fields goes through this class.
        self.routing_version = 0
        # model -> (routing_version, its partition); bounded: the scheduler asks only for known models
        self._routable: dict[str, tuple[int, Routable]] = {}

    def set_drain_flags(self, worker_ids: set[str]) -> None:
        """The operator's drain flags, as stored (Redis): applied to known and future workers."""
        self.drain_flags = set(worker_ids)
        for w in self.workers.values():
            w.draining = w.worker_id in self.drain_flags
        self.routing_version += 1

    def mark_dead(self, worker_id: str) -> None:
        """Take a worker out of routing now (the shell's recovery, before its re-routes)."""
        w = self.workers.get(worker_id)
        if w is not None:
            w.liveness = "dead"
            self.routing_version += 1

    def apply(self, event: WorkerRegistered | WorkerStatusReported, now_ns: int, stale: bool = False) -> WorkerInfo:
        """Fold one event heard at `now_ns`. `stale`: an old report replayed from the status
        stream (a restarted router reads the last one of every worker, dead ones included):
        it updates what we know but is no sign of life."""
        info = self.workers.get(event.worker_id)
        if info is None:
            info = WorkerInfo(worker_id=event.worker_id, role=event.role, boot_id=event.boot_id, first_seen_ns=now_ns,
                              draining=event.worker_id in self.drain_flags)
            self.workers[event.worker_id] = info
            before = None
        else:
            before = (info.role, info.state, info.liveness, info.max_seq_len_tokens, info.max_batch_tokens, info.model)
        if info.boot_id != event.boot_id:
            info.boot_id = event.boot_id
            info.num_restarts += 1
        info.role = event.role
        self.roles_seen.add(event.role)
        info.engine = event.engine
        info.model = event.model or self.default_model
        self.models_seen.add(info.model)
        info.lora_adapters = event.lora_adapters
        info.max_num_seqs = event.max_num_seqs
        info.max_loras = event.max_loras
        info.pid = event.pid
        info.host = event.host
        info.block_size_tokens = event.block_size_tokens
        info.max_batch_tokens = event.max_batch_tokens
        info.max_seq_len_tokens = event.max_seq_len_tokens
        if isinstance(event, WorkerStatusReported):
            info.state = event.state
            info.not_ready_reason = event.not_ready_reason
            info.signals = event.signals or EngineSignals()
            info.num_kv_blocks = event.num_kv_blocks
            info.num_free_kv_blocks = event.num_free_kv_blocks
            info.num_cached_kv_blocks = event.num_cached_kv_blocks
            info.num_running_requests = event.num_running_requests
            info.num_queued_batches = event.num_queued_batches
            info.recent_step_ms = event.recent_step_ms
            info.time_scale = event.time_scale if event.time_scale > 0 else 1.0
            info.loaded_lora_adapters = event.loaded_lora_adapters
            info.last_heartbeat_ns = max(info.last_heartbeat_ns, now_ns)
            if stale:
                if info.liveness == "pending":
                    info.liveness = "dead"
            else:
                info.heard_since_sync = True
                info.num_missed_syncs = 0
                info.liveness = "ready"
        else:
            info.num_kv_blocks = event.num_kv_blocks
        if before != (info.role, info.state, info.liveness, info.max_seq_len_tokens, info.max_batch_tokens, info.model):
            self.routing_version += 1
        return info

    def live(self) -> list[WorkerInfo]:
        """The workers `is_live` admits."""
        return [w for w in self.workers.values() if w.is_live()]

    def sync(self, now_ns: int, dead_after_missed: int, expire_ns: int) -> tuple[list[str], list[str]]:
        """One liveness cycle. Returns (workers that just became dead, workers that expired)."""
        newly_dead: list[str] = []
        expired: list[str] = []
        self.routing_version += 1  # (liveness moves here; one bump per cycle is cheap)
        for w in list(self.workers.values()):
            if w.heard_since_sync:
                w.heard_since_sync = False
                continue
            if w.liveness == "pending" and w.last_heartbeat_ns == 0:
                w.last_heartbeat_ns = w.first_seen_ns  # registered, never reported: expiry counts from then
            w.num_missed_syncs += 1
            if w.liveness in ("ready", "suspect", "pending"):
                if w.num_missed_syncs >= dead_after_missed:
                    if w.liveness != "pending":
                        newly_dead.append(w.worker_id)
                    w.liveness = "dead"
                elif w.liveness == "ready":
                    w.liveness = "suspect"
            if now_ns - w.last_heartbeat_ns >= expire_ns:
                expired.append(w.worker_id)
                del self.workers[w.worker_id]
        return newly_dead, expired

    def remove(self, worker_id: str) -> WorkerInfo | None:
        self.routing_version += 1
        return self.workers.pop(worker_id, None)

    def routable(self, model: str) -> "Routable":
        """The live workers serving `model` (a pool: resolve_model's) by role, with the smallest
        limits among them, and the live workers of other models apart (cached per routing_version)."""
        cached = self._routable.get(model)
        if cached is not None and cached[0] == self.routing_version:
            return cached[1]
        live, others = [], []
        for w in self.workers.values():
            if w.is_live():
                (live if w.model == model else others).append(w)
        r = Routable(
            colocated=[w for w in live if w.role == "pd_fusion"],
            prefill=[w for w in live if w.role == "prefill"],
            decode=[w for w in live if w.role == "decode"],
            num_live=len(live),
            min_seq_len_tokens=min((w.max_seq_len_tokens for w in live if w.max_seq_len_tokens > 0), default=0),
            min_batch_tokens=min((w.max_batch_tokens for w in live if w.role != "decode" and w.max_batch_tokens > 0),
                                 default=0),
            other_models=others,
        )
        self._routable[model] = (self.routing_version, r)
        return r

    def resolve_model(self, model: str) -> str:
        """The pool a request's `model` names ("" and the default: module docstring)."""
        model = model or self.default_model
        if model == self.default_model and len(self.models_seen) == 1 and model not in self.models_seen:
            return next(iter(self.models_seen))
        return model

    def is_known_model(self, model: str) -> bool:
        """A pool exists for `model` ("": the default): it is the default or a worker reported it."""
        return not model or model == self.default_model or model in self.models_seen

    def adapter_parent(self, name: str) -> str | None:
        """The model of a worker that serves LoRA adapter `name`; None if none does."""
        return next((w.model for w in self.workers.values() if name in w.lora_adapters), None)

    def pool_of(self, model: str) -> str | None:
        """The pool a request's `model` routes in: its model's (resolve_model), or for a LoRA
        adapter its parent's; None for a name no worker serves (and not the default)."""
        if self.is_known_model(model):
            return self.resolve_model(model)
        return self.adapter_parent(model)

    def models(self) -> dict[str, list[str]]:
        """Every model of the workers in the view, and the default, each with the LoRA adapters
        its workers have loaded (sorted, once each): what /v1/models lists."""
        out: dict[str, set[str]] = {self.default_model: set()} if self.default_model else {}
        for w in self.workers.values():
            out.setdefault(w.model, set()).update(w.lora_adapters)
        return {model: sorted(adapters) for model, adapters in sorted(out.items())}

    def roles_in_use(self) -> set[str]:
        """pd_fusion if colocated workers were seen; prefill+decode if either PD role was."""
        roles: set[str] = set()
        if "pd_fusion" in self.roles_seen:
            roles.add("pd_fusion")
        if self.roles_seen & {"prefill", "decode"}:
            roles |= {"prefill", "decode"}
        return roles

    def readiness(self) -> tuple[bool, str]:
        """Ready when every role in use has at least one live worker. The reason says why
        not in one line of at most READINESS_REASON_MAX chars: the roles without a live
        worker, then the workers of those roles with why each is not live (at most
        READINESS_WORKERS_SHOWN of them, each why cut at READINESS_WHY_MAX chars), e.g.
        "no live worker for role pd_fusion: w0 not_ready (engine server http://x unreachable:
        connection refused); w1 dead (no status for 3 liveness cycles)"."""
        roles = self.roles_in_use()
        if not roles:
            return False, "no worker has reported yet"
        live_roles = {w.role for w in self.live()}
        missing = sorted(roles - live_roles)
        if not missing:
            return True, "ok"
        reason = "no live worker for role " + ", ".join(missing)
        idle = sorted((w for w in self.workers.values() if w.role in missing), key=lambda w: w.worker_id)
        if idle:
            shown = [f"{w.worker_id} {_why_not_live(w)}" for w in idle[:READINESS_WORKERS_SHOWN]]
            if len(idle) > READINESS_WORKERS_SHOWN:
                shown.append(f"{len(idle) - READINESS_WORKERS_SHOWN} more")
            reason += ": " + "; ".join(shown)
        return False, _one_line(reason, READINESS_REASON_MAX)


READINESS_REASON_MAX = 600  # chars of /readyz's not-ready reason (one line: logs and `flexlb up` print it)
READINESS_WORKERS_SHOWN = 4  # workers named in it; the rest are counted
READINESS_WHY_MAX = 160  # chars of one worker's own reason in it


def _one_line(text: str, max_chars: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= max_chars else text[: max_chars - 3] + "..."


def _why_not_live(w: WorkerInfo) -> str:
    """Why a worker gets no work, in a few words (the readiness reason's part for it)."""
    if w.liveness == "pending":
        return "registered, no status report yet"
    if w.liveness == "dead":
        return f"dead (no status for {w.num_missed_syncs} liveness cycles)"
    if w.state != "ready":
        why = _one_line(w.not_ready_reason, READINESS_WHY_MAX) if w.not_ready_reason else ""
        return f"{w.state} ({why})" if why else w.state
    if w.draining:
        return "drained by an operator"
    return w.liveness
