"""The core's mirror of the inflight ledger: what each worker has been given and not finished.

The Redis ledger (services/shell/ledger.py) is the durable, shared record; this mirror is
what routing reads, folded from the same facts without I/O:
- a prefill batch enters at dispatch with its predicted ms, is marked started by
  `batch.started`, and leaves at `prefill.completed` (returned, so the predictor can learn),
  or when every member has ended without it (`member_ended`: they failed, were cancelled or
  moved before their prefill was reported; a batch kept then would hold its worker under
  backpressure for good: a server that fails every request fast kept its queue held);
- a decode reservation (hard KV = prompt tokens, expected KV = prompt + min(max_tokens, cap))
  enters at dispatch and leaves at the request's terminal event. Once the worker's status
  report lists the request as running, its KV is inside the reported numbers and the
  reservation stops being added on top ("visible"), so it is never counted twice.

Wait estimate (FlexLB's rule): wait_ms = max(0, Σ predicted ms of the worker's inflight
batches − time since the earliest of them started); batches the engine has not started do
not burn time. Invariants (property-tested): counts and reserved tokens never go negative;
a second release of the same entry changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class InflightBatch:
    batch_id: str
    worker_id: str
    predicted_ms: float
    request_ids: list[str]
    members: list[tuple[int, int]]  # (prompt tokens, predicted cached tokens) per request
    dispatched_ns: int
    started_ns: int | None = None
    num_ended: int = 0  # members that reached their terminal outcome before the batch's prefill was reported


@dataclass
class DecodeReservation:
    request_id: str
    worker_id: str
    hard_kv_tokens: int
    expected_kv_tokens: int
    created_ns: int
    tpot_target_ms: float = 0.0  # its TPOT target (0: none)
    first_token_ns: int | None = None  # when its prefill completed (its batch's start + measured ms), once known
    visible: bool = False  # the worker reports it running: its KV is in the reported numbers
    num_missed_reports: int = 0  # consecutive status reports of the worker without it, once visible


@dataclass
class WorkerInflight:
    batches: dict[str, InflightBatch] = field(default_factory=dict)  # batch id -> batch
    reservations: dict[str, DecodeReservation] = field(default_factory=dict)  # request id -> reservation
    num_batch_requests: int = 0  # Σ requests over `batches`
    predicted_ms_total: float = 0.0  # Σ predicted ms over `batches` (re-summed on completion: no drift)
    earliest_started_ns: int | None = None  # min started_ns over `batches` (None: none started)
    hidden_hard_kv_tokens: int = 0  # Σ hard KV of reservations not yet visible
    hidden_expected_kv_tokens: int = 0  # Σ expected KV of reservations not yet visible
    num_visible: int = 0  # reservations the worker reports running

    def num_requests(self, num_queued: int, num_reported_running: int, colocated: bool) -> int:
        """FlexLB's pending count: the requests of ours the worker holds or will hold, each
        once, plus engine tasks we don't know. A request routed to a colocated worker holds a
        reservation there from admission to its end, so its queue and batch entries are not
        counted again; a prefill-only worker holds no reservations; reported running requests
        beyond the visible reservations are the ones we don't know."""
        ours = len(self.reservations) if colocated else len(self.reservations) + self.num_batch_requests + num_queued
        unknown = num_reported_running - self.num_visible
        return ours + unknown if unknown > 0 else ours


    def wait_ms(self, now_ns: int) -> float:
        """FlexLB's rule, O(1) from the aggregates (module docstring)."""
        if not self.batches:
            return 0.0
        total = self.predicted_ms_total
        if self.earliest_started_ns is not None:
            total -= (now_ns - self.earliest_started_ns) / 1e6
        return total if total > 0.0 else 0.0


