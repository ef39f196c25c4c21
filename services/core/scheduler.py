"""Admission, routing and batching: the decisions of the router, as pure functions of state.

Flow of one request (all in `admit`):
1. validate against limits (`too_large` when the prompt exceeds the router limit or every
   worker's max sequence length);
2. `queue_full` when the global inflight cap or the chosen worker's queue bound is reached;
3. pick the decode worker (decode policy over live decode-capable workers), then the
   prefill worker (prefill policy over live prefill-capable workers); in colocated mode
   (pd_fusion) one pick serves both; `no_worker` when a role has no live candidate;
4. record the picks (only now: a rejected request leaves the policies untouched) and queue
   the request in the prefill worker's batcher.

`tick(now_ns)` closes due batches and returns them with ids `<id_prefix>-<n>`; the caller
passes a prefix unique per router process, so batch ids never repeat across restarts (they
are JetStream dedupe ids).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from schemas.messages import WorkerRegistered, WorkerStatusReported
from services.core.batcher import FixedWindowBatcher, FixedWindowParams
from services.core.policies import Pick, RouteContext, RoutingPolicy
from services.core.view import WorkerView


@dataclass(frozen=True)
class SchedulerConfig:
    max_prompt_tokens: int = 32768
    max_queue_per_worker: int = 1024
    max_inflight_requests: int = 100_000
    worker_timeout_ms: int = 1000
    batcher: FixedWindowParams = field(default_factory=FixedWindowParams)


@dataclass
class QueuedRequest:
    """A request admitted and waiting in a batcher. Field names match `Batchable`."""

    request_id: str
    num_prompt_tokens: int
    max_tokens: int
    enqueued_ns: int
    prefill_worker_id: str
    decode_worker_id: str
    payload: object = None  # the shell's request handle; the core never looks inside


@dataclass(frozen=True)
class Admitted:
    request: QueuedRequest
    prefill_pick: Pick
    decode_pick: Pick
    policy: str


@dataclass(frozen=True)
class Rejected:
    code: str
    message: str


@dataclass(frozen=True)
class FormedBatch:
    batch_id: str
    worker_id: str
    items: list[QueuedRequest]
    reason: str

    @property
    def num_prompt_tokens(self) -> int:
        return sum(i.num_prompt_tokens for i in self.items)


class Scheduler:
    def __init__(self, config: SchedulerConfig, prefill_policy: RoutingPolicy, decode_policy: RoutingPolicy, id_prefix: str) -> None:
        self.config = config
        self.prefill_policy = prefill_policy
        self.decode_policy = decode_policy
        self.id_prefix = id_prefix
        self.view = WorkerView()
        self.batchers: dict[str, FixedWindowBatcher[QueuedRequest]] = {}  # prefill worker id -> batcher
        self.inflight: set[str] = set()  # admitted request ids without a terminal outcome
        self.num_batches = 0

    @property
    def timeout_ns(self) -> int:
        return self.config.worker_timeout_ms * 1_000_000

    def on_worker_event(self, event: WorkerRegistered | WorkerStatusReported, now_ns: int) -> None:
        info = self.view.apply(event, now_ns)
        batcher = self.batchers.get(info.worker_id)
        if batcher is not None:
            batcher.max_batch_tokens = max(1, info.max_batch_tokens)

    def admit(
        self, request_id: str, num_prompt_tokens: int, max_tokens: int, now_ns: int, rng: random.Random,
        block_hashes: tuple[int, ...] = (), payload: object = None,
    ) -> Admitted | Rejected:
        cfg = self.config
        if request_id in self.inflight:
            return Rejected("duplicate_request", f"request {request_id} is already in flight")
        if num_prompt_tokens > cfg.max_prompt_tokens:
            return Rejected("too_large", f"prompt of {num_prompt_tokens} tokens exceeds the limit of {cfg.max_prompt_tokens}")
        if len(self.inflight) >= cfg.max_inflight_requests:
            return Rejected("queue_full", f"global inflight cap of {cfg.max_inflight_requests} reached")
        live = self.view.live(now_ns, self.timeout_ns)
        fitting = [w for w in live if w.max_seq_len_tokens <= 0 or num_prompt_tokens + max_tokens <= w.max_seq_len_tokens]
        if live and not fitting:
            return Rejected("too_large", f"{num_prompt_tokens}+{max_tokens} tokens exceed every live worker's max sequence length")
        colocated = [w for w in fitting if w.role == "pd_fusion"]
        decode_c = [w for w in fitting if w.role == "decode"]
        prefill_c = [w for w in fitting if w.role == "prefill"]

        def ctx(cands):
            return RouteContext(request_id, num_prompt_tokens, max_tokens, cands, now_ns, rng, block_hashes)

        if decode_c and prefill_c:
            decode_pick = self.decode_policy.select(ctx(decode_c))
            prefill_pick = self.prefill_policy.select(ctx([w for w in prefill_c if self._has_room(w.worker_id)]))
            policy = f"{self.prefill_policy.name}/{self.decode_policy.name}"
        elif colocated:
            prefill_pick = self.prefill_policy.select(ctx([w for w in colocated if self._has_room(w.worker_id)]))
            decode_pick = prefill_pick
            policy = self.prefill_policy.name
        else:
            return Rejected("no_worker", "no live worker can serve this request")
        if prefill_pick is None:
            return Rejected("queue_full", f"every prefill worker's queue holds {cfg.max_queue_per_worker} requests")
        if decode_pick is None:
            return Rejected("no_worker", "no live decode worker")
        self.prefill_policy.record(prefill_pick)
        if decode_pick is not prefill_pick:
            self.decode_policy.record(decode_pick)
        item = QueuedRequest(
            request_id=request_id, num_prompt_tokens=num_prompt_tokens, max_tokens=max_tokens, enqueued_ns=now_ns,
            prefill_worker_id=prefill_pick.worker_id, decode_worker_id=decode_pick.worker_id, payload=payload,
        )
        self._batcher(prefill_pick.worker_id).add(item)
        self.inflight.add(request_id)
        return Admitted(item, prefill_pick, decode_pick, policy)

    def _has_room(self, worker_id: str) -> bool:
        b = self.batchers.get(worker_id)
        return b is None or len(b) < self.config.max_queue_per_worker

    def _batcher(self, worker_id: str) -> FixedWindowBatcher[QueuedRequest]:
        b = self.batchers.get(worker_id)
        if b is None:
            info = self.view.workers.get(worker_id)
            b = FixedWindowBatcher(self.config.batcher, max(1, info.max_batch_tokens if info else 1 << 30))
            self.batchers[worker_id] = b
        return b

    def tick(self, now_ns: int) -> list[FormedBatch]:
        out: list[FormedBatch] = []
        for worker_id, batcher in self.batchers.items():
            for closed in batcher.poll(now_ns):
                self.num_batches += 1
                out.append(FormedBatch(f"{self.id_prefix}-{self.num_batches}", worker_id, closed.items, closed.reason))
        return out

    def next_due_ns(self) -> int | None:
        dues = [d for b in self.batchers.values() if (d := b.next_due_ns()) is not None]
        return min(dues) if dues else None

    def on_terminal(self, request_id: str) -> bool:
        """Forget a request that reached its terminal outcome; False if it was not inflight."""
        if request_id in self.inflight:
            self.inflight.discard(request_id)
            return True
        return False

    def drain_queues(self) -> list[QueuedRequest]:
        items = [i for b in self.batchers.values() for i in b.drain()]
        for i in items:
            self.inflight.discard(i.request_id)
        return items
