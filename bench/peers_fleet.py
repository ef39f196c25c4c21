"""The fleets bench/peers.py compares: its configurations (`Config`, `builtin_configs`,
`with_pd`), how each starts K simulated engines and the router in front of them (or none),
readies them (`warm_up`), reads their counters and stops them.

Not a harness: bench/peers.py's docstring says what each configuration runs and why the
peer routers get the flags they get. Fleets:
- `FlexlbFleet`: `flexlb up --workers K --time-scale T` + the configuration's flags +
  --flexlb-args; facts from FlexLB's event log (request.finished, request.admitted).
- `SimFleet`: K `flexlb sim-server` processes, and sglang-router or vllm-router in front of
  them (or none: direct round-robin); facts from the servers' /metrics deltas.
- `AdapterFleet`: FlexLB's OpenAI adapter in front of the same K sim-servers (each also
  publishing vLLM's KV events over ZMQ); engine facts as SimFleet's, outcomes from the event log.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gzip
import json
import shlex
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import msgspec

from bench.common import (
    REPO,
    Proc,
    child_env,
    flexlb_exe,
    free_port,
    http_get,
    parse_metrics,
    wait_http,
    wait_up_state,
)
from bench.loadgen import Rec, stream_one

PEER_POLICIES = ("round_robin", "cache_aware", "power_of_two")
WARMUP_PROMPT = "warm"  # shorter than any KV block: nothing is cached by it
WARMUP_PREFIX = "warmup-"


# --------------------------------------------------------------------------- configurations
@dataclass(frozen=True)
class Config:
    name: str
    kind: str  # "flexlb" | "flexlb-openai" (FlexLB's agents in front of the sim-servers) | "sglang" | "vllm" | "direct"
    policy: str | None = None  # the peer router's --policy
    flexlb_flags: tuple[str, ...] = ()  # added to `flexlb up`
    pd: tuple[int, int] | None = None  # disaggregated: (prefill engines, decode engines); None: colocated
    engine_mode: str = "vllm"  # every engine's --scheduler: "vllm" (mixed steps) | "sglang" (prefill-first)


def with_pd(config: Config, suffix: str, workers: int) -> Config:
    """`NAME@PpDd` (e.g. `flexlb@3p1d`, `sglang-cache_aware@3p1d`): the same configuration on
    a disaggregated fleet of P prefill and D decode engines, P + D = K. FlexLB: `flexlb up
    --prefill P --decode D`. sglang-router: `--pd-disaggregation`, each prefill engine given
    with its own HTTP port as the bootstrap port, `--policy` for both stages (SGLang's
    bootstrap protocol, emulated by the sim-server: workers/sim_server/http.py). vllm-router's PD
    protocol (kv_transfer_params) is not emulated, and no-router round-robin has no hand-off."""
    import re

    match = re.fullmatch(r"(\d+)p(\d+)d", suffix)
    if match is None:
        raise ValueError(f"{config.name}@{suffix}: the fleet shape is PpDd, e.g. 3p1d")
    num_prefill, num_decode = int(match[1]), int(match[2])
    if num_prefill < 1 or num_decode < 1 or num_prefill + num_decode != workers:
        raise ValueError(f"{config.name}@{suffix}: P, D >= 1 and P + D = --workers ({workers})")
    if config.kind not in ("flexlb", "sglang"):
        raise ValueError(f"{config.name}@{suffix}: a PD fleet runs with FlexLB or sglang-router only")
    flags = config.flexlb_flags + (("--prefill", str(num_prefill), "--decode", str(num_decode))
                                   if config.kind == "flexlb" else ())
    return dataclasses.replace(config, name=f"{config.name}@{suffix}", flexlb_flags=flags,
                               pd=(num_prefill, num_decode))


def builtin_configs() -> dict[str, Config]:
    configs = [
        Config("flexlb", "flexlb"),
        Config("flexlb-fixed-window", "flexlb", flexlb_flags=("--batcher", "fixed-window")),
        Config("flexlb-slo-budget", "flexlb", flexlb_flags=("--batcher", "slo-budget")),
        Config("flexlb-cache-aware", "flexlb", flexlb_flags=("--prefill-policy", "cache-aware")),
        Config("flexlb-round-robin", "flexlb", flexlb_flags=("--prefill-policy", "round-robin")),
        Config("flexlb-openai", "flexlb-openai"),
        *(Config(f"sglang-{p}", "sglang", policy=p) for p in PEER_POLICIES),
        *(Config(f"vllm-{p}", "vllm", policy=p) for p in PEER_POLICIES),
        Config("direct-round-robin", "direct"),
    ]
    return {c.name: c for c in configs}


# --------------------------------------------------------------------------- fleets
ENGINE_INT_FLAGS = ("num_kv_blocks", "block_size_tokens", "max_seq_len_tokens", "max_num_batched_tokens",
                    "max_num_seqs", "max_prefill_tokens")


def engine_flags(args: argparse.Namespace, engine_mode: str | None = None) -> list[str]:
    """The engine flags given on our command line, for every engine of every configuration,
    and `--scheduler ENGINE_MODE` (the run's engine mode, passed to every engine always)."""
    out: list[str] = ["--scheduler", engine_mode] if engine_mode else []
    for name in (*ENGINE_INT_FLAGS, "profile"):
        v = getattr(args, name)
        if v is not None:
            out += [f"--{name.replace('_', '-')}", str(v)]
    if args.no_chunked_prefill:
        out.append("--no-chunked-prefill")
    return out


class Fleet:
    """K engines (and a router or not) for one run."""

    def __init__(self, config: Config, args: argparse.Namespace, workdir: Path, tag: str) -> None:
        self.config, self.args, self.workdir, self.tag = config, args, workdir, tag
        self.procs: list[Proc] = []
        self.urls: list[tuple[str, int]] = []  # where the client sends
        # Hooks for a fault harness (bench/faults.py), both unused by default: extra flags for
        # engine i's command line (e.g. `--fail-generations`), and a function of (i, the engine's
        # URL), called once the engines are healthy, giving the URL the router (or agent) is
        # handed for engine i instead (e.g. a proxy's in front of it; /metrics and /health
        # are still read from the engine itself).
        self.engine_args: dict[int, list[str]] = {}
        self.engine_front: Callable[[int, str], str] | None = None

    def commands(self) -> list[str]:
        return [shlex.join(p.argv) for p in self.procs]

    def pids(self) -> dict[str, int]:
        return {p.name: p.pid for p in self.procs}

    def target_of(self, i: int) -> int:
        return 0

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> dict[str, int | None]:
        codes = {}
        for p in reversed(self.procs):  # router first, engines last
            codes[p.name] = p.stop(self.args.stop_timeout_s)
        return codes

    def counters(self) -> dict[str, Any] | None:
        return None

    async def after_replay(self, before: dict[str, Any] | None) -> dict[str, Any]:
        return {}


class FlexlbFleet(Fleet):
    """`flexlb up --workers K --time-scale T` (+ the configuration's flags, + --flexlb-args)."""

    def fleet_flags(self) -> list[str]:
        """`flexlb up`'s fleet: K NATS workers running our engine flags and the run's engine mode."""
        a = self.args
        return ["--workers", str(a.workers), "--time-scale", f"{a.time_scale:g}",
                *engine_flags(a, self.config.engine_mode)]

    def start(self) -> None:
        self.start_up(self.fleet_flags())

    def up_argv(self, fleet_flags: list[str], port: int, state_file: Path) -> list[str]:
        """`flexlb up FLEET_FLAGS` + the configuration's flags + --flexlb-args (which win)."""
        return [*flexlb_exe(), "up", "--open-admin", *fleet_flags, "--port", str(port), "--state-file", str(state_file),
                *self.config.flexlb_flags, *self.args.flexlb_args_list]

    def start_up(self, fleet_flags: list[str]) -> None:
        """`up_argv(FLEET_FLAGS)`; returns once its router answers /readyz."""
        a = self.args
        self.port = free_port()
        self.state_file = self.workdir / f"state-{self.tag}.json"
        argv = self.up_argv(fleet_flags, self.port, self.state_file)
        up = Proc("up", argv, self.workdir / f"{self.tag}-up.log", child_env(self.workdir))
        self.procs.append(up)
        up.start()
        deadline = time.monotonic() + a.startup_timeout_s
        self.state = wait_up_state(up, self.state_file, deadline, a.startup_timeout_s)
        url = self.state["router_url"]
        wait_http(url + "/readyz", deadline, [up], lambda s, _: s == 200)
        host, port = url.split("//", 1)[1].rsplit(":", 1)
        self.urls = [(host, int(port))]

    def pids(self) -> dict[str, int]:
        pids = {k: v for k, v in self.state.get("pids", {}).items()} if hasattr(self, "state") else {}
        return {**pids, **{p.name: p.pid for p in self.procs}}

    def counters(self) -> dict[str, Any] | None:
        return self.router_counters()

    def router_counters(self) -> dict[str, Any] | None:
        status, text = http_get(self.state["router_url"] + "/metrics")
        return parse_metrics(text) if status == 200 else None

    async def after_replay(self, before: dict[str, Any] | None) -> dict[str, Any]:
        return await self.event_log_facts(before)

    async def event_log_facts(self, before: dict[str, Any] | None) -> dict[str, Any]:
        """Prefix hits and per-worker requests from the event log (warm-ups left out)."""
        from schemas import messages as m
        from services.eventlog import read_stream

        envs = await asyncio.wait_for(read_stream(self.state["nats_url"]), self.args.startup_timeout_s)
        per_worker: Counter = Counter()
        terminal: Counter = Counter()
        failures: Counter = Counter()  # "code: message" of request.failed events
        prompt = cached = 0
        for env in envs:
            p = env.payload
            rid = getattr(p, "request_id", "")
            if rid.startswith(WARMUP_PREFIX):
                continue
            if isinstance(p, m.RequestAdmitted):
                per_worker[p.prefill_worker_id] += 1
            elif isinstance(p, m.RequestFinished):
                prompt += p.num_prompt_tokens
                cached += p.num_cached_tokens
                terminal["finished"] += 1
            elif isinstance(p, m.RequestFailed):
                terminal[f"failed:{p.code}"] += 1
                failures[f"{p.code}: {p.message[:160]}"] += 1
            elif isinstance(p, m.RequestRejected):
                terminal[f"rejected:{p.code}"] += 1
            elif isinstance(p, m.RequestCancelled):
                terminal["cancelled"] += 1
        from schemas.subjects import JOURNAL_STREAM

        journal = await asyncio.wait_for(read_stream(self.state["nats_url"], JOURNAL_STREAM.name),
                                         self.args.startup_timeout_s * 4)
        if self.args.keep_logs:  # the journal beside the logs: `flexlb whatif FILE` re-runs it offline
            with gzip.open(self.workdir / f"{self.tag}-journal.jsonl.gz", "wb") as f:
                f.writelines(m.encode(e).rstrip(b"\n") + b"\n" for e in journal)
        over = self.over_refusal(journal)
        status, text = http_get(self.state["router_url"] + "/admin/workers")
        # what the router learned of each worker (decode model, TPOT calibration), for the report
        learned = ({w["id"]: {k: w.get(k) for k in ("decode_model", "predicted_step_ms", "predicted_tpot_ms")}
                    for w in json.loads(text).get("workers", [])} if status == 200 else None)
        after = self.router_counters() or {}
        best_effort = None
        if after and before is not None:
            key = "flexlb_best_effort_admissions_total"
            best_effort = after.get(key, 0.0) - before.get(key, 0.0)
        return {
            "source": "event log: request.finished (prefix), request.admitted (per worker)",
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "prefix_hit_rate": round(cached / prompt, 4) if prompt else None,
            "requests_per_worker": dict(sorted(per_worker.items())),
            "terminal_events": dict(sorted(terminal.items())),
            "failure_messages": dict(failures.most_common(10)),
            "best_effort_admissions": best_effort,
            "over_refusal": over,
            "workers_learned": learned,
            "events": len(envs),
        }

    def over_refusal(self, envs: list) -> dict[str, Any] | None:
        """How many of the run's slo_unattainable refusals would have met their SLO: the run's
        journal (`envs`: the FLEXLB_JOURNAL stream) re-run in virtual time with refusal off (services/whatif.py `over_refusal`),
        on engines of the cell's mode, heard as the cell's workers are (openai agents or sim
        workers); warm-ups left out of the counts. None: no journal to re-run."""
        from services import whatif

        try:
            rec = whatif.recording_from_envs(envs)
        except ValueError as exc:
            print(f"    over-refusal: not computed ({exc})", file=sys.stderr, flush=True)
            return None
        rec.workers = [dataclasses.replace(w, scheduler=self.config.engine_mode) for w in rec.workers]
        out = whatif.over_refusal(rec, agent="openai" if self.config.kind == "flexlb-openai" else "sim")
        warm = sum(1 for a in rec.arrivals if a.request.request_id.startswith(WARMUP_PREFIX))
        n = out["requests"] - warm
        out["requests"] = n
        out["over_refusal_rate"] = round(out["would_meet"] / n, 4) if n else 0.0
        if self.args.marginal_over_refusal:  # each refusal alone (a virtual re-run per refusal)
            alone = whatif.marginal_over_refusal(rec, agent="openai" if self.config.kind == "flexlb-openai" else "sim")
            alone["requests"] = n
            alone["marginal_over_refusal_rate"] = round(alone["at_no_cost"] / n, 4) if n else 0.0
            out["marginal"] = alone
        return out


def peer_router_ready(workers: int) -> Callable[[int | None, str], bool]:
    """A peer router's /readiness answer says ready with all `workers` healthy (wait_http's test)."""

    def ready(status: int | None, text: str) -> bool:
        if status != 200:
            return False
        try:
            return int(json.loads(text).get("healthy_workers", -1)) >= workers
        except (ValueError, AttributeError, TypeError):
            return True  # 200 without the counts: take the router's word

    return ready


class SimFleet(Fleet):
    """K `flexlb sim-server` processes, and the peer router in front of them (or none)."""

    def start_engines(self, kv_events: bool = False) -> float:
        """K sim-servers (with vLLM's KV events sockets on loopback when `kv_events`: their
        endpoints in self.kv_endpoints); returns the start-up deadline once all are healthy."""
        a = self.args
        env = child_env(self.workdir)
        base = shlex.split(a.sim_server_cmd) if a.sim_server_cmd else [*flexlb_exe(), "sim-server"]
        engines = []
        self.engine_urls: list[str] = []
        self.kv_endpoints: list[tuple[str, str]] = []  # (PUB, replay) per engine
        pd = self.config.pd
        roles = ["prefill"] * pd[0] + ["decode"] * pd[1] if pd else ["pd_fusion"] * a.workers
        for i, role in enumerate(roles):
            port = free_port()
            events: list[str] = []
            if kv_events:
                # The server binds its PUB socket only for `tcp://*:PORT` (vLLM's rule: any other
                # address is connected to, for a proxy) and the agent's SUB connects: given
                # 127.0.0.1 on both sides, both connect and no event ever arrives.
                pub_port, replay = free_port(), f"tcp://127.0.0.1:{free_port()}"
                self.kv_endpoints.append((f"tcp://127.0.0.1:{pub_port}", replay))
                events = ["--kv-events-endpoint", f"tcp://*:{pub_port}", "--kv-events-replay-endpoint", replay]
            argv = self.engine_argv(base, i, role if pd else None, port, events)
            engines.append(Proc(f"worker-w{i}", argv, self.workdir / f"{self.tag}-w{i}.log", env))
            self.engine_urls.append(f"http://127.0.0.1:{port}")
        self.procs = list(engines)
        for p in engines:
            p.start()
        deadline = time.monotonic() + a.startup_timeout_s
        for url in self.engine_urls:
            wait_http(url + "/health", deadline, engines, lambda s, _: s == 200)
        # what the router (or FlexLB's agents) is given for each engine (engine_front's, or its own URL)
        self.router_engine_urls = [self.engine_front(i, url) if self.engine_front else url
                                   for i, url in enumerate(self.engine_urls)]
        return deadline

    def engine_argv(self, base: list[str], i: int, role: str | None, port: int, events: list[str]) -> list[str]:
        """One sim-server: engine w<i> (a PD role or colocated), our engine flags and the run's engine mode."""
        a = self.args
        return [*base, "--port", str(port), "--worker-id", f"w{i}", "--time-scale", f"{a.time_scale:g}",
                *(["--role", role] if role else []), *(["--host", "127.0.0.1"] if a.sim_server_has_host else []),
                *engine_flags(a, self.config.engine_mode), *events,
                *(["--model-name", a.model_name] if a.model_name != "flexlb-sim" else []),
                *self.engine_args.get(i, [])]

    def start(self) -> None:
        a = self.args
        env = child_env(self.workdir)
        pd = self.config.pd
        deadline = self.start_engines()
        kind = self.config.kind
        if kind == "direct":
            self.urls = [("127.0.0.1", int(u.rsplit(":", 1)[1])) for u in self.router_engine_urls]
            return
        port, prom_port = free_port(), free_port()
        module = "sglang_router.launch_router" if kind == "sglang" else "vllm_router.launch_router"
        if pd:  # each prefill engine's own HTTP port is its bootstrap port (workers/sim_server/http.py)
            fleet = ["--pd-disaggregation"]
            for url, own in zip(self.router_engine_urls[:pd[0]], self.engine_urls[:pd[0]]):
                fleet += ["--prefill", url, own.rsplit(":", 1)[1]]
            for url in self.router_engine_urls[pd[0]:]:
                fleet += ["--decode", url]
        else:
            fleet = ["--worker-urls", *self.router_engine_urls]
        argv = [sys.executable, "-m", module, "--host", "127.0.0.1", "--port", str(port),
                *fleet, "--policy", self.config.policy,
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prom_port),
                "--log-level", "warn" if kind == "sglang" else "warning",
                "--worker-startup-check-interval", "1", *a.peer_args_list]
        self.prometheus_port = prom_port
        router = Proc("router", argv, self.workdir / f"{self.tag}-router.log", env)
        self.procs.append(router)
        router.start()

        wait_http(f"http://127.0.0.1:{port}/readiness", deadline, self.procs, peer_router_ready(a.workers))
        self.urls = [("127.0.0.1", port)]

    def target_of(self, i: int) -> int:
        return i % len(self.urls) if self.config.kind == "direct" else 0

    def counters(self) -> dict[str, Any] | None:
        out = {}
        for i, url in enumerate(self.engine_urls):
            status, text = http_get(url + "/metrics")
            if status != 200:
                return None
            sums: dict[str, float] = {}
            for key, v in parse_metrics(text).items():
                name = key.split("{", 1)[0]
                sums[name] = sums.get(name, 0.0) + v
            out[f"w{i}"] = sums
        return out

    def router_log_findings(self) -> list[str]:
        """Lines of the router's log that say it tried to fetch a tokenizer or failed requests."""
        router = next((p for p in self.procs if p.name == "router"), None)
        if router is None:
            return []
        try:
            text = router.log_path.read_text(errors="replace")
        except OSError:
            return []
        found: dict[str, int] = {}
        for line in text.splitlines():
            line = _strip_ansi(line)
            low = line.lower()
            if "huggingface" in low or "download" in low or ("tokenizer" in low and "fail" in low):
                at = max(line.find("Failed"), 0)
                msg = line[at:at + 300]
                found[msg] = found.get(msg, 0) + 1
        return [f"{n}x {msg}" for msg, n in list(found.items())[:10]]

    def router_metrics(self) -> dict[str, float]:
        """The peer router's own counters of retries, errors and circuit breaking."""
        if self.config.kind not in ("sglang", "vllm"):
            return {}
        status, text = http_get(f"http://127.0.0.1:{self.prometheus_port}/metrics")
        if status != 200:
            return {}
        out = {}
        for key, v in parse_metrics(text).items():
            name = key.split("{", 1)[0]
            not_ok = 'status_code="' in key and 'status_code="2' not in key
            if v and (not_ok or any(w in name for w in ("retr", "error", "fail", "circuit", "reject"))):
                out[key] = v
        return out

    async def after_replay(self, before: dict[str, Any] | None) -> dict[str, Any]:
        after = self.counters()
        if after is None or before is None:
            return {"source": "sim-server /metrics", "error": "a sim-server's /metrics did not answer"}

        def delta(w: str, name: str) -> float:
            return after[w].get(name, 0.0) - before[w].get(name, 0.0)

        workers = sorted(after)
        prompt = sum(delta(w, "flexlb_sim_prompt_tokens_total") for w in workers)
        cached = sum(delta(w, "flexlb_sim_cached_tokens_total") for w in workers)
        queries = sum(delta(w, "vllm:prefix_cache_queries_total") for w in workers)
        hits = sum(delta(w, "vllm:prefix_cache_hits_total") for w in workers)
        return {
            "source": "sim-server /metrics deltas over the replay",
            "prompt_tokens": int(prompt),
            "cached_tokens": int(cached),
            "prefix_hit_rate": round(cached / prompt, 4) if prompt else None,
            "vllm_prefix_cache_hit_rate": round(hits / queries, 4) if queries else None,
            "requests_per_worker": {w: int(delta(w, "flexlb_sim_requests_total")) for w in workers},
            "preemptions": int(sum(delta(w, "flexlb_sim_preemptions_total") for w in workers)),
            "kv_event_batches_published": int(sum(delta(w, "flexlb_sim_kv_event_batches_total") for w in workers)),
            "router_counters": self.router_metrics(),
            "router_log": self.router_log_findings(),
        }


