"""`flexlb` command line: `up` (the whole stack on one machine, services/up.py), `router`,
`worker`, `sim-server` (one simulated engine over HTTP, workers/sim_server/http.py), `workers`
(list, drain, undrain, remove through the admin API), `events` (export or tail the event
log), `replay`, `explain` and `whatif` (the flight recorder, services/eventlog.py and
services/whatif.py), `schema` (the JSON Schema of every bus message).

One module over 500 lines: the parser of ten commands and the run function of each, whose
stop handling (SIGTERM, SIGINT at any moment) is the bulk; what a command does lives in the
module it names.

Flags override `FLEXLB_*` environment variables, which override defaults; every value is
validated at start and a bad one exits with status 2 and a message naming it.
`up`, `router` and `worker` stop on SIGTERM or SIGINT at any moment (starting, waiting for
NATS or Redis, serving) within 5 s and exit 0: a stop on request is not a failure.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import signal
import sys
import threading
import time

from schemas.subjects import redact_url
from services.core.batchers import BATCHERS
from services.core.policies import DECODE_POLICIES, PREFILL_POLICIES
from services.settings import SHIPPED_BATCHER, RouterSettings, SettingsError, known_env_vars, load


def _choices_help(registry, default: str) -> str:  # noqa: ANN001 - a policy or batcher registry
    """`name (default): summary | ...` from a core registry, so the help lists what exists."""
    return " | ".join(f"{name}{' (default)' if name == default else ''}: {spec.summary}" for name, spec in registry.items())


PREFILL_HELP = _choices_help(PREFILL_POLICIES, RouterSettings().prefill_policy)
DECODE_HELP = _choices_help(DECODE_POLICIES, RouterSettings().decode_policy)
BATCHER_HELP = _choices_help(BATCHERS, SHIPPED_BATCHER)


def _add_router_flags(p: argparse.ArgumentParser, with_listen: bool = True) -> None:
    p.add_argument("--nats-url", help="NATS server URL (env FLEXLB_NATS_URL)")
    p.add_argument("--redis-url", help="Redis URL (env FLEXLB_REDIS_URL)")
    if with_listen:
        p.add_argument("--host", help="HTTP listen address (default 127.0.0.1)")
        p.add_argument("--port", type=int, help="HTTP port (default 8000)")
        p.add_argument("--reuse-port", action="store_true", default=None,
                       help="bind the port with SO_REUSEPORT: several router processes share it")
        p.add_argument("--own-port", type=int, help="with --reuse-port: a second port only this process listens on")
        p.add_argument("--admin-port", type=int, help="serve /admin/*, /docs and /openapi.json on this port instead "
                                                      "(the public port then carries only the API, health and metrics; "
                                                      "flexlb up: the i-th router gets this + i)")
        p.add_argument("--admin-host", help="listen address of --admin-port (default 127.0.0.1)")
    p.add_argument("--router-id", help="router id, stable across restarts (default router-0)")
    p.add_argument("--cluster", help="cluster name: the Redis key prefix")
    p.add_argument("--prefill-policy", help=PREFILL_HELP)
    p.add_argument("--prefill-policy-params", help="JSON object of the prefill policy's parameters")
    p.add_argument("--decode-policy", help=DECODE_HELP)
    p.add_argument("--decode-policy-params", help="JSON object of the decode policy's parameters")
    p.add_argument("--scheduling-config", help="YAML or JSON file: `prefill` / `decode` pipelines of filters, scorers "
                                               "and a picker (services/core/pipeline/; README, Extending the scheduler)")
    p.add_argument("--batcher", help=BATCHER_HELP)
    p.add_argument("--batcher-params", help="JSON object of the batcher's parameters")
    p.add_argument("--batch-wait-ms", type=float,
                   help="longest wait of a batch (ms): slo-budget window_ms (default 1000), fixed-window wait_ms (10)")
    p.add_argument("--batch-size-max", type=int, help="most requests per batch (default 8)")
    p.add_argument("--prefix-index", help="exact (workers' KV events, default) | approximate (learned from decisions)")
    p.add_argument("--prefill-coefficients", help="JSON object: prior of the prefill-time predictor (base_ms, per_token_ms, ...)")
    p.add_argument("--predictor-learning", help="true (default) | false: refine the predictor from measured batches")
    p.add_argument("--slo-mode", help="reject-explicit (default) | best-effort | reject | shed: what to do with a "
                                      "request whose TTFT target looks unattainable (services/core/slo.py)")
    p.add_argument("--slo-tpot-guard", type=float,
                   help="shed: refuse new work while the decoding worker's step time > this x the TPOT target "
                        "(default 0: off)")
    p.add_argument("--max-prompt-tokens", type=int, help="longest prompt accepted (default 32768)")
    p.add_argument("--tokenizer", help="a Hugging Face tokenizer.json (or its directory) for text prompts: the ids "
                                       "hashed and sent are the model's (default: the byte-level tokenizer)")
    p.add_argument("--tokenizer-add-special-tokens",
                   help="true (default) | false: with --tokenizer, add its special tokens (BOS) to a text prompt, "
                        "as vLLM and SGLang do")
    p.add_argument("--chat-template", help="a Jinja chat template file (.jinja, or .json with chat_template) for "
                   "/v1/chat/completions; default: the --tokenizer directory's, else a built-in one for the byte tokenizer")
    p.add_argument("--seed", type=int, help="seed of the router's decisions (default 0)")
    p.add_argument("--retry-limit", type=int, help="times a request failed by a worker before its first token is routed "
                                                   "again, excluding that worker (default 2; 0: off)")
    p.add_argument("--migration-limit", type=int, help="times a request whose worker dies or fails it mid-stream goes on "
                                                       "elsewhere as a continuation (default 3; 0: it fails)")
    p.add_argument("--tenant-classes", help="JSON object: tenant -> the priority classes it may use, its default first, "
                                             "e.g. {\"alpha\": [\"standard\", \"critical\"]} (with API keys set, a tenant "
                                             "not listed gets standard, sheddable)")
    p.add_argument("--tenant-limits", help="JSON object: tenant (or \"*\": any other) -> {max_open, "
                                            "requests_per_minute, tokens_per_minute}, per router process; over one: "
                                            "429 rate_limited with Retry-After")
    p.add_argument("--strict-priority", action="store_true", default=None,
                   help="refuse (403 priority_not_granted) a request asking a class its tenant is not granted, "
                        "instead of lowering it")
    p.add_argument("--tpot-calibration", help="worker (default) | pool: whose finished requests teach a worker's "
                                               "step time -> TPOT calibration (its own, or its whole pool's)")
    p.add_argument("--breaker-failures", type=int, help="consecutive server failures that open a worker's circuit "
                                                        "breaker (default 5; 0: off)")
    p.add_argument("--breaker-open-s", type=float, help="seconds an opened breaker waits before one probe request "
                                                        "(default 1; doubled at each re-opening)")
    p.add_argument("--breaker-max-open-s", type=float, help="cap of the breaker's doubling wait (default 30)")
    p.add_argument("--fair-queue", help="true (default) | false: under overload hold work beyond what the engines run "
                                        "at the router, released by priority class and tenants' fair share")
    p.add_argument("--fair-engine-buffer", type=int,
                   help="requests each engine may hold waiting beyond its max_num_seqs (default 0)")
    p.add_argument("--fairness-params", help="JSON object over the fair queue's defaults: w_out, starvation_bound_ms, "
                                             "max_queued_per_class, max_queued_per_tenant, max_queued_total, "
                                             "max_queue_wait_ms, retry_after_ms, default_weight")
    p.add_argument("--tenant-weights", help="JSON object: tenant -> weight of its fair share (default 1 each)")
    p.add_argument("--tenant-header", help="the header naming a request's tenant (default x-flexlb-tenant; "
                                           "'' ignores client-sent tenant headers)")
    p.add_argument("--scheduling-pool", help="lead this pool (model) only: its own lease and ledger; requests for "
                                             "other pools go to their leaders (default: lead every pool)")
    p.add_argument("--tenant-api-keys-file", help="a JSON file: API key (Authorization: Bearer) -> tenant. With keys set "
                                                  "(this file, or FLEXLB_TENANT_API_KEYS; never a flag: a command line "
                                                  "is readable by every local user) every request needs a known key, "
                                                  "and its tenant is the key's")
    p.add_argument("--trust-tenant-header", action="store_true", default=None,
                   help="with API keys set, take the tenant from the tenant header when a request has one (only behind "
                        "a trusted gateway that authenticates clients and sets it; default: ignored)")
    p.add_argument("--log-level", help="debug | info | warning | error")


def _add_worker_flags(p: argparse.ArgumentParser, many_servers: bool = False) -> None:
    p.add_argument("--engine", help="sim (default) | torch: a real model (env FLEXLB_ENGINE; needs the torch extra) | "
                                    "openai: in front of a vLLM / SGLang server at --engine-url | llamacpp (up only): "
                                    "llama-servers it starts, an openai agent in front of each")
    if many_servers:  # flexlb up: one agent per server
        p.add_argument("--engine-url", action="append",
                       help="openai: a server's base URL, once per server (one worker agent each, colocated)")
    else:
        p.add_argument("--engine-url", help="openai: the server's base URL, e.g. http://127.0.0.1:8001")
    p.add_argument("--engine-model", help="openai: the served model name (default: the server's first /v1/models)")
    p.add_argument("--served-model-name", help="the model name the worker reports and requests name as `model` "
                                               "(default: sim flexlb-sim, torch the preset or model directory's name, "
                                               "openai the server's)")
    p.add_argument("--engine-protocol", choices=["openai", "sglang"],
                   help="openai: how the agent drives the server: openai (default; /v1/completions, and "
                        "/v1/chat/completions for chat: vLLM, SGLang, any OpenAI-compatible server) | sglang "
                        "(SGLang's native /generate with input_ids)")
    p.add_argument("--engine-prompt", choices=["ids", "text"],
                   help="openai: a completion's prompt as the agent sends it: ids (default: the router's token ids) | "
                        "text (the client's text where it sent text: the server tokenizes it; for a server whose "
                        "tokenizer the router does not have; `flexlb up --engine llamacpp` sets it without --tokenizer)")
    p.add_argument("--upstream-max-concurrency", type=int, help="openai: most requests open to the server (default 256)")
    p.add_argument("--upstream-stall-timeout-s", type=float,
                   help="openai: a stream silent this long fails with upstream_error (default 60)")
    many = {"action": "append"} if many_servers else {}  # flexlb up: once per server, in --engine-url order
    p.add_argument("--kv-events-endpoint", **many, help="openai: vLLM's KV events ZMQ PUB endpoint, e.g. "
                   "tcp://HOST:5557 (up: once per server, in order); sim-server: publish its own there, e.g. tcp://*:5557")
    p.add_argument("--kv-events-replay-endpoint", **many, help="openai: its replay endpoint, e.g. tcp://HOST:5558; "
                                                               "sim-server: serve replays there, e.g. tcp://*:5558")
    p.add_argument("--kv-events-topic", help="openai: its topic (default: all); sim-server: the topic to publish on")
    p.add_argument("--model", help="torch: tiny (default) | 1b | a local Hugging Face Llama directory")
    p.add_argument("--device", help="torch: cpu (default) | cuda | cuda:N")
    p.add_argument("--model-seed", type=int, help="torch: seed of a preset's random weights (default 0)")
    p.add_argument("--dtype", help="torch: float32 | bfloat16 | float16 (default: the preset's)")
    p.add_argument("--torch-threads", type=int,
                   help="torch on CPU: intra-op threads (default: all cores; flexlb up: cores / workers)")
    p.add_argument("--time-scale", type=float, help="sim: engine time multiplier: 1 = profile speed, 0 = instant")
    p.add_argument("--heartbeat-interval-ms", type=int, help="status heartbeat period (default 200)")
    p.add_argument("--drain-timeout-s", type=float,
                   help="on SIGTERM, finish what it holds for up to this long, taking no new work, then fail the rest "
                        "retryable (default 30; 0: at once; flexlb up: 0, as its routers stop first)")
    if not many_servers:  # flexlb up gives each worker a port of its own (--worker-metrics)
        p.add_argument("--metrics-port", type=int, help="serve the worker's own Prometheus /metrics on this port "
                                                        "(env FLEXLB_METRICS_PORT; default 0: off)")
    p.add_argument("--num-kv-blocks", type=int, help="KV capacity in blocks (default 16384)")
    p.add_argument("--block-size-tokens", type=int, help="tokens per KV block (default 16)")
    p.add_argument("--max-batch-tokens", type=int, help="most prompt tokens per prefill batch (default 65536)")
    p.add_argument("--max-seq-len-tokens", type=int, help="longest prompt + output (default 40960)")
    p.add_argument("--profile", help="timing profile JSON (default: llama2-70b H100 TP8, Splitwise fit)")
    p.add_argument("--max-num-batched-tokens", type=int,
                   help="engine: tokens one step computes, prefill chunks + decodes (default 8192)")
    p.add_argument("--max-num-seqs", type=int, help="engine: most sequences running at once (default 256)")
    p.add_argument("--lora-adapters", help="sim: the LoRA adapters it serves, comma-separated (requests name one as "
                                           "`model`; default none)")
    p.add_argument("--max-loras", type=int, help="LoRA adapter slots: sim, default 4 with --lora-adapters; openai, the "
                                                 "server's --max-loras (default: vLLM's vllm:lora_requests_info)")
    p.add_argument("--lora-load-ms", type=float, help="sim: engine ms to load an adapter into a slot (default 20, "
                                                      "x --time-scale)")
    p.add_argument("--engine-max-num-seqs", type=int, help="openai: the server's --max-num-seqs (default 0: learned from "
                                                           "its /metrics, the most it ran while requests waited)")
    p.add_argument("--scheduler", help="engine: vllm (default; decodes and prompt chunks share each step) | sglang "
                                       "(prefill-first: a prompt runs as a step of its own before the decodes go on)")
    p.add_argument("--max-prefill-tokens", type=int,
                   help="engine, scheduler sglang: most new prompt tokens per prefill step (default 16384)")
    p.add_argument("--no-chunked-prefill", dest="chunked_prefill", action="store_false", default=None,
                   help="engine: run each prompt whole in one step instead of splitting it over steps")
    p.add_argument("--outbound-buffer-bytes", type=int,
                   help="bytes of outputs a worker holds while NATS is away (default 2 MiB); beyond: stream_overflow")


# Environment variables of the command line itself (not settings of a router or worker).
CLI_ENV_VARS = frozenset({"FLEXLB_ADMIN_URL", "FLEXLB_UP_STATE", "FLEXLB_TEST_NATS_URL", "FLEXLB_TEST_REDIS_URL"})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flexlb", description="FlexLB control plane for LLM inference clusters")
    sub = parser.add_subparsers(dest="command", required=True)

    # (allow_abbrev off: `--tenant-api-keys KEYS`, the old flag, must not pass for --tenant-api-keys-file)
    up = sub.add_parser("up", help="run NATS, Redis, a router and simulated workers on this machine", allow_abbrev=False)
    _add_router_flags(up)
    _add_worker_flags(up, many_servers=True)
    up.add_argument("--workers", type=int, help="colocated pd_fusion workers of the default model (default 2; 0 with --pool)")
    up.add_argument("--pool", action="append", metavar="NAME=N",
                    help="N colocated workers serving model NAME (their --served-model-name), repeatable: one pool "
                         "per model; instead of the default model's workers unless --workers is given too")
    up.add_argument("--prefill", type=int, default=0, help="prefill workers (disaggregated mode, with --decode)")
    up.add_argument("--decode", type=int, default=0, help="decode workers (disaggregated mode, with --prefill)")
    up.add_argument("--leader-per-pool", action="store_true",
                    help="with --pool: one router per pool, each leading its pool's scheduling (--scheduling-pool), "
                         "more with --routers (standbys, pools in turn); any router takes any model")
    up.add_argument("--routers", type=int, default=1, help="router replicas on consecutive ports, or free ones if taken (leader + standbys)")
    up.add_argument("--http-workers", type=int, default=1,
                    help="router processes sharing --port (SO_REUSEPORT): the leader and N-1 standbys that take HTTP "
                         "and forward scheduling to it, so the HTTP side uses N cores (default 1)")
    up.add_argument("--worker-metrics", action="store_true",
                    help="each worker serves its own /metrics on a free port (listed as worker_metrics_urls)")
    up.add_argument("--gguf", help="--engine llamacpp: the model file its llama-servers load (default: a tiny "
                                   "random-weight Llama made and cached on first use, no download)")
    up.add_argument("--llama-server-arg", action="append", metavar="ARG",
                    help="--engine llamacpp: one more argument for every llama-server (repeatable; "
                         "--llama-server-arg=--threads --llama-server-arg=2)")
    up.add_argument("--open-admin", action="store_true",
                    help="no admin token: anyone who can reach the router's port can drain and remove workers "
                         "(loopback only; for tests and a laptop). Default: `up` generates one (or takes "
                         "FLEXLB_ADMIN_TOKEN) and keeps it in a 0600 file beside its state file")
    up.add_argument("--state-file", help="write URLs and the pid of every started process here (JSON)")
    up.add_argument("--data-dir", help="NATS JetStream data directory (default: a temporary one)")
    up.add_argument("--nats-port", type=int, help="port for the started nats-server (default: a free one); "
                                                   "with --nats-cluster N, the first of N consecutive ports")
    up.add_argument("--nats-cluster", type=int, default=1, metavar="N",
                    help="start N clustered nats-server processes (routes, JetStream on each, a store each under "
                         "--data-dir) with streams replicated min(N, 3) times, so one node can be lost (default 1)")
    up.add_argument("--redis-sentinel", action="store_true",
                    help="start a Redis primary, a replica and three sentinels instead of one redis-server; the "
                         "routers find the primary through the sentinels (FLEXLB_REDIS_SENTINELS) and follow a failover")
    up.add_argument("--redis-port", type=int, help="port for the started redis-server (default: a free one)")

    router = sub.add_parser("router", help="run one router process", allow_abbrev=False)
    _add_router_flags(router)
    router.add_argument("--drain-timeout-s", type=float,
                        help="on SIGTERM: hand leadership over at once, stop listening and relay the streams already "
                             "open for up to this long (default 30; 0: cut them; a second signal ends the wait)")

    worker = sub.add_parser("worker", help="run one engine worker process")
    worker.add_argument("--id", dest="worker_id", help="worker id (env FLEXLB_WORKER_ID)")
    worker.add_argument("--role", help="pd_fusion | prefill | decode (env FLEXLB_ROLE)")
    worker.add_argument("--nats-url", help="NATS server URL (env FLEXLB_NATS_URL)")
    _add_worker_flags(worker)
    worker.add_argument("--log-level", default="info", help="debug | info | warning | error")

    sim = sub.add_parser("sim-server", help="serve one simulated engine over HTTP (OpenAI, SGLang and vLLM worker "
                                            "endpoints) for peer routers; see workers/sim_server/http.py")
    sim.add_argument("--host", default="127.0.0.1", help="HTTP listen address (default 127.0.0.1)")
    sim.add_argument("--port", type=int, required=True, help="HTTP port")
    sim.add_argument("--worker-id", dest="worker_id", default="sim-0", help="id in logs and request ids (default sim-0)")
    sim.add_argument("--model-name", default="flexlb-sim", help="model name it reports (default flexlb-sim)")
    sim.add_argument("--role", default="pd_fusion", choices=["pd_fusion", "prefill", "decode"],
                     help="pd_fusion (default), or prefill / decode behind a PD router (SGLang's bootstrap "
                          "protocol, workers/sim_server/http.py)")
    sim.add_argument("--tokenizer", help="a Hugging Face tokenizer.json (or its directory): text prompts, /tokenize and "
                                         "output text use it, as the router's --tokenizer (default: byte-level)")
    sim.add_argument("--bare-openai", action="store_true",
                     help="look like an OpenAI-compatible server with neither Prometheus /metrics (404) nor token "
                          "ids in its streams (return_token_ids ignored): TGI, llama.cpp, vLLM < 0.10.2")
    sim.add_argument("--chat-template", help="/v1/chat/completions: a Jinja chat template file (.jinja, or .json with "
                                             "chat_template) (default: the one beside --tokenizer's tokenizer.json; "
                                             "the built-in one for the byte-level tokenizer)")
    sim.add_argument("--incremental-streaming-output", action="store_true",
                     help="/generate streams each chunk's output_ids and text, not the whole output so far (SGLang's "
                          "flag of that name)")
    sim.add_argument("--canned-chunks", metavar="FILE",
                     help="a scripted server (relay tests): every streamed generation is answered with FILE's "
                          "lines, one SSE event's data each, byte for byte; the bodies received at GET /_sim/requests")
    sim.add_argument("--embedding-dim", type=int, default=0, metavar="N",
                     help="serve POST /v1/embeddings with vectors of N floats drawn from each input's tokens "
                          "(0, the default: not served, 404)")
    sim.add_argument("--fail-generations", action="store_true",
                     help="fault injection: answer every generation 500 at once while /health and /metrics stay "
                          "fine (a bad GPU, a wedged engine); counted in flexlb_sim_failed_generations_total")
    _add_worker_flags(sim)
    sim.add_argument("--log-level", default="info", help="debug | info | warning | error")

    workers = sub.add_parser("workers", help="list, drain, undrain or remove workers through the admin API")
    workers.add_argument("action", choices=["list", "drain", "undrain", "remove"])
    workers.add_argument("worker_id", nargs="?", help="the worker (all but list)")
    workers.add_argument("--force", action="store_true", help="remove: even if it holds work (re-routed or failed)")
    workers.add_argument("--url", help="router URL (env FLEXLB_ADMIN_URL; default: the last running `flexlb up`'s, "
                                       "else http://127.0.0.1:8000)")
    workers.add_argument("--token", help="admin bearer token (env FLEXLB_ADMIN_TOKEN)")

    events = sub.add_parser("events", help="export the event log and core journal to a file, or tail them live")
    events.add_argument("action", choices=["export", "tail"])
    events.add_argument("--nats-url", help="NATS server URL (env FLEXLB_NATS_URL, default nats://127.0.0.1:4222)")
    events.add_argument("--out", help="export: the file (.gz: gzip'd JSON lines)")
    events.add_argument("--since", help="export: from this stream seq, ISO time or epoch seconds")
    events.add_argument("--until", help="export: up to this stream seq, ISO time or epoch seconds")
    events.add_argument("--streams", default="FLEXLB_JOURNAL,FLEXLB_EVENTS", help="export: streams, comma-separated")
    events.add_argument("--kind", action="append", default=[], help="tail: only event types starting with this (repeatable)")
    events.add_argument("--request", help="tail: only events of this request id")

    rp = sub.add_parser("replay", help="re-decide a recorded run through the core; check every decision is identical")
    rp.add_argument("file", help="an export of `flexlb events export`")
    rp.add_argument("--router", help="only this router's journal")
    rp.add_argument("--json", action="store_true", help="print a summary object (events, decisions, matched, first_divergence)")
    rp.add_argument("--at", help="stop at this instant (epoch seconds or ISO time) and show the state")
    rp.add_argument("--show", default="workers", help="with --at: workers | ledger | queues | index")

    ex = sub.add_parser("explain", help="one request's timeline and decisions, from an export or the live router")
    ex.add_argument("request_id")
    ex.add_argument("--file", help="an export (default: ask the live router at --url)")
    ex.add_argument("--url", help="router URL (env FLEXLB_ADMIN_URL; default: the last running `flexlb up`'s, else http://127.0.0.1:8000)")
    ex.add_argument("--token", help="admin bearer token (env FLEXLB_ADMIN_TOKEN)")
    ex.add_argument("--json", action="store_true", help="JSON instead of a table")

    wi = sub.add_parser("whatif", help="re-run a recorded run's arrivals in virtual time under another configuration")
    wi.add_argument("file", help="an export of `flexlb events export`")
    wi.add_argument("--prefill-policy", help="default: the recorded one")
    wi.add_argument("--decode-policy", help="default: the recorded one")
    wi.add_argument("--batcher", help="default: the recorded one (with its parameters)")
    wi.add_argument("--workers", type=int, help="this many workers like the first recorded one (default: as recorded)")
    wi.add_argument("--profile", help="engine timing profile JSON (default: the sim workers' default)")
    wi.add_argument("--json", action="store_true", help="print {recorded, rerun} as JSON")
    wi.add_argument("--plot", help="draw both TTFT CDFs to this PNG (needs matplotlib: pip install 'flexlb[plot]')")
    wi.add_argument("--refusal", choices=["as-recorded", "off", "marginal"], default="as-recorded",
                    help="off: re-run with every SLO refusal off (admitted best effort, the TPOT hold gives way) and "
                         "say how many of the recorded run's slo_unattainable refusals would have met their SLO, and how "
                         "many requests that meet it with refusals on would then miss it (net change in met requests); "
                         "marginal: judge each refusal of the re-run alone, serving that one request and no other "
                         "(a re-run per refusal): how many would have met their SLO at no cost to the others")
    wi.add_argument("--engine-scheduler", choices=["vllm", "sglang"], default="vllm",
                    help="the re-run engines' step scheduler (a recording does not carry it; default vllm)")

    schema = sub.add_parser("schema", help="print the JSON Schema of every bus message")
    schema.add_argument("--out", help="write to this file instead of stdout")
    return parser


def _overrides(args: argparse.Namespace, cls) -> dict:
    return {k: v for k, v in vars(args).items() if k in cls.__struct_fields__ and v is not None}


def router_settings(args: argparse.Namespace, environ=None) -> RouterSettings:
    from workers.config import WorkerConfig

    return load(RouterSettings, environ, _overrides(args, RouterSettings),
                known_elsewhere=known_env_vars(WorkerConfig) | CLI_ENV_VARS)


def worker_config(args: argparse.Namespace, environ=None):
    from workers.config import WorkerConfig

    cfg = load(WorkerConfig, environ, _overrides(args, WorkerConfig), known_elsewhere=known_env_vars(RouterSettings) | CLI_ENV_VARS)
    return cfg


def _logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


ROUTER_STOP_S = 4.5  # SIGTERM / SIGINT -> exit within this after the drain of open streams (--drain-timeout-s)
WORKER_STOP_S = 4.5  # the same for a worker (its final reports get SHUTDOWN_TIMEOUT_S, 3 s)
WAIT_LOG_INTERVAL_S = 10.0  # while waiting for NATS or Redis at start, one line saying so this often
log = logging.getLogger("flexlb.cli")


def run_router(settings: RouterSettings) -> int:
    """One router process. It waits for NATS and Redis to answer before it starts (logging
    "waiting for NATS at URL: why (retrying)" every WAIT_LOG_INTERVAL_S), then serves.
    SIGTERM or SIGINT at any moment (waiting, starting, serving) stops it within
    ROUTER_STOP_S, after --drain-timeout-s at most for the streams already open when it was
    serving (a leader hands its lease over first): exit 0; 1 if its stop had to be cut short;
    3 if start-up failed."""
    import uvicorn
    import uvloop

    from services.api import admin_only, create_app, public_only
    from services.shell.router import RouterService

    _logging(settings.log_level)
    sockets = _listen_sockets(settings) if settings.reuse_port else None

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            yield  # main() below owns SIGINT / SIGTERM (uvicorn's would wait out a start-up, then re-raise them)

    extra: list[tuple] = []  # (server, its task): the admin listener, stopped after the main one

    async def main() -> int:
        try:
            return await serve_router()
        finally:
            for other, task in extra:
                other.should_exit = True
                await asyncio.wait({task}, timeout=ROUTER_STOP_S)

    async def serve_router() -> int:
        stop, urgent = asyncio.Event(), asyncio.Event()
        loop = asyncio.get_running_loop()
        drain_s = settings.drain_timeout_s
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, _stopper(stop, "router", drain_s + ROUTER_STOP_S + 0.3, urgent))
        if not await _unless_stopped(stop, _wait_for_bus_and_store(settings)):
            return 0  # (it said what it was waiting for)
        service = RouterService(settings)
        app = create_app(service)
        server = Server(uvicorn.Config(
            public_only(app) if settings.admin_port else app, host=settings.host, port=settings.port, log_level=settings.log_level,
            access_log=False, lifespan="on", timeout_graceful_shutdown=drain_s,
            timeout_keep_alive=settings.http_keep_alive_s,
            loop="uvloop", http="httptools",  # dependencies: a third less CPU per request than asyncio + h11
        ))
        serving = asyncio.create_task(server.serve(sockets=sockets), name="uvicorn")
        if settings.admin_port:  # admin, /docs and /openapi.json on a listener of their own (no lifespan: one owner)
            admin_server = Server(uvicorn.Config(
                admin_only(app), host=settings.admin_host, port=settings.admin_port, log_level=settings.log_level,
                access_log=False, lifespan="off", timeout_graceful_shutdown=1.0, loop="uvloop", http="httptools"))
            extra.append((admin_server, asyncio.create_task(admin_server.serve(), name="uvicorn-admin")))
        stopping = asyncio.create_task(stop.wait(), name="stop")
        await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if serving.done():  # start-up failed (SystemExit 3 from uvicorn), or it stopped by itself
            stopping.cancel()
            serving.result()
            return 0
        if not server.started:  # still in start-up (the router's own connect and stream set-up): cut it
            logging.getLogger("uvicorn.error").setLevel(logging.CRITICAL)  # not a start-up failure: we cut it
            serving.cancel()
            await asyncio.gather(serving, return_exceptions=True)
            log.warning("router %s: stopped during start-up", settings.router_id)
            return 0
        # Leadership first, so a standby schedules while we drain; then uvicorn stops listening and
        # waits up to drain_s for the open requests (we relay their tokens as a standby would),
        # then the router's own stop.
        await service.hand_off()
        open_requests = len(server.server_state.connections)
        if drain_s > 0 and open_requests:
            log.warning("router %s stopping: relaying the streams of %d open connections for up to %.0f s "
                        "(a second signal ends the wait)", settings.router_id, open_requests, drain_s)
        server.should_exit = True
        urgent_wait = asyncio.create_task(urgent.wait(), name="urgent")
        await asyncio.wait({serving, urgent_wait}, timeout=drain_s + ROUTER_STOP_S, return_when=asyncio.FIRST_COMPLETED)
        urgent_wait.cancel()
        if urgent.is_set() and not serving.done():
            log.warning("router %s: a second signal: cutting the open streams", settings.router_id)
            for task in list(server.server_state.tasks):  # (not force_exit: it would skip the router's own stop)
                task.cancel(msg="router stopping: a second signal")
        done, _ = await asyncio.wait({serving}, timeout=ROUTER_STOP_S)
        if not done:
            server.force_exit = True
            serving.cancel()
            await asyncio.gather(serving, return_exceptions=True)
            log.error("router %s: stop not finished after %.1f s; exiting anyway", settings.router_id, ROUTER_STOP_S)
            return 1
        serving.result()
        return 0

    return uvloop.run(main())


def _stopper(stop: asyncio.Event, what: str, exit_within_s: float, urgent: asyncio.Event | None = None):
    """A signal handler: set `stop`; the first time, also arm the last word on the stop: a
    process still here `exit_within_s` later (a library that swallowed a cancel and waits on
    a dead socket) says so and exits 1 (os._exit, from a timer thread). A second signal sets
    `urgent` (a draining worker stops draining)."""

    def force_exit() -> None:
        sys.stderr.write(f"flexlb {what}: still stopping {exit_within_s:.1f} s after the signal; exiting now\n")
        sys.stderr.flush()
        os._exit(1)

    def on_signal() -> None:
        if not stop.is_set():
            timer = threading.Timer(exit_within_s, force_exit)
            timer.daemon = True
            timer.start()
        elif urgent is not None:
            urgent.set()
        stop.set()

    return on_signal


async def _unless_stopped(stop: asyncio.Event, coro) -> bool:
    """Run `coro` until it ends (True) or `stop` is set first (False: it is cancelled)."""
    work = asyncio.ensure_future(coro)
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait({work, stopped}, return_when=asyncio.FIRST_COMPLETED)
    for t in (work, stopped):
        if not t.done():
            t.cancel()
    await asyncio.gather(work, stopped, return_exceptions=True)
    if work.done() and not work.cancelled():
        work.result()  # its own failure raises
        return True
    return False


async def _wait_for_bus_and_store(settings: RouterSettings) -> None:
    """Until one NATS server of `nats_url` and the Redis of the settings (or, with sentinels,
    its primary) answer; each failed try is retried after 0.5 s and said every WAIT_LOG_INTERVAL_S."""
    from urllib.parse import urlsplit

    from schemas.subjects import nats_servers
    from services.shell.router import redis_client

    async def nats_answers() -> None:
        """One server of the list greets a new connection with its INFO line (as NATS does)."""
        last: Exception | None = None
        for server in nats_servers(settings.nats_url):
            url = urlsplit(server if "://" in server else "nats://" + server)
            try:
                reader, writer = await asyncio.wait_for(asyncio.open_connection(url.hostname, url.port or 4222), 2.0)
                try:
                    greeting = await asyncio.wait_for(reader.readline(), 2.0)
                finally:
                    writer.close()
                if greeting.startswith(b"INFO"):
                    return
                last = ConnectionError(f"{url.hostname}:{url.port} does not speak NATS (said {greeting[:40]!r})")
            except (OSError, asyncio.TimeoutError) as exc:  # not listening, refused, silent: the next server, or retry
                last = exc
        raise last or ConnectionError("no NATS server named")

    async def redis_answers() -> None:
        client = redis_client(settings)
        try:
            await asyncio.wait_for(client.ping(), 3.0)
        finally:
            await client.aclose()

    redis_where = f"the sentinels {settings.redis_sentinels}" if settings.redis_sentinels else settings.redis_url
    for what, probe in ((f"NATS at {redact_url(settings.nats_url)}", nats_answers),
                        (f"Redis at {redact_url(redis_where)}", redis_answers)):
        last_log = None
        while True:
            try:
                await probe()
                break
            except asyncio.CancelledError:
                log.warning("router %s: stopped while waiting for %s", settings.router_id, what)
                raise
            except Exception as exc:  # any failure to answer is waited out, and said
                now = time.monotonic()
                if last_log is None or now - last_log >= WAIT_LOG_INTERVAL_S:
                    last_log = now
                    log.warning("waiting for %s: %s (retrying)", what, f"{exc.__class__.__name__}: {exc}".rstrip(": "))
            await asyncio.sleep(0.5)
        if last_log is not None:
            log.info("%s answers", what)


def _listen_sockets(settings: RouterSettings) -> list:
    """The shared port, bound with SO_REUSEPORT (every process of the group sets it, and the
    kernel spreads new connections among them), and this process's own port if it has one."""
    import socket

    family = socket.AF_INET6 if ":" in settings.host else socket.AF_INET
    shared = socket.socket(family, socket.SOCK_STREAM)
    shared.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    shared.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    shared.bind((settings.host, settings.port))
    sockets = [shared]
    if settings.own_port:
        own = socket.socket(family, socket.SOCK_STREAM)
        own.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        own.bind((settings.host, settings.own_port))
        sockets.append(own)
    return sockets


