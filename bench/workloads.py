"""The benchmarks' workloads, in one place: which requests arrive when, with which prompt.

    from bench.workloads import load_workload
    rows = load_workload("chat", start_row=0, rows=400, max_prompt_tokens=32000, seed=0)
    rows[3].ts_ms, rows[3].input_length, rows[3].max_tokens, rows[3].prompt(), rows[3].block_hashes(16)

`load_workload(name, start_row, rows, max_prompt_tokens=32000, seed=0, chat=None) -> list[Row]`
returns the requests `start_row .. start_row + rows - 1` of a workload in arrival order, with
`ts_ms` relative to the first returned one. A `Row` carries the arrival time (trace ms, before
any rate multiplier), the prompt length as sent, `max_tokens`, its request id, and the prompt
text on demand (`prompt()`, built deterministically: one printable ASCII character is one token
of the byte-level tokenizer, schemas/tokens.py, for every router alike) and its chained block
hashes (`block_hashes(16)`: `schemas.tokens.block_hashes` of the prompt's bytes, what the
engines' prefix caches and FlexLB's index key blocks by). `prefix_block_ids` /
`prefix_block_tokens` describe the prefix sharing to bench/capacity.py (`workload_requests`).

Workloads (`name`; the data files are read from ../shared/data, never copied):
- `mooncake` (mooncake_synthetic_trace.jsonl): each hash id expands to a fixed block of 512
  printable characters (random.Random(hash_id)), concatenated and cut to the row's
  input_length, so prefix sharing is exact. Prompts longer than `max_prompt_tokens` are cut
  to it (`recorded_input_length` keeps the trace's length).
- `azure-conv`, `azure-code` (the Azure 2023 CSVs): no prefix information; each row's prompt
  is random printable text seeded by its row index.
- a path to a file of either format.
  These three are exactly what bench/peers.py replayed before this module existed (same
  rows, prompts and request ids `row-NNNNN`; tests/unit/bench/test_workloads.py pins them), so old
  results stay comparable. `seed` and `chat` do not apply to them (a ValueError if given).
- `chat`: a synthetic multi-turn chat with shared system prompts (`ChatParams`, below).
- `long-conv`: long-prompt multi-turn conversations, Mooncake-like (`LONG_CONV`, below): the
  same generator as `chat` with other parameters.
`CHAT_WORKLOADS` maps the generated ones (the chat family) to their `ChatParams`; for them a
`chat=` argument replaces those parameters.

The chat workload. Tenants (`num_tenants`, 4) each have a system prompt of a length drawn
uniformly from `system_prompt_tokens` (1000-4000). Sessions start as a Poisson process of
`session_rate_per_s` (0.5) sessions per second; each picks a tenant uniformly. A session's
turn k sends the whole history again:

    prompt(k) = system prompt + user(0) + answer(0) + ... + user(k-1) + answer(k-1) + user(k)

so turn k's prompt starts with turn k-1's prompt followed by answer(k-1). The lengths of
user(k) and answer(k) are one row of ../shared/data/sharegpt_8k_filtered_stats_llama2_tokenizer.csv
(`num_prefill_tokens`, `num_decode_tokens`), drawn per turn; max_tokens = the answer's length.
After each turn the user leaves with probability 1 / `mean_turns` (4): geometric, mean 4
turns. The session also ends when the next prompt would exceed `max_prompt_tokens` (32000:
the history no longer fits; nothing is cut). Arrivals: turn 0 at the session's start; turn
k+1 when answer(k) would have finished at a nominal `nominal_ms_per_token` (50 ms per output
token, from turn k's arrival) plus a think time, exponential with mean `mean_think_s` (20 s).
The stream is every session's turns sorted by arrival (ties: by session, then turn); `rows`
requests from `start_row` are taken from it, and it is the same stream whatever `rows` is (a
longer slice extends a shorter one). Everything is deterministic by `seed`: the arrival
process, each session's draws and each piece of text (random.Random seeded by strings of
`seed`, the piece's kind, session and turn). Request ids: `chat-sSSSSS-tTT`.

Like every trace here, a rate multiplier divides every timestamp (bench/peers.py), think
times and the nominal answer time included: at ×2 a user thinks half as long. Open loop:
a next turn is sent on schedule even if the previous answer is late (a closed loop would
hide an overloaded router behind slower users).

What prefix reuse the chat workload really offers. The answer text in a turn's history is
filler of the answer's length seeded by (session, turn), not the text the engine generated
for that request (it is not known in advance; the sim engine's answers are a function of
the request id, workers/engines/sim.py `sim_token_id`, and routers may rename requests). So
the prefix that turn k+1 shares with earlier requests is exactly turn k's whole prompt (the
system prompt and every earlier user message and filler answer); the engine computed and
cached those blocks when it ran turn k's prompt, and the rest of turn k+1 (the filler answer
and the new user message) is new to every cache. This is what a real engine offers too
when it caches prompt blocks only (the sim engine registers prompt blocks, not generated
ones, in its cache: with the real answer in the history the blocks holding it would be
recomputed all the same). Across sessions, the tenant's system prompt is shared. The
unbounded-cache reuse (`prefix_reuse`: the share of prompt tokens a cache of infinite size,
shared by the whole fleet, would serve) is reported by bench/peers.py in the run's facts.
Rows 0-1999 of `chat` (seed 0): 1.70 req/s recorded, input mean 11090 / p50 9351 / p99
29959 tokens, output mean 439, 3.87 turns per session, prefix reuse 0.763 (0.557 among
turn-0 prompts: the system prompts are 26 % of all prompt tokens), 78 % of prompts <= 16000.

The long-conv workload (`LONG_CONV`): long-prompt conversations like the Mooncake
conversation trace (FAST'25: mean input ~12k tokens, mean output ~343, multi-turn, little
sharing across sessions). That trace's text is not public, so the workload is generated from
the public statistics of such traces: long prompts, multi-turn sessions, little cross-session
sharing. It is the chat generator with four more knobs, whose defaults leave `chat` as it
was (same draws, same stream):
- `session_context_tokens` (2000-10000, uniform per session): each session's own document,
  unique to it, placed right after the tenant's system prompt in every turn:

      prompt(k) = system prompt + context + user(0) + answer(0) + ... + user(k)

  (so turn k+1 still starts with turn k's whole prompt); its length and text come from
  streams of their own (random.Random seeded by `seed`, "context-length" / "context" and the
  session), not from the session's stream;
- `max_user_tokens` (2000): a user message is min(ShareGPT num_prefill_tokens, 2000) (the
  documents are the context; ShareGPT's long user messages would dwarf them);
- `max_session_prompt_tokens` (16000): a session ends before a prompt would exceed
  min(16000, max_prompt_tokens), so that nearly every request can meet a 2 s TTFT alone on an
  idle engine (the profile's prefill_ms ≈ 26.45 + 0.06414·p + 3.635e-6·p² for p uncached
  tokens: 1983 ms at p = 16000);
- `request_id_prefix` ("lconv"): request ids `lconv-sSSSSS-tTT`.
The rest: 4 tenants with short system prompts (200-600 tokens: the only cross-session
sharing), answers from ShareGPT's num_decode_tokens as in chat, mean 3 turns (geometric),
mean think time 20 s, and 0.75 sessions per second: the 16000-token cap ends some sessions
early, leaving ~2.6 turns a session, so the stream settles at ~1.9 req/s, as chat's 0.5
sessions/s × ~3.9 turns does: the same multiplier loads both alike (rows 0-1999, 4 engines,
vllm mode, the default profile: capacity bounds of 2.36 req/s for chat, 2.40 for long-conv).
Rows 0-1999 (seed 0): 1.81 req/s recorded (rows 0-399: 1.53; chat's: 1.29), input mean 9570 /
p50 9590 / p99 15674 / max 15986 tokens (the 16000 cap keeps the mean below Mooncake's 12k),
output mean 441, 2.56 turns per session, prefix reuse 0.579 with an unbounded cache (within
sessions: each turn re-sends the previous prompt; 0.056 among turn-0 prompts, where the system
prompts are all that is shared: 4.6 % of all prompt tokens), 100 % of prompts <= 16000 tokens;
alone on an idle engine (bench/capacity.py `zero_load_slo_fraction`, 2 s TTFT and 100 ms TPOT,
the default profile and engine limits) all meet the SLO with the infinite cache, 99.8 % cold.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import heapq
import json
import random
import re
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Protocol

from bench.capacity import WorkloadRequest, infinite_cache_hits
from schemas.tokens import ROOT_DIGEST, block_hashes, chain_block_hashes

REPO = Path(__file__).resolve().parent.parent
DATA = REPO.parent / "shared" / "data"
TRACES = {
    "mooncake": DATA / "mooncake_synthetic_trace.jsonl",
    "azure-conv": DATA / "AzureLLMInferenceTrace_conv_2023.csv",
    "azure-code": DATA / "AzureLLMInferenceTrace_code_2023.csv",
}
SHAREGPT_LENGTHS = DATA / "sharegpt_8k_filtered_stats_llama2_tokenizer.csv"
WORKLOADS = (*TRACES, "chat", "long-conv")  # CHAT_WORKLOADS (below) are the generated ones
HASH_BLOCK_TOKENS = 512  # tokens (= characters) per Mooncake hash id
PRINTABLE = "".join(chr(c) for c in range(32, 127))  # one byte, one token each
DEFAULT_MAX_PROMPT_TOKENS = 32000  # FlexLB refuses more than 32768


class PromptSource(Protocol):
    """Builds a row's prompt text (and may cache what rows share)."""

    def prompt(self, row: "Row") -> str: ...

    def block_hashes(self, row: "Row", block_size_tokens: int) -> list[int]: ...


