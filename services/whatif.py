"""`flexlb whatif FILE`: re-run a recorded incident's arrivals, in virtual time, through the
scheduling core against the simulated engine, under another configuration; print the
recorded run and the re-run side by side.

This module is the wiring: the core (`services/core/`) still imports no engine. A discrete-
event loop in virtual nanoseconds drives one `Scheduler` and one `SimEngine` per worker the
way the router and the worker agents do on the bus: arrivals are admitted, `tick` runs when
`next_due_ns` says, each formed batch goes to its worker's engine, each engine step takes
`duration_ms × time_scale` (the recorded workers' time scale), its outputs come back as the
same inputs the router gets (batch started, prefill completed with the measured time, KV
events, first tokens, finishes), status reports every `heartbeat_ms` and a liveness cycle
every `liveness_ms`. Nothing fails here: a what-if answers "which configuration", not
"what if a worker dies".
The engines run with the sim engine's default scheduler settings (token budget 8192,
256 sequences, chunked prefill): a recording does not carry them.

From the file: the arrivals (each request's first `admit` in the journal: time, prompt
length, block hashes, max_tokens, SLO overrides), the fleet (workers, roles, KV blocks,
block size, batch and sequence limits, time scale: from their status reports) and the
recorded configuration. The recorded run's numbers come from its events: TTFT = the
worker's first token (`request.finished.first_token_ns`) minus the arrival; TPOT =
(finish − first token) / (tokens − 1); hit rate = Σ cached / Σ prompt over
`prefill.completed`. Times are reported in engine ms (wall ms ÷ time scale), as bench/ does.

SLO attainment: TTFT ≤ the request's TTFT target and TPOT ≤ its TPOT target (the targets
admission gave it). Goodput: requests meeting both, per second of virtual (engine) time from
the first arrival to the last finish.
"""

from __future__ import annotations

import heapq
import json
import sys
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Any, TextIO

from schemas import messages as m
from services.core.journal import Recorder, Sink, config_from_builtins, request_from_builtins, split_journals
from services.core.scheduler import AdmitRequest, Admitted, Scheduler, SchedulerConfig
from workers.engines.sim import EngineBatch, EngineRequest, SimEngine, load_profile

MS = 1_000_000


@dataclass
class Arrival:
    t_ns: int
    request: AdmitRequest


@dataclass
class WorkerSpec:
    worker_id: str
    role: str
    num_kv_blocks: int
    block_size_tokens: int
    max_batch_tokens: int
    max_seq_len_tokens: int
    time_scale: float
    scheduler: str = "vllm"  # the engine's step scheduler (workers/engines/sim.py): vllm | sglang
    model: str = ""  # the model it served ("": the router's default): its pool


@dataclass
class Recording:
    config: SchedulerConfig
    arrivals: list[Arrival]
    workers: list[WorkerSpec]
    envs: list[m.Envelope]


def load_recording(path: str, progress: bool = False) -> Recording:
    from services.eventlog import read_export

    _, envs, _ = read_export(path, progress=progress)
    return recording_from_envs(envs, path)


def recording_from_envs(envs: list[m.Envelope], source: str = "the event log") -> Recording:
    """A recording from an event log's envelopes (an export's, or a live stream's)."""
    path = source
    journals = split_journals(envs)
    if not journals:
        raise ValueError(f"{path}: no core journal (core.recorded events) to take arrivals from")
    records = max(journals.values(), key=len)  # the boot that did the scheduling
    config = next(config_from_builtins(e.payload.args["config"]) for e in records if e.payload.op == "config")
    arrivals: list[Arrival] = []
    seen: set[str] = set()
    workers: dict[str, WorkerSpec] = {}
    for e in records:
        rec = e.payload
        if rec.op in ("admit", "offer"):  # (an offer: the arrival waited in the fair queue)
            req = request_from_builtins(rec.args["request"])
            if req.request_id not in seen:
                seen.add(req.request_id)
                arrivals.append(Arrival(rec.now_ns, req))
        elif rec.op == "on_worker_event" and rec.args["event"].get("type") == "worker.status_reported":
            ev = rec.args["event"]
            workers.setdefault(ev["worker_id"], WorkerSpec(
                ev["worker_id"], ev["role"], ev["num_kv_blocks"], ev["block_size_tokens"], ev["max_batch_tokens"],
                ev["max_seq_len_tokens"], ev.get("time_scale", 1.0), model=ev.get("model", "")))
    if not arrivals or not workers:
        raise ValueError(f"{path}: the journal holds {len(arrivals)} arrivals and {len(workers)} workers; need both")
    return Recording(config, sorted(arrivals, key=lambda a: a.t_ns), sorted(workers.values(), key=lambda w: w.worker_id),
                     envs)


