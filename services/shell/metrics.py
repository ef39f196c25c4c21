"""Prometheus metrics of one router process (its own registry: tests may run several)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

OTHER_TENANT = "other"  # the label of every tenant the router was not configured with
UNKNOWN_MODEL = "unknown"  # the label of a model no pool serves


class RouterMetrics:
    """`known_tenants`: the tenants a label may name (the default tenant, the API keys' and the
    weighted ones); any other is counted as OTHER_TENANT, so a client naming tenants cannot grow
    the series without bound (a model label is a pool's, or UNKNOWN_MODEL: intake.py)."""

    def __init__(self, known_tenants: frozenset[str] = frozenset()) -> None:
        self.known_tenants = known_tenants
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("flexlb_requests_total", "Requests by terminal outcome and code", ["outcome", "code"], registry=r)
        self.undecodable = Counter("flexlb_undecodable_messages_total", "Messages that failed to decode, by source", ["source"], registry=r)
        self.stream_overflow = Counter("flexlb_token_buffer_overflow_total", "Requests failed because their token buffer was full", registry=r)
        self.orphan_tokens = Counter("flexlb_orphan_token_chunks_total", "Token chunks for requests this router does not hold", registry=r)
        self.duplicate_terminal = Counter("flexlb_duplicate_terminal_total", "Terminal outcomes after the first (counted, not applied)", registry=r)
        self.dispatch_failures = Counter("flexlb_dispatch_failures_total", "Batches whose dispatch publish failed", registry=r)
        self.consumer_errors = Counter("flexlb_consumer_errors_total", "Errors in bus consumer loops (retried)", ["consumer"], registry=r)
        self.batches = Counter("flexlb_batches_dispatched_total", "Batches dispatched, by close reason", ["reason"], registry=r)
        self.batch_size = Histogram("flexlb_batch_size_requests", "Requests per dispatched batch", buckets=(1, 2, 4, 8, 16, 32, 64), registry=r)
        self.inflight = Gauge("flexlb_inflight_requests", "Admitted requests without a terminal outcome", registry=r)
        self.ttft = Histogram(
            "flexlb_ttft_seconds", "Time from arrival to first token at the router",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30), registry=r,
        )
        self.best_effort = Counter("flexlb_best_effort_admissions_total",
                                   "Requests admitted although their predicted TTFT exceeded the SLO", registry=r)
        self.hold_moves = Counter("flexlb_hold_moves_total",
                                  "Requests the TPOT hold kept to their emergency point, then moved to another worker "
                                  "that could serve them", registry=r)
        self.predictor_error_pct = Histogram(
            "flexlb_prefill_prediction_error_percent", "Absolute error of predicted vs measured batch prefill time, percent",
            buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500), registry=r,
        )
        self.prompt_tokens = Counter("flexlb_prefill_prompt_tokens_total", "Prompt tokens prefilled by workers", registry=r)
        self.cached_tokens = Counter("flexlb_prefill_cached_tokens_total", "Prompt tokens served from workers' prefix caches", registry=r)
        self.kv_events = Counter("flexlb_kv_events_total", "KV-cache events by how the prefix index took them", ["status"], registry=r)
        self.worker_degraded = Gauge("flexlb_worker_degraded", "1 while the worker's learned decode step is at least 2x "
                                     "its pool's other workers' median (/admin/workers step_ratio)", ["worker"], registry=r)
        self.worker_step_ratio = Gauge("flexlb_worker_step_ratio", "The worker's learned decode step over its pool's other "
                                       "workers' median, at a reference load", ["worker"], registry=r)
        self.retries = Counter("flexlb_retries_total", "Requests a worker failed before their first token, routed again "
                               "excluding that worker, by the failure's code", ["code"], registry=r)
        self.worker_breaker = Gauge("flexlb_worker_breaker_state", "The worker's circuit breaker: 0 closed, 1 half-open "
                                    "(a probe request out), 2 open (no new requests)", ["worker"], registry=r)
        self.breaker_transitions = Counter("flexlb_worker_breaker_transitions_total", "Circuit breaker transitions, by the "
                                           "state entered", ["to"], registry=r)
        self.migrations = Counter("flexlb_migrations_total", "Requests whose worker died or failed them mid-stream, gone on "
                                  "elsewhere as a continuation", registry=r)
        self.reroutes = Counter("flexlb_reroutes_total", "Requests re-routed because their worker died before starting them", registry=r)
        self.ledger_resyncs = Counter("flexlb_ledger_resyncs_total",
                                      "Rebuilds of the Redis ledger from the router's memory after a Redis outage or restart",
                                      registry=r)
        self.ledger_evictions = Counter("flexlb_ledger_evictions_total", "Ledger entries evicted by the TTL sweep (unconfirmed)", registry=r)
        self.journal_records = Counter("flexlb_journal_records_total", "Core journal records published", registry=r)
        self.journal_lost = Counter("flexlb_journal_lost_total", "Core journal records the bus refused (replay sees a gap)",
                                    registry=r)
        self.ledger_settlements = Counter("flexlb_ledger_settlements_total",
                                          "Requests settled by calibration: the worker stopped reporting them, no terminal event came",
                                          registry=r)
        self.leader = Gauge("flexlb_router_leader", "1 while this router holds the scheduling lease", registry=r)
        self.forwarded = Counter("flexlb_forwarded_requests_total", "Requests this standby forwarded to the leader", registry=r)
        self.token_resends = Counter(
            "flexlb_token_resends_total", "Token gaps (chunks lost in flight, e.g. with a NATS node) the router asked "
            "the worker to fill by publishing them again", registry=r)
        self.tpot = Histogram(
            "flexlb_tpot_seconds", "Time per output token after the first, per finished request, as its client saw it",
            buckets=(0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1), registry=r)
        self.slo_requests = Counter(
            "flexlb_slo_requests_total", "Finished requests by SLO outcome: met (TTFT and TPOT within their targets), "
            "ttft_missed, tpot_missed, ttft_tpot_missed", ["result"], registry=r)
        self.queue_depth = Gauge("flexlb_queued_requests", "Requests admitted and waiting in the router's batch queues",
                                 registry=r)
        self.ledger_entries = Gauge("flexlb_ledger_entries", "Inflight ledger entries in the router's mirror "
                                    "(prefill batches + decode reservations)", registry=r)
        self.epoch = Gauge("flexlb_fencing_epoch", "This router's fencing epoch (a new leader takes a higher one)", registry=r)
        self.worker_live = Gauge("flexlb_worker_live", "1 while the worker gets work (ready or suspect), per worker",
                                 ["worker"], registry=r)
        self.worker_kv_used = Gauge("flexlb_worker_kv_used_ratio", "Share of the worker's KV blocks in use (its last report)",
                                    ["worker"], registry=r)
        self.worker_queued = Gauge("flexlb_worker_queued_at_router", "Requests queued at the router for the worker",
                                   ["worker"], registry=r)
        self.worker_held = Gauge("flexlb_worker_held_requests", "Requests the router holds inflight on the worker",
                                 ["worker"], registry=r)
        self.worker_tpot = Gauge("flexlb_worker_predicted_tpot_ms", "The TPOT the router's decode model predicts on the "
                                 "worker now (its load and what was dispatched there)", ["worker"], registry=r)
        self.decode_model_error = Gauge("flexlb_decode_model_error_percent", "Mean relative error of the worker's decode "
                                        "model against its reported step times (EMA, percent)", ["worker"], registry=r)
        self.dispatch_paused = Gauge(
            "flexlb_dispatch_paused", "1 while the leader dispatches nothing: its lease outran its renewal (Redis unreachable)",
            registry=r)
        self.bus_silent_cycles = Counter(
            "flexlb_bus_silent_cycles_total",
            "Liveness cycles skipped because the router's own NATS server did not answer a ping (a frozen or cut-off bus, "
            "not dead workers)", registry=r)
        self.ledger_releases = Counter("flexlb_ledger_releases_total", "Ledger fields released, by cause", ["cause"], registry=r)
        # The fair queue (services/core/admission.py): per class, and per tenant.
        self.fair_requests = Counter(
            "flexlb_fair_queue_requests_total", "Requests through the fair queue by class and outcome: queued, released "
            "(by priority), starvation (a lower class served at its starvation bound), queue_full, shed, queue_timeout, "
            "cancelled", ["priority_class", "outcome"], registry=r)
        self.fair_waiting = Gauge("flexlb_fair_queue_waiting", "Requests waiting in the fair queue, by class",
                                  ["priority_class"], registry=r)
        self.fair_wait = Histogram(
            "flexlb_fair_queue_wait_seconds", "Time requests waited in the fair queue before release, by class",
            ["priority_class"], buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60), registry=r)
        self.tenant_requests = Counter(
            "flexlb_tenant_requests_total", "Requests by tenant and outcome: admitted (at once or on release from the fair "
            "queue), queued, or the refusal's code", ["tenant", "outcome"], registry=r)
        self.tenant_cost = Counter(
            "flexlb_tenant_cost_tokens_total", "Cost tokens (input + w_out x output) charged to the tenant's fair share "
            "at release from the fair queue, before settlement", ["tenant"], registry=r)
        self.tenant_tokens = Counter(
            "flexlb_tenant_tokens_total", "Tokens served per tenant (finished requests): kind input or output",
            ["tenant", "kind"], registry=r)
        self.model_requests = Counter(
            "flexlb_model_requests_total", "Requests by model (pool) and outcome: admitted, finished, or the refusal's "
            "code", ["model", "outcome"], registry=r)

    def tenant(self, tenant: str) -> str:
        """A tenant as a label value: itself if configured, else OTHER_TENANT."""
        return tenant if tenant in self.known_tenants else OTHER_TENANT

    def model(self, pool: str | None) -> str:
        """A request's model as a label value: its pool, or UNKNOWN_MODEL when no pool serves it."""
        return pool or UNKNOWN_MODEL
