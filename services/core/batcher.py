"""Per-prefill-worker batchers: when does a queue of admitted requests become a batch?

`fixed-window` (this module; issue 4 adds its remaining knobs and `slo-budget`):
- dispatch when the queue holds `batch_size_max` requests ("full"), or when the head has
  waited `wait_ms` ("window");
- a batch takes requests FIFO while their prompt tokens sum to at most `max_batch_tokens`
  of the worker (the head is always taken, so one large prompt never blocks the queue);
- `drain()` returns every queued item (shutdown/expiry): the caller fails each one with an
  error; nothing is dropped.

The batcher never sleeps or busy-waits: the shell asks `next_due_ns()` and sleeps until
then or until a new arrival.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar


class Batchable(Protocol):
    num_prompt_tokens: int
    enqueued_ns: int


T = TypeVar("T", bound=Batchable)


@dataclass(frozen=True)
class FixedWindowParams:
    wait_ms: float = 10.0
    batch_size_max: int = 8

    def __post_init__(self) -> None:
        if self.wait_ms < 0 or self.batch_size_max < 1:
            raise ValueError(f"fixed-window: wait_ms >= 0 and batch_size_max >= 1 required, got {self}")


@dataclass(frozen=True)
class Closed(Generic[T]):
    items: list[T]
    reason: str  # "full" | "window"


class FixedWindowBatcher(Generic[T]):
    name = "fixed-window"

    def __init__(self, params: FixedWindowParams, max_batch_tokens: int) -> None:
        self.params = params
        self.max_batch_tokens = max_batch_tokens
        self.queue: deque[T] = deque()

    def __len__(self) -> int:
        return len(self.queue)

    def add(self, item: T) -> None:
        self.queue.append(item)

    def next_due_ns(self) -> int | None:
        if not self.queue:
            return None
        if len(self.queue) >= self.params.batch_size_max:
            return self.queue[0].enqueued_ns
        return self.queue[0].enqueued_ns + int(self.params.wait_ms * 1e6)

    def poll(self, now_ns: int) -> list[Closed[T]]:
        out: list[Closed[T]] = []
        while self.queue:
            full = len(self.queue) >= self.params.batch_size_max
            due = now_ns - self.queue[0].enqueued_ns >= self.params.wait_ms * 1e6
            if not (full or due):
                break
            items = [self.queue.popleft()]
            tokens = items[0].num_prompt_tokens
            while (
                self.queue
                and len(items) < self.params.batch_size_max
                and tokens + self.queue[0].num_prompt_tokens <= self.max_batch_tokens
            ):
                tokens += self.queue[0].num_prompt_tokens
                items.append(self.queue.popleft())
            out.append(Closed(items, "full" if len(items) >= self.params.batch_size_max else "window"))
        return out

    def remove(self, predicate) -> list[T]:
        """Take out the queued items matching predicate (e.g. a cancelled request)."""
        kept: deque[T] = deque()
        taken: list[T] = []
        for item in self.queue:
            (taken if predicate(item) else kept).append(item)
        self.queue = kept
        return taken

    def drain(self) -> list[T]:
        items = list(self.queue)
        self.queue.clear()
        return items


BATCHERS = {"fixed-window": FixedWindowBatcher}
