"""What the router holds for one live request: its handle (the Request whole, where it runs,
its stream's progress), the Inbox its one client reader takes tokens from, and the Terminal
that ends that stream. The handles live in RouterState.handles (services/shell/state.py)."""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from schemas import messages as m
from services.core.scheduler import AdmitRequest


@dataclass(frozen=True)
class Terminal:
    """The end of a request's stream, as the client sees it."""

    outcome: str  # finished | failed | cancelled | timed_out | rejected
    code: str | None = None
    message: str = ""
    finish_reason: str | None = None


class Inbox:
    """A request's outbox to its one client reader: token chunks and, last, its Terminal.

    asyncio.Queue's shape (put_nowait, get, get_nowait, empty, qsize) for exactly one reader,
    which is all a handle has; an asyncio.Queue per request was ~2 % of the router's CPU at
    3,000 requests/s (bench/README.md, "hotpath.py"). Unbounded: the relay bounds it
    (token_buffer_max). Beyond a queue's: `peek`, and `wait` / `wake`, so that a stream
    waits for its first item or its dispatch on the one future its reader already has
    (RequestHandle.mark_dispatched), with no task or event of its own."""

    __slots__ = ("_items", "_waiter", "_wakeable")

    def __init__(self) -> None:
        self._items: deque = deque()
        self._waiter: asyncio.Future | None = None
        self._wakeable = False  # the waiter is wait()'s: wake() resolves it (get()'s waits for an item)

    def put_nowait(self, item: Any) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def empty(self) -> bool:
        return not self._items

    def qsize(self) -> int:
        return len(self._items)

    def get_nowait(self) -> Any:
        if not self._items:
            raise asyncio.QueueEmpty
        return self._items.popleft()

    def peek(self) -> Any:
        """The next item, left in place (None when there is none)."""
        return self._items[0] if self._items else None

    async def get(self) -> Any:
        while not self._items:  # (wait() inlined: this is every token chunk's path)
            if self._waiter is not None:
                raise RuntimeError("an Inbox has one reader")
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.popleft()

    async def wait(self) -> None:
        """Until an item is put, or wake() is called (returns at once if one is queued)."""
        if self._items:
            return
        if self._waiter is not None:
            raise RuntimeError("an Inbox has one reader")
        self._waiter = asyncio.get_running_loop().create_future()
        self._wakeable = True
        try:
            await self._waiter
        finally:
            self._waiter = None
            self._wakeable = False

    def wake(self) -> None:
        """Wake the reader waiting in wait() without an item: something else it waits on
        changed (RequestHandle.mark_dispatched). A reader in get(), or none, is left alone."""
        if self._wakeable and not self._waiter.done():
            self._waiter.set_result(None)


@dataclass
class RequestHandle:
    request: m.Request  # what the client asked, whole (schemas/messages.py): its fields are read through it
    arrival_ns: int
    queue: Inbox = field(default_factory=Inbox)  # TokensGenerated | Terminal
    next_index: int = 0  # index of the next output token we expect
    num_buffered: int = 0  # token chunks queued and not yet read by the client
    prefill_worker_id: str = ""
    decode_worker_id: str = ""
    batch_id: str = ""
    done: bool = False  # the client has been given its terminal outcome
    first_token_ns: int = 0
    grace_task: asyncio.Task | None = None
    admit: AdmitRequest | None = None  # what it was admitted with, for a re-route
    num_reroutes: int = 0
    timeout_s: float = 600.0  # its deadline, from arrival
    token_subject: str = ""  # where its tokens go (this router's, or a forwarding standby's)
    remote: bool = False  # forwarded by a standby: no local client reads this handle
    forwarded_by: str = ""  # remote: the router that forwarded it (its client's), SubmitRequest.router_id
    leader_id: str = ""  # standby: the leader that admitted it (we forwarded it there)
    leader_pool: str = ""  # the pool whose leader that is ("": the cluster's one leader)
    # A batch holding it was dispatched (the acked publish: Dispatcher.dispatch), here or, forwarded,
    # by its leader (its batch.dispatched event): its client's stream may start (mark_dispatched).
    dispatched: bool = False
    ahead: dict[int, Any] = field(default_factory=dict)  # chunks past a gap, by start index (relay)
    resend_task: asyncio.Task | None = None  # the gap's deadline while a resend is awaited
    slo_ttft_ms: float = 0.0  # the targets it was admitted with (0: unknown); flexlb_slo_requests_total
    slo_tpot_ms: float = 0.0
    # Set while it waits in the fair queue (the leader's, or the leader's a standby forwarded it
    # to): resolved None when admitted, or with the Rejected that refused it.
    admission: asyncio.Future | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.request.prompt_token_ids

    @property
    def max_tokens(self) -> int:
        return self.request.max_tokens

    @property
    def stop(self) -> list[str]:
        return self.request.stop  # OpenAI stop strings (the API cuts the text at the first)

    @property
    def chat(self) -> m.ChatForward | None:
        return self.request.chat

    @property
    def sampling(self) -> m.Sampling | None:
        return self.request.sampling  # how its tokens are drawn (None: greedy)

    @property
    def tenant(self) -> str:
        return self.request.tenant  # ("": the default tenant)

    def mark_dispatched(self) -> None:
        """Its batch went (module docstring of services/api.py: a stream's response starts at
        its dispatch or its first item, whichever comes first): wake its client's reader."""
        self.dispatched = True
        self.queue.wake()

    @property
    def is_forward(self) -> bool:
        """Ours, scheduled by another router: forwarded to a leader (or handed over to a new one
        when we stopped leading). A local request has `admit` set and no leader; a remote one is a standby's."""
        return not self.remote and (bool(self.leader_id) or self.admit is None)
