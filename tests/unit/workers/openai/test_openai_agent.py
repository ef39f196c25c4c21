"""workers/openai/agent.py without a server: /metrics mapped to a status, refusals to codes,
stream chunks to token chunks, bad chunks to upstream_error, and the agent replacing only
the EngineBackend. (In front of real servers: tests/integration/test_openai_agent.py.)"""

from __future__ import annotations

import pytest

from schemas import messages as m
from workers.openai.agent import STATUS_METRICS, parse_prometheus, refusal_of, server_status


def test_metrics_of_vllm_and_sglang_map_to_a_status():
    vllm = parse_prometheus(
        '# HELP x\nvllm:num_requests_running{model_name="m"} 3.0\nvllm:num_requests_waiting{model_name="m"} 2\n'
        'vllm:kv_cache_usage_perc{model_name="m"} 0.25\n'
        'vllm:cache_config_info{block_size="32",num_gpu_blocks="1000",cache_dtype="auto"} 1.0\n'
        'vllm:prefix_cache_hits_total{model_name="m"} 40\nnot a metric line\n')
    st = server_status(vllm)
    assert (st.flavour, st.num_running, st.num_waiting, st.kv_usage, st.num_gpu_blocks, st.block_size, st.prefix_hits) == (
        "vllm", 3, 2, 0.25, 1000, 32, 40)
    st = server_status(parse_prometheus('sglang:num_running_reqs{tp_rank="0"} 5\nsglang:num_queue_reqs 1\nsglang:token_usage 0.5\n'))
    assert (st.flavour, st.num_running, st.num_waiting, st.kv_usage) == ("sglang", 5, 1, 0.5)
    assert server_status(parse_prometheus("other_metric 1\n")).flavour == ""
    # llama.cpp's llama-server --metrics (as the one built here exports them): slots busy and
    # requests deferred, its prompt cache as processed and reused token counters.
    llama = ("# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed, excluding cached tokens\n"
             "llamacpp:prompt_tokens_total 600\nllamacpp:prompt_tokens_cached_total 400\nllamacpp:n_decode_total 9\n"
             "llamacpp:requests_processing 3\nllamacpp:requests_deferred 2\n")
    st = server_status(parse_prometheus(llama, STATUS_METRICS))
    assert (st.flavour, st.num_running, st.num_waiting, st.prefix_queries, st.prefix_hits) == ("llamacpp", 3, 2, 1000, 400)
    # What a poll reads: only the lines of the metrics the status uses, the same status.
    assert set(parse_prometheus(text := vllm_text(), STATUS_METRICS)) == {
        "vllm:num_requests_running", "vllm:kv_cache_usage_perc", "vllm:cache_config_info"}
    assert server_status(parse_prometheus(text, STATUS_METRICS)) == server_status(parse_prometheus(text))


def vllm_text() -> str:
    histogram = "".join(f'vllm:time_to_first_token_seconds_bucket{{le="{b}"}} {b}\n' for b in range(50))
    return ('vllm:num_requests_running{model_name="m"} 2\n' + histogram + 'vllm:kv_cache_usage_perc 0.5\n'
            'vllm:cache_config_info{block_size="16",num_gpu_blocks="99"} 1\n')


def test_a_refusing_server_gives_coded_failures():
    assert refusal_of(429, b'{"error": {"message": "busy"}}').code == "upstream_refused"
    assert refusal_of(503, b"down").code == "upstream_refused"
    assert refusal_of(400, b'{"error": {"message": "bad"}}').code == "invalid_request"
    assert refusal_of(413, b"{}").code == "too_large"
    failure = refusal_of(500, b"boom")
    assert failure.code == "upstream_error" and "500" in failure.message and "boom" in failure.message


