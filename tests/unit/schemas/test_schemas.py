"""The wire contract: golden payloads decode forever, errors are typed, subjects are safe."""

from __future__ import annotations

import json

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas import messages as m
from schemas.errors import ERROR_CODES, ErrorBody, error_code
from schemas.subjects import ALL_STREAMS, dispatch_subject, token_subject, validate_token
from schemas.tokens import TextDecoder, block_hashes, decode_tokens, encode_text
from tests import REPO

GOLDEN = REPO / "tests" / "golden"
GOLDEN_FILES = sorted(GOLDEN.glob("*.json"))


def test_every_tag_has_a_golden_payload():
    tags = {m.tag_of(t) for t in m.PAYLOAD_TYPES}
    assert tags == {p.stem for p in GOLDEN_FILES}


@pytest.mark.parametrize("path", GOLDEN_FILES, ids=lambda p: p.stem)
def test_golden_payload_decodes_and_round_trips(path):
    data = path.read_bytes()
    env = m.decode(data)
    assert m.tag_of(type(env.payload)) == path.stem
    assert env.schema_version == 1
    # Re-encoding then decoding is lossless for every field the golden file carries (new
    # optional fields, also inside nested structs, may be added beside them).
    again = json.loads(m.encode(env))
    original = json.loads(data)
    _assert_carries(again["payload"], original["payload"], "payload")


def _assert_carries(again, original, where: str) -> None:
    if isinstance(original, dict):
        assert isinstance(again, dict), where
        for key, value in original.items():
            assert key in again, f"{where}.{key} is lost"
            _assert_carries(again[key], value, f"{where}.{key}")
    elif isinstance(original, list):
        assert isinstance(again, list) and len(again) == len(original), where
        for i, (a, o) in enumerate(zip(again, original)):
            _assert_carries(a, o, f"{where}[{i}]")
    else:
        assert again == original, f"{where}: {again!r} != {original!r}"


def test_old_reader_ignores_unknown_new_fields():
    raw = json.loads((GOLDEN / "request.finished.json").read_text())
    raw["payload"]["some_future_field"] = {"x": 1}
    raw["future_envelope_field"] = 3
    env = m.decode(json.dumps(raw).encode())
    assert isinstance(env.payload, m.RequestFinished)


@pytest.mark.parametrize(
    "data,fragment",
    [
        (b"not json", "malformed"),
        (b'{"event_id": "x"}', "missing required field"),
        (b'{"event_id":"x","producer":"p","seq":1,"time_ns":1,"payload":{"type":"no.such"}}', "Invalid value"),
        (b'{"event_id":"x","producer":"p","seq":1,"time_ns":1,"schema_version":99,'
         b'"payload":{"type":"request.cancelled","request_id":"r","worker_id":"w"}}', "newer"),
    ],
    ids=["garbage", "missing-fields", "unknown-tag", "future-version"],
)
def test_undecodable_messages_raise_decode_error_with_reason(data, fragment):
    with pytest.raises(m.DecodeError) as info:
        m.decode(data)
    assert fragment.lower() in str(info.value).lower()


def test_envelope_factory_sequences_are_gap_free():
    f = m.EnvelopeFactory("w1", "boot")
    envs = [f.wrap(m.RequestCancelled(request_id=f"r{i}", worker_id="w1"), time_ns=i) for i in range(5)]
    assert [e.seq for e in envs] == [1, 2, 3, 4, 5]
    assert len({e.event_id for e in envs}) == 5


def test_json_schema_covers_every_tag():
    text = json.dumps(m.json_schema())
    for t in m.PAYLOAD_TYPES:
        assert m.tag_of(t) in text


@pytest.mark.parametrize("spelling", ["prefill", "PREFILL", "ROLE_TYPE_PREFILL", "RoleType.PREFILL", " Prefill "])
def test_role_spellings_parse(spelling):
    assert m.parse_role(spelling) == "prefill"


def test_unknown_role_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown worker role 'vit2'"):
        m.parse_role("vit2")


def test_error_bodies_carry_code_and_retryable():
    body = msgspec.json.decode(msgspec.json.encode(ErrorBody.of("queue_full", "full")))
    assert body == {"error": {"code": "queue_full", "message": "full", "retryable": True}}
    assert error_code("invalid_request").http_status == 400
    assert all(400 <= c.http_status < 600 for c in ERROR_CODES.values())
    with pytest.raises(ValueError):
        error_code("nope")


def test_subject_tokens_are_validated():
    assert validate_token("worker id", "w-1_a") == "w-1_a"
    for bad in ["", "a.b", "a b", "a*", "x" * 129]:
        with pytest.raises(ValueError):
            validate_token("worker id", bad)
    assert dispatch_subject("w1") == "flexlb.cmd.dispatch.w1"
    assert token_subject("r", "q") == "flexlb.tok.r.q"


def test_streams_do_not_overlap():
    seen = set()
    for spec in ALL_STREAMS:
        for subj in spec.subjects:
            assert subj not in seen
            seen.add(subj)
        assert spec.api_config()["name"] == spec.name
        assert spec.api_config()["num_replicas"] == 1 and spec.api_config(3)["num_replicas"] == 3
    for bad in (0, 6):
        with pytest.raises(ValueError, match="replicas must be 1..5"):
            ALL_STREAMS[0].api_config(bad)


def test_block_hashes_chain_and_share_prefixes():
    a = list(range(100))
    b = list(range(64)) + [7] * 36
    ha, hb = block_hashes(a, 16), block_hashes(b, 16)
    assert len(ha) == 6 and len(hb) == 6
    assert ha[:4] == hb[:4] and ha[4] != hb[4]
    # Chaining: the same block content after a different prefix hashes differently.
    assert block_hashes([1] * 16 + [2] * 16, 16)[1] != block_hashes([3] * 16 + [2] * 16, 16)[1]