class AdapterFleet(SimFleet, FlexlbFleet):
    """FlexLB through its OpenAI adapter: the same K sim-servers as the peers' (each also
    publishing vLLM's KV events over ZMQ), and `flexlb up --engine openai --engine-url URL
    --kv-events-endpoint PUB --kv-events-replay-endpoint REPLAY` per server in front of them
    (+ the configuration's flags, + --flexlb-args). The engine's facts come from the servers'
    /metrics, as for the peers; the outcome counts from FlexLB's event log."""

    def start(self) -> None:
        self.start_engines(kv_events=True)
        flags = ["--engine", "openai"]
        for url, (pub, replay) in zip(self.router_engine_urls, self.kv_endpoints):
            flags += ["--engine-url", url, "--kv-events-endpoint", pub, "--kv-events-replay-endpoint", replay]
        self.start_up(flags)

    def target_of(self, i: int) -> int:
        return 0

    def pids(self) -> dict[str, int]:
        """`flexlb up`'s processes (its agents are worker-*), and the servers as engine-*."""
        state = self.state.get("pids", {}) if hasattr(self, "state") else {}
        procs = {("engine-" + p.name.removeprefix("worker-") if p.name.startswith("worker-") else p.name): p.pid
                 for p in self.procs}
        return {**state, **procs}

    def stop(self) -> dict[str, int | None]:
        return Fleet.stop(self)  # `flexlb up` (the last started) first, the servers after

    def counters(self) -> dict[str, Any] | None:
        return SimFleet.counters(self)

    async def after_replay(self, before: dict[str, Any] | None) -> dict[str, Any]:
        engines = await SimFleet.after_replay(self, before)
        flexlb = await self.event_log_facts(None)
        keep = ("terminal_events", "failure_messages", "requests_per_worker", "events", "over_refusal", "workers_learned")
        # That the servers' KV events reach the router's prefix index (a run without them
        # routes blind to the cache and says nothing else about it).
        kv = {k: v for k, v in (self.router_counters() or {}).items() if k.startswith("flexlb_kv_events_total")}
        published = engines.get("kv_event_batches_published", 0)
        if published > 0 and not sum(kv.values()):
            print(f"    WARNING: the servers published {published} KV event batches and the router took none",
                  file=sys.stderr, flush=True)
        return engines | {"flexlb_" + k: flexlb[k] for k in keep} | {"router_kv_events": kv}


