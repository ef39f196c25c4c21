"""Prometheus metrics of one router process (its own registry: tests may run several)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class RouterMetrics:
    def __init__(self) -> None:
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
        self.best_effort = Counter("flexlb_best_effort_admissions_total", "Requests admitted although their predicted TTFT exceeded the SLO", registry=r)
        self.predictor_error_pct = Histogram(
            "flexlb_prefill_prediction_error_percent", "Absolute error of predicted vs measured batch prefill time, percent",
            buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500), registry=r,
        )
        self.prompt_tokens = Counter("flexlb_prefill_prompt_tokens_total", "Prompt tokens prefilled by workers", registry=r)
        self.cached_tokens = Counter("flexlb_prefill_cached_tokens_total", "Prompt tokens served from workers' prefix caches", registry=r)
        self.kv_events = Counter("flexlb_kv_events_total", "KV-cache events by how the prefix index took them", ["status"], registry=r)
        self.reroutes = Counter("flexlb_reroutes_total", "Requests re-routed because their worker died before starting them", registry=r)
        self.ledger_resyncs = Counter("flexlb_ledger_resyncs_total", "Rebuilds of the Redis ledger from the router's memory after a Redis outage or restart", registry=r)
        self.ledger_evictions = Counter("flexlb_ledger_evictions_total", "Ledger entries evicted by the TTL sweep (unconfirmed)", registry=r)
        self.journal_records = Counter("flexlb_journal_records_total", "Core journal records published", registry=r)
        self.journal_lost = Counter("flexlb_journal_lost_total", "Core journal records the bus refused (replay sees a gap)",
                                    registry=r)
        self.ledger_settlements = Counter("flexlb_ledger_settlements_total",
                                          "Requests settled by calibration: the worker stopped reporting them, no terminal event came",
                                          registry=r)
        self.leader = Gauge("flexlb_router_leader", "1 while this router holds the scheduling lease", registry=r)
        self.forwarded = Counter("flexlb_forwarded_requests_total", "Requests this standby forwarded to the leader", registry=r)
        self.dispatch_paused = Gauge(
            "flexlb_dispatch_paused", "1 while the leader dispatches nothing: its lease outran its renewal (Redis unreachable)",
            registry=r)
        self.bus_silent_cycles = Counter(
            "flexlb_bus_silent_cycles_total",
            "Liveness cycles skipped because the router's own NATS server did not answer a ping (a frozen or cut-off bus, "
            "not dead workers)", registry=r)
        self.ledger_releases = Counter("flexlb_ledger_releases_total", "Ledger fields released, by cause", ["cause"], registry=r)
