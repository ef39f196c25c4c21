"""Typed settings, from defaults < `FLEXLB_*` environment variables < command-line flags.

Every value is validated at start; a bad value stops the process with a message that names
the setting (`SettingsError`). An unknown `FLEXLB_*` variable is warned about, never
silently ignored. The same loader serves the router (`RouterSettings`) and the worker
(`workers.config.WorkerConfig`), so compose files and `flexlb up` speak one language.
"""

from __future__ import annotations

import logging
import math
import os
import re
from typing import Any, Mapping

import msgspec

from schemas.subjects import nats_servers, validate_token
from schemas.tokens import load_tokenizer
from services.core.fairness import CLASSES
from services.limits import parse_limits

log = logging.getLogger("flexlb.settings")

ENV_PREFIX = "FLEXLB_"


# The fixed-window batch window we ship (FlexLB's is 300 ms). Measured with bench/trace.py
# (Mooncake rows 0-499 at 1/3 rate, 4 workers, cost-based): TTFT mean 3.9 s with 10 ms vs
# 5.3 s with 300 ms, hit rate 0.063 vs 0.051; at these arrival rates a window rarely finds a
# second request for the same worker, so a long one only adds latency. Set --batch-wait-ms
# (or batcher_params.wait_ms) higher for bursty short-prompt traffic, where batching pays.
# Checked again on goodput (bench/PEERS.md: the highest load with >= 90 % of requests within
# TTFT 2 s / TPOT 100 ms, 4 engines, beside sglang-router and vllm-router): cost-based +
# fixed-window 10 ms + reject-explicit reaches 5.79 req/s on Azure code (slo-budget 5.82,
# round-robin < 4.94) and holds 0.60 attainment to 0.6x Mooncake (best-effort 0.57 at 0.3x),
# but 21.5 req/s on Azure conv, where slo-budget gives 22.5 and round-robin 22.7 (decode-heavy
# traffic: the README's defaults section says how to pick).
SHIPPED_FIXED_WINDOW_WAIT_MS = 10.0

