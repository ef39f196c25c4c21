"""One home for the OpenAI response shapes: a non-streaming answer's body and a stream's
server-sent events, for /v1/completions and /v1/chat/completions. The router answers its
clients with them (services/api.py), the sim server answers peer routers with them
(workers/sim_server/formats.py, with vLLM's token ids where a request asks for them); the
shapes are schemas/api.py's, the SSE framing schemas/http.py's `sse`.

A shape is made per request (its id, creation time and model) and used as:
`first()` the stream's opening event (chat: the role chunk; completions: none),
`chunk(text, finish_reason, token_ids)` one event per engine delta,
`usage_chunk(usage)` the include_usage event, `body(text, finish_reason, usage, token_ids)`
the non-streaming answer. Streamed chunks carry no `usage` key but on the usage chunk (as vLLM
sends them); a chat chunk without text has an empty delta (`{}`, as OpenAI's last chunk).
`skips_empty`: a chunk with neither text nor an end need not be sent (chat), where a
completion stream sends every engine chunk.
"""

from __future__ import annotations

import msgspec

from schemas.api import (
    ChatChoice,
    ChatChoiceWithTokenIds,
    ChatChunkChoice,
    ChatChunkChoiceWithTokenIds,
    ChatCompletionChunk,
    ChatCompletionChunkWithPromptIds,
    ChatCompletionResponse,
    ChatCompletionResponseWithPromptIds,
    ChatDelta,
    ChatMessage,
    CompletionChoice,
    CompletionChoiceWithTokenIds,
    CompletionChunk,
    CompletionResponse,
    PromptTokensDetails,
    UsageWithDetails,
)
from schemas.http import sse

_encode = msgspec.json.Encoder().encode


def usage_of(num_prompt_tokens: int, num_output_tokens: int, num_cached_tokens: int | None) -> UsageWithDetails:
    """OpenAI's usage; `prompt_tokens_details.cached_tokens` where the engine said (None: left out)."""
    return UsageWithDetails(
        prompt_tokens=num_prompt_tokens, completion_tokens=num_output_tokens,
        total_tokens=num_prompt_tokens + num_output_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=num_cached_tokens) if num_cached_tokens is not None else None,
    )


class CompletionShape:
    """`text_completion` bodies and chunks (/v1/completions). `return_token_ids` (vLLM >= 0.10.2):
    each choice carries its token ids."""

    skips_empty = False

    def __init__(self, request_id: str, created: int, model: str, include_usage: bool = False,
                 return_token_ids: bool = False) -> None:
        self.request_id, self.created, self.model = request_id, created, model
        self.include_usage, self.return_token_ids = include_usage, return_token_ids

    def _choice(self, text: str, finish_reason: str | None, token_ids: list[int] | None) -> CompletionChoice:
        if self.return_token_ids:
            return CompletionChoiceWithTokenIds(text=text, finish_reason=finish_reason, token_ids=token_ids or [])
        return CompletionChoice(text=text, finish_reason=finish_reason)

    def _chunk(self, choices: list[CompletionChoice], usage: UsageWithDetails | None = None) -> bytes:
        return sse(_encode(CompletionChunk(id=self.request_id, object="text_completion", created=self.created,
                                           model=self.model, choices=choices, usage=usage)))

    def first(self) -> bytes:
        return b""

    def chunk(self, text: str, finish_reason: str | None, token_ids: list[int] | None = None) -> bytes:
        return self._chunk([self._choice(text, finish_reason, token_ids)])

    def usage_chunk(self, usage: UsageWithDetails) -> bytes:
        return self._chunk([], usage)

    def body(self, text: str, finish_reason: str | None, usage: UsageWithDetails,
             token_ids: list[int] | None = None) -> bytes:
        return _encode(CompletionResponse(id=self.request_id, created=self.created, model=self.model,
                                          choices=[self._choice(text, finish_reason, token_ids)], usage=usage))


class ChatShape:
    """`chat.completion` bodies and `chat.completion.chunk` chunks (/v1/chat/completions).
    `return_token_ids` (vLLM >= 0.10.2): each choice carries its token ids, and the prompt's
    ids (`prompt_token_ids`) come in the first chunk or the body."""

    skips_empty = True

    def __init__(self, request_id: str, created: int, model: str, include_usage: bool = False,
                 return_token_ids: bool = False, prompt_token_ids: list[int] | None = None) -> None:
        self.request_id, self.created, self.model = request_id, created, model
        self.include_usage, self.return_token_ids = include_usage, return_token_ids
        self.prompt_token_ids = prompt_token_ids or []

    def _chunk(self, choices: list[ChatChunkChoice], usage: UsageWithDetails | None = None,
               prompt_token_ids: list[int] | None = None) -> bytes:
        if prompt_token_ids is not None:
            return sse(_encode(ChatCompletionChunkWithPromptIds(
                id=self.request_id, object="chat.completion.chunk", created=self.created, model=self.model,
                choices=choices, usage=usage, prompt_token_ids=prompt_token_ids)))
        return sse(_encode(ChatCompletionChunk(id=self.request_id, object="chat.completion.chunk", created=self.created,
                                               model=self.model, choices=choices, usage=usage)))

    def first(self) -> bytes:
        return self._chunk([ChatChunkChoice(delta=ChatDelta(role="assistant", content=""))],
                           prompt_token_ids=self.prompt_token_ids if self.return_token_ids else None)

    def chunk(self, text: str, finish_reason: str | None, token_ids: list[int] | None = None) -> bytes:
        delta = ChatDelta(content=text) if text else ChatDelta()
        if self.return_token_ids:
            return self._chunk([ChatChunkChoiceWithTokenIds(delta=delta, finish_reason=finish_reason,
                                                            token_ids=token_ids or [])])
        return self._chunk([ChatChunkChoice(delta=delta, finish_reason=finish_reason)])

    def usage_chunk(self, usage: UsageWithDetails) -> bytes:
        return self._chunk([], usage)

    def body(self, text: str, finish_reason: str | None, usage: UsageWithDetails,
             token_ids: list[int] | None = None) -> bytes:
        message = ChatMessage(role="assistant", content=text)
        if self.return_token_ids:
            return _encode(ChatCompletionResponseWithPromptIds(
                id=self.request_id, created=self.created, model=self.model, usage=usage,
                choices=[ChatChoiceWithTokenIds(message=message, finish_reason=finish_reason, token_ids=token_ids or [])],
                prompt_token_ids=self.prompt_token_ids))
        return _encode(ChatCompletionResponse(id=self.request_id, created=self.created, model=self.model, usage=usage,
                                              choices=[ChatChoice(message=message, finish_reason=finish_reason)]))
