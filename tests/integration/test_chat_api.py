"""`POST /v1/chat/completions`: parsing and refusals (no network), stop strings, and the
official OpenAI client against `flexlb up` on the sim engine, the torch engine, and the
openai agent in front of `flexlb sim-server` (real NATS, Redis and processes)."""

from __future__ import annotations

import httpx
import pytest
from openai import BadRequestError, OpenAI

from schemas.chat_template import ChatTemplates
from services.infra import free_port
from tests.integration.stack import expected_text, wait_for

TEMPLATES = ChatTemplates.builtin()


SYSTEM = {"role": "system", "content": "You are terse."}


# --------------------------------------------------------------------------- end to end
def client_of(state) -> OpenAI:
    return OpenAI(base_url=state["router_url"] + "/v1", api_key="unused", timeout=120, max_retries=0)


def conversation(turn_reply: str | None = None) -> list[dict]:
    msgs = [SYSTEM, {"role": "user", "content": "Name three colours, please."}]
    if turn_reply is not None:
        msgs += [{"role": "assistant", "content": turn_reply}, {"role": "user", "content": "And three more?"}]
    return msgs


def check_multi_turn_with_the_openai_client(state, model: str, expect_text) -> None:
    """Turn 1 not streamed, turn 2 streamed with include_usage: content, role, finish reason
    and usage right (`expect_text(id, n)`: the engine's text for that request, or None)."""
    client = client_of(state)
    msgs = conversation()
    one = client.chat.completions.create(model=model, messages=msgs, max_tokens=12)
    rendered = TEMPLATES.render(msgs, add_generation_prompt=True)
    choice = one.choices[0]
    assert one.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.finish_reason == "length" and one.usage.completion_tokens == 12
    assert one.usage.prompt_tokens == len(rendered.encode()) and one.usage.total_tokens == one.usage.prompt_tokens + 12
    if expect_text is not None:
        assert choice.message.content == expect_text(one.id, 12)
    msgs2 = conversation(choice.message.content)
    chunks = list(client.chat.completions.create(model=model, messages=msgs2, max_tokens=9, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert reasons == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 9
    assert chunks[-1].usage.prompt_tokens == len(TEMPLATES.render(msgs2, add_generation_prompt=True).encode())
    assert all(c.usage is None for c in chunks[:-1])
    if expect_text is not None:
        assert content == expect_text(chunks[0].id, 9)
    else:
        assert content  # the model's own text


def test_the_openai_client_chats_with_flexlb_up_on_the_sim_engine(flexlb_up):
    _, state = flexlb_up("--time-scale", "0.01", "--workers", "2")
    check_multi_turn_with_the_openai_client(state, "flexlb-sim", expected_text)
    client = client_of(state)
    # Streamed without usage: no usage chunk; a stop string cuts the text (request id known: its text too).
    text = expected_text("chat-stop-1", 30)
    stop = text[10:13]
    cut = text[:text.index(stop)]
    chunks = list(client.chat.completions.create(model="flexlb-sim", messages=conversation(), max_tokens=30, stream=True,
                                                 stop=[stop], extra_body={"request_id": "chat-stop-1"}))
    assert all(c.usage is None for c in chunks) and chunks[-1].choices[0].finish_reason == "stop"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == cut
    whole = client.chat.completions.create(model="flexlb-sim", messages=conversation(), max_tokens=30, stop=stop,
                                           extra_body={"request_id": "chat-stop-2"})
    text2 = expected_text("chat-stop-2", 30)
    expected = text2[:text2.index(stop)] if stop in text2 else text2
    assert whole.choices[0].message.content == expected
    assert whole.choices[0].finish_reason == ("stop" if stop in text2 else "length")
    # Refusals come back as the client's BadRequestError, naming the field.
    with pytest.raises(BadRequestError) as err:
        client.chat.completions.create(model="flexlb-sim", messages=conversation(), n=2)
    assert "n:" in str(err.value)


def test_turn_two_hits_the_prefix_cache_turn_one_filled(flexlb_up):
    """Multi-turn prefix reuse on the sim engine: turn 2's cached tokens >= turn 1's rendered
    prompt, rounded down to whole blocks (16 tokens)."""
    _, state = flexlb_up("--time-scale", "0.01", "--workers", "2")
    client = client_of(state)
    long_system = {"role": "system", "content": "You answer questions about colours. " * 8}
    msgs = [long_system, {"role": "user", "content": "Name three colours, please."}]
    one = client.chat.completions.create(model="flexlb-sim", messages=msgs, max_tokens=8)
    assert one.usage.prompt_tokens_details.cached_tokens == 0
    # The router has folded turn 1's end (its prefill and its hold on the worker are over):
    # a turn sent within the fold's lag may be priced as queued behind turn 1 (README, chat).
    wait_for(lambda: any(e["what"] == "request.finished" for e in httpx.get(
        f"{state['router_url']}/admin/requests/{one.id}", timeout=10).json().get("timeline", [])),
        30, "the router to fold turn 1's end")
    msgs += [{"role": "assistant", "content": one.choices[0].message.content},
             {"role": "user", "content": "And three more?"}]
    two = client.chat.completions.create(model="flexlb-sim", messages=msgs, max_tokens=8)
    block = 16
    assert one.usage.prompt_tokens > 4 * block
    assert two.usage.prompt_tokens_details.cached_tokens >= one.usage.prompt_tokens // block * block


@pytest.mark.timeout(600)
def test_the_openai_client_chats_with_flexlb_up_on_the_torch_engine(flexlb_up):
    pytest.importorskip("torch")
    _, state = flexlb_up("--engine", "torch", "--workers", "1")
    check_multi_turn_with_the_openai_client(state, "flexlb-sim", None)
    # Greedy: the same conversation gives the same text streamed or not.
    client = client_of(state)
    whole = client.chat.completions.create(model="flexlb-sim", messages=conversation(), max_tokens=6)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="flexlb-sim", messages=conversation(), max_tokens=6, stream=True) if c.choices)
    assert streamed == whole.choices[0].message.content


def test_the_openai_client_chats_through_the_openai_agent_in_front_of_sim_servers(flexlb_up, spawn):
    urls = []
    for i in range(2):
        port = free_port()
        spawn("sim-server", "--port", str(port), "--worker-id", f"s{i}", "--time-scale", "0.01", name=f"sim{i}")
        urls.append(f"http://127.0.0.1:{port}")
    for url in urls:
        wait_for(lambda: _healthy(url), 60, f"{url}/health")
    _, state = flexlb_up("--engine", "openai", *[a for u in urls for a in ("--engine-url", u)])
    check_multi_turn_with_the_openai_client(state, "flexlb-sim", expected_text)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
