"""The capacity bound of a workload on a fleet: the most requests per second it could ever sustain.

Pure and offline: a function of the requests (prompt and output lengths, prefix block ids),
the engine's timing profile, scheduler and limits, and the number of workers. It answers "how
far from the ceiling is a router", so it is deliberately optimistic: every distinct prefix
block is computed ONCE, fleet-wide and forever (an infinite prefix cache shared by all
workers), the work is spread perfectly evenly over the K workers with no idle time, every
step is as full as the engine's limits allow, and no latency target is considered. It must
never be below what a fleet sustains: every term below is a LOWER bound on the engine time
the workload needs, so K x 1000 / (work per request) is an upper bound on the rate. It is
checked against the simulated engine (tests/unit/bench/test_capacity.py: random workloads with shared
prefixes, random routings and arrival gaps, both schedulers: the engines never need less time
than the bound charges). One assumption: each engine takes its requests in arrival order, so
a shared prefix is first computed by the earliest request that has it.

Per request i (n prompt tokens, m = max_tokens output tokens, c cached tokens; coefficients
of the timing profile, `workers/engines/sim.py`, which also defines a step's cost):

    c_i   = tokens of i's prompt already computed by an earlier request of the workload (the
            longest prefix it shares with any earlier prompt), rounded down to whole KV
            blocks of `block_size_tokens`, and never the whole prompt: the engine always
            computes the last block of a fully cached prompt, so at most
            floor((n - 1) / block_size) x block_size tokens are cached
    token terms, exact whatever the schedule:
      prefill_i = prefill_per_token_ms x (n - c) + prefill_per_token_sq_ms x (n² - c²)
      decode_i  = Σ_{j=1}^{m-1} [decode_per_seq_ms + decode_per_context_token_ms x (n + j)]
                  (output token 0 comes out of the prefill step; the step producing token j
                  sees a context of n + j tokens, as the engine counts it)

Every step also pays one fixed cost (the weights read once): prefill_base_ms if it computes a
prompt chunk, decode_base_ms if it only decodes. The bound charges the fewest steps the
workload can run in, fleet-wide (Σ over all requests; T = max_num_batched_tokens):

    S_seqs = Σ (m - 1) / max_num_seqs              (a step decodes at most max_num_seqs sequences)
    S_kv   = Σ_i Σ_j (n_i - c_i + j) / KV tokens   (KV tokens = num_kv_blocks x block_size_tokens)

S_kv: the running decodes must fit in the KV cache at every step. A decoding sequence's
blocks beyond its cached prefix (its own prompt part and its output) belong to it alone; the
cached prefix may be shared with other running sequences and is not counted (a lower bound
on the KV in use, so this is an upper bound on the batch).

- scheduler "vllm" (mixed steps: decodes and prompt chunks share a step's budget of T tokens,
  a decoding sequence taking one): S ≥ S_min = max(S_tok, S_seqs, S_kv), with
  S_tok = Σ (n - c + m - 1) / T' (T' = T; without chunked prefill the engine raises its
  budget to max(T, max_seq_len_tokens)), of which at least Σ (n - c) / T' compute chunks:
      base = min(prefill_base, decode_base) x S_min + max(0, prefill_base - decode_base) x Σ (n - c) / T'
  (with the shipped profile, prefill_base < decode_base: every step at the prefill's base)
- scheduler "sglang" (prefill-first: a step is a prefill step or a decode step, never both):
  prefill steps take at most P' = T new tokens (SGLang's chunked_prefill_size; without
  chunking a prompt goes whole: P' = max(max_prefill_tokens, the longest prompt)), and
  decode steps have no token budget:
      base = prefill_base x Σ (n - c) / P' + decode_base x max(S_seqs, S_kv)

    work  = Σ_i (prefill_i + decode_i) + base                               (engine ms)
    bound = K x 1000 x N / work                                              (req/s)
    multiplier = bound / recorded rate, recorded rate = N / span of the workload's timestamps

The bound's `decode_batch_size` is the mean decode batch it allows: Σ (m - 1) over the steps
the decodes need (limited by max_num_seqs, the KV cache, or, vllm, the step's token budget).

Why it is an upper bound, not a prediction: real caches are finite and per worker (a prefix
is recomputed on every worker it lands on, and evicted), a router balances imperfectly,
arrivals are bursty (queues form below the bound), steps are rarely full, and a fleet at its
bound has unbounded queues: with latency targets the sustainable load is lower, well lower
when TPOT binds (a decode batch as large as the KV allows steps slower than a 100 ms TPOT).

Why a slice must be sustained (bench/peers.py): a slice that arrives, at the bound, within a
few request lifetimes is a burst the fleet absorbs in its running batch and drains after the
last arrival, so it passes loads no fleet sustains (tests/unit/bench/test_capacity.py replays such a
slice in virtual time). `slice_lifetimes` is how many mean request lifetimes
(`mean_zero_load_e2e_ms`: alone on an idle engine, cold cache) a slice lasts when it arrives
at the bound; bench/peers.py by default replays about the shortest slice that lasts
`MIN_SLICE_LIFETIMES` (10) of them (`--rows auto`), marks a shorter slice's headlines as a
burst, and flags any headline above the bound (exit status 3). How this was found, with its
figures, and the formula's history: bench/PEERS.md, "The capacity bound".

A companion figure, `zero_load_slo_fraction`: the share of requests that could meet their SLO
even alone on an idle engine (a ceiling on attainment at any load, however good the router):
    TTFT_0 = ceil((n - c) / T) x prefill_base_ms (one step per chunk; without chunked prefill one step)
             + prefill_per_token_ms x (n - c) + prefill_per_token_sq_ms x (n² - c²)
    TPOT_0 = decode_base_ms + decode_per_seq_ms + decode_per_context_token_ms x (n + m/2)
             (the mean over tokens 1 .. m-1 of a batch of one, context n + j)
(the same under both schedulers: alone, a prefill-first engine runs the same steps) and a
request is feasible when TTFT_0 ≤ the TTFT target and (m = 1 or TPOT_0 ≤ the TPOT target).
With c from the infinite shared cache it is optimistic; with c = 0, what a cold cache allows.

Prefix sharing is given per request as `prefix_block_ids`: prefix-chained ids of blocks of
`prefix_block_tokens` tokens, so two requests share their first k blocks exactly when their
first k ids are equal (Mooncake's `hash_ids` of 512 tokens; the chat workload's 16-token
block hashes, bench/workloads.py). A Mooncake prompt is the concatenation of one fixed block
of text per id, cut to n, so a block id may appear in a shorter (cut) form first and a
longer one later; the bound tracks, per id, the longest form computed so far. None means the
prompt shares nothing.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

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


SCHEDULERS = ("vllm", "sglang")  # the sim engine's step schedulers (workers/engines/sim.py)
MIN_SLICE_LIFETIMES = 10.0  # a sustained slice lasts at least this many request lifetimes at the bound


@dataclass(frozen=True)
class EngineLimits:
    """The per-worker engine limits the bound depends on (defaults: the sim engine's)."""

    # tokens one step computes: vllm, prompt chunks + one per decoding sequence; sglang, a prefill step's chunk budget
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256  # most sequences running at once
    num_kv_blocks: int = 16384  # KV capacity in blocks
    block_size_tokens: int = 16  # tokens per KV block (the prefix cache's granularity)
    scheduler: str = "vllm"  # "vllm": mixed steps | "sglang": prefill-first, separate prefill and decode steps
    max_prefill_tokens: int = 16384  # sglang: most new prompt tokens per prefill step (binds without chunking)
    chunked_prefill: bool = True  # False: a prompt runs whole in one step
    max_seq_len_tokens: int = 40960  # vllm without chunking: the step budget becomes max(T, this)

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "num_kv_blocks", "block_size_tokens",
                     "max_prefill_tokens", "max_seq_len_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.scheduler not in SCHEDULERS:
            raise ValueError(f"scheduler must be one of {', '.join(SCHEDULERS)}, got {self.scheduler!r}")


@dataclass(frozen=True)
class WorkloadRequest:
    """One request of the workload, as sent (after any prompt cut)."""

    num_prompt_tokens: int
    max_tokens: int  # output tokens (>= 1)
    prefix_block_ids: tuple[int, ...] | None = None  # chained ids of prefix_block_tokens-token blocks


@dataclass(frozen=True)
class CapacityBound:
    num_requests: int
    num_workers: int
    scheduler: str  # the engine's step scheduler the bound was computed for
    num_prompt_tokens: int  # Σ n
    num_cached_tokens: int  # Σ c: computed once fleet-wide, never again
    decode_batch_size: float  # the mean decode batch the bound allows: Σ (m - 1) / decode steps
    decode_batch_limited_by: str  # "max_num_seqs" | "max_num_batched_tokens" | "kv_cache" | "none" (nothing decodes)
    mean_decode_context_tokens: float | None  # mean context of a decode step's sequence; None: nothing decodes
    mean_decode_kv_tokens: float | None  # the same beyond the cached prefix (what the KV limit counts)
    num_steps: float  # fewest steps, fleet-wide (vllm: all steps; sglang: prefill + decode steps)
    mean_prefill_ms: float  # per request: the prefill's token terms (no step base)
    mean_decode_ms: float  # per request: the decode's token terms (no step base)
    mean_step_base_ms: float  # per request: its share of the steps' fixed costs
    mean_work_ms: float  # the sum of the three
    rate_req_per_s: float  # the bound: K x 1000 / mean_work_ms
    recorded_rate_req_per_s: float | None  # N / span of the trace's timestamps (None: span 0)
    multiplier: float | None  # rate_req_per_s / recorded_rate_req_per_s
    serve_fraction: float = 1.0  # the share of the requests a router must serve (the target); below 1, see capacity_bound

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


@dataclass(frozen=True)
class DecodeSteps:
    """The fewest steps the decodes need (fleet-wide) and what limits them."""

    num_decode_tokens: int  # Σ (m - 1)
    num_steps: float  # max over the limits below (0 when nothing decodes)
    limited_by: str  # "max_num_seqs" | "max_num_batched_tokens" | "kv_cache" | "none"
    sum_context_tokens: float  # Σ_i Σ_j (n_i + j)
    sum_kv_tokens: float  # Σ_i Σ_j (n_i - c_i + j)

    @property
    def batch_size(self) -> float:
        return self.num_decode_tokens / self.num_steps if self.num_steps else 0.0


def decode_steps(requests: Sequence[WorkloadRequest], hits: Sequence[int], limits: EngineLimits) -> DecodeSteps:
    """S_seqs, S_kv and (vllm) the token budget's Σ (m - 1) / T: the module docstring's decode limits."""
    num_tokens = 0
    sum_context = sum_kv = 0.0
    for r, c in zip(requests, hits, strict=True):
        k = max(0, r.max_tokens - 1)
        num_tokens += k
        sum_context += k * r.num_prompt_tokens + k * (k + 1) / 2
        sum_kv += k * (r.num_prompt_tokens - c) + k * (k + 1) / 2
    if not num_tokens:
        return DecodeSteps(0, 0.0, "none", 0.0, 0.0)
    candidates = [(num_tokens / limits.max_num_seqs, "max_num_seqs")]
    if limits.scheduler == "vllm":
        candidates.append((num_tokens / step_token_budget(limits), "max_num_batched_tokens"))
    candidates.append((sum_kv / (limits.num_kv_blocks * limits.block_size_tokens), "kv_cache"))
    steps, why = max(candidates, key=lambda c: c[0])  # first listed wins a tie
    return DecodeSteps(num_tokens, steps, why, sum_context, sum_kv)


def step_token_budget(limits: EngineLimits, longest_prompt_tokens: int = 0) -> int:
    """Most prompt tokens one step computes: vllm, T (without chunking max(T, max_seq_len));
    sglang, the chunk budget T (without chunking a prompt goes whole: max(max_prefill_tokens,
    the longest prompt))."""
    if limits.chunked_prefill:
        return limits.max_num_batched_tokens
    if limits.scheduler == "vllm":
        return max(limits.max_num_batched_tokens, limits.max_seq_len_tokens)
    return max(limits.max_prefill_tokens, longest_prompt_tokens)


def capacity_bound(requests: Sequence[WorkloadRequest], costs: StepCosts, limits: EngineLimits, num_workers: int,
                   recorded_span_s: float | None = None, prefix_block_tokens: int = 512,
                   serve_fraction: float = 1.0) -> CapacityBound:
    """The bound (module docstring) of `requests` in arrival order on `num_workers` workers.

    `recorded_span_s`: last minus first timestamp of the slice (seconds), for the recorded
    rate N / span and the bound as a multiplier of it.

    `serve_fraction` f < 1: the target asks only that a share f of the requests attain, so a
    router may refuse the rest, at no engine cost, and it would refuse the costliest. The
    bound is then K x 1000 x N / W_f, W_f = the sum of the ceil(f N) smallest per-request
    lower bounds w_i = prefill_i + decode_i + base_i, where base_i is the request's share of
    one additive step count (vllm: min(prefill_base, decode_base) x (n - c + m - 1) / T' +
    max(0, prefill_base - decode_base) x (n - c) / T'; sglang: prefill_base x (n - c) / P' +
    decode_base x (m - 1) / max_num_seqs). Every subset S of that size needs at least
    Σ_S w_i (each step count is at least each of its additive terms), so this is still an
    upper bound; c_i stays the hit against the whole workload (a refused request's prefix
    counted as cached: optimistic, as a bound must be).
    """
    if not requests:
        raise ValueError("no requests")
    if not 0 < serve_fraction <= 1:
        raise ValueError(f"serve_fraction must be in (0, 1], got {serve_fraction}")
    if num_workers < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    for r in requests:
        if r.num_prompt_tokens < 1 or r.max_tokens < 1:
            raise ValueError(f"prompt and max_tokens must be >= 1: {r}")
    hits = infinite_cache_hits(requests, prefix_block_tokens, limits.block_size_tokens)
    n_req = len(requests)
    computed = sum(r.num_prompt_tokens - c for r, c in zip(requests, hits))
    prefill = sum(costs.prefill_per_token_ms * (r.num_prompt_tokens - c)
                  + costs.prefill_per_token_sq_ms * (r.num_prompt_tokens ** 2 - c * c) for r, c in zip(requests, hits))
    dec = decode_steps(requests, hits, limits)
    decode = (costs.decode_per_seq_ms * dec.num_decode_tokens
              + costs.decode_per_context_token_ms * dec.sum_context_tokens)
    budget = step_token_budget(limits, max(r.num_prompt_tokens for r in requests))
    prefill_steps = computed / budget
    if limits.scheduler == "vllm":
        num_steps = max((computed + dec.num_decode_tokens) / budget, dec.num_steps)
        base = (min(costs.prefill_base_ms, costs.decode_base_ms) * num_steps
                + max(0.0, costs.prefill_base_ms - costs.decode_base_ms) * prefill_steps)
    else:
        num_steps = prefill_steps + dec.num_steps
        base = costs.prefill_base_ms * prefill_steps + costs.decode_base_ms * dec.num_steps
    work = prefill + decode + base
    rate = num_workers * 1000.0 * n_req / work if work > 0 else math.inf
    if serve_fraction < 1:
        cheapest = _cheapest_work(requests, hits, costs, limits, budget, serve_fraction)
        rate = num_workers * 1000.0 * n_req / cheapest if cheapest > 0 else math.inf
    recorded = n_req / recorded_span_s if recorded_span_s and recorded_span_s > 0 else None
    return CapacityBound(
        num_requests=n_req,
        num_workers=num_workers,
        scheduler=limits.scheduler,
        num_prompt_tokens=sum(r.num_prompt_tokens for r in requests),
        num_cached_tokens=sum(hits),
        decode_batch_size=dec.batch_size,
        decode_batch_limited_by=dec.limited_by,
        mean_decode_context_tokens=dec.sum_context_tokens / dec.num_decode_tokens if dec.num_decode_tokens else None,
        mean_decode_kv_tokens=dec.sum_kv_tokens / dec.num_decode_tokens if dec.num_decode_tokens else None,
        num_steps=num_steps,
        mean_prefill_ms=prefill / n_req,
        mean_decode_ms=decode / n_req,
        mean_step_base_ms=base / n_req,
        mean_work_ms=work / n_req,
        rate_req_per_s=rate,
        recorded_rate_req_per_s=recorded,
        multiplier=rate / recorded if recorded else None,
        serve_fraction=serve_fraction,
    )


def _cheapest_work(requests: Sequence[WorkloadRequest], hits: Sequence[int], costs: StepCosts, limits: EngineLimits,
                   budget: int, serve_fraction: float) -> float:
    """W_f of capacity_bound's docstring: the least engine time any ceil(f N) of the requests need."""
    low, high = min(costs.prefill_base_ms, costs.decode_base_ms), max(0.0, costs.prefill_base_ms - costs.decode_base_ms)
    per_request = []
    for r, c in zip(requests, hits, strict=True):
        n, k, computed = r.num_prompt_tokens, max(0, r.max_tokens - 1), r.num_prompt_tokens - c
        w = (costs.prefill_per_token_ms * computed + costs.prefill_per_token_sq_ms * (n * n - c * c)
             + costs.decode_per_seq_ms * k + costs.decode_per_context_token_ms * (k * n + k * (k + 1) / 2))
        if limits.scheduler == "vllm":
            w += low * (computed + k) / budget + high * computed / budget
        else:
            w += costs.prefill_base_ms * computed / budget + costs.decode_base_ms * k / limits.max_num_seqs
        per_request.append(w)
    per_request.sort()
    return sum(per_request[:math.ceil(serve_fraction * len(per_request))])


def zero_load_latency_ms(r: WorkloadRequest, num_cached_tokens: int, costs: StepCosts,
                         limits: EngineLimits) -> tuple[float, float | None]:
    """(TTFT_0, TPOT_0) of one request alone on an idle engine (module docstring); TPOT_0 is
    None for a single-token request."""
    n, c, m = r.num_prompt_tokens, num_cached_tokens, r.max_tokens
    num_steps = -(-(n - c) // limits.max_num_batched_tokens) if limits.chunked_prefill else 1
    ttft = (num_steps * costs.prefill_base_ms + costs.prefill_per_token_ms * (n - c)
            + costs.prefill_per_token_sq_ms * (n * n - c * c))
    if m == 1:
        return ttft, None
    return ttft, costs.decode_base_ms + costs.decode_per_seq_ms + costs.decode_per_context_token_ms * (n + m / 2)


def mean_zero_load_e2e_ms(requests: Sequence[WorkloadRequest], costs: StepCosts, limits: EngineLimits) -> float:
    """A request's mean lifetime alone on an idle engine, cold cache: TTFT_0 + (m - 1) x TPOT_0."""
    if not requests:
        raise ValueError("no requests")
    total = 0.0
    for r in requests:
        ttft, tpot = zero_load_latency_ms(r, 0, costs, limits)
        total += ttft + (r.max_tokens - 1) * (tpot or 0.0)
    return total / len(requests)


def slice_lifetimes(requests: Sequence[WorkloadRequest], bound: CapacityBound, costs: StepCosts,
                    limits: EngineLimits) -> float:
    """How many mean request lifetimes (`mean_zero_load_e2e_ms`) the slice lasts when its N
    requests arrive at the bound for serving every one of them (N x mean work / K, whatever
    the bound's `serve_fraction`): (N / bound) / lifetime. Below MIN_SLICE_LIFETIMES a run near
    the bound is a burst, not a sustained load (module docstring)."""
    slice_ms = bound.num_requests * bound.mean_work_ms / bound.num_workers
    return slice_ms / mean_zero_load_e2e_ms(requests, costs, limits)


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
