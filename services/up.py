"""`flexlb up`: the whole stack on one machine, no containers.

Starts, in order: `nats-server` with JetStream (data in `--data-dir` or a temporary
directory) and `redis-server` (no persistence) on free or given loopback ports — unless
`FLEXLB_NATS_URL` / `FLEXLB_REDIS_URL` name servers to use instead — then the simulated
workers (`--workers N` colocated, or `--prefill N --decode M` disaggregated) and the
router. `--pool NAME=N` (repeatable) starts N colocated workers serving model NAME (each
with `--served-model-name NAME`): one pool per model, routed by the request's `model`; with
pools, `--workers` (workers of the default model) is 0 unless given. `--engine openai --engine-url URL [--engine-url URL ...]` starts one worker agent
per OpenAI-compatible server instead (workers/openai/agent.py; colocated; the i-th
`--kv-events-endpoint` / `--kv-events-replay-endpoint` goes to the i-th server; without
any, the router's prefix index is `approximate` unless `--prefix-index` says otherwise).
It waits until the router's `/readyz` says ready, prints the URLs, writes them and every
started pid to `--state-file` (JSON); `--routers 2` starts a second router on the
next port (a standby that forwards to the leader and takes over if it dies); `--http-workers N`
starts N routers on the one `--port` instead (SO_REUSEPORT: the kernel spreads connections
among them; the first is the leader, the others standbys that forward to it, so the HTTP side
uses N cores; each also listens on a port of its own, for its /metrics and its view, in the
state file's `http_worker_urls`), and runs until SIGINT/SIGTERM, when it stops
every child (router first, servers last) and exits 0. `--nats-cluster 3` starts three
clustered nats-server processes instead of one (nats-0..2, a store each under `--data-dir`);
every client is given all three URLs and the streams are created with 3 replicas
(FLEXLB_NATS_REPLICAS), so any one node may be lost. `--redis-sentinel` starts a Redis
primary, a replica and three sentinels (quorum 2, a silent primary failed over after 1 s);
the routers find the primary through the sentinels (FLEXLB_REDIS_SENTINELS). A child that dies is reported on
stderr; the rest keep running (an operator restarts what is missing, or Ctrl-C).

Waiting and stopping:
- While it waits for readiness it prints, on stderr, "flexlb up: waiting for URL to be
  ready: REASON": the router's /readyz reason (the workers of a role without a live one, each
  with its own reason, e.g. "w0 not_ready (engine server http://x unreachable: ...)") and the
  workers of the fleet the router has not heard of ("not registered yet: w1", from
  /admin/workers, with FLEXLB_ADMIN_TOKEN if one is set). Not in the first WAIT_SAY_MIN_S
  (2 s), then when the reason changes (at most every 2 s) or every WAIT_SAY_EVERY_S (10 s).
  Not ready after READY_TIMEOUT_S (90 s): it stops everything and exits 1.
- SIGINT or SIGTERM at any moment interrupts whatever it waits for (a server to listen, the
  router to be ready, the run loop): the handler raises `Interrupted`. During start-up it
  prints "flexlb up: interrupted by SIGINT during start-up (waiting for WHAT); stopping what
  it started", after it "flexlb up: SIGTERM: stopping"; either way it sends SIGTERM to the
  routers and workers, gives them CHILDREN_STOP_S (4 s) together, SIGKILLs what is left,
  then stops the servers (SERVERS_STOP_S each before SIGKILL) and exits 0: a stop on request
  is not a failure. A second signal while stopping is ignored (the stop is bounded anyway).
- Routers and workers run in sessions of their own, as the servers do: a terminal's Ctrl-C
  reaches only `flexlb up`, which stops them in order (before, each got the SIGINT too and
  `flexlb up` reported its exit as a failure during start-up).
- Killed outright (SIGKILL), it takes everything with it: every child and server it starts
  (from its main thread) has the parent-death signal SIGTERM (Linux prctl
  PR_SET_PDEATHSIG, services/infra.die_with_parent), so none outlives it.
"""

from __future__ import annotations

import http.client
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import msgspec

