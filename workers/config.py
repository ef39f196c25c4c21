"""A worker's settings: `WorkerConfig`, the one flat view that `FLEXLB_*` environment
variables, `flexlb worker` / `flexlb up` flags and compose files fill (services/settings.py
loads it by field name), and the typed settings of each engine derived from it.

Groups (each a frozen Struct with its own validation, built by the method of that name):
- `scheduler_settings()`: what the sim and torch engines share, their scheduler
  (workers/engines/scheduler.py): KV blocks, block size, sequence length, the per-step token
  budget, running sequences, chunked prefill, vllm or sglang scheduling;
- `sim_settings()`: the timing profile, the time scale and the LoRA adapters it serves
  (workers/engines/sim.py);
- `torch_settings()`: the model, device, seed, dtype and threads (workers/engines/torch_engine.py);
- `openai_settings()`: the server, its protocol, the stream limits, vLLM's KV-event
  endpoints, and the server's limits when given (workers/openai/agent.py).
The rest is the agent's own: identity, role, NATS, heartbeat, metrics, outbound buffer.
A setting of another engine than the worker's is accepted (compose files set them for
every service) and unused; `validate` checks the common fields and the worker's engine's
group only.

The limits every worker reports to the router (WorkerRegistered / WorkerStatusReported):
- the most sequences running at once, `max_num_seqs`: sim and torch, the scheduler's
  `max_num_seqs` (256); openai, `engine_max_num_seqs`, the server's
  --max-num-seqs, else (0) learned from its /metrics (workers/openai/status.py,
  `learn_max_num_seqs`). A setting of its own, not `max_num_seqs`: that one has a default
  (256) the sim and torch engines run with, which the agent could not tell from an
  operator's 256, and a server's real limit is often another number (SGLang sizes it from
  its memory); a wrong limit is worse than an unknown one (0), which the router treats as
  such.
- the LoRA adapter slots, `max_loras` (0: the engine's default): sim, DEFAULT_MAX_LORAS (4)
  when `lora_adapters` names any, and it must be 0 without them; openai, the server's
  --max-loras when given, else what vLLM's `vllm:lora_requests_info` says (0: none). One
  setting for both: it is new, so 0 can mean "the engine's default" for each.
`lora_adapters` (comma-separated names, as `nats_url`: an environment variable holds it) and
`lora_load_ms` (20) are the sim engine's: what it serves and what a load costs. The openai
agent learns what its server serves from GET /v1/models (an adapter is a model with a
`parent`); the torch engine serves none.

`make_engine(cfg)` is the one construction path of an engine from a config, for the NATS
worker and `flexlb sim-server` alike, so both run the very same engine.

Imports: `schemas` and `workers.engines` only.
"""

from __future__ import annotations

import os

import msgspec

from schemas import messages as m
from schemas.subjects import nats_servers, validate_token
from workers.engines.base import Engine
from workers.engines.scheduler import SCHEDULERS
from workers.engines.sim import DEFAULT_LORA_LOAD_MS

ENGINES = ("sim", "torch", "openai")
# The model a sim worker serves unless `served_model_name` says otherwise: the router's
# default `model_name` (services/settings.py), so a plain stack needs neither set.
SIM_MODEL_NAME = "flexlb-sim"
PROTOCOLS = ("openai", "sglang")
ENGINE_PROMPTS = ("ids", "text")  # what the openai agent sends as a completion's prompt (OpenAISettings.engine_prompt)
DEFAULT_MAX_LORAS = 4  # sim with adapters, max_loras 0: bench/lora.py's slots per worker (vLLM's own default is 1)


