"""The sim-server's response bodies and stream chunks, per dialect: OpenAI completions and chat
(the shapes of schemas/api.py, with vLLM's token ids where asked) and SGLang's /generate.
workers/sim_server/http.py documents each endpoint's shape; a format turns one request's engine
deltas (workers/sim_server/front.py `Delta`) into bytes: `chunk(out, delta, text)` for a stream
(one or more server-sent events), `body(out, finished)` for a non-streaming answer.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from schemas.api import (
    ChatChoice,
    ChatChoiceWithTokenIds,
    ChatChunkChoice,
    ChatChunkChoiceWithTokenIds,
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
from schemas.tokens import BYTE_TOKENIZER, ByteTokenizer, HFTokenizer
from workers.engines.base import FinishedOut
from workers.sim_server.front import Delta

ABORT_MESSAGE = "aborted by POST /abort_request"

_json_encode = msgspec.json.Encoder().encode


def _sse(obj: Any) -> bytes:
    return sse(_json_encode(obj))


def _usage(num_prompt_tokens: int, out: Output, finished: FinishedOut) -> UsageWithDetails:
    n = len(out.token_ids)
    return UsageWithDetails(prompt_tokens=num_prompt_tokens, completion_tokens=n, total_tokens=num_prompt_tokens + n,
                            prompt_tokens_details=PromptTokensDetails(cached_tokens=finished.num_cached_tokens))


class Output:
    """One request's output so far: token ids and their text (decoded incrementally)."""

    __slots__ = ("token_ids", "text_parts", "_decoder")

    def __init__(self, tokenizer: ByteTokenizer | HFTokenizer = BYTE_TOKENIZER) -> None:
        self.token_ids: list[int] = []
        self.text_parts: list[str] = []
        self._decoder = tokenizer.incremental_decoder()

    def add(self, delta: Delta) -> str:
        """Append a step's tokens; return their text (a split UTF-8 character waits)."""
        self.token_ids.extend(delta.token_ids)
        text = self._decoder.decode(delta.token_ids, final=delta.finished is not None)
        self.text_parts.append(text)
        return text

    @property
    def text(self) -> str:
        return "".join(self.text_parts)




class OpenAIFormat:
    """`/v1/completions` bodies and chunks (OpenAI completion shape)."""

    def __init__(self, request_id: str, model: str, num_prompt_tokens: int, include_usage: bool,
                 return_token_ids: bool = False) -> None:
        self.id = f"cmpl-{request_id}"
        self.model = model
        self.created = int(time.time())
        self.num_prompt_tokens = num_prompt_tokens
        self.include_usage = include_usage
        self.return_token_ids = return_token_ids  # vLLM >= 0.10.2: each choice carries its token ids

    def _choice(self, text: str, finish_reason: str | None, token_ids: list[int]) -> CompletionChoice:
        if self.return_token_ids:
            return CompletionChoiceWithTokenIds(text=text, finish_reason=finish_reason, token_ids=token_ids)
        return CompletionChoice(text=text, finish_reason=finish_reason)

    def chunk(self, out: Output, delta: Delta, text: str) -> bytes:
        finish_reason = delta.finished.finish_reason if delta.finished is not None else None
        data = _sse(CompletionChunk(id=self.id, object="text_completion", created=self.created, model=self.model,
                                    choices=[self._choice(text, finish_reason, delta.token_ids)]))
        if delta.finished is not None and self.include_usage:
            data += _sse(CompletionChunk(id=self.id, object="text_completion", created=self.created, model=self.model,
                                         choices=[], usage=_usage(self.num_prompt_tokens, out, delta.finished)))
        return data

    def body(self, out: Output, finished: FinishedOut) -> bytes:
        return _json_encode(CompletionResponse(
            id=self.id, created=self.created, model=self.model,
            choices=[self._choice(out.text, finished.finish_reason, out.token_ids)],
            usage=_usage(self.num_prompt_tokens, out, finished)))


