"""Request headers on the completions path, hostile bytes included. The client's W3C trace
context (issue 39's first piece, and issue 35's example of a new Request field): the API
checks a `traceparent` header and sets Request.traceparent; the dispatch carries it
(tests/unit/schemas/test_schemas.py), the openai agent sends it on
(tests/integration/test_upstream_http.py, and end to end tests/integration/test_openai_agent.py).
A bad header is a 400 naming the header, and echoes at most 40 characters of its value."""

from __future__ import annotations

import asyncio
import json

import pytest

from schemas import messages as m
from schemas.http import HttpError
from schemas.tokens import ByteTokenizer
from services.api import CompletionsFront, timeout_of, traceparent_of
from services.core.scheduler import Rejected
from services.settings import RouterSettings

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"
GOOD = f"00-{TRACE}-{PARENT}-01"


def test_a_version_00_trace_context_is_kept_and_a_later_version_is_read_as_00():
    assert traceparent_of(None) == ""
    assert traceparent_of(GOOD) == GOOD
    assert traceparent_of(f"cc-{TRACE}-{PARENT}-00-what-comes-later") == f"00-{TRACE}-{PARENT}-00"


@pytest.mark.parametrize("raw", [
    "", "garbage", GOOD.upper(), GOOD + "-x", f"ff-{TRACE}-{PARENT}-01", f"00-{'0' * 32}-{PARENT}-01",
    f"00-{TRACE}-{'0' * 16}-01", f"00-{TRACE[:-1]}-{PARENT}-01", GOOD + "\r\nx-injected: 1",
    f"cc-{TRACE}-{PARENT}-00-" + "x" * 600,
])
def test_a_malformed_trace_context_is_refused_with_a_code_and_not_echoed(raw):
    with pytest.raises(HttpError) as info:
        traceparent_of(raw)
    assert info.value.code == "invalid_request" and "traceparent" in info.value.message
    assert raw[:20] not in info.value.message or raw == ""


class SubmitRecorder:
    """What the completions path asks of the router: submit (refused here, so no stream
    follows), reject, request ids."""

    def __init__(self) -> None:
        self.settings = RouterSettings()
        self.submitted: list[m.Request] = []
        self.rejected: list[str] = []

    def new_request_id(self) -> str:
        return f"r{len(self.submitted) + len(self.rejected)}"

    async def submit(self, request: m.Request) -> Rejected:
        self.submitted.append(request)
        return Rejected("no_worker", "none here")

    async def reject(self, request_id: str, code: str, message: str) -> None:
        self.rejected.append(code)


def post(front: CompletionsFront, headers: list[tuple[bytes, bytes]], body: bytes | None = None,
         chat: bool = False) -> list[dict]:
    """One request through the completions path (`body`: a small completion by default); the ASGI messages sent."""
    body = json.dumps({"prompt": "hello", "max_tokens": 4}).encode() if body is None else body
    sent: list[dict] = []
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "path": "/v1/chat/completions" if chat else "/v1/completions", "method": "POST",
             "headers": [(b"content-length", str(len(body)).encode()), *headers]}
    asyncio.run(front.completions(scope, receive, send, chat=chat))
    return sent


def test_the_header_becomes_the_requests_traceparent_and_a_bad_one_is_a_400():
    service = SubmitRecorder()
    front = CompletionsFront(service, ByteTokenizer(), app=None)
    post(front, [(b"traceparent", GOOD.encode())])
    post(front, [])
    assert [r.traceparent for r in service.submitted] == [GOOD, ""]
    sent = post(front, [(b"traceparent", b"00-nothex")])
    assert sent[0]["status"] == 400 and service.rejected == ["invalid_request"]
    assert b"traceparent" in sent[1]["body"] and len(service.submitted) == 2


@pytest.mark.parametrize("header", [b"x-flexlb-slo-ttft-ms", b"x-flexlb-slo-tpot-ms", b"x-flexlb-priority-class",
                                    b"x-request-timeout-ms"])
