"""The router's chat-template rendering against Hugging Face transformers' own.

The story: an OpenAI chat request reaches the router, which renders `messages` with the
model's template and tokenizes the text; the engine behind it would have called
transformers' `apply_chat_template`. So for real model families' templates (the verbatim
copies `trl` ships, found on disk without importing trl, which is installed without its
dependencies) the rendering must equal transformers', text and token ids, over the
conversations a router sees: a system prompt, several turns, a generation prompt on and
off, a final message to continue, tools, reasoning, content parts. A template that refuses a
conversation (Gemma has no system role) must refuse it with transformers' message.

The tokenizer is built here: a byte-level BPE trained in memory on the templates and the
conversations, with every control token the template writes (`<|im_start|>`,
`<start_of_turn>`, `<｜Assistant｜>`, ...) and the model's bos/eos added as special tokens,
wrapped by transformers' `PreTrainedTokenizerFast`, saved with `save_pretrained`, and read
back by `load_chat_templates(model_dir=...)` + `HFTokenizer` as the router reads a model.

Then the resolution order of `load_chat_templates`, named templates, errors, and the
built-in default against a hand-written expected string.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

from schemas.chat_template import (
    DEFAULT_CHAT_TEMPLATE,
    ChatTemplateError,
    ChatTemplates,
    load_chat_templates,
)
from schemas.tokens import HFTokenizer
from tests import REPO

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")


def _trl_templates_dir() -> Path:
    spec = importlib.util.find_spec("trl")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("trl (for its verbatim chat templates) is not installed", allow_module_level=True)
    return Path(spec.submodule_search_locations[0]) / "chat_templates"


TEMPLATES_DIR = _trl_templates_dir()

# Template file (trl/chat_templates/<name>.jinja) -> (its family, its model's named special
# tokens as in the model's tokenizer_config.json): 17 templates of 13 families, plus Qwen 3's
# training variant for the {% generation %} tag.
FAMILIES = {
    "llama3": ("Llama 3", {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}),
    "llama3_1": ("Llama 3", {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}),
    "llama3_2": ("Llama 3", {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}),
    "qwen2_5": ("Qwen 2.5", {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}),
    "qwen3": ("Qwen 3", {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}),
    "qwen3_training": ("Qwen 3", {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}),
    "gemma": ("Gemma", {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>"}),
    "gemma3": ("Gemma 3", {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>"}),
    "deepseekv3": ("DeepSeek", {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>"}),
    "deepseek_r1_distill": ("DeepSeek", {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>"}),
    "cohere": ("Cohere", {"bos_token": "<BOS_TOKEN>", "eos_token": "<|END_OF_TURN_TOKEN|>", "pad_token": "<PAD>"}),
    "cohere2": ("Cohere", {"bos_token": "<BOS_TOKEN>", "eos_token": "<|END_OF_TURN_TOKEN|>", "pad_token": "<PAD>"}),
    "phi3": ("Phi-3", {"bos_token": "<s>", "eos_token": "<|endoftext|>", "unk_token": "<unk>"}),
    "phi3_5": ("Phi-3", {"bos_token": "<s>", "eos_token": "<|endoftext|>", "unk_token": "<unk>"}),
    "glm4moe": ("GLM-4", {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}),
    "gptoss": ("gpt-oss", {"bos_token": "<|startoftext|>", "eos_token": "<|return|>", "pad_token": "<|endoftext|>"}),
    "lfm2": ("LFM2", {"bos_token": "<|startoftext|>", "eos_token": "<|im_end|>", "pad_token": "<|pad|>"}),
    "nemotron_3_nano": ("Nemotron", {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}),
}

# --- conversations ------------------------------------------------------------------------

SYSTEM = {"role": "system", "content": "You are a terse assistant. Answer in one line."}


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str, **extra) -> dict:
    return {"role": "assistant", "content": text, **extra}


TURNS = [user("What is the capital of France?"), assistant("Paris."), user("And of Japan? Answer with ☕ café.")]

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "The city, e.g. Zürich"},
                           "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city"],
        },
    },
}
TOOL_ROUND_TRIP = [
    user("Weather in Zürich?"),
    # content None, as OpenAI clients send it next to tool_calls: dropped before rendering
    assistant(None, tool_calls=[{"id": "call_1", "type": "function",
                                 "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}]),
    {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": '{"temperature_c": 21}'},
]

# name -> (messages, render keyword arguments)
SCENARIOS = {
    "system+turns+gen": ([SYSTEM, *TURNS], {"add_generation_prompt": True}),
    "system+turns": ([SYSTEM, *TURNS, assistant("Tokyo.")], {"add_generation_prompt": False}),
    "turns+gen": (TURNS, {"add_generation_prompt": True}),
    "single-user": ([user("Hi")], {"add_generation_prompt": False}),
    "continue-final": ([SYSTEM, *TURNS, assistant("The capital of Japan is")], {"continue_final_message": True}),
    "tools+gen": ([SYSTEM, user("Weather in Zürich?")], {"add_generation_prompt": True, "tools": [WEATHER_TOOL]}),
    "tool-round-trip": (TOOL_ROUND_TRIP, {"add_generation_prompt": True, "tools": [WEATHER_TOOL]}),
    "reasoning": ([user("2+2?"), assistant("4", reasoning_content="Two plus two is four."), user("3+3?")],
                  {"add_generation_prompt": True}),
    # under vLLM's newer name `reasoning`: transformers copies it to the names templates read
    "reasoning-final": ([user("2+2?"), assistant("4", reasoning="Two plus two is four.")], {}),
    "content-parts": ([{"role": "user", "content": [{"type": "text", "text": "Describe "},
                                                    {"type": "text", "text": "this."}]}],
                      {"add_generation_prompt": True}),
}

# Which scenarios run on which templates. Every template: the plain conversations; templates
# that read tools / reasoning / content parts: those. A (template, scenario) in REFUSED must
# make transformers raise, and the router must raise the same message.
TOOL_TEMPLATES = ("llama3_1", "llama3_2", "qwen2_5", "qwen3", "glm4moe", "gptoss", "lfm2", "nemotron_3_nano")
REASONING_TEMPLATES = ("qwen3", "qwen3_training", "gptoss", "nemotron_3_nano", "glm4moe")
PARTS_TEMPLATES = ("gemma3", "qwen3", "llama3_2", "lfm2")
REFUSED = {
    ("gemma", "system+turns+gen"), ("gemma", "system+turns"), ("gemma", "continue-final"),  # no system role
    ("lfm2", "tool-round-trip"),  # its template dumps a tool call's fields it does not find (TypeError)
}


def cases():
    plain = ("system+turns+gen", "system+turns", "turns+gen", "single-user", "continue-final")
    for family in FAMILIES:
        names = list(plain)
        names += ["tools+gen", "tool-round-trip"] if family in TOOL_TEMPLATES else []
        names += ["reasoning", "reasoning-final"] if family in REASONING_TEMPLATES else []
        names += ["content-parts"] if family in PARTS_TEMPLATES else []
        for name in names:
            yield pytest.param(family, name, id=f"{family}-{name}")


# --- a model directory per family, built once ----------------------------------------------

CONTROL_TOKEN = re.compile(r"<\|[A-Za-z0-9_]+\|>|<｜[^｜<>]+｜>|<(?:start|end)_of_turn>|<\|?[A-Z_]+\|?>"
                           r"|</?(?:think|tool_call|tool_response|tools)>")


def control_tokens(source: str, named: dict[str, str]) -> list[str]:
    found = dict.fromkeys(CONTROL_TOKEN.findall(source))
    found.update(dict.fromkeys(named.values()))
    return list(found)


def corpus(source: str) -> list[str]:
    texts = [source]
    for messages, _ in SCENARIOS.values():
        texts += [json.dumps(messages, ensure_ascii=False), json.dumps(WEATHER_TOOL, ensure_ascii=False)]
    return texts * 3


class Model:
    """One family's template, its transformers tokenizer, and the directory it saved."""

    def __init__(self, family: str, directory: Path) -> None:
        from tokenizers import decoders, models, pre_tokenizers, trainers
        from transformers import PreTrainedTokenizerFast

        self.family = family
        self.source = (TEMPLATES_DIR / f"{family}.jinja").read_text(encoding="utf-8")
        self.named = FAMILIES[family][1]
        backend = tokenizers.Tokenizer(models.BPE())
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=700, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                      special_tokens=control_tokens(self.source, self.named), show_progress=False)
        backend.train_from_iterator(corpus(self.source), trainer)
        self.hf = PreTrainedTokenizerFast(tokenizer_object=backend, chat_template=self.source, **self.named)
        self.hf.save_pretrained(str(directory))
        self.directory = directory


