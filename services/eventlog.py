"""The event log as a flight recorder: `flexlb events export|tail`, `flexlb replay`,
`flexlb explain`.

Export file: gzip'd JSON lines (plain JSON lines if the name does not end in .gz). Line 1 is
a header — {"flexlb_export": 1, "schema_version", "code_version", "exported_at_ns",
"streams": {name: {"first_seq", "last_seq", "exported", "truncated", "note"}}, "config"} —
then one envelope per line exactly as it travelled on the bus. Streams: FLEXLB_JOURNAL (the
core journal, what replay folds) and FLEXLB_EVENTS (lifecycle, decisions, KV, admin: what
explain reads besides the journal). A stream whose oldest messages retention already
deleted is exported from its first remaining message and marked `truncated` in the header
and on stderr: never skipped silently.

`--since` / `--until`: a stream sequence number (an integer below 10^12), an ISO-8601 time,
or seconds since the epoch.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from importlib import metadata
from typing import Any, TextIO

import msgspec

from schemas import messages as m
from schemas.subjects import EVENTS_STREAM, JOURNAL_STREAM, nats_servers
from services.core.journal import OPS, ReplayReport, config_from_builtins, replay, request_from_builtins, split_journals
from services.core.scheduler import Admitted, Scheduler

log = logging.getLogger("flexlb.eventlog")
EXPORT_FORMAT = 1
SEQ_LIMIT = 10**12  # below: a sequence number; above: a time


def code_version() -> str:
    try:
        return metadata.version("flexlb")
    except metadata.PackageNotFoundError:
        return "unknown"


def parse_point(text: str | None) -> tuple[str, int] | None:
    """("seq", n) | ("time", ns) | None. Raises ValueError naming the value."""
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        try:
            return "time", int(datetime.fromisoformat(text).timestamp() * 1e9)
        except ValueError:
            raise ValueError(f"not a sequence number, an ISO-8601 time or epoch seconds: {text!r}") from None
    if value.is_integer() and 0 <= value < SEQ_LIMIT:
        return "seq", int(value)
    return "time", int(value * 1e9)


async def _nats_error(exc: Exception) -> None:
    """The client's error callback: a connection failure surfaces as the exception of
    connect() (the CLI prints it in one line); here it is only logged at debug level."""
    log.debug("nats: %s: %s", type(exc).__name__, exc)


# ------------------------------------------------------------------ export
@dataclass
class StreamExport:
    first_seq: int = 0
    last_seq: int = 0
    exported: int = 0
    truncated: bool = False
    note: str = ""


# JetStream answers "service unavailable" while a clustered stream elects a leader (a node
# restarted: seconds); an export then asks again for up to this long, saying so, before failing.
ELECTION_WAIT_S = 15.0


async def _while_electing(call, what: str):
    """`await call()`, asked again while JetStream is unavailable, for up to ELECTION_WAIT_S."""
    from nats.js.errors import ServiceUnavailableError

    deadline = time.monotonic() + ELECTION_WAIT_S
    while True:
        try:
            return await call()
        except ServiceUnavailableError:
            if time.monotonic() >= deadline:
                raise
            print(f"flexlb events: JetStream unavailable for {what} (a stream electing its leader?); "
                  "asking again", file=sys.stderr)
            await asyncio.sleep(0.5)


async def read_stream(nats_url: str, stream: str = EVENTS_STREAM.name) -> list[m.Envelope]:
    """Every message of a stream, decoded, in stream order (direct gets by sequence): what
    the bench and the tests read a run's events from. Deleted messages (a work queue's acked
    ones, a purge) are skipped, and so are ones that do not decode (poison messages put in a
    shared log on purpose)."""
    import nats

    nc = await nats.connect(nats_servers(nats_url))
    try:
        js = nc.jetstream()
        info = await _while_electing(lambda: js.stream_info(stream), f"{stream}'s info")
        out = []
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            try:
                raw = await _while_electing(lambda: js.get_msg(stream, seq), f"{stream}'s message {seq}")
            except nats.js.errors.NotFoundError:
                continue
            try:
                out.append(m.decode(raw.data))
            except m.DecodeError:
                continue
        return out
    finally:
        await nc.close()


async def export(nats_url: str, out_path: str, streams: list[str], since: str | None = None, until: str | None = None,
                 progress: bool = True) -> dict[str, Any]:
    import nats
    from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
    from rich.progress import Progress

    since_p, until_p = parse_point(since), parse_point(until)
    nc = await nats.connect(nats_servers(nats_url), connect_timeout=5, max_reconnect_attempts=2, allow_reconnect=False,
                            error_cb=_nats_error)
    js = nc.jetstream()
    header: dict[str, Any] = {"flexlb_export": EXPORT_FORMAT, "schema_version": m.SCHEMA_VERSION,
                              "code_version": code_version(), "exported_at_ns": time.time_ns(), "streams": {},
                              "config": None}
    lines: list[bytes] = []
    try:
        for stream in streams:
            info = await _while_electing(lambda: js.stream_info(stream), f"{stream}'s info")
            st = StreamExport(first_seq=info.state.first_seq, last_seq=info.state.last_seq)
            header["streams"][stream] = st
            if info.state.messages == 0:
                st.note = "empty"
                continue
            start_seq = st.first_seq
            if since_p and since_p[0] == "seq":
                start_seq = max(since_p[1], st.first_seq)
                if since_p[1] < st.first_seq:
                    st.truncated = True
                    st.note = f"asked from seq {since_p[1]}, but retention already deleted up to {st.first_seq - 1}"
            elif st.first_seq > 1 and not since_p:
                st.truncated = True
                st.note = f"retention already deleted seqs 1..{st.first_seq - 1}"
            if st.truncated:
                print(f"flexlb events export: {stream} is TRUNCATED: {st.note}", file=sys.stderr)
            cfg = ConsumerConfig(ack_policy=AckPolicy.NONE, deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
                                 opt_start_seq=start_seq, max_ack_pending=-1)
            if since_p and since_p[0] == "time":
                cfg = ConsumerConfig(ack_policy=AckPolicy.NONE, deliver_policy=DeliverPolicy.BY_START_TIME,
                                     opt_start_time=datetime.fromtimestamp(since_p[1] / 1e9).astimezone().isoformat())
            sub = await _while_electing(lambda: js.pull_subscribe(">", durable=None, stream=stream, config=cfg),
                                        f"a consumer on {stream}")
            total = st.last_seq - start_seq + 1
            with Progress(disable=not progress or total < 10_000, transient=True) as bar:
                task = bar.add_task(f"export {stream}", total=total)
                done = False
                while not done:
                    try:  # (a node restarted: the consumer's stream may still be electing its leader)
                        msgs = await _while_electing(lambda: sub.fetch(batch=1000, timeout=2.0), f"{stream}'s messages")
                    except asyncio.TimeoutError:
                        break
                    for msg in msgs:
                        seq = msg.metadata.sequence.stream
                        if until_p and ((until_p[0] == "seq" and seq > until_p[1]) or
                                        (until_p[0] == "time" and msg.metadata.timestamp.timestamp() * 1e9 > until_p[1])):
                            done = True
                            break
                        lines.append(msg.data)
                        st.exported += 1
                        if seq >= st.last_seq:
                            done = True
                    bar.update(task, advance=len(msgs))
            await sub.unsubscribe()
    finally:
        await nc.close()
    for raw in lines:  # the configuration in force: the first journal config record
        if b'"op":"config"' in raw:
            header["config"] = m.decode(raw).payload.args
            break
    header["streams"] = {k: msgspec.to_builtins(v) for k, v in header["streams"].items()}
    opener = gzip.open if out_path.endswith(".gz") else open
    with opener(out_path, "wb") as f:
        f.write(json.dumps(header).encode() + b"\n")
        for raw in lines:
            f.write(raw.rstrip(b"\n") + b"\n")
    return header


def read_export(path: str, only: tuple[type, ...] = (), progress: bool = False) -> tuple[dict[str, Any], list[m.Envelope], int]:
    """(header, envelopes, undecodable lines). A file without a header is read too (a plain
    JSON-lines capture); an unreadable line is counted, never silently dropped. With `only`
    (payload types), lines that do not name one of their tags are not decoded at all (replay
    reads only the journal: its other lines are half the file); a journal line damaged so
    badly that its tag is gone shows up as a gap in the journal's sequence. `progress`: a
    bar over the file's bytes for files over 20 MB (in a terminal)."""
    from rich.progress import Progress

    header: dict[str, Any] = {}
    envs: list[m.Envelope] = []
    bad = 0
    markers = [b'"' + m.tag_of(t).encode() + b'"' for t in only]  # (any JSON spacing: a hand-edited line too)
    size = os.path.getsize(path)
    with open(path, "rb") as raw, Progress(disable=not progress or size < 20_000_000, transient=True) as bar, \
            (gzip.GzipFile(fileobj=raw) if path.endswith(".gz") else raw) as f:
        task = bar.add_task(f"read {os.path.basename(path)}", total=size)
        for i, line in enumerate(f):
            if not i & 4095:
                bar.update(task, completed=raw.tell())
            if not line.strip():
                continue
            if i == 0 and b'"flexlb_export"' in line:
                header = json.loads(line)
                continue
            if markers and not any(marker in line for marker in markers):
                continue
            try:
                envs.append(m.decode(line))
            except m.DecodeError:
                bad += 1
    return header, envs, bad


