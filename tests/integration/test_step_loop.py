"""The step loop (workers/engines/step_loop.py), the one way the NATS worker and the sim HTTP
front drive an engine: an exception from `engine.step()` fails what the engine held with
`worker_failed`, is counted, and the loop goes on for the next request without spinning.
(The HTTP front's side: tests/integration/test_sim_http.py, the engine bug mid-stream.)"""

from __future__ import annotations

import asyncio
import secrets

import nats

from schemas import messages as m
from schemas.subjects import dispatch_subject, worker_events_subject
from workers.agent import WorkerAgent
from workers.config import WorkerConfig


async def test_an_engine_bug_in_the_nats_worker_fails_its_requests_worker_failed_and_the_worker_serves_on(nats_url):
    """In process, against a real NATS: the worker's engine raises on the first request's
    step; that request fails `worker_failed` (retryable), the error is counted, and the next
    request, once the engine is sound again, finishes on the same worker."""
    wid = f"w-steploop-{secrets.token_hex(3)}"
    agent = WorkerAgent(WorkerConfig(worker_id=wid, nats_url=nats_url, time_scale=0,
                                     heartbeat_interval_ms=100).validate())
    real_step, is_broken = agent.engine.step, True

    def step():  # broken for the first request only
        if is_broken and agent.engine.num_queued_requests:
            raise RuntimeError("a bug in the engine")
        return real_step()

    agent.engine.step = step
    nc = await nats.connect(nats_url)
    events: asyncio.Queue = asyncio.Queue()

    async def on_event(msg):
        events.put_nowait(m.decode(msg.data).payload)

    await nc.subscribe(worker_events_subject(wid), cb=on_event)
    stop = asyncio.Event()
    running = asyncio.create_task(agent.run(stop))
    envelopes = m.EnvelopeFactory("test-router", "b1")

    async def next_event(kind, request_id):
        while True:
            event = await asyncio.wait_for(events.get(), timeout=10)
            if isinstance(event, kind) and event.request_id == request_id:
                return event

    async def dispatch(batch_id: str, request_id: str) -> None:
        batch = m.DispatchBatch(batch_id=batch_id, router_id="test-router", worker_id=wid, epoch=1, requests=[
            m.BatchRequest(request_id=request_id, prompt_token_ids=[5, 6, 7], max_tokens=2, decode_worker_id=wid,
                           token_subject=f"flexlb.tok.test-router.{request_id}")])
        await nc.jetstream().publish(dispatch_subject(wid), m.encode(envelopes.wrap(batch, 1)))

    try:
        while True:  # registered: the worker's streams and consumer exist
            if isinstance(await asyncio.wait_for(events.get(), timeout=15), m.WorkerRegistered):
                break
        await dispatch("b-broken", "r-broken")
        failed = await next_event(m.RequestFailed, "r-broken")
        assert (failed.code, failed.retryable) == ("worker_failed", True)
        assert agent.num_engine_errors == 1
        assert agent.engine.num_running_requests == 0  # cancelled in the engine, not left running
        is_broken = False
        await dispatch("b-sound", "r-sound")
        finished = await next_event(m.RequestFinished, "r-sound")
        assert finished.num_output_tokens == 2
        assert agent.num_engine_errors == 1
    finally:
        stop.set()
        await asyncio.wait_for(running, timeout=15)
        await nc.close()
