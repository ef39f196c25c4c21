"""The step loop: how an engine (workers/engines/base.py) is driven, one implementation for
the NATS worker (workers/agent.py) and the sim HTTP front (workers/sim_server/http.py).

`StepLoop.run()` (one asyncio task), over and over:
1. `engine.step()`. None (nothing to do): wait for `work`, the event whoever submits sets,
   and step again.
2. `sink.step_began(step)`: the engine's state has already changed (a request cancelled
   from now on gets nothing of this step); say what starts (BatchStarted, KV events).
3. the step's time: an engine that `measures_time` already spent it (yield once; measured
   ms = `duration_ms`); else sleep `duration_ms × time_scale` (0: instant, still one yield
   to the event loop per step); measured ms = the sleep as it was, back in engine time
   (÷ time_scale; `duration_ms` when time_scale is 0). `sink.sleep_over()` follows the
   sleep, also when the loop is cancelled in it.
4. `sink.step_ended(step, measured_ms)`: publish or deliver the step's outputs.

An exception from `engine.step()` is an engine bug. It is counted (`num_engine_errors`),
logged with its traceback, and `sink.engine_failed(message)` fails every request the engine
held, each with `worker_failed` (retryable) and cancelled in the engine, so that none
hangs; the loop then waits for the next submission before it steps again: an engine that
keeps raising fails each new request and never spins. An exception from the sink ends the
loop (a sink catches what it can survive); the owner sees the task done.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

from workers.engines.base import Engine, StepResult

log = logging.getLogger("flexlb.step_loop")

ENGINE_FAILED_CODE = "worker_failed"  # what each request held by an engine whose step() raised fails with


class StepSink(Protocol):
    """What the loop's owner does with each step (module docstring)."""

    async def step_began(self, step: StepResult) -> None:
        """Right after `engine.step()`, before the step's time."""

    def sleep_over(self) -> None:
        """The step's time is over (or the loop was cancelled in it)."""

    async def step_ended(self, step: StepResult, measured_ms: float) -> None:
        """After the step's time: the outputs go out."""

    async def engine_failed(self, message: str) -> None:
        """`engine.step()` raised: fail (`ENGINE_FAILED_CODE`, with `message`) and cancel every
        request the engine held."""


class StepLoop:
    def __init__(self, engine: Engine, sink: StepSink, time_scale: float, name: str,
                 work: asyncio.Event | None = None) -> None:
        self.engine = engine
        self.sink = sink
        self.time_scale = time_scale  # 0: instant; 0.01: 100x faster than the modelled time
        self.name = name  # in the log and in the failed requests' message ("worker w1")
        self.work = work if work is not None else asyncio.Event()  # set by whoever submits to the engine
        self.num_engine_errors = 0  # exceptions raised by engine.step(), since start

    async def run(self) -> None:
        scale = self.time_scale
        while True:
            self.work.clear()
            try:
                step = self.engine.step()
            except Exception as exc:  # an engine bug: counted, logged, its requests failed (module docstring)
                self.num_engine_errors += 1
                log.exception("%s: engine.step() raised; failing every request it holds", self.name)
                await self.sink.engine_failed(f"the engine of {self.name} raised {type(exc).__name__}: {exc}")
                await self.work.wait()  # nothing is held now: retry only for a new request, never spin
                continue
            if step is None:
                await self.work.wait()
                continue
            await self.sink.step_began(step)
            try:
                if self.engine.measures_time:  # the step already ran, measured
                    await asyncio.sleep(0)
                    measured_ms = step.duration_ms
                else:
                    t0 = time.monotonic()
                    await asyncio.sleep(step.duration_ms * scale / 1000)
                    measured_ms = (time.monotonic() - t0) * 1000 / scale if scale > 0 else step.duration_ms
            finally:
                self.sink.sleep_over()
            await self.sink.step_ended(step, measured_ms)
