"""HTTP API bodies (OpenAI-compatible completions) as msgspec Structs."""

from __future__ import annotations

from typing import Any, Union

import msgspec


class CompletionRequest(msgspec.Struct, kw_only=True):
    """`POST /v1/completions`. Fields FlexLB does not know (logprobs, echo, best_of, ...: not
    null) go to the engine as they came (ForEngine.extra_body): an engine server behind
    `--engine openai` takes them, FlexLB's own engines refuse them (400 naming the field).
    Sampling (temperature, top_p, seed, ignore_eos) reaches the engine; the sim engine's
    output does not depend on it. Absent temperature is greedy (0), not OpenAI's 1: the same
    request gives the same tokens unless asked otherwise."""

    prompt: Union[str, list[int]]
    model: str | None = None
    max_tokens: int = 16
    stream: bool = False
    request_id: str | None = None  # optional client-chosen id (also the X-Request-Id header)
    user: str | None = None
    priority: int | None = None  # 1-100, default 50: scales the SLO targets (lower number = looser)
    # critical | standard | sheddable: its class in the fair queue under overload (default: by
    # priority, 70-100 critical, 30-69 standard, 1-29 sheddable; services/core/fairness.py)
    priority_class: str | None = None
    slo_ttft_ms: float | None = None  # override the TTFT target
    slo_tpot_ms: float | None = None  # override the time-per-output-token target
    timeout_s: float | None = None  # this request's deadline (default: the router's request_timeout_s)
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    ignore_eos: bool = False
    stop: Union[str, list[str], None] = None  # cut the text before the first of these (services/chat.py)
    stream_options: StreamOptions | None = None  # include_usage: a last chunk with the usage
    n: int = 1  # choices per request: only 1 (more is refused, not silently ignored)


class CompletionChoice(msgspec.Struct, kw_only=True):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None = None


class CompletionResponse(msgspec.Struct, kw_only=True):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageWithDetails | None = None


class PromptTokensDetails(msgspec.Struct, kw_only=True):
    cached_tokens: int  # prompt tokens the engine found in its prefix cache


class UsageWithDetails(msgspec.Struct, kw_only=True):
    """OpenAI's usage with `prompt_tokens_details` (cached prompt tokens), where known."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class StreamOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    include_usage: bool = False  # one more chunk at the end: choices [] and the usage
    continuous_usage_stats: bool = False  # vLLM's: refused (every chunk's usage) unless false


class ChatCompletionRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`POST /v1/chat/completions` (services/chat.py says how each field is used). Fields
    FlexLB does not know, and known ones its own engines do not honour (logprobs, penalties,
    logit_bias, a response_format other than text, ...: services/chat.py ENGINE_ONLY_FIELDS),
    go to the engine as they came: an engine server behind `--engine openai` takes them,
    FlexLB's own engines refuse them (400 naming the field); n > 1 is refused everywhere.
    Nothing is accepted and then ignored."""

    messages: list[dict[str, Any]]
    model: str | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None  # OpenAI's newer name; the smaller of the two when both are given
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Union[str, list[str], None] = None
    seed: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    user: str | None = None
    tools: list[dict[str, Any]] | None = None  # rendered by the template; forwarded to an OpenAI server
    tool_choice: Any = None  # forwarded to an OpenAI server (the template does not see it)
    parallel_tool_calls: bool | None = None  # forwarded with tools; no effect on FlexLB's own engines
    add_generation_prompt: bool = True  # vLLM's extension: end the prompt with the assistant's header
    continue_final_message: bool = False  # vLLM's extension: the last (assistant) message goes on, unclosed
    chat_template_kwargs: dict[str, Any] | None = None  # extra template variables (enable_thinking, ...)
    # Accepted only at their neutral value (refused otherwise, naming the field):
    logprobs: bool = False
    top_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None
    store: bool = False
    metadata: dict[str, str] | None = None
    # FlexLB's own, as on /v1/completions:
    request_id: str | None = None
    priority: int | None = None
    priority_class: str | None = None
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    timeout_s: float | None = None
    ignore_eos: bool = False


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str = "assistant"
    content: str | None = None


class ChatChoice(msgspec.Struct, kw_only=True):
    index: int = 0
    message: ChatMessage
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionResponse(msgspec.Struct, kw_only=True):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageWithDetails | None = None


class ChatDelta(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: str | None = None  # only in the first chunk
    content: str | None = None


class ChatChunkChoice(msgspec.Struct, kw_only=True):
    index: int = 0
    delta: ChatDelta
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionChunk(msgspec.Struct, kw_only=True, omit_defaults=True):
    id: str
    object: str  # "chat.completion.chunk" (no default: omit_defaults would drop it)
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageWithDetails | None = None  # only on the include_usage chunk


# --------------------------------------------------------------------------- vLLM's token ids
# vLLM >= 0.10.2 with `return_token_ids: true`: each choice carries its token ids, and a chat
# answer the prompt's (`prompt_token_ids`: in the first chunk of a stream, or in the body).
# The sim-server (workers/sim_server/formats.py) answers so; the router's own answers do not.
class CompletionChoiceWithTokenIds(CompletionChoice, kw_only=True):
    token_ids: list[int]  # this chunk's (a stream) or the whole output's (a body)


class CompletionChunk(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One streamed `/v1/completions` chunk as vLLM sends it: no `usage` key but on the
    include_usage chunk (`choices: []`)."""

    id: str
    object: str  # "text_completion" (no default: omit_defaults would drop it)
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageWithDetails | None = None


class ChatChoiceWithTokenIds(ChatChoice, kw_only=True):
    token_ids: list[int]


class ChatCompletionResponseWithPromptIds(ChatCompletionResponse, kw_only=True):
    prompt_token_ids: list[int]  # the server's rendering of the messages


class ChatChunkChoiceWithTokenIds(ChatChunkChoice, kw_only=True):
    token_ids: list[int]


class ChatCompletionChunkWithPromptIds(ChatCompletionChunk, kw_only=True):
    prompt_token_ids: list[int] | None = None  # the first chunk's only
