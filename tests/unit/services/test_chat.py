"""services/chat.py: chat requests parsed, rendered and refused naming the field, tool-call
arguments as the template sees them, stop strings, the OpenAI chat shapes. (The official
OpenAI client against running stacks: tests/integration/test_chat_api.py.)"""

from __future__ import annotations

import json

import msgspec
import pytest

from schemas.chat_template import ChatTemplates
from schemas.http import HttpError
from schemas.openai_bodies import ChatShape
from schemas.tokens import BYTE_TOKENIZER
from services.chat import StopMatcher, parse_chat
from services.settings import RouterSettings

SETTINGS = RouterSettings()


TEMPLATES = ChatTemplates.builtin()


SYSTEM = {"role": "system", "content": "You are terse."}


def parse(body: dict):
    return parse_chat(json.dumps(body).encode(), SETTINGS, BYTE_TOKENIZER, TEMPLATES)


# --------------------------------------------------------------------------- parsing
def test_a_conversation_is_rendered_with_the_template_and_routed_on_its_byte_ids():
    msgs = [SYSTEM, {"role": "user", "content": "Hi"}]
    p = parse({"messages": msgs, "max_completion_tokens": 7, "stop": "x"})
    rendered = TEMPLATES.render(msgs, add_generation_prompt=True)
    assert p.tokens == list(rendered.encode()) and rendered.endswith("<|assistant|>\n")
    assert p.max_tokens == 7 and p.stop == ["x"]
    assert p.chat.messages == msgs and p.chat.add_generation_prompt is True
    # Text content parts are the same conversation as a string content.
    parts = parse({"messages": [SYSTEM, {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]})
    assert parts.tokens == p.tokens and parts.max_tokens == SETTINGS.max_output_tokens


REFUSED = [
    ("n-2", {"n": 2}, "n:"),
    ("unknown-inside-a-known-field", {"stream": True, "stream_options": {"include_usage": True, "x": 1}}, "x"),
    ("unknown-field-name-too-long", {"f" * 65: 1}, "unknown field"),
    ("too-many-unknown-fields", {f"f{i}": 1 for i in range(33)}, "more than 32"),
    ("stream-options-without-stream", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("both-continue-and-generation-prompt", {"continue_final_message": True}, "continue_final_message"),
    ("image-part", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0]"),
    ("no-messages", {"messages": []}, "messages"),
    ("role-missing", {"messages": [{"content": "hi"}]}, "messages[0].role"),
    ("max-tokens-zero", {"max_tokens": 0}, "max_tokens"),
    ("too-many-stops", {"stop": [str(i) for i in range(17)]}, "stop"),
    ("template-kwargs-override", {"chat_template_kwargs": {"messages": []}}, "messages"),
]


def test_fields_only_an_engine_server_honours_go_to_the_engine_as_they_came():
    """Unknown fields (not null) and known ones FlexLB's engines do not honour, at a value other
    than neutral, leave the parse apart (ForEngine.extra_body); the scheduler then routes the
    request only to engine servers behind --engine openai (test_scheduler, engine_fields)."""
    given = {"frobnicate": {"deep": [1, 2.5]}, "logprobs": True, "top_logprobs": 3, "presence_penalty": 0.5,
             "response_format": {"type": "json_object"}, "parallel_tool_calls": False, "nothing": None}
    p = parse({"messages": [{"role": "user", "content": "hi"}], **given})
    assert p.extra_body == {k: v for k, v in given.items() if v is not None}
    neutral = parse({"messages": [{"role": "user", "content": "hi"}], "logprobs": False, "presence_penalty": 0,
                     "response_format": {"type": "text"}})
    assert neutral.extra_body == {}


@pytest.mark.parametrize("extra,needle", [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_what_flexlb_would_not_honour_is_refused_naming_the_field(extra, needle):
    body = {"messages": [{"role": "user", "content": "hi"}], **extra}
    with pytest.raises(HttpError) as err:
        parse(body)
    assert err.value.code == "invalid_request" and needle in err.value.message


def test_tool_call_arguments_reach_the_template_as_objects_as_vllm_renders_them():
    tpl = ChatTemplates(templates={"default": "{% for m in messages %}{% for c in m.tool_calls or [] %}"
                                              "{{ c.function.arguments | tojson }}{% endfor %}{% endfor %}"},
                        special_tokens={}, origin="test")
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"city": "Paris"}'}}
    msgs = [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": None, "tool_calls": [call]}]
    p = parse_chat(json.dumps({"messages": msgs}).encode(), SETTINGS, BYTE_TOKENIZER, tpl)
    assert bytes(p.tokens).decode() == '{"city": "Paris"}'
    assert p.chat.messages[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'  # forwarded as sent


def test_a_template_error_is_a_400_with_the_templates_message():
    strict = ChatTemplates(templates={"default": "{% if messages[0].role != 'user' %}"
                                                 "{{ raise_exception('Conversations must start with a user turn') }}"
                                                 "{% endif %}{{ messages[0].content }}"},
                           special_tokens={}, origin="test")
    with pytest.raises(HttpError) as err:
        parse_chat(json.dumps({"messages": [SYSTEM]}).encode(), SETTINGS, BYTE_TOKENIZER, strict)
    assert "Conversations must start with a user turn" in err.value.message
    with pytest.raises(HttpError) as err:
        parse_chat(json.dumps({"messages": [SYSTEM]}).encode(), SETTINGS, BYTE_TOKENIZER, None)
    assert "--chat-template" in err.value.message


@pytest.mark.parametrize("chunks,stops,out,hit", [
    (["hello wor", "ld"], ["world"], "hello ", True),  # split across chunks: never sent
    (["abc", "def"], ["xyz"], "abcdef", False),
    (["ab", "c"], ["bcd"], "a", False),  # "bc" held: could still become "bcd"
    (["a<", "/s", ">tail"], ["</s>", "tail"], "a", True),  # the earliest stop wins
])
def test_stop_strings_cut_the_text_before_the_first_and_hold_a_possible_start(chunks, stops, out, hit):
    matcher, sent, met = StopMatcher(stops), [], False
    for c in chunks:
        text, met = matcher.feed(c)
        sent.append(text)
        if met:
            break
    assert "".join(sent) == out and met is hit
    if not hit:
        assert "".join(sent) + matcher.flush() == "".join(chunks)


def test_the_first_chunk_says_the_role_and_a_chunk_without_text_carries_no_content():
    shape = ChatShape("chatcmpl-1", 7, "m")
    first = json.loads(shape.first()[6:])
    assert first["object"] == "chat.completion.chunk" and first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    end = json.loads(shape.chunk("", "length")[6:])
    assert end["choices"][0]["delta"] == {} and end["choices"][0]["finish_reason"] == "length" and "usage" not in end


def test_usage_chunk_json_is_openai_shaped():
    shape = ChatShape("chatcmpl-2", 7, "m", include_usage=True)
    from schemas.openai_bodies import usage_of

    body = msgspec.json.decode(shape.usage_chunk(usage_of(10, 3, 4))[6:])
    assert body["choices"] == [] and body["usage"] == {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13,
                                                       "prompt_tokens_details": {"cached_tokens": 4}}


def test_tool_call_arguments_that_are_not_json_are_refused_naming_the_message():
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{city: Paris"}}
    msgs = [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": None, "tool_calls": [call]}]
    with pytest.raises(HttpError) as err:
        parse({"messages": msgs})
    assert err.value.code == "invalid_request" and "messages[1].tool_calls" in err.value.message
