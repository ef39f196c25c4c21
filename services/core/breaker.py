"""Circuit breakers: one per worker, opened by consecutive request failures, so that a server
that fails fast (a bad GPU, a wedged engine whose /health and /metrics still answer) stops
attracting the traffic its empty queue invites.

States and transitions (what SMG and vllm-router do, driven by the router's own events):
- closed: requests go there. Each request failure the worker reports with a code that says
  the server failed it (`COUNTED_CODES`) counts; a success resets the count. At
  `failures_to_open` consecutive failures it opens, unless no other worker of its pool would
  then be closed: a fault upstream of every worker (all of them failing at once) does not
  empty the pool; the requests then fail with the servers' own codes, which say what is
  wrong, instead of `no_worker`.
- open: no new request is placed there, for `open_ms` (the first time; doubled at each
  re-opening, up to `max_open_ms`). After that the next request the policies place there is
  its probe: the breaker is half-open.
- half-open: no other request is placed there until the probe ends. A success (the probe's,
  or any request's it was already running) closes it and resets the back-off; a failure
  re-opens it with the back-off doubled. A probe that ends neither way (cancelled by its
  client, refused) leaves it open with its back-off over, so the next request probes.

Outcomes come from `Scheduler.on_outcome` (journaled: a replay re-makes every transition) with
the time of the event that carried them; nothing here reads a clock. A worker removed from the
fleet keeps its breaker: a worker that comes back under the same id probes first.

Parameters (`BreakerParams`, defaults): failures_to_open 5 (0: breakers off), open_ms 1000,
max_open_ms 30000.
"""

from __future__ import annotations

from dataclasses import dataclass

# Codes with which a worker says the server failed a request. Not counted: what the client
# caused (invalid_request, too_large, cancelled, adapter_not_found), a deadline, and a server's
# "busy" (upstream_refused: 429/503, load the policies already see).
COUNTED_CODES = frozenset({"upstream_error", "worker_failed", "dispatch_failed", "stream_overflow", "internal"})

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"
STATE_VALUES = {CLOSED: 0, HALF_OPEN: 1, OPEN: 2}  # the metric's values
MAX_ERROR_CHARS = 200  # the last error kept per worker (it is echoed in /admin/workers and events)


@dataclass(frozen=True)
class BreakerParams:
    failures_to_open: int = 5  # consecutive counted failures that open a worker's breaker (0: off)
    open_ms: float = 1000.0  # how long it stays open the first time
    max_open_ms: float = 30_000.0  # the doubling back-off's cap

    def validate(self) -> "BreakerParams":
        if self.failures_to_open < 0:
            raise ValueError(f"breaker failures_to_open must be >= 0 (0: off), got {self.failures_to_open!r}")
        if not 0 < self.open_ms <= self.max_open_ms < float("inf"):
            raise ValueError(f"breaker open_ms must be > 0 and <= max_open_ms (finite), got {self.open_ms!r} / "
                             f"{self.max_open_ms!r}")
        return self


@dataclass(frozen=True)
class BreakerChange:
    """A transition, for the event log, metrics and explain."""

    worker_id: str
    from_state: str
    to_state: str
    reason: str
    open_ms: float  # the back-off now (open: how long it stays open)
    num_failures: int  # consecutive counted failures


class Breaker:
    __slots__ = ("state", "num_failures", "opened_ns", "open_ms", "probe_request_id", "last_error", "num_opened")

    def __init__(self, open_ms: float) -> None:
        self.state = CLOSED
        self.num_failures = 0
        self.opened_ns = 0
        self.open_ms = open_ms
        self.probe_request_id = ""
        self.last_error = ""
        self.num_opened = 0

    def probe_due(self, now_ns: int) -> bool:
        return self.state == OPEN and now_ns >= self.opened_ns + int(self.open_ms * 1e6)

    def view(self, now_ns: int) -> dict:
        out = {"state": self.state, "consecutive_failures": self.num_failures, "last_error": self.last_error,
               "times_opened": self.num_opened}
        if self.state == OPEN:
            out["probe_in_ms"] = max(0.0, round((self.opened_ns + self.open_ms * 1e6 - now_ns) / 1e6, 1))
        if self.state == HALF_OPEN:
            out["probe_request_id"] = self.probe_request_id
        return out