@pytest.fixture(scope="module")
def model_for(tmp_path_factory):
    built: dict[str, Model] = {}

    def get(family: str) -> Model:
        if family not in built:
            built[family] = Model(family, tmp_path_factory.mktemp(family))
        return built[family]

    return get


def transformers_render(model: Model, messages: list[dict], tokenize: bool, kwargs: dict):
    out = model.hf.apply_chat_template(messages, tokenize=tokenize, **kwargs)
    return out["input_ids"] if tokenize and not isinstance(out, list) else out


# --- fidelity -----------------------------------------------------------------------------


@pytest.mark.parametrize("family,scenario", list(cases()))
def test_rendering_equals_transformers(model_for, family, scenario):
    model = model_for(family)
    messages, kwargs = SCENARIOS[scenario]
    ours = ChatTemplates(templates={"default": model.source}, special_tokens=model.named, origin=family)
    sent = json.dumps(messages)

    if (family, scenario) in REFUSED:
        with pytest.raises(Exception) as theirs:
            transformers_render(model, messages, False, kwargs)
        with pytest.raises(ChatTemplateError) as mine:
            ours.render(messages, **kwargs)
        assert str(theirs.value) and str(theirs.value) in str(mine.value)
        return

    expected = transformers_render(model, messages, False, kwargs)
    rendered = ours.render(messages, **kwargs)
    assert rendered == expected
    assert json.dumps(messages) == sent  # the caller's messages are not modified

    # The ids: the router's path from the saved model directory (template, special tokens
    # and tokenizer.json as a model ships them) against transformers' tokenize=True.
    loaded = load_chat_templates(model_dir=str(model.directory))
    assert loaded is not None and loaded.origin == str(model.directory / "chat_template.jinja")
    assert loaded.special_tokens == model.hf.special_tokens_map
    ids = HFTokenizer(str(model.directory), add_special_tokens=False).encode(loaded.render(messages, **kwargs))
    assert ids == transformers_render(model, messages, True, kwargs)


