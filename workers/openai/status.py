"""Reading an engine server's load from its Prometheus /metrics (the openai agent's status
poll, workers/openai/agent.py, module docstring "Status"): vLLM's, SGLang's or llama.cpp's
metric names. llama.cpp's `llama-server --metrics` (flavour "llamacpp") has requests running
(`llamacpp:requests_processing`) and waiting for a slot (`requests_deferred`), and its prompt
cache as token counters: `prompt_tokens_total` (processed, excluding cached) and
`prompt_tokens_cached_total` (reused), so queried = both, hits = cached; no KV usage gauge.

LoRA (vLLM only): `vllm:lora_requests_info{max_lora, running_lora_adapters,
waiting_lora_adapters}`, an info gauge whose value is the time it was set: vLLM sets a new
label set at each stats update and the old ones stay in the exposition, so the sample with
the highest value is the current one. Its adapters (comma-separated names) are those of
the running requests, then those of the waiting ones; the agent reports them as the loaded
adapters (a running request's adapter is loaded; a waiting one's is about to be), in that
order, duplicates dropped: vLLM says nothing of its LRU order or of adapters loaded but
idle, so "least recently used first" is not known. Without the gauge (SGLang, a vLLM
without --enable-lora) the loaded adapters are unknown (None).

max_num_seqs (`learn_max_num_seqs`): neither server exports it. A server with requests
waiting runs all it can (its --max-num-seqs, or fewer when its KV cache is the limit), so
the highest number running while requests kept waiting is a lower bound of it, the limit
itself once such a stretch found the KV cache not the limit. Kept waiting: LEARN_AFTER_POLLS
(5) polls in a row (a second at the 200 ms heartbeat), not one: a burst caught between two
engine steps shows requests waiting beside a few running, and the router, holding work
beyond the limit it is told (its fair queue, no engine buffer by default), would then never
send enough for the server to show more: a single poll's count could lock the limit low.
A server admits from its queue every step (tens of ms), so a second of waiting means it
runs all it can. Until then it is 0 (unknown: the router holds nothing back); an agent whose own upstream_max_concurrency keeps the server below its
limit never learns it (nothing waits there), which is right: the agent's limit is then the
one that matters, and the operator can give the server's with --engine-max-num-seqs
(workers/config.py).
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

    flavour: str = ""  # "vllm" | "sglang" | "llamacpp" | "" (none's names found)
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0  # 0..1
    num_gpu_blocks: int = 0  # 0: not exported
    block_size: int = 0
    prefix_queries: float = 0.0
    prefix_hits: float = 0.0
    max_loras: int = 0  # vllm:lora_requests_info's max_lora; 0: not exported
    loaded_lora_adapters: list[str] | None = None  # its running then waiting adapters; None: not exported


# Every metric server_status reads (parse_prometheus' filter at each poll).
STATUS_METRICS = (
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc",
    "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:cache_config_info",
    "sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage", "vllm:lora_requests_info",
    "llamacpp:requests_processing", "llamacpp:requests_deferred", "llamacpp:prompt_tokens_total",
    "llamacpp:prompt_tokens_cached_total",
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
        lora_info = metrics.get("vllm:lora_requests_info")
        if lora_info:
            labels = max(lora_info, key=lambda sample: sample[1])[0]  # the newest (module docstring)
            st.max_loras = int(labels["max_lora"]) if labels.get("max_lora", "").isdigit() else 0
            names = (labels.get("running_lora_adapters", "") + "," + labels.get("waiting_lora_adapters", "")).split(",")
            st.loaded_lora_adapters = list(dict.fromkeys(n for n in names if n))
    elif "sglang:num_running_reqs" in metrics:
        st.flavour = "sglang"
        st.num_running = int(total("sglang:num_running_reqs"))
        st.num_waiting = int(total("sglang:num_queue_reqs"))
        st.kv_usage = max((v for _, v in metrics.get("sglang:token_usage", [])), default=0.0)
    elif "llamacpp:requests_processing" in metrics:
        st.flavour = "llamacpp"
        st.num_running = int(total("llamacpp:requests_processing"))
        st.num_waiting = int(total("llamacpp:requests_deferred"))
        st.prefix_hits = total("llamacpp:prompt_tokens_cached_total")
        st.prefix_queries = total("llamacpp:prompt_tokens_total") + st.prefix_hits
    return st


LEARN_AFTER_POLLS = 5  # consecutive polls with requests waiting before their running count is believed


class MaxNumSeqsLearner:
    """The server's max_num_seqs as its polls teach it (module docstring): the most running
    during LEARN_AFTER_POLLS consecutive polls that all saw requests waiting, never less than
    what was learned before; 0 until then."""

    def __init__(self) -> None:
        self.learned = 0
        self.streak = 0  # consecutive polls with requests waiting
        self.streak_max = 0  # the most running among them

    def observe(self, st: ServerStatus) -> int:
        if st.num_waiting > 0:
            self.streak += 1
            self.streak_max = max(self.streak_max, st.num_running)
            if self.streak >= LEARN_AFTER_POLLS:
                self.learned = max(self.learned, self.streak_max)
        else:
            self.streak = self.streak_max = 0
        return self.learned

    def forget(self) -> None:
        self.learned = self.streak = self.streak_max = 0
