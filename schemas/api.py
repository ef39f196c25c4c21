"""HTTP API bodies (OpenAI-compatible completions) as msgspec Structs."""

from __future__ import annotations

from typing import Union

import msgspec


class CompletionRequest(msgspec.Struct, kw_only=True):
    """`POST /v1/completions`. Unknown OpenAI fields (stop, logprobs, ...) are accepted and
    ignored. Sampling (temperature, top_p, seed, ignore_eos) reaches the engine; the sim
    engine's output does not depend on it. Absent temperature is greedy (0), not OpenAI's 1:
    the same request gives the same tokens unless asked otherwise."""

    prompt: Union[str, list[int]]
    model: str | None = None
    max_tokens: int = 16
    stream: bool = False
    request_id: str | None = None  # optional client-chosen id (also the X-Request-Id header)
    user: str | None = None
    priority: int | None = None  # 1-100, default 50: scales the SLO targets (lower number = looser)
    slo_ttft_ms: float | None = None  # override the TTFT target
    slo_tpot_ms: float | None = None  # override the time-per-output-token target
    timeout_s: float | None = None  # this request's deadline (default: the router's request_timeout_s)
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    ignore_eos: bool = False


class CompletionChoice(msgspec.Struct, kw_only=True):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None = None


class Usage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionResponse(msgspec.Struct, kw_only=True):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
