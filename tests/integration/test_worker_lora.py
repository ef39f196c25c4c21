"""A worker's limits and LoRA adapters, end to end: the sim worker (workers/agent.py, the sim
engine's adapters), the sim-server's adapters over HTTP (workers/sim_server/http.py), and the
openai agent in front of it (workers/openai/agent.py). (Without processes:
tests/unit/workers/engines/test_sim_lora.py and tests/unit/workers/test_worker_limits.py.)

Story:
- in process, the sim-server lists its adapters in /v1/models with their base model as
  `parent`, runs a completion whose `model` names one with it (a load, its name in the
  answer), runs any other `model` on the base, refuses an unknown SGLang `lora_path`, and
  exports vLLM's `vllm:lora_requests_info`;
- a `flexlb worker` process (real NATS) registers its max_num_seqs and adapters, serves
  requests naming them through its one slot (the second evicts the first), fails an
  adapter it does not serve with `adapter_not_found`, and counts its loads on /metrics;
- an openai agent in front of a sim-server with adapters reports what /v1/models and the
  gauge say, sends a request's adapter as `model` (the server loads it), and learns the
  server's max_num_seqs when the server has requests waiting.
"""

from __future__ import annotations

import asyncio
import json
import secrets

import httpx
import nats

from schemas import messages as m
from schemas.subjects import dispatch_subject, status_subject, token_subject, worker_events_subject
from services.infra import free_port
from tests.integration.stack import asgi_call, expected_text, start_sim_server, wait_async
from workers.config import WorkerConfig
from workers.openai.status import parse_prometheus
from workers.sim_server.http import SimFront, SimHttpApp


# --------------------------------------------------------------------------- builders
class Watcher:
    """A worker's events and status reports, as they come (core NATS subscriptions)."""

    def __init__(self) -> None:
        self.events: list = []
        self.statuses: list[m.WorkerStatusReported] = []
        self.chunks: list[m.TokensGenerated] = []

    async def start(self, nc, worker: str, router: str) -> None:
        async def on_event(msg):
            self.events.append(m.decode(msg.data).payload)

        async def on_status(msg):
            self.statuses.append(m.decode(msg.data).payload)

        async def on_tokens(msg):
            payload = m.decode(msg.data).payload
            self.chunks.extend(payload.chunks if isinstance(payload, m.TokensBatch) else [payload])

        await nc.subscribe(worker_events_subject(worker), cb=on_event)
        await nc.subscribe(status_subject(worker), cb=on_status)
        await nc.subscribe(token_subject(router, "*"), cb=on_tokens)

    def first(self, kind, request_id: str | None = None):
        return next((e for e in self.events if isinstance(e, kind)
                     and (request_id is None or e.request_id == request_id)), None)

    async def wait(self, what: str, predicate, timeout_s: float = 30):
        async def check():
            return predicate()
        return await wait_async(check, timeout_s, what, interval_s=0.05)


async def dispatch(nc, worker: str, router: str, *requests: tuple[str, str, int]) -> None:
    """One batch of (request id, adapter, max_tokens) to `worker`."""
    cmd = m.DispatchBatch(batch_id=f"b-{secrets.token_hex(3)}", router_id=router, worker_id=worker, epoch=1, requests=[
        m.BatchRequest(request_id=rid, prompt_token_ids=[5, 6, 7, 8], max_tokens=n, decode_worker_id=worker,
                       token_subject=token_subject(router, rid), lora_adapter=adapter)
        for rid, adapter, n in requests])
    await nc.jetstream().publish(dispatch_subject(worker), m.encode(m.EnvelopeFactory(router, "b").wrap(cmd, 1)))


# --------------------------------------------------------------------------- the sim-server, in process
async def test_the_sim_server_serves_its_adapters_as_vllm_does():
    front = SimFront(WorkerConfig(worker_id="inproc", time_scale=0, lora_adapters="sql,chat").validate())
    app = SimHttpApp(front)
    front.start()
    try:
        status, body = await asgi_call(app, "GET", "/v1/models")
        models = json.loads(body)["data"]
        assert status == 200 and [(x["id"], x.get("parent")) for x in models] == [
            ("flexlb-sim", None), ("sql", "flexlb-sim"), ("chat", "flexlb-sim")]
        status, body = await asgi_call(app, "POST", "/v1/completions", {"model": "sql", "prompt": "hello", "max_tokens": 3})
        assert status == 200 and json.loads(body)["model"] == "sql"
        assert front.engine.num_lora_loads == 1 and front.engine.loaded_lora_adapters() == ["sql"]
        status, body = await asgi_call(app, "POST", "/v1/completions", {"model": "gpt-4", "prompt": "hello", "max_tokens": 3})
        assert status == 200 and json.loads(body)["model"] == "flexlb-sim"  # not an adapter: the base
        assert front.engine.num_lora_loads == 1
        status, body = await asgi_call(app, "POST", "/generate", {"text": "hi", "lora_path": "chat",
                                                             "sampling_params": {"max_new_tokens": 2}})
        assert status == 200 and front.engine.loaded_lora_adapters() == ["sql", "chat"]
        status, body = await asgi_call(app, "POST", "/generate", {"text": "hi", "lora_path": "nope"})
        assert status == 400 and b"nope" in body
        metrics = parse_prometheus(front.metrics_text())
        [(labels, _)] = metrics["vllm:lora_requests_info"]
        assert labels == {"max_lora": "4", "running_lora_adapters": "", "waiting_lora_adapters": ""}
        assert metrics["flexlb_sim_lora_loads_total"] == [({}, 2.0)]
        assert front.server_info()["max_running_requests"] == 256
    finally:
        await front.stop()


