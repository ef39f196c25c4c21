"""The step loop (workers/engines/step_loop.py), the one way the NATS worker and the sim HTTP
front drive an engine: an exception from `engine.step()` fails what the engine held with
`worker_failed`, is counted, and the loop goes on for the next request without spinning.
(A NATS worker surviving it: tests/integration/test_step_loop.py.)"""

from __future__ import annotations

import asyncio

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