# ------------------------------------------------------------------ replay
def replay_file(path: str, router: str | None = None, until: str | None = None,
                progress: bool = True) -> tuple[dict[str, Any], list[ReplayReport]]:
    from rich.progress import Progress

    header, envs, bad = read_export(path, only=(m.CoreRecorded,), progress=progress)
    journals = split_journals(envs)
    if router:
        journals = {k: v for k, v in journals.items() if k[0] == router}
    until_p = parse_point(until)
    until_ns = until_p[1] if until_p else None
    reports = []
    with Progress(disable=not progress or len(envs) < 20_000, transient=True) as bar:
        for (router_id, boot), records in journals.items():
            task = bar.add_task(f"replay {router_id}/{boot}", total=len(records))
            reports.append(replay(records, until_ns=until_ns, on_record=lambda i: bar.update(task, completed=i)))
    summary = {
        "file": path, "undecodable_lines": bad, "journals": len(reports),
        "events": sum(r.events for r in reports), "decisions": sum(r.decisions for r in reports),
        "matched": sum(r.matched for r in reports),
        "first_divergence": next((_divergence_json(r) for r in reports if r.first_divergence), None),
        "gaps": [[r.router_id, r.boot_id, a, b] for r in reports for a, b in r.gaps],
        "errors": [e for r in reports for e in r.errors],
    }
    return summary, reports