# ------------------------------------------------------------------ metrics
def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))]


def summarize(ttft: dict[str, float], tpot: dict[str, float], slos: dict[str, tuple[float, float]], cached: int,
              prompt: int, rejected: dict[str, int], span_ms: float, n: int) -> dict[str, Any]:
    def stats(d: dict[str, float]) -> dict[str, float]:
        vals = list(d.values())
        return {"n": len(vals), "mean": round(sum(vals) / len(vals), 1) if vals else float("nan"),
                "p90": round(_pct(vals, 0.9), 1), "p99": round(_pct(vals, 0.99), 1)}

    met = [rid for rid, (t_slo, p_slo) in slos.items()
           if rid in ttft and ttft[rid] <= t_slo and tpot.get(rid, 0.0) <= p_slo]
    return {"requests": n, "ttft_ms": stats(ttft), "tpot_ms": stats(tpot),
            "slo_attainment": round(len(met) / len(slos), 4) if slos else float("nan"),
            "num_attained": len(met),  # of all n requests: rejections are misses
            "goodput_rps": round(len(met) / (span_ms / 1000), 3) if span_ms > 0 else float("nan"),
            "prefix_hit_rate": round(cached / prompt, 4) if prompt else 0.0,
            "rejected": dict(rejected)}


def recorded_metrics(rec: Recording) -> dict[str, Any]:
    scale = rec.workers[0].time_scale or 1.0
    arrival = {a.request.request_id: a.t_ns for a in rec.arrivals}
    slos: dict[str, tuple[float, float]] = {}
    for e in rec.envs:
        p = e.payload
        if isinstance(p, m.CoreRecorded) and p.op == "admit" and p.out.get("ok"):
            slos.setdefault(p.args["request"]["request_id"], (p.out["slo_ttft_ms"], p.out.get("slo_tpot_ms", float("inf"))))
        elif isinstance(p, m.CoreRecorded) and p.op == "release":  # admitted out of the fair queue
            for entry in p.out["released"]:
                if len(entry) == 6 and entry[5].get("ok"):
                    slos.setdefault(entry[1], (entry[5]["slo_ttft_ms"], entry[5].get("slo_tpot_ms", float("inf"))))
    ttft: dict[str, float] = {}
    tpot: dict[str, float] = {}
    cached = prompt = 0
    rejected: dict[str, int] = defaultdict(int)
    last_ns = 0
    for e in rec.envs:
        p = e.payload
        if isinstance(p, m.RequestFinished) and p.request_id in arrival and p.first_token_ns:
            ttft[p.request_id] = (p.first_token_ns - arrival[p.request_id]) / MS / scale
            if p.num_output_tokens > 1:
                tpot[p.request_id] = (e.time_ns - p.first_token_ns) / MS / scale / (p.num_output_tokens - 1)
            last_ns = max(last_ns, e.time_ns)
        elif isinstance(p, m.PrefillCompleted):
            cached += p.num_cached_tokens
            prompt += p.num_prompt_tokens
        elif isinstance(p, m.RequestRejected):
            rejected[p.code] += 1
    span_ms = (last_ns - rec.arrivals[0].t_ns) / MS / scale if last_ns else 0.0
    return summarize(ttft, tpot, slos, cached, prompt, rejected, span_ms, len(rec.arrivals))