@dataclass(frozen=True)
class Row:
    """One request of a workload."""

    row: int  # traces: the data row in the file (from 0); chat, long-conv: the position in the generated stream
    request_id: str  # traces: row-NNNNN; chat: chat-sSSSSS-tTT; long-conv: lconv-sSSSSS-tTT
    ts_ms: float  # arrival relative to the first row of the slice (trace ms, before any rate multiplier)
    recorded_input_length: int  # prompt tokens in the trace (chat: as sent)
    input_length: int  # prompt tokens as sent: min(recorded, max_prompt_tokens)
    max_tokens: int  # output tokens: max(1, output length)
    # Prefix sharing for bench/capacity.py: chained ids of prefix_block_tokens-token blocks
    # (Mooncake: its hash_ids of 512 tokens; chat: the 16-token block hashes); None: none.
    prefix_block_ids: tuple[int, ...] | None = field(default=None, repr=False)
    prefix_block_tokens: int = HASH_BLOCK_TOKENS
    session: int | None = None  # chat: the session; traces: None
    turn: int | None = None  # chat: the turn within the session, from 0
    source: PromptSource | None = field(default=None, repr=False, compare=False)

    @property
    def hash_ids(self) -> tuple[int, ...] | None:
        """Mooncake's hash ids (512-token blocks); None for every other workload."""
        return self.prefix_block_ids if self.prefix_block_tokens == HASH_BLOCK_TOKENS else None

    def prompt(self) -> str:
        """The prompt text: input_length printable ASCII characters (= tokens)."""
        if self.source is None:
            raise ValueError(f"{self.request_id}: a row without a prompt source")
        return self.source.prompt(self)

    def block_hashes(self, block_size_tokens: int = 16) -> list[int]:
        """`schemas.tokens.block_hashes` of the prompt's bytes: the chained hashes of its full
        blocks, as the engines and FlexLB's prefix index compute them."""
        if self.source is None:
            raise ValueError(f"{self.request_id}: a row without a prompt source")
        return self.source.block_hashes(self, block_size_tokens)


