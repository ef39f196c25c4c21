"""What a worker reports of its engine's limits and LoRA adapters, without a bus or a server:
the sim agent's status from its engine (workers/agent.py), its /metrics counter of adapter
loads (workers/metrics.py), the openai agent's from the server's /metrics
(workers/openai/status.py: vLLM's `vllm:lora_requests_info`, max_num_seqs learned from
overload) or from its settings, and the upstream bodies that select an adapter
(workers/openai/agent.py). Against real processes: tests/integration/test_worker_lora.py."""

from __future__ import annotations

import pytest

from schemas import messages as m
from workers.agent import WorkerAgent
from workers.config import WorkerConfig
from workers.engines.base import EngineBatch, EngineRequest
from workers.metrics import StatusCollector
from workers.openai.agent import OpenAIAgent
from workers.openai.status import MaxNumSeqsLearner, ServerStatus, parse_prometheus, server_status
from workers.openai.upstream import UpstreamFailure, refusal_of


# --------------------------------------------------------------------------- builders
def sim_agent(**fields) -> WorkerAgent:
    """A sim worker that is not started (no bus): its engine is real, time_scale 0."""
    return WorkerAgent(WorkerConfig(worker_id="w0", time_scale=0, **fields).validate())


def openai_agent(protocol: str = "openai", **fields) -> OpenAIAgent:
    return OpenAIAgent(WorkerConfig(worker_id="w9", engine="openai", engine_url="http://127.0.0.1:9",
                                    engine_protocol=protocol, engine_model="base-model", **fields).validate())


def batch_request(rid: str = "r1", adapter: str = "", chat: m.ChatForward | None = None) -> m.BatchRequest:
    return m.BatchRequest(request_id=rid, prompt_token_ids=[1, 2], max_tokens=4, decode_worker_id="w9",
                          token_subject=f"flexlb.tok.rt.{rid}", lora_adapter=adapter, chat=chat)


def vllm_metrics(running: int = 0, waiting: int = 0, lora_lines: str = "") -> ServerStatus:
    return server_status(parse_prometheus(
        f'vllm:num_requests_running{{model_name="m"}} {running}\nvllm:num_requests_waiting{{model_name="m"}} {waiting}\n'
        + lora_lines))


def metric_names(collector: StatusCollector) -> dict[str, float]:
    return {f.name: f.samples[0].value for f in collector.collect() if f.samples}


# --------------------------------------------------------------------------- the sim agent
def test_a_sim_worker_reports_its_limits_and_its_loaded_adapters_least_recent_first():
    agent = sim_agent(max_num_seqs=7, lora_adapters="a,b,c", max_loras=2)
    st = agent.status()
    assert (st.max_num_seqs, st.lora_adapters, st.max_loras, st.loaded_lora_adapters) == (7, ["a", "b", "c"], 2, [])
    for rid, adapter in (("r1", "b"), ("r2", "a")):
        agent.engine.submit_batch(EngineBatch(batch_id=rid, requests=[
            EngineRequest(request_id=rid, prompt_token_ids=[1, 2, 3], max_tokens=1, lora_adapter=adapter)]))
        while agent.engine.step() is not None:
            pass
    st = agent.status()
    assert st.loaded_lora_adapters == ["b", "a"] and agent.num_lora_loads == 2
    collector = StatusCollector(lambda: st, lambda: (0, 0), agent)
    assert metric_names(collector)["flexlb_worker_lora_loads"] == 2  # exported as flexlb_worker_lora_loads_total


def test_a_sim_worker_without_adapters_reports_the_default_limit_and_no_adapter_counter():
    agent = sim_agent()
    st = agent.status()
    assert (st.max_num_seqs, st.lora_adapters, st.max_loras, st.loaded_lora_adapters) == (256, [], 0, [])
    assert agent.num_lora_loads is None
    assert "flexlb_worker_lora_loads" not in metric_names(StatusCollector(lambda: st, lambda: (0, 0), agent))


def test_the_sim_agent_passes_the_requests_adapter_to_the_engine():
    agent = sim_agent(lora_adapters="a")
    agent.submit_batch("b1", [batch_request("r1", "a"), batch_request("r2", "nope")])
    step = agent.engine.step()
    assert step.lora_loads == ["a"]
    assert [(f.request_id, f.code) for f in step.failed] == [("r2", "adapter_not_found")]


# --------------------------------------------------------------------------- max_num_seqs learned from /metrics
def learned(polls: list[tuple[int, int]]) -> int:
    learner = MaxNumSeqsLearner()
    for running, waiting in polls:
        out = learner.observe(vllm_metrics(running, waiting))
    return out


