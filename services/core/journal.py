"""The core's journal: every call that changes a scheduler's state, with its inputs and a
summary of what it decided, in call order. Replaying the calls through a fresh `Scheduler`
with the recorded configuration rebuilds its state at any instant and re-makes every
decision; comparing the summaries checks that the core is pure and the journal complete.

Pure like the rest of the core: `Recorder` hands records to a sink the shell provides (it
publishes them as `core.recorded` events), `replay` folds records it is given.

One table (`OPS`) says, per operation, how its arguments become builtins and back, and how
its result is summarized — the recorder and the replayer use the same entries, so a
summary differs only if the decision did. Reads (`view`, `batchers`, `holds_work`,
`next_due_ns`, ...) are not journaled: they change nothing. Randomness needs nothing extra:
each decision draws from `decision_seed(config.seed, decision_seq)`, and the sequence is
part of the state the replay rebuilds.

Decisions (counted by replay): admissions, ticks that formed batches or failed requests,
liveness cycles that killed or expired workers, worker removals, and status reports that
settled requests. Every other record is compared too: any difference is a divergence.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from schemas import messages as m
from services.core.admission import Released
from services.core.fairness import Queued, Refused
from services.core.scheduler import AdmitRequest, Admitted, Rejected, Scheduler, SchedulerConfig, SyncResult, TickResult

Sink = Callable[[str, int, dict[str, Any], dict[str, Any]], None]  # (op, now_ns, args, out)


# ------------------------------------------------------------------ summaries
def _decisions(decisions) -> list[list[Any]]:
    return [[d.stage, d.policy, d.decision_seq, d.seed, d.pick.worker_id] for d in decisions]


def summarize_admit(res: Admitted | Rejected) -> dict[str, Any]:
    if isinstance(res, Admitted):
        return {"ok": True, "prefill": res.request.prefill_worker_id, "decode": res.request.decode_worker_id,
                "cached": res.request.num_cached_tokens, "predicted_ttft_ms": res.predicted_ttft_ms,
                "slo_ttft_ms": res.slo_ttft_ms, "slo_tpot_ms": res.slo_tpot_ms, "best_effort": res.best_effort,
                "decisions": _decisions(res.decisions)}
    out = {"ok": False, "code": res.code, "predicted_ttft_ms": res.predicted_ttft_ms,
           "decisions": _decisions(res.decisions)}
    if res.code == "slo_unattainable":  # why: the best worker's predictions against the targets
        out["refusal"] = {"worker": res.best_worker_id, "predicted_ttft_ms": res.predicted_ttft_ms,
                          "slo_ttft_ms": res.slo_ttft_ms, "predicted_tpot_ms": res.predicted_tpot_ms,
                          "slo_tpot_ms": res.slo_tpot_ms}
    return out


def summarize_offer(res) -> dict[str, Any]:
    if isinstance(res, Queued):
        return {"queued": True, "class": res.priority_class, "tenant": res.tenant,
                "evicted": res.evicted.request_id if res.evicted is not None else None}
    if isinstance(res, Refused):
        return {"refused": res.code, "class": res.priority_class, "tenant": res.tenant}
    return summarize_admit(res)


def summarize_release(res: list[Released]) -> dict[str, Any]:
    out = []
    for r in res:
        rec = r.record
        if isinstance(rec, Refused):
            out.append([r.pool, rec.request_id, "refused", rec.code])
        else:
            out.append([r.pool, rec.request_id, rec.reason, rec.tenant, round(rec.counter_after, 6),
                        summarize_admit(r.outcome)])
    return {"released": out}


def _failure(f) -> list[Any]:
    if f.code != "slo_unattainable":
        return [f.item.request_id, f.code]
    return [f.item.request_id, f.code, {"worker": f.best_worker_id, "predicted_ttft_ms": f.predicted_ttft_ms,
                                        "slo_ttft_ms": f.slo_ttft_ms, "predicted_tpot_ms": f.predicted_tpot_ms,
                                        "slo_tpot_ms": f.slo_tpot_ms}]


def summarize_tick(res: TickResult) -> dict[str, Any]:
    if not res.batches and not res.failures and not res.moves:  # (most ticks)
        return {"batches": [], "failures": []}
    out = {"batches": [[b.batch_id, b.worker_id, [i.request_id for i in b.items], b.reason, b.predicted_ms]
                       for b in res.batches],
           "failures": [_failure(f) for f in res.failures]}
    if res.moves:  # (absent before moves existed: old journals' ticks summarize as they did)
        out["moves"] = [[mv.item.request_id, mv.from_worker_id, mv.item.prefill_worker_id, mv.decision.decision_seq]
                        for mv in res.moves]
    return out


def summarize_sync(res: SyncResult) -> dict[str, Any]:
    return {"dead": list(res.dead), "expired": list(res.expired), "orphans": [i.request_id for i in res.orphans]}


def _event_out(e) -> dict[str, Any]:
    return msgspec.to_builtins(e)


_TAG_TO_TYPE = {m.tag_of(t): t for t in m.PAYLOAD_TYPES}


def _event_in(d: dict[str, Any]):
    """Builtins back to the event (to its concrete type by tag: 6x faster than via the union)."""
    cls = _TAG_TO_TYPE.get(d.get("type"))
    return msgspec.convert(d, cls) if cls is not None else msgspec.convert(d, m.Payload)


def _request_out(req: AdmitRequest) -> dict[str, Any]:
    out = {"request_id": req.request_id, "num_prompt_tokens": req.num_prompt_tokens, "max_tokens": req.max_tokens,
           "block_hashes": list(req.block_hashes), "priority": req.priority, "slo_ttft_ms": req.slo_ttft_ms,
           "slo_tpot_ms": req.slo_tpot_ms, "model": req.model, "tenant": req.tenant, "priority_class": req.priority_class}
    if req.best_effort:
        out["best_effort"] = True
    if req.excluded_workers:
        out["excluded_workers"] = list(req.excluded_workers)
    if req.engine_fields:
        out["engine_fields"] = list(req.engine_fields)
    if req.embeddings:
        out["embeddings"] = True
    return out


def request_from_builtins(d: dict[str, Any]) -> AdmitRequest:
    return AdmitRequest(request_id=d["request_id"], num_prompt_tokens=d["num_prompt_tokens"], max_tokens=d["max_tokens"],
                        block_hashes=tuple(d["block_hashes"]), priority=d["priority"], slo_ttft_ms=d["slo_ttft_ms"],
                        slo_tpot_ms=d["slo_tpot_ms"], model=d.get("model", ""),  # (no model: recorded before pools)
                        tenant=d.get("tenant", ""), priority_class=d.get("priority_class", ""),
                        best_effort=d.get("best_effort", False), excluded_workers=tuple(d.get("excluded_workers", ())),
                        engine_fields=tuple(d.get("engine_fields", ())), embeddings=d.get("embeddings", False))


# ------------------------------------------------------------------ the operations
@dataclass(frozen=True)
class Op:
    """Run one journaled call on a scheduler from builtin args; return (result, out)."""

    run: Callable[[Scheduler, int, dict[str, Any]], tuple[Any, dict[str, Any]]]
    is_decision: Callable[[dict[str, Any]], bool] = lambda out: False


def _worker_event(s: Scheduler, now: int, a: dict[str, Any]):
    before = len(s.settled)
    info = s.on_worker_event(_event_in(a["event"]), now, a["stale"])
    return info, {"settled": [list(x) for x in s.settled[before:]]}


OPS: dict[str, Op] = {
    "on_worker_event": Op(_worker_event, lambda out: bool(out["settled"])),
    "on_kv_event": Op(lambda s, now, a: (u := s.on_kv_event(_event_in(a["event"])), {"status": u.status})),
    "admit": Op(lambda s, now, a: (r := s.admit(request_from_builtins(a["request"]), now), summarize_admit(r)),
                lambda out: True),
    "tick": Op(lambda s, now, a: (r := s.tick(now), summarize_tick(r)),
               lambda out: bool(out["batches"] or out["failures"] or out.get("moves"))),
    "sync": Op(lambda s, now, a: (r := s.sync(now), summarize_sync(r)),
               lambda out: bool(out["dead"] or out["expired"] or out["orphans"])),
    "on_batch_started": Op(lambda s, now, a: (r := s.on_batch_started(a["worker_id"], a["batch_id"], now), {"ok": r})),
    "on_prefill_completed": Op(lambda s, now, a: (
        r := s.on_prefill_completed(a["worker_id"], a["batch_id"], a["measured_ms"], a["num_cached_tokens"]),
        {"ok": r is not None})),
    "on_terminal": Op(lambda s, now, a: (r := s.on_terminal(a["request_id"], a.get("num_output_tokens"), a.get("tpot_ms")),
                                         {"ok": r})),
    "offer": Op(lambda s, now, a: (r := s.offer(request_from_builtins(a["request"]), now), summarize_offer(r)),
                lambda out: True),
    "release": Op(lambda s, now, a: (r := s.release(now), summarize_release(r)), lambda out: bool(out["released"])),
    "cancel_waiting": Op(lambda s, now, a: (r := s.cancel_waiting(a["request_id"], now), {"cancelled": r is not None})),
    "drain_waiting": Op(lambda s, now, a: (r := s.drain_waiting(now), {"items": r})),
    "remove_queued": Op(lambda s, now, a: (r := s.remove_queued(a["request_id"]), {"removed": r is not None})),
    "remove_worker": Op(lambda s, now, a: (r := s.remove_worker(a["worker_id"]), {"orphans": [i.request_id for i in r]}),
                        lambda out: True),
    "rollback_ids": Op(lambda s, now, a: (s.rollback_ids(a["worker_id"], a["batch_id"], a["request_ids"]), {})),
    "forget_batch": Op(lambda s, now, a: (s.forget_batch(a["worker_id"], a["batch_id"]), {})),
    "drain_queues": Op(lambda s, now, a: (r := s.drain_queues(), {"items": [i.request_id for i in r]})),
    "set_drain_flags": Op(lambda s, now, a: (s.set_drain_flags(set(a["worker_ids"])), {})),
    "mark_dead": Op(lambda s, now, a: (s.mark_dead(a["worker_id"]), {})),
    "on_outcome": Op(lambda s, now, a: (
        r := s.on_outcome(a["request_id"], a["worker_id"], a["ok"], a["code"], a["message"], now),
        {"breaker": [r.from_state, r.to_state] if r is not None else None}), lambda out: out["breaker"] is not None),
    "take_settled": Op(lambda s, now, a: (r := s.take_settled(), {"settled": [list(x) for x in r]})),
}


def config_builtins(config: SchedulerConfig) -> dict[str, Any]:
    return msgspec.to_builtins(config)


def config_from_builtins(d: dict[str, Any]) -> SchedulerConfig:
    return msgspec.convert(d, SchedulerConfig)


# ------------------------------------------------------------------ recording
class Recorder:
    """A Scheduler whose state-changing calls are journaled. It wraps the core's interface
    explicitly: each state-changing method of Scheduler has its recording method below, and
    what callers may read through it is named in READS; any other name raises AttributeError,
    so a new core method cannot be called unjournaled (and replays diverge later) without
    anyone noticing. tests/unit/services/core/test_journal.py fails while a public Scheduler method is
    neither recorded here nor in READS."""

    # Queries and views: none changes what the core decides. decode_model and predictor build
    # a worker's default model on first use, as the core does itself, in dicts nothing iterates.
    # Not here, on purpose: `batcher` and `load` (they create a worker's batcher, whose order in
    # `batchers` is the order tick polls them) and `rollback_ids` (recorded as `rollback`).
    READS = frozenset({
        "block_size_tokens", "breakers", "step_ratios", "decode_model", "engine_load", "holds_work", "next_due_ns", "pool_room", "predictor",
        "batchers", "config", "fair", "id_prefix", "index", "inflight", "ledger", "poll_errors", "queued", "settled",
        "view",
    })

    def __init__(self, scheduler: Scheduler, sink: Sink) -> None:
        self._s = scheduler
        self._sink = sink
        sink("config", 0, {"config": config_builtins(scheduler.config), "id_prefix": scheduler.id_prefix}, {})

    def __getattr__(self, name: str) -> Any:
        if name in Recorder.READS:
            return getattr(self._s, name)
        raise AttributeError(f"Scheduler.{name} is neither recorded by the journal's Recorder nor declared "
                             "read-only in Recorder.READS (services/core/journal.py)")

    def _call(self, op: str, now_ns: int, args: dict[str, Any]) -> Any:
        """Apply `op` from builtin `args` (the same entry replay uses) and record it."""
        result, out = OPS[op].run(self._s, now_ns, args)
        self._sink(op, now_ns, args, out)
        return result

    def on_worker_event(self, event, now_ns: int, stale: bool = False):
        before = len(self._s.settled)
        info = self._s.on_worker_event(event, now_ns, stale)
        self._sink("on_worker_event", now_ns, {"event": _event_out(event), "stale": stale},
                   {"settled": [list(x) for x in self._s.settled[before:]]})
        return info

    def on_kv_event(self, event):
        update = self._s.on_kv_event(event)
        self._sink("on_kv_event", 0, {"event": _event_out(event)}, {"status": update.status})
        return update

    def admit(self, req: AdmitRequest, now_ns: int):
        res = self._s.admit(req, now_ns)
        self._sink("admit", now_ns, {"request": _request_out(req)}, summarize_admit(res))
        return res

    def tick(self, now_ns: int) -> TickResult:
        return self._call("tick", now_ns, {})

    def sync(self, now_ns: int) -> SyncResult:
        return self._call("sync", now_ns, {})

    def on_batch_started(self, worker_id: str, batch_id: str, now_ns: int) -> bool:
        return self._call("on_batch_started", now_ns, {"worker_id": worker_id, "batch_id": batch_id})

    def on_prefill_completed(self, worker_id: str, batch_id: str, measured_ms: float, num_cached_tokens: int):
        return self._call("on_prefill_completed", 0, {"worker_id": worker_id, "batch_id": batch_id,
                                                      "measured_ms": measured_ms, "num_cached_tokens": num_cached_tokens})

    def on_outcome(self, request_id: str, worker_id: str, ok: bool, code: str, message: str, now_ns: int):
        return self._call("on_outcome", now_ns, {"request_id": request_id, "worker_id": worker_id, "ok": ok, "code": code,
                                                 "message": message})

    def on_terminal(self, request_id: str, num_output_tokens: int | None = None, tpot_ms: float | None = None) -> bool:
        args: dict[str, Any] = {"request_id": request_id}
        if num_output_tokens is not None:  # (journals before the fair queue have none)
            args["num_output_tokens"] = num_output_tokens
        if tpot_ms is not None:  # (nor before the TPOT calibration)
            args["tpot_ms"] = tpot_ms
        return self._call("on_terminal", 0, args)

    def offer(self, req: AdmitRequest, now_ns: int):
        res = self._s.offer(req, now_ns)
        # Admitted or rejected at once, the offer was an admission (the queue was only read):
        # journaled as one, so what reads journals for arrivals (replay, explain, what-if)
        # sees one kind of arrival whether the fair queue is on or off.
        op = "admit" if isinstance(res, (Admitted, Rejected)) else "offer"
        self._sink(op, now_ns, {"request": _request_out(req)}, summarize_offer(res))
        return res

    def release(self, now_ns: int) -> list[Released]:
        return self._call("release", now_ns, {})

    def cancel_waiting(self, request_id: str, now_ns: int):
        return self._call("cancel_waiting", now_ns, {"request_id": request_id})

    def drain_waiting(self, now_ns: int) -> list[str]:
        return self._call("drain_waiting", now_ns, {})

    def remove_queued(self, request_id: str):
        return self._call("remove_queued", 0, {"request_id": request_id})

    def remove_worker(self, worker_id: str):
        return self._call("remove_worker", 0, {"worker_id": worker_id})

    def rollback(self, batch) -> None:
        self._call("rollback_ids", 0, {"worker_id": batch.worker_id, "batch_id": batch.batch_id,
                                       "request_ids": [i.request_id for i in batch.items]})

    def forget_batch(self, worker_id: str, batch_id: str) -> None:
        self._call("forget_batch", 0, {"worker_id": worker_id, "batch_id": batch_id})

    def drain_queues(self):
        return self._call("drain_queues", 0, {})

    def set_drain_flags(self, worker_ids: set[str]) -> None:
        self._call("set_drain_flags", 0, {"worker_ids": sorted(worker_ids)})

    def mark_dead(self, worker_id: str) -> None:
        self._call("mark_dead", 0, {"worker_id": worker_id})

    def take_settled(self):
        return self._call("take_settled", 0, {})


# ------------------------------------------------------------------ replay
@dataclass
class Divergence:
    index: int  # position of the record in its journal (0 = the config record)
    seq: int  # the envelope's seq
    op: str
    now_ns: int
    args: dict[str, Any]
    recorded: dict[str, Any]
    remade: dict[str, Any]


@dataclass
class ReplayReport:
    router_id: str
    boot_id: str
    events: int = 0  # records folded
    decisions: int = 0
    matched: int = 0  # decisions whose re-made summary equals the recorded one
    records_matched: int = 0  # all records, decisions or not
    first_divergence: Divergence | None = None
    gaps: list[tuple[int, int]] = field(default_factory=list)  # missing envelope seqs (first, last)
    errors: list[str] = field(default_factory=list)
    scheduler: Scheduler | None = None  # the state at the end (or at `until_ns`)
    last_now_ns: int = 0


def replay(records: Iterable[m.Envelope], until_ns: int | None = None,
           on_record: Callable[[int], None] | None = None) -> ReplayReport:
    """Fold one router boot's journal (envelopes of `core.recorded`, in seq order, starting
    with its `config` record) through a fresh Scheduler. With `until_ns`, stop before the
    first record stamped later (the state "at" that instant)."""
    report: ReplayReport | None = None
    s: Scheduler | None = None
    last_seq = 0
    # (The loop is the replay's own overhead per record: counters live in locals and are
    # stored in the report once at the end; a decision's kind is read from the recorded
    # summary, and from the re-made one only when they differ.)
    events = decisions = matched = records_matched = 0
    last_now_ns = 0
    divergence: Divergence | None = None
    ops_get = OPS.get
    for index, env in enumerate(records):
        rec = env.payload
        if not isinstance(rec, m.CoreRecorded):
            continue
        if report is None:
            report = ReplayReport(router_id=rec.router_id, boot_id=env.event_id.split(":")[1] if ":" in env.event_id else "")
        seq = env.seq
        if last_seq and seq != last_seq + 1:
            report.gaps.append((last_seq + 1, seq - 1))
        last_seq = seq
        now_ns = rec.now_ns
        if until_ns is not None and now_ns and now_ns > until_ns:
            break
        events += 1
        if on_record is not None and not events & 1023:  # (a progress bar: every 1,024 records)
            on_record(index)
        op = ops_get(rec.op)
        if op is None:
            if rec.op == "config":
                s = Scheduler(config_from_builtins(rec.args["config"]), id_prefix=rec.args["id_prefix"])
                records_matched += 1
                continue
            report.errors.append(f"record {seq}: unknown op {rec.op!r}")
            continue
        if s is None:
            report.errors.append(f"record {seq} ({rec.op}) before any config record: the journal starts mid-run")
            break
        try:
            out = op.run(s, now_ns, rec.args)[1]
        except (ValueError, KeyError, TypeError, msgspec.ValidationError) as exc:  # a corrupt record: say which
            out = {"error": f"{type(exc).__name__}: {exc}"}
        recorded = rec.out
        if out == recorded:  # (summaries hold only JSON types: lists, dicts, str, int, float, bool, None)
            records_matched += 1
            if op.is_decision(recorded):
                decisions += 1
                matched += 1
        else:
            if op.is_decision(recorded) or op.is_decision(out):
                decisions += 1
            if divergence is None:
                divergence = Divergence(index, seq, rec.op, now_ns, rec.args, recorded, out)
        if now_ns > last_now_ns:
            last_now_ns = now_ns
    if report is None:
        report = ReplayReport(router_id="", boot_id="", errors=["no core.recorded events"])
    report.events, report.decisions, report.matched, report.records_matched = events, decisions, matched, records_matched
    report.first_divergence, report.last_now_ns = divergence, last_now_ns
    report.scheduler = s
    return report


def split_journals(envs: Iterable[m.Envelope]) -> dict[tuple[str, str], list[m.Envelope]]:
    """Group `core.recorded` envelopes by (router id, boot), each in seq order."""
    out: dict[tuple[str, str], list[m.Envelope]] = {}
    for env in envs:
        if isinstance(env.payload, m.CoreRecorded):
            boot = env.event_id.split(":")[1] if env.event_id.count(":") >= 2 else ""
            out.setdefault((env.payload.router_id, boot), []).append(env)
    for records in out.values():
        records.sort(key=lambda e: e.seq)
    return out