def test_at_least_ten_families_are_compared():
    compared = {FAMILIES[template][0] for template, _ in (p.values for p in cases())}
    assert len(compared) >= 10, sorted(compared)


def test_the_generation_tag_renders_its_body():
    source = (TEMPLATES_DIR / "qwen3_training.jinja").read_text(encoding="utf-8")
    assert "{% generation %}" in source
    rendered = ChatTemplates(templates={"default": source}).render([user("Hi"), assistant("Hello there.")])
    assert rendered.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\nHello there.<|im_end|>\n")


def test_a_system_prompt_gemma_refuses_surfaces_its_own_message():
    source = (TEMPLATES_DIR / "gemma.jinja").read_text(encoding="utf-8")
    with pytest.raises(ChatTemplateError, match="^System role not supported$"):
        ChatTemplates(templates={"default": source}).render([SYSTEM, user("Hi")])


def test_continue_final_message_errors_are_transformers():
    templates = ChatTemplates.builtin()
    with pytest.raises(ChatTemplateError, match="not compatible"):
        templates.render([user("Hi"), assistant("Hel")], continue_final_message=True, add_generation_prompt=True)
    with pytest.raises(ChatTemplateError, match='has no "content" to continue'):
        templates.render([user("Hi"), assistant(None)], continue_final_message=True)
    deleting = ChatTemplates(templates={"default": "{% for m in messages %}[{{ m.role }}]{% endfor %}"})
    with pytest.raises(ChatTemplateError, match="not an accepted field"):
        deleting.render([user("Hi")], continue_final_message=True)
    with pytest.raises(ChatTemplateError, match="empty conversation"):
        templates.render([], add_generation_prompt=True)


# --- the built-in default -----------------------------------------------------------------


def test_the_builtin_default_renders_the_documented_text():
    templates = ChatTemplates.builtin()
    assert templates.templates == {"default": DEFAULT_CHAT_TEMPLATE}
    assert templates.special_tokens == {} and templates.origin == "built-in default"
    conversation = [SYSTEM, user("Hi"), assistant("Hello!"), user("Bye")]
    assert templates.render(conversation, add_generation_prompt=True) == (
        "<|system|>\nYou are a terse assistant. Answer in one line.\n"
        "<|user|>\nHi\n<|assistant|>\nHello!\n<|user|>\nBye\n<|assistant|>\n")
    assert templates.render(conversation) == (
        "<|system|>\nYou are a terse assistant. Answer in one line.\n"
        "<|user|>\nHi\n<|assistant|>\nHello!\n<|user|>\nBye\n")
    assert templates.render([user("Hi"), assistant("The answer is ")], continue_final_message=True) == (
        "<|user|>\nHi\n<|assistant|>\nThe answer is ")
    parts = {"role": "user", "content": [{"type": "text", "text": "Look:"}, {"type": "image_url", "image_url": {}},
                                         {"type": "text", "text": "what is it?"}]}
    assert templates.render([parts]) == "<|user|>\nLook:\nwhat is it?\n"
    assert templates.render([user("Hi"), {"role": "assistant", "content": None}]) == "<|user|>\nHi\n<|assistant|>\n\n"