class SchedulerSettings(msgspec.Struct, frozen=True, kw_only=True):
    """The scheduler the sim and torch engines share (workers/engines/scheduler.py)."""

    num_kv_blocks: int  # KV capacity (blocks of block_size_tokens)
    block_size_tokens: int
    max_seq_len_tokens: int  # longest prompt + output
    max_num_batched_tokens: int  # tokens one step may compute (prompt chunks + one per decode)
    max_num_seqs: int  # sequences running at once
    chunked_prefill: bool  # a prompt may be split over steps
    scheduler: str  # vllm (mixed steps) | sglang (prefill-first)
    max_prefill_tokens: int  # sglang: the input budget of one prefill step

    def validate(self) -> None:
        if self.scheduler not in SCHEDULERS:
            raise ValueError(f"scheduler {self.scheduler!r} is not known; known: {', '.join(SCHEDULERS)}")
        for name in ("num_kv_blocks", "block_size_tokens", "max_seq_len_tokens", "max_num_batched_tokens",
                     "max_num_seqs", "max_prefill_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


class SimSettings(msgspec.Struct, frozen=True, kw_only=True):
    """The simulated engine's timing and LoRA adapters (workers/engines/sim.py)."""

    profile: str | None  # timing profile JSON; None: llama2-70b H100 TP8 (Splitwise fit)
    time_scale: float  # wall time = profile time x this: 0 instant, 0.01 100x faster
    lora_adapters: list[str]  # the adapters it serves (requests name one as `model`); []: none
    max_loras: int  # its adapter slots (resolved: DEFAULT_MAX_LORAS with adapters, 0 without)
    lora_load_ms: float  # modelled ms of loading an adapter into a slot (engine time: x time_scale)

    def validate(self) -> None:
        if self.time_scale < 0:
            raise ValueError(f"time_scale must be >= 0, got {self.time_scale}")
        if self.lora_load_ms < 0:
            raise ValueError(f"lora_load_ms must be >= 0, got {self.lora_load_ms}")
        if len(set(self.lora_adapters)) < len(self.lora_adapters):
            raise ValueError(f"lora_adapters names an adapter twice: {','.join(self.lora_adapters)}")
        if self.max_loras and not self.lora_adapters:
            raise ValueError(f"max_loras {self.max_loras} without lora_adapters: the sim engine has no adapter to load")


class TorchSettings(msgspec.Struct, frozen=True, kw_only=True):
    """The torch engine's model (workers/engines/torch_engine.py)."""

    model: str  # a preset (tiny, 1b: seeded random weights) or a local Hugging Face Llama directory
    device: str  # cpu | cuda | cuda:N
    model_seed: int  # seed of a preset's random weights
    dtype: str | None  # float32 | bfloat16 | float16; None: the preset's (HF directory: float32)
    torch_threads: int  # intra-op threads on a CPU; 0: torch's default (every core)

    def validate(self) -> None:
        if self.torch_threads < 0:
            raise ValueError(f"torch_threads must be >= 0, got {self.torch_threads}")
        try:
            import torch  # noqa: F401  (the torch extra)
        except ImportError:
            raise ValueError("engine torch needs torch: pip install -e '.[torch]'") from None


class OpenAISettings(msgspec.Struct, frozen=True, kw_only=True):
    """The server behind the openai agent (workers/openai/agent.py)."""

    engine_url: str  # its base URL
    engine_model: str  # the served model name; "": the first of its GET /v1/models
    engine_protocol: str  # openai (/v1/completions, /v1/chat/completions) | sglang (/generate)
    # a completion's prompt: "ids" (the router's token ids: the server sees exactly what the
    # router routed on) | "text" (the client's text where it sent text, the server tokenizes it:
    # for a server whose tokenizer the router does not have; ForEngine.prompt_text)
    engine_prompt: str
    upstream_max_concurrency: int  # most requests open to it at once
    upstream_stall_timeout_s: float  # a stream silent this long fails (upstream_error)
    kv_events_endpoint: str  # vLLM's KV-event ZMQ PUB endpoint; "": no events
    kv_events_replay_endpoint: str  # its replay endpoint (optional)
    kv_events_topic: str  # its topic; "": all
    engine_max_num_seqs: int  # the server's --max-num-seqs; 0: learned from its /metrics (module docstring)
    max_loras: int  # the server's --max-loras; 0: from vLLM's vllm:lora_requests_info, else 0

    def validate(self, role: str) -> None:
        if not self.engine_url.startswith(("http://", "https://")):
            raise ValueError(f"engine openai needs engine_url, an http:// or https:// base URL, got {self.engine_url!r}")
        if role != "pd_fusion":
            raise ValueError("engine openai serves colocated (pd_fusion) only: PD through a server's own KV "
                             "connector (vLLM kv_transfer_params) is not supported")
        if self.engine_protocol not in PROTOCOLS:
            raise ValueError(f"engine_protocol must be openai or sglang, got {self.engine_protocol!r}")
        if self.engine_prompt not in ENGINE_PROMPTS:
            raise ValueError(f"engine_prompt must be ids or text, got {self.engine_prompt!r}")
        if self.upstream_max_concurrency <= 0 or self.upstream_stall_timeout_s <= 0:
            raise ValueError("upstream_max_concurrency and upstream_stall_timeout_s must be > 0")
        if self.kv_events_replay_endpoint and not self.kv_events_endpoint:
            raise ValueError("kv_events_replay_endpoint needs kv_events_endpoint")


def _group(cls, cfg: "WorkerConfig"):
    return cls(**{name: getattr(cfg, name) for name in cls.__struct_fields__})


class WorkerConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The flat view the settings loader fills (module docstring); fields by group."""

    # The agent's own.
    worker_id: str
    role: str = "pd_fusion"
    engine: str = "sim"  # sim | torch (the `torch` extra) | openai (an engine server)
    nats_url: str = "nats://127.0.0.1:4222"  # a cluster: every server's URL, comma-separated
    nats_replicas: int = 1  # copies of each stream it creates if it starts first (the router's setting)
    heartbeat_interval_ms: int = 200
    # SIGTERM: stop taking work (report "draining") and finish what it holds for up to this
    # long, then fail the rest retryable and exit; 0: fail what it holds at once. 30 s:
    # Kubernetes' default termination grace period (docker-compose.yml's stop_grace_period
    # gives a little more), time for a few hundred decode steps.
    drain_timeout_s: float = 30.0
    metrics_port: int = 0  # > 0: the worker's own Prometheus /metrics here (workers/metrics.py)
    metrics_host: str = "127.0.0.1"
    max_batch_tokens: int = 65536  # most prompt tokens in one prefill batch (reported to the router)
    # The model name it reports (requests name it as `model`; the router routes by it). "": the
    # engine's own (served_model()): sim "flexlb-sim", torch the preset or the model
    # directory's basename, openai the server's (engine_model, or its first /v1/models id).
    served_model_name: str = ""
    # While NATS is away, outputs wait in the client's buffer, up to this many bytes (shared by
    # all requests). A request whose tokens do not fit is stopped and failed with
    # stream_overflow (counted in num_stream_overflows), never silently truncated.
    outbound_buffer_bytes: int = 2 * 1024 * 1024
    # SchedulerSettings (sim, torch); block size, KV blocks and sequence length are also what
    # every worker reports (the openai agent's come from its server where it says them).
    num_kv_blocks: int = 16384
    block_size_tokens: int = 16
    max_seq_len_tokens: int = 40960
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    chunked_prefill: bool = True
    scheduler: str = "vllm"
    max_prefill_tokens: int = 16384
    # SimSettings.
    profile: str | None = None
    time_scale: float = 1.0
    lora_adapters: str = ""  # comma-separated adapter names; "": none
    max_loras: int = 0  # 0: the engine's default (module docstring): sim 4 with adapters; openai the server's
    lora_load_ms: float = DEFAULT_LORA_LOAD_MS
    # TorchSettings. Several CPU workers on one machine must share the cores (`flexlb up`
    # gives each cores / workers): oversubscribed OpenMP threads spin against each other and
    # a 0.1 s step takes seconds, missing heartbeats.
    model: str = "tiny"
    device: str = "cpu"
    model_seed: int = 0
    dtype: str | None = None
    torch_threads: int = 0
    # OpenAISettings. `kv_events_*` are also where `flexlb sim-server` publishes vLLM-style
    # events itself; a NATS worker of the sim or torch engine publishes on NATS.
    engine_url: str = ""
    engine_model: str = ""
    engine_protocol: str = "openai"
    engine_prompt: str = "ids"
    upstream_max_concurrency: int = 256
    upstream_stall_timeout_s: float = 60.0
    kv_events_endpoint: str = ""
    kv_events_replay_endpoint: str = ""
    kv_events_topic: str = ""
    engine_max_num_seqs: int = 0  # the server's --max-num-seqs; 0: learned (module docstring)

    def served_model(self) -> str:
        """The model this worker serves and reports (`served_model_name`'s comment)."""
        if self.served_model_name:
            return self.served_model_name
        if self.engine == "torch":
            return os.path.basename(os.path.normpath(self.model))  # a preset's name is its own basename
        if self.engine == "openai":
            return self.engine_model  # learned from the server before registering (prepare_engine)
        return SIM_MODEL_NAME

    def lora_adapter_names(self) -> list[str]:
        """`lora_adapters` as a list (blank entries dropped)."""
        return [name.strip() for name in self.lora_adapters.split(",") if name.strip()]

    def scheduler_settings(self) -> SchedulerSettings:
        return _group(SchedulerSettings, self)

    def sim_settings(self) -> SimSettings:
        adapters = self.lora_adapter_names()
        return SimSettings(profile=self.profile, time_scale=self.time_scale, lora_adapters=adapters,
                           max_loras=self.max_loras or (DEFAULT_MAX_LORAS if adapters else 0),
                           lora_load_ms=self.lora_load_ms)

    def torch_settings(self) -> TorchSettings:
        return _group(TorchSettings, self)

    def openai_settings(self) -> OpenAISettings:
        return _group(OpenAISettings, self)

    def validate(self) -> "WorkerConfig":
        validate_token("worker_id", self.worker_id)
        nats_servers(self.nats_url)
        if not 1 <= self.nats_replicas <= 5:
            raise ValueError(f"nats_replicas must be 1..5 (JetStream's limit), got {self.nats_replicas}")
        if not 0 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port must be 0 (off) or a TCP port, got {self.metrics_port}")
        self.role = m.parse_role(self.role)
        if self.engine not in ENGINES:
            raise ValueError(f"engine {self.engine!r} is not available; known: {', '.join(ENGINES)}")
        for name in ("heartbeat_interval_ms", "max_batch_tokens", "outbound_buffer_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not self.drain_timeout_s >= 0:
            raise ValueError(f"drain_timeout_s must be >= 0 (0: no drain), got {self.drain_timeout_s}")
        for name in ("engine_max_num_seqs", "max_loras"):  # 0: the engine's default (module docstring)
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0: the engine's default), got {getattr(self, name)}")
        # The scheduler's sizes are every worker's report (the openai agent's too).
        self.scheduler_settings().validate()
        if self.engine == "openai":
            self.openai_settings().validate(self.role)
        elif self.engine == "torch":
            self.torch_settings().validate()
        else:
            sim = self.sim_settings()
            sim.validate()
            if self.served_model() in sim.lora_adapters:
                raise ValueError(f"lora_adapters names the served model {self.served_model()!r}: a request's "
                                 "`model` would not say whether it wants the adapter or the base")
        return self


def make_engine(cfg: WorkerConfig) -> Engine:
    """The engine a worker config describes (module docstring)."""
    if cfg.engine == "openai":
        raise ValueError("engine openai has no engine of its own: it forwards to the server at engine_url")
    sched = cfg.scheduler_settings()
    common = dict(role=cfg.role, num_kv_blocks=sched.num_kv_blocks, block_size_tokens=sched.block_size_tokens,
                  max_seq_len_tokens=sched.max_seq_len_tokens, max_num_batched_tokens=sched.max_num_batched_tokens,
                  max_num_seqs=sched.max_num_seqs, chunked_prefill=sched.chunked_prefill, scheduler=sched.scheduler,
                  max_prefill_tokens=sched.max_prefill_tokens)
    if cfg.engine == "torch":
        import torch

        from workers.engines.torch_engine import TorchEngine, load_model

        t = cfg.torch_settings()
        if t.torch_threads:
            torch.set_num_threads(t.torch_threads)
        return TorchEngine(load_model(t.model, device=t.device, seed=t.model_seed, dtype=t.dtype), **common)
    from workers.engines.sim import SimEngine, load_profile

    sim = cfg.sim_settings()
    return SimEngine(profile=load_profile(sim.profile), lora_adapters=sim.lora_adapters, max_loras=sim.max_loras,
                     lora_load_ms=sim.lora_load_ms, **common)