def run_worker(cfg) -> int:
    from workers.agent import WorkerAgent

    if cfg.engine != "openai" and (cfg.kv_events_endpoint or cfg.kv_events_replay_endpoint):
        raise ValueError("--kv-events-* are for --engine openai (a sim or torch worker publishes its KV events "
                         "on NATS; `flexlb sim-server` publishes vLLM's)")

    async def main() -> None:
        stop, urgent = asyncio.Event(), asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):  # the agent's own stop is bounded; this bounds the rest
            loop.add_signal_handler(sig, _stopper(stop, "worker", cfg.drain_timeout_s + WORKER_STOP_S, urgent))
        if cfg.engine == "openai":
            from workers.openai.agent import OpenAIAgent

            await OpenAIAgent(cfg).run(stop, urgent)
        else:
            await WorkerAgent(cfg).run(stop, urgent)

    import uvloop  # (a dependency) the agents' CPU per relayed token 53 -> 45 us against asyncio's loop (bench/adapter_cost.py)

    uvloop.run(main())
    return 0


def run_sim_server(args: argparse.Namespace, cfg) -> int:
    """`flexlb sim-server`: the engine of `flexlb worker` (same config and role) behind
    HTTP instead of NATS (workers/sim_server/http.py documents the endpoints)."""
    from schemas.chat_template import ChatTemplates, load_chat_templates
    from schemas.tokens import load_tokenizer
    from workers.sim_server.http import serve

    tokenizer = load_tokenizer(args.tokenizer)  # a bad file: ValueError, exit 2 (main)
    if not 0 <= args.embedding_dim <= 65536:
        raise ValueError(f"--embedding-dim must be in 0..65536, got {args.embedding_dim}")
    canned = None
    if args.canned_chunks:  # one event's data per non-empty line, kept as written (a bad line: exit 2)
        with open(args.canned_chunks, "rb") as f:
            canned = [line.strip() for line in f if line.strip()]
        for i, line in enumerate(canned):
            try:
                json.loads(line)
            except ValueError as exc:
                raise ValueError(f"--canned-chunks {args.canned_chunks}: line {i + 1} is not JSON: {exc}") from None
    # Chat: --chat-template, else the template beside the tokenizer, else the built-in one for
    # the byte tokenizer (as the router resolves its own); a bad file: ChatTemplateError (a ValueError).
    chat_templates = load_chat_templates(args.chat_template or "", args.tokenizer or "")
    if chat_templates is None and not args.tokenizer:
        chat_templates = ChatTemplates.builtin()
    serve(cfg, host=args.host, port=args.port, model_name=args.model_name, log_level=args.log_level, tokenizer=tokenizer,
          bare_openai=args.bare_openai, incremental_streaming_output=args.incremental_streaming_output,
          chat_templates=chat_templates, fail_generations=args.fail_generations, canned_chunks=canned,
          embedding_dim=args.embedding_dim)
    return 0