# The batcher we ship and its parameters (FlexLB's defaults are fixed-window, 300 ms): slo-budget
# holding prompts for a worker up to a 1 s window (never past what a request's TTFT target
# leaves: its guard), so that a worker's prompts go together, and holding them while the
# worker's predicted TPOT with one more request would exceed 0.9 x the request's TPOT target
# (its decode model, services/core/decode_model.py), so that a burst waits out its TTFT slack
# at the router instead of slowing every running decode. Measured in virtual time against
# the peers' routing rules (bench/tune.py) and side by side with the peers (bench/PEERS.md);
# the README's defaults section has the numbers.
# The prefill policy's parameters we ship over cost-based's own (FlexLB's): a worker without the
# prompt's cached prefix pays its extra prefill 3 times over (the engine time it takes from
# every request there, not only this one's TTFT), and no imbalance filter (it pushed a
# conversation's next turn off the worker holding its history whenever that worker had a
# batch queued: prefix hit 0.43 against the cache-aware peers' 0.48 on long-conv). The
# README's defaults section has the numbers.
SHIPPED_COST_BASED_PARAMS = {"prefill_weight": 3.0, "imbalance_factor": 0.0}
SHIPPED_BATCHER = "slo-budget"
# A strict request the TPOT hold kept to its emergency point, that no other worker can take in
# time, is served on its worker when the TPOT predicted there with it is within 1.2 x its target
# and the requests that finished there recently got TPOT within 0.9 x their target, refused
# only beyond: the prediction is for a moment, the target a mean over a request's life, and
# refusing at the hold's limit lost one long-conversation request in six that would have met
# both targets; the gate keeps the hold refusing on a saturated worker, where giving way drags
# every running decode past its target together. One run each, vLLM-like engines
# (bench/PEERS.md, "Long conversations"): refusing, long-conv rows 0-299 at 1.78 / 2.14 req/s
# 0.930 (19 refused) / 0.840 (43), Azure conv rows 0-1514 at 14.5 req/s 0.884 (137); shipped:
# 0.977 (3) / 0.843 (35), 0.868 (133); giving way at 1.2 x without the gate: 0.993 / 0.897 but
# Azure conv 0.606, at 1.1 x 0.857 (at 2.14) and 0.702; gated on the worker's step time now
# (1.0 x): 0.947 / 0.873, 0.892 (a long prompt's chunks stretch the step time for seconds).
# A cheap request (its predicted prefill within 1.5 x its TPOT target, its own predicted TPOT within
# 0.95 x) is served there even where that gate would refuse it: Azure conv vLLM-like at 14.5
# req/s 0.867 (138 refused) -> 0.890 (112), one run each; in virtual time 14.49 -> 15.04 req/s at
# 90 %, the other cells unchanged (bench/PEERS.md, "The hold, searched offline").
# The stall hold (1.0): a batch waits, within its TTFT guard, while its prefill would stall a
# decoding request on its worker by more than that request can absorb within its TPOT target
# ((target - predicted TPOT) x (its expected tokens - 1)), until that request is expected to
# finish: a short answer (most of Azure code's) misses TPOT on one long prompt landing in its
# few steps. In virtual time (bench/tune.py, `--agent openai`, highest load at 90 %): Azure code
# 7.02 -> 7.89 req/s vLLM-like, 6.66 -> 7.32 prefill-first; Azure conv 15.04 -> 14.81 / 14.06 ->
# 14.42; long-conv 2.04 -> 2.05 / 1.99 -> 2.03; chat 1.69 -> 1.68 / 1.66 -> 1.67; live: bench/PEERS.md.
# Only while the worker's TPOT with the head is within 0.8 x its target (`stall_hold_headroom`):
# nearer the target the TPOT hold needs the request's TTFT slack; live, Azure conv vLLM-like at
# 13.3 / 14.5 req/s 0.925 / 0.865 without that limit, 0.935 / 0.890 with it (0.937 / 0.894
# without the stall hold); Azure code unchanged or better (0.964 / 0.938 vLLM-like at 6.37 /
# 7.16 req/s against 0.964 / 0.897; prefill-first 0.951 / 0.902 against 0.933 / 0.920).
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
DEFAULT_GRANT = ("standard", "sheddable")  # a tenant tenant_classes does not list, once grants are on
TENANT_NAME = re.compile(r"[A-Za-z0-9._:-]{1,64}")  # a tenant names a metrics label and a journal field
SECRET_SETTINGS = frozenset({"tenant_api_keys", "admin_token"})  # never echoed in an error
SHIPPED_SLO_BUDGET_PARAMS = {"window_ms": 1000.0, "tpot_headroom": 0.9, "tpot_refuse_ratio": 1.2,
                             "give_way_tpot_ratio": 0.9, "give_way_prefill_ratio": 1.5,
                             "give_way_cheap_tpot_ratio": 0.95, "stall_hold": 1.0, "stall_hold_headroom": 0.8}


def sentinel_addresses(value: str) -> list[tuple[str, int]]:
    """`host:port,host:port` -> [(host, port), ...]; "" -> []. ValueError names a bad entry."""
    out = []
    for entry in filter(None, (e.strip() for e in value.split(","))):
        host, sep, port = entry.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"not host:port: {entry!r} (comma-separated, e.g. 127.0.0.1:26379,127.0.0.1:26380)")
        out.append((host, int(port)))
    return out


class SettingsError(ValueError):
    """A setting has a bad value; the message names it."""


class RouterSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    cluster: str = "default"  # Redis key prefix flexlb:<cluster>:
    router_id: str = "router-0"  # stable across restarts: names the durable event consumer
    nats_url: str = "nats://127.0.0.1:4222"  # a cluster: every server's URL, comma-separated
    # Copies of each JetStream stream across the NATS cluster: 3 on a three-node cluster (any
    # one node may be lost), 1 on one server (`flexlb up --nats-cluster 3` sets 3).
    nats_replicas: int = 1
    redis_url: str = "redis://127.0.0.1:6379/0"  # its db (and password) are used with Sentinel too
    # Redis through Sentinel: the sentinels' host:port, comma-separated. The primary of
    # `redis_master_name` is discovered through them, and found again after a failover.
    redis_sentinels: str = ""
    redis_master_name: str = "flexlb"
    host: str = "127.0.0.1"  # HTTP listen address
    port: int = 8000
    # Bind the port with SO_REUSEPORT, so that several router processes share it and the
    # kernel spreads connections among them (`flexlb up --http-workers N`: one leader, the
    # rest standbys that forward to it over NATS).
    reuse_port: bool = False
    own_port: int = 0  # with reuse_port: a second port only this process listens on (its /metrics, its view); 0: none
    model_name: str = "flexlb-sim"  # the default model: of requests that name none and workers that report none
    prefill_policy: str = "cost-based"  # see services/core/policies/
    prefill_policy_params: dict[str, Any] = {}  # JSON object of the policy's parameters
    decode_policy: str = "kv-aware"
    decode_policy_params: dict[str, Any] = {}
    # A scheduling pipeline file (YAML or JSON; services/core/pipeline/): its `prefill` and / or
    # `decode` section makes that stage's policy `pipeline`, with those filters, scorers and
    # picker (README, "Extending the scheduler"). Not with that stage's policy parameters.
    scheduling_config: str = ""
    batcher: str = SHIPPED_BATCHER  # slo-budget | fixed-window (services/core/batchers/)
    batcher_params: dict[str, Any] = {}  # JSON object of the batcher's parameters (over the shipped ones)
    # Shortcuts: the longest wait of a batch (fixed-window wait_ms, slo-budget window_ms) and
    # the most requests in one (batch_size_max of either).
    batch_wait_ms: float | None = None
    batch_size_max: int | None = None
    prefix_index: str = "exact"  # exact (workers' KV events) | approximate (learned from decisions)
    slo_mode: str = "reject-explicit"  # reject-explicit | best-effort | reject | shed (services/core/slo.py)
    slo_tpot_guard: float = 0.0  # shed: refuse while the decoding worker's step time > this x the TPOT target; 0 = off
    predictor_learning: bool = True  # refine prefill-time coefficients from measured batches
    prefill_coefficients: dict[str, Any] = {}  # prior of the predictor (default: Splitwise fit)
    max_prompt_tokens: int = 32768  # larger prompts: too_large
    # Text prompts: a Hugging Face tokenizer.json (or a directory with one), so the ids the
    # router hashes and sends are the model's; "": the byte-level tokenizer (schemas/tokens.py).
    tokenizer: str = ""
    # With tokenizer: add its special tokens (BOS) to a text prompt, as vLLM's /v1/completions
    # and SGLang do for text (they run our ids as given, so the BOS must be ours).
    tokenizer_add_special_tokens: bool = True
    # Chat completions: a Jinja chat template file (.jinja, or .json with "chat_template") that
    # replaces the tokenizer directory's; "": the tokenizer's, else (byte tokenizer) the built-in
    # one (services/chat.py, schemas/chat_template.py).
    chat_template: str = ""
    max_output_tokens: int = 8192  # larger max_tokens: invalid_request
    max_body_bytes: int = 8 * 1024 * 1024  # larger bodies: too_large
    max_queue_per_worker: int = 1024  # batcher queue bound per prefill worker: queue_full
    max_inflight_requests: int = 100_000  # global cap: queue_full
    liveness_sync_ms: int = 500  # one liveness cycle; a cycle without a report is a missed beat
    dead_after_missed_syncs: int = 3  # consecutive missed cycles before a worker is dead (1.5 s)
    settle_after_missed_reports: int = 2  # a request a worker reported running, then left out of this many reports: settled
    expire_after_ms: int = 10_000  # no report this long: the worker is removed everywhere
    token_buffer_max: int = 4096  # token chunks buffered per request before stream_overflow
    finish_grace_ms: int = 2000  # after a finish event, wait this long for straggling tokens
    ledger_ttl_s: int = 300  # an unconfirmed ledger entry is evicted after this long
    ledger_sweep_s: float = 60.0  # how often the TTL sweep runs
    request_timeout_s: float = 600.0  # the client waits at most this long for a terminal outcome
    # A request a worker fails before any of its tokens reached the client (a 5xx, a refused
    # connection, the worker gone before prefill) is routed again, excluding the workers that
    # failed it, at most this many times (0: fails at once).
    retry_limit: int = 2
    # A request whose worker dies or fails it after its first token reached the client goes on
    # elsewhere as a continuation (its prompt plus the tokens sent), at most this many times
    # (0: it fails, worker_failed / upstream_error, as before; past the limit:
    # migration_limit_exceeded). Needs the token ids of what was sent (an engine server that
    # streams text without ids: it fails as before).
    migration_limit: int = 3
    # Circuit breakers (services/core/breaker.py): this many consecutive server failures of a
    # worker's requests open its breaker (0: off); it stays open breaker_open_s, doubled at each
    # re-opening up to breaker_max_open_s, then one probe request half-opens it.
    breaker_failures: int = 5
    # Whose finished requests teach a worker's TPOT calibration (the step time -> TPOT line the
    # TPOT hold reads; services/core/decode_model.py): "worker" (its own) or "pool" (every
    # finished request of its model and role). Not the default: live, long-conv rows 0-299 at
    # 1.96 / 2.14 req/s, one run each, vLLM-like 0.937 / 0.860 (worker) against 0.953 / 0.873
    # (pool), prefill-first 0.933 / 0.847 against 0.897 / 0.817: no better than the noise
    # (bench/results/check_issue34/tpot_calibration_*); identical in virtual time.
    tpot_calibration: str = "worker"
    breaker_open_s: float = 1.0
    breaker_max_open_s: float = 30.0
    seed: int = 0  # the router's RNG seed (decisions are reproducible)
    journal: bool = True  # record every call into the scheduling core (FLEXLB_JOURNAL; `flexlb replay`)
    events_max_age_s: float = 24 * 3600  # retention of the event log (FLEXLB_EVENTS) ...
    events_max_bytes: int = 1024 * 1024 * 1024  # ... whichever limit comes first
    journal_max_age_s: float = 24 * 3600  # retention of the core journal (FLEXLB_JOURNAL) ...
    journal_max_bytes: int = 1024 * 1024 * 1024  # ... whichever limit comes first
    admin_token: str = ""  # bearer token of /admin/*; required where the admin API listens beyond loopback
    # A listener of its own for /admin/*, /docs and /openapi.json (0: they share `port`): the
    # public port then carries only the API, /healthz, /readyz and /metrics, and the admin one
    # listens on `admin_host` (loopback by default: reach it from the machine, a bastion or a
    # port-forward).
    admin_port: int = 0
    admin_host: str = "127.0.0.1"
    # Lead one pool only (a model's workers): its own Redis lease, ledger and submit subject, so
    # that the leaders of different pools run in different processes; requests for another
    # pool are forwarded to its leader. "": lead every pool, one lease for the cluster (a
    # cluster runs one way or the other: every router set, or none).
    scheduling_pool: str = ""
    # The fair queue under overload (services/core/admission.py, fairness.py): work beyond what
    # the engines run (their max_num_seqs) plus fair_engine_buffer each waits at the router,
    # released by priority class, then by tenants' fair share of tokens.
    fair_queue: bool = True
    fair_engine_buffer: int = 0
    # FairnessParams over the defaults (JSON object): w_out, starvation_bound_ms,
    # max_queued_per_class, max_queued_per_tenant, max_queued_total, max_queue_wait_ms,
    # retry_after_ms, default_weight.
    fairness_params: dict[str, Any] = {}
    tenant_weights: dict[str, float] = {}  # tenant -> its weight in its class's fair share (default 1)
    # Where a request's tenant comes from. With `tenant_api_keys` set (API key -> tenant; from
    # FLEXLB_TENANT_API_KEYS or `tenant_api_keys_file`, never a command line), every request
    # needs a known key (`Authorization: Bearer <key>`; else 401 invalid_api_key) and its
    # tenant is the key's: this header is ignored unless `trust_tenant_header` (a trusted
    # gateway in front, which authenticates clients and names their tenant, sets it). Without
    # keys: this header's value; "" ignores any client-sent tenant header. Neither: "default".
    tenant_header: str = "x-flexlb-tenant"
    tenant_api_keys: dict[str, str] = {}
    tenant_api_keys_file: str = ""  # a JSON object (key -> tenant), merged into tenant_api_keys
    trust_tenant_header: bool = False
    # Priority is granted, not claimed: tenant -> the classes it may use, its default first
    # (e.g. {"alpha": ["standard", "critical"]}: alpha's requests run standard unless they ask
    # critical). A request asking (by `priority_class`, the x-flexlb-priority-class header or
    # its numeric priority's band) a class its tenant is not granted is lowered to the highest
    # granted class below it (none: its default), its priority clamped into that class's band;
    # the request.admitted event records both classes. `strict_priority`: refused instead, 403
    # priority_not_granted. Once API keys or any grant are configured, a tenant not listed is
    # granted DEFAULT_GRANT (standard, sheddable); with neither, every class is open to everyone
    # (one trust domain: any client can name any tenant then).
    tenant_classes: dict[str, list[str]] = {}
    strict_priority: bool = False
    # Per-tenant limits of this router process (services/limits.py): tenant (or "*": every tenant
    # not listed) -> {"max_open", "requests_per_minute", "tokens_per_minute"}; over one: 429
    # rate_limited with Retry-After.
    tenant_limits: dict[str, dict[str, float]] = {}
    log_level: str = "info"
    # On SIGTERM: give the lease up at once (a standby leads), stop listening, and relay the
    # streams already open for up to this long (a second signal ends the wait); 0: cut them.
    # flexlb up's routers: 1 s unless --drain-timeout-s is given.
    drain_timeout_s: float = 30.0
    # An idle client connection stays open this long (uvicorn's own default is 5 s). Behind a
    # load balancer or gateway it must outlast the proxy's idle timeout (AWS ALB 60 s, nginx's
    # upstream keepalive 60 s): otherwise the router closes a connection just as the proxy
    # sends the next request on it, and that request fails (502 at the proxy; a client of its
    # own sees the connection reset).
    http_keep_alive_s: float = 75.0

    def validate(self) -> "RouterSettings":
        try:
            validate_token("router_id", self.router_id)
            validate_token("cluster", self.cluster)
        except ValueError as exc:
            raise SettingsError(str(exc)) from None
        try:
            nats_servers(self.nats_url)
        except ValueError as exc:
            raise SettingsError(f"setting nats_url: {exc}") from None
        try:
            sentinel_addresses(self.redis_sentinels)
        except ValueError as exc:
            raise SettingsError(f"setting redis_sentinels: {exc}") from None
        if self.redis_sentinels:
            try:
                validate_token("redis_master_name", self.redis_master_name)
            except ValueError as exc:
                raise SettingsError(str(exc)) from None
        if not 1 <= self.nats_replicas <= 5:
            raise SettingsError(f"setting nats_replicas must be 1..5 (JetStream's limit), got {self.nats_replicas!r}")
        positive = [
            "port", "max_prompt_tokens", "max_output_tokens", "max_body_bytes",
            "max_queue_per_worker", "max_inflight_requests", "liveness_sync_ms", "dead_after_missed_syncs",
            "settle_after_missed_reports", "expire_after_ms", "token_buffer_max",
            "ledger_ttl_s", "ledger_sweep_s", "request_timeout_s",
        ]
        for name in positive:
            if getattr(self, name) <= 0:
                raise SettingsError(f"setting {name} must be > 0, got {getattr(self, name)!r}")
        if not 0 <= self.own_port < 65536 or (self.own_port and (not self.reuse_port or self.own_port == self.port)):
            raise SettingsError(f"setting own_port goes with reuse_port and must be another port than port, got {self.own_port!r}")
        if self.scheduling_config:
            self._apply_scheduling_config()
        if not self.http_keep_alive_s > 0:
            raise SettingsError(f"setting http_keep_alive_s must be > 0, got {self.http_keep_alive_s!r}")
        if self.tenant_api_keys_file:
            self._load_tenant_api_keys()
        for key, tenant in self.tenant_api_keys.items():
            if not key or not isinstance(tenant, str) or not TENANT_NAME.fullmatch(tenant):
                # (never the key itself: it is a secret)
                raise SettingsError(f"tenant_api_keys: every key must be non-empty and map to a tenant of 1-64 characters "
                                    f"of A-Z a-z 0-9 . _ : -, got tenant {str(tenant)[:80]!r}")
        for tenant, classes in self.tenant_classes.items():
            if not TENANT_NAME.fullmatch(tenant):
                raise SettingsError(f"setting tenant_classes: tenant names are 1-64 characters of A-Z a-z 0-9 . _ : -, "
                                    f"got {tenant[:80]!r}")
            if not classes or len(set(classes)) != len(classes) or any(c not in CLASSES for c in classes):
                raise SettingsError(f"setting tenant_classes: {tenant}'s classes must be a non-empty list of distinct "
                                    f"{', '.join(CLASSES)} (its default first), got {str(classes)[:120]}")
        bad = [t for t in self.tenant_limits if t != "*" and not TENANT_NAME.fullmatch(t)]
        if bad:
            raise SettingsError(f"setting tenant_limits: tenant names are 1-64 characters of A-Z a-z 0-9 . _ : - "
                                f"(or \"*\": every other tenant), got {bad[0][:80]!r}")
        try:
            parse_limits(self.tenant_limits)
        except ValueError as exc:
            raise SettingsError(f"setting tenant_limits: {exc}") from None
        if self.tpot_calibration not in ("worker", "pool"):
            raise SettingsError(f"setting tpot_calibration must be worker or pool, got {self.tpot_calibration!r}")
        if self.retry_limit < 0 or self.breaker_failures < 0 or self.migration_limit < 0:
            raise SettingsError(f"settings retry_limit, migration_limit and breaker_failures must be >= 0 (0: off), got "
                                f"{self.retry_limit!r}, {self.migration_limit!r} and {self.breaker_failures!r}")
        if not 0 < self.breaker_open_s <= self.breaker_max_open_s < math.inf:
            raise SettingsError(f"setting breaker_open_s must be > 0 and <= breaker_max_open_s (finite), got "
                                f"{self.breaker_open_s!r} and {self.breaker_max_open_s!r}")
        if not self.drain_timeout_s >= 0:
            raise SettingsError(f"setting drain_timeout_s must be >= 0 (0: no drain), got {self.drain_timeout_s!r}")
        if self.batch_wait_ms is not None and self.batch_wait_ms < 0:
            raise SettingsError(f"setting batch_wait_ms must be >= 0, got {self.batch_wait_ms!r}")
        if self.batch_size_max is not None and self.batch_size_max < 1:
            raise SettingsError(f"setting batch_size_max must be >= 1, got {self.batch_size_max!r}")
        if self.prefix_index not in ("exact", "approximate"):
            raise SettingsError(f"setting prefix_index must be exact or approximate, got {self.prefix_index!r}")
        if self.slo_mode not in ("reject-explicit", "best-effort", "reject", "shed"):
            raise SettingsError(f"setting slo_mode must be reject-explicit, best-effort, reject or shed, got {self.slo_mode!r}")
        if not self.slo_tpot_guard >= 0:
            raise SettingsError(f"setting slo_tpot_guard must be >= 0 (0: off), got {self.slo_tpot_guard}")
        try:
            self.scheduler_config().validate()
        except ValueError as exc:
            raise SettingsError(f"scheduling settings: {exc}") from None
        admin_host = self.admin_host if self.admin_port else self.host
        if not self.admin_token and admin_host not in LOOPBACK_HOSTS:
            raise SettingsError(
                f"setting admin_token (FLEXLB_ADMIN_TOKEN) is required when the admin API listens on {admin_host!r}: "
                "it can drain and remove workers" + ("" if self.admin_port else " (--admin-port P serves it on a "
                                                     "loopback port of its own)")
            )
        if not 0 <= self.admin_port < 65536 or (self.admin_port and self.admin_port in (self.port, self.own_port)):
            raise SettingsError(f"setting admin_port must be 0 (off) or a port other than the router's, got {self.admin_port!r}")
        if self.log_level.lower() not in {"debug", "info", "warning", "error"}:
            raise SettingsError(f"setting log_level must be debug|info|warning|error, got {self.log_level!r}")
        if self.tokenizer:  # read it now: a bad file stops the process at start, not at the first request
            try:
                load_tokenizer(self.tokenizer, self.tokenizer_add_special_tokens)
            except ValueError as exc:
                raise SettingsError(f"setting tokenizer (--tokenizer / FLEXLB_TOKENIZER): {exc}") from None
        return self


    def prefill_policy_params_effective(self) -> dict[str, Any]:
        """The prefill policy's parameters: the shipped ones (cost-based's), under `prefill_policy_params`."""
        shipped = SHIPPED_COST_BASED_PARAMS if self.prefill_policy == "cost-based" else {}
        return {**shipped, **self.prefill_policy_params}

    def batcher_params_effective(self) -> dict[str, Any]:
        """The batcher's parameters: the shipped ones, under `batcher_params`, under the shortcuts."""
        shipped = {"fixed-window": {"wait_ms": SHIPPED_FIXED_WINDOW_WAIT_MS},
                   "slo-budget": SHIPPED_SLO_BUDGET_PARAMS}.get(self.batcher, {})
        params = {**shipped, **self.batcher_params}
        if self.batch_wait_ms is not None:
            params["window_ms" if self.batcher == "slo-budget" else "wait_ms"] = self.batch_wait_ms
        if self.batch_size_max is not None:
            params["batch_size_max"] = self.batch_size_max
        return params

    def _apply_scheduling_config(self) -> None:
        """Each section of the scheduling config file becomes its stage's `pipeline` policy
        (idempotent: validating again finds the same parameters in place)."""
        import yaml

        from services.core.policies import build_policy

        where = f"setting scheduling_config ({self.scheduling_config})"
        try:
            with open(self.scheduling_config, encoding="utf-8") as f:
                doc = yaml.safe_load(f)
        except OSError as exc:
            raise SettingsError(f"{where}: cannot read it: {exc.strerror}") from None
        except yaml.YAMLError as exc:
            raise SettingsError(f"{where}: not YAML or JSON: {str(exc)[:300]}") from None
        if not isinstance(doc, dict) or not doc or set(doc) - {"prefill", "decode"}:
            raise SettingsError(f"{where}: must be a mapping with a `prefill` and / or a `decode` section, got "
                                f"{sorted(doc) if isinstance(doc, dict) else type(doc).__name__}")
        for stage, section in doc.items():
            params = getattr(self, f"{stage}_policy_params")
            if params and (getattr(self, f"{stage}_policy") != "pipeline" or params != section):
                raise SettingsError(f"{where}: its {stage} section and {stage}_policy_params both given: one or the other")
            try:
                build_policy(stage, "pipeline", section)
            except ValueError as exc:
                raise SettingsError(f"{where}: {stage}: {exc}") from None
            setattr(self, f"{stage}_policy", "pipeline")
            setattr(self, f"{stage}_policy_params", section)

    def _load_tenant_api_keys(self) -> None:
        try:
            with open(self.tenant_api_keys_file, "rb") as f:
                keys = msgspec.json.decode(f.read(), type=dict[str, str])
        except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise SettingsError(f"tenant_api_keys_file {self.tenant_api_keys_file!r} is not a readable JSON object of "
                                f"key -> tenant: {exc.__class__.__name__}") from None
        self.tenant_api_keys = {**self.tenant_api_keys, **keys}

    def scheduler_config(self):
        from services.core.breaker import BreakerParams
        from services.core.decode_model import DecodeModelParams
        from services.core.predictor import PredictorParams, PrefillCoefficients
        from services.core.scheduler import SchedulerConfig
        from services.core.slo import SloParams

        try:
            coefficients = msgspec.convert(self.prefill_coefficients, PrefillCoefficients)
        except msgspec.ValidationError as exc:
            raise ValueError(f"prefill_coefficients: {exc}") from None
        return SchedulerConfig(
            max_prompt_tokens=self.max_prompt_tokens, max_queue_per_worker=self.max_queue_per_worker,
            max_inflight_requests=self.max_inflight_requests,
            dead_after_missed_syncs=self.dead_after_missed_syncs, expire_after_ms=self.expire_after_ms,
            settle_after_missed_reports=self.settle_after_missed_reports,
            prefill_policy=self.prefill_policy, prefill_policy_params=self.prefill_policy_params_effective(),
            decode_policy=self.decode_policy, decode_policy_params=dict(self.decode_policy_params),
            batcher=self.batcher, batcher_params=self.batcher_params_effective(),
            predictor_coefficients=coefficients, predictor_params=PredictorParams(learning=self.predictor_learning),
            decode_model_params=DecodeModelParams(tpot_calibration_scope=self.tpot_calibration),
            slo=SloParams(mode=self.slo_mode, tpot_guard=self.slo_tpot_guard), prefix_index=self.prefix_index, seed=self.seed,
            model_name=self.model_name, fairness=self.fair_admission_config(),
            breaker=BreakerParams(failures_to_open=self.breaker_failures, open_ms=self.breaker_open_s * 1000.0,
                                  max_open_ms=self.breaker_max_open_s * 1000.0),
            end_unprefilled_batches=True,
        )

    def fair_admission_config(self):
        from services.core.admission import FairAdmissionConfig
        from services.core.fairness import FairnessParams

        known = set(FairnessParams.__dataclass_fields__) - {"tenant_weights"}
        unknown = set(self.fairness_params) - known
        if unknown:
            raise ValueError(f"fairness_params: unknown {', '.join(sorted(unknown))} (known: {', '.join(sorted(known))})")
        try:
            params = msgspec.convert({**self.fairness_params, "tenant_weights": dict(self.tenant_weights)}, FairnessParams)
        except msgspec.ValidationError as exc:
            raise ValueError(f"fairness_params: {exc}") from None
        return FairAdmissionConfig(enabled=self.fair_queue, engine_buffer=self.fair_engine_buffer, params=params)