# --- variables --------------------------------------------------------------------------------

ECHO = ("{{ bos_token }}|{{ eos_token }}|{{ tools | tojson }}|{{ documents | tojson }}|{{ flavour }}|"
        "{{ add_generation_prompt }}|{% for m in messages %}{{ m.content }}{% endfor %}")


def test_special_tokens_tools_documents_and_kwargs_reach_the_template():
    templates = ChatTemplates(templates={"default": ECHO}, special_tokens={"bos_token": "<s>", "eos_token": "</s>"})
    rendered = templates.render([user("Zürich")], tools=[WEATHER_TOOL], documents=[{"title": "T", "text": "x"}],
                                add_generation_prompt=True,
                                chat_template_kwargs={"flavour": "mint", "eos_token": "<END>"})
    assert rendered == (f"<s>|<END>|{json.dumps([WEATHER_TOOL], ensure_ascii=False)}|"
                        '[{"title": "T", "text": "x"}]|mint|True|Zürich')


@pytest.mark.parametrize("key", ["messages", "tools", "documents", "add_generation_prompt", "continue_final_message"])
def test_chat_template_kwargs_may_not_replace_the_request(key):
    with pytest.raises(ChatTemplateError, match=f"'{key}'"):
        ChatTemplates.builtin().render([user("Hi")], chat_template_kwargs={key: "x"})


def test_raise_exception_surfaces_the_template_message():
    templates = ChatTemplates(templates={"default": "{% if messages[0].role != 'user' %}"
                                                    "{{ raise_exception('Conversations must start with a user turn') }}"
                                                    "{% endif %}ok"})
    assert templates.render([user("Hi")]) == "ok"
    with pytest.raises(ChatTemplateError) as caught:
        templates.render([SYSTEM])
    assert str(caught.value) == "Conversations must start with a user turn"


def test_a_template_that_breaks_on_the_request_is_a_chat_template_error():
    templates = ChatTemplates(templates={"default": "{{ messages[0].content + 1 }}"})
    with pytest.raises(ChatTemplateError, match="TypeError"):
        templates.render([user("Hi")])


def test_the_sandbox_holds():
    templates = ChatTemplates(templates={"default": "{{ messages.__class__.__mro__ }}"})
    with pytest.raises(ChatTemplateError):
        templates.render([user("Hi")])
    underscore = ChatTemplates(templates={"default": "{% set ns = namespace(_x=1) %}{{ ns._x }}"})
    with pytest.raises(ChatTemplateError, match="underscore-prefixed"):
        underscore.render([user("Hi")])


# --- named templates and resolution order --------------------------------------------------------

NAMED = [{"name": "default", "template": "DEFAULT{% for m in messages %}:{{ m.content }}{% endfor %}"},
         {"name": "tool_use", "template": "TOOLS({{ tools | length }}){% for m in messages %}:{{ m.content }}{% endfor %}"}]


def write(path: Path, content) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(content if isinstance(content, str) else json.dumps(content), encoding="utf-8")
    return path


def test_named_templates_pick_tool_use_with_tools_and_default_otherwise(tmp_path):
    write(tmp_path / "tokenizer_config.json", {"chat_template": NAMED, "bos_token": {"content": "<s>", "lstrip": False},
                                               "eos_token": "</s>"})
    templates = load_chat_templates(model_dir=str(tmp_path))
    assert templates is not None and set(templates.templates) == {"default", "tool_use"}
    assert templates.special_tokens == {"bos_token": "<s>", "eos_token": "</s>"}
    assert templates.render([user("a")]) == "DEFAULT:a"
    assert templates.render([user("a")], tools=[WEATHER_TOOL]) == "TOOLS(1):a"
    # transformers makes the same choice
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizers.Tokenizer(tokenizers.models.BPE()), chat_template=NAMED)
    assert hf.apply_chat_template([user("a")], tools=[WEATHER_TOOL], tokenize=False) == "TOOLS(1):a"
    assert hf.apply_chat_template([user("a")], tokenize=False) == "DEFAULT:a"


def test_named_templates_without_a_default_are_refused():
    templates = ChatTemplates(templates={"tool_use": "T", "rag": "R"}, origin="x")
    assert templates.render([user("a")], tools=[]) == "T"
    with pytest.raises(ChatTemplateError, match="no default"):
        templates.render([user("a")])


