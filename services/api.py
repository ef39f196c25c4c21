"""The router's HTTP API: OpenAI-compatible completions and chat completions (raw ASGI,
CompletionsFront; their parsing and shapes in services/chat.py), and health, metrics and
admin (FastAPI).

Every error is `{"error": {"code", "message", "retryable"}}` with the design's HTTP status;
bodies are parsed with msgspec (not FastAPI's validation) so that every bad input maps to a
code: `invalid_request` (400) for malformed JSON, wrong types, missing prompt or bad
max_tokens; `too_large` (413) for bodies over `max_body_bytes` or prompts over
`max_prompt_tokens`. A client that disconnects mid-stream cancels its request.

A streaming response starts (its status line and headers) only once its request is
dispatched (its batch's publish acked by the stream: Dispatcher.dispatch, or, forwarded by
a standby, its leader's batch.dispatched event) or its first token or outcome arrives,
whichever comes first. Until then nothing is sent, so a refusal (admission, or the
batcher giving up on it: slo_unattainable, queue_timeout, too_large, a failed dispatch) is
an HTTP status with the JSON error body, and Retry-After where the code asks the client to
come back (error_headers): never an error event inside a 200 stream, which clients count
as accepted and do not retry. What fails after that (a worker that dies) still arrives as
an error event in the stream.

Text prompts are tokenized here, by `settings.tokenizer` (a Hugging Face tokenizer.json,
loaded once by `create_app`; default the byte-level one, `schemas/tokens.py`): the router
hashes and dispatches those ids, so they must be the model's. Before tokenizing, a text
longer than `max_prompt_tokens x max_chars_per_token` characters (the most one token of
that tokenizer can stand for; 1 for bytes) is refused `too_large` at once; where the file
proves no such bound, only `max_body_bytes` bounds the work. An HF tokenizer runs in a
thread (it releases the GIL), so a long prompt does not stall the event loop, and so does a
chat template's rendering. The router never decodes ids: output text comes from the workers.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import math
import re
import time
from collections.abc import Mapping
from contextlib import asynccontextmanager

import msgspec
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from prometheus_client import generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from schemas import messages as m
from schemas.api import CompletionRequest
from schemas.errors import ERROR_CODES
from schemas.http import (
    JSON_TYPE,
    SSE_TYPE,
    ClientGone,
    HttpError,
    error_body,
    error_status,
    read_body,
    send_bytes,
    send_error,
)
from schemas.openai_bodies import ChatShape, CompletionShape, ExtrasJoiner
from schemas.subjects import validate_token
from schemas.tokens import BYTE_TOKENIZER, ByteTokenizer, HFTokenizer, load_tokenizer
from services import anthropic, responses
from services.chat import (
    OutputCursor,
    check_max_tokens,
    check_options,
    decode_with_extra,
    parse_chat,
    resolve_chat_templates,
    sampling_of,
    stop_strings,
)
from services.core.admission import DEFAULT_TENANT
from services.core.fairness import CLASS_BANDS, CLASSES, class_of_priority
from services.core.scheduler import Rejected
from services.embeddings import EmbeddingsAnswer, parse_embeddings
from services.limits import Refusal, TenantLimits, parse_limits
from services.settings import DEFAULT_GRANT
from services.shell.router import RequestHandle, RouterService

log = logging.getLogger("flexlb.api")

class _StrictCompletionRequest(CompletionRequest, forbid_unknown_fields=True):
    """A completion body with no field FlexLB does not know (the usual case: one decode)."""


_REQ_DECODER = msgspec.json.Decoder(CompletionRequest)
_STRICT_REQ_DECODER = msgspec.json.Decoder(_StrictCompletionRequest)
_COMPLETION_FIELDS = frozenset(CompletionRequest.__struct_fields__)
_ENC = msgspec.json.Encoder()
# Refusals that say when to come back (Retry-After): every retryable code answered 429 or 503
# (queue_full, shed, slo_unattainable, no_worker, not_ready, ...), and queue_timeout (504: the
# wait was at the router, not in an engine). error_headers gives it, to admission refusals and
# to a stream's failure before its response started alike.
RETRY_AFTER_CODES = frozenset([c.code for c in ERROR_CODES.values() if c.retryable and c.http_status in (429, 503)]
                              + ["queue_timeout"])
# Retry-After where the refusal gives no hint of its own (the fair queue's retry_after_ms does):
# 1 s. A worker that restarts is routable on its first status report (heartbeats come every
# 200 ms by default) and a dead one is declared dead within a second, so for `no_worker` 1 s is
# soon enough to find one back and long enough not to spin a client against an empty pool; a
# batch window or a TPOT hold (slo_unattainable) moves on within a second too.
DEFAULT_RETRY_AFTER_MS = 1000


def key_digests(keys: Mapping[str, str]) -> dict[bytes, str]:
    """API key -> tenant, kept as SHA-256 digest -> tenant: the keys themselves are not kept
    past start-up, and a lookup compares digests (a dict probe on a digest tells a timing
    observer nothing about how near a guess came to a key)."""
    return {hashlib.sha256(k.encode()).digest(): t for k, t in keys.items()}


def tenant_of(settings, authorization: str | None, header: str | None, digests: Mapping[bytes, str] | None = None) -> str:
    """A request's tenant (settings.py, `tenant_header`). With API keys configured (`digests`,
    from key_digests): its key's, the key required (401 invalid_api_key without one, or with
    an unknown one), the tenant header ignored unless `trust_tenant_header` (a trusted gateway
    names the tenant). Without keys: the tenant header's value (when `tenant_header` is set),
    else "" (the default tenant). A tenant names a metrics label and a journal field: 1-64
    characters of [A-Za-z0-9._:-]."""
    if digests:
        scheme, _, key = (authorization or "").partition(" ")
        tenant = digests.get(hashlib.sha256(key.strip().encode()).digest()) if scheme.lower() == "bearer" else None
        if tenant is None:
            raise HttpError("invalid_api_key", "a valid API key is required (Authorization: Bearer <key>)"
                            if not authorization else "the API key is not valid")
        if not settings.trust_tenant_header:
            return tenant
    if header is None or not settings.tenant_header:
        return tenant if digests else ""
    if not _TENANT_RE.fullmatch(header):
        raise HttpError("invalid_request", f"{settings.tenant_header} must be 1-64 characters of A-Z a-z 0-9 . _ : -, "
                                           f"got {header[:80]!r}")
    return header


_TENANT_RE = re.compile(r"[A-Za-z0-9._:-]{1,64}")


def priority_class_header(value: str | None) -> str:
    """The x-flexlb-priority-class header (the body's `priority_class` wins): a class or ""."""
    if value is None:
        return ""
    if value not in CLASSES:
        raise HttpError("invalid_request", f"x-flexlb-priority-class must be one of {', '.join(CLASSES)}, got {value[:40]!r}")
    return value


def grant_class(settings, tenant: str, asked: str, priority: int | None) -> tuple[str, int | None, str]:
    """The class a request runs at, by its tenant's grant (settings.py, `tenant_classes`):
    (class, priority, the class asked if it was lowered else ""). `asked`: the class it named
    ("": none; then its numeric priority's band, or its tenant's default when it gave neither).
    Grants are off (every class open: what it asked, unchanged) unless API keys or
    `tenant_classes` are configured. Lowered: to the highest granted class below the one asked
    (none: the tenant's default), the priority clamped into that class's band; with
    `strict_priority`, 403 priority_not_granted instead."""
    if not settings.tenant_classes and not settings.tenant_api_keys:
        return asked, priority, ""
    granted = settings.tenant_classes.get(tenant or DEFAULT_TENANT, DEFAULT_GRANT)
    if not asked:
        if priority is None:
            return granted[0], None, ""
        asked = class_of_priority(priority)
    if asked in granted:
        return asked, priority, ""
    if settings.strict_priority:
        raise HttpError("priority_not_granted", f"priority class {asked} is not granted to tenant {tenant or DEFAULT_TENANT} "
                                                f"(granted: {', '.join(granted)})")
    below = [c for c in CLASSES[CLASSES.index(asked) + 1:] if c in granted]
    got = below[0] if below else granted[0]
    if priority is not None:
        low, high = CLASS_BANDS[got]
        priority = min(high, max(low, priority))
    return got, priority, asked


ADMIN_PATHS = ("/admin/", "/docs", "/redoc", "/openapi.json")  # what --admin-port moves off the public port


def _is_admin_path(path: str) -> bool:
    return path.startswith(ADMIN_PATHS) or path == "/admin"


def public_only(app):
    """The public listener's app with --admin-port: the API, /healthz, /readyz, /metrics,
    /v1/models; an admin path is 404 not_found here (it is served on the admin port)."""

    async def public(scope, receive, send):
        if scope["type"] == "http" and _is_admin_path(scope["path"]):
            await send_error(send, "not_found", "not served on this port (the admin API has a port of its own)")
            return
        await app(scope, receive, send)

    return public


def admin_only(app):
    """The admin listener's app with --admin-port: /admin/*, /docs, /openapi.json (and the
    health probes); anything else is 404 not_found here (the API is on the public port)."""

    async def admin(scope, receive, send):
        if scope["type"] == "http" and not (_is_admin_path(scope["path"]) or scope["path"] in ("/healthz", "/readyz")):
            await send_error(send, "not_found", "not served on the admin port")
            return
        await app(scope, receive, send)

    return admin


def _openapi(app: FastAPI) -> dict:
    """FastAPI's schema of its own routes plus the generation and embeddings endpoints, which are served
    on the raw ASGI path (CompletionsFront) and so unknown to FastAPI: their bodies' schemas
    come from the msgspec structs that parse them (schemas/api.py), the errors from
    schemas/errors.py. What /docs shows and an API fuzzer reads."""
    from fastapi.openapi.utils import get_openapi

    from schemas.api import ChatCompletionRequest

    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    from services.embeddings import EmbeddingRequest

    (completion, chat, embeddings), defs = msgspec.json.schema_components(
        [CompletionRequest, ChatCompletionRequest, EmbeddingRequest], ref_template="#/components/schemas/{name}")
    schema.setdefault("components", {}).setdefault("schemas", {}).update(defs)
    statuses = sorted({c.http_status for c in ERROR_CODES.values()})
    error = {"description": "refused or failed: {\"error\": {\"code\", \"message\", \"retryable\"}} "
                            "(schemas/errors.py)", "content": {"application/json": {"schema": {"type": "object"}}}}
    messages = {"type": "object", "required": ["max_tokens", "messages"], "properties": {
        "model": {"type": "string"}, "max_tokens": {"type": "integer"}, "system": {},
        "messages": {"type": "array", "items": {"type": "object", "required": ["role", "content"], "properties": {
            "role": {"type": "string", "enum": ["user", "assistant"]}, "content": {}}}},
        "stop_sequences": {"type": "array", "items": {"type": "string"}}, "stream": {"type": "boolean"},
        "temperature": {"type": "number"}, "top_p": {"type": "number"}, "tools": {"type": "array"},
        "tool_choice": {"type": "object"}}}
    for path, body, what in (("/v1/completions", completion, "text completion (OpenAI API)"),
                             ("/v1/chat/completions", chat, "chat completion (OpenAI API)"),
                             ("/v1/messages", messages, "message (Anthropic's Messages API; services/anthropic.py)"),
                             ("/v1/responses", {"type": "object", "required": ["input"], "properties": {
                                 "model": {"type": "string"}, "input": {}, "instructions": {"type": "string"},
                                 "max_output_tokens": {"type": "integer"}, "stream": {"type": "boolean"},
                                 "tools": {"type": "array"}}},
                              "response (OpenAI's Responses API; services/responses.py)"),
                             ("/v1/embeddings", embeddings, "embeddings (OpenAI API; services/embeddings.py)")):
        schema["paths"][path] = {"post": {
            "summary": what, "operationId": path.strip("/").replace("/", "_"),
            "requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
            "responses": {"200": {"description": "the completion (JSON, or server-sent events with stream)",
                                  "content": {"application/json": {"schema": {"type": "object"}},
                                              "text/event-stream": {"schema": {"type": "string"}}}},
                          **{str(s): error for s in statuses}},
        }}
    app.openapi_schema = schema
    return schema


def cross_site_refusal(headers: Mapping[str, str]) -> str:
    """Why an admin state change looks like a browser's cross-site request ("": it does not).
    A page on another site can make the operator's browser send a "simple" request (a form's
    or fetch's POST with a text/plain, form or multipart body, no custom header) to a router
    on localhost without any preflight; it cannot send `Content-Type: application/json`, and
    a browser names the page's site in `Origin` (and `Sec-Fetch-Site`). So: JSON only, and an
    Origin, when sent, must be the very host:port the request went to."""
    ctype = headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype != "application/json":
        return f"an admin state change needs Content-Type: application/json (a body of {{}} will do), got {ctype[:40]!r}"
    if headers.get("sec-fetch-site", "").lower() == "cross-site":
        return "a cross-site request may not change the router's state (Sec-Fetch-Site: cross-site)"
    origin = headers.get("origin")
    if origin is not None:
        _, sep, netloc = origin.partition("://")
        if not sep or netloc.lower() != headers.get("host", "").lower():
            return f"Origin {origin[:80]!r} is not this router ({headers.get('host', '')[:80]!r})"
    return ""


def _error(code: str, message: str, request_id: str | None = None) -> Response:
    status, body = error_status(code), error_body(code, message)
    headers = {"X-Request-Id": request_id} if request_id else None
    return Response(body, status_code=status, media_type="application/json", headers=headers)


def parse_completion(body: bytes, settings,
                     tokenizer: ByteTokenizer | HFTokenizer = BYTE_TOKENIZER) -> tuple[CompletionRequest, list[int], dict]:
    """Decode and validate a completion body; raise HttpError with a design code. A text
    prompt becomes `tokenizer`'s ids. Fields FlexLB does not know (logprobs, echo, ...; not
    null) come back apart, for the engine (ForEngine.extra_body)."""
    req, extra = decode_with_extra(body, _STRICT_REQ_DECODER, _REQ_DECODER, _COMPLETION_FIELDS, settings, "a prompt")
    check_max_tokens(req.max_tokens, settings)
    if req.n != 1:
        raise HttpError("invalid_request", f"n: only one choice per request is supported, got {req.n}")
    if req.stream_options is not None and not req.stream:
        raise HttpError("invalid_request", "stream_options: only with stream true")
    if isinstance(req.prompt, str):
        bound = tokenizer.max_chars_per_token  # cheap bound before tokenizing (module docstring)
        if bound is not None and len(req.prompt) > settings.max_prompt_tokens * bound:
            raise HttpError("too_large", f"prompt of {len(req.prompt)} characters exceeds the limit of "
                                          f"{settings.max_prompt_tokens} tokens (one token is at most {bound} characters)")
        tokens = tokenizer.encode(req.prompt)
    else:
        tokens = req.prompt
        if any(t < 0 or t >= 1 << 31 for t in tokens):
            raise HttpError("invalid_request", "prompt token ids must be in [0, 2^31)")
    if not tokens:
        raise HttpError("invalid_request", "prompt is empty")
    if len(tokens) > settings.max_prompt_tokens:
        raise HttpError("too_large", f"prompt of {len(tokens)} tokens exceeds the limit of {settings.max_prompt_tokens}")
    check_options(req, settings)
    return req, tokens, extra


def models_body(models: dict[str, list[str]]) -> dict:
    """/v1/models (OpenAI's list, as vLLM gives it): every model (model -> its workers' loaded
    LoRA adapters, WorkerView.models), then each adapter as a model with its `parent`."""
    data: list[dict] = [{"id": model, "object": "model", "owned_by": "flexlb", "root": model, "parent": None}
                        for model in models]
    data += [{"id": adapter, "object": "model", "owned_by": "flexlb", "root": adapter, "parent": model}
             for model, adapters in models.items() for adapter in adapters]
    return {"object": "list", "data": data}


def _header_ms(raw: str | None, name: str) -> float | None:
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        raise HttpError("invalid_request", f"header {name} must be a number of ms, got {raw[:40]!r}") from None
    if not (value > 0 and value < 1e9):
        raise HttpError("invalid_request", f"header {name} must be positive, got {raw[:40]!r}")
    return value


def timeout_of(body_s: float | None, header_ms: float | None, server_s: float) -> float | None:
    """A request's own deadline: the body's `timeout_s` (checked: at most the server's) and the
    `X-Request-Timeout-Ms` header (capped by the server's `request_timeout_s`), the sooner of the
    two; None: neither (the server's). Past it the request is cancelled at the engine, wherever
    it is, and its client gets 504 `timed_out` (README, Failures)."""
    header_s = min(header_ms / 1000.0, server_s) if header_ms is not None else None
    given = [t for t in (body_s, header_s) if t is not None]
    return min(given) if given else None


TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-[^\x00-\x1f\x7f]*)?")
TRACEPARENT_MAX_CHARS = 512  # a later version may append fields; nothing longer is a trace context