def load_workload(name: str, start_row: int = 0, rows: int = 200, max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS,
                  seed: int = 0, chat: "ChatParams | None" = None) -> list[Row]:
    """Requests `start_row .. start_row + rows - 1` of workload `name` (module docstring), in
    arrival order, `ts_ms` relative to the first. `seed` and `chat` apply to the chat family
    only (`CHAT_WORKLOADS`: `chat`, `long-conv`); `chat` replaces the workload's own params."""
    if start_row < 0 or rows < 1:
        raise ValueError(f"start_row must be >= 0 and rows >= 1, got {start_row}, {rows}")
    if max_prompt_tokens < 1:
        raise ValueError(f"max_prompt_tokens must be >= 1, got {max_prompt_tokens}")
    if name in CHAT_WORKLOADS:
        return load_chat(chat or CHAT_WORKLOADS[name], start_row, rows, max_prompt_tokens, seed)
    if seed != 0 or chat is not None:
        raise ValueError(f"seed and chat parameters apply to the chat workloads ({', '.join(CHAT_WORKLOADS)}), "
                         f"not to {name!r}")
    return load_trace(resolve_trace(name)[1], start_row, rows, max_prompt_tokens)


def resolve_trace(name_or_path: str) -> tuple[str, Path]:
    """A trace name (mooncake, azure-conv, azure-code) or a path (relative: to the repo root
    when it does not exist from here) -> (name, absolute path)."""
    if name_or_path in TRACES:
        return name_or_path, TRACES[name_or_path].resolve()
    p = Path(name_or_path)
    p = p if p.is_absolute() or p.exists() else REPO / p
    if not p.is_file():
        raise ValueError(f"unknown workload {name_or_path!r}: not one of {', '.join(WORKLOADS)} and no such file")
    return p.stem, p.resolve()


