"""Admission, routing and batching: the router's decisions as pure functions of its state.

State (all folded from events and the router's own decisions; nothing read from a clock):
the worker view, the prefix index (exact from KV events, or approximate from decisions),
one prefill-time predictor and one batcher per prefill worker, the inflight mirror of the
ledger, the hysteresis gates, and the set of admitted requests without a terminal outcome.

One request (`admit`):
1. limits: `duplicate_request`, `too_large` (router limit, or beyond every live worker's
   max sequence length, or a prompt longer than every prefill worker's `max_batch_tokens`:
   rejected at arrival rather than failed after queueing), `queue_full` (global cap);
   `model_not_found` (the request names a model no worker has reported and not the
   default `model_name`), `no_worker` (none of that model's workers is live);
2. candidates: live workers of the request's model (its pool: `model`, "" for the default)
   of each role, each scored with its prefix hit, predicted
   prefill, inflight wait, batcher-queue wait, pending count and KV (services/core/policies/);
3. disaggregated: the decode policy picks first (it reserves KV), then the prefill policy;
   colocated (pd_fusion): the prefill policy picks the one worker; `no_worker` when a role
   has no candidate, `queue_full` when every prefill worker's batcher is at its bound;
4. SLO: TTFT/TPOT targets from buckets × priority (slo.py). The predicted TTFT is the
   chosen worker's wait + queue + prefill; if even the best candidate cannot meet the TTFT
   target, the SLO mode decides (slo.py): `slo_unattainable`, or admitted as best-effort;
5. commit: policies record their picks, the decode KV is reserved in the mirror, the
   approximate index (if used) learns the prompt's blocks, and the request joins the
   prefill worker's batcher. Every decision is returned as data (`RouteDecision`).

Randomness: decision n draws from `DecisionRng(decision_seed(seed, n))`, so a replay of
the same inputs re-draws the same numbers; the seed is recorded in the decision.

`tick(now_ns)` polls the batchers; closed batches enter the inflight mirror and are returned
with ids `<id_prefix>-<n>` (the caller passes a prefix unique per router process: batch ids
are JetStream dedupe ids); expired and too-large queue items are returned as failures and
forgotten. A request the slo-budget batcher's TPOT hold kept on its worker up to its
emergency point is refused only when no worker could serve it (`_resolve_held`): moved to a
worker that can start it in time without holding it (`TickResult.moves`, a "move" decision),
else served on its worker if its calibrated TPOT there is within `tpot_refuse_ratio` x its
target and its recently finished requests got TPOT within `give_way_tpot_ratio` x it (the batcher's own
defaults 0: never, not checked; the router ships 1.2 and 0.9, services/settings.py), or if it is
cheap there (`give_way_prefill_ratio`, `give_way_cheap_tpot_ratio`: its prefill a short stall for
the running decodes, its own TPOT within its target), else refused slo_unattainable with the
best worker's predicted TTFT and TPOT (the journal keeps them).
The TPOT the hold and that test read is each worker's decode step calibrated by what its
finished requests actually got (`on_terminal(..., tpot_ms)`; decode_model.py).
`next_due_ns(now_ns)` says when to tick next (None: on the next event).
Block size: the router hashes prompts with one block size, that of the fleet (workers must
agree; the first worker's is used).

Parameters: `SchedulerConfig`, each field with its default and meaning below. The records the
scheduler takes and returns are in records.py, the pending-prefix index in pending_prefixes.py.
Size: this module is one class, the state machine above (about 600 lines). Its methods read
and fold the same state, and the scoring loop (`_prefill_candidates`) inlines the ledger's,
batcher's and predictor's rules for speed (bench/CORE.md), so splitting it would scatter
one invariant over modules without making any part independent.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from schemas.messages import (
    KvAllCleared,
    KvBlocksRemoved,
    KvBlocksStored,
    KvSnapshot,
    WorkerRegistered,
    WorkerStatusReported,
)
from services.core.admission import FairAdmission, FairAdmissionConfig, Released
from services.core.batchers import DEFAULT_BATCHER, Batcher, Closed, WorkerLoad, build_batcher, parse_params
from services.core.batchers.base import tpot_added_ms
from services.core.breaker import BreakerChange, BreakerParams, Breakers
from services.core.decode_model import DecodeCoefficients, DecodeModel, DecodeModelParams
from services.core.fairness import Cancelled, Queued, Refused
from services.core.inflight import DecodeReservation, InflightBatch, InflightLedger, WorkerInflight
from services.core.lora import AdapterWorker, LoraParams, touch
from services.core.lora import pick as lora_pick
from services.core.pending_prefixes import PendingPrefixes
from services.core.policies import Candidate, RouteContext, RoutingPolicy, build_policy
from services.core.policies.protocol import Pick, Score
from services.core.predictor import PredictorParams, PrefillCoefficients, PrefillPredictor
from services.core.prefix_index import ApproximatePrefixIndex, IndexUpdate, PrefixIndex
from services.core.records import (  # (re-exported: the shell, the journal and tests import them from here)
    AdmitRequest,
    Admitted,
    FormedBatch,
    Moved,
    QueuedRequest,
    QueueFailure,
    Rejected,
    RouteDecision,
    SyncResult,
    TickResult,
)
from services.core.seeded import decision_seed
from services.core.slo import SloParams, slo_targets
from services.core.view import WorkerInfo, WorkerView

INDEX_EXPIRY_INTERVAL_NS = 1_000_000_000
# The router's guess of a worker's loaded adapters outranks the worker's report for this long
# after it routed an adapter there: a few heartbeats (200 ms each by default) plus a batch
# window, by when the report includes what was routed (_lora_decide).
LORA_GUESS_NS = 2_000_000_000  # sweep expired approximate-index entries once a second
DEGRADED_RATIO = 2.0  # a worker whose decode step is this many times its peers' median is reported degraded
DEGRADED_REFERENCE = (8, 8 * 2048)  # (running requests, KV tokens): the load step_ratios compares at
DEGRADED_MIN_OBSERVATIONS = 20  # status reports a decode model learns from before step_ratios compares it


@dataclass(frozen=True)
class SchedulerConfig:
    max_prompt_tokens: int = 32768
    max_queue_per_worker: int = 1024
    max_inflight_requests: int = 100_000
    prefill_policy: str = "cost-based"
    prefill_policy_params: dict[str, Any] = field(default_factory=dict)
    decode_policy: str = "kv-aware"
    decode_policy_params: dict[str, Any] = field(default_factory=dict)
    batcher: str = DEFAULT_BATCHER
    batcher_params: dict[str, Any] = field(default_factory=dict)
    predictor_coefficients: PrefillCoefficients = field(default_factory=PrefillCoefficients)
    predictor_params: PredictorParams = field(default_factory=PredictorParams)
    decode_coefficients: DecodeCoefficients = field(default_factory=DecodeCoefficients)  # the decode model's prior
    decode_model_params: DecodeModelParams = field(default_factory=DecodeModelParams)
    slo: SloParams = field(default_factory=SloParams)
    prefix_index: str = "exact"  # "exact" (KV events) | "approximate" (learned from decisions)
    approx_index_ttl_ms: float = 120_000.0
    # exact mode: a routed prompt counts as cached on its worker for this long (0.9–1.0 of it),
    # until the worker's KV events confirm it; 0 disables (services/core/pending_prefixes.py).
    pending_prefix_ttl_ms: float = 30_000.0
    dead_after_missed_syncs: int = 3  # liveness: dead after this many sync cycles without a report
    settle_after_missed_reports: int = 2  # calibration: a running request missing from this many reports is settled
    expire_after_ms: int = 10_000  # liveness: removed everywhere after this long without a report
    seed: int = 0
    # The router's default model (its `model_name`): the pool of requests that name no model
    # and of workers that report none. (A journal recorded before this field replays with
    # the default: its workers and requests named none, so every worker stays a candidate.)
    model_name: str = "flexlb-sim"
    # The fair queue under overload (services/core/admission.py): `offer` and `release` use
    # it; `admit` alone (replays of journals recorded before it, what-if) never does.
    fairness: FairAdmissionConfig = field(default_factory=FairAdmissionConfig)
    # Per-worker circuit breakers (services/core/breaker.py). (A journal recorded before them
    # replays with the defaults: it has no on_outcome call, so every breaker stays closed.)
    breaker: BreakerParams = field(default_factory=BreakerParams)
    # A prefill batch whose members all ended before its prefill was reported (they failed
    # fast, were cancelled or moved: the worker reports no prefill for them) leaves its worker's
    # inflight mirror then (inflight.py member_ended); kept, it held the worker under
    # backpressure for good. False: kept until the worker is gone, as journals recorded before
    # this field did (they replay as recorded); the router sets True (services/settings.py).
    end_unprefilled_batches: bool = False

    def validate(self) -> "SchedulerConfig":
        if self.prefix_index not in ("exact", "approximate"):
            raise ValueError(f"prefix_index must be exact or approximate, got {self.prefix_index!r}")
        for name in ("max_prompt_tokens", "max_queue_per_worker", "max_inflight_requests", "dead_after_missed_syncs", "expire_after_ms",
                     "settle_after_missed_reports"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        build_policy("prefill", self.prefill_policy, self.prefill_policy_params)
        build_policy("decode", self.decode_policy, self.decode_policy_params)
        build_batcher(self.batcher, self.batcher_params, lambda items: 0.0)
        self.slo.validate()
        self.breaker.validate()
        return self


class Scheduler:
    def __init__(self, config: SchedulerConfig, id_prefix: str) -> None:
        self.config = config.validate()
        self.id_prefix = id_prefix
        self.prefill_policy: RoutingPolicy = build_policy("prefill", config.prefill_policy, config.prefill_policy_params)
        self.decode_policy: RoutingPolicy = build_policy("decode", config.decode_policy, config.decode_policy_params)
        # The gates and the expected decode KV are the policies' parameters, read here where they
        # act (the scheduler keeps the gate state): the prefill gate is cost-based's
        # (pending_gate_high, pending_gate_hysteresis), the decode gate and the expected output
        # are kv-aware's (max_kv_usage, kv_usage_hysteresis, expected_output_cap). A policy that
        # has no gate reads no `gated` flag, so none is computed for it (inf: never closes).
        pp, dp = self.prefill_policy.params, self.decode_policy.params
        self.pending_gate_high, self.pending_gate_hysteresis = pp.pending_gate()
        self.max_kv_usage, self.kv_usage_hysteresis = dp.kv_gate()
        self.expected_output_cap_tokens: int = dp.expected_output_cap_tokens()
        # The batcher's TPOT hold (slo-budget's; fixed-window has none): the policy may leave
        # out workers that would only hold a request for it; _resolve_held and load read the rest.
        hold = parse_params(config.batcher, config.batcher_params).hold()
        self.tpot_headroom: float = hold.tpot_headroom
        self.hold_guard_ms: float = hold.guard_ms  # a moved request's TTFT margin
        self.tpot_refuse_ratio: float = hold.tpot_refuse_ratio  # (_resolve_held)
        self.give_way_tpot_ratio: float = hold.give_way_tpot_ratio  # (_resolve_held)
        self.give_way_prefill_ratio: float = hold.give_way_prefill_ratio  # (_resolve_held)
        self.give_way_cheap_tpot_ratio: float = hold.give_way_cheap_tpot_ratio
        self.stall_hold: float = hold.stall_hold  # (load: its stall limits)
        self.view = WorkerView(config.model_name)
        self.index = PrefixIndex()
        self.approx_index = ApproximatePrefixIndex(ttl_ms=config.approx_index_ttl_ms)
        self.pending_index = PendingPrefixes(ttl_ms=config.pending_prefix_ttl_ms)
        self.ledger = InflightLedger()
        self.predictors: dict[str, PrefillPredictor] = {}  # prefill worker id -> its predictor
        self.decode_models: dict[str, DecodeModel] = {}  # worker id -> its decode-step model (decode_model.py)
        # request id -> (its decode worker, the step ms predicted there when its batch formed), until it ends
        self.tpot_predicted: dict[str, tuple[str, float]] = {}
        self.batchers: dict[str, Batcher] = {}  # prefill worker id -> its batcher
        self.prefill_gated: set[str] = set()  # workers whose pending count closed the gate
        self.decode_gated: set[str] = set()  # workers whose KV usage closed the gate
        self.inflight: set[str] = set()  # admitted request ids without a terminal outcome
        self._slots: dict[str, tuple[Batcher, Mapping[int, QueuedRequest], WorkerInflight, PrefillPredictor, float | None]] = {}  # see _slot
        self.queued: dict[str, tuple[str, int]] = {}  # request id -> (prefill worker, batcher seq) while queued here
        self.num_batches = 0
        self.decision_seq = 0
        self.last_expiry_ns = 0  # when the approximate indexes were last swept
        self.settled: list[tuple[str, str]] = []  # see take_settled
        self.poll_errors: list[str] = []  # batcher polls that raised, for the shell to log and count
        self.fair = FairAdmission(config.fairness)  # the queue that holds work under overload (admission.py)
        self.breakers = Breakers(config.breaker)  # per-worker circuit breakers (breaker.py; on_outcome)
        self.lora_params = LoraParams()
        # worker id -> (the LoRA adapters the router routed there, least recently used first, when
        # it last did): its guess, ahead of the worker's reports for LORA_GUESS_NS (_lora_decide)
        self.lora_loaded: dict[str, tuple[tuple[str, ...], int]] = {}

    # ---------------------------------------------------------------- inputs
    def on_worker_event(self, event: WorkerRegistered | WorkerStatusReported, now_ns: int, stale: bool = False) -> WorkerInfo:
        info = self.view.apply(event, now_ns, stale)
        if isinstance(event, WorkerStatusReported) and not stale:
            if info.role != "prefill":
                used_blocks = event.num_kv_blocks - event.num_free_kv_blocks - event.num_cached_kv_blocks
                self.decode_model(event.worker_id).observe(event.num_running_requests,
                                                           max(0, used_blocks) * event.block_size_tokens,
                                                           event.recent_step_ms)
            for r in self.ledger.calibrate(event.worker_id, event.running_request_ids, self.config.settle_after_missed_reports):
                self.settled.append((event.worker_id, r.request_id))
        return info

    def take_settled(self) -> list[tuple[str, str]]:
        """(worker id, request id) of requests calibration settled since the last call: the
        worker stopped reporting them and no terminal event came. Their reservations are
        released; the shell ends each request (and its Redis ledger entry)."""
        out, self.settled = self.settled, []
        return out

    def sync(self, now_ns: int) -> "SyncResult":
        """One liveness cycle. Dead workers get no new work, and the requests queued for them
        at the router come back for re-routing; expired workers are removed from every
        structure (view, batcher, prefix indexes, inflight mirror, predictor, gates), so nothing
        grows without bound."""
        dead, expired = self.view.sync(now_ns, self.config.dead_after_missed_syncs, self.config.expire_after_ms * 1_000_000)
        orphans: list[QueuedRequest] = []
        for worker_id in dead + expired:
            batcher = self.batchers.get(worker_id)
            if batcher is not None:
                orphans.extend(batcher.drain())
        for worker_id in expired:
            self.remove_worker(worker_id)  # (its batcher was drained above)
        for item in orphans:
            self.on_terminal(item.request_id)  # forgotten here; the shell re-admits or fails it
        return SyncResult(dead, expired, orphans)

    def holds_work(self, worker_id: str) -> int:
        """Requests the worker holds or will hold: queued here, inflight, or reported running."""
        info = self.view.workers.get(worker_id)
        batcher = self.batchers.get(worker_id)
        queued = len(batcher) if batcher else 0
        inflight = self.ledger.workers.get(worker_id)
        if inflight is None:
            return queued + (info.num_running_requests + info.num_queued_batches if info else 0)
        # Each request once (see WorkerInflight.num_requests), plus batches it reports queued.
        return inflight.num_requests(queued, info.num_running_requests if info else 0,
                                     info is not None and info.role == "pd_fusion") + (info.num_queued_batches if info else 0)

    def remove_worker(self, worker_id: str) -> list[QueuedRequest]:
        """Forget a worker everywhere (operator removal or expiry); returns its queued requests."""
        self._slots.pop(worker_id, None)
        batcher = self.batchers.pop(worker_id, None)
        orphans = batcher.drain() if batcher is not None else []
        self.view.remove(worker_id)
        self.predictors.pop(worker_id, None)
        self.decode_models.pop(worker_id, None)
        self.index.remove_worker(worker_id)
        self.pending_index.remove_worker(worker_id)
        self.approx_index.remove_worker(worker_id)
        self.ledger.remove_worker(worker_id)
        self.prefill_gated.discard(worker_id)
        self.decode_gated.discard(worker_id)
        self.lora_loaded.pop(worker_id, None)
        for item in orphans:
            self.on_terminal(item.request_id)
        return orphans

    def on_kv_event(self, event: KvBlocksStored | KvBlocksRemoved | KvAllCleared | KvSnapshot) -> IndexUpdate:
        return self.index.apply(event)

    def on_batch_started(self, worker_id: str, batch_id: str, now_ns: int) -> bool:
        return self.ledger.start_batch(worker_id, batch_id, now_ns)

    def on_prefill_completed(self, worker_id: str, batch_id: str, measured_ms: float, num_cached_tokens: int) -> InflightBatch | None:
        """Retire the batch and teach the worker's predictor its measured time.

        Per-request cache hits are not reported, only the batch total: the predicted hits are
        scaled to that total (in proportion to prompt length when none was predicted)."""
        batch = self.ledger.complete_batch(worker_id, batch_id)
        if batch is None:
            return None
        first_token_ns = (batch.started_ns if batch.started_ns is not None else batch.dispatched_ns) + round(measured_ms * 1e6)
        for rid in batch.request_ids:
            r = self.ledger.reservation(rid)
            if r is not None and r.first_token_ns is None:
                r.first_token_ns = first_token_ns
        predictor = self.predictors.get(worker_id)
        if predictor is not None and batch.members:
            predicted = sum(c for _, c in batch.members)
            if predicted > 0:
                scale = num_cached_tokens / predicted
                members = [(n, min(n, round(c * scale))) for n, c in batch.members]
            else:
                total = sum(n for n, _ in batch.members) or 1
                members = [(n, min(n, round(num_cached_tokens * n / total))) for n, _ in batch.members]
            predictor.observe(members, measured_ms)
            batcher = self.batchers.get(worker_id)
            if batcher is not None:
                batcher.invalidate()  # its cached queue-wait predictions are stale now
        return batch

    def on_terminal(self, request_id: str, num_output_tokens: int | None = None, tpot_ms: float | None = None) -> bool:
        """Forget a request that reached its terminal outcome; False if it was not inflight.
        `num_output_tokens`: what it produced, if known: settles its tenant's fair-queue charge.
        `tpot_ms`: the TPOT it got (wall ms between its first and last token over its tokens
        after the first; a finished request of 2 tokens or more): its decode worker's TPOT
        calibration learns from it (decode_model.py)."""
        predicted = self.tpot_predicted.pop(request_id, None)
        if predicted is not None and tpot_ms is not None:
            model = self.decode_models.get(predicted[0])
            info = self.view.workers.get(predicted[0])
            if model is not None:
                got = tpot_ms / (info.time_scale if info is not None else 1.0)
                model.observe_tpot(predicted[1], got)
                if info is not None and self.config.decode_model_params.tpot_calibration_scope == "pool":
                    for w in self.view.workers.values():  # (its pool: same model and role)
                        other = self.decode_models.get(w.worker_id) if w.worker_id != info.worker_id else None
                        if other is not None and w.model == info.model and w.role == info.role:
                            other.observe_tpot(predicted[1], got, own=False)
        if self.fair.dispatched:
            self.fair.settle(request_id, num_output_tokens)
        if self.breakers.num_not_closed:
            self.breakers.ended(request_id)  # (a probe whose worker reported no outcome)
        if self.config.end_unprefilled_batches:
            gone = self.ledger.member_ended(request_id)  # (its batch, once every member ended unprefilled)
            if gone is not None and gone.worker_id in self.batchers:
                self.batchers[gone.worker_id].invalidate()
        self.ledger.release(request_id)
        self.queued.pop(request_id, None)
        if request_id in self.inflight:
            self.inflight.discard(request_id)
            return True
        return False

    def on_outcome(self, request_id: str, worker_id: str, ok: bool, code: str, message: str, now_ns: int) -> BreakerChange | None:
        """What a worker reported of a request it ran (finished: `ok`; else failed with `code`),
        for its circuit breaker (breaker.py); call it before `on_terminal`. Returns the
        transition, if any (also kept in `breakers.changes`)."""
        info = self.view.workers.get(worker_id)
        others_closed = True
        if not ok and info is not None:
            r = self.view.routable(info.model)
            others_closed = any(w.worker_id != worker_id and w.role == info.role and self.breakers.is_closed(w.worker_id)
                                for w in (*r.colocated, *r.prefill, *r.decode))
        return self.breakers.outcome(worker_id, request_id, ok, code, message, now_ns, others_closed)

    def step_ratios(self) -> dict[str, float]:
        """Each live colocated or decode worker's learned decode step at a reference load
        (DEGRADED_REFERENCE) over the median of its pool's other such workers' (same model and
        role), once both have learned from DEGRADED_MIN_OBSERVATIONS reports: a worker running
        slower than its peers (thermal throttling, a noisy neighbour) shows a ratio well above 1,
        and back near 1 once its steps are (the model weighs recent reports most). A pool of one
        has no ratio. A read: nothing changes."""
        running, kv = DEGRADED_REFERENCE
        steps: dict[tuple[str, str], dict[str, float]] = {}
        for w in self.view.workers.values():
            model = self.decode_models.get(w.worker_id) if w.role != "prefill" and w.is_live() else None
            if model is not None and model.num_observations >= DEGRADED_MIN_OBSERVATIONS:
                steps.setdefault((w.model, w.role), {})[w.worker_id] = model.predict_ms(running, kv) * w.time_scale
        out: dict[str, float] = {}
        for group in steps.values():
            for wid, ms in group.items():
                others = sorted(v for k, v in group.items() if k != wid)
                if others:
                    mid = len(others) // 2
                    median = others[mid] if len(others) % 2 else (others[mid - 1] + others[mid]) / 2
                    out[wid] = round(ms / median, 3) if median > 0 else 1.0
        return out

    # ---------------------------------------------------------------- helpers
    def predictor(self, worker_id: str) -> PrefillPredictor:
        p = self.predictors.get(worker_id)
        if p is None:
            p = self.predictors[worker_id] = PrefillPredictor(self.config.predictor_coefficients, self.config.predictor_params)
        return p

    def decode_model(self, worker_id: str) -> DecodeModel:
        d = self.decode_models.get(worker_id)
        if d is None:
            d = self.decode_models[worker_id] = DecodeModel(self.config.decode_coefficients, self.config.decode_model_params)
        return d

    def engine_load(self, worker_id: str) -> tuple[int, int]:
        """(requests, KV tokens) the worker runs or has been sent: its report, plus what we
        dispatched that it does not show yet."""
        info = self.view.workers.get(worker_id)
        if info is None:
            return 0, 0
        inf = self.ledger.workers.get(worker_id)
        batcher = self.batchers.get(worker_id)
        used = max(0, info.num_kv_blocks - info.num_allocatable_kv_blocks) * info.block_size_tokens
        if inf is None:
            return info.num_running_requests, used
        queued = batcher.items_view.values() if batcher is not None and info.role == "pd_fusion" else ()
        # Reservations are made at admission: those still queued here are not on the worker.
        hidden = len(inf.reservations) - len(queued) - inf.num_visible
        hidden_kv = inf.hidden_hard_kv_tokens - sum(item.kv_tokens for item in queued)
        running = info.num_running_requests + (hidden if hidden > 0 else 0)
        return running, used + (hidden_kv if hidden_kv > 0 else 0)

    def batcher(self, worker_id: str) -> Batcher:
        b = self.batchers.get(worker_id)
        if b is None:
            predictor = self.predictor(worker_id)

            b = self.batchers[worker_id] = build_batcher(self.config.batcher, self.config.batcher_params,
                                                         predictor.predict_items_ms)
        return b

    def _slot(self, worker_id: str) -> tuple[Batcher, Mapping[int, QueuedRequest], WorkerInflight, PrefillPredictor,
                                             float | None]:
        """The worker's batcher (with its queue and empty-queue window), inflight entry and
        predictor in one lookup (the routing hot path); dropped with the worker in
        remove_worker, which is the only place any of the three is removed."""
        batcher = self.batcher(worker_id)
        slot = self._slots[worker_id] = (batcher, batcher.items_view, self.ledger.worker(worker_id), self.predictor(worker_id),
                                         batcher.empty_queue_window_ms)
        return slot

    def load(self, worker_id: str, now_ns: int) -> WorkerLoad:
        info = self.view.workers.get(worker_id)
        bs = info.block_size_tokens if info else 16
        hard, _ = self.ledger.hidden_kv(worker_id)
        # Unknown KV (no report yet) must not shrink batches to one request: treat as unbounded
        # (_prefill_candidates inlines the same rule).
        free_kv = (info.num_allocatable_kv_blocks * bs - hard) if info and info.num_kv_blocks else 1 << 40
        tpot = per_request = per_kilotoken = 0.0
        stall_limits: tuple[tuple[float, float], ...] = ()
        if info is not None and info.role != "prefill":
            running, kv = self.engine_load(worker_id)
            if running > 0:  # an idle worker always takes work
                model = self.decode_model(worker_id)
                slope = model.tpot_slope  # (calibrated: the TPOT its requests got against the prediction)
                tpot, per_request, per_kilotoken = model.predict_tpot_ms(running, kv), model.b * slope, model.c * slope
                if self.stall_hold > 0:
                    stall_limits = self._stall_limits(worker_id, tpot, now_ns)
        return WorkerLoad(
            max_batch_tokens=info.max_batch_tokens if info else 0,
            free_kv_tokens=max(0, free_kv),
            num_inflight_batches=self.ledger.num_inflight_batches(worker_id),
            wait_ms=self.ledger.wait_ms(worker_id, now_ns),
            tpot_ms=tpot, tpot_ms_per_request=per_request, tpot_ms_per_kilotoken=per_kilotoken,
            stall_limits=stall_limits,
        )

    def _stall_limits(self, worker_id: str, tpot_ms: float, now_ns: int) -> tuple[tuple[float, float], ...]:
        """What a prefill stall on the worker now costs its decoding requests: for each one
        that has its first token and a TPOT target, (the stall it can absorb, ms until it
        finishes). A request expected to produce N tokens at the worker's predicted TPOT t
        has (target - t) x (N - 1) ms of its TPOT budget to spare, whole until its last
        token; it has produced about (now - first token) / t of them."""
        out = []
        for r in self.ledger.worker(worker_id).reservations.values():
            first = r.first_token_ns
            n = r.expected_kv_tokens - r.hard_kv_tokens  # its expected output: min(max_tokens, the cap)
            if first is None or n < 2 or r.tpot_target_ms <= 0:
                continue
            left_ms = (n - 1) * tpot_ms - (now_ns - first) / 1e6
            if left_ms > 0:
                out.append((max(0.0, (r.tpot_target_ms - tpot_ms) * (n - 1)), left_ms))
        return tuple(out)

    def block_size_tokens(self) -> int:
        return next((w.block_size_tokens for w in self.view.workers.values()), 16)

    def _matches(self, block_hashes: tuple[int, ...], now_ns: int) -> dict[str, int]:
        if not block_hashes:
            return {}
        if self.config.prefix_index == "approximate":
            return self.approx_index.match(block_hashes, now_ns)
        exact = self.index.match(block_hashes)
        if self.config.pending_prefix_ttl_ms <= 0:
            return exact
        pending = self.pending_index.match(block_hashes, now_ns)
        for worker_id, n in pending.items():  # (exact is a fresh dict: merged in place)
            if n > exact.get(worker_id, 0):
                exact[worker_id] = n
        return exact

    def _gate(self, gated: set[str], worker_id: str, value: float, high: float, hysteresis: float) -> bool:
        """Hysteresis: closes at `high`, reopens at high × (1 − hysteresis). Folds the state."""
        if worker_id in gated:
            if value <= high * (1 - hysteresis):
                gated.discard(worker_id)
        elif value >= high:
            gated.add(worker_id)
        return worker_id in gated

    def _prefill_candidates(self, workers: list[WorkerInfo], req: AdmitRequest, now_ns: int,
                            with_tpot: bool = False) -> list[Candidate]:
        """Score every worker whose queue has room (the hot path: one pass, O(1) per worker —
        the ledger keeps its wait aggregates, the batcher its queue shape). `with_tpot`
        (colocated workers): each candidate carries the calibrated TPOT the request would
        decode at there (decode_model.py)."""
        matches = self._matches(req.block_hashes, now_ns)
        cfg = self.config
        max_queue = cfg.max_queue_per_worker
        high = self.pending_gate_high
        reopen = high * (1 - self.pending_gate_hysteresis)
        gated_set = self.prefill_gated
        block_counts = self.index.block_counts
        n = req.num_prompt_tokens
        n_sq = n * n
        new_candidate = tuple.__new__  # Candidate's fields in order (see Candidate)
        out = []
        slots = self._slots
        for w in workers:
            wid = w.worker_id
            slot = slots.get(wid)
            if slot is None:
                slot = self._slot(wid)
            batcher, queue_items, inf, predictor, empty_queue_window_ms = slot
            queued = len(queue_items)
            if queued >= max_queue:
                continue
            bs = w.block_size_tokens
            cached = 0
            if matches:
                blocks = matches.get(wid)
                if blocks:
                    cached = blocks * bs
                    if cached >= n:
                        cached = n - bs  # the last block is always computed (cached_tokens)
                    if cached < 0:
                        cached = 0
            if inf.batches:  # InflightLedger's wait rule, inlined (WorkerInflight.wait_ms)
                wait = inf.predicted_ms_total
                if inf.earliest_started_ns is not None:
                    wait -= (now_ns - inf.earliest_started_ns) / 1e6
                if wait < 0.0:
                    wait = 0.0
            else:
                wait = 0.0
            total = w.num_kv_blocks * bs
            free = w.num_allocatable_kv_blocks * bs
            hard = inf.hidden_hard_kv_tokens
            # Unknown KV (no report yet) must not shrink batches to one request: treat as unbounded.
            free_kv = (free - hard if free > hard else 0) if w.num_kv_blocks else 1 << 40
            if queued or empty_queue_window_ms is None:
                queue = batcher.queue_wait(now_ns, w.max_batch_tokens, free_kv, wait)
            else:  # an empty queue: queue_wait's rule without the call
                queue = empty_queue_window_ms - wait
                if not queue > 0.0:
                    queue = 0.0
            # WorkerInflight.num_requests, inlined
            ours = len(inf.reservations) if w.role == "pd_fusion" else len(inf.reservations) + inf.num_batch_requests + queued
            unknown = w.num_running_requests - inf.num_visible
            pending = ours + unknown if unknown > 0 else ours
            if wid in gated_set:
                gated = pending > reopen
                if not gated:
                    gated_set.discard(wid)
            elif pending >= high:
                gated = True
                gated_set.add(wid)
            else:
                gated = False
            a, b, c, d, e = predictor.hot_coefficients  # predict_ms(((n, cached),)), inlined (0 <= cached < n)
            prefill = a + b * (n - cached) + c * (n_sq - cached * cached) + d * cached + e
            if prefill < 0.0:
                prefill = 0.0
            tpot = 0.0
            if with_tpot:  # colocated: the TPOT this worker would decode the request at (idle: 0, it always takes it)
                running, kv = self.engine_load(wid)
                if running:
                    tpot = self.decode_model(wid).predict_tpot_ms(running + 1, kv + n)
            out.append(new_candidate(Candidate, (
                w, wid, cached, prefill, wait, queue, pending, block_counts.get(wid, 0), total,
                total - free + inf.hidden_expected_kv_tokens, free - hard, gated, prefill + wait + queue, tpot,
            )))
        return out

    def _kv(self, w: WorkerInfo) -> dict[str, int]:
        hard, expected = self.ledger.hidden_kv(w.worker_id)
        total = w.num_kv_blocks * w.block_size_tokens
        free = w.num_allocatable_kv_blocks * w.block_size_tokens
        return {"kv_total_tokens": total, "kv_used_tokens": total - free + expected, "kv_available_tokens": free - hard}

    def _decode_candidates(self, workers: list[WorkerInfo]) -> list[Candidate]:
        out = []
        for w in workers:
            kv = self._kv(w)
            usage = kv["kv_used_tokens"] / kv["kv_total_tokens"] if kv["kv_total_tokens"] else 1.0
            out.append(Candidate(
                worker=w, num_pending=self.ledger.worker(w.worker_id).num_requests(0, w.num_running_requests, True),
                gated=self._gate(self.decode_gated, w.worker_id, usage, self.max_kv_usage, self.kv_usage_hysteresis),
                **kv,
            ))
        return out

    def _decide(self, stage: str, policy: RoutingPolicy, req: AdmitRequest, cands: list[Candidate], now_ns: int,
                slo_ttft_ms: float, tpot_limit_ms: float = 0.0, others: list[WorkerInfo] | None = None) -> RouteDecision:
        """One policy's pick among `cands`; `others` (live workers of other models than the
        request's) join its score cards, filtered by "model"."""
        self.decision_seq += 1
        seed = decision_seed(self.config.seed, self.decision_seq)
        ctx = RouteContext(req.request_id, req.num_prompt_tokens, req.max_tokens, cands, now_ns, seed,
                           len(req.block_hashes), slo_ttft_ms, tpot_limit_ms)
        pick = policy.select(ctx)
        if others:  # the model filter's cards, after the policy's (built when read, as the policy's are)
            inner = pick

            def cards() -> list[Score]:
                return inner.scores + [Score(w.worker_id, 0.0, {}, "model") for w in others]

            pick = Pick(inner.worker_id, reason_fn=lambda: inner.reason, cards=cards)
        return RouteDecision(stage, policy.name, self.decision_seq, seed, pick)

    # ---------------------------------------------------------------- admission
    def _lora_decide(self, req: AdmitRequest, adapter: str, workers: list[WorkerInfo], now_ns: int) -> RouteDecision:
        """Which worker serves a request naming LoRA adapter `adapter` (services/core/lora.py:
        loaded > free slot > evicting the least recently used, load within each, a load cap),
        among the colocated workers that serve it; those that do not are filtered by "lora".
        A worker's adapters (least recently used first) are the router's own guess from what it
        routed there, until LORA_GUESS_NS after it last did, then what the worker reports loaded
        (a report lags what was just routed: trusting it at once sent the next request for an
        adapter to another worker, as if the first had not loaded it); the guess alone while
        the worker reports nothing. Its slots: `max_loras`, 1 when unknown (vLLM's default)."""
        self.decision_seq += 1
        seed = decision_seed(self.config.seed, self.decision_seq)
        serving, others = [], []
        for w in workers:
            (serving if adapter in w.lora_adapters else others).append(w)
        aws = []
        for w in serving:
            inf = self.ledger.workers.get(w.worker_id)
            outstanding = len(inf.reservations) if inf is not None else w.num_running_requests
            guess = self.lora_loaded.get(w.worker_id)
            if guess is not None and (w.loaded_lora_adapters is None or now_ns - guess[1] < LORA_GUESS_NS):
                loaded = guess[0]
            else:
                loaded = tuple(w.loaded_lora_adapters or ())
            aws.append(AdapterWorker(w.worker_id, loaded, max(w.max_loras, 1), outstanding))
        d = lora_pick(aws, adapter, self.lora_params)
        scores = [Score(c.worker_id, round(c.score, 6), {"outstanding": float(c.outstanding), "over_cap": float(c.over_cap),
                                                         **{f"state_{c.state}": 1.0}})
                  for c in d.candidates] + [Score(w.worker_id, 0.0, {}, "lora") for w in others]
        return RouteDecision("lora", "lora-affinity", self.decision_seq, seed, Pick(d.worker_id, d.reason, scores))

    def admit(self, req: AdmitRequest, now_ns: int) -> Admitted | Rejected:
        cfg = self.config
        n = req.num_prompt_tokens
        if req.request_id in self.inflight or req.request_id in self.fair.waiting:
            return Rejected("duplicate_request", f"request {req.request_id} is already in flight")
        if n > cfg.max_prompt_tokens:
            return Rejected("too_large", f"prompt of {n} tokens exceeds the limit of {cfg.max_prompt_tokens}")
        if len(self.inflight) >= cfg.max_inflight_requests:
            return Rejected("queue_full", f"global inflight cap of {cfg.max_inflight_requests} reached")
        adapter = ""
        if not self.view.is_known_model(req.model):
            parent = self.view.adapter_parent(req.model)
            if parent is None:
                return Rejected("model_not_found", f"model {req.model!r} is not served here: no worker has reported it "
                                                   f"(the router's default model is {cfg.model_name!r})")
            adapter, model = req.model, parent  # a LoRA adapter: routed in its parent's pool (_lora_decide)
        else:
            model = self.view.resolve_model(req.model)
        # Live workers of the request's model that can hold it, by role (the view caches the
        # partition per model; only a request beyond the smallest limit among them needs a
        # filtering pass). Live workers of other models are shown filtered by "model".
        routable = self.view.routable(model)
        if not routable.num_live:
            return Rejected("no_worker", f"no live worker serves model {model!r}"
                            if routable.other_models else "no live worker can serve this request")
        total = n + req.max_tokens
        colocated, prefill_workers, decode_workers = routable.colocated, routable.prefill, routable.decode
        if 0 < routable.min_seq_len_tokens < total or 0 < routable.min_batch_tokens < n:
            colocated = [w for w in colocated if not (0 < w.max_seq_len_tokens < total or 0 < w.max_batch_tokens < n)]
            prefill_workers = [w for w in prefill_workers
                               if not (0 < w.max_seq_len_tokens < total or 0 < w.max_batch_tokens < n)]
            decode_workers = [w for w in decode_workers if not 0 < w.max_seq_len_tokens < total]
        fitting = decode_workers or prefill_workers or colocated
        if routable.num_live and not fitting:
            return Rejected("too_large", f"{n}+{req.max_tokens} tokens exceed every live worker's max sequence length "
                                         f"or prefill batch capacity")
        if req.excluded_workers or self.breakers.num_not_closed:  # (breaker.py; a retry's failed workers)
            colocated, prefill_workers, decode_workers = (
                [w for w in ws if w.worker_id not in req.excluded_workers and self.breakers.admits(w.worker_id, now_ns)]
                for ws in (colocated, prefill_workers, decode_workers))
            if not colocated and not (prefill_workers and decode_workers):
                return Rejected("no_worker", "every worker that could serve it has its circuit breaker open"
                                + (f" or failed it before (tried {len(req.excluded_workers)})" if req.excluded_workers else ""))
        if req.embeddings:  # only engine servers that answer /v1/embeddings
            colocated, prefill_workers, decode_workers = (
                [w for w in ws if w.signals is not None and w.signals.embeddings]
                for ws in (colocated, prefill_workers, decode_workers))
            if not colocated and not (prefill_workers and decode_workers):
                return Rejected("invalid_request", f"model {model!r}: no live worker serves embeddings (an engine "
                                                   "server that answers /v1/embeddings: llama-server --embeddings, an "
                                                   "embedding model behind --engine openai)")
        if req.engine_fields:  # fields only an engine server taking OpenAI bodies honours
            colocated, prefill_workers, decode_workers = (
                [w for w in ws if w.signals is not None and w.signals.protocol == "openai"]
                for ws in (colocated, prefill_workers, decode_workers))
            if not colocated and not (prefill_workers and decode_workers):
                names = ", ".join(req.engine_fields[:8])
                return Rejected("invalid_request", f"{names}: not honoured by the engines serving model {model!r}; "
                                                   "only engine servers behind --engine openai take these fields")
        priority = cfg.slo.default_priority if req.priority is None else req.priority
        slo_ttft, slo_tpot = slo_targets(cfg.slo, n, priority, req.slo_ttft_ms, req.slo_tpot_ms)
        decisions: list[RouteDecision] = []
        if adapter:
            if decode_workers or prefill_workers:
                return Rejected("invalid_request", f"model {adapter!r} is a LoRA adapter of {model!r}, whose pool is "
                                                   "disaggregated: adapters run on colocated workers only (the decode "
                                                   f"side would run the base model); name {model!r}")
            lora = self._lora_decide(req, adapter, colocated, now_ns)
            decisions.append(lora)
            if lora.pick.worker_id is None:
                return Rejected("no_worker", f"no live worker of {model!r} can serve adapter {adapter!r}: "
                                             f"{lora.pick.reason}", decisions)
            colocated = [w for w in colocated if w.worker_id == lora.pick.worker_id]
        if decode_workers and prefill_workers:
            d = self._decide("decode", self.decode_policy, req, self._decode_candidates(decode_workers), now_ns, slo_ttft,
                             others=routable.other_models)
            decisions.append(d)
            if d.pick.worker_id is None:
                return Rejected("no_worker", f"no decode worker can take it: {d.pick.reason}", decisions)
            prefill_pool = prefill_workers
        elif colocated:
            prefill_pool = colocated
        else:
            return Rejected("no_worker", "no live worker can serve this request" if not fitting
                            else "disaggregated fleet lacks a live prefill or decode worker")
        cands = self._prefill_candidates(prefill_pool, req, now_ns, self.tpot_headroom > 0 and not decisions)  # (only workers whose queue has room)
        if not cands:
            return Rejected("queue_full", f"every prefill worker's queue holds {cfg.max_queue_per_worker} requests", decisions)
        p = self._decide("prefill", self.prefill_policy, req, cands, now_ns, slo_ttft,
                         self.tpot_headroom * slo_tpot if self.tpot_headroom else 0.0, routable.other_models)
        decisions.append(p)
        if p.pick.worker_id is None:
            return Rejected("no_worker", f"no prefill worker can take it: {p.pick.reason}", decisions)
        picked = p.pick.worker_id
        chosen = cands[0]
        best_ttft = math.inf
        for c in cands:
            if c.ttft_ms < best_ttft:
                best_ttft = c.ttft_ms
            if c.worker_id == picked:
                chosen = c
        predicted_ttft = chosen.ttft_ms
        best_effort = best_ttft > slo_ttft
        mode = cfg.slo.mode
        if best_effort and not req.best_effort and (mode == "reject" or (mode == "reject-explicit" and req.slo_ttft_ms is not None) or (
                mode == "shed" and (req.slo_ttft_ms is not None or min(c.prefill_ms for c in cands) <= slo_ttft))):
            return Rejected(
                "slo_unattainable",
                f"best predicted TTFT {best_ttft:.0f} ms exceeds the SLO of {slo_ttft:.0f} ms",
                decisions, predicted_ttft_ms=best_ttft, slo_ttft_ms=slo_ttft,
            )
        # The TPOT guard looks at the worker that will decode it: in a disaggregated fleet the
        # prefill worker's steps are prefill chunks, which no running decode waits on.
        decoder = chosen.worker
        if decisions[0].stage == "decode":
            decoder = self.view.workers.get(decisions[0].pick.worker_id, decoder)
        if mode == "shed" and cfg.slo.tpot_guard > 0 and decoder.recent_step_ms > slo_tpot * cfg.slo.tpot_guard and not req.best_effort:
            return Rejected(
                "slo_unattainable",
                f"worker {decoder.worker_id} steps take {decoder.recent_step_ms:.0f} ms, above {cfg.slo.tpot_guard:g} x "
                f"the TPOT SLO of {slo_tpot:.0f} ms",
                decisions, predicted_ttft_ms=best_ttft, slo_ttft_ms=slo_ttft,
            )
        # commit
        decode_worker_id = decisions[0].pick.worker_id if decisions[0].stage == "decode" else p.pick.worker_id
        for d in decisions:
            (self.decode_policy if d.stage == "decode" else self.prefill_policy).record(d.pick)
        self.ledger.reserve(DecodeReservation(
            request_id=req.request_id, worker_id=decode_worker_id, hard_kv_tokens=n,
            expected_kv_tokens=n + min(req.max_tokens, self.expected_output_cap_tokens), created_ns=now_ns,
            tpot_target_ms=slo_tpot,
        ))
        if req.block_hashes:
            if cfg.prefix_index == "approximate":
                self.approx_index.record(p.pick.worker_id, req.block_hashes, now_ns)
            elif cfg.pending_prefix_ttl_ms > 0:
                self.pending_index.record(p.pick.worker_id, req.block_hashes, now_ns)
        item = QueuedRequest(
            request_id=req.request_id, num_prompt_tokens=n, num_cached_tokens=chosen.num_cached_tokens,
            kv_tokens=n, max_tokens=req.max_tokens, enqueued_ns=now_ns,
            deadline_ns=now_ns + int(slo_ttft * 1e6), tpot_target_ms=slo_tpot,
            strict_deadline=not req.best_effort and (mode == "reject" or (mode != "best-effort" and req.slo_ttft_ms is not None)),
            prefill_worker_id=p.pick.worker_id,
            decode_worker_id=decode_worker_id, payload=req.payload, lora_adapter=adapter,
            block_hashes=req.block_hashes, model=model, openai_only=bool(req.engine_fields),
            embeddings=req.embeddings,
        )
        if adapter:  # the worker loads it (or uses it): the router's guess until its next report
            w = self.view.workers[p.pick.worker_id]
            loaded = self.lora_loaded[w.worker_id][0] if w.worker_id in self.lora_loaded else tuple(w.loaded_lora_adapters or ())
            self.lora_loaded[w.worker_id] = (touch(loaded, adapter, max(w.max_loras, 1))[0], now_ns)
        self.queued[req.request_id] = (p.pick.worker_id, self.batcher(p.pick.worker_id).add(item))
        self.inflight.add(req.request_id)
        if self.breakers.num_not_closed:  # a worker whose probe was due: this request is its probe
            for wid in {p.pick.worker_id, decode_worker_id}:
                self.breakers.placed(wid, req.request_id, now_ns)
        return Admitted(item, decisions, predicted_ttft, slo_ttft, slo_tpot, priority, best_effort)

    # ---------------------------------------------------------------- the fair queue
    def pool_room(self, pool: str) -> int | None:
        """How many more requests the pool's engines take now (None: unknown; admission.py)."""
        return self.fair.room(pool, self.view, self.ledger)

    def offer(self, req: AdmitRequest, now_ns: int) -> Admitted | Rejected | Queued | Refused:
        """Admit the request now if its pool's queue is empty and its engines have room (or
        the queue is off, or the model unknown: admission answers); else queue it or refuse
        it by the queue's bounds (admission.py). A ValueError names a bad priority class."""
        fair = self.fair
        pool = self.view.pool_of(req.model) if fair.config.enabled else None
        if pool is None:
            return self.admit(req, now_ns)
        q = fair.queues.get(pool)
        if q is None or not q.num_queued():
            room = self.pool_room(pool)
            if room is None or room > 0:
                return self.admit(req, now_ns)
        if req.request_id in self.inflight or req.request_id in fair.waiting:  # (admit's answer: journaled as one)
            return Rejected("duplicate_request", f"request {req.request_id} is already in flight")
        freq = fair.to_fair(req)
        out = fair.queue(pool).offer(freq, now_ns)
        if isinstance(out, Queued):
            fair.waiting[req.request_id] = (pool, freq.priority_class)
            if out.evicted is not None:
                fair.waiting.pop(out.evicted.request_id, None)
        return out

    def release(self, now_ns: int) -> list[Released]:
        """Refuse what waited too long, then admit, in the queue's order, as many queued
        requests as each pool's engines have room for (admission.py)."""
        out: list[Released] = []
        fair = self.fair
        for pool, q in fair.queues.items():
            if not q.num_queued():
                continue
            for r in q.expire(now_ns):
                fair.waiting.pop(r.request_id, None)
                out.append(Released(pool, r))
            if not q.num_queued():
                continue
            room = self.pool_room(pool)
            for d in q.pop(now_ns, q.num_queued() if room is None else room):
                fair.waiting.pop(d.request_id, None)
                res = self.admit(d.request.payload, now_ns)
                if isinstance(res, Admitted):
                    fair.dispatched[d.request_id] = (pool, d)
                out.append(Released(pool, d, res))
        return out

    def cancel_waiting(self, request_id: str, now_ns: int) -> Cancelled | None:
        """Take a request out of the fair queue (its client left); None if it is not there."""
        where = self.fair.waiting.pop(request_id, None)
        if where is None:
            return None
        return self.fair.queues[where[0]].cancel(request_id, where[1], now_ns)

    def drain_waiting(self, now_ns: int) -> list[str]:
        """Take every request out of the fair queue (leadership lost): their ids, oldest first."""
        out = []
        for request_id in list(self.fair.waiting):
            if self.cancel_waiting(request_id, now_ns) is not None:
                out.append(request_id)
        return out

    # ---------------------------------------------------------------- batching
    def tick(self, now_ns: int) -> TickResult:
        if now_ns - self.last_expiry_ns >= INDEX_EXPIRY_INTERVAL_NS:
            self.last_expiry_ns = now_ns
            self.pending_index.expire(now_ns)
            self.approx_index.expire(now_ns)
        batches: list[FormedBatch] = []
        failures: list[QueueFailure] = []
        held: list[QueuedRequest] = []  # strict heads the TPOT hold kept to their emergency point
        workers = self.view.workers
        for worker_id, batcher in self.batchers.items():
            if not len(batcher):
                continue
            info = workers.get(worker_id)
            if batcher.quiet(now_ns, info.max_batch_tokens if info else 0):  # (load()'s max_batch_tokens)
                continue
            try:
                res = batcher.poll(now_ns, self.load(worker_id, now_ns))
            except ValueError as exc:  # a broken prediction: the batcher kept its queue; fail loudly
                self.poll_errors.append(f"{worker_id}: {exc}")
                continue
            for closed in res.batches:
                batches.append(self._form(worker_id, closed, now_ns))
            for it in res.expired:
                failures.append(QueueFailure(it, "queue_timeout", f"queued on {worker_id} past its deadline"))
            for it in res.too_large:
                failures.append(QueueFailure(it, "too_large", f"prompt of {it.num_prompt_tokens} tokens cannot fit {worker_id}"))
            held.extend(res.unattainable)
        moves: list[Moved] = []
        for it in held:  # (after the loop: a move may add a batcher)
            moved = self._resolve_held(it, now_ns)
            if isinstance(moved, Moved):
                moves.append(moved)
            elif moved is not None:
                failures.append(moved)
        for f in failures:
            self.on_terminal(f.item.request_id)
        return TickResult(batches, failures, moves)

    def _resolve_held(self, item: QueuedRequest, now_ns: int) -> Moved | QueueFailure | None:
        """A strict request the TPOT hold kept on its worker up to its emergency point (the
        batcher's `unattainable`). Refuse only what no worker could serve:
        1. a colocated worker of its pool that would not hold it (its calibrated TPOT there
           with it within the hold's limit) and can still start it in time (its TTFT from now
           within what the deadline leaves less the batcher's guard) takes it: moved, the
           prefill policy picking among those (a "move" decision);
        2. else, if its calibrated TPOT on its own worker (its prefix cache) is within
           `tpot_refuse_ratio` x its target, the hold gives way: served there now, as a
           request whose SLO mode admits best effort would be (None: back in that queue);
        3. else, if it is cheap on its own worker (its predicted prefill there within
           `give_way_prefill_ratio` x its TPOT target: it stalls the running decodes there
           for that many of their tokens at most) and its TPOT predicted there is within
           `give_way_cheap_tpot_ratio` x its target, the hold gives way whatever the worker's
           recent TPOT: it can meet its targets and takes little from the others (0: off;
           the router ships 1.5 and 0.95);
        4. else it is refused slo_unattainable, naming the best worker's predictions (the
           lowest TPOT among those that can still start it in time, its own included).
        `tpot_refuse_ratio` 0 (the batcher's default): no giving way; the router ships 1.2. It
        gives way only while the TPOT the worker's finished requests recently got is within
        `give_way_tpot_ratio` x the target (`_may_give_way`; 0: not checked; the router ships 0.9)."""
        src = item.prefill_worker_id
        target = item.tpot_target_ms
        limit = self.tpot_headroom * target
        left_ms = (item.deadline_ns - now_ns) / 1e6
        here = self.load(src, now_ns)
        here_tpot = here.tpot_ms + tpot_added_ms(here, item)
        if self.tpot_refuse_ratio > 0 and here_tpot <= self.tpot_refuse_ratio * target and self._may_give_way(src, target):
            return self._give_way(item)
        prefill_ms = self.predictor(src).predict_items_ms([item])
        options: list[tuple[float, float, str]] = [(here_tpot, here.wait_ms + prefill_ms, src)]
        if item.decode_worker_id == src and not item.lora_adapter:  # (disaggregated or an adapter: it stays)
            total = item.num_prompt_tokens + item.max_tokens
            others = [w for w in self.view.routable(item.model).colocated
                      if w.worker_id != src and not 0 < w.max_seq_len_tokens < total
                      and not (item.openai_only and (w.signals is None or w.signals.protocol != "openai"))
                      and not (item.embeddings and (w.signals is None or not w.signals.embeddings))
                      and not 0 < w.max_batch_tokens < item.num_prompt_tokens and self.breakers.is_closed(w.worker_id)]
            req = AdmitRequest(request_id=item.request_id, num_prompt_tokens=item.num_prompt_tokens,
                               max_tokens=item.max_tokens, block_hashes=item.block_hashes)
            budget = left_ms - self.hold_guard_ms
            in_time = [c for c in self._prefill_candidates(others, req, now_ns, True) if c.ttft_ms <= budget]
            fit = [c for c in in_time if c.tpot_ms <= limit]
            if fit:
                d = self._decide("move", self.prefill_policy, req, fit, now_ns, left_ms, limit)
                if d.pick.worker_id is not None:
                    return self._move(item, next(c for c in fit if c.worker_id == d.pick.worker_id), now_ns, src, d)
            options += [(c.tpot_ms, c.ttft_ms, c.worker_id) for c in in_time]
        if (self.give_way_prefill_ratio > 0 and prefill_ms <= self.give_way_prefill_ratio * target
                and here_tpot <= self.give_way_cheap_tpot_ratio * target):  # cheap
            return self._give_way(item)
        best_tpot, best_ttft, best_id = min(options)
        waited_ms = (now_ns - item.enqueued_ns) / 1e6
        slo_ttft = waited_ms + left_ms
        return QueueFailure(item, "slo_unattainable", (
            f"held for {src}'s TPOT (its decodes would exceed the {target:.0f} ms target) until its TTFT target could "
            f"no longer be met, and no worker could serve it: best {best_id}, predicted TTFT {waited_ms + best_ttft:.0f} "
            f"ms of {slo_ttft:.0f}, TPOT {best_tpot:.0f} ms of {target:.0f}"),
            best_worker_id=best_id, predicted_ttft_ms=round(waited_ms + best_ttft, 3), predicted_tpot_ms=round(best_tpot, 3),
            slo_ttft_ms=round(slo_ttft, 3), slo_tpot_ms=target)

    def _give_way(self, item: QueuedRequest) -> None:
        """The hold gives way: the request goes back in its worker's queue as one whose SLO mode
        admits best effort would be, and leaves at its emergency point (None: no failure)."""
        item.strict_deadline = False
        self.queued[item.request_id] = (item.prefill_worker_id, self.batcher(item.prefill_worker_id).add(item))
        return None

    def _may_give_way(self, worker_id: str, tpot_target_ms: float) -> bool:
        """Whether the hold may give way on `worker_id`: the TPOT its recently finished requests
        got (its decode model's `recent_tpot_ms`, none yet: yes) is within `give_way_tpot_ratio`
        x the target (0: not checked). They got it inside the target: the prediction over the
        hold's limit is a moment's (a burst's few held requests), served. They got more: the
        worker is saturated, and giving way would drag every running decode past its target
        together (the hold keeps refusing, which protects them). The worker's step time now is
        no such sign: a long prompt's chunks stretch it for seconds on a worker whose requests
        get their TPOT."""
        if self.give_way_tpot_ratio <= 0:
            return True
        got = self.decode_model(worker_id).recent_tpot_ms
        return got <= 0 or got <= self.give_way_tpot_ratio * tpot_target_ms

    def _move(self, item: QueuedRequest, to: Candidate, now_ns: int, src: str, decision: RouteDecision) -> Moved:
        """Re-queue a held request on another colocated worker: its decode reservation and
        pending prefix go with it."""
        wid = to.worker_id
        self.prefill_policy.record(decision.pick)
        self.ledger.release(item.request_id)
        self.ledger.reserve(DecodeReservation(
            request_id=item.request_id, worker_id=wid, hard_kv_tokens=item.num_prompt_tokens,
            expected_kv_tokens=item.num_prompt_tokens + min(item.max_tokens, self.expected_output_cap_tokens),
            created_ns=now_ns, tpot_target_ms=item.tpot_target_ms))
        if item.block_hashes:
            if self.config.prefix_index == "approximate":
                self.approx_index.record(wid, item.block_hashes, now_ns)
            elif self.config.pending_prefix_ttl_ms > 0:
                self.pending_index.record(wid, item.block_hashes, now_ns)
        item.prefill_worker_id = item.decode_worker_id = wid
        item.num_cached_tokens = to.num_cached_tokens
        self.queued[item.request_id] = (wid, self.batcher(wid).add(item))
        return Moved(item, src, decision)

    def _form(self, worker_id: str, closed: Closed, now_ns: int) -> FormedBatch:
        self.num_batches += 1
        for item in closed.items:
            self.queued.pop(item.request_id, None)
        batch = FormedBatch(f"{self.id_prefix}-{self.num_batches}", worker_id, list(closed.items), closed.reason,
                            closed.predicted_ms)
        self.ledger.add_batch(InflightBatch(
            batch_id=batch.batch_id, worker_id=worker_id, predicted_ms=closed.predicted_ms,
            request_ids=[i.request_id for i in batch.items],
            members=[(i.num_prompt_tokens, i.num_cached_tokens) for i in batch.items], dispatched_ns=now_ns,
        ))
        # The step time each member's decode worker is predicted to run at with the batch on
        # it (uncalibrated): what its TPOT, once it finishes, is compared with (on_terminal).
        steps: dict[str, float] = {}
        for i in batch.items:
            step = steps.get(i.decode_worker_id)
            if step is None:
                running, kv = self.engine_load(i.decode_worker_id)
                step = steps[i.decode_worker_id] = self.decode_model(i.decode_worker_id).predict_ms(max(running, 1), kv)
            self.tpot_predicted[i.request_id] = (i.decode_worker_id, step)
        return batch

    def rollback(self, batch: FormedBatch) -> None:
        """The batch could not be dispatched: forget it and its requests."""
        self.rollback_ids(batch.worker_id, batch.batch_id, [item.request_id for item in batch.items])

    def rollback_ids(self, worker_id: str, batch_id: str, request_ids: list[str]) -> None:
        self.ledger.complete_batch(worker_id, batch_id)
        for request_id in request_ids:
            self.on_terminal(request_id)

    def forget_batch(self, worker_id: str, batch_id: str) -> None:
        """Drop an inflight batch from the mirror without teaching the predictor (its worker
        died with it)."""
        self.ledger.complete_batch(worker_id, batch_id)

    def set_drain_flags(self, worker_ids: set[str]) -> None:
        self.view.set_drain_flags(worker_ids)

    def mark_dead(self, worker_id: str) -> None:
        self.view.mark_dead(worker_id)

    def next_due_ns(self, now_ns: int) -> int | None:
        dues = [d for w, b in self.batchers.items() if len(b) and (d := b.next_due_ns(now_ns, self.load(w, now_ns))) is not None]
        return min(dues) if dues else None

    def remove_queued(self, request_id: str) -> QueuedRequest | None:
        """Take a request out of its batcher queue (a cancel): O(1); None if it is not queued."""
        where = self.queued.get(request_id)
        if where is None:
            return None
        batcher = self.batchers.get(where[0])
        taken = batcher.take(where[1]) if batcher is not None else None
        if taken is None:  # left the queue by a path that forgot to tell: a bug, but not a wrong removal
            self.queued.pop(request_id, None)
            return None
        self.on_terminal(request_id)
        return taken

    def drain_queues(self) -> list[QueuedRequest]:
        items = [i for b in self.batchers.values() for i in b.drain()]
        for i in items:
            self.on_terminal(i.request_id)
        return items