def relay_of(rid: str = "r1"):
    """An agent (not started: no bus, no server) holding one released request, and its stream's relay."""
    from workers.agent import ReqMeta
    from workers.config import WorkerConfig
    from workers.openai.agent import OpenAIAgent, OpenBatch, StreamRelay

    agent = OpenAIAgent(WorkerConfig(worker_id="w9", engine="openai", engine_url="http://127.0.0.1:9").validate())
    r = m.BatchRequest(request_id=rid, prompt_token_ids=[1, 2], max_tokens=8, decode_worker_id="w9",
                       token_subject=f"flexlb.tok.rt.{rid}", token_batch_subject="flexlb.tok.rt")
    meta = agent.meta[rid] = ReqMeta(r.token_subject, "w9", [], 8, token_batch_subject=r.token_batch_subject)
    return agent, StreamRelay(agent, OpenBatch("b1", [r], released_ns=1), r, meta)


def test_stream_chunks_become_token_chunks_for_the_routers_batch_in_order():
    agent, relay = relay_of()
    relay.on_data(b'{"choices": [{"text": "ab", "token_ids": [97, 98], "finish_reason": null}], "usage": null}')
    relay.on_data(b'{"choices": [{"text": "", "token_ids": [], "finish_reason": null}]}')  # nothing new: skipped
    relay.on_data(b'{"choices": [{"text": "c", "token_ids": [99], "finish_reason": "length"}]}')
    relay.on_data(b'{"choices": [], "usage": {"prompt_tokens": 2, "prompt_tokens_details": {"cached_tokens": 1}}}')
    relay.end()  # (the last chunk waits for the stream's end: the usage after it says what was cached)
    chunks = agent.token_batches["flexlb.tok.rt"]
    assert [(c.start_index, c.token_ids, c.text, c.finish_reason, c.num_cached_tokens) for c in chunks] == [
        (0, [97, 98], "ab", None, None), (2, [99], "c", "length", 1)]
    assert (relay.index, relay.finish, relay.num_cached_tokens(), relay.num_output_tokens()) == (3, "length", 1, 3)
    assert agent.stream_token_ids is True
    assert agent.sent_tokens["r1"][1] == chunks  # kept for a resend
    assert agent.first_token_ns["r1"] == relay.first_ns > 0


@pytest.mark.parametrize("payload,fragment", [
    (b'{"error": {"message": "CUDA out of memory", "code": 500}}', "failed the request"),
    (b'{"choices": [{"text": "", "token_ids": [], "finish_reason": "abort"}]}', "ended the request: abort"),
    (b'{"choices": [{"text": "x", "token_ids": [1], "fini', "undecodable"),
    (b'{"choices": {"not": "a list"}}', "undecodable"),
    (b'{"choices": [{"text": "", "finish_reason": "content_filter"}]}', "ended the request: content_filter"),
], ids=["error-chunk", "abort", "cut-json", "wrong-shape", "unknown-finish"])
def test_a_bad_stream_chunk_ends_the_request_with_upstream_error(payload, fragment):
    from workers.openai.upstream import UpstreamFailure

    agent, relay = relay_of()
    with pytest.raises(UpstreamFailure) as info:
        relay.on_data(payload)
    assert info.value.code == "upstream_error" and fragment in info.value.message
    assert not agent.token_batches


def test_bytes_for_a_request_that_left_the_agent_close_its_stream():
    from workers.openai.upstream import UpstreamFailure

    agent, relay = relay_of()
    agent._forget("r1")  # cancelled meanwhile
    with pytest.raises(UpstreamFailure):
        relay.on_data(b'{"choices": [{"text": "a", "token_ids": [97], "finish_reason": null}]}')
    assert not agent.token_batches and "r1" not in agent.first_token_ns


def test_the_openai_agent_replaces_only_the_engine_backend_of_the_agent():
    """An engine kind replaces the EngineBackend methods and nothing else of the agent (the
    bus side stays one implementation); both kinds implement the whole Protocol."""
    from workers.agent import EngineBackend, WorkerAgent
    from workers.openai.agent import OpenAIAgent

    backend = {n for n in EngineBackend.__dict__ if not n.startswith("_")}
    replaced = {n for n, v in OpenAIAgent.__dict__.items() if callable(v) and n in WorkerAgent.__dict__} - {"__init__"}
    assert replaced <= backend, f"overridden outside EngineBackend: {sorted(replaced - backend)}"
    assert backend <= set(dir(WorkerAgent)) and backend <= set(dir(OpenAIAgent))