def _strip_ansi(s: str) -> str:
    import re

    return re.sub(r"\x1b\[[0-9;]*m", "", s)


def make_fleet(config: Config, args: argparse.Namespace, workdir: Path, tag: str) -> Fleet:
    fleets = {"flexlb": FlexlbFleet, "flexlb-openai": AdapterFleet}
    return fleets.get(config.kind, SimFleet)(config, args, workdir, tag)


# --------------------------------------------------------------------------- readiness
def warm_up(fleet: Fleet, args: argparse.Namespace, deadline: float) -> int:
    """Tiny requests through every URL until `--warmup` succeed on each (or the deadline)."""
    if args.warmup <= 0:
        return 0
    enc = msgspec.json.Encoder()
    sent = 0

    async def go() -> None:
        nonlocal sent
        for u, (host, port) in enumerate(fleet.urls):
            ok = 0
            while ok < args.warmup:
                rid = f"{WARMUP_PREFIX}{u}-{sent}"
                body = enc.encode({"model": args.model_name, "prompt": WARMUP_PROMPT, "max_tokens": 2, "stream": True,
                                   "request_id": rid})
                rec = Rec(-1, u)
                sent += 1
                try:
                    await asyncio.wait_for(stream_one(host, port, body, rec, rid), 30)
                except asyncio.TimeoutError:
                    rec.error = "client_timeout"
                if rec.done and rec.error is None:
                    ok += 1
                elif time.monotonic() > deadline:
                    raise RuntimeError(f"warm-up through {host}:{port} keeps failing: {rec.error}")
                else:
                    await asyncio.sleep(0.2)

    asyncio.run(go())
    return sent


def sim_server_check(args: argparse.Namespace) -> str | None:
    """None when the engine server command answers --help and takes --scheduler (and whether
    it takes --host); else why it cannot run."""
    base = shlex.split(args.sim_server_cmd) if args.sim_server_cmd else [*flexlb_exe(), "sim-server"]
    try:
        res = subprocess.run([*base, "--help"], cwd=REPO, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{shlex.join(base)} --help failed: {exc}"
    if res.returncode != 0:
        return f"{shlex.join(base)} --help exited {res.returncode}: {(res.stderr or res.stdout).strip()[-300:]}"
    if "--scheduler" not in res.stdout:
        return f"{shlex.join(base)} does not take --scheduler, which every engine gets (the engine mode)"
    args.sim_server_has_host = "--host" in res.stdout
    return None
