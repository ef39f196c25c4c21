"""`POST /v1/embeddings` (OpenAI's embeddings API): parsing and the answer's shape
(services/api.py moves the bytes).

What runs it. Embeddings are an engine server's (llama-server `--embeddings`, an embedding
model behind vLLM or SGLang): the openai agent asks its server once at its start whether it
answers `/v1/embeddings` and says so (EngineSignals.embeddings, shown by /admin/workers).
Only those workers are candidates (the scheduler's `AdmitRequest.embeddings`); a model none of
whose live workers serves embeddings is 400 `invalid_request` saying so. FlexLB's own
engines (sim, torch) do not serve them.

The request goes the way a completion goes: API key, tenant limits, the fair queue,
admission (its inputs, tokenized by the router's tokenizer, are its prompt: their sum is
sized against `max_prompt_tokens`, hashed for the prefix index, predicted as a prefill),
the batcher, the journal. Its "output" is one token (KV and TPOT are counted as for a
one-token completion), and it ends when the vectors are back.

Fields: `input` (required): a text, a list of texts, a list of token ids or a list of
lists of token ids (OpenAI's four forms), at most MAX_INPUTS inputs, none empty; `model`;
FlexLB's `request_id`, `priority`, `priority_class`, `timeout_s`, `slo_ttft_ms`. The rest
(`encoding_format`, `dimensions`, `user`, and any field FlexLB does not know) go to the
server as they came (ForEngine.extra_body): it answers them (llama.cpp: base64; a model that
cannot truncate refuses `dimensions`, and that 400 reaches the client). `stream` is not an
embeddings field: refused.

The answer: `{"object": "list", "data": [...], "model": <the model asked>, "usage":
{"prompt_tokens", "total_tokens"}}`. Each `data` item is the server's, byte for byte (its
`embedding` floats or base64 text, its `index`); usage is the server's count when it gives
one, else the router's.
"""

from __future__ import annotations

import msgspec

from schemas import messages as m
from schemas.http import HttpError
from schemas.tokens import ByteTokenizer, HFTokenizer
from services.chat import check_options, decode_with_extra

MAX_INPUTS = 2048  # OpenAI's limit on inputs per request


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    input: str | list[str | int | list[int]]  # (msgspec allows one list type per union: checked below)
    model: str | None = None
    request_id: str | None = None
    priority: int | None = None
    priority_class: str | None = None
    timeout_s: float | None = None
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None  # (check_options reads it; an embedding decodes nothing: refused if set)
    stream: bool = False  # (not an embeddings field: refused if true)


class _StrictEmbeddingRequest(EmbeddingRequest, forbid_unknown_fields=True):
    pass


_STRICT = msgspec.json.Decoder(_StrictEmbeddingRequest)
_LAX = msgspec.json.Decoder(EmbeddingRequest)
_FIELDS = frozenset(EmbeddingRequest.__struct_fields__)


def parse_embeddings(body: bytes, settings, tokenizer: ByteTokenizer | HFTokenizer) -> tuple[EmbeddingRequest, list[int],
                                                                                              m.EmbedForward, dict]:
    """-> (request, the router's token ids of every input in order, what the server gets, fields
    for the engine only). HttpError with a code for what cannot be served."""
    req, extra = decode_with_extra(body, _STRICT, _LAX, _FIELDS, settings, "an input")
    if req.stream:
        raise HttpError("invalid_request", "stream: embeddings are not streamed")
    if req.slo_tpot_ms is not None:
        raise HttpError("invalid_request", "slo_tpot_ms: an embedding has no output tokens")
    raw = req.input
    if isinstance(raw, str):
        inputs: list = [raw]
    elif raw and all(isinstance(x, int) for x in raw):
        inputs = [raw]
    elif all(isinstance(x, str) for x in raw) or all(isinstance(x, list) for x in raw):
        inputs = raw
    else:
        raise HttpError("invalid_request", "input must be a text, a list of texts, a list of token ids or a list of "
                                           "lists of token ids")
    if not inputs:
        raise HttpError("invalid_request", "input is empty")
    if len(inputs) > MAX_INPUTS:
        raise HttpError("invalid_request", f"input: at most {MAX_INPUTS} inputs per request, got {len(inputs)}")
    limit = settings.max_prompt_tokens
    bound = tokenizer.max_chars_per_token
    tokens: list[int] = []
    for i, one in enumerate(inputs):
        if not one:
            raise HttpError("invalid_request", f"input[{i}] is empty")
        if isinstance(one, str):
            if bound is not None and len(one) > limit * bound:
                raise HttpError("too_large", f"input[{i}] of {len(one)} characters exceeds the limit of {limit} tokens")
            tokens += tokenizer.encode(one)
        else:
            if any(t < 0 or t >= 1 << 31 for t in one):
                raise HttpError("invalid_request", f"input[{i}]: token ids must be in [0, 2^31)")
            tokens += one
        if len(tokens) > limit:
            raise HttpError("too_large", f"inputs of {len(tokens)} tokens or more exceed the limit of {limit}")
    check_options(req, settings)
    return req, tokens, m.EmbedForward(input=inputs), extra


class EmbeddingsAnswer:
    """The server's data items (`TokensGenerated.extra` of each chunk: one item, or the usage)
    joined into the client's body."""

    def __init__(self, model: str, num_prompt_tokens: int) -> None:
        self.model = model
        self.items: list[bytes] = []
        self.usage: bytes = b""
        self.num_prompt_tokens = num_prompt_tokens

    def add(self, extra: str) -> None:
        """One chunk's extra: {"data": <item>} or {"usage": <usage>} (workers/openai/agent.py)."""
        parts = msgspec.json.decode(extra, type=dict[str, msgspec.Raw])
        if "data" in parts:
            self.items.append(bytes(parts["data"]))
        if "usage" in parts:
            self.usage = bytes(parts["usage"])

    def body(self) -> bytes:
        usage = self.usage or msgspec.json.encode({"prompt_tokens": self.num_prompt_tokens,
                                                   "total_tokens": self.num_prompt_tokens})
        return (b'{"object":"list","data":[' + b",".join(self.items) + b'],"model":' + msgspec.json.encode(self.model)
                + b',"usage":' + usage + b"}")