@pytest.mark.parametrize("value", [b"x" * 5000, b"-" + b"9" * 5000])
def test_a_bad_header_is_a_400_naming_it_that_echoes_at_most_40_characters_of_it(header, value):
    service = SubmitRecorder()
    sent = post(CompletionsFront(service, ByteTokenizer(), app=None), [(header, value)])
    body = json.loads(sent[1]["body"])
    assert sent[0]["status"] == 400 and body["error"]["code"] == "invalid_request" and not service.submitted
    assert header.decode() in body["error"]["message"]
    assert value[:40].decode() in body["error"]["message"] and value[:41].decode() not in body["error"]["message"]


def test_a_client_deadline_header_is_the_requests_timeout_capped_by_the_servers():
    service = SubmitRecorder()
    front = CompletionsFront(service, ByteTokenizer(), app=None)
    server_s = service.settings.request_timeout_s
    post(front, [(b"x-request-timeout-ms", b"1500")])
    post(front, [(b"x-request-timeout-ms", str(server_s * 1000 * 10).encode())])  # more than the server allows
    post(front, [])
    assert [r.timeout_s for r in service.submitted] == [1.5, server_s, None]
    assert timeout_of(2.0, 500.0, server_s) == 0.5 and timeout_of(0.25, 500.0, server_s) == 0.25  # the sooner
    sent = post(front, [(b"x-request-timeout-ms", b"0")])
    assert sent[0]["status"] == 400 and len(service.submitted) == 3


# ------------------------------------------------------------------ identity (issue 37, first part)
def keyed(trust: bool = False) -> SubmitRecorder:
    service = SubmitRecorder()
    service.settings = RouterSettings(tenant_api_keys={"k-alpha": "alpha", "k-beta": "beta"},
                                      trust_tenant_header=trust).validate()
    return service


@pytest.mark.parametrize("headers", [
    [],  # no key
    [(b"authorization", b"Bearer nope")],  # an unknown key
    [(b"authorization", b"k-alpha")],  # no scheme
    [(b"authorization", b"Basic k-alpha")],
    [(b"x-flexlb-tenant", b"alpha")],  # a tenant header alone is no identity
])
def test_with_api_keys_set_a_request_without_a_known_key_is_401_whatever_tenant_it_names(headers):
    service = keyed()
    sent = post(CompletionsFront(service, ByteTokenizer(), app=None), headers)
    body = json.loads(sent[1]["body"])
    assert sent[0]["status"] == 401 and body["error"]["code"] == "invalid_api_key" and not service.submitted
    assert b"k-alpha" not in sent[1]["body"]  # nothing of a key echoed


def test_the_tenant_is_the_keys_and_the_header_counts_only_behind_a_trusted_gateway():
    service = keyed()
    front = CompletionsFront(service, ByteTokenizer(), app=None)
    post(front, [(b"authorization", b"Bearer k-alpha"), (b"x-flexlb-tenant", b"beta")])
    post(front, [(b"authorization", b"bearer k-beta")])
    assert [r.tenant for r in service.submitted] == ["alpha", "beta"]
    assert "k-alpha" not in front.key_digests.values() and all(len(d) == 32 for d in front.key_digests)  # digests kept
    gateway = keyed(trust=True)
    front = CompletionsFront(gateway, ByteTokenizer(), app=None)
    post(front, [(b"authorization", b"Bearer k-alpha"), (b"x-flexlb-tenant", b"beta")])
    post(front, [(b"authorization", b"Bearer k-alpha")])
    assert [r.tenant for r in gateway.submitted] == ["beta", "alpha"]


def test_without_keys_the_header_names_the_tenant_as_before():
    service = SubmitRecorder()
    post(CompletionsFront(service, ByteTokenizer(), app=None), [(b"x-flexlb-tenant", b"gamma")])
    assert [r.tenant for r in service.submitted] == ["gamma"]


