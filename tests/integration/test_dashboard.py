"""The Grafana dashboard cannot rot: every metric its queries name is one a running router or
worker exports (scraped from `flexlb up --worker-metrics`, after real requests)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx

from tests.integration.stack import make_bodies, run_concurrent_streams, wait_async

DASHBOARD = Path(__file__).resolve().parent.parent.parent / "services/monitoring/grafana/dashboards/flexlb.json"
METRIC = re.compile(r"\bflexlb_[a-z0-9_]+")


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL expression) of every target."""
    dashboard = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in dashboard["panels"] for t in p["targets"]]


def exported_names(exposition: str) -> set[str]:
    """Metric names in a Prometheus text exposition: families (# TYPE) and samples."""
    names = set()
    for line in exposition.splitlines():
        if line.startswith("# TYPE "):
            names.add(line.split()[2])
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{\s]", line, maxsplit=1)[0])
    return names


def unknown_metrics(queries: list[tuple[str, str]], exported: set[str]) -> list[str]:
    """Problems: a query naming a metric nobody exports (a histogram's _bucket/_sum/_count of
    an exported histogram is known), or naming no FlexLB metric at all."""
    problems = []
    for title, expr in queries:
        names = METRIC.findall(expr)
        if not names:
            problems.append(f"{title}: {expr!r} names no flexlb_ metric")
        for name in names:
            base = re.sub(r"_(bucket|sum|count)$", "", name)
            if name not in exported and base not in exported:
                problems.append(f"{title}: {name} is not exported by a router or worker")
    return problems


def test_the_checker_flags_a_metric_nobody_exports():
    exported = exported_names("# TYPE flexlb_ttft_seconds histogram\nflexlb_ttft_seconds_bucket{le=\"1\"} 3\n"
                              "flexlb_requests_total{outcome=\"finished\",code=\"\"} 2\n")
    ok = [("a", "histogram_quantile(0.9, rate(flexlb_ttft_seconds_bucket[1m]))"), ("b", "sum(flexlb_requests_total)")]
    assert unknown_metrics(ok, exported) == []
    bad = unknown_metrics([("c", "rate(flexlb_typo_total[1m])"), ("d", "up")], exported)
    assert bad == ["c: flexlb_typo_total is not exported by a router or worker", "d: 'up' names no flexlb_ metric"]


async def test_every_dashboard_query_names_a_metric_the_running_stack_exports(flexlb_up):
    _, state = flexlb_up("--workers", "2", "--time-scale", "0.02", "--worker-metrics")
    url = state["router_url"]
    results = await run_concurrent_streams(url, make_bodies(20, seed=21))
    assert all(r["done"] and not r["errors"] for r in results)
    worker_urls = list(state["worker_metrics_urls"].values())
    assert len(worker_urls) == 2

    async def workers_reporting():
        async with httpx.AsyncClient(timeout=5) as c:
            texts = [(await c.get(u)).text for u in worker_urls]
        return texts if all("flexlb_worker_running_requests" in t for t in texts) else None

    worker_texts = await wait_async(workers_reporting, 30, "every worker's /metrics to carry its status")
    async with httpx.AsyncClient(timeout=10) as c:
        router_text = (await c.get(url + "/metrics")).text
    exported = exported_names(router_text)
    for text in worker_texts:
        exported |= exported_names(text)
    queries = dashboard_queries()
    assert len(queries) >= 20, len(queries)
    problems = unknown_metrics(queries, exported)
    assert not problems, "\n".join(problems)
    # The panels are all there: outcomes by code, TTFT/TPOT, SLO attainment, queue and
    # batch sizes, per-worker KV and liveness, predictor error, ledger, leader and epoch.
    named = {n for _, e in queries for n in METRIC.findall(e)}
    for needed in ("flexlb_requests_total", "flexlb_ttft_seconds_bucket", "flexlb_tpot_seconds_bucket",
                   "flexlb_slo_requests_total", "flexlb_queued_requests", "flexlb_batch_size_requests_sum",
                   "flexlb_worker_kv_used_ratio", "flexlb_worker_live", "flexlb_prefill_prediction_error_percent_bucket",
                   "flexlb_ledger_entries", "flexlb_ledger_evictions_total", "flexlb_router_leader", "flexlb_fencing_epoch"):
        assert needed in named, needed
    # And the new router gauges carry the fleet: one series per worker.
    assert {f'flexlb_worker_live{{worker="{w}"}} 1.0' for w in ("w0", "w1")} <= set(router_text.splitlines())
    assert any(ln.startswith('flexlb_slo_requests_total{result="') for ln in router_text.splitlines())
