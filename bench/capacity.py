"""The capacity bound of a trace on a fleet: the most requests per second it could ever sustain.

Pure and offline: a function of the requests (prompt and output lengths, prefix block ids),
the engine's timing profile and limits, and the number of workers. It answers "how far from
the ceiling is a router", so it is deliberately optimistic: every distinct prefix block is
computed ONCE, fleet-wide and forever (an infinite prefix cache shared by all workers), and
the work is spread perfectly evenly over the K workers, with no queueing and no idle time.

The formula (per request i in trace order; n prompt tokens, m = max_tokens output tokens,
c cached tokens; coefficients of the timing profile, `workers/engines/sim.py`):

    c_i        = tokens of i's prompt already computed by an earlier request of the trace
                 (the longest prefix it shares with any earlier prompt), rounded down to whole
                 KV blocks of `block_size_tokens`, and never the whole prompt: the engine
                 always computes the last block of a fully cached prompt, so at most
                 floor((n - 1) / block_size) × block_size tokens are cached
    prefill_i  = (n - c) × (prefill_per_token_ms + prefill_base_ms / max_num_batched_tokens)
                 + prefill_per_token_sq_ms × (n² - c²)
                 (the step's base cost is shared by a full step of max_num_batched_tokens
                 computed tokens)
    decode_i   = Σ_{j=1}^{m-1} [decode_per_seq_ms + decode_base_ms / B
                                + decode_per_context_token_ms × (n + j)]
                 = (m - 1) × (decode_per_seq_ms + decode_base_ms / B)
                   + decode_per_context_token_ms × ((m - 1) × n + m(m - 1)/2)
                 (output token 0 comes out of the prefill step; the step that produces
                 token j sees a context of n + j tokens, as the engine counts it)
    B          = the largest decode batch that fits: min(max_num_seqs, max_num_batched_tokens
                 (each decoding sequence takes one token of the step's budget),
                 floor(num_kv_blocks × block_size_tokens / mean context)), at least 1, where
                 mean context = Σ_i Σ_j (n_i + j) / Σ_i (m_i - 1) is the mean context of a
                 decoding sequence over all decode steps of the trace
    work_i     = prefill_i + decode_i                                        (engine ms)
    bound      = K × 1000 / mean_i(work_i)                                   (req/s)
    multiplier = bound / recorded rate, recorded rate = N / span of the trace's timestamps

Why it is an upper bound, not a prediction: real caches are finite and per worker (a prefix
is recomputed on every worker it lands on, and evicted), a router balances imperfectly and
arrivals are bursty (queues form below the bound), decode batches are rarely as large as B,
prefill steps are rarely full, and no latency target is considered at all: a fleet run at
its bound has unbounded queues, so its TTFT SLO attainment tends to zero well before it.
Two simplifications could make it slightly optimistic or pessimistic at the margin: a step
that mixes prefill chunks and decodes pays one base cost in a vLLM-like engine, whereas the
formula charges prefill and decode tokens their own amortized base; and B ignores the KV
blocks that sequences sharing a prefix share.

A companion figure, `zero_load_slo_fraction`: the share of requests that could meet their SLO
even alone on an idle engine (a ceiling on attainment at any load, however good the router):
    TTFT_0 = ceil((n - c) / max_num_batched_tokens) × prefill_base_ms      (one step per chunk)
             + prefill_per_token_ms × (n - c) + prefill_per_token_sq_ms × (n² - c²)
    TPOT_0 = decode_base_ms + decode_per_seq_ms + decode_per_context_token_ms × (n + m/2)
             (the mean over tokens 1 .. m-1 of a batch of one, context n + j)
and a request is feasible when TTFT_0 ≤ the TTFT target and (m = 1 or TPOT_0 ≤ the TPOT
target). With c from the infinite shared cache it is optimistic; with c = 0, what a cold
cache allows.

Prefix sharing is given per request as `prefix_block_ids`: the Mooncake `hash_ids`,
prefix-chained ids of blocks of `prefix_block_tokens` (512) tokens, so two requests share
their first k blocks exactly when their first k ids are equal. The prompt built from them
(`bench/peers.py`) is the concatenation of one fixed block of text per id, cut to n, so a
block id may appear in a shorter (cut) form first and a longer one later; the bound tracks,
per id, the longest form computed so far. None means the prompt shares nothing.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

PROFILE_KEYS = ("prefill_base_ms", "prefill_per_token_ms", "prefill_per_token_sq_ms", "decode_base_ms",
                "decode_per_seq_ms", "decode_per_context_token_ms")


@dataclass(frozen=True)
class StepCosts:
    """The six coefficients of a timing profile (engine ms); see workers/engines/sim.py."""

    prefill_base_ms: float  # fixed cost of a prefill step
    prefill_per_token_ms: float  # per computed (uncached) prompt token
    prefill_per_token_sq_ms: float  # per (n² - c²) of each request
    decode_base_ms: float  # fixed cost of a decode step
    decode_per_seq_ms: float  # per sequence in the decode batch
    decode_per_context_token_ms: float  # per context token of the decode batch

    @classmethod
    def from_profile(cls, profile: Any) -> "StepCosts":
        """From a `TimingProfile`, or any mapping / object with the six coefficient names."""
        get = profile.__getitem__ if isinstance(profile, Mapping) else lambda k: getattr(profile, k)
        return cls(**{k: float(get(k)) for k in PROFILE_KEYS})

    @classmethod
    def from_file(cls, path: str | Path) -> "StepCosts":
        """From a timing-profile JSON file (workers/profiles/*.json)."""
        return cls.from_profile(json.loads(Path(path).read_text()))


@dataclass(frozen=True)
class EngineLimits:
    """The per-worker engine limits the bound depends on (defaults: the sim engine's)."""

    max_num_batched_tokens: int = 8192  # tokens one step computes: prefill chunks + one per decode
    max_num_seqs: int = 256  # most sequences running at once
    num_kv_blocks: int = 16384  # KV capacity in blocks
    block_size_tokens: int = 16  # tokens per KV block (the prefix cache's granularity)

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "num_kv_blocks", "block_size_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class WorkloadRequest:
    """One request of the trace, as sent (after any prompt cut)."""

    num_prompt_tokens: int
    max_tokens: int  # output tokens (>= 1)
    prefix_block_ids: tuple[int, ...] | None = None  # chained ids of prefix_block_tokens-token blocks


@dataclass(frozen=True)
class RequestWork:
    """The bound's accounting of one request (engine ms)."""

    num_cached_tokens: int
    prefill_ms: float
    decode_ms: float

    @property
    def work_ms(self) -> float:
        return self.prefill_ms + self.decode_ms


@dataclass(frozen=True)
class CapacityBound:
    num_requests: int
    num_workers: int
    num_prompt_tokens: int  # Σ n
    num_cached_tokens: int  # Σ c: computed once fleet-wide, never again
    decode_batch_size: int  # B
    decode_batch_limited_by: str  # "max_num_seqs" | "max_num_batched_tokens" | "kv_cache"
    mean_decode_context_tokens: float | None  # None: no request decodes (all m == 1)
    mean_prefill_ms: float
    mean_decode_ms: float
    mean_work_ms: float
    rate_req_per_s: float  # the bound: K × 1000 / mean_work_ms
    recorded_rate_req_per_s: float | None  # N / span of the trace's timestamps (None: span 0)
    multiplier: float | None  # rate_req_per_s / recorded_rate_req_per_s

    @property
    def reuse(self) -> float:
        """Share of prompt tokens the infinite shared cache serves."""
        return self.num_cached_tokens / self.num_prompt_tokens if self.num_prompt_tokens else 0.0

    def as_dict(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in self.__dataclass_fields__}
        out["reuse"] = self.reuse
        return out


def infinite_cache_hits(requests: Sequence[WorkloadRequest], prefix_block_tokens: int = 512,
                        block_size_tokens: int = 16) -> list[int]:
    """Cached tokens of each request under one infinite cache shared by the whole fleet.

    Walks the request's prefix blocks: block k holds min(prefix_block_tokens, n - k × P)
    tokens of it; an earlier request computed `computed[id]` tokens of that block (the block's
    text is fixed, so a shorter form is a prefix of a longer one). The shared prefix grows by
    min(computed, own) per block and stops at the first block not fully available. Rounded
    down to whole KV blocks, and at most floor((n - 1) / block_size) blocks (the engine
    always computes the last block of a fully cached prompt).
    """
    if prefix_block_tokens <= 0 or block_size_tokens <= 0:
        raise ValueError("prefix_block_tokens and block_size_tokens must be positive")
    computed: dict[int, int] = {}  # block id -> most of its tokens any earlier request computed
    hits = []
    for r in requests:
        n = r.num_prompt_tokens
        if not r.prefix_block_ids:
            hits.append(0)
            continue
        own = [(bid, min(prefix_block_tokens, n - k * prefix_block_tokens))
               for k, bid in enumerate(r.prefix_block_ids) if n - k * prefix_block_tokens > 0]
        shared = 0
        for bid, num_own_tokens in own:
            have = computed.get(bid, 0)
            shared += min(have, num_own_tokens)
            if have < num_own_tokens:
                break
        max_cached = (n - 1) // block_size_tokens * block_size_tokens if n > 0 else 0
        hits.append(min(shared // block_size_tokens * block_size_tokens, max_cached))
        for bid, num_own_tokens in own:
            if computed.get(bid, 0) < num_own_tokens:
                computed[bid] = num_own_tokens
    return hits


def decode_batch_size(requests: Iterable[WorkloadRequest], limits: EngineLimits) -> tuple[int, str, float | None]:
    """B, what limits it, and the mean context of a decoding sequence (see the module docstring)."""
    num_steps = 0  # Σ (m - 1): decode tokens
    sum_context = 0.0  # Σ_i Σ_j (n_i + j)
    for r in requests:
        k = max(0, r.max_tokens - 1)
        num_steps += k
        sum_context += k * r.num_prompt_tokens + k * (k + 1) / 2
    candidates = [(limits.max_num_seqs, "max_num_seqs"), (limits.max_num_batched_tokens, "max_num_batched_tokens")]
    mean_context = None
    if num_steps:
        mean_context = sum_context / num_steps
        kv_tokens = limits.num_kv_blocks * limits.block_size_tokens
        candidates.append((max(1, math.floor(kv_tokens / mean_context)), "kv_cache"))
    size, why = min(candidates, key=lambda c: c[0])  # first listed wins a tie
    return size, why, mean_context


def request_work(r: WorkloadRequest, num_cached_tokens: int, costs: StepCosts, limits: EngineLimits,
                 batch_size: int) -> RequestWork:
    n, c = r.num_prompt_tokens, num_cached_tokens
    prefill = ((n - c) * (costs.prefill_per_token_ms + costs.prefill_base_ms / limits.max_num_batched_tokens)
               + costs.prefill_per_token_sq_ms * (n * n - c * c))
    k = max(0, r.max_tokens - 1)  # decode steps: tokens 1 .. m-1
    decode = (k * (costs.decode_per_seq_ms + costs.decode_base_ms / batch_size)
              + costs.decode_per_context_token_ms * (k * n + k * (k + 1) / 2))
    return RequestWork(num_cached_tokens=c, prefill_ms=prefill, decode_ms=decode)


def capacity_bound(requests: Sequence[WorkloadRequest], costs: StepCosts, limits: EngineLimits, num_workers: int,
                   recorded_span_s: float | None = None, prefix_block_tokens: int = 512) -> CapacityBound:
    """The bound (module docstring) of `requests` in trace order on `num_workers` workers.

    `recorded_span_s`: last minus first timestamp of the trace slice (seconds), for the
    recorded rate N / span and the bound as a multiplier of it.
    """
    if not requests:
        raise ValueError("no requests")
    if num_workers < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    for r in requests:
        if r.num_prompt_tokens < 1 or r.max_tokens < 1:
            raise ValueError(f"prompt and max_tokens must be >= 1: {r}")
    hits = infinite_cache_hits(requests, prefix_block_tokens, limits.block_size_tokens)
    size, why, mean_context = decode_batch_size(requests, limits)
    works = [request_work(r, c, costs, limits, size) for r, c in zip(requests, hits)]
    n = len(works)
    mean_work = sum(w.work_ms for w in works) / n
    rate = num_workers * 1000.0 / mean_work if mean_work > 0 else math.inf
    recorded = n / recorded_span_s if recorded_span_s and recorded_span_s > 0 else None
    return CapacityBound(
        num_requests=n,
        num_workers=num_workers,
        num_prompt_tokens=sum(r.num_prompt_tokens for r in requests),
        num_cached_tokens=sum(hits),
        decode_batch_size=size,
        decode_batch_limited_by=why,
        mean_decode_context_tokens=mean_context,
        mean_prefill_ms=sum(w.prefill_ms for w in works) / n,
        mean_decode_ms=sum(w.decode_ms for w in works) / n,
        mean_work_ms=mean_work,
        rate_req_per_s=rate,
        recorded_rate_req_per_s=recorded,
        multiplier=rate / recorded if recorded else None,
    )


def zero_load_latency_ms(r: WorkloadRequest, num_cached_tokens: int, costs: StepCosts,
                         limits: EngineLimits) -> tuple[float, float | None]:
    """(TTFT_0, TPOT_0) of one request alone on an idle engine (module docstring); TPOT_0 is
    None for a single-token request."""
    n, c, m = r.num_prompt_tokens, num_cached_tokens, r.max_tokens
    num_steps = -(-(n - c) // limits.max_num_batched_tokens)
    ttft = (num_steps * costs.prefill_base_ms + costs.prefill_per_token_ms * (n - c)
            + costs.prefill_per_token_sq_ms * (n * n - c * c))
    if m == 1:
        return ttft, None
    return ttft, costs.decode_base_ms + costs.decode_per_seq_ms + costs.decode_per_context_token_ms * (n + m / 2)


def zero_load_slo_fraction(requests: Sequence[WorkloadRequest], costs: StepCosts, limits: EngineLimits,
                           slo_ttft_ms: float, slo_tpot_ms: float, with_cache: bool = True,
                           prefix_block_tokens: int = 512) -> float:
    """Share of `requests` that meet both targets alone on an idle engine (module docstring);
    `with_cache`: cached tokens from the infinite shared cache, else none."""
    if not requests:
        raise ValueError("no requests")
    hits = (infinite_cache_hits(requests, prefix_block_tokens, limits.block_size_tokens) if with_cache
            else [0] * len(requests))
    feasible = 0
    for r, c in zip(requests, hits):
        ttft, tpot = zero_load_latency_ms(r, c, costs, limits)
        feasible += ttft <= slo_ttft_ms and (tpot is None or tpot <= slo_tpot_ms)
    return feasible / len(requests)
