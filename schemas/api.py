"""HTTP API bodies (OpenAI-compatible completions) as msgspec Structs."""

from __future__ import annotations

from typing import Union

import msgspec


class CompletionRequest(msgspec.Struct, kw_only=True):
    """`POST /v1/completions`. Unknown OpenAI fields (temperature, top_p, ...) are accepted
    and ignored by the simulated engine."""

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
