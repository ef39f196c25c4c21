"""A worker's own /metrics (Prometheus), from the status report it last published.

`metrics_port` (FLEXLB_METRICS_PORT, `flexlb worker --metrics-port`) > 0 serves them on
`metrics_host:metrics_port` (prometheus_client's HTTP server, a thread of its own). The
collector reads the last status report, an immutable struct the heartbeat loop replaces, so
a scrape never walks the agent's live dictionaries from another thread. The router exports
its view of every worker too (flexlb_worker_*{worker=...}); these are the worker's own
counters, which the router does not have: steps, stale and undecodable commands, overflows,
terminal events still unacked or given up; and, read from the agent itself (an int attribute,
atomic to read from this thread), counters that only some agents keep (AGENT_COUNTERS: an
agent without the attribute, or with None in it, exports none of it), e.g. the openai
agent's chat prompt mismatches, the sim engine's LoRA adapter loads.
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from schemas import messages as m

GAUGES = {  # metric -> (help, status field)
    "flexlb_worker_running_requests": ("Requests the engine is running", "num_running_requests"),
    "flexlb_worker_queued_batches": ("Batches waiting in the engine", "num_queued_batches"),
    "flexlb_worker_kv_blocks": ("KV capacity, blocks", "num_kv_blocks"),
    "flexlb_worker_free_kv_blocks": ("KV blocks free", "num_free_kv_blocks"),
    "flexlb_worker_cached_kv_blocks": ("KV blocks holding a cached prefix", "num_cached_kv_blocks"),
    "flexlb_worker_recent_step_ms": ("Mean engine step over the last 3 s, ms", "recent_step_ms"),
    "flexlb_worker_fencing_epoch": ("Highest router epoch accepted", "fencing_epoch"),
}
COUNTERS = {
    "flexlb_worker_batches_executed": ("Prefill batches executed", "num_batches_executed"),
    "flexlb_worker_requests_finished": ("Requests finished", "num_requests_finished"),
    "flexlb_worker_stale_commands_refused": ("Commands refused for an older fencing epoch", "num_stale_commands_refused"),
    "flexlb_worker_undecodable_messages": ("Messages that did not decode (dead-lettered)", "num_undecodable_messages"),
    "flexlb_worker_stream_overflows": ("Requests stopped: their tokens did not fit the outbound buffer", "num_stream_overflows"),
}
# Counters read from the agent (metric -> (help, agent attribute)); exported with _total.
AGENT_COUNTERS = {
    "flexlb_worker_chat_prompt_mismatches": (
        "Chat requests whose prompt the engine server rendered to other token ids than the router (openai agent: "
        "give the router the model's tokenizer directory or --chat-template)", "num_chat_prompt_mismatches"),
    "flexlb_worker_engine_errors": ("Exceptions raised by engine.step(); each failed every request the engine held "
                                    "(workers/engines/step_loop.py)", "num_engine_errors"),
    "flexlb_worker_upstream_failures": ("Requests failed at or on the way to the engine server (openai agent)",
                                        "num_upstream_failures"),
    "flexlb_worker_lora_loads": ("LoRA adapters loaded into a slot of the engine (sim engine with adapters; an "
                                 "engine server's loads are its own)", "num_lora_loads"),
}


class StatusCollector:
    def __init__(self, last_status: Callable[[], m.WorkerStatusReported | None],
                 acked: Callable[[], tuple[int, int]], agent: object = None) -> None:
        self.last_status = last_status
        self.acked = acked  # (unacked now, lost so far) terminal events
        self.agent = agent  # AGENT_COUNTERS' attributes are read from it (None: none exported)

    def collect(self):
        st = self.last_status()
        if st is None:
            return
        labels = ["worker", "role"]
        values = [st.worker_id, st.role]
        for name, (doc, attr) in GAUGES.items():
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(values, float(getattr(st, attr)))
            yield g
        for name, (doc, attr) in COUNTERS.items():
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(values, float(getattr(st, attr)))
            yield c
        unacked, lost = self.acked()
        g = GaugeMetricFamily("flexlb_worker_terminal_events_unacked", "Terminal events sent, not yet acked by the stream",
                              labels=labels)
        g.add_metric(values, float(unacked))
        yield g
        c = CounterMetricFamily("flexlb_worker_terminal_events_lost", "Terminal events given up on (never acked)",
                                labels=labels)
        c.add_metric(values, float(lost))
        yield c
        for name, (doc, attr) in AGENT_COUNTERS.items():
            value = getattr(self.agent, attr, None)
            if isinstance(value, int):
                c = CounterMetricFamily(name, doc, labels=labels)
                c.add_metric(values, float(value))
                yield c


def serve(host: str, port: int, collector: StatusCollector):
    """Start the /metrics HTTP server; returns (server, thread)."""
    registry = CollectorRegistry()
    registry.register(collector)
    return start_http_server(port, addr=host, registry=registry)