def run_workers_admin(args: argparse.Namespace) -> int:
    """`flexlb workers ...`: prints the API's JSON answer; exit 0 on 2xx, 1 otherwise. The
    token: --token, else FLEXLB_ADMIN_TOKEN, else the one the last running `flexlb up` keeps."""
    import os

    import httpx

    from services.up import read_admin_token

    url = (args.url or os.environ.get("FLEXLB_ADMIN_URL") or _last_up_router_url()).rstrip("/")
    token = args.token or os.environ.get("FLEXLB_ADMIN_TOKEN") or read_admin_token()
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    if args.action != "list" and not args.worker_id:
        print(f"flexlb workers {args.action}: a worker id is required", file=sys.stderr)
        return 2
    try:
        with httpx.Client(timeout=30, headers=headers) as client:
            if args.action == "list":
                resp = client.get(f"{url}/admin/workers")
            elif args.action == "remove":
                resp = client.request("DELETE", f"{url}/admin/workers/{args.worker_id}",
                                      params={"force": str(args.force).lower()}, json={})
            else:
                resp = client.post(f"{url}/admin/workers/{args.worker_id}/{args.action}", json={})  # (JSON: admin_auth)
    except httpx.HTTPError as exc:
        print(f"flexlb workers {args.action}: cannot reach {url}: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(resp.json(), indent=2))
    return 0 if resp.is_success else 1


def run_eventlog(args: argparse.Namespace) -> int:
    """`flexlb events export|tail`, `flexlb replay`, `flexlb explain` (services/eventlog.py).
    Exit 0: done (replay: every decision identical, no gap); 1: a divergence, a gap, or
    nothing found; 2: bad arguments or an unreadable source."""
    import os

    from services import eventlog

    nats_url = getattr(args, "nats_url", None) or os.environ.get("FLEXLB_NATS_URL") or _last_up_nats_url() \
        or "nats://127.0.0.1:4222"
    try:
        if args.command == "events" and args.action == "export":
            if not args.out:
                print("flexlb events export: --out FILE is required", file=sys.stderr)
                return 2
            header = asyncio.run(eventlog.export(nats_url, args.out, args.streams.split(","), args.since, args.until,
                                                 progress=sys.stderr.isatty()))
            for name, st in header["streams"].items():
                flag = " TRUNCATED: " + st["note"] if st["truncated"] else ""
                print(f"{name}: {st['exported']} messages (stream seqs {st['first_seq']}..{st['last_seq']}){flag}")
            print(f"wrote {args.out}")
            return 0
        if args.command == "events":
            stop = asyncio.Event()

            async def run_tail() -> None:
                loop = asyncio.get_running_loop()
                for sig in (signal.SIGINT, signal.SIGTERM):
                    loop.add_signal_handler(sig, stop.set)
                await eventlog.tail(nats_url, args.kind, args.request, stop=stop)

            asyncio.run(run_tail())
            return 0
        if args.command == "replay":
            summary, reports = eventlog.replay_file(args.file, args.router, args.at, progress=sys.stderr.isatty())
            if args.at:
                for r in reports:
                    print(f"# {r.router_id}/{r.boot_id} at {r.last_now_ns} ({r.events} records folded)")
                    if r.scheduler is not None:
                        eventlog.show_state(r.scheduler, args.show)
                return 0
            if args.json:
                print(json.dumps(summary, indent=2, default=str))
            else:
                eventlog.print_replay(summary)
            ok = summary["matched"] == summary["decisions"] and not summary["first_divergence"] and not summary["gaps"]
            return 0 if ok and not summary["errors"] else 1
        # explain
        if args.file:
            data = eventlog.explain_file(args.file, args.request_id)
        else:
            import httpx

            from services.up import read_admin_token

            url = (args.url or os.environ.get("FLEXLB_ADMIN_URL") or _last_up_router_url()).rstrip("/")
            token = args.token or os.environ.get("FLEXLB_ADMIN_TOKEN") or read_admin_token()
            resp = httpx.get(f"{url}/admin/requests/{args.request_id}", timeout=10,
                             headers={"Authorization": f"Bearer {token}"} if token else {})
            if resp.status_code == 404:
                print(f"request {args.request_id}: unknown to {url}", file=sys.stderr)
                return 1
            if not resp.is_success:
                print(resp.text, file=sys.stderr)
                return 1
            data = resp.json()
        if args.json:
            print(json.dumps(data, indent=2, default=str))
        else:
            eventlog.print_explain(data)
        return 0 if data["found"] else 1
    except (OSError, ValueError) as exc:
        print(f"flexlb {args.command}: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # nats' own errors (no server, timeout): one line with the URL, not a traceback
        if type(exc).__module__.startswith("nats"):
            print(f"flexlb {args.command}: cannot use NATS at {redact_url(nats_url)}: {type(exc).__name__}: {exc} "
                  "(--nats-url or FLEXLB_NATS_URL; `flexlb up` prints its URL)", file=sys.stderr)
            return 2
        raise


def _last_up_router_url() -> str:
    """Where the last running `flexlb up` serves its admin API (its router's URL, or its
    --admin-port's), else the default port's."""
    from services.up import last_up_state

    state = last_up_state() or {}
    return state.get("admin_url") or state.get("router_url") or "http://127.0.0.1:8000"


def _last_up_nats_url() -> str | None:
    """The NATS URL of the last `flexlb up` on this machine, if it is still running."""
    from services.up import last_up_state

    return (last_up_state() or {}).get("nats_url")


def run_whatif(args: argparse.Namespace) -> int:
    from services import whatif

    try:
        rec = whatif.load_recording(args.file, progress=sys.stderr.isatty())
        rec.workers = [dataclasses.replace(w, scheduler=args.engine_scheduler) for w in rec.workers]
        config = whatif.with_overrides(rec.config, args.prefill_policy, args.decode_policy, args.batcher)
        over = marginal = None
        if args.refusal == "off":
            over = whatif.over_refusal(dataclasses.replace(rec, config=config), args.workers, args.profile)
            config = whatif.refusal_off(config)
        elif args.refusal == "marginal":
            marginal = whatif.marginal_over_refusal(dataclasses.replace(rec, config=config), args.workers, args.profile)
        recorded = whatif.recorded_metrics(rec)
        rerun, cdf = whatif.simulate(rec, config, args.workers, profile_path=args.profile, with_ttfts=True,
                                     progress=sys.stderr.isatty())
    except (OSError, ValueError) as exc:
        print(f"flexlb whatif: {exc}", file=sys.stderr)
        return 2
    label = "re-run: " + "/".join([config.prefill_policy, config.decode_policy, config.batcher]) + (
        f" x{args.workers}" if args.workers else "") + (" refusal off" if over is not None else "")
    if args.json:
        print(json.dumps({"recorded": recorded, "rerun": rerun, "config": label}
                         | ({"over_refusal": over} if over is not None else {})
                         | ({"marginal_over_refusal": marginal} if marginal is not None else {}), indent=2))
    else:
        whatif.print_side_by_side(recorded, rerun, label)
        if over is not None:
            print(f"over-refusal: {over['would_meet']} of the {over['refused']} requests refused slo_unattainable would "
                  f"have met their SLO with refusal off ({over['over_refusal_rate']:.2%} of {over['requests']} requests); "
                  f"{over['others_lost']} requests that meet it with refusals on would miss it: net {over['net']:+d} met")
        if marginal is not None:
            print(f"each refusal alone: of the {marginal['refused']} requests the re-run refuses slo_unattainable, "
                  f"{marginal['at_no_cost']} would have met their SLO served, at no cost to the others "
                  f"({marginal['marginal_over_refusal_rate']:.2%} of {marginal['requests']} requests), "
                  f"{marginal['at_a_cost']} at a cost to others, {marginal['would_miss']} would have missed it anyway")
    if args.plot:
        try:
            whatif.plot_cdfs(whatif.recorded_ttfts(rec), cdf, label, args.plot)
        except ImportError:
            print("flexlb whatif: --plot needs matplotlib (pip install 'flexlb[plot]')", file=sys.stderr)
            return 2
        print(f"wrote {args.plot}")
    return 0


def _stop_before_start(signum, frame) -> None:
    raise SystemExit(0)  # told to stop before its own handlers are in place: nothing is running yet


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command in ("router", "worker", "up"):  # a stop on request exits 0 from the first moment on
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, _stop_before_start)
    try:
        if args.command == "router":
            return run_router(router_settings(args))
        if args.command == "worker":
            _logging(args.log_level)
            return run_worker(worker_config(args))
        if args.command == "sim-server":
            _logging(args.log_level)
            return run_sim_server(args, worker_config(args))
        if args.command == "up":
            from services.up import run_up

            return run_up(args, router_settings(args))
    except (SettingsError, ValueError) as exc:
        print(f"flexlb {args.command}: configuration error: {exc}", file=sys.stderr)
        return 2
    if args.command == "workers":
        return run_workers_admin(args)
    if args.command in ("events", "replay", "explain"):
        return run_eventlog(args)
    if args.command == "whatif":
        return run_whatif(args)
    if args.command == "schema":
        from schemas.messages import json_schema

        text = json.dumps(json_schema(), indent=2)
        if args.out:
            with open(args.out, "w") as fh:
                fh.write(text + "\n")
        else:
            print(text)
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
