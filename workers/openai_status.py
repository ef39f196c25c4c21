"""Reading an engine server's load from its Prometheus /metrics (the openai agent's status
poll, workers/openai_agent.py, module docstring "Status"): vLLM's or SGLang's metric names.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str, names: tuple[str, ...] | None = None) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Prometheus text exposition -> {metric name: [(labels, value)]}; comments skipped, a
    line that does not parse is skipped too (a server's exporter may add formats we do not
    read; what we need is looked up by name and its absence is handled by the caller).
    `names`: only lines that start with one of them (vLLM's /metrics is hundreds of lines
    of histograms, read at every heartbeat)."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for line in text.splitlines():
        if not line or line[0] == "#" or (names is not None and not line.startswith(names)):
            continue
        match = _SAMPLE.match(line)
        if match is None:
            continue
        name, labels, value = match.groups()
        try:
            number = float(value)
        except ValueError:
            continue
        out.setdefault(name, []).append((dict(_LABEL.findall(labels or "")), number))
    return out


@dataclass
class ServerStatus:
    """What the server's /metrics said last."""

    flavour: str = ""  # "vllm" | "sglang" | "" (neither's names found)
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0  # 0..1
    num_gpu_blocks: int = 0  # 0: not exported
    block_size: int = 0
    prefix_queries: float = 0.0
    prefix_hits: float = 0.0


# Every metric server_status reads (parse_prometheus' filter at each poll).
STATUS_METRICS = (
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc",
    "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:cache_config_info",
    "sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage",
)


def server_status(metrics: dict[str, list[tuple[dict[str, str], float]]]) -> ServerStatus:
    def total(name: str) -> float:
        return sum(v for _, v in metrics.get(name, []))

    st = ServerStatus()
    if "vllm:num_requests_running" in metrics:
        st.flavour = "vllm"
        st.num_running = int(total("vllm:num_requests_running"))
        st.num_waiting = int(total("vllm:num_requests_waiting"))
        usage = metrics.get("vllm:kv_cache_usage_perc") or metrics.get("vllm:gpu_cache_usage_perc") or []
        st.kv_usage = max((v for _, v in usage), default=0.0)
        st.prefix_queries = total("vllm:prefix_cache_queries_total")
        st.prefix_hits = total("vllm:prefix_cache_hits_total")
        for labels, _ in metrics.get("vllm:cache_config_info", []):
            if labels.get("num_gpu_blocks", "").isdigit():
                st.num_gpu_blocks = int(labels["num_gpu_blocks"])
            if labels.get("block_size", "").isdigit():
                st.block_size = int(labels["block_size"])
    elif "sglang:num_running_reqs" in metrics:
        st.flavour = "sglang"
        st.num_running = int(total("sglang:num_running_reqs"))
        st.num_waiting = int(total("sglang:num_queue_reqs"))
        st.kv_usage = max((v for _, v in metrics.get("sglang:token_usage", [])), default=0.0)
    return st