def test_byte_tokenizer_round_trips_utf8():
    text = "héllo, wörld ✓"
    assert decode_tokens(encode_text(text)) == text


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 255), min_size=1, max_size=40), st.lists(st.integers(1, 5), min_size=40, max_size=40))
def test_text_decoded_chunk_by_chunk_equals_the_whole_decoded_once(ids, cuts):
    """A multi-byte character split across two steps' chunks is sent once, whole."""
    decoder, out, i = TextDecoder(), "", 0
    for cut in cuts:
        if i >= len(ids):
            break
        out += decoder.decode(ids[i:i + cut], final=i + cut >= len(ids))
        i += cut
    assert out == decode_tokens(ids)


def full_request() -> m.Request:
    """A Request with every field off its default (a field added without a value here fails
    test_a_request_travels_whole_in_a_forward)."""
    return m.Request(request_id="r1", prompt_token_ids=[1, 2], max_tokens=5, priority=90, slo_ttft_ms=500.0,
                     slo_tpot_ms=50.0, timeout_s=9.0, sampling=m.Sampling(temperature=0.5), stop=["\n"],
                     chat=m.ChatForward(messages=[{"role": "user", "content": "hi"}]), model="m", tenant="acme",
                     priority_class="standard", priority_class_asked="critical", traceparent=TRACEPARENT,
                     output_offset=3, extra_body={"logprobs": True}, embed=m.EmbedForward(input=["hi", "there"]), prompt_text="hi")


def test_a_request_travels_whole_in_a_forward():
    """A field of Request reaches the leader without anything between naming it: SubmitRequest
    is a Request, and `of` copies every field."""
    req = full_request()
    defaults = m.Request(request_id="", prompt_token_ids=[], max_tokens=0)
    assert all(getattr(req, f) != getattr(defaults, f) for f in m.REQUEST_FIELDS)
    cmd = m.SubmitRequest.of(req, "router-1", "flexlb.tok.router-1.r1")
    back = m.decode(m.encode(m.EnvelopeFactory("p", "b").wrap(cmd, 1))).payload
    assert isinstance(back, m.Request) and back.router_id == "router-1"
    assert {f: getattr(back, f) for f in m.REQUEST_FIELDS} == {f: getattr(req, f) for f in m.REQUEST_FIELDS}


TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_what_the_engine_needs_travels_whole_into_the_dispatch():
    """A BatchRequest is built from the Request's ForEngine part whole (engine_part, as
    services/shell/dispatch.py does), so a field the engine reads needs nothing between."""
    req = full_request()
    assert set(m.ENGINE_FIELDS) <= set(m.REQUEST_FIELDS) and set(m.ENGINE_FIELDS) <= set(m.BatchRequest.__struct_fields__)
    br = m.BatchRequest(**m.engine_part(req), request_id="r1", decode_worker_id="w1", token_subject="flexlb.tok.rt.r1")
    cmd = m.DispatchBatch(batch_id="b1", router_id="rt", worker_id="w1", epoch=1, requests=[br])
    back = m.decode(m.encode(m.EnvelopeFactory("p", "b").wrap(cmd, 1))).payload.requests[0]
    assert {f: getattr(back, f) for f in m.ENGINE_FIELDS} == {f: getattr(req, f) for f in m.ENGINE_FIELDS}
    assert back.traceparent == TRACEPARENT


def test_free_text_of_an_event_is_bounded_at_construction_and_decode_so_it_fits_the_bus():
    """A 2 MB message or reason (a client's string echoed, an upstream's error body) is cut to
    MAX_TEXT_CHARS, so the event stays far inside NATS's 1 MiB default message limit."""
    huge = "x" * 2_000_000
    events = [
        m.RequestRejected(request_id="r", router_id="p", code="invalid_request", message=huge),
        m.RequestFailed(request_id="r", worker_id="w", code="upstream_error", message=huge),
        m.RequestCancelled(request_id="r", worker_id="w", reason=huge),
        m.RequestAdmitted(request_id="r", router_id="p", prefill_worker_id="w", decode_worker_id="w",
                          num_prompt_tokens=1, max_tokens=1, reason=huge, model="m" * 256, tenant="t" * 64),
        m.RouteDecided(request_id="r", router_id="p", decision_seq=1, seed=0, stage="prefill", policy="x",
                       picked_worker_id="w", reason=huge),
        m.SubmitReply(request_id="r", router_id="p", admitted=False, code="internal", message=huge),
        m.CancelRequest(request_id="r", worker_id="w", reason=huge),
    ]
    factory = m.EnvelopeFactory("p", "b")
    for event in events:
        data = m.encode(factory.wrap(event, 1))
        assert len(data) < m.MAX_TEXT_CHARS + 2000 < 1024 * 1024, type(event).__name__
        text = getattr(event, "message", None) or event.reason
        assert len(text) == m.MAX_TEXT_CHARS and text.endswith("[truncated]")
        back = m.decode(data).payload
        assert back == event
    raw = m.encode(factory.wrap(m.RequestRejected(request_id="r", router_id="p", code="c", message="ok"), 1))
    raw = raw.replace(b'"ok"', b'"' + b"y" * 5000 + b'"')  # a longer one written by an older or foreign publisher
    assert len(m.decode(raw).payload.message) == m.MAX_TEXT_CHARS
    short = m.RequestRejected(request_id="r", router_id="p", code="c", message="x" * m.MAX_TEXT_CHARS)
    assert short.message == "x" * m.MAX_TEXT_CHARS  # at the bound: untouched