class Breakers:
    """Every worker's breaker (created closed on first use)."""

    def __init__(self, params: BreakerParams) -> None:
        self.params = params.validate()
        self.by_worker: dict[str, Breaker] = {}
        self.num_not_closed = 0  # a fast path: 0 -> every worker admits
        self.changes: list[BreakerChange] = []  # every transition, until the shell takes them (take_changes)

    def take_changes(self) -> list[BreakerChange]:
        """The transitions since the last call (an output buffer: what the router reports as
        events and metrics; nothing here reads it)."""
        out, self.changes = self.changes, []
        return out

    def get(self, worker_id: str) -> Breaker:
        b = self.by_worker.get(worker_id)
        if b is None:
            b = self.by_worker[worker_id] = Breaker(self.params.open_ms)
        return b

    def get_view(self, worker_id: str, now_ns: int) -> dict:
        """What /admin/workers shows of it (a worker with no breaker yet: closed, no failure)."""
        b = self.by_worker.get(worker_id)
        return b.view(now_ns) if b is not None else {"state": CLOSED, "consecutive_failures": 0, "last_error": "",
                                                     "times_opened": 0}

    def admits(self, worker_id: str, now_ns: int) -> bool:
        """Whether a new request may be placed there now (closed, or open with its probe due)."""
        b = self.by_worker.get(worker_id)
        return b is None or b.state == CLOSED or b.probe_due(now_ns)

    def is_closed(self, worker_id: str) -> bool:
        b = self.by_worker.get(worker_id)
        return b is None or b.state == CLOSED

    def placed(self, worker_id: str, request_id: str, now_ns: int) -> BreakerChange | None:
        """A request was placed on the worker: if its probe was due, it is the probe."""
        b = self.by_worker.get(worker_id)
        if b is None or not b.probe_due(now_ns):
            return None
        b.probe_request_id = request_id
        return self._move(worker_id, b, HALF_OPEN, f"probe {request_id}")

    def outcome(self, worker_id: str, request_id: str, ok: bool, code: str, message: str, now_ns: int,
                others_closed: bool) -> BreakerChange | None:
        """A request the worker ran succeeded (`ok`) or failed with `code`. `others_closed`:
        another live worker of its pool is closed (else this one does not open)."""
        if self.params.failures_to_open == 0:
            return None
        if ok:
            b = self.by_worker.get(worker_id)
            if b is None:
                return None
            b.num_failures = 0
            if b.state == CLOSED:
                return None
            b.open_ms = self.params.open_ms
            b.probe_request_id = ""
            return self._move(worker_id, b, CLOSED, f"request {request_id} succeeded")
        if code not in COUNTED_CODES:
            return self._probe_ended(worker_id, request_id, now_ns)
        b = self.get(worker_id)
        b.num_failures += 1
        b.last_error = f"{code}: {message}"[:MAX_ERROR_CHARS]
        if b.state == HALF_OPEN:
            b.open_ms = min(self.params.max_open_ms, b.open_ms * 2)
            return self._open(worker_id, b, now_ns, f"request {request_id} failed while half-open ({code})")
        if b.state == CLOSED and b.num_failures >= self.params.failures_to_open:
            if not others_closed:
                return None  # the last closed worker of its pool: it stays (module docstring)
            return self._open(worker_id, b, now_ns, f"{b.num_failures} consecutive failures ({code})")
        return None

    def ended(self, request_id: str) -> BreakerChange | None:
        """A request left the router (any outcome): if it was still some worker's probe, it
        ended neither way (cancelled, refused, moved, its worker's answer lost), and that worker
        is open again with its back-off over (the next request placed there probes)."""
        for worker_id, b in self.by_worker.items():
            if b.state == HALF_OPEN and b.probe_request_id == request_id:
                return self._probe_ended(worker_id, request_id)
        return None

    def _probe_ended(self, worker_id: str, request_id: str, now_ns: int = 0) -> BreakerChange | None:
        b = self.by_worker.get(worker_id)
        if b is None or b.state != HALF_OPEN or b.probe_request_id != request_id:
            return None
        b.probe_request_id = ""
        b.opened_ns = 0  # its back-off is over: due at once
        return self._move(worker_id, b, OPEN, f"probe {request_id} ended without an answer")

    def _open(self, worker_id: str, b: Breaker, now_ns: int, reason: str) -> BreakerChange:
        b.opened_ns = now_ns
        b.probe_request_id = ""
        b.num_opened += 1
        return self._move(worker_id, b, OPEN, reason)

    def _move(self, worker_id: str, b: Breaker, to: str, reason: str) -> BreakerChange:
        before = b.state
        if before == CLOSED and to != CLOSED:
            self.num_not_closed += 1
        elif before != CLOSED and to == CLOSED:
            self.num_not_closed -= 1
        b.state = to
        change = BreakerChange(worker_id, before, to, reason, b.open_ms, b.num_failures)
        self.changes.append(change)
        return change
