"""`flexlb up`: the whole stack on one machine, no containers.

Starts, in order: `nats-server` with JetStream (data in `--data-dir` or a temporary
directory) and `redis-server` (no persistence) on free or given loopback ports — unless
`FLEXLB_NATS_URL` / `FLEXLB_REDIS_URL` name servers to use instead — then the simulated
workers (`--workers N` colocated, or `--prefill N --decode M` disaggregated) and the
router. `--engine openai --engine-url URL [--engine-url URL ...]` starts one worker agent
per OpenAI-compatible server instead (workers/openai_agent.py; colocated; the i-th
`--kv-events-endpoint` / `--kv-events-replay-endpoint` goes to the i-th server; without
any, the router's prefix index is `approximate` unless `--prefix-index` says otherwise). It waits until the router's `/readyz` says ready, prints the URLs, writes them and
every started pid to `--state-file` (JSON); `--routers 2` starts a second router on the
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
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

from services.infra import (
    SENTINEL_MASTER,
    InfraError,
    ManagedServer,
    start_nats,
    start_nats_cluster,
    start_redis,
    start_redis_sentinel,
)
from services.settings import RouterSettings

READY_TIMEOUT_S = 90.0


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


def _child(argv: list[str], env: dict[str, str], nice: int = 0) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "services.cli", *argv], env=env,
                            preexec_fn=(lambda: os.nice(nice)) if nice else None)


def _wait_ready(url: str, procs: dict[str, subprocess.Popen], timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    last = "no answer yet"
    while time.monotonic() < deadline:
        for name, p in procs.items():
            if p.poll() is not None:
                raise InfraError(f"{name} exited with status {p.returncode} during start-up")
        try:
            with urllib.request.urlopen(url + "/readyz", timeout=2) as resp:
                if resp.status == 200:
                    return "ready"
        except urllib.error.HTTPError as exc:
            last = exc.read().decode(errors="replace")
        except OSError as exc:
            last = str(exc)
        time.sleep(0.2)
    raise InfraError(f"router not ready after {timeout_s}s: {last}")


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
    if args.prefill == 0 and args.workers < 1:
        raise ValueError("--workers must be >= 1")
    servers: list[ManagedServer] = []
    children: dict[str, subprocess.Popen] = {}
    stopping = False

    def on_signal(signum, frame):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        nats_url = os.environ.get("FLEXLB_NATS_URL")
        replicas_env: dict[str, str] = {}
        if not nats_url:
            data_dir = args.data_dir or tempfile.mkdtemp(prefix="flexlb-nats-")
            if args.nats_cluster > 1:
                ports = [args.nats_port + i for i in range(args.nats_cluster)] if args.nats_port else None
                servers.extend(start_nats_cluster(data_dir, args.nats_cluster, ports))
                nats_url = ",".join(s.url for s in servers)
                if "FLEXLB_NATS_REPLICAS" not in os.environ:
                    replicas_env["FLEXLB_NATS_REPLICAS"] = str(min(3, args.nats_cluster))
            else:
                servers.append(start_nats(data_dir, args.nats_port))
                nats_url = servers[-1].url
        redis_url = os.environ.get("FLEXLB_REDIS_URL")
        sentinel_env: dict[str, str] = {}
        if not redis_url:
            if args.redis_sentinel:
                root = os.path.join(args.data_dir, "sentinel") if args.data_dir else tempfile.mkdtemp(prefix="flexlb-sentinel-")
                started = start_redis_sentinel(root)
                servers.extend(started)
                redis_url = started[0].url  # the first primary; routers follow the sentinels, not this
                sentinel_env = {"FLEXLB_REDIS_SENTINELS": ",".join(s.url for s in started[2:]),
                                "FLEXLB_REDIS_MASTER_NAME": SENTINEL_MASTER}
            else:
                servers.append(start_redis(args.redis_port))
                redis_url = servers[-1].url
        env = dict(os.environ, FLEXLB_NATS_URL=nats_url, FLEXLB_REDIS_URL=redis_url, **replicas_env, **sentinel_env)
        worker_flags: list[str] = []
        for flag in ("engine", "model", "device", "model_seed", "dtype", "torch_threads", "time_scale", "heartbeat_interval_ms", "num_kv_blocks", "block_size_tokens", "max_batch_tokens",
                     "max_seq_len_tokens", "profile", "outbound_buffer_bytes", "max_num_batched_tokens", "max_num_seqs",
                     "scheduler", "max_prefill_tokens", "engine_model", "upstream_max_concurrency", "upstream_stall_timeout_s", "kv_events_topic"):
            value = getattr(args, flag)
            if value is not None:
                worker_flags += [f"--{flag.replace('_', '-')}", str(value)]
        if args.chunked_prefill is False:
            worker_flags.append("--no-chunked-prefill")
        per_worker: dict[str, list[str]] = {}  # flags of one worker only (its server)
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
            fleet = [(f"w{i}", "pd_fusion") for i in range(args.workers)]
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
        router_urls, http_worker_urls = [], []
        for i in range(max(args.routers, args.http_workers)):
            router_id = settings.router_id if i == 0 else f"{settings.router_id}-{i}"
            if args.http_workers > 1:  # one shared port; each process also has its own
                port = settings.port
                own_port = _replica_port(settings.host, settings.port + 1 + i)
                listen = ["--reuse-port", "--own-port", str(own_port)]
            else:
                port = settings.port if i == 0 else _replica_port(settings.host, settings.port + i)
                listen = []
            router_flags = ["router", *listen, "--host", settings.host, "--port", str(port), "--router-id", router_id,
                            "--prefill-policy", settings.prefill_policy, "--decode-policy", settings.decode_policy,
                            "--prefill-policy-params", json.dumps(settings.prefill_policy_params),
                            "--decode-policy-params", json.dumps(settings.decode_policy_params),
                            "--batcher", settings.batcher, "--batcher-params", json.dumps(settings.batcher_params_effective()),
                            "--prefix-index", prefix_index, "--slo-mode", settings.slo_mode,
                            "--prefill-coefficients", json.dumps(settings.prefill_coefficients),
                            "--predictor-learning", str(settings.predictor_learning).lower(),
                            "--max-prompt-tokens", str(settings.max_prompt_tokens), "--seed", str(settings.seed),
                            "--cluster", settings.cluster, "--log-level", settings.log_level,
                            "--tokenizer-add-special-tokens", str(settings.tokenizer_add_special_tokens).lower()]
            if settings.tokenizer:  # every replica tokenizes alike: a standby forwards ids, not text
                router_flags += ["--tokenizer", os.path.abspath(settings.tokenizer)]
            children["router" if i == 0 else f"router-{i}"] = _child(router_flags, env)
            if args.http_workers > 1:
                http_worker_urls.append(f"http://{settings.host}:{own_port}")
                if i == 0:
                    router_urls.append(f"http://{settings.host}:{port}")
            else:
                router_urls.append(f"http://{settings.host}:{port}")
            if i == 0:  # the first router takes the lease; the others start as standbys
                _wait_ready(http_worker_urls[0] if http_worker_urls else router_urls[0], children, READY_TIMEOUT_S)
        router_url = router_urls[0]
        for url in router_urls[1:] + http_worker_urls[1:]:
            _wait_ready(url, children, READY_TIMEOUT_S)
        state = {
            "router_url": router_url,
            "router_urls": router_urls,
            "http_worker_urls": http_worker_urls,  # --http-workers: each process's own port (its /metrics, its view)
            "nats_url": nats_url,
            "redis_url": redis_url,
            "redis_sentinels": sentinel_env.get("FLEXLB_REDIS_SENTINELS", ""),
            "worker_metrics_urls": worker_metrics_urls,  # --worker-metrics: each worker's own /metrics
            "workers": [{"id": w, "role": r} for w, r in fleet],
            "pids": {**{s.name: s.proc.pid for s in servers}, **{n: p.pid for n, p in children.items()}},
            "up_pid": os.getpid(),
            "nats_data_dir": next((s.argv[s.argv.index("-sd") + 1] for s in servers if s.name == "nats-server"), None),
            # Every server this run started, with its command line: an operator (or a fault test)
            # restarts a killed node as it was, on its port and store.
            "servers": [{"name": s.name, "url": s.url, "pid": s.proc.pid, "argv": s.argv} for s in servers],
        }
        for path in filter(None, (args.state_file, LAST_UP_STATE)):  # LAST_UP_STATE: what `flexlb events` finds
            try:
                os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
                tmp = path + ".tmp"
                with open(tmp, "w") as fh:
                    json.dump(state, fh, indent=2)
                os.replace(tmp, path)
            except OSError as exc:
                if path == args.state_file:
                    raise
                print(f"flexlb up: could not write {path} ({exc}); pass --nats-url to `flexlb events`", file=sys.stderr)
        print(f"FlexLB is up: {', '.join(router_urls)}  (workers: {', '.join(f'{w}/{r}' for w, r in fleet)})", flush=True)
        print(f"  completions: curl -N {router_url}/v1/completions -H 'Content-Type: application/json' "
              f"-d '{{\"prompt\": \"Hello\", \"max_tokens\": 16, \"stream\": true}}'", flush=True)
        print(f"  admin: {router_url}/admin/workers  {router_url}/admin/ledger   nats: {nats_url}   redis: {redis_url}",
              flush=True)
        print("  flight recorder: flexlb events export --out run.jsonl.gz && flexlb replay run.jsonl.gz", flush=True)
        reported: set[str] = set()
        while not stopping:
            for name, p in children.items():
                if p.poll() is not None and name not in reported:
                    reported.add(name)
                    print(f"flexlb up: {name} (pid {p.pid}) exited with status {p.returncode}", file=sys.stderr, flush=True)
            time.sleep(0.2)
        return 0
    except InfraError as exc:
        print(f"flexlb up: {exc}", file=sys.stderr)
        return 1
    finally:
        order = ["router"] + [n for n in children if n != "router"]
        for name in order:
            p = children.get(name)
            if p is not None and p.poll() is None:
                p.terminate()
        for name in order:
            p = children.get(name)
            if p is None:
                continue
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        for s in reversed(servers):
            s.stop()
