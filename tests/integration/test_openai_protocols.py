"""`--engine openai` in front of any OpenAI-compatible server, SGLang's native protocol, and
chat forwarding (workers/openai/agent.py; the test peer is `flexlb sim-server`,
workers/sim_server/http.py).

Story, first without a network: a stream's chunks become token chunks whether or not they
carry token ids (counted, then corrected by the server's usage), chat chunks are read from
their deltas, a server's own rendering of a chat prompt is compared with the router's, and
SGLang's /generate streams read the same whether cumulative or incremental. Then with real
nats-server and redis-server: a router in front of two `sim-server --bare-openai` (no
/metrics, no token ids) and in front of two SGLang-dialect servers (one cumulative, one
incremental) completes every request whole; a chat request reaches the server's
/v1/chat/completions; a server with /metrics 404 but /health 200 is ready and one that
answers nothing is not, saying why.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets

import httpx
import nats
import pytest

from schemas import messages as m
from schemas.subjects import STATUS_STREAM, dispatch_subject, status_subject, token_batch_subject, token_subject
from services.infra import free_port
from tests.integration.stack import (
    expected_text,
    start_sim_server,
    streams_complete_across,
    wait_async,
)
from workers.agent import ReqMeta
from workers.config import WorkerConfig
from workers.openai.agent import OpenAIAgent, OpenBatch, SGLangRelay, StreamRelay, parse_prometheus
from workers.openai.upstream import UpstreamFailure


# --------------------------------------------------------------------------- builders
def agent_of(protocol: str = "openai") -> OpenAIAgent:
    """An agent that is not started (no bus, no server)."""
    return OpenAIAgent(WorkerConfig(worker_id="w9", engine="openai", engine_url="http://127.0.0.1:9",
                                    engine_protocol=protocol, engine_model="m").validate())


def request_of(rid: str = "r1", prompt: list[int] | None = None, chat: m.ChatForward | None = None,
               **extra) -> m.BatchRequest:
    return m.BatchRequest(request_id=rid, prompt_token_ids=prompt or [1, 2], max_tokens=8, decode_worker_id="w9",
                          token_subject=f"flexlb.tok.rt.{rid}", token_batch_subject="flexlb.tok.rt", chat=chat, **extra)


def relay_of(agent: OpenAIAgent, r: m.BatchRequest):
    meta = agent.meta[r.request_id] = ReqMeta(r.token_subject, "w9", [], r.max_tokens,
                                              token_batch_subject=r.token_batch_subject)
    cls = SGLangRelay if agent.protocol == "sglang" else StreamRelay
    return cls(agent, OpenBatch("b1", [r], released_ns=1), r, meta)


def sent(agent: OpenAIAgent) -> list[tuple[int, list[int], int, str, str | None]]:
    """The outbox: (start_index, token_ids, tokens it stands for, text, finish_reason) per chunk."""
    return [(c.start_index, c.token_ids, c.num_chunk_tokens, c.text, c.finish_reason)
            for c in agent.token_batches.get("flexlb.tok.rt", [])]


def data(obj) -> bytes:
    return json.dumps(obj).encode()


# --------------------------------------------------------------------------- streams without token ids
def test_a_stream_without_token_ids_is_counted_per_chunk_and_the_servers_usage_settles_the_count():
    agent = agent_of()
    relay = relay_of(agent, request_of())
    relay.on_data(data({"choices": [{"text": "ab", "finish_reason": None}]}))
    relay.on_data(data({"choices": [{"text": "", "finish_reason": None}]}))  # nothing new: skipped
    relay.on_data(data({"choices": [{"text": "c", "finish_reason": None}]}))
    relay.on_data(data({"choices": [{"text": "d", "finish_reason": "length"}]}))
    assert agent.stream_token_ids is False
    # The last chunk waits for the usage after it, which says the server made 5 tokens.
    assert sent(agent) == [(0, [], 1, "ab", None), (1, [], 1, "c", None)]
    relay.on_data(data({"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 5,
                                                 "prompt_tokens_details": {"cached_tokens": 2}}}))
    relay.end()
    assert sent(agent)[-1] == (2, [], 3, "d", "length")
    assert (relay.finish, relay.num_output_tokens(), relay.num_cached_tokens()) == ("length", 5, 2)


def test_a_running_count_in_each_chunk_gives_each_chunk_its_tokens():
    agent = agent_of()
    relay = relay_of(agent, request_of())
    usage = {"prompt_tokens": 2, "total_tokens": 0}
    relay.on_data(data({"choices": [{"text": "ab", "finish_reason": None}], "usage": {**usage, "completion_tokens": 2}}))
    relay.on_data(data({"choices": [{"text": "cde", "finish_reason": "stop"}], "usage": {**usage, "completion_tokens": 5}}))
    relay.end()
    assert sent(agent) == [(0, [], 2, "ab", None), (2, [], 3, "cde", "stop")]
    assert relay.num_output_tokens() == 5


def test_without_usage_each_chunk_with_text_is_one_token():
    agent = agent_of()
    relay = relay_of(agent, request_of())
    for text, reason in (("x", None), ("y", None), ("", "length")):
        relay.on_data(data({"choices": [{"text": text, "finish_reason": reason}]}))
    relay.end()
    assert sent(agent) == [(0, [], 1, "x", None), (1, [], 1, "y", None), (2, [], 0, "", "length")]
    assert relay.num_output_tokens() == 2


# --------------------------------------------------------------------------- chat
def chat_of(**extra) -> m.ChatForward:
    return m.ChatForward(messages=[{"role": "user", "content": "hi"}], **extra)


def test_chat_chunks_are_read_from_their_deltas_and_a_tool_call_ends_the_turn_normally():
    agent = agent_of()
    relay = relay_of(agent, request_of(prompt=[5, 6, 7], chat=chat_of()))
    relay.on_data(data({"object": "chat.completion.chunk", "prompt_token_ids": [5, 6, 7],
                        "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}))
    relay.on_data(data({"choices": [{"index": 0, "delta": {"content": "Hel"}, "token_ids": [72, 101, 108]}]}))
    relay.on_data(data({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"name": "f"}}]},
                                     "token_ids": [9], "finish_reason": "tool_calls"}]}))
    assert sent(agent) == [(0, [72, 101, 108], 3, "Hel", None)]  # (the last chunk waits for the usage after it)
    relay.on_data(data({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4,
                                                 "prompt_tokens_details": {"cached_tokens": 2}}}))
    relay.end()
    assert sent(agent) == [(0, [72, 101, 108], 3, "Hel", None), (3, [9], 1, "", "stop")]
    assert agent.token_batches["flexlb.tok.rt"][-1].num_cached_tokens == 2  # (the client's usage says it)
    assert agent.num_chat_prompt_mismatches == 0  # the server rendered what the router did


def test_what_a_chunk_says_beyond_its_text_rides_with_its_tokens_as_the_server_wrote_it():
    """Tool-call deltas, reasoning, logprobs and a server's own field go out with the chunk's
    tokens (TokensGenerated.extra, the server's bytes); a tool-call chunk without text still
    goes; the held last chunk of a stream without ids keeps its part; the request's fields for
    the engine only are in the server's body, never over the agent's own."""
    agent = agent_of()
    r = request_of(prompt=[5, 6, 7], chat=chat_of(), extra_body={"logprobs": True, "top_logprobs": 2, "stream": False})
    relay = relay_of(agent, r)
    path, body = agent._request(r)
    assert path == "/v1/chat/completions" and body["logprobs"] is True and body["top_logprobs"] == 2
    assert body["stream"] is True  # (the agent's own field stays the agent's)
    call = b'"tool_calls":[{"index":0,"id":"c1","type":"function","function":{"name":"f","arguments":"{\\"a"}}]'
    relay.on_data(b'{"system_fingerprint":"fp","choices":[{"index":0,"delta":{' + call + b'},'
                  b'"logprobs":{"content":[{"token":"q","logprob":-0.25000001}]},"finish_reason":null}]}')
    relay.on_data(data({"choices": [{"index": 0, "delta": {"reasoning_content": "hm", "content": "ok"},
                                     "finish_reason": None}]}))
    relay.on_data(data({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}))
    relay.end()
    chunks = agent.token_batches["flexlb.tok.rt"]
    assert [c.text for c in chunks] == ["", "ok", ""] and chunks[-1].finish_reason == "stop"
    assert call.decode() in chunks[0].extra and '"logprob":-0.25000001' in chunks[0].extra
    assert json.loads(chunks[0].extra)["chunk"] == {"system_fingerprint": "fp"}
    assert json.loads(chunks[1].extra) == {"delta": {"reasoning_content": "hm"}}
    assert json.loads(chunks[2].extra) == {"choice": {"finish_reason": "tool_calls"}}  # (held, then sent)


def test_a_different_rendering_is_counted_per_request_and_logged_once_per_model(caplog):
    agent = agent_of()
    caplog.set_level(logging.WARNING, logger="flexlb.worker.openai")
    for rid in ("a", "b", "c"):
        relay = relay_of(agent, request_of(rid, prompt=[5, 6, 7], chat=chat_of()))
        server_ids = [5, 6, 7] if rid == "c" else [5, 9, 7, 8]
        relay.on_data(data({"prompt_token_ids": server_ids, "choices": [
            {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}))
    assert agent.num_chat_prompt_mismatches == 2
    lines = [r.getMessage() for r in caplog.records if "chat template" in r.getMessage()]
    assert len(lines) == 1 and "--chat-template" in lines[0] and "first difference at token 1" in lines[0]


def test_a_completions_first_chunk_is_not_compared():
    agent = agent_of()
    relay = relay_of(agent, request_of(prompt=[5, 6, 7]))
    relay.on_data(data({"prompt_token_ids": [1], "choices": [{"text": "a", "token_ids": [97]}]}))
    assert agent.num_chat_prompt_mismatches == 0


def test_upstream_bodies_per_protocol():
    sampling = m.Sampling(temperature=0.5, seed=7)
    completion = request_of(sampling=sampling, stop=["\n\n"])
    path, body = agent_of()._request(completion)
    assert path == "/v1/completions"
    assert (body["prompt"], body["stop"], body["seed"], body["return_token_ids"], body["stream"]) == (
        [1, 2], ["\n\n"], 7, True, True)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    chat = request_of(chat=chat_of(tools=tools, tool_choice="auto", chat_template_kwargs={"enable_thinking": False}))
    path, body = agent_of()._request(chat)
    assert path == "/v1/chat/completions" and "prompt" not in body and "stop" not in body
    assert (body["messages"], body["tools"], body["tool_choice"], body["chat_template_kwargs"], body["max_tokens"]) == (
        [{"role": "user", "content": "hi"}], tools, "auto", {"enable_thinking": False}, 8)
    assert body["stream_options"] == {"include_usage": True} and body["return_token_ids"] is True
    assert "add_generation_prompt" not in body and "continue_final_message" not in body  # the servers' defaults
    _, body = agent_of()._request(request_of(chat=chat_of(add_generation_prompt=False, continue_final_message=True)))
    assert (body["add_generation_prompt"], body["continue_final_message"]) == (False, True)
    path, body = agent_of("sglang")._request(completion)
    assert path == "/generate"
    assert body == {"input_ids": [1, 2], "stream": True, "rid": "r1", "sampling_params": {
        "max_new_tokens": 8, "temperature": 0.5, "top_p": 1.0, "sampling_seed": 7, "stop": ["\n\n"]}}


# --------------------------------------------------------------------------- SGLang's /generate
def sglang_stream(cumulative: bool) -> list[bytes]:
    """Three steps of 1, 2 and 1 tokens, as SGLang streams them either way."""
    steps = [([104], "h"), ([105, 106], "ij"), ([107], "k")]
    out, ids, text = [], [], ""
    for i, (new_ids, new_text) in enumerate(steps):
        ids, text = ids + new_ids, text + new_text
        last = i == len(steps) - 1
        meta = {"id": "r1", "prompt_tokens": 2, "completion_tokens": len(ids), "cached_tokens": 1 if last else 0,
                "finish_reason": {"type": "length", "length": 4} if last else None}
        out.append(data({"text": text if cumulative else new_text, "output_ids": list(ids) if cumulative else new_ids,
                         "meta_info": meta, "index": 0}))
    return out


@pytest.mark.parametrize("cumulative", [True, False], ids=["cumulative", "incremental"])
def test_sglang_streams_read_the_same_cumulative_or_incremental(cumulative):
    agent = agent_of("sglang")
    relay = relay_of(agent, request_of())
    for payload in sglang_stream(cumulative):
        relay.on_data(payload)
    relay.end()
    assert sent(agent) == [(0, [104], 1, "h", None), (1, [105, 106], 2, "ij", None), (3, [107], 1, "k", "length")]
    assert (relay.finish, relay.num_output_tokens(), relay.num_cached_tokens(), agent.stream_token_ids) == (
        "length", 4, 1, True)


@pytest.mark.parametrize("payload,fragment", [
    ({"text": "", "output_ids": [], "meta_info": {"finish_reason": {"type": "abort", "message": "oom"}}}, "abort"),
    ({"error": {"message": "bad"}}, "failed the request"),
    ({"text": "a", "meta_info": {"completion_tokens": 1}}, "no output_ids"),
], ids=["abort", "error", "no-ids"])
def test_a_bad_sglang_chunk_fails_the_request(payload, fragment):
    agent = agent_of("sglang")
    relay = relay_of(agent, request_of())
    with pytest.raises(UpstreamFailure) as info:
        relay.on_data(data(payload))
    assert info.value.code == "upstream_error" and fragment in info.value.message


# --------------------------------------------------------------------------- end to end
def worker_statuses(nats_url: str, worker_ids: list[str]) -> dict[str, m.WorkerStatusReported]:
    async def read():
        nc = await nats.connect(nats_url)
        try:
            js = nc.jetstream()
            out = {}
            for w in worker_ids:
                try:
                    out[w] = m.decode((await js.get_last_msg(STATUS_STREAM.name, status_subject(w))).data).payload
                except nats.js.errors.NotFoundError:  # no report yet: left out
                    continue
            return out
        finally:
            await nc.close()

    return asyncio.run(read())


def test_100_streams_through_servers_without_metrics_or_token_ids(spawn, flexlb_up):
    (url_a, _), (url_b, _) = (start_sim_server(spawn, "--time-scale", "0.05", "--bare-openai") for _ in range(2))
    assert httpx.get(url_a + "/metrics", timeout=5).status_code == 404
    chat = httpx.post(url_a + "/v1/chat/completions", timeout=10, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "return_token_ids": True})
    assert chat.status_code == 200 and "prompt_token_ids" not in chat.json()  # asked for, not given
    assert "token_ids" not in chat.json()["choices"][0] and len(chat.json()["choices"][0]["message"]["content"]) == 2
    _, state = flexlb_up("--engine", "openai", "--engine-url", url_a, "--engine-url", url_b)
    streams_complete_across(state, 100, seed=31)
    statuses = worker_statuses(state["nats_url"], ["w0", "w1"])
    for st in statuses.values():
        assert st.state == "ready" and st.not_ready_reason == ""
        assert st.signals == m.EngineSignals(protocol="openai", metrics="none", liveness="health", token_ids=False,
                                             kv_events=False)
    # The operator sees the same per worker in /admin/workers.
    admin = {w["id"]: w for w in httpx.get(state["router_url"] + "/admin/workers", timeout=30).json()["workers"]}
    for wid in ("w0", "w1"):
        assert admin[wid]["signals"] == {"protocol": "openai", "metrics": "none", "liveness": "health",
                                         "token_ids": False, "kv_events": False, "embeddings": False}
        assert admin[wid]["not_ready_reason"] == ""
    # Served by the servers (their counters, which a bare server keeps off /metrics).
    served = sum(sum(v for _, v in parse_prometheus(httpx.get(u + "/_sim/metrics", timeout=5).text)
                     .get("flexlb_sim_requests_finished_total", [])) for u in (url_a, url_b))
    assert served == 100 + 1  # and the chat request above


def test_100_streams_through_sglangs_generate_cumulative_and_incremental(spawn, flexlb_up):
    (url_a, _), (url_b, _) = (start_sim_server(spawn, "--time-scale", "0.05", *extra)
                              for extra in ((), ("--incremental-streaming-output",)))
    _, state = flexlb_up("--engine", "openai", "--engine-protocol", "sglang", "--engine-url", url_a, "--engine-url", url_b)
    streams_complete_across(state, 100, seed=32)
    for st in worker_statuses(state["nats_url"], ["w0", "w1"]).values():
        assert (st.signals.protocol, st.signals.token_ids, st.signals.liveness) == ("sglang", True, "metrics")
    for url in (url_a, url_b):
        metrics = parse_prometheus(httpx.get(url + "/metrics", timeout=5).text)
        assert metrics["flexlb_sim_requests_finished_total"][0][1] > 0


async def dispatch_one(nc, worker: str, r: m.BatchRequest, router: str) -> None:
    cmd = m.DispatchBatch(batch_id=f"b-{secrets.token_hex(3)}", router_id=router, worker_id=worker, epoch=10**6,
                          requests=[r])
    await nc.jetstream().publish(dispatch_subject(worker), m.encode(m.EnvelopeFactory(router, "b").wrap(cmd, 1)))


async def ready_worker(nc, worker: str, timeout_s: float = 60) -> m.WorkerStatusReported:
    js = nc.jetstream()
    last: list = [None]

    async def ready():
        try:
            last[0] = m.decode((await js.get_last_msg(STATUS_STREAM.name, status_subject(worker))).data).payload
        except Exception:  # no report yet
            return False
        return last[0].state == "ready"

    await wait_async(ready, timeout_s, f"worker {worker} ready")
    return last[0]


async def test_a_chat_request_reaches_the_servers_chat_endpoint_and_a_different_rendering_is_counted(spawn, nats_url):
    url, proc = start_sim_server(spawn, "--time-scale", "0.05")
    worker, router, metrics_port = f"w-{secrets.token_hex(3)}", f"rt-{secrets.token_hex(3)}", free_port()
    agent_proc = spawn("worker", "--id", worker, "--engine", "openai", "--engine-url", url, "--metrics-port",
                       str(metrics_port), env={"FLEXLB_NATS_URL": nats_url}, name=worker)
    nc = await nats.connect(nats_url)
    chunks: list[m.TokensGenerated] = []

    async def on_tokens(msg):
        payload = m.decode(msg.data).payload
        chunks.extend(payload.chunks if isinstance(payload, m.TokensBatch) else [payload])

    await nc.subscribe(token_batch_subject(router), cb=on_tokens)
    await nc.subscribe(token_subject(router, "*"), cb=on_tokens)
    await ready_worker(nc, worker)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    async with httpx.AsyncClient(timeout=10) as client:  # the server's own rendering, as a router with its template has it
        rendered = (await client.post(url + "/tokenize", json={"messages": messages})).json()["tokens"]
    wrong = [t + 1 for t in rendered]  # a router whose template differs
    rids = [f"c-{secrets.token_hex(3)}" for _ in range(3)]
    for rid, prompt in zip(rids, (rendered, wrong, wrong)):
        await dispatch_one(nc, worker, m.BatchRequest(
            request_id=rid, prompt_token_ids=prompt, max_tokens=6, decode_worker_id=worker,
            token_subject=token_subject(router, rid), token_batch_subject=token_batch_subject(router),
            chat=m.ChatForward(messages=messages)), router)
    await wait_async(lambda: asyncio.sleep(0, sum(c.finish_reason is not None for c in chunks) == 3), 60,
                     "the chat requests' last chunks")
    await nc.close()
    for rid in rids:
        mine = [c for c in chunks if c.request_id == rid]
        assert "".join(c.text for c in mine) == expected_text(rid, 6)
        assert [t for c in mine for t in c.token_ids] and mine[-1].finish_reason == "length"
    async with httpx.AsyncClient(timeout=10) as client:
        served = parse_prometheus((await client.get(url + "/metrics")).text)
        worker_metrics = parse_prometheus((await client.get(f"http://127.0.0.1:{metrics_port}/metrics")).text)
    assert served["flexlb_sim_chat_requests_total"][0][1] == 3  # the server's chat endpoint ran them
    assert worker_metrics["flexlb_worker_chat_prompt_mismatches_total"][0][1] == 2
    log_text = agent_proc.log_path.read_text()
    assert log_text.count("chat template rendering differs") == 1, log_text[-3000:]


async def test_liveness_falls_back_to_health_and_a_silent_server_is_not_ready_saying_why(spawn, nats_url):
    bare, _ = start_sim_server(spawn, "--time-scale", "0", "--bare-openai")
    silent = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    workers = {f"w-{secrets.token_hex(3)}": url for url in (bare, silent)}
    for worker, url in workers.items():
        spawn("worker", "--id", worker, "--engine", "openai", "--engine-url", url, env={"FLEXLB_NATS_URL": nats_url},
              name=worker)
    up, down = list(workers)
    nc = await nats.connect(nats_url)
    st = await ready_worker(nc, up)
    assert (st.signals.liveness, st.signals.metrics, st.not_ready_reason) == ("health", "none", "")
    js = nc.jetstream()
    last: list = [None]

    async def reported():
        try:
            last[0] = m.decode((await js.get_last_msg(STATUS_STREAM.name, status_subject(down))).data).payload
        except Exception:  # no report yet
            return False
        return True

    await wait_async(reported, 60, f"a status of {down}")
    await asyncio.sleep(1)  # a few heartbeats: it stays down
    await reported()
    await nc.close()
    assert last[0].state == "not_ready"
    assert silent in last[0].not_ready_reason and "/metrics" in last[0].not_ready_reason, last[0].not_ready_reason