@pytest.mark.parametrize("polls,expected", [
    ([(5, 0)] * 10, 0),  # nothing waits: the server may run more
    ([(3, 5)] + [(8, 0)] * 9, 0),  # a burst between two steps: not its limit
    ([(3, 5), (8, 2), (8, 2), (8, 1), (8, 3)], 8),  # kept waiting for 5 polls: it runs all it can
    ([(8, 2)] * 5 + [(5, 2)] * 5, 8),  # never below what an earlier overload showed
    ([(8, 2)] * 5 + [(3, 0)] + [(12, 1)] * 5, 12),  # raised by a later one
    ([(8, 2)] * 4 + [(3, 0)] + [(12, 1)] * 4, 0),  # two short ones are not one long one
], ids=["idle", "a-burst", "sustained", "keeps-the-highest", "raised", "broken-streaks"])
def test_max_num_seqs_is_the_most_running_while_requests_kept_waiting(polls, expected):
    assert learned(polls) == expected


def test_sglangs_metrics_teach_it_too():
    learner = MaxNumSeqsLearner()
    st = server_status(parse_prometheus("sglang:num_running_reqs 4\nsglang:num_queue_reqs 3\nsglang:token_usage 0.2\n"))
    assert [learner.observe(st) for _ in range(5)] == [0, 0, 0, 0, 4]


@pytest.mark.parametrize("setting,learned,expected", [(0, 0, 0), (0, 9, 9), (32, 9, 32)],
                         ids=["unknown", "learned", "the-setting-wins"])
def test_the_openai_agent_reports_the_setting_else_what_it_learned(setting, learned, expected):
    agent = openai_agent(engine_max_num_seqs=setting, max_num_seqs=64)  # the latter: the sim's and torch's, unused
    agent.learned_max_num_seqs = learned
    assert agent.status().max_num_seqs == expected


# --------------------------------------------------------------------------- vLLM's LoRA gauge
LORA_INFO = (
    'vllm:lora_requests_info{max_lora="4",running_lora_adapters="x",waiting_lora_adapters=""} 1700000000.0\n'
    'vllm:lora_requests_info{max_lora="4",running_lora_adapters="b,a",waiting_lora_adapters="c,a"} 1700000009.5\n'
    'vllm:lora_requests_info{max_lora="4",running_lora_adapters="",waiting_lora_adapters=""} 1700000003.0\n'
)


def test_the_newest_lora_info_sample_gives_the_slots_and_the_loaded_adapters():
    st = vllm_metrics(lora_lines=LORA_INFO)
    assert (st.max_loras, st.loaded_lora_adapters) == (4, ["b", "a", "c"])  # running, then waiting; once each


def test_without_the_gauge_the_loaded_adapters_are_unknown():
    st = vllm_metrics()
    assert (st.max_loras, st.loaded_lora_adapters) == (0, None)
    agent = openai_agent()
    agent.server = st
    assert (agent.status().max_loras, agent.status().loaded_lora_adapters) == (0, None)


@pytest.mark.parametrize("setting,expected", [(0, 4), (8, 8)], ids=["from-the-gauge", "the-setting-wins"])
def test_the_openai_agent_reports_the_servers_slots_and_loaded_adapters(setting, expected):
    agent = openai_agent(max_loras=setting)
    agent.server = vllm_metrics(lora_lines=LORA_INFO)
    st = agent.status()
    assert (st.max_loras, st.loaded_lora_adapters) == (expected, ["b", "a", "c"])


# --------------------------------------------------------------------------- the upstream request
def test_a_request_naming_an_adapter_is_sent_with_the_adapter_as_model():
    agent = openai_agent()
    assert agent._request(batch_request())[1]["model"] == "base-model"
    path, body = agent._request(batch_request(adapter="sql-lora"))
    assert (path, body["model"]) == ("/v1/completions", "sql-lora")
    path, body = agent._request(batch_request(adapter="sql-lora", chat=m.ChatForward(messages=[{"role": "user",
                                                                                               "content": "hi"}])))
    assert (path, body["model"]) == ("/v1/chat/completions", "sql-lora")


def test_sglangs_generate_names_the_adapter_as_lora_path():
    agent = openai_agent("sglang")
    assert "lora_path" not in agent._request(batch_request())[1]
    path, body = agent._request(batch_request(adapter="sql-lora"))
    assert (path, body["lora_path"]) == ("/generate", "sql-lora")


@pytest.mark.parametrize("adapter,status,code", [
    ("sql-lora", 404, "adapter_not_found"),
    ("", 404, "upstream_error"),  # the base model itself is missing: the agent's configuration
    ("sql-lora", 500, "upstream_error"),
    ("sql-lora", 400, "invalid_request"),
], ids=["adapter-404", "base-404", "adapter-500", "adapter-400"])
def test_vllms_404_to_an_adapter_request_is_adapter_not_found(adapter, status, code):
    body = b'{"error": {"message": "The model `sql-lora` does not exist.", "type": "NotFoundError", "code": 404}}'
    failure = OpenAIAgent._failure_of(batch_request(adapter=adapter), refusal_of(status, body))
    assert failure.code == code and "does not exist" in failure.message
    assert isinstance(failure, UpstreamFailure)