# ------------------------------------------------------------------ the simulation
@dataclass(frozen=True)
class Outcome:
    """What happened to one request in a re-run (times in engine ms)."""

    ttft_ms: float | None  # None: no first token
    tpot_ms: float | None  # None: fewer than 2 tokens, or none
    slo: tuple[float, float] | None  # (TTFT, TPOT) targets admission gave it; None: not admitted
    code: str  # why it was refused or failed ("": it finished)

    @property
    def attained(self) -> bool:
        return (self.slo is not None and self.ttft_ms is not None and self.ttft_ms <= self.slo[0]
                and (self.tpot_ms or 0.0) <= self.slo[1])


@dataclass(order=True)
class _Ev:
    t_ns: int
    seq: int
    kind: str = field(compare=False)
    data: Any = field(compare=False, default=None)


def simulate(rec: Recording, config: SchedulerConfig, num_workers: int | None = None, heartbeat_ms: float = 200.0,
             liveness_ms: float = 500.0, profile_path: str | None = None, with_ttfts: bool = False,
             progress: bool = False):
    """The re-run's metrics (and, with_ttfts, also its TTFTs in engine ms, for the plot)."""
    from rich.progress import Progress

    with Progress(disable=not progress or len(rec.arrivals) < 1000, transient=True) as bar:
        task = bar.add_task("what-if", total=len(rec.arrivals))
        return _simulate(rec, config, num_workers, heartbeat_ms, liveness_ms, profile_path, with_ttfts,
                         lambda: bar.advance(task))