def traceparent_of(raw: str | None) -> str:
    """The client's W3C `traceparent`, as version 00 (a later version's first four fields, as
    the W3C Trace Context spec asks of a party that knows 00 only); "" without one. A malformed
    one is refused (invalid_request, 400), not dropped, so a client learns its tracing is broken."""
    if raw is None:
        return ""
    match = TRACEPARENT.fullmatch(raw) if len(raw) <= TRACEPARENT_MAX_CHARS else None
    if match is None or match[1] == "ff" or (match[1] == "00" and match[5]) or set(match[2]) == {"0"} or set(match[3]) == {"0"}:
        raise HttpError("invalid_request", "header traceparent is not a W3C trace context "
                                               "(version-trace_id-parent_id-flags, lowercase hex, ids not all zero)")
    return f"00-{match[2]}-{match[3]}-{match[4]}"


def _bad_worker_id(worker_id: str) -> Response | None:
    try:
        validate_token("worker_id", worker_id)
    except ValueError as exc:
        return _error("invalid_request", str(exc))
    return None


class Unauthorized(Exception):
    pass


def create_app(service: RouterService, manage_lifecycle: bool = True) -> "CompletionsFront":
    """The router's ASGI app: `POST /v1/completions` on the raw ASGI path (CompletionsFront),
    everything else (health, metrics, admin, lifespan) through FastAPI."""
    settings = service.settings
    tokenizer = load_tokenizer(settings.tokenizer, settings.tokenizer_add_special_tokens)

    async def admin_auth(request: Request) -> str:
        """/admin/* needs `Authorization: Bearer <admin_token>` when a token is set (and one
        must be set to listen beyond loopback: settings refuse to start otherwise; `flexlb up`
        sets one unless --open-admin). A state change (any method but GET/HEAD) must also be
        one no web page could send cross-site (`cross_site_refusal`)."""
        if settings.admin_token:
            given = request.headers.get("authorization", "")
            if not (given.startswith("Bearer ") and hmac.compare_digest(given[7:].encode(), settings.admin_token.encode())):
                raise Unauthorized()
        if request.method not in ("GET", "HEAD"):
            why = cross_site_refusal(request.headers)
            if why:
                raise HttpError("forbidden", why)
        return request.client.host if request.client else ""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if manage_lifecycle:
            await service.start()
        try:
            yield
        finally:
            if manage_lifecycle:
                await service.stop()

    app = FastAPI(title="FlexLB router", lifespan=lifespan)
    app.openapi = lambda: app.openapi_schema or _openapi(app)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "invalid_request"}.get(exc.status_code, "invalid_request")
        body = error_body(code, str(exc.detail))
        return Response(body, status_code=exc.status_code, media_type="application/json")

    @app.exception_handler(Unauthorized)
    async def unauthorized(request: Request, exc: Unauthorized):
        resp = _error("unauthorized", "the admin API needs a valid bearer token (Authorization: Bearer ...)")
        resp.headers["WWW-Authenticate"] = "Bearer"
        return resp

    @app.exception_handler(HttpError)
    async def refused(request: Request, exc: HttpError):
        return _error(exc.code, exc.message)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        """A bad path or query parameter of a FastAPI route: 400 invalid_request in our one
        error shape (FastAPI's own would be a 422 of its own), naming the parameter, not echoing it."""
        first = (exc.errors() or [{}])[0]
        where = ".".join(str(p) for p in first.get("loc", ()))[:80]
        return _error("invalid_request", f"{where}: {str(first.get('msg', 'invalid'))[:120]}")

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return _error("internal", f"internal error: {exc.__class__.__name__}")

    def identity() -> dict:
        return {"router_id": service.router_id, "boot_id": service.boot_id, "epoch": service.epoch,
                "role": "leader" if service.is_leader else "standby", "scheduling_pool": service.settings.scheduling_pool}

    @app.get("/healthz")
    async def healthz():
        # Liveness of this process: the event loop answers and the core is running.
        if not service.running:
            return _error("not_ready", "router is not running")
        return {"status": "ok", **identity()}

    @app.get("/admin/router")
    async def admin_router(by: str = Depends(admin_auth)):
        """This router's identity and where it is connected (addresses: admin only, never on
        the public /healthz)."""
        return {**identity(), "nats_server": service.nats_server}

    @app.get("/readyz")
    async def readyz(model: str | None = None):
        """The router's readiness; with `?model=NAME`, also that pool's: a live worker serves
        it (or, led by another router: its leader holds the pool's lease). A load balancer
        per model probes its pool, so one model's outage does not take the others' endpoint."""
        ok, reason = await service.readiness()
        if ok and model is not None:
            ok, reason = await service.pool_readiness(model)
            if ok is None:
                return _error("model_not_found", reason)
        if not ok:
            return _error("not_ready", reason)
        return {"status": "ready", "reason": reason, "view_ready_after_ms": service.view_ready_after_ms}

    @app.get("/metrics")
    async def metrics():
        service.refresh_gauges()
        return Response(generate_latest(service.metrics.registry), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return models_body(service.models())

    @app.get("/admin/workers")
    async def admin_workers(by: str = Depends(admin_auth)):
        return {"workers": service.workers_view()}

    @app.post("/admin/workers/{worker_id}/drain")
    async def admin_drain(worker_id: str, by: str = Depends(admin_auth)):
        if (bad := _bad_worker_id(worker_id)) is not None:
            return bad
        return await service.drain(worker_id, by)

    @app.post("/admin/workers/{worker_id}/undrain")
    async def admin_undrain(worker_id: str, by: str = Depends(admin_auth)):
        if (bad := _bad_worker_id(worker_id)) is not None:
            return bad
        return await service.undrain(worker_id, by)

    @app.delete("/admin/workers/{worker_id}")
    async def admin_remove(worker_id: str, force: bool = False, by: str = Depends(admin_auth)):
        if (bad := _bad_worker_id(worker_id)) is not None:
            return bad
        ok, body = await service.remove(worker_id, force, by)
        return body if ok else _error(body["code"], body["message"])

    @app.get("/admin/ledger")
    async def admin_ledger(by: str = Depends(admin_auth)):
        entries = await service.ledger.entries()
        return {"entries": entries, "num_entries": len(entries)}

    @app.get("/admin/requests/{request_id}")
    async def admin_request(request_id: str, by: str = Depends(admin_auth)):
        record = service.records.get(request_id)
        if record is None:
            return _error("not_found", f"no live or recent request {request_id} (the last {len(service.records.records)} are kept)")
        return record

    return CompletionsFront(service, tokenizer, app, resolve_chat_templates(settings, tokenizer))


_GONE = object()  # put in a stream's queue when its client disconnects


def _id_header(request_id: str | None) -> list[tuple[bytes, bytes]] | None:
    return [(b"x-request-id", request_id.encode())] if request_id else None


def error_headers(request_id: str | None, code: str, retry_after_ms: int = 0) -> list[tuple[bytes, bytes]]:
    """The headers of a refusal: X-Request-Id, and for a code in RETRY_AFTER_CODES Retry-After
    in whole seconds (at least 1): `retry_after_ms` rounded up (the fair queue's hint), else
    DEFAULT_RETRY_AFTER_MS. One rule for admission refusals and a stream's failure before its
    response started (module docstring)."""
    headers = _id_header(request_id) or []
    if code in RETRY_AFTER_CODES:
        retry_s = max(1, math.ceil((retry_after_ms or DEFAULT_RETRY_AFTER_MS) / 1000))
        headers.append((b"retry-after", str(retry_s).encode()))
    return headers


class CompletionsFront:
    """`POST /v1/completions`, `/v1/chat/completions`, `/v1/messages`, `/v1/responses` and
    `/v1/embeddings` on the raw ASGI path; every other request goes to FastAPI.

    The completion path is the router's hot path: FastAPI's and Starlette's request,
    response and middleware objects were a third of its CPU per request (bench/README.md,
    "hotpath.py"). Here the body is read from `receive`, parsed by msgspec, and the answer
    sent as ASGI messages; one deadline timer per request bounds the wait for its outcome
    (the request's timeout plus 2 s for the worker's timed_out report to arrive first). A
    streaming client that disconnects cancels its request: a watcher on `receive` tells the
    stream, before its response started as after. The endpoints share the path; what differs
    is the parsing and the shapes (services/chat.py; Anthropic's /v1/messages and OpenAI's
    /v1/responses are translated into a chat request first and answered in their own shapes:
    services/anthropic.py, services/responses.py). An embeddings request takes the same path to
    its worker and is answered whole (services/embeddings.py, `collect_embeddings`).
    """

    PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/responses", "/v1/embeddings")
    # The APIs translated onto the chat path: their request translation and answer shape.
    DIALECTS = {"/v1/messages": (anthropic.to_chat, anthropic.MessagesShape),
                "/v1/responses": (responses.to_chat, responses.ResponsesShape)}

    def __init__(self, service: RouterService, tokenizer: ByteTokenizer | HFTokenizer, app: FastAPI,
                 chat_templates=None) -> None:
        self.service, self.settings, self.tokenizer, self.app = service, service.settings, tokenizer, app
        self.chat_templates = chat_templates
        self.tenant_header = self.settings.tenant_header.lower().encode("latin-1") or None  # (ASGI names are lower case)
        self.key_digests = key_digests(self.settings.tenant_api_keys)  # (tenant_of)
        self.limits = TenantLimits(parse_limits(self.settings.tenant_limits)) if self.settings.tenant_limits else None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] not in self.PATHS:
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked_send(message) -> None:
            nonlocal started
            started = True
            await send(message)

        try:
            if scope["method"] != "POST":
                await send_error(tracked_send, "invalid_request", "Method Not Allowed")
                return
            path = scope["path"]
            embed = path == "/v1/embeddings"
            await self.completions(scope, receive, tracked_send, chat=path != "/v1/completions" and not embed,
                                   dialect=self.DIALECTS.get(path), embed=embed)
        except ClientGone:
            return
        except Exception as exc:
            log.exception("unhandled error on %s", scope["path"])
            if not started:
                await send_error(send, "internal", f"internal error: {exc.__class__.__name__}")

    def _parse(self, body: bytes, chat: bool, embed: bool = False):
        """-> (request, prompt ids, max_tokens, stop strings, sampling, ChatForward or
        EmbedForward or None, include_usage, fields for the engine only)."""
        if embed:  # (one output token: services/embeddings.py)
            req, tokens, forward, extra = parse_embeddings(body, self.settings, self.tokenizer)
            return req, tokens, 1, [], None, forward, False, extra
        if chat:
            p = parse_chat(body, self.settings, self.tokenizer, self.chat_templates)
            return p.req, p.tokens, p.max_tokens, p.stop, p.sampling, p.chat, p.include_usage, p.extra_body
        req, tokens, extra = parse_completion(body, self.settings, self.tokenizer)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return req, tokens, req.max_tokens, stop_strings(req.stop), sampling_of(req), None, include_usage, extra

    async def completions(self, scope, receive, send, chat: bool = False, dialect: tuple | None = None,
                          embed: bool = False) -> None:
        """One completion of any API (`dialect`: (request translation, answer shape) of an API
        translated onto the chat path; None: OpenAI's own), or an embeddings request (`embed`)."""
        service, settings = self.service, self.settings
        request_id = length = slo_ttft_raw = slo_tpot_raw = tenant_raw = api_key = class_raw = traceparent_raw = None
        timeout_raw = None
        tenant_header = self.tenant_header
        for name, value in scope["headers"]:
            if name == b"content-length":
                length = value
            elif name == b"x-request-id":
                request_id = value.decode("latin-1") or None
            elif name == b"x-flexlb-slo-ttft-ms":
                slo_ttft_raw = value.decode("latin-1")
            elif name == b"x-flexlb-slo-tpot-ms":
                slo_tpot_raw = value.decode("latin-1")
            elif name == tenant_header:
                tenant_raw = value.decode("latin-1")
            elif name == b"authorization":
                api_key = value.decode("latin-1")
            elif name == b"x-api-key" and dialect is not None and api_key is None:  # (Anthropic's clients send their key so)
                api_key = "Bearer " + value.decode("latin-1")
            elif name == b"x-flexlb-priority-class":
                class_raw = value.decode("latin-1")
            elif name == b"traceparent":
                traceparent_raw = value.decode("latin-1")
            elif name == b"x-request-timeout-ms":
                timeout_raw = value.decode("latin-1")
        try:
            # who it is first: a client without a valid key costs no body read, parse or tokenization
            tenant = tenant_of(settings, api_key, tenant_raw, self.key_digests)
            body = await read_body(receive, settings.max_body_bytes, length)
            if dialect is not None:
                body = dialect[0](body)
            if self.tokenizer.is_costly or chat or embed:  # an HF tokenizer, a template, many inputs: off the event loop
                req, tokens, max_tokens, stop, sampling, forward, include_usage, extra = await asyncio.to_thread(
                    self._parse, body, chat, embed)
            else:
                req, tokens, max_tokens, stop, sampling, forward, include_usage, extra = self._parse(body, chat)
            request_id = req.request_id or request_id
            if request_id is not None:
                validate_token("request_id", request_id)
            slo_ttft = req.slo_ttft_ms if req.slo_ttft_ms is not None else _header_ms(slo_ttft_raw, "x-flexlb-slo-ttft-ms")
            slo_tpot = req.slo_tpot_ms if req.slo_tpot_ms is not None else _header_ms(slo_tpot_raw, "x-flexlb-slo-tpot-ms")
            priority_class, priority, asked = grant_class(settings, tenant, req.priority_class or priority_class_header(class_raw),
                                                          req.priority)
            traceparent = traceparent_of(traceparent_raw)
            timeout_s = timeout_of(req.timeout_s, _header_ms(timeout_raw, "x-request-timeout-ms"), settings.request_timeout_s)
        except (HttpError, ValueError) as exc:
            code = getattr(exc, "code", "invalid_request")
            message = getattr(exc, "message", str(exc))
            request_id = request_id or service.new_request_id()
            await service.reject(request_id, code, message)
            await send_error(send, code, message, _id_header(request_id))
            return
        request_id = request_id or service.new_request_id()
        limited = False
        if self.limits is not None:
            try:
                limited = self.limits.admit(tenant or DEFAULT_TENANT, len(tokens) + max_tokens, time.monotonic())
            except Refusal as exc:
                await service.reject(request_id, "rate_limited", exc.message)
                await send_error(send, "rate_limited", exc.message, error_headers(request_id, "rate_limited", exc.retry_after_ms))
                return
        request = m.Request(
            request_id=request_id, prompt_token_ids=tokens, max_tokens=max_tokens, priority=priority,
            slo_ttft_ms=slo_ttft, slo_tpot_ms=slo_tpot, timeout_s=timeout_s, sampling=sampling, stop=stop,
            prompt_text=req.prompt if not chat and not embed and isinstance(req.prompt, str) else "",
            chat=None if embed else forward, embed=forward if embed else None, model=req.model or "", tenant=tenant,
            priority_class=priority_class, priority_class_asked=asked, traceparent=traceparent, extra_body=extra or None)
        try:
            await self._serve(request, req.stream, chat, include_usage, receive, send, dialect)
        finally:
            if limited:
                self.limits.release(tenant or DEFAULT_TENANT)

    async def _serve(self, request: m.Request, stream: bool, chat: bool, include_usage: bool, receive, send,
                     dialect: tuple | None = None) -> None:
        """Submit the parsed request and answer it: refused, or its result (streamed or whole)."""
        request_id = request.request_id
        outcome = await self.service.submit(request)
        if not isinstance(outcome, Rejected) and outcome.admission is not None:  # waiting in the fair queue
            outcome = await self.await_admission(outcome, receive)
            if outcome is None:
                return  # the client left while it waited (its request was taken out of the queue)
        if isinstance(outcome, Rejected):
            await send_error(send, outcome.code, outcome.message,
                             error_headers(request_id, outcome.code, outcome.retry_after_ms))
            return
        model = request.model or self.settings.model_name
        if request.embed is not None:
            await self.collect_embeddings(outcome, send, EmbeddingsAnswer(model, len(request.prompt_token_ids)))
            return
        if dialect is not None:
            shape = dialect[1](request_id, model, len(request.prompt_token_ids))
        else:
            shape = (ChatShape if chat else CompletionShape)(request_id, int(time.time()), model, include_usage)
        if stream:
            await self.stream(outcome, receive, send, shape)
        else:
            await self.collect(outcome, send, shape)

    async def await_admission(self, handle: RequestHandle, receive) -> RequestHandle | Rejected | None:
        """Wait while the request is in the fair queue: the handle once admitted, the Rejected
        that refused it, or None if the client went away meanwhile (then it is cancelled)."""

        async def watch_disconnect() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        watcher = asyncio.get_running_loop().create_task(watch_disconnect())
        try:
            async with asyncio.timeout_at(self._deadline(handle)):
                done, _ = await asyncio.wait((handle.admission, watcher), return_when=asyncio.FIRST_COMPLETED)
        except TimeoutError:
            await self.service.cancel(handle, "router request timeout while queued")
            return Rejected("queue_timeout", f"not admitted within {handle.timeout_s}s")
        finally:
            watcher.cancel()
        if handle.admission in done:
            verdict = handle.admission.result()
            return handle if verdict is None else verdict
        await self.service.cancel(handle, "client disconnected while queued")
        return None

    def _deadline(self, handle: RequestHandle) -> float:
        """The router's own deadline (loop time): the request's, plus a little for the
        worker's timed_out report to arrive first (the worker enforces the same deadline)."""
        return asyncio.get_running_loop().time() + handle.timeout_s + 2.0

    async def stream(self, handle: RequestHandle, receive, send, shape) -> None:
        """Server-sent events. The response starts at the request's dispatch or its first token
        or outcome, whichever comes first (module docstring): a failure before that, or the
        router's deadline, is an HTTP error status; after it, an error event in the stream."""
        service = self.service
        rid = handle.request_id
        cursor = OutputCursor(handle.stop)

        async def watch_disconnect() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            handle.queue.put_nowait(_GONE)

        watcher = asyncio.get_running_loop().create_task(watch_disconnect())
        finished = started = False
        queue = handle.queue
        try:
            try:
                async with asyncio.timeout_at(self._deadline(handle)):
                    # Dispatch (mark_dispatched wakes the inbox) or the first item (a token, the
                    # outcome, or the client gone): one future, the inbox's, waits for both.
                    while not handle.dispatched and queue.empty():
                        await queue.wait()
                    head = queue.peek()
                    if head is _GONE:
                        return  # finally: cancel the work
                    if head is not None and not isinstance(head, m.TokensGenerated) and head.outcome != "finished":
                        queue.get_nowait()  # it ended before its response started: an HTTP status
                        finished = True
                        code = head.code or "worker_failed"
                        await send_error(send, code, head.message, error_headers(rid, code))
                        return
                    started = True
                    await send({"type": "http.response.start", "status": 200, "headers": [
                        (b"content-type", SSE_TYPE), (b"x-request-id", rid.encode()), (b"cache-control", b"no-cache")]})
                    first = shape.first()
                    while not finished:
                        # Every chunk already queued goes out in one write: an engine step's
                        # tokens often arrive together, and each ASGI send is a transport write.
                        out: list[bytes] = [first] if first else []
                        first = b""
                        item = await queue.get()
                        while True:
                            if item is _GONE:
                                return  # finally: cancel the work
                            if isinstance(item, m.TokensGenerated):
                                text, reason, stopped = cursor.take(item)
                                if stopped:
                                    shape.stopped_by(cursor.stop_matched)
                                    await service.cancel(handle, "stop string")  # nothing if it already ended
                                if text or reason is not None or item.extra or not shape.skips_empty:
                                    out.append(shape.chunk(text, reason, extra=item.extra))
                                if reason is not None and (handle.stop or shape.include_usage):
                                    # The end is known: with a stop string the Terminal may never come.
                                    if shape.include_usage:
                                        out.append(shape.usage_chunk(cursor.usage(len(handle.prompt_token_ids))))
                                    out.append(shape.done)
                                    finished = True
                                    break
                            else:
                                if item.outcome != "finished":
                                    out.append(shape.error(item.code or "worker_failed", item.message))
                                out.append(shape.done)
                                finished = True
                                break
                            if queue.empty():
                                break
                            item = queue.get_nowait()
                        await send({"type": "http.response.body", "body": b"".join(out), "more_body": not finished})
            except TimeoutError:
                await service.cancel(handle, "router request timeout")
                finished = True
                message = f"no terminal outcome within {handle.timeout_s}s"
                if started:
                    await send({"type": "http.response.body", "body": shape.error("timed_out", message) + shape.done})
                else:
                    await send_error(send, "timed_out", message, error_headers(rid, "timed_out"))
        finally:
            watcher.cancel()
            if not finished and not handle.done:
                # The client went away (or the send failed): stop the work.
                await service.cancel(handle, "client disconnected")

    async def collect_embeddings(self, handle: RequestHandle, send, answer: EmbeddingsAnswer) -> None:
        """An embeddings request's answer: the server's data items (one per chunk) joined
        (services/embeddings.py), or its failure's status."""
        try:
            async with asyncio.timeout_at(self._deadline(handle)):
                while isinstance(item := await handle.queue.get(), m.TokensGenerated):
                    if item.extra:
                        answer.add(item.extra)
        except TimeoutError:
            await self.service.cancel(handle, "router request timeout")
            await send_error(send, "timed_out", f"no terminal outcome within {handle.timeout_s}s", _id_header(handle.request_id))
            return
        if item.outcome != "finished":
            code = item.code or "worker_failed"
            await send_error(send, code, item.message, error_headers(handle.request_id, code))
            return
        await send_bytes(send, 200, answer.body(), JSON_TYPE, _id_header(handle.request_id))

    async def collect(self, handle: RequestHandle, send, shape) -> None:
        service = self.service
        parts: list[str] = []
        joiner = ExtrasJoiner()  # what the engine server said beyond the text (schemas/openai_bodies.py)
        cursor = OutputCursor(handle.stop)
        stopped = False
        try:
            async with asyncio.timeout_at(self._deadline(handle)):
                while not stopped:
                    item = await handle.queue.get()
                    if not isinstance(item, m.TokensGenerated):
                        break
                    text, reason, stopped = cursor.take(item)
                    parts.append(text)
                    if item.extra:
                        joiner.add(item.extra)
                    if stopped:
                        shape.stopped_by(cursor.stop_matched)
                        await service.cancel(handle, "stop string")
        except TimeoutError:
            await service.cancel(handle, "router request timeout")
            await send_error(send, "timed_out", f"no terminal outcome within {handle.timeout_s}s", _id_header(handle.request_id))
            return
        if not stopped:
            if item.outcome != "finished":
                code = item.code or "worker_failed"
                await send_error(send, code, item.message, error_headers(handle.request_id, code))
                return
            reason = item.finish_reason
        body = shape.whole("".join(parts), reason, cursor.usage(len(handle.prompt_token_ids)), joiner)
        await send_bytes(send, 200, body, JSON_TYPE, _id_header(handle.request_id))