def test_keys_come_from_a_file_or_the_environment_and_a_bad_one_is_refused_without_showing_it(tmp_path):
    from services.settings import SettingsError, load

    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"k-file": "filed"}))
    s = load(RouterSettings, {"FLEXLB_TENANT_API_KEYS": json.dumps({"k-env": "envd"}),
                              "FLEXLB_TENANT_API_KEYS_FILE": str(path)})
    assert s.tenant_api_keys == {"k-env": "envd", "k-file": "filed"}
    with pytest.raises(SettingsError) as err:
        load(RouterSettings, {"FLEXLB_TENANT_API_KEYS": '{"sekrit-key": "bad tenant!"}'})
    assert "sekrit-key" not in str(err.value)
    with pytest.raises(SettingsError) as err:
        load(RouterSettings, {"FLEXLB_TENANT_API_KEYS": '{"sekrit-key": '})
    assert "sekrit" not in str(err.value)
    (tmp_path / "bad.json").write_text('{"sekrit-key": 5}')
    with pytest.raises(SettingsError) as err:
        load(RouterSettings, {"FLEXLB_TENANT_API_KEYS_FILE": str(tmp_path / "bad.json")})
    assert "sekrit" not in str(err.value)


def test_keys_are_never_a_command_line_flag():
    from services.cli import build_parser

    for command in ("router", "up"):
        with pytest.raises(SystemExit):
            build_parser().parse_args([command, "--tenant-api-keys", '{"k": "t"}'])


# ------------------------------------------------------------------ bounded input (issue 37, part of Build 3)
def post_body(front: CompletionsFront, body: bytes, chat: bool = False) -> list[dict]:
    return post(front, [], body, chat)