def _simulate(rec: Recording, config: SchedulerConfig, num_workers: int | None, heartbeat_ms: float,
              liveness_ms: float, profile_path: str | None, with_ttfts: bool, on_arrival, agent: str = "sim",
              outcomes: dict[str, "Outcome"] | None = None, journal: Sink | None = None):
    """`agent`: what the router hears, as from "sim" workers (the engine's own steps: a batch
    starts when its first chunk runs, its prefill time is its share of the steps) or from
    "openai" agents in front of engine servers (workers/openai/agent.py: a batch starts when
    it is released, at once here; its prefill time is the longest first-token latency of its
    members from the release, the server's queueing included; running = everything
    released, queued = the server's waiting requests).
    `outcomes`: filled with every request's Outcome (request id -> what happened to it).
    `journal`: the core's calls are recorded to it as a router's are (services/core/journal.py)."""
    if agent not in ("sim", "openai"):
        raise ValueError(f"agent must be sim or openai, got {agent!r}")
    profile = load_profile(profile_path)
    specs = list(rec.workers)
    if num_workers is not None:  # more or fewer workers like the recorded ones, taken in turn (every pool stays)
        specs = [WorkerSpec(f"w{i}", base.role, base.num_kv_blocks, base.block_size_tokens, base.max_batch_tokens,
                            base.max_seq_len_tokens, base.time_scale, base.scheduler, base.model)
                 for i, base in ((i, specs[i % len(specs)]) for i in range(num_workers))]
    scale = specs[0].time_scale or 1.0
    s = Scheduler(config, id_prefix="whatif")
    if journal is not None:
        s = Recorder(s, journal)
    engines = {w.worker_id: SimEngine(profile, w.role, w.num_kv_blocks, w.block_size_tokens, w.max_seq_len_tokens,
                                      scheduler=w.scheduler) for w in specs}
    spec_of = {w.worker_id: w for w in specs}
    busy: dict[str, bool] = {w: False for w in engines}
    batch_prefill_ms: dict[str, float] = defaultdict(float)  # batch id -> its share of the steps so far
    kv_seq: dict[str, int] = defaultdict(int)
    heap: list[_Ev] = []
    counter = 0

    def push(t: int, kind: str, data: Any = None) -> None:
        nonlocal counter
        counter += 1
        heapq.heappush(heap, _Ev(t, counter, kind, data))

    recent_steps: dict[str, deque[tuple[int, float]]] = {w: deque() for w in engines}  # (end ns, engine ms)

    def recent_step_ms(w: str, t: int) -> float:
        """The agent's WorkerStatusReported.recent_step_ms, in virtual time."""
        window = recent_steps[w]
        while window and window[0][0] < t - int(m.RECENT_STEPS_WINDOW_S * 1000 * scale * MS):
            window.popleft()
        return round(sum(ms for _, ms in window) / len(window), 3) if window else 0.0

    def status(w: str, t: int) -> None:
        e, sp = engines[w], spec_of[w]
        running, queued = e.num_running_requests, e.num_queued_batches
        if agent == "openai":
            running, queued = running + e.num_queued_requests, e.num_queued_requests
        s.on_worker_event(m.WorkerStatusReported(
            worker_id=w, role=sp.role, boot_id="whatif", block_size_tokens=sp.block_size_tokens,
            num_kv_blocks=sp.num_kv_blocks, num_free_kv_blocks=e.num_free_kv_blocks,
            num_cached_kv_blocks=e.num_cached_kv_blocks, max_batch_tokens=sp.max_batch_tokens,
            max_seq_len_tokens=sp.max_seq_len_tokens, num_running_requests=running,
            num_queued_batches=queued, running_request_ids=e.running_request_ids(), time_scale=scale,
            recent_step_ms=recent_step_ms(w, t), model=sp.model), t)
        s.take_settled()

    arrival_ns: dict[str, int] = {}
    requests: dict[str, AdmitRequest] = {}
    slos: dict[str, tuple[float, float]] = {}
    first_ns: dict[str, int] = {}
    ttft: dict[str, float] = {}
    tpot: dict[str, float] = {}
    rejected: dict[str, int] = defaultdict(int)
    failed_code: dict[str, str] = {}  # request id -> why it was refused or failed
    cached = prompt = 0
    last_finish = 0
    t0 = rec.arrivals[0].t_ns
    for w in engines:
        status(w, t0)
    for a in rec.arrivals:
        push(a.t_ns, "arrival", a.request)
    push(t0 + int(heartbeat_ms * MS), "heartbeat")
    push(t0 + int(liveness_ms * MS), "sync")

    def start_step(w: str, t: int) -> None:
        step = engines[w].step()
        if step is None:
            busy[w] = False
            return
        busy[w] = True
        if agent == "sim":
            for batch_id in step.batches_started:
                s.on_batch_started(w, batch_id, t)
        push(t + int(step.duration_ms * scale * MS), "step_done", (w, step))

    tick_at: list[int | None] = [None]  # when the one pending "tick" event is due

    def tick(t: int) -> None:
        nonlocal pending_work
        res = s.tick(t)
        for b in res.batches:
            for i in b.items:
                decode_of[i.request_id] = i.decode_worker_id
            engines[b.worker_id].submit_batch(EngineBatch(batch_id=b.batch_id, requests=[
                EngineRequest(request_id=i.request_id, prompt_token_ids=[0] * i.num_prompt_tokens, max_tokens=i.max_tokens,
                              block_hashes=list(requests[i.request_id].block_hashes)) for i in b.items]))
            if agent == "openai":
                released_ns[b.batch_id] = t
                s.on_batch_started(b.worker_id, b.batch_id, t)
            if not busy[b.worker_id]:
                start_step(b.worker_id, t)
        for f in res.failures:
            rejected[f.code] += 1
            failed_code[f.item.request_id] = f.code
        pending_work -= len(res.failures)
        due = s.next_due_ns(t)
        if due is not None:  # one pending tick at a time: an earlier one replaces a later one
            due = max(due, t + 1)
            if tick_at[0] is None or due < tick_at[0] or tick_at[0] <= t:
                tick_at[0] = due
                push(due, "tick")

    decode_of: dict[str, str] = {}  # request id -> the decode worker the router chose for it
    released_ns: dict[str, int] = {}  # agent openai: batch id -> its release
    pending_work = len(rec.arrivals)
    while heap:
        ev = heapq.heappop(heap)
        t = ev.t_ns
        if ev.kind == "arrival":
            on_arrival()
            req: AdmitRequest = ev.data
            requests[req.request_id] = req
            arrival_ns[req.request_id] = t
            res = s.admit(req, t)
            if isinstance(res, Admitted):
                slos[req.request_id] = (res.slo_ttft_ms, res.slo_tpot_ms)
            else:
                rejected[res.code] += 1
                failed_code[req.request_id] = res.code
                pending_work -= 1
            tick(t)
        elif ev.kind == "tick":
            if t == tick_at[0]:  # (a superseded tick is skipped)
                tick_at[0] = None
                tick(t)
        elif ev.kind == "step_done":
            w, step = ev.data
            if step.kind != "report":
                recent_steps[w].append((t, step.duration_ms))
            if step.blocks_removed:
                kv_seq[w] += 1
                s.on_kv_event(m.KvBlocksRemoved(worker_id=w, boot_id="whatif", kv_seq=kv_seq[w],
                                                block_hashes=list(step.blocks_removed)))
            if step.blocks_stored:
                kv_seq[w] += 1
                s.on_kv_event(m.KvBlocksStored(worker_id=w, boot_id="whatif", kv_seq=kv_seq[w],
                                               block_hashes=list(step.blocks_stored)))
            for batch_id, share_ms in step.prefill_ms_by_batch.items():
                batch_prefill_ms[batch_id] += share_ms
            for done in step.batches_prefilled:
                measured_ms = batch_prefill_ms.pop(done.batch_id, 0.0)
                if agent == "openai":  # (the step's end is its last member's first token)
                    measured_ms = (t - released_ns.pop(done.batch_id, t)) / MS / scale
                if done.request_ids:
                    s.on_prefill_completed(w, done.batch_id, measured_ms, done.num_cached_tokens)
                    cached += done.num_cached_tokens
                    prompt += done.num_prompt_tokens
            for tok in step.tokens:
                if tok.index == 0:
                    first_ns[tok.request_id] = t
                    ttft[tok.request_id] = (t - arrival_ns[tok.request_id]) / MS / scale
            for f in step.finished:
                got = None
                if f.num_output_tokens > 1 and f.request_id in first_ns:
                    tpot[f.request_id] = (t - first_ns[f.request_id]) / MS / scale / (f.num_output_tokens - 1)
                    got = tpot[f.request_id] * scale  # (wall ms, as the router measures it)
                s.on_terminal(f.request_id, f.num_output_tokens, got)
                last_finish = max(last_finish, t)
                pending_work -= 1
            for f in step.failed:
                rejected[f.code] += 1
                failed_code[f.request_id] = f.code
                s.on_terminal(f.request_id)
                pending_work -= 1
            for h in step.handoffs:  # disaggregated: the decode worker the router chose takes it over
                item_decode = decode_of.pop(h.request_id, None)
                if item_decode is not None and item_decode in engines:
                    engines[item_decode].submit_decode(EngineRequest(
                        request_id=h.request_id, prompt_token_ids=[0] * requests[h.request_id].num_prompt_tokens,
                        max_tokens=requests[h.request_id].max_tokens,
                        block_hashes=list(requests[h.request_id].block_hashes)), h.first_token_id, h.num_cached_tokens)
                    if not busy[item_decode]:
                        start_step(item_decode, t)
            start_step(w, t)
            tick(t)
        elif ev.kind == "heartbeat":
            for w in engines:
                status(w, t)
            if pending_work > 0:
                push(t + int(heartbeat_ms * MS), "heartbeat")
        elif ev.kind == "sync":
            s.sync(t)
            if pending_work > 0:
                push(t + int(liveness_ms * MS), "sync")
    span_ms = (last_finish - t0) / MS / scale if last_finish else 0.0
    result = summarize(ttft, tpot, slos, cached, prompt, rejected, span_ms, len(rec.arrivals))
    if outcomes is not None:
        for a in rec.arrivals:
            rid = a.request.request_id
            slo = slos.get(rid)
            outcomes[rid] = Outcome(ttft.get(rid), tpot.get(rid), slo, failed_code.get(rid, ""))
    return (result, sorted(ttft.values())) if with_ttfts else result