def workload_requests(rows: list[Row]) -> tuple[list[WorkloadRequest], int]:
    """The rows as bench/capacity.py requests, and their prefix block size in tokens."""
    sizes = {r.prefix_block_tokens for r in rows if r.prefix_block_ids}
    if len(sizes) > 1:
        raise ValueError(f"rows mix prefix block sizes {sorted(sizes)}")
    size = sizes.pop() if sizes else HASH_BLOCK_TOKENS
    return [WorkloadRequest(r.input_length, r.max_tokens, r.prefix_block_ids) for r in rows], size


def prefix_reuse(rows: list[Row], block_size_tokens: int = 16) -> float:
    """Share of prompt tokens an infinite prefix cache shared by the whole fleet would serve
    (bench/capacity.py `infinite_cache_hits`, in whole KV blocks of `block_size_tokens`)."""
    requests, prefix_block_tokens = workload_requests(rows)
    hits = infinite_cache_hits(requests, prefix_block_tokens, block_size_tokens)
    total = sum(r.num_prompt_tokens for r in requests)
    return sum(hits) / total if total else 0.0


# --------------------------------------------------------------------------- the traces
def _azure_ts_ms(text: str) -> float:
    """'2023-11-16 18:15:46.6805900' (7 fractional digits) -> epoch ms."""
    date, _, frac = text.strip().partition(".")
    base = datetime.strptime(date, "%Y-%m-%d %H:%M:%S").timestamp()
    return (base + (float("0." + frac) if frac else 0.0)) * 1000.0