class ChatFormat:
    """`/v1/chat/completions` bodies and chunks (OpenAI chat shape; vLLM's token ids)."""

    def __init__(self, request_id: str, model: str, prompt_token_ids: list[int], include_usage: bool,
                 return_token_ids: bool = False) -> None:
        self.id = f"chatcmpl-{request_id}"
        self.model = model
        self.created = int(time.time())
        self.prompt_token_ids = prompt_token_ids
        self.include_usage = include_usage
        # vLLM >= 0.10.2: the prompt's ids (the first chunk, or the body) and each choice's ids.
        self.return_token_ids = return_token_ids
        self.sent_role = False

    def _chunk(self, choices: list[ChatChunkChoice], usage: UsageWithDetails | None = None,
               prompt_token_ids: list[int] | None = None) -> bytes:
        return _sse(ChatCompletionChunkWithPromptIds(
            id=self.id, object="chat.completion.chunk", created=self.created, model=self.model, choices=choices,
            usage=usage, prompt_token_ids=prompt_token_ids))

    def chunk(self, out: Output, delta: Delta, text: str) -> bytes:
        data = b""
        if not self.sent_role:  # the first chunk: the role, no content (and the prompt's ids)
            self.sent_role = True
            data = self._chunk([ChatChunkChoice(delta=ChatDelta(role="assistant", content=""))],
                               prompt_token_ids=self.prompt_token_ids if self.return_token_ids else None)
        finish_reason = delta.finished.finish_reason if delta.finished is not None else None
        if self.return_token_ids:
            choice = ChatChunkChoiceWithTokenIds(delta=ChatDelta(content=text), finish_reason=finish_reason,
                                                 token_ids=delta.token_ids)
        else:
            choice = ChatChunkChoice(delta=ChatDelta(content=text), finish_reason=finish_reason)
        data += self._chunk([choice])
        if delta.finished is not None and self.include_usage:
            data += self._chunk([], usage=_usage(len(self.prompt_token_ids), out, delta.finished))
        return data

    def body(self, out: Output, finished: FinishedOut) -> bytes:
        message = ChatMessage(role="assistant", content=out.text)
        usage = _usage(len(self.prompt_token_ids), out, finished)
        if self.return_token_ids:
            return _json_encode(ChatCompletionResponseWithPromptIds(
                id=self.id, created=self.created, model=self.model, usage=usage,
                choices=[ChatChoiceWithTokenIds(message=message, finish_reason=finished.finish_reason,
                                                token_ids=out.token_ids)],
                prompt_token_ids=self.prompt_token_ids))
        return _json_encode(ChatCompletionResponse(
            id=self.id, created=self.created, model=self.model, usage=usage,
            choices=[ChatChoice(message=message, finish_reason=finished.finish_reason)]))


class SGLangFormat:
    """`/generate` bodies and chunks (SGLang shape: cumulative text in streams)."""

    def __init__(self, request_id: str, num_prompt_tokens: int, incremental: bool = False) -> None:
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self.incremental = incremental  # --incremental-streaming-output: each chunk's ids and text only

    def _meta(self, out: Output, finished: FinishedOut | None) -> dict[str, Any]:
        n = len(out.token_ids)
        return {
            "id": self.request_id,
            "finish_reason": {"type": finished.finish_reason, "length": n} if finished is not None else None,
            "prompt_tokens": self.num_prompt_tokens, "completion_tokens": n,
            "cached_tokens": finished.num_cached_tokens if finished is not None else 0,
        }

    def chunk(self, out: Output, delta: Delta, text: str) -> bytes:
        if self.incremental:
            return _sse({"text": text, "output_ids": delta.token_ids, "meta_info": self._meta(out, delta.finished),
                        "index": 0})
        return _sse({"text": out.text, "output_ids": out.token_ids, "meta_info": self._meta(out, delta.finished),
                    "index": 0})

    def body(self, out: Output, finished: FinishedOut) -> bytes:
        return _json_encode({"text": out.text, "output_ids": out.token_ids, "meta_info": self._meta(out, finished)})

    def aborted(self, out: Output) -> bytes:
        """The last chunk of a request aborted by /abort_request: no new output, finish type abort."""
        meta = {**self._meta(out, None), "finish_reason": {"type": "abort", "message": ABORT_MESSAGE}}
        return _sse({"text": "" if self.incremental else out.text, "output_ids": [] if self.incremental else out.token_ids,
                    "meta_info": meta, "index": 0})