async def test_a_sim_server_without_adapters_lists_one_model_and_exports_no_lora_gauge():
    front = SimFront(WorkerConfig(worker_id="inproc", time_scale=0).validate())
    app = SimHttpApp(front)
    front.start()
    try:
        _, body = await asgi_call(app, "GET", "/v1/models")
        assert [x["id"] for x in json.loads(body)["data"]] == ["flexlb-sim"]
        assert "vllm:lora_requests_info" not in parse_prometheus(front.metrics_text())
    finally:
        await front.stop()


# --------------------------------------------------------------------------- the sim worker, real NATS
async def test_a_sim_worker_registers_its_limits_serves_its_adapters_and_refuses_others(spawn, nats_url):
    worker, router, metrics_port = f"w-{secrets.token_hex(3)}", f"rt-{secrets.token_hex(3)}", free_port()
    nc = await nats.connect(nats_url)
    seen = Watcher()
    await seen.start(nc, worker, router)
    spawn("worker", "--id", worker, "--max-num-seqs", "7", "--time-scale", "0", "--heartbeat-interval-ms", "50",
          "--metrics-port", str(metrics_port),
          env={"FLEXLB_NATS_URL": nats_url, "FLEXLB_LORA_ADAPTERS": "a,b", "FLEXLB_MAX_LORAS": "1"}, name=worker)
    try:
        registered = await seen.wait("its registration", lambda: seen.first(m.WorkerRegistered))
        assert (registered.max_num_seqs, registered.lora_adapters, registered.max_loras) == (7, ["a", "b"], 1)
        await dispatch(nc, worker, router, ("r-a", "a", 3), ("r-b", "b", 3), ("r-x", "x", 3))
        failed = await seen.wait("r-x's failure", lambda: seen.first(m.RequestFailed, "r-x"))
        assert (failed.code, failed.retryable) == ("adapter_not_found", False)
        assert "'x'" in failed.message and "a, b" in failed.message
        for rid in ("r-a", "r-b"):
            await seen.wait(f"{rid} finished", lambda rid=rid: seen.first(m.RequestFinished, rid))
            text = "".join(c.text for c in seen.chunks if c.request_id == rid)
            assert text == expected_text(rid, 3)
        # One slot: a, then b in its place (a waited for nothing: b waited for a to finish).
        st = await seen.wait("a status after both", lambda: next(
            (s for s in reversed(seen.statuses) if s.loaded_lora_adapters == ["b"]), None))
        assert (st.max_num_seqs, st.max_loras, st.lora_adapters) == (7, 1, ["a", "b"])
        async with httpx.AsyncClient(timeout=10) as client:
            async def loads():
                text = (await client.get(f"http://127.0.0.1:{metrics_port}/metrics")).text
                return parse_prometheus(text).get("flexlb_worker_lora_loads_total")
            assert (await wait_async(loads, 10, "the loads counter"))[0][1] == 2.0
    finally:
        await nc.close()


# --------------------------------------------------------------------------- the openai agent in front of a sim-server
async def test_the_openai_agent_sends_the_adapter_as_model_and_learns_the_servers_limits(spawn, nats_url):
    url, _ = start_sim_server(spawn, "--time-scale", "0.1", env={"FLEXLB_LORA_ADAPTERS": "sql,chat", "FLEXLB_MAX_NUM_SEQS": "2"})
    worker, router = f"w-{secrets.token_hex(3)}", f"rt-{secrets.token_hex(3)}"
    nc = await nats.connect(nats_url)
    seen = Watcher()
    await seen.start(nc, worker, router)
    spawn("worker", "--id", worker, "--engine", "openai", "--engine-url", url, "--heartbeat-interval-ms", "50",
          env={"FLEXLB_NATS_URL": nats_url}, name=worker)
    try:
        registered = await seen.wait("its registration", lambda: seen.first(m.WorkerRegistered))
        assert (registered.lora_adapters, registered.max_loras, registered.max_num_seqs) == (["sql", "chat"], 4, 0)
        ready = await seen.wait("a ready status", lambda: next((s for s in seen.statuses if s.state == "ready"), None))
        assert ready.loaded_lora_adapters == [] and ready.max_num_seqs == 0  # the gauge is there; nothing waited yet
        await dispatch(nc, worker, router, ("r-sql", "sql", 5))
        await seen.wait("r-sql finished", lambda: seen.first(m.RequestFinished, "r-sql"))
        assert "".join(c.text for c in seen.chunks if c.request_id == "r-sql") == expected_text("r-sql", 5)
        served = parse_prometheus(httpx.get(url + "/metrics", timeout=5).text)
        assert served["flexlb_sim_lora_loads_total"] == [({}, 1.0)]  # the server ran it with the adapter
        # Five requests at once on a server that runs two: three wait, and the agent learns 2.
        async with httpx.AsyncClient(timeout=60) as client:
            load = asyncio.gather(*(client.post(url + "/v1/completions", json={
                "model": "chat", "prompt": f"p{i}", "max_tokens": 600}) for i in range(5)))
            st = await seen.wait("max_num_seqs learned", lambda: next(  # the first: from the overload's poll
                (s for s in seen.statuses if s.max_num_seqs == 2), None), timeout_s=60)
            assert "chat" in st.loaded_lora_adapters
            assert all(r.status_code == 200 for r in await load)
    finally:
        await nc.close()