def recorded_ttfts(rec: Recording) -> list[float]:
    scale = rec.workers[0].time_scale or 1.0
    arrival = {a.request.request_id: a.t_ns for a in rec.arrivals}
    return sorted((p.first_token_ns - arrival[p.request_id]) / MS / scale for e in rec.envs
                  if isinstance(p := e.payload, m.RequestFinished) and p.request_id in arrival and p.first_token_ns)


def plot_cdfs(recorded: list[float], rerun: list[float], label: str, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for values, name in ((recorded, "recorded"), (rerun, label)):
        if values:
            ax.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post", label=name)
    ax.set_xlabel("TTFT (engine ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_xscale("log")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def refused_in(rec: Recording) -> list[str]:
    """The requests the recorded run refused as slo_unattainable (at admission, or held by the
    TPOT hold and refused before dispatch), from its journal, in order."""
    out: list[str] = []
    for e in rec.envs:
        p = e.payload
        if not isinstance(p, m.CoreRecorded):
            continue
        if p.op == "admit" and p.out.get("code") == "slo_unattainable":
            out.append(p.args["request"]["request_id"])
        elif p.op == "tick":
            out += [f[0] for f in p.out.get("failures", ()) if f[1] == "slo_unattainable"]
        elif p.op == "release":  # refused on release from the fair queue
            out += [r[1] for r in p.out["released"] if len(r) == 6 and r[5].get("code") == "slo_unattainable"]
    return list(dict.fromkeys(out))


def refusal_off(config: SchedulerConfig) -> SchedulerConfig:
    """The configuration with every SLO refusal off: admission admits best effort, and a
    request the TPOT hold keeps to its emergency point is served there (slo.py best-effort)."""
    import dataclasses

    import msgspec

    return dataclasses.replace(config, slo=msgspec.structs.replace(config.slo, mode="best-effort")).validate()


def over_refusal(rec: Recording, num_workers: int | None = None, profile_path: str | None = None,
                 agent: str = "sim") -> dict[str, Any]:
    """How many of the recorded run's slo_unattainable refusals would in fact have met their
    SLO: the run's arrivals re-run in virtual time with refusal off (`refusal_off`), each
    refused request's TTFT and TPOT there against the targets admission gives it. The rate is
    per request of the run (the bench's over-refusal figure).

    And what serving them would have cost: the same arrivals re-run, in the same virtual world,
    with the recorded configuration (refusals on). `others_lost`: requests that met their SLO
    there and miss it with refusal off (the refused requests' load, served, pushed them past a
    target); `net`: requests meeting their SLO with refusal off minus with it on. A refusal
    protects the running requests of its worker (the TPOT hold) as much as it judges the
    refused one: a refused request that would have met, at the price of two others that then
    miss, was a refusal worth making; `net` says which way the whole run went."""
    refused = refused_in(rec)
    outcomes: dict[str, Outcome] = {}
    rerun = _simulate(rec, refusal_off(rec.config), num_workers, 200.0, 500.0, profile_path, False, lambda: None,
                      agent, outcomes)
    kept: dict[str, Outcome] = {}
    on = _simulate(rec, rec.config, num_workers, 200.0, 500.0, profile_path, False, lambda: None, agent, kept)
    met = [r for r in refused if r in outcomes and outcomes[r].attained]
    n = len(rec.arrivals)
    return {"requests": n, "refused": len(refused), "would_meet": len(met),
            "over_refusal_rate": round(len(met) / n, 4) if n else 0.0,
            "rerun_attainment": rerun["slo_attainment"], "would_meet_ids": met[:50],
            "refusal_on_attainment": on["slo_attainment"], **refusal_cost(kept, outcomes)}


def marginal_over_refusal(rec: Recording, num_workers: int | None = None, profile_path: str | None = None,
                          agent: str = "sim") -> dict[str, Any]:
    """Each refusal judged alone: could a worker have served that one request? The arrivals are
    re-run with the recorded configuration; then, for each request that run refuses
    slo_unattainable, once more with that one request served best effort (never refused, its
    deadline not strict: AdmitRequest.best_effort) and every other as configured. It was a
    request lost (`at_no_cost`) when it then meets its SLO and no fewer of the others meet
    theirs; `at_a_cost` when it meets and others then miss (the refusal protected them);
    `would_miss` when it misses anyway. Unlike `over_refusal` (every refusal off at once,
    where the refused requests' load is served together), this asks of one refusal what the
    router asked at the time. A re-run per refusal: seconds each in virtual time. One more
    request moves every later decision of a re-run, so the others' count moves a little
    either way by chance; `others_delta` lists it per refusal."""
    import dataclasses

    def run(arrivals: list[Arrival]) -> dict[str, Outcome]:
        outcomes: dict[str, Outcome] = {}
        _simulate(dataclasses.replace(rec, arrivals=arrivals), rec.config, num_workers, 200.0, 500.0, profile_path,
                  False, lambda: None, agent, outcomes)
        return outcomes

    on = run(rec.arrivals)
    met_on = sum(1 for o in on.values() if o.attained)
    refused = [r for r, o in on.items() if o.code == "slo_unattainable"]
    at_no_cost: list[str] = []
    at_a_cost: list[str] = []
    deltas: list[int] = []
    for rid in refused:
        one = run([Arrival(a.t_ns, dataclasses.replace(a.request, best_effort=True)) if a.request.request_id == rid else a
                   for a in rec.arrivals])
        delta = sum(1 for r, o in one.items() if r != rid and o.attained) - met_on
        deltas.append(delta)
        if one[rid].attained:
            (at_no_cost if delta >= 0 else at_a_cost).append(rid)
    n = len(rec.arrivals)
    return {"requests": n, "refused": len(refused), "at_no_cost": len(at_no_cost), "at_a_cost": len(at_a_cost),
            "would_miss": len(refused) - len(at_no_cost) - len(at_a_cost),
            "marginal_over_refusal_rate": round(len(at_no_cost) / n, 4) if n else 0.0,
            "at_no_cost_ids": at_no_cost[:50], "others_delta": deltas, "attainment": round(met_on / n, 4) if n else 0.0}


def refusal_cost(on: dict[str, Outcome], off: dict[str, Outcome]) -> dict[str, int]:
    """Between two re-runs of the same arrivals, refusals on and off (request id -> Outcome):
    `others_lost`, the requests that meet their SLO with refusals on and miss it with them off,
    and `net`, the requests meeting it with them off minus with them on."""
    def met(o: Outcome | None) -> bool:
        return o is not None and o.attained

    return {"others_lost": sum(1 for r, o in on.items() if o.attained and not met(off.get(r))),
            "net": sum(map(met, off.values())) - sum(map(met, on.values()))}


def with_overrides(config: SchedulerConfig, prefill_policy: str | None, decode_policy: str | None,
                   batcher: str | None) -> SchedulerConfig:
    changes: dict[str, Any] = {}
    if prefill_policy:
        changes.update(prefill_policy=prefill_policy, prefill_policy_params={})
    if decode_policy:
        changes.update(decode_policy=decode_policy, decode_policy_params={})
    if batcher and batcher != config.batcher:
        changes.update(batcher=batcher, batcher_params={})
    import dataclasses

    return dataclasses.replace(config, **changes).validate() if changes else config


def print_side_by_side(recorded: dict[str, Any], rerun: dict[str, Any], label: str, out: TextIO = sys.stdout) -> None:
    rows = [("TTFT mean ms", "ttft_ms", "mean"), ("TTFT p90 ms", "ttft_ms", "p90"), ("TTFT p99 ms", "ttft_ms", "p99"),
            ("TPOT mean ms", "tpot_ms", "mean"), ("TPOT p90 ms", "tpot_ms", "p90"), ("TPOT p99 ms", "tpot_ms", "p99"),
            ("SLO attainment", "slo_attainment", None), ("goodput req/s", "goodput_rps", None),
            ("prefix hit rate", "prefix_hit_rate", None)]
    out.write(f"{'':<18} {'recorded':>14} {label:>24}\n")
    for name, key, sub in rows:
        a = recorded[key][sub] if sub else recorded[key]
        b = rerun[key][sub] if sub else rerun[key]
        out.write(f"{name:<18} {a:>14} {b:>24}\n")
    out.write(f"{'rejected':<18} {json.dumps(recorded['rejected']):>14} {json.dumps(rerun['rejected']):>24}\n")