class TracePrompts:
    """Mooncake: hash id -> its fixed 512-character block (cached: shared prefixes repeat);
    Azure: random printable text seeded by the row index."""

    def __init__(self) -> None:
        self.blocks: dict[int, str] = {}

    def block(self, hash_id: int) -> str:
        b = self.blocks.get(hash_id)
        if b is None:
            b = "".join(random.Random(hash_id).choices(PRINTABLE, k=HASH_BLOCK_TOKENS))
            self.blocks[hash_id] = b
        return b

    def prompt(self, row: Row) -> str:
        n = row.input_length
        if row.prefix_block_ids is None:
            return "".join(random.Random(row.row).choices(PRINTABLE, k=n))
        need = -(-n // HASH_BLOCK_TOKENS)
        if need > len(row.prefix_block_ids):
            raise ValueError(f"row {row.row}: input_length {n} exceeds {len(row.prefix_block_ids)} hash blocks")
        return "".join(self.block(h) for h in row.prefix_block_ids[:need])[:n]

    def block_hashes(self, row: Row, block_size_tokens: int) -> list[int]:
        return block_hashes(list(self.prompt(row).encode()), block_size_tokens)


def load_trace(path: Path, start: int, count: int, max_prompt_tokens: int) -> list[Row]:
    """Rows of a Mooncake JSONL or Azure CSV file (module docstring)."""
    source = TracePrompts()
    raw: list[tuple[int, float, int, int, tuple[int, ...] | None]] = []  # row, ts, n, output, hash ids
    if path.suffix == ".jsonl":
        with open(path) as fh:
            for i, line in enumerate(fh):
                if i < start or not line.strip():
                    continue
                if len(raw) >= count:
                    break
                r = json.loads(line)
                raw.append((i, float(r["timestamp"]), int(r["input_length"]), int(r["output_length"]),
                            tuple(r["hash_ids"])))
    else:
        with open(path, newline="") as fh:
            for i, r in enumerate(csv.DictReader(fh)):
                if i < start:
                    continue
                if len(raw) >= count:
                    break
                raw.append((i, _azure_ts_ms(r["TIMESTAMP"]), max(1, int(r["ContextTokens"])),
                            int(r["GeneratedTokens"]), None))
    t0 = raw[0][1] if raw else 0.0
    return [Row(row=i, request_id=f"row-{i:05d}", ts_ms=ts - t0, recorded_input_length=n,
                input_length=min(n, max_prompt_tokens), max_tokens=max(1, out), prefix_block_ids=ids,
                prefix_block_tokens=HASH_BLOCK_TOKENS, source=source)
            for i, ts, n, out, ids in raw]


# --------------------------------------------------------------------------- chat
@dataclass(frozen=True)
class ChatParams:
    """The chat family's knobs (module docstring); the defaults are what `chat` means,
    `LONG_CONV` is `long-conv`. The last four fields' defaults change nothing (no context, no
    cap, the `chat-` ids): `chat` is the same stream as before they existed."""

    num_tenants: int = 4
    system_prompt_tokens: tuple[int, int] = (1000, 4000)  # each tenant's length: uniform in [lo, hi]
    session_rate_per_s: float = 0.5  # Poisson session starts per second (before any rate multiplier)
    mean_turns: float = 4.0  # geometric: after each turn the user leaves with probability 1 / mean_turns
    mean_think_s: float = 20.0  # exponential think time between an answer's nominal end and the next turn
    nominal_ms_per_token: float = 50.0  # the answer's nominal speed, for the next turn's arrival
    lengths_path: Path = SHAREGPT_LENGTHS  # user / answer lengths: num_prefill_tokens / num_decode_tokens
    # each session's own context (a document: shared with no other session), after the system
    # prompt in every turn; its length uniform in [lo, hi] per session; (0, 0): none
    session_context_tokens: tuple[int, int] = (0, 0)
    max_user_tokens: int = 0  # a user message: min(num_prefill_tokens, this); 0: no cap
    # a session ends before a prompt would exceed min(this, max_prompt_tokens); 0: max_prompt_tokens
    max_session_prompt_tokens: int = 0
    request_id_prefix: str = "chat"  # request ids <prefix>-sSSSSS-tTT

    def __post_init__(self) -> None:
        lo, hi = self.system_prompt_tokens
        problems = []
        if self.num_tenants < 1:
            problems.append(f"num_tenants must be >= 1, got {self.num_tenants}")
        if not 1 <= lo <= hi:
            problems.append(f"system_prompt_tokens must be 1 <= lo <= hi, got {self.system_prompt_tokens}")
        if self.session_rate_per_s <= 0:
            problems.append(f"session_rate_per_s must be > 0, got {self.session_rate_per_s}")
        if self.mean_turns < 1:
            problems.append(f"mean_turns must be >= 1, got {self.mean_turns}")
        if self.mean_think_s < 0 or self.nominal_ms_per_token < 0:
            problems.append("mean_think_s and nominal_ms_per_token must be >= 0")
        context = self.session_context_tokens
        if len(context) != 2 or not 0 <= context[0] <= context[1]:
            problems.append(f"session_context_tokens must be 0 <= lo <= hi, got {context}")
        if self.max_user_tokens < 0:
            problems.append(f"max_user_tokens must be >= 0 (0: no cap), got {self.max_user_tokens}")
        if self.max_session_prompt_tokens < 0:
            problems.append(f"max_session_prompt_tokens must be >= 0 (0: max_prompt_tokens alone), "
                            f"got {self.max_session_prompt_tokens}")
        if not isinstance(self.request_id_prefix, str) or not re.fullmatch(r"[A-Za-z0-9_.-]+", self.request_id_prefix):
            problems.append(f"request_id_prefix must be letters, digits, '_', '.' or '-' (at least one), "
                            f"got {self.request_id_prefix!r}")
        if problems:
            raise ValueError("; ".join(problems))

    def prompt_limit(self, max_prompt_tokens: int) -> int:
        """The longest prompt a session may send: min(max_session_prompt_tokens, max_prompt_tokens)."""
        return min(self.max_session_prompt_tokens or max_prompt_tokens, max_prompt_tokens)


# `long-conv` (module docstring): long-prompt conversations, Mooncake-like.
LONG_CONV = ChatParams(
    num_tenants=4,
    system_prompt_tokens=(200, 600),  # short: the only thing sessions share
    session_rate_per_s=0.75,  # ~2.6 turns a session (the cap ends some): ~1.9 req/s, as chat's 0.5 x ~3.9
    mean_turns=3.0,
    mean_think_s=20.0,
    session_context_tokens=(2000, 10000),
    max_user_tokens=2000,
    max_session_prompt_tokens=16000,  # a 16000-token prefill alone: ~1.98 s, within a 2 s TTFT
    request_id_prefix="lconv",
)
# The generated workloads, by name: what `load_workload` uses when no `chat=` is given.
CHAT_WORKLOADS: dict[str, ChatParams] = {"chat": ChatParams(), "long-conv": LONG_CONV}


def chat_params_of(name: str) -> ChatParams | None:
    """The parameters of a chat-family workload (`CHAT_WORKLOADS`); None for a trace or a path."""
    return CHAT_WORKLOADS.get(name)


@functools.lru_cache(maxsize=4)
def sharegpt_lengths(path: Path = SHAREGPT_LENGTHS) -> tuple[tuple[int, int], ...]:
    """(user message tokens, answer tokens) per ShareGPT row: num_prefill_tokens (at least 1),
    num_decode_tokens (at least 1)."""
    with open(path, newline="") as fh:
        out = tuple((max(1, int(r["num_prefill_tokens"])), max(1, int(r["num_decode_tokens"])))
                    for r in csv.DictReader(fh))
    if not out:
        raise ValueError(f"{path}: no rows")
    return out


@dataclass(frozen=True)
class ChatSession:
    """One generated session: its tenant and the (user, answer) lengths of its turns."""

    session: int
    tenant: int
    start_ms: float
    turn_lengths: tuple[tuple[int, int], ...]  # per turn sent: (user message tokens, answer tokens)
    turn_ts_ms: tuple[float, ...]  # per turn sent: arrival (ms from the first session's start)
    context_tokens: int = 0  # the session's own context, after the system prompt in every turn


class ChatPrompts:
    """The chat family's text: system prompts, session contexts, user messages and filler
    answers, each a deterministic piece seeded by (seed, kind, session, turn); a prompt is
    their concatenation.
    Block hashes of a session's turn extend those of its previous turn (the prompt does)."""

    def __init__(self, params: ChatParams, seed: int, sessions: dict[int, ChatSession],
                 system_lengths: list[int]) -> None:
        self.params, self.seed, self.sessions, self.system_lengths = params, seed, sessions, system_lengths
        self._pieces: dict[tuple[str, int, int], str] = {}
        # (session, block size) -> (turn, full-block hashes of its prompt, digest of the last one)
        self._chains: dict[tuple[int, int], tuple[int, list[int], bytes]] = {}

    def piece(self, kind: str, session: int, turn: int, length: int) -> str:
        key = (kind, session, turn)
        text = self._pieces.get(key)
        if text is None:
            rng = random.Random(f"flexlb-chat:{self.seed}:{kind}:{session}:{turn}")
            text = "".join(rng.choices(PRINTABLE, k=length))
            self._pieces[key] = text
        return text

    def prompt(self, row: Row) -> str:
        s = self.sessions[row.session]
        parts = [self.piece("system", s.tenant, 0, self.system_lengths[s.tenant])]
        if s.context_tokens:
            parts.append(self.piece("context", s.session, 0, s.context_tokens))
        for k in range(row.turn):
            user, answer = s.turn_lengths[k]
            parts += [self.piece("user", s.session, k, user), self.piece("answer", s.session, k, answer)]
        parts.append(self.piece("user", s.session, row.turn, s.turn_lengths[row.turn][0]))
        text = "".join(parts)
        if len(text) != row.input_length:
            raise AssertionError(f"{row.request_id}: built {len(text)} characters, expected {row.input_length}")
        return text

    def block_hashes(self, row: Row, block_size_tokens: int) -> list[int]:
        token_ids = list(self.prompt(row).encode())
        key = (row.session, block_size_tokens)
        prev = self._chains.get(key)
        if prev is not None and prev[0] < row.turn:  # an earlier turn's prompt is a prefix of this one
            hashes, parent = list(prev[1]), prev[2]
        else:
            hashes, parent = [], ROOT_DIGEST
        chained = chain_block_hashes(token_ids[len(hashes) * block_size_tokens:], block_size_tokens, parent)
        hashes += [h for h, _ in chained]
        if chained:
            parent = chained[-1][1]
        self._chains[key] = (row.turn, hashes, parent)
        return list(hashes)


def _chat_session(params: ChatParams, seed: int, session: int, start_ms: float, system_lengths: list[int],
                  lengths: tuple[tuple[int, int], ...], max_prompt_tokens: int) -> ChatSession:
    rng = random.Random(f"flexlb-chat:{seed}:session:{session}")
    tenant = rng.randrange(params.num_tenants)
    lo, hi = params.session_context_tokens
    # its own stream: the session's draws above stay those of a workload without contexts
    context = random.Random(f"flexlb-chat:{seed}:context-length:{session}").randint(lo, hi) if hi else 0
    limit = params.prompt_limit(max_prompt_tokens)
    history = system_lengths[tenant] + context
    ts = start_ms
    turn_lengths: list[tuple[int, int]] = []
    turn_ts: list[float] = []
    while True:
        user, answer = lengths[rng.randrange(len(lengths))]
        if params.max_user_tokens:
            user = min(user, params.max_user_tokens)
        if history + user > limit:
            break  # the history no longer fits: the session ends
        turn_lengths.append((user, answer))
        turn_ts.append(ts)
        history += user + answer
        if rng.random() < 1.0 / params.mean_turns:
            break  # the user leaves
        think_ms = rng.expovariate(1.0 / params.mean_think_s) * 1000.0 if params.mean_think_s > 0 else 0.0
        ts += answer * params.nominal_ms_per_token + think_ms
    return ChatSession(session, tenant, start_ms, tuple(turn_lengths), tuple(turn_ts), context)


def load_chat(params: ChatParams, start_row: int, rows: int, max_prompt_tokens: int, seed: int) -> list[Row]:
    """Requests start_row .. start_row + rows - 1 of a chat-family stream (module docstring)."""
    lo, hi = params.system_prompt_tokens
    limit = params.prompt_limit(max_prompt_tokens)
    if hi + params.session_context_tokens[1] >= limit:
        what = (f"system prompts up to {hi} tokens" if not params.session_context_tokens[1] else
                f"system prompts up to {hi} tokens and session contexts up to {params.session_context_tokens[1]}")
        raise ValueError(f"{what} leave no room under max_prompt_tokens {max_prompt_tokens}"
                         + (f" / max_session_prompt_tokens {params.max_session_prompt_tokens}"
                            if params.max_session_prompt_tokens else ""))
    lengths = sharegpt_lengths(params.lengths_path)
    system_lengths = [random.Random(f"flexlb-chat:{seed}:tenant:{t}").randint(lo, hi)
                      for t in range(params.num_tenants)]
    arrivals = random.Random(f"flexlb-chat:{seed}:sessions")
    need = start_row + rows
    sessions: dict[int, ChatSession] = {}
    pending: list[tuple[float, int, int]] = []  # heap of (ts, session, turn) not yet final
    final: list[tuple[float, int, int]] = []
    start_ms = 0.0
    session = 0
    empty_in_a_row = 0
    while len(final) < need:
        # Every later session's turns arrive at or after start_ms: what arrived before is final.
        while pending and pending[0][0] < start_ms and len(final) < need:
            final.append(heapq.heappop(pending))
        if len(final) >= need:
            break
        s = _chat_session(params, seed, session, start_ms, system_lengths, lengths, max_prompt_tokens)
        sessions[session] = s
        for turn, ts in enumerate(s.turn_ts_ms):
            heapq.heappush(pending, (ts, session, turn))
        empty_in_a_row = 0 if s.turn_lengths else empty_in_a_row + 1
        if empty_in_a_row > 1000:
            raise ValueError(f"1000 sessions in a row had no turn under the prompt limit {limit}")
        session += 1
        start_ms += arrivals.expovariate(params.session_rate_per_s) * 1000.0
    picked = final[start_row:need]
    source = ChatPrompts(params, seed, sessions, system_lengths)
    t0 = picked[0][0]
    out = []
    for i, (ts, s_id, turn) in enumerate(picked, start=start_row):
        s = sessions[s_id]
        n = (system_lengths[s.tenant] + s.context_tokens + sum(u + a for u, a in s.turn_lengths[:turn])
             + s.turn_lengths[turn][0])
        out.append(Row(row=i, request_id=f"{params.request_id_prefix}-s{s_id:05d}-t{turn:02d}", ts_ms=ts - t0, recorded_input_length=n,
                       input_length=n, max_tokens=s.turn_lengths[turn][1], prefix_block_tokens=16, session=s_id,
                       turn=turn, source=source))
    # Prefix ids for the capacity bound: the 16-token block hashes themselves (chained, so two
    # prompts share their first k blocks exactly when their first k hashes are equal).
    return [dataclasses.replace(r, prefix_block_ids=tuple(r.block_hashes(16))) for r in out]