def test_resolution_order(tmp_path):
    model = tmp_path / "model"
    write(model / "tokenizer_config.json", {"chat_template": "CONFIG", "eos_token": "</s>"})
    assert load_chat_templates(model_dir=str(model)).render([user("a")]) == "CONFIG"
    write(model / "chat_template.json", {"chat_template": "JSON"})
    assert load_chat_templates(model_dir=str(model)).render([user("a")]) == "JSON"
    write(model / "chat_template.jinja", "JINJA")
    write(model / "additional_chat_templates" / "tool_use.jinja", "JINJA-TOOLS")
    found = load_chat_templates(model_dir=str(model))
    assert found.origin == str(model / "chat_template.jinja")
    assert found.render([user("a")]) == "JINJA" and found.render([user("a")], tools=[]) == "JINJA-TOOLS"
    # a tokenizer.json path stands for its directory
    write(model / "tokenizer.json", "{}")
    assert load_chat_templates(model_dir=str(model / "tokenizer.json")).render([user("a")]) == "JINJA"
    # --chat-template wins over the directory; the directory still gives the special tokens
    flag = write(tmp_path / "mine.jinja", "FLAG{{ eos_token }}")
    chosen = load_chat_templates(chat_template=str(flag), model_dir=str(model))
    assert chosen.origin == str(flag) and chosen.render([user("a")]) == "FLAG</s>"
    flag_json = write(tmp_path / "mine.json", {"chat_template": NAMED})
    assert load_chat_templates(chat_template=str(flag_json)).render([user("a")], tools=[]) == "TOOLS(0):a"


def test_no_template_is_none(tmp_path):
    assert load_chat_templates() is None
    write(tmp_path / "tokenizer_config.json", {"eos_token": "</s>"})
    assert load_chat_templates(model_dir=str(tmp_path)) is None


def test_legacy_special_tokens_map(tmp_path):
    write(tmp_path / "chat_template.jinja", "{{ bos_token }}{{ eos_token }}{{ pad_token }}")
    write(tmp_path / "tokenizer_config.json", {"eos_token": "</s>"})
    write(tmp_path / "special_tokens_map.json", {"bos_token": {"content": "<s>"}, "eos_token": "<eos>",
                                                 "pad_token": "<pad>"})
    # no added_tokens_decoder in the config: the legacy map wins, as in transformers
    assert load_chat_templates(model_dir=str(tmp_path)).render([user("a")]) == "<s><eos><pad>"
    write(tmp_path / "tokenizer_config.json", {"eos_token": "</s>", "added_tokens_decoder": {}})
    assert load_chat_templates(model_dir=str(tmp_path)).render([user("a")]) == "<s></s><pad>"


@pytest.mark.parametrize("name,content,reason", [
    ("bad.jinja", "{% for m in messages %}unclosed", "invalid jinja"),
    ("bad.json", "{not json", "invalid JSON"),
    ("bad.json", json.dumps({"template": "x"}), "no 'chat_template' key"),
    ("bad.json", json.dumps({"chat_template": 3}), "neither a string"),
    ("missing.jinja", None, "no such file"),
], ids=["jinja-syntax", "json-syntax", "json-without-key", "json-wrong-type", "missing"])
def test_a_bad_chat_template_file_names_the_file(tmp_path, name, content, reason):
    path = tmp_path / name
    if content is not None:
        write(path, content)
    with pytest.raises(ChatTemplateError) as caught:
        load_chat_templates(chat_template=str(path))
    assert str(path) in str(caught.value) and reason in str(caught.value)


def test_a_bad_template_in_the_model_directory_names_the_file(tmp_path):
    write(tmp_path / "chat_template.jinja", "fine")
    bad = write(tmp_path / "additional_chat_templates" / "tool_use.jinja", "{{ oops ")
    with pytest.raises(ChatTemplateError, match=re.escape(str(bad))):
        load_chat_templates(model_dir=str(tmp_path))
    (tmp_path / "additional_chat_templates" / "tool_use.jinja").unlink()
    config = write(tmp_path / "special_tokens_map.json", "{")
    with pytest.raises(ChatTemplateError, match=re.escape(str(config))):
        load_chat_templates(model_dir=str(tmp_path))
    with pytest.raises(ChatTemplateError, match="does not exist"):
        load_chat_templates(model_dir=str(tmp_path / "nowhere"))


def test_importing_the_module_does_not_import_jinja():
    import subprocess
    import sys

    code = "import sys, schemas.chat_template; print('jinja2' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=str(REPO))
    assert out.stdout.strip() == "False"