@pytest.mark.parametrize("model", ["m" * 257, "bad\x00model", "tab\tmodel", "del\x7f"])
@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
def test_a_long_or_unprintable_model_name_is_a_400_echoing_at_most_40_characters(model, chat):
    from schemas.chat_template import ChatTemplates

    service = SubmitRecorder()
    front = CompletionsFront(service, ByteTokenizer(), app=None, chat_templates=ChatTemplates.builtin())
    body = {"model": model, "max_tokens": 2, **({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"})}
    sent = post_body(front, json.dumps(body).encode(), chat)
    err = json.loads(sent[1]["body"])["error"]
    assert sent[0]["status"] == 400 and err["code"] == "invalid_request" and "model" in err["message"], err
    assert len(err["message"]) < 200 and not service.submitted
    ok = post_body(front, json.dumps({**body, "model": "m" * 256}).encode(), chat)  # at the bound: accepted
    assert ok[0]["status"] == 503 and len(service.submitted) == 1  # (SubmitRecorder answers no_worker)


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
def test_json_nested_past_the_decoders_bound_is_a_400_not_a_500(chat):
    service = SubmitRecorder()
    front = CompletionsFront(service, ByteTokenizer(), app=None)
    deep = b"[" * 5000 + b"]" * 5000
    body = (b'{"messages": [{"role": "user", "content": "hi", "name": ' + deep + b'}], "max_tokens": 2}' if chat
            else b'{"prompt": "hi", "max_tokens": 2, "stop": ' + deep + b'}')
    sent = post_body(front, body, chat)
    assert sent[0]["status"] == 400 and json.loads(sent[1]["body"])["error"]["code"] == "invalid_request"


def test_n_other_than_1_is_refused_on_completions_not_silently_ignored():
    service = SubmitRecorder()
    front = CompletionsFront(service, ByteTokenizer(), app=None)
    sent = post_body(front, json.dumps({"prompt": "hi", "max_tokens": 2, "n": 3}).encode())
    assert sent[0]["status"] == 400 and "n:" in json.loads(sent[1]["body"])["error"]["message"] and not service.submitted
    post_body(front, json.dumps({"prompt": "hi", "max_tokens": 2, "n": 1}).encode())
    assert len(service.submitted) == 1


# ------------------------------------------------------------------ priority is granted (issue 37, Build 2)
def granted(strict: bool = False) -> SubmitRecorder:
    service = SubmitRecorder()
    service.settings = RouterSettings(tenant_api_keys={"k-alpha": "alpha", "k-beta": "beta", "k-gamma": "gamma"},
                                      tenant_classes={"alpha": ["standard", "critical"], "gamma": ["sheddable"]},
                                      strict_priority=strict).validate()
    return service


@pytest.mark.parametrize("key, ask, priority, want", [
    # alpha: granted standard (its default) and critical
    (b"k-alpha", None, None, ("standard", None, "")),
    (b"k-alpha", "critical", None, ("critical", None, "")),
    (b"k-alpha", "sheddable", None, ("standard", None, "sheddable")),  # nothing below sheddable: its default
    (b"k-alpha", None, 90, ("critical", 90, "")),
    # beta: not listed, so the default grant (standard, sheddable)
    (b"k-beta", "critical", None, ("standard", None, "critical")),
    (b"k-beta", None, 95, ("standard", 69, "critical")),  # a priority in critical's band is a claim too: clamped
    (b"k-beta", "sheddable", None, ("sheddable", None, "")),
    (b"k-beta", None, None, ("standard", None, "")),
    # gamma: sheddable only
    (b"k-gamma", "critical", None, ("sheddable", None, "critical")),
    (b"k-gamma", None, 50, ("sheddable", 29, "standard")),
])
@pytest.mark.parametrize("where", ["body", "header"])
def test_a_class_not_granted_is_lowered_and_the_request_records_what_it_asked(key, ask, priority, want, where):
    service = granted()
    body = {"prompt": "hello", "max_tokens": 4, **({"priority": priority} if priority is not None else {})}
    headers = [(b"authorization", b"Bearer " + key)]
    if ask is not None and where == "body":
        body["priority_class"] = ask
    elif ask is not None:
        headers.append((b"x-flexlb-priority-class", ask.encode()))
    post(CompletionsFront(service, ByteTokenizer(), app=None), headers, json.dumps(body).encode())
    (r,) = service.submitted
    assert (r.priority_class, r.priority, r.priority_class_asked) == want


def test_strict_priority_refuses_a_class_not_granted_with_403_and_serves_a_granted_one():
    service = granted(strict=True)
    front = CompletionsFront(service, ByteTokenizer(), app=None)
    sent = post(front, [(b"authorization", b"Bearer k-beta"), (b"x-flexlb-priority-class", b"critical")])
    body = json.loads(sent[1]["body"])
    assert sent[0]["status"] == 403 and body["error"]["code"] == "priority_not_granted" and not service.submitted
    assert "standard, sheddable" in body["error"]["message"] and service.rejected == ["priority_not_granted"]
    post(front, [(b"authorization", b"Bearer k-alpha"), (b"x-flexlb-priority-class", b"critical")])
    assert [(r.tenant, r.priority_class) for r in service.submitted] == [("alpha", "critical")]


def test_without_keys_or_grants_every_class_is_open_as_before():
    service = SubmitRecorder()
    post(CompletionsFront(service, ByteTokenizer(), app=None), [(b"x-flexlb-priority-class", b"critical")])
    assert [(r.priority_class, r.priority_class_asked) for r in service.submitted] == [("critical", "")]


@pytest.mark.parametrize("classes", [{"alpha": []}, {"alpha": ["gold"]}, {"alpha": ["standard", "standard"]},
                                     {"bad tenant!": ["standard"]}])
def test_a_bad_grant_is_refused_naming_it(classes):
    from services.settings import SettingsError

    with pytest.raises(SettingsError, match="tenant_classes"):
        RouterSettings(tenant_classes=classes).validate()


def test_the_settings_know_the_cores_classes():
    from services.core.fairness import CLASSES
    from services.settings import DEFAULT_GRANT

    assert set(DEFAULT_GRANT) <= set(CLASSES) and DEFAULT_GRANT[0] == "standard"


def test_request_ids_the_router_makes_are_random_not_a_counter():
    """A guessable next id would let a client claim it first (its own request under that id),
    and the request it belonged to would be refused duplicate_request."""
    from services.shell.intake import ID_RANDOM_BATCH, Intake

    intake = Intake(None)
    ids = [intake.new_request_id() for _ in range(3 * ID_RANDOM_BATCH)]
    assert len(set(ids)) == len(ids) and all(len(i) == 5 + 24 and i.startswith("cmpl-") for i in ids)
    prefixes = {a[:5 + 12] == b[:5 + 12] for a, b in zip(ids, ids[1:])}
    assert prefixes == {False}  # no shared prefix and counter: 96 random bits each
