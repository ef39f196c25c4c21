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
    UsageWithDetails,
)
from schemas.http import sse
from schemas.openai_bodies import ChatShape, CompletionShape, usage_of
from schemas.tokens import BYTE_TOKENIZER, ByteTokenizer, HFTokenizer
from workers.engines.base import FinishedOut
from workers.sim_server.front import Delta

ABORT_MESSAGE = "aborted by POST /abort_request"

_json_encode = msgspec.json.Encoder().encode


def _sse(obj: Any) -> bytes:
    return sse(_json_encode(obj))


def _usage(num_prompt_tokens: int, out: Output, finished: FinishedOut) -> UsageWithDetails:
    return usage_of(num_prompt_tokens, len(out.token_ids), finished.num_cached_tokens)


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
    """`/v1/completions` bodies and chunks (schemas/openai_bodies.py's shape; vLLM's token ids
    where asked)."""

    def __init__(self, request_id: str, model: str, num_prompt_tokens: int, include_usage: bool,
                 return_token_ids: bool = False) -> None:
        self.shape = CompletionShape(f"cmpl-{request_id}", int(time.time()), model, include_usage, return_token_ids)
        self.num_prompt_tokens = num_prompt_tokens

    def chunk(self, out: Output, delta: Delta, text: str) -> bytes:
        return _chunk(self.shape, self.num_prompt_tokens, out, delta, text)

    def body(self, out: Output, finished: FinishedOut) -> bytes:
        return self.shape.body(out.text, finished.finish_reason, _usage(self.num_prompt_tokens, out, finished),
                               out.token_ids)


class ChatFormat:
    """`/v1/chat/completions` bodies and chunks (schemas/openai_bodies.py's shape; vLLM's token
    ids and the prompt's where asked)."""

    def __init__(self, request_id: str, model: str, prompt_token_ids: list[int], include_usage: bool,
                 return_token_ids: bool = False) -> None:
        self.shape = ChatShape(f"chatcmpl-{request_id}", int(time.time()), model, include_usage, return_token_ids,
                               prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.sent_role = False

    def chunk(self, out: Output, delta: Delta, text: str) -> bytes:
        first = b""
        if not self.sent_role:  # the first chunk: the role, no content (and the prompt's ids)
            self.sent_role = True
            first = self.shape.first()
        return first + _chunk(self.shape, self.num_prompt_tokens, out, delta, text)

    def body(self, out: Output, finished: FinishedOut) -> bytes:
        return self.shape.body(out.text, finished.finish_reason, _usage(self.num_prompt_tokens, out, finished),
                               out.token_ids)


def _chunk(shape: CompletionShape | ChatShape, num_prompt_tokens: int, out: Output, delta: Delta, text: str) -> bytes:
    """One engine delta's event, and the usage event after the last one where asked."""
    finished = delta.finished
    data = shape.chunk(text, finished.finish_reason if finished is not None else None, delta.token_ids)
    if finished is not None and shape.include_usage:
        data += shape.usage_chunk(_usage(num_prompt_tokens, out, finished))
    return data


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