from schemas.subjects import strip_credentials
from services.infra import (
    SENTINEL_MASTER,
    Credentials,
    InfraError,
    ManagedServer,
    die_with_parent,
    start_nats,
    start_nats_cluster,
    start_redis,
    start_redis_sentinel,
    write_private,
)
from services.settings import RouterSettings

READY_TIMEOUT_S = 90.0
WAIT_SAY_MIN_S = 2.0  # while waiting for readiness: a changed reason is printed at most this often
WAIT_SAY_EVERY_S = 10.0  # ... and an unchanged one again after this
CHILDREN_STOP_S = 4.0  # stopping: routers and workers get this long (together) after SIGTERM, then SIGKILL
SERVERS_STOP_S = 0.5  # then each server gets at least this long after SIGTERM, then SIGKILL


def _replica_port(host: str, wanted: int) -> int:
    """A standby router's port: the next one after the leader's if free, else any free one
    (printed and written to the state file either way)."""
    import socket

    from services.infra import free_port

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, wanted))
        except OSError:
            return free_port()
    return wanted
# The last `flexlb up`'s URLs and pids, so `flexlb events export` / `tail` find its NATS with
# no flags (FLEXLB_UP_STATE moves it; tests point it into their temporary directory).
LAST_UP_STATE = os.environ.get("FLEXLB_UP_STATE") or os.path.join(
    os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state"), "flexlb", "up.json")


def secrets_path(state_file: str | None) -> str:
    """Where `flexlb up` keeps the URLs of its NATS and Redis with their credentials."""
    return (state_file or LAST_UP_STATE) + ".secrets"


def admin_token_path(state_file: str | None) -> str:
    """Where `flexlb up` keeps the admin token it generated: beside its --state-file, else
    beside LAST_UP_STATE (what the CLI reads)."""
    return (state_file or LAST_UP_STATE) + ".admin-token"


def last_up_state() -> dict | None:
    """The state of the last `flexlb up` on this machine, if it is still running (else None),
    with its servers' URLs as clients need them (their credentials: `with_secrets`)."""
    try:
        with open(LAST_UP_STATE) as fh:
            state = json.load(fh)
        os.kill(int(state["up_pid"]), 0)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return with_secrets(state) if isinstance(state, dict) else None


def with_secrets(state: dict) -> dict:
    """A state file's contents with `nats_url` and `redis_url` as clients need them: with the
    credentials its `secrets_file` holds (readable by its owner only). Unchanged without one."""
    path = state.get("secrets_file")
    if not path:
        return state
    try:
        with open(path) as fh:
            urls = json.load(fh)
    except (OSError, ValueError):
        return state
    return {**state, **{k: urls[k] for k in ("nats_url", "redis_url") if isinstance(urls.get(k), str)}}


def read_admin_token() -> str:
    """The admin token of the last `flexlb up` on this machine while it runs ("": none, or not
    readable): what `flexlb workers` and `flexlb explain` send when given none."""
    path = (last_up_state() or {}).get("admin_token_file")
    if not path:
        return ""
    try:
        with open(path) as fh:
            return fh.read().strip()
    except OSError:
        return ""


class Interrupted(BaseException):
    """SIGINT or SIGTERM reached `flexlb up`: raised from the signal handler wherever it
    waits (a BaseException, so no `except Exception` on the way swallows it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _child(argv: list[str], env: dict[str, str], nice: int = 0) -> subprocess.Popen:
    """A `flexlb` child in a session of its own (a terminal's Ctrl-C reaches only `flexlb up`,
    which stops the children itself) that ends with us (infra.die_with_parent)."""
    return subprocess.Popen([sys.executable, "-m", "services.cli", *argv], env=env, start_new_session=True,
                            preexec_fn=die_with_parent(nice))


def _get_json(url: str, token: str = "") -> tuple[int, dict]:
    """GET a router URL: (HTTP status, JSON body); OSError if it does not answer."""
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=2) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as exc:
        body = exc.read()
        try:
            return exc.code, json.loads(body or b"{}")
        except ValueError:
            return exc.code, {"error": {"message": body.decode(errors="replace")[:200]}}


def _not_ready_reason(url: str, worker_ids: list[str], admin_token: str, admin_url: str = "") -> str | None:
    """None when the router at `url` is ready; else why not, in one line: its /readyz reason
    (which names the workers that are not live and why), and the workers of this fleet it
    has not heard of at all (from /admin/workers)."""
    try:
        status, body = _get_json(url + "/readyz")
    except (OSError, ValueError, http.client.HTTPException) as exc:  # not listening yet (starting), a cut or non-JSON answer
        return f"the router does not answer yet ({getattr(exc, 'reason', exc)})"
    if status == 200:
        return None
    reason = str((body.get("error") or {}).get("message") or f"HTTP {status}")
    if worker_ids:
        try:
            status, body = _get_json((admin_url or url) + "/admin/workers", admin_token)
        except (OSError, ValueError, http.client.HTTPException):  # the readyz reason alone is still worth printing
            status, body = 0, {}
        if status == 200:
            known = {w.get("id") for w in body.get("workers", [])}
            unknown = [w for w in worker_ids if w not in known]
            if unknown:
                reason += "; not registered yet: " + ", ".join(unknown)
    return reason


def _wait_ready(url: str, procs: dict[str, subprocess.Popen], timeout_s: float, worker_ids: list[str] = (),
                admin_token: str = "", say=None, admin_url: str = "") -> None:
    """Until the router at `url` is ready. Why it is not is printed when it changes (at most
    every WAIT_SAY_MIN_S, the first time after that long) and again every WAIT_SAY_EVERY_S;
    `say(reason)` is told each new one. InfraError if a child exits or `timeout_s` passes."""
    started = time.monotonic()
    deadline = started + timeout_s
    said, said_at = None, started
    reason = "no answer yet"
    while time.monotonic() < deadline:
        for name, p in procs.items():
            if p.poll() is not None:
                raise InfraError(f"{name} (pid {p.pid}) exited with status {p.returncode} during start-up")
        reason = _not_ready_reason(url, list(worker_ids), admin_token, admin_url)
        if reason is None:
            return
        if say is not None:
            say(reason)
        now = time.monotonic()
        if (reason != said and now - said_at >= WAIT_SAY_MIN_S) or now - said_at >= WAIT_SAY_EVERY_S:
            print(f"flexlb up: waiting for {url} to be ready: {reason}", file=sys.stderr, flush=True)
            said, said_at = reason, now
        time.sleep(0.25)
    raise InfraError(f"router at {url} not ready after {timeout_s:.0f} s: {reason}")


def _stop_all(children: dict[str, subprocess.Popen], servers: list[ManagedServer]) -> None:
    """SIGTERM to every router and worker (routers first), CHILDREN_STOP_S for all of them
    together, SIGKILL to what is left; then the servers likewise, in reverse start order."""
    order = sorted(children, key=lambda n: not n.startswith("router"))
    for name in order:
        p = children[name]
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + CHILDREN_STOP_S
    for name in order:
        p = children[name]
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            print(f"flexlb up: {name} (pid {p.pid}) still running {CHILDREN_STOP_S} s after SIGTERM: killed",
                  file=sys.stderr, flush=True)
            p.kill()
            p.wait(5)
    for s in reversed(servers):
        s.stop(SERVERS_STOP_S)


def parse_pools(values: list[str]) -> list[tuple[str, int]]:
    """`--pool NAME=N` values -> [(model, number of workers)], in order; ValueError naming the
    bad one (no `=`, an empty name, N not a positive integer, a model given twice)."""
    pools: list[tuple[str, int]] = []
    for value in values:
        name, sep, count = value.rpartition("=")
        if not sep or not name.strip() or not count.strip().isdigit() or int(count) < 1:
            raise ValueError(f"--pool {value!r}: expected NAME=N, a model name and a number of workers >= 1")
        if any(name == seen for seen, _ in pools):
            raise ValueError(f"--pool {value!r}: model {name!r} is given twice")
        pools.append((name, int(count)))
    return pools


def run_up(args, settings: RouterSettings) -> int:
    prefix_index = settings.prefix_index
    if args.engine == "openai":
        urls, events, replays = args.engine_url or [], args.kv_events_endpoint or [], args.kv_events_replay_endpoint or []
        if not urls:
            raise ValueError("--engine openai needs --engine-url URL, once per server")
        if args.prefill or args.decode:
            raise ValueError("--engine openai serves colocated only (no --prefill / --decode)")
        if len(events) > len(urls) or len(replays) > len(events):
            raise ValueError("give --kv-events-endpoint at most once per --engine-url (the i-th to the i-th server), "
                             "and --kv-events-replay-endpoint at most once per --kv-events-endpoint")
        if not events and args.prefix_index is None and "FLEXLB_PREFIX_INDEX" not in os.environ:
            prefix_index = "approximate"  # no KV events from the servers: learn the prefixes from decisions
    elif args.engine_url or args.kv_events_endpoint or args.kv_events_replay_endpoint:
        raise ValueError("--engine-url and --kv-events-* go with --engine openai")
    llamacpp = args.engine == "llamacpp"  # llama-servers started here, then used as --engine openai servers
    if llamacpp:
        if args.prefill or args.decode or args.pool:
            raise ValueError("--engine llamacpp starts colocated llama-servers of one model (no --prefill / --decode / "
                             "--pool)")
        if args.gguf and not os.path.isfile(args.gguf):
            raise ValueError(f"--gguf {args.gguf}: no such file")
        if args.prefix_index is None and "FLEXLB_PREFIX_INDEX" not in os.environ:
            prefix_index = "approximate"  # llama-server publishes no KV events
    elif args.gguf or args.llama_server_arg:
        raise ValueError("--gguf and --llama-server-arg go with --engine llamacpp")
    if (args.prefill > 0) != (args.decode > 0):
        raise ValueError("--prefill and --decode go together (disaggregated mode needs both roles)")
    if args.routers < 1:
        raise ValueError("--routers must be >= 1")
    if args.http_workers < 1:
        raise ValueError("--http-workers must be >= 1")
    if args.http_workers > 1 and args.routers > 1:
        raise ValueError("--http-workers N already runs N routers (a leader and standbys); give one of the two")
    if not 1 <= args.nats_cluster <= 7:
        raise ValueError("--nats-cluster must be 1..7 (nodes of one NATS cluster on this machine)")
    if args.nats_cluster > 1 and os.environ.get("FLEXLB_NATS_URL"):
        raise ValueError("--nats-cluster starts a cluster; FLEXLB_NATS_URL names servers to use instead: give one of the two")
    if args.redis_sentinel and os.environ.get("FLEXLB_REDIS_URL"):
        raise ValueError("--redis-sentinel starts Redis with Sentinel; FLEXLB_REDIS_URL names a server to use instead: "
                         "give one of the two")
    pools = parse_pools(args.pool or [])
    if pools and (args.prefill or args.engine == "openai"):
        raise ValueError("--pool starts colocated sim or torch workers (no --prefill / --decode, no --engine openai)")
    if args.scheduling_pool:
        raise ValueError("flexlb up starts its routers itself: --leader-per-pool gives each one a pool "
                         "(--scheduling-pool is for a `flexlb router` of your own)")
    if args.leader_per_pool and (not pools or args.workers or args.http_workers > 1):
        raise ValueError("--leader-per-pool goes with --pool NAME=N (every worker in a pool: no --workers, "
                         "no --http-workers)")
    num_routers = max(args.routers, len(pools)) if args.leader_per_pool else args.routers
    num_workers = args.workers if args.workers is not None else (0 if pools else 2)
    if args.prefill == 0 and num_workers < (0 if pools else 1):
        raise ValueError("--workers must be >= 1 (>= 0 with --pool)")
    servers: list[ManagedServer] = []
    children: dict[str, subprocess.Popen] = {}
    stop_signal: int | None = None
    waiting_for = "starting"  # what start-up is doing now, said if it is interrupted
    is_up = False

    def on_signal(signum, frame):
        nonlocal stop_signal
        if stop_signal is not None:  # already stopping (bounded: _stop_all)
            return
        stop_signal = signum
        raise Interrupted(signum)  # out of whatever wait it is in

    def waiting(reason: str) -> None:
        nonlocal waiting_for
        waiting_for = reason

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    token_file = secrets_file = ""
    creds = Credentials.generate()  # for the servers it starts (not for those FLEXLB_*_URL names)
    try:
        nats_url = os.environ.get("FLEXLB_NATS_URL")
        replicas_env: dict[str, str] = {}
        if not nats_url:
            data_dir = args.data_dir or tempfile.mkdtemp(prefix="flexlb-nats-")
            if args.nats_cluster > 1:
                ports = [args.nats_port + i for i in range(args.nats_cluster)] if args.nats_port else None
                waiting(f"a cluster of {args.nats_cluster} nats-server processes to start")
                servers.extend(start_nats_cluster(data_dir, args.nats_cluster, ports, creds=creds))
                nats_url = creds.nats_url(",".join(s.url for s in servers))
                if "FLEXLB_NATS_REPLICAS" not in os.environ:
                    replicas_env["FLEXLB_NATS_REPLICAS"] = str(min(3, args.nats_cluster))
            else:
                waiting("nats-server to start")
                servers.append(start_nats(data_dir, args.nats_port, creds=creds))
                nats_url = creds.nats_url(servers[-1].url)
        redis_url = os.environ.get("FLEXLB_REDIS_URL")
        sentinel_env: dict[str, str] = {}
        if not redis_url:
            if args.redis_sentinel:
                root = os.path.join(args.data_dir, "sentinel") if args.data_dir else tempfile.mkdtemp(prefix="flexlb-sentinel-")
                waiting("Redis with Sentinel to start")
                started = start_redis_sentinel(root, creds=creds)
                servers.extend(started)
                redis_url = creds.redis_url(started[0].url)  # the first primary; routers follow the sentinels, not this
                sentinel_env = {"FLEXLB_REDIS_SENTINELS": ",".join(s.url for s in started[2:]),
                                "FLEXLB_REDIS_MASTER_NAME": SENTINEL_MASTER}
            else:
                waiting("redis-server to start")
                servers.append(start_redis(args.redis_port, creds=creds))
                redis_url = creds.redis_url(servers[-1].url)
        if llamacpp:  # its servers first: the agents in front of them are plain openai workers from here on
            from services import llamacpp as lc

            waiting("llama-server to be found or built")
            binary = lc.server_binary(say=lambda what: print(f"flexlb up: {what}", file=sys.stderr, flush=True))
            if not args.gguf:
                waiting("the tiny llama.cpp model to be made")
            model = os.path.abspath(args.gguf) if args.gguf else lc.tiny_model()
            waiting(f"{num_workers} llama-server processes to load {os.path.basename(model)}")
            slots, threads = lc.machine_shape(model, num_workers)
            started = lc.start_servers(num_workers, model, binary, parallel=slots, threads=threads,
                                       extra=args.llama_server_arg or [])
            servers.extend(started)
            args.engine, args.engine_url = "openai", [s.url for s in started]
            if args.engine_prompt is None and not settings.tokenizer:  # the router lacks the model's tokenizer:
                args.engine_prompt = "text"  # text completions are tokenized by llama-server itself
        env = dict(os.environ, FLEXLB_NATS_URL=nats_url, FLEXLB_REDIS_URL=redis_url, **replicas_env, **sentinel_env)
        admin_token = settings.admin_token
        if not admin_token and not args.open_admin:  # the admin API is closed by default
            admin_token = secrets.token_urlsafe(32)
            token_file = write_private(admin_token_path(args.state_file), admin_token + "\n")
            settings = msgspec.structs.replace(settings, admin_token=admin_token)
        if admin_token:  # to the routers by environment, never a command line
            env["FLEXLB_ADMIN_TOKEN"] = admin_token
        worker_flags: list[str] = []
        for flag in ("engine", "model", "device", "model_seed", "dtype", "torch_threads", "time_scale", "heartbeat_interval_ms",
                     "num_kv_blocks", "block_size_tokens", "max_batch_tokens", "max_seq_len_tokens", "profile",
                     "outbound_buffer_bytes", "max_num_batched_tokens", "max_num_seqs", "scheduler", "max_prefill_tokens",
                     "engine_model", "served_model_name", "engine_protocol", "engine_prompt",
                     "upstream_max_concurrency", "upstream_stall_timeout_s", "kv_events_topic",
                     "lora_adapters", "max_loras", "lora_load_ms", "engine_max_num_seqs", "drain_timeout_s"):
            value = getattr(args, flag)
            if value is not None:
                worker_flags += [f"--{flag.replace('_', '-')}", str(value)]
        if args.drain_timeout_s is None:  # its routers stop first: nobody waits for what a worker would finish
            worker_flags += ["--drain-timeout-s", "0"]
        if args.chunked_prefill is False:
            worker_flags.append("--no-chunked-prefill")
        per_worker: dict[str, list[str]] = {}  # flags of one worker only (its server, its pool's model)
        worker_models: dict[str, str] = {}  # worker id -> its --pool's model (others: the engine's own)
        if args.engine == "openai":
            fleet = [(f"w{i}", "pd_fusion") for i in range(len(args.engine_url))]
            per_worker = {f"w{i}": ["--engine-url", url] for i, url in enumerate(args.engine_url)}
            for i, endpoint in enumerate(args.kv_events_endpoint or []):
                per_worker[f"w{i}"] += ["--kv-events-endpoint", endpoint]
            for i, replay in enumerate(args.kv_events_replay_endpoint or []):
                per_worker[f"w{i}"] += ["--kv-events-replay-endpoint", replay]
        elif args.prefill:
            fleet = [(f"p{i}", "prefill") for i in range(args.prefill)] + [(f"d{i}", "decode") for i in range(args.decode)]
        else:
            fleet = [(f"w{i}", "pd_fusion") for i in range(num_workers)]
            for model, n in pools:  # each pool's workers serve its model, numbered on from the default's
                for _ in range(n):
                    worker_id = f"w{len(fleet)}"
                    fleet.append((worker_id, "pd_fusion"))
                    per_worker[worker_id] = ["--served-model-name", model]
                    worker_models[worker_id] = model
        worker_metrics_urls: dict[str, str] = {}
        if args.worker_metrics:
            from services.infra import free_port

            for worker_id, _ in fleet:
                port = free_port()
                per_worker.setdefault(worker_id, []).extend(["--metrics-port", str(port)])
                worker_metrics_urls[worker_id] = f"http://127.0.0.1:{port}/metrics"
        worker_nice = 0
        if args.engine == "torch" and (args.device or "cpu") == "cpu":
            # CPU torch workers share this machine's cores (WorkerConfig.torch_threads says why),
            # and run at a lower priority: computing flat out, they would otherwise starve the
            # router, whose late reading of heartbeats then declares live workers dead.
            worker_nice = 10
            if args.torch_threads is None:
                worker_flags += ["--torch-threads", str(max(1, (os.cpu_count() or 1) // max(1, len(fleet))))]
        for worker_id, role in fleet:
            children[f"worker-{worker_id}"] = _child(["worker", "--id", worker_id, "--role", role, *worker_flags,
                                                      *per_worker.get(worker_id, [])], env, nice=worker_nice)
        router_urls, http_worker_urls, admin_urls = [], [], []
        for i in range(max(num_routers, args.http_workers)):
            router_id = settings.router_id if i == 0 else f"{settings.router_id}-{i}"
            if args.http_workers > 1:  # one shared port; each process also has its own
                port = settings.port
                own_port = _replica_port(settings.host, settings.port + 1 + i)
                listen = ["--reuse-port", "--own-port", str(own_port)]
            else:
                port = settings.port if i == 0 else _replica_port(settings.host, settings.port + i)
                listen = []
            if settings.admin_port:  # the admin API on a listener of its own, the i-th router on port + i
                listen += ["--admin-port", str(settings.admin_port + i), "--admin-host", settings.admin_host]
                admin_urls.append(f"http://{settings.admin_host}:{settings.admin_port + i}")
            router_flags = ["router", *listen, "--host", settings.host, "--port", str(port), "--router-id", router_id,
                            "--prefill-policy", settings.prefill_policy, "--decode-policy", settings.decode_policy,
                            "--prefill-policy-params", json.dumps(settings.prefill_policy_params),
                            "--decode-policy-params", json.dumps(settings.decode_policy_params),
                            "--batcher", settings.batcher, "--batcher-params", json.dumps(settings.batcher_params_effective()),
                            "--prefix-index", prefix_index, "--slo-mode", settings.slo_mode,
                            "--slo-tpot-guard", str(settings.slo_tpot_guard),
                            "--prefill-coefficients", json.dumps(settings.prefill_coefficients),
                            "--predictor-learning", str(settings.predictor_learning).lower(),
                            "--max-prompt-tokens", str(settings.max_prompt_tokens), "--seed", str(settings.seed),
                            "--cluster", settings.cluster, "--log-level", settings.log_level,
                            "--tokenizer-add-special-tokens", str(settings.tokenizer_add_special_tokens).lower(),
                            "--fair-queue", str(settings.fair_queue).lower(),
                            "--fair-engine-buffer", str(settings.fair_engine_buffer),
                            "--fairness-params", json.dumps(settings.fairness_params),
                            "--tenant-weights", json.dumps(settings.tenant_weights),
                            "--tenant-header", settings.tenant_header,
                            *(["--trust-tenant-header"] if settings.trust_tenant_header else []),
                            "--tenant-classes", json.dumps(settings.tenant_classes),
                            "--tenant-limits", json.dumps(settings.tenant_limits),
                            *(["--strict-priority"] if settings.strict_priority else []),
                            "--retry-limit", str(settings.retry_limit),
                            "--migration-limit", str(settings.migration_limit), "--breaker-failures", str(settings.breaker_failures),
                            "--breaker-open-s", str(settings.breaker_open_s),
                            "--tpot-calibration", settings.tpot_calibration,
                            "--breaker-max-open-s", str(settings.breaker_max_open_s),
                            # up stops its routers first, then its workers: a router relays its open
                            # streams 1 s (not 30) unless told otherwise
                            "--drain-timeout-s", str(1.0 if args.drain_timeout_s is None else args.drain_timeout_s)]
            if settings.tokenizer:  # every replica tokenizes alike: a standby forwards ids, not text
                router_flags += ["--tokenizer", os.path.abspath(settings.tokenizer)]
            if settings.chat_template:
                router_flags += ["--chat-template", os.path.abspath(settings.chat_template)]
            led = pools[i % len(pools)][0] if args.leader_per_pool else ""
            if led:
                router_flags += ["--scheduling-pool", led]
            # API keys go by environment, never on a command line (readable in /proc/*/cmdline)
            router_env = {**env, "FLEXLB_TENANT_API_KEYS": json.dumps(settings.tenant_api_keys)} if settings.tenant_api_keys else env
            children["router" if i == 0 else f"router-{i}"] = _child(router_flags, router_env)
            if args.http_workers > 1:
                http_worker_urls.append(f"http://{settings.host}:{own_port}")
                if i == 0:
                    router_urls.append(f"http://{settings.host}:{port}")
            else:
                router_urls.append(f"http://{settings.host}:{port}")
            if i == 0:  # the first router takes the lease; the others start as standbys
                url = http_worker_urls[0] if http_worker_urls else router_urls[0]
                waiting(f"the router at {url} to be ready")
                _wait_ready(url, children, READY_TIMEOUT_S,
                            [w for w, _ in fleet if not led or worker_models.get(w) == led], settings.admin_token,
                            lambda why, url=url: waiting(f"the router at {url} to be ready: {why}"),
                            admin_urls[0] if admin_urls else url)
        router_url = router_urls[0]
        for url in router_urls[1:] + http_worker_urls[1:]:
            waiting(f"the standby router at {url} to be ready")
            _wait_ready(url, children, READY_TIMEOUT_S, say=lambda why, url=url: waiting(
                f"the standby router at {url} to be ready: {why}"))
        # The servers' URLs with their credentials go to a file of mode 0600 of their own (the
        # clients' FLEXLB_NATS_URL / FLEXLB_REDIS_URL); the state file keeps the addresses.
        secrets_file = write_private(secrets_path(args.state_file), json.dumps({"nats_url": nats_url, "redis_url": redis_url}))
        state = {
            "router_url": router_url,
            "router_urls": router_urls,
            "http_worker_urls": http_worker_urls,  # --http-workers: each process's own port (its /metrics, its view)
            "admin_url": admin_urls[0] if admin_urls else router_url,  # where /admin/* is (--admin-port: its own port)
            "admin_urls": admin_urls,  # --admin-port: each router's admin listener
            "nats_url": strip_credentials(nats_url),
            "redis_url": strip_credentials(redis_url),
            "secrets_file": secrets_file,  # the URLs with their credentials (mode 0600; last_up_state reads them)
            "redis_sentinels": sentinel_env.get("FLEXLB_REDIS_SENTINELS", ""),
            "worker_metrics_urls": worker_metrics_urls,  # --worker-metrics: each worker's own /metrics
            "workers": [{"id": w, "role": r, **({"model": worker_models[w]} if w in worker_models else {})} for w, r in fleet],
            # where the admin token `up` generated is (mode 0600; the CLI reads it from there): not
            # the token itself ("": one was given, by FLEXLB_ADMIN_TOKEN, or --open-admin)
            "admin_token_file": token_file,
            "pids": {**{s.name: s.proc.pid for s in servers}, **{n: p.pid for n, p in children.items()}},
            "up_pid": os.getpid(),
            "nats_data_dir": next((s.argv[s.argv.index("-sd") + 1] for s in servers if s.name == "nats-server"), None),
            # Every server this run started, with its command line: an operator (or a fault test)
            # restarts a killed node as it was, on its port and store.
            "servers": [{"name": s.name, "url": s.url, "pid": s.proc.pid, "argv": s.argv} for s in servers],
        }
        for path in filter(None, (args.state_file, LAST_UP_STATE)):  # LAST_UP_STATE: what `flexlb events` finds
            try:
                write_private(path, json.dumps(state, indent=2))
            except OSError as exc:
                if path == args.state_file:
                    raise
                print(f"flexlb up: could not write {path} ({exc}); pass --nats-url to `flexlb events`", file=sys.stderr)
        named = [f"{w}/{r}" + (f" {worker_models[w]}" if w in worker_models else "") for w, r in fleet]  # (with its pool)
        print(f"FlexLB is up: {', '.join(router_urls)}  (workers: {', '.join(named)})", flush=True)
        print(f"  completions: curl -N {router_url}/v1/completions -H 'Content-Type: application/json' "
              f"-d '{{\"prompt\": \"Hello\", \"max_tokens\": 16, \"stream\": true}}'", flush=True)
        admin_url = admin_urls[0] if admin_urls else router_url
        print(f"  admin: {admin_url}/admin/workers  {admin_url}/admin/ledger   nats: {strip_credentials(nats_url)}   "
              f"redis: {strip_credentials(redis_url)} (their credentials: in {secrets_file})", flush=True)
        print("  flight recorder: flexlb events export --out run.jsonl.gz && flexlb replay run.jsonl.gz", flush=True)
        if token_file:
            print(f"  admin token: in {token_file} (mode 0600; `flexlb workers` and `flexlb explain` read it from "
                  "there; curl -H \"Authorization: Bearer $(cat FILE)\")", flush=True)
        elif not admin_token:
            print("  admin: OPEN (--open-admin): anyone who can reach the port can drain and remove workers", flush=True)
        is_up = True
        reported: set[str] = set()
        while True:  # until a signal (Interrupted)
            for name, p in children.items():
                if p.poll() is not None and name not in reported:
                    reported.add(name)
                    print(f"flexlb up: {name} (pid {p.pid}) exited with status {p.returncode}", file=sys.stderr, flush=True)
            time.sleep(0.2)
    except Interrupted as exc:
        if is_up:
            print(f"flexlb up: {exc}: stopping", file=sys.stderr, flush=True)
        else:
            print(f"flexlb up: interrupted by {exc} during start-up (waiting for {waiting_for}); "
                  "stopping what it started", file=sys.stderr, flush=True)
        return 0
    except InfraError as exc:
        print(f"flexlb up: {exc}", file=sys.stderr)
        return 1
    finally:
        stop_signal = stop_signal or signal.SIGTERM  # from here on a signal no longer interrupts: the stop is bounded
        _stop_all(children, servers)
        for path in filter(None, (token_file, secrets_file)):  # (the secrets die with what they opened)
            try:
                os.unlink(path)
            except OSError as exc:
                print(f"flexlb up: could not remove {path}: {exc}", file=sys.stderr)
        shutil.rmtree(creds.secrets_dir, ignore_errors=True)
