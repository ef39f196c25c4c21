"""The step loop (workers/engines/step_loop.py), the one way the NATS worker and the sim HTTP
front drive an engine: an exception from `engine.step()` fails what the engine held with
`worker_failed`, is counted, and the loop goes on for the next request without spinning.
(The HTTP front's side: tests/test_sim_http.py, the engine bug mid-stream.)"""

from __future__ import annotations

import asyncio
import secrets

import nats

from schemas import messages as m
from schemas.subjects import dispatch_subject, worker_events_subject
from workers.agent import WorkerAgent
from workers.config import WorkerConfig
from workers.engines.base import StepResult
from workers.engines.step_loop import StepLoop


class RaisingEngine:
    """Raises on its first `num_failures` steps, then has nothing to do."""

    measures_time = False

    def __init__(self, num_failures: int) -> None:
        self.num_failures = num_failures
        self.num_steps = 0

    def step(self) -> StepResult | None:
        self.num_steps += 1
        if self.num_steps <= self.num_failures:
            raise RuntimeError("a bug in the engine")
        return None


class RecordingSink:
    def __init__(self) -> None:
        self.failures: list[str] = []

    async def step_began(self, step: StepResult) -> None:
        raise AssertionError("no step ran")

    def sleep_over(self) -> None:
        raise AssertionError("no step ran")

    async def step_ended(self, step: StepResult, measured_ms: float) -> None:
        raise AssertionError("no step ran")

    async def engine_failed(self, message: str) -> None:
        self.failures.append(message)


async def test_a_raising_step_fails_the_held_requests_once_and_the_loop_waits_for_new_work_without_spinning():
    engine, sink = RaisingEngine(num_failures=2), RecordingSink()
    loop = StepLoop(engine, sink, time_scale=0, name="worker w1")
    task = asyncio.create_task(loop.run())
    await asyncio.sleep(0.05)
    assert (engine.num_steps, loop.num_engine_errors, len(sink.failures)) == (1, 1, 1)  # waits: no spin
    assert "worker w1" in sink.failures[0]
    loop.work.set()  # a new request: the loop steps again (and the engine raises again)
    await asyncio.sleep(0.05)
    assert (engine.num_steps, loop.num_engine_errors) == (2, 2)
    loop.work.set()  # the engine recovered: nothing to do, no failure
    await asyncio.sleep(0.05)
    assert (engine.num_steps, loop.num_engine_errors, len(sink.failures)) == (3, 2, 2)
    assert not task.done()
    task.cancel()


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