def _divergence_json(r: ReplayReport) -> dict[str, Any]:
    d = r.first_divergence
    return {"router_id": r.router_id, "boot_id": r.boot_id, "index": d.index, "seq": d.seq, "op": d.op, "now_ns": d.now_ns,
            "args": _abbrev(d.args), "recorded": d.recorded, "remade": d.remade}


def _abbrev(args: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in args.items():
        if isinstance(v, dict):
            out[k] = _abbrev(v)
        elif isinstance(v, list) and len(v) > 8:
            out[k] = [*v[:4], f"... {len(v)} items"]
        else:
            out[k] = v
    return out


def print_replay(summary: dict[str, Any], out: TextIO = sys.stdout) -> None:
    out.write(f"{summary['events']} records in {summary['journals']} journal(s); "
              f"{summary['matched']}/{summary['decisions']} decisions identical\n")
    for g in summary["gaps"]:
        out.write(f"INCOMPLETE: {g[0]}/{g[1]} journal seqs {g[2]}..{g[3]} missing\n")
    for e in summary["errors"]:
        out.write(f"ERROR: {e}\n")
    if summary["undecodable_lines"]:
        out.write(f"{summary['undecodable_lines']} undecodable lines\n")
    d = summary["first_divergence"]
    if d is None:
        out.write("no divergence\n")
        return
    out.write(f"first divergence: record {d['index']} (seq {d['seq']}) {d['op']} at {d['now_ns']}\n")
    out.write(f"  input:    {json.dumps(d['args'])[:400]}\n")
    keys = sorted(set(d["recorded"]) | set(d["remade"]))
    out.write(f"  {'field':<18} {'recorded':<40} re-made\n")
    for k in keys:
        a, b = d["recorded"].get(k), d["remade"].get(k)
        mark = " " if a == b else "*"
        out.write(f"{mark} {k:<18} {json.dumps(a)[:40]:<40} {json.dumps(b)[:60]}\n")


def show_state(s: Scheduler, what: str, out: TextIO = sys.stdout) -> dict[str, Any]:
    """The core's state after a replay: workers | ledger | queues | index."""
    if what == "workers":
        data = {w.worker_id: {"role": w.role, "liveness": w.liveness, "state": w.state, "draining": w.draining,
                              "missed_syncs": w.num_missed_syncs, "free_kv_blocks": w.num_free_kv_blocks,
                              "running": w.num_running_requests} for w in s.view.workers.values()}
    elif what == "ledger":
        data = {wid: {"batches": {b.batch_id: {"predicted_ms": b.predicted_ms, "requests": b.request_ids,
                                               "started": b.started_ns is not None} for b in w.batches.values()},
                      "reservations": sorted(w.reservations), "hidden_hard_kv_tokens": w.hidden_hard_kv_tokens}
                for wid, w in s.ledger.workers.items()}
    elif what == "queues":
        data = {wid: [i.request_id for i in b.items_view.values()] for wid, b in s.batchers.items()}
    elif what == "index":
        data = {wid: {"blocks": n, "awaiting_resync": s.index.needs_resync(wid)} for wid, n in s.index.block_counts.items()}
    else:
        raise ValueError(f"--show must be workers, ledger, queues or index, got {what!r}")
    out.write(json.dumps(data, indent=2, default=str) + "\n")
    return data


# ------------------------------------------------------------------ explain
@dataclass
class Step:
    t_ns: int
    source: str  # "journal" | "events"
    what: str
    detail: dict[str, Any] = field(default_factory=dict)


def explain_file(path: str, request_id: str) -> dict[str, Any]:
    """The request's timeline from an export: arrival and admission (re-made through the core,
    with every candidate's score components and filters), the batch it joined and why it
    left when it did, worker deaths and re-routes, worker events, the terminal outcome."""
    _, envs, _ = read_export(path)
    steps: list[Step] = []
    for (router_id, boot), records in split_journals(envs).items():
        steps += _explain_journal(records, request_id)
    for env in envs:
        p = env.payload
        if isinstance(p, m.CoreRecorded):
            continue
        rids = getattr(p, "request_ids", None) or []
        if getattr(p, "request_id", None) == request_id or request_id in rids:
            detail = {k: v for k, v in msgspec.to_builtins(p).items() if k not in ("type", "token_ids", "candidates")}
            if isinstance(p, m.RouteDecided):
                detail["candidates"] = [msgspec.to_builtins(c) for c in p.candidates]
            steps.append(Step(env.time_ns, "events", m.tag_of(type(p)), _abbrev(detail)))
        elif isinstance(p, m.WorkerLivenessChanged) and any(s.detail.get("worker") == p.worker_id for s in steps):
            steps.append(Step(env.time_ns, "events", "worker.liveness_changed", msgspec.to_builtins(p)))
    steps.sort(key=lambda s: s.t_ns)
    arrival = next((s.t_ns for s in steps if s.what == "admitted" or s.what == "rejected"), steps[0].t_ns if steps else 0)
    return {"request_id": request_id, "found": bool(steps), "source": path,
            "timeline": [{"t_ms": round((s.t_ns - arrival) / 1e6, 3), "source": s.source, "what": s.what, "event": s.what,
                          **s.detail} for s in steps]}


def _explain_journal(records: list[m.Envelope], rid: str) -> list[Step]:
    steps: list[Step] = []
    s: Scheduler | None = None
    now = 0
    assigned: set[str] = set()  # the workers it was admitted to, until it ends or they die
    for env in records:
        rec = env.payload
        now = rec.now_ns or now
        if rec.op == "config":
            s = Scheduler(config_from_builtins(rec.args["config"]), id_prefix=rec.args["id_prefix"])
            continue
        if s is None:
            continue
        if rec.op == "admit" and rec.args["request"]["request_id"] == rid:
            res = s.admit(request_from_builtins(rec.args["request"]), rec.now_ns)  # applied here, as replay would
            detail: dict[str, Any] = {"router": rec.router_id}
            if isinstance(res, Admitted):
                detail.update(worker=res.request.prefill_worker_id, decode_worker=res.request.decode_worker_id,
                              predicted_ttft_ms=round(res.predicted_ttft_ms, 1), slo_ttft_ms=res.slo_ttft_ms,
                              best_effort=res.best_effort, cached_tokens=res.request.num_cached_tokens)
            else:
                detail.update(code=res.code, message=res.message)
            detail["decisions"] = [{
                "stage": d.stage, "policy": d.policy, "seq": d.decision_seq, "seed": d.seed, "picked": d.pick.worker_id,
                "reason": d.pick.reason,
                "candidates": [{"worker": c.worker_id, "score": round(c.score, 3), "filtered_by": c.filtered_by,
                                **{k: round(v, 3) for k, v in c.components.items()}} for c in d.pick.scores],
            } for d in res.decisions]
            steps.append(Step(rec.now_ns, "journal", "admitted" if isinstance(res, Admitted) else "rejected", detail))
            if isinstance(res, Admitted):
                assigned = {res.request.prefill_worker_id, res.request.decode_worker_id}
            continue
        _, out = OPS[rec.op].run(s, rec.now_ns, rec.args)
        if rec.op == "tick":
            for batch_id, worker, members, reason, predicted in out["batches"]:
                if rid in members:
                    steps.append(Step(rec.now_ns, "journal", "batched", {
                        "batch_id": batch_id, "worker": worker, "size": len(members), "closed_because": reason,
                        "predicted_prefill_ms": round(predicted, 1)}))
            for failed, code in out["failures"]:
                if failed == rid:
                    steps.append(Step(rec.now_ns, "journal", "failed_in_queue", {"code": code}))
        elif rec.op == "sync" and (rid in out["orphans"] or (assigned and assigned & set(out["dead"]))):
            steps.append(Step(rec.now_ns, "journal", "worker_died", {"dead": out["dead"], "expired": out["expired"],
                                                                      "then": "re-route, migrate or retry; else fail (retryable)"}))
            assigned = set()
        elif rec.op == "remove_worker" and rid in out["orphans"]:
            steps.append(Step(now, "journal", "worker_removed", {"worker": rec.args["worker_id"]}))
        elif rec.op in ("on_terminal", "remove_queued") and rec.args.get("request_id") == rid and any(out.values()):
            steps.append(Step(now, "journal", "released_in_core" if rec.op == "on_terminal" else "cancelled_in_queue", {}))
            assigned = set()
        elif rec.op == "on_worker_event" and any(r == rid for _, r in out["settled"]):
            steps.append(Step(rec.now_ns, "journal", "settled", {"worker": rec.args["event"]["worker_id"]}))
    return steps


def print_explain(data: dict[str, Any], out: TextIO = sys.stdout) -> None:
    if not data["found"]:
        out.write(f"request {data['request_id']}: not in {data['source']}\n")
        return
    out.write(f"request {data['request_id']} (times relative to arrival)\n")
    for step in data["timeline"]:
        extra = {k: v for k, v in step.items() if k not in ("t_ms", "source", "what", "event", "decisions")}
        out.write(f"{step['t_ms']:>12.3f} ms  {step['what']:<26} {json.dumps(extra, default=str)[:160]}\n")
        for d in step.get("decisions", []):
            out.write(f"{'':>17}{d['stage']} by {d['policy']}: picked {d['picked']} — {d['reason']}\n")
            for c in d["candidates"]:
                comps = " ".join(f"{k}={v}" for k, v in c.items() if k not in ("worker", "score", "filtered_by"))
                flag = f" FILTERED ({c['filtered_by']})" if c["filtered_by"] else ""
                out.write(f"{'':>19}{c['worker']:<10} score {c['score']:>10}{flag}  {comps}\n")


# ------------------------------------------------------------------ tail
async def tail(nats_url: str, kinds: list[str], request_id: str | None, out: TextIO = sys.stdout,
               stop: asyncio.Event | None = None) -> None:
    import nats

    nc = await nats.connect(nats_servers(nats_url), error_cb=_nats_error)
    stop = stop or asyncio.Event()

    async def on_msg(msg):
        try:
            env = m.decode(msg.data)
        except m.DecodeError as exc:
            out.write(f"{msg.subject}: undecodable ({exc})\n")
            return
        tag = m.tag_of(type(env.payload))
        if kinds and not any(tag.startswith(k) for k in kinds):
            return
        if request_id and getattr(env.payload, "request_id", None) != request_id and request_id not in (
                getattr(env.payload, "request_ids", None) or []):
            return
        out.write(f"{env.time_ns} {tag} {m.encode(env).decode()[:300]}\n")
        out.flush()

    await nc.subscribe("flexlb.evt.>", cb=on_msg)
    await nc.subscribe("flexlb.journal.>", cb=on_msg)
    try:
        await stop.wait()
    finally:
        await nc.close()


DEFAULT_STREAMS = [JOURNAL_STREAM.name, EVENTS_STREAM.name]