class InflightLedger:
    def __init__(self) -> None:
        self.workers: dict[str, WorkerInflight] = {}
        self.request_to_worker: dict[str, str] = {}  # request id -> decode worker id
        self.request_to_batch: dict[str, tuple[str, str]] = {}  # request id -> (worker, batch) while that batch is inflight

    def worker(self, worker_id: str) -> WorkerInflight:
        """The worker's entry, created empty if absent (removed only by remove_worker)."""
        return self._w(worker_id)

    def _w(self, worker_id: str) -> WorkerInflight:
        w = self.workers.get(worker_id)
        if w is None:
            w = self.workers[worker_id] = WorkerInflight()
        return w

    # ---------------------------------------------------------------- prefill batches
    def add_batch(self, batch: InflightBatch) -> bool:
        w = self._w(batch.worker_id)
        if batch.batch_id in w.batches:
            return False
        w.batches[batch.batch_id] = batch
        for rid in batch.request_ids:
            self.request_to_batch[rid] = (batch.worker_id, batch.batch_id)
        w.num_batch_requests += len(batch.request_ids)
        w.predicted_ms_total += batch.predicted_ms
        if batch.started_ns is not None and (w.earliest_started_ns is None or batch.started_ns < w.earliest_started_ns):
            w.earliest_started_ns = batch.started_ns
        return True

    def start_batch(self, worker_id: str, batch_id: str, now_ns: int) -> bool:
        w = self.workers.get(worker_id)
        b = w.batches.get(batch_id) if w is not None else None
        if b is None or b.started_ns is not None:
            return False
        b.started_ns = now_ns
        if w.earliest_started_ns is None or now_ns < w.earliest_started_ns:
            w.earliest_started_ns = now_ns
        return True

    def complete_batch(self, worker_id: str, batch_id: str) -> InflightBatch | None:
        w = self.workers.get(worker_id)
        if w is None:
            return None
        b = w.batches.pop(batch_id, None)
        if b is not None:
            for rid in b.request_ids:
                if self.request_to_batch.get(rid) == (worker_id, batch_id):
                    del self.request_to_batch[rid]
            w.num_batch_requests -= len(b.request_ids)
            # Re-summed rather than subtracted, so float error never accumulates (O(batches), once per batch).
            w.predicted_ms_total = sum(x.predicted_ms for x in w.batches.values())
            w.earliest_started_ns = min((x.started_ns for x in w.batches.values() if x.started_ns is not None), default=None)
        return b

    def member_ended(self, request_id: str) -> InflightBatch | None:
        """A request ended: if its prefill batch is still inflight (its prefill not reported)
        and every member has now ended, the batch leaves (returned; nothing to learn from)."""
        where = self.request_to_batch.pop(request_id, None)
        if where is None:
            return None
        w = self.workers.get(where[0])
        b = w.batches.get(where[1]) if w is not None else None
        if b is None:
            return None
        b.num_ended += 1
        return self.complete_batch(*where) if b.num_ended >= len(b.request_ids) else None

    # ---------------------------------------------------------------- decode reservations
    def reserve(self, r: DecodeReservation) -> bool:
        """Reserve once per request id, on one worker; a second reserve changes nothing."""
        if r.request_id in self.request_to_worker:
            return False
        w = self._w(r.worker_id)
        w.reservations[r.request_id] = r
        w.hidden_hard_kv_tokens += r.hard_kv_tokens
        w.hidden_expected_kv_tokens += r.expected_kv_tokens
        self.request_to_worker[r.request_id] = r.worker_id
        return True

    def release(self, request_id: str) -> DecodeReservation | None:
        worker_id = self.request_to_worker.pop(request_id, None)
        if worker_id is None:
            return None
        w = self.workers[worker_id]
        r = w.reservations.pop(request_id)
        if r.visible:
            w.num_visible -= 1
        else:
            w.hidden_hard_kv_tokens -= r.hard_kv_tokens
            w.hidden_expected_kv_tokens -= r.expected_kv_tokens
        return r

    def calibrate(self, worker_id: str, running_request_ids: list[str], settle_after: int = 2) -> list[DecodeReservation]:
        """Status reports are authoritative. A reservation the worker reports becomes visible
        (its KV is in the reported numbers). A visible one the worker then leaves out of
        `settle_after` consecutive reports is settled: released and returned, so the caller
        can end the request (its terminal event was lost). Reservations never reported are
        left to the TTL sweep: their dispatch may still be on its way."""
        w = self.workers.get(worker_id)
        if w is None or not w.reservations:
            return []
        reported = set(running_request_ids)
        settled: list[DecodeReservation] = []
        for rid, r in list(w.reservations.items()):
            if rid in reported:
                r.num_missed_reports = 0
                if not r.visible:
                    r.visible = True
                    w.num_visible += 1
                    w.hidden_hard_kv_tokens -= r.hard_kv_tokens
                    w.hidden_expected_kv_tokens -= r.expected_kv_tokens
            elif r.visible:
                r.num_missed_reports += 1
                if r.num_missed_reports >= settle_after:
                    settled.append(self.release(rid))
        return settled

    def remove_worker(self, worker_id: str) -> WorkerInflight | None:
        w = self.workers.pop(worker_id, None)
        if w is not None:
            for rid in w.reservations:
                self.request_to_worker.pop(rid, None)
            for b in w.batches.values():
                for rid in b.request_ids:
                    if self.request_to_batch.get(rid) == (worker_id, b.batch_id):
                        del self.request_to_batch[rid]
        return w

    # ---------------------------------------------------------------- queries
    def wait_ms(self, worker_id: str, now_ns: int) -> float:
        w = self.workers.get(worker_id)
        return 0.0 if w is None else w.wait_ms(now_ns)

    def reservation(self, request_id: str) -> DecodeReservation | None:
        worker_id = self.request_to_worker.get(request_id)
        return None if worker_id is None else self.workers[worker_id].reservations.get(request_id)

    def num_inflight_batches(self, worker_id: str) -> int:
        w = self.workers.get(worker_id)
        return len(w.batches) if w else 0

    def num_pending_requests(self, worker_id: str) -> int:
        """Requests in inflight prefill batches + decode reservations held on the worker."""
        w = self.workers.get(worker_id)
        return (w.num_batch_requests + len(w.reservations)) if w else 0

    def hidden_kv(self, worker_id: str) -> tuple[int, int]:
        """(hard, expected) KV tokens reserved on the worker and not yet in its reports."""
        w = self.workers.get(worker_id)
        return (w.hidden_hard_kv_tokens, w.hidden_expected_kv_tokens) if w else (0, 0)
