"""The sim-server's request parsing: JSON bodies, prompts (text or token ids), typed fields,
the request id, and the fields refused because the simulated engine would not honour them
(workers/sim_server/http.py documents each endpoint's fields). Every refusal is an `HttpError`
(schemas/http.py) with code `invalid_request`.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec

from schemas.chat_template import ChatTemplateError, ChatTemplates, tool_arguments_as_objects
from schemas.http import HttpError, Scope
from schemas.tokens import BYTE_TOKENIZER, ByteTokenizer, HFTokenizer

MAX_REQUEST_ID_CHARS = 256

_json_decode = msgspec.json.Decoder().decode


def parse_json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = _json_decode(raw) if raw else {}
    except msgspec.DecodeError as exc:
        raise HttpError("invalid_request", f"the body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise HttpError("invalid_request", "the body must be a JSON object")
    return body


def prompt_token_ids(value: Any, field: str, tokenizer: ByteTokenizer | HFTokenizer = BYTE_TOKENIZER,
                     add_special_tokens: bool | None = None) -> list[int]:
    """Text, token ids, or a one-element list of either -> token ids (text by `tokenizer`,
    `add_special_tokens` None: its default). An empty prompt passes: the engine refuses it
    (`invalid_request`), as on the NATS path."""
    if isinstance(value, str):
        return tokenizer.encode(value, add_special_tokens)
    if isinstance(value, list):
        if all(type(v) is int for v in value):
            if any(v < 0 for v in value):
                raise HttpError("invalid_request", f"{field}: token ids must be >= 0")
            return value
        if len(value) == 1 and isinstance(value[0], (str, list)):
            return prompt_token_ids(value[0], field, tokenizer, add_special_tokens)
        if all(isinstance(v, (str, list)) for v in value):
            raise HttpError("invalid_request", f"{field}: a batch of {len(value)} prompts is not supported; send one per request")
    raise HttpError("invalid_request", f"{field} must be text or a list of token ids")


def int_field(body: dict[str, Any], name: str, default: int) -> int:
    value = body.get(name)
    if value is None:
        return default
    if type(value) is not int:
        raise HttpError("invalid_request", f"{name} must be an integer, got {value!r}")
    return value


def bool_field(body: dict[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise HttpError("invalid_request", f"{name} must be true or false, got {value!r}")
    return value


def refuse_unmodelled(body: dict[str, Any]) -> None:
    """Fields that would change the answer are refused rather than silently ignored."""
    if int_field(body, "n", 1) != 1:
        raise HttpError("invalid_request", "n > 1 is not supported by the simulated engine")
    if bool_field(body, "echo"):
        raise HttpError("invalid_request", "echo is not supported by the simulated engine")


OUTPUT_OFFSET_HEADER = b"x-flexlb-output-offset"
MAX_OUTPUT_OFFSET = 10_000_000


def output_offset_of(scope: Scope) -> int:
    """A continuation's first output index (`X-Flexlb-Output-Offset`, sent by FlexLB's openai
    agent for a migrated request; 0 without it): the simulated output goes on from there, as a
    real greedy engine's would from the same context. A server that is not this one ignores it."""
    for key, value in scope["headers"]:
        if key == OUTPUT_OFFSET_HEADER:
            text = value.decode("latin-1")
            if not text.isdigit() or int(text) > MAX_OUTPUT_OFFSET:
                raise HttpError("invalid_request", f"X-Flexlb-Output-Offset must be an integer in [0, {MAX_OUTPUT_OFFSET}]")
            return int(text)
    return 0


def request_id_of(scope: Scope, body: dict[str, Any]) -> str | None:
    for key, value in scope["headers"]:
        if key == b"x-request-id":
            request_id = value.decode("latin-1")
            break
    else:
        request_id = body.get("rid")
        if request_id is None:
            request_id = body.get("request_id")
    if request_id is None or request_id == "":
        return None
    if not isinstance(request_id, str) or len(request_id) > MAX_REQUEST_ID_CHARS:
        raise HttpError("invalid_request", f"the request id must be a string of at most {MAX_REQUEST_ID_CHARS} characters")
    return request_id


async def prompt_of(tokenizer: ByteTokenizer | HFTokenizer, value: Any, field: str,
                    body: dict[str, Any] | None = None) -> list[int]:
    """`prompt_token_ids` by `tokenizer`, with the body's `add_special_tokens`
    (vLLM's field; absent: the tokenizer's default); an HF tokenizer in a thread."""
    add = body.get("add_special_tokens") if body is not None else None
    if add is not None and not isinstance(add, bool):
        raise HttpError("invalid_request", f"add_special_tokens must be true or false, got {add!r}")
    if tokenizer.is_costly:
        return await asyncio.to_thread(prompt_token_ids, value, field, tokenizer, add)
    return prompt_token_ids(value, field, tokenizer, add)


async def chat_prompt(body: dict[str, Any], chat_templates: ChatTemplates | None,
                      tokenizer: ByteTokenizer | HFTokenizer) -> list[int]:
    """A chat body's `messages` rendered by the chat template (with `tools`,
    `add_generation_prompt`, `continue_final_message`, `chat_template_kwargs`) and
    encoded without special tokens (the template writes them), as vLLM does."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(x, dict) for x in messages):
        raise HttpError("invalid_request", "messages must be a non-empty list of objects")
    if chat_templates is None:
        raise HttpError("invalid_request", f"no chat template for this server's tokenizer ({tokenizer.name}):"
                                           " start it with --chat-template FILE")
    tools = body.get("tools")
    kwargs = body.get("chat_template_kwargs")
    if tools is not None and not isinstance(tools, list):
        raise HttpError("invalid_request", "tools must be a list")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise HttpError("invalid_request", "chat_template_kwargs must be an object")
    add_generation_prompt = body.get("add_generation_prompt", True)
    if not isinstance(add_generation_prompt, bool):
        raise HttpError("invalid_request", "add_generation_prompt must be true or false")
    try:
        text = chat_templates.render(tool_arguments_as_objects(messages), tools=tools,
                                          add_generation_prompt=add_generation_prompt,
                                          continue_final_message=bool_field(body, "continue_final_message"),
                                          chat_template_kwargs=kwargs)
    except ChatTemplateError as exc:
        raise HttpError("invalid_request", f"chat template: {exc}") from None
    if tokenizer.is_costly:
        return await asyncio.to_thread(tokenizer.encode, text, False)
    return tokenizer.encode(text, False)