def known_env_vars(*classes: type) -> set[str]:
    return {ENV_PREFIX + f.upper() for cls in classes for f in cls.__struct_fields__}


def load(
    cls: type,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    known_elsewhere: set[str] = frozenset(),
) -> Any:
    """Build `cls` from environment and overrides (None values in overrides are skipped).

    Values from the environment are strings converted to the field's type (lax conversion:
    "8" -> 8, "true" -> True); anything that does not convert raises SettingsError naming the
    variable. Unknown FLEXLB_* variables (not fields of cls, not in known_elsewhere) log a warning.
    """
    environ = os.environ if environ is None else environ
    fields = set(cls.__struct_fields__)
    raw: dict[str, Any] = {}
    for key, value in environ.items():
        if not key.startswith(ENV_PREFIX):
            continue
        name = key[len(ENV_PREFIX):].lower()
        if name in fields:
            raw[name] = value
        elif key not in known_elsewhere:
            log.warning("unknown environment variable %s ignored (known: %s)", key, ", ".join(sorted(known_env_vars(cls))))
    origin = {k: f"{ENV_PREFIX}{k.upper()}" for k in raw}
    for key, value in (overrides or {}).items():
        if value is None:
            continue
        if key not in fields:
            raise SettingsError(f"unknown setting {key!r}")
        raw[key] = value
        origin[key] = f"--{key.replace('_', '-')}"
    for key in list(raw):
        if cls.__annotations__.get(key, "").startswith("dict") and isinstance(raw[key], str):
            try:
                raw[key] = msgspec.json.decode(raw[key])
            except msgspec.DecodeError as exc:
                raise SettingsError(f"{origin[key]} must be a JSON object: "
                                    f"{'(not shown: a secret)' if key in SECRET_SETTINGS else exc}") from None
    try:
        obj = msgspec.convert(raw, cls, strict=False)
    except msgspec.ValidationError as exc:
        text = str(exc)
        for key, where in origin.items():
            if f"$.{key}" in text:
                shown = "(not shown: a secret)" if key in SECRET_SETTINGS else repr(raw[key])
                raise SettingsError(f"bad value {shown} for {where}: {text}") from None
        raise SettingsError(text) from None
    validate = getattr(obj, "validate", None)
    return validate() if validate else obj
