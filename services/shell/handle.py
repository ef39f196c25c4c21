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
    """One live request at this router. Its state has one owner: the handle itself, which the
    parts tell what happened (admitted, placed, batched, rerouted, taken by a leader, handed
    over, ended); only the relay writes the stream's progress (STREAM_FIELDS), token by token.
    tests/unit/services/shell/test_shell_state.py fails on any other write from outside."""

    # What it is, set when it is made and never changed
    request: m.Request  # what the client asked, whole (schemas/messages.py): its fields are read through it
    arrival_ns: int
    timeout_s: float = 600.0  # its deadline, from arrival
    token_subject: str = ""  # where its tokens go (this router's, or a forwarding standby's)
    remote: bool = False  # forwarded by a standby: no local client reads this handle
    forwarded_by: str = ""  # remote: the router that forwarded it (its client's), SubmitRequest.router_id
    queue: Inbox = field(default_factory=Inbox)  # TokensGenerated | Terminal, to its one client reader
    # Its stream's progress (the relay's)
    next_index: int = 0  # index of the next output token we expect
    output_ids: list[int] = field(default_factory=list)  # the token ids accepted so far (a migration's continuation)
    ids_known: bool = True  # every chunk accepted had its token ids (an engine server may stream text only)
    first_token_ns: int = 0
    ahead: dict[int, Any] = field(default_factory=dict)  # chunks past a gap, by start index
    resend_task: asyncio.Task | None = None  # the gap's deadline while a resend is awaited
    # Where it runs and how it ends (the handle's own, through the methods below)
    admit: AdmitRequest | None = None  # what it was admitted with here, for a re-route
    prefill_worker_id: str = ""
    decode_worker_id: str = ""
    batch_id: str = ""
    num_reroutes: int = 0
    num_retries: int = 0  # routed again after a worker failed it before its first token (Recovery.retry)
    num_migrations: int = 0  # gone on elsewhere after its worker died or failed it mid-stream (Recovery.migrate)
    # What its engine runs, when that is not `request`: a migrated request's continuation (its
    # prompt plus the output sent, the rest of max_tokens, from that output index).
    continuation: m.Request | None = None
    slo_ttft_ms: float = 0.0  # the targets it was admitted with (0: unknown); flexlb_slo_requests_total
    slo_tpot_ms: float = 0.0
    leader_id: str = ""  # standby: the leader that admitted it (we forwarded it there)
    leader_pool: str = ""  # the pool whose leader that is ("": the cluster's one leader)
    # A batch holding it was dispatched (the acked publish: Dispatcher.dispatch), here or, forwarded,
    # by its leader (its batch.dispatched event): its client's stream may start (mark_dispatched).
    dispatched: bool = False
    # Set while it waits in the fair queue (the leader's, or the leader's a standby forwarded it
    # to): resolved None when admitted, or with the Rejected that refused it.
    admission: asyncio.Future | None = None
    grace_task: asyncio.Task | None = None  # its finish grace (relay.grace), once the worker said it finished
    done: bool = False  # the client has been given its terminal outcome

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
    def for_engine(self) -> m.Request:
        """What its engine runs: the request, or a migrated request's continuation."""
        return self.continuation if self.continuation is not None else self.request

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

    # ---------------------------------------------------------------- what happened to it
    def admit_here(self, admit: AdmitRequest) -> None:
        """Admitted by this router, which leads: no other leader holds it."""
        self.leader_id = self.leader_pool = ""
        self.admit = admit

    def place(self, prefill_worker_id: str, decode_worker_id: str, slo_ttft_ms: float | None = None,
              slo_tpot_ms: float | None = None) -> None:
        """Its workers (and, when admitted, its targets; None: unchanged)."""
        self.prefill_worker_id, self.decode_worker_id = prefill_worker_id, decode_worker_id
        if slo_ttft_ms is not None:
            self.slo_ttft_ms = slo_ttft_ms
        if slo_tpot_ms is not None:
            self.slo_tpot_ms = slo_tpot_ms

    def batched(self, batch_id: str) -> None:
        self.batch_id = batch_id

    def rerouted(self, prefill_worker_id: str, decode_worker_id: str, counts: bool) -> None:
        """Re-admitted elsewhere, out of its batch (`counts`: toward its re-route limit)."""
        self.num_reroutes += 1 if counts else 0
        self.place(prefill_worker_id, decode_worker_id)
        self.batch_id = ""

    def retried(self, admit: AdmitRequest, prefill_worker_id: str, decode_worker_id: str) -> None:
        """A worker failed it before its first token: re-admitted with `admit` (the workers that
        failed it excluded), out of its batch."""
        self.admit = admit
        self.num_retries += 1
        self.place(prefill_worker_id, decode_worker_id)
        self.batch_id = ""

    def migrated(self, admit: AdmitRequest, continuation: m.Request, prefill_worker_id: str, decode_worker_id: str) -> None:
        """Its worker died or failed it mid-stream: re-admitted (`admit`) as `continuation`."""
        self.admit = admit
        self.continuation = continuation
        self.num_migrations += 1
        self.place(prefill_worker_id, decode_worker_id)
        self.batch_id = ""

    def streamed_by(self, worker_id: str) -> None:
        """Forwarded, and its tokens beat the leader's reply that names its workers: the worker
        streaming them is its decode worker."""
        self.decode_worker_id = worker_id

    def wait_for_admission(self) -> None:
        """It waits in a fair queue: its client awaits `admission` (one handed back keeps the
        one its client already awaits)."""
        if self.admission is None or self.admission.done():
            self.admission = asyncio.get_running_loop().create_future()

    def admission_over(self, outcome: Any) -> None:
        """Out of the fair queue: admitted (None) or refused (the Rejected); no-op if not waiting."""
        if self.admission is not None and not self.admission.done():
            self.admission.set_result(outcome)

    def taken(self, reply: m.SubmitReply) -> None:
        """A leader took it (we forwarded it, or handed it over): admitted with its workers, or
        queued in that leader's fair queue (the workers come with its request.admitted event)."""
        if reply.code == "queued":
            if self.leader_id == reply.router_id:  # its request.admitted came first: not queued any more
                return
            self.wait_for_admission()
            self.place("", "")  # (an old leader's picks, if handed over)
        else:  # (the relay may have set the decode worker already, from tokens that beat the reply here)
            self.place(reply.prefill_worker_id, reply.decode_worker_id, reply.slo_ttft_ms, reply.slo_tpot_ms)
            self.admission_over(None)  # handed over from a queue: admitted
        self.leader_id = reply.router_id

    def handed_over(self, pool: str) -> None:
        """We stopped leading `pool` and handed it to the new leader, not yet dispatched by it
        (one we dispatched and then re-routed was by us): until its batch.dispatched, it waits
        at a leader."""
        self.leader_pool = pool
        self.dispatched = False

    def start_grace(self, task: asyncio.Task) -> None:
        self.grace_task = task

    def end(self) -> None:
        """Its client has its terminal outcome, or another router answers for it now."""
        self.done = True


STREAM_FIELDS = ("next_index", "output_ids", "ids_known", "first_token_ns", "ahead", "resend_task")  # written by the relay (services/shell/relay.py)
