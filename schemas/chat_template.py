"""A model's chat template: OpenAI chat `messages` -> the prompt text, as the model's engine
renders it.

The router tokenizes a chat request itself (to hash its blocks and send ids), so its prompt
text must be the one the engine would have built: Hugging Face transformers'
`tokenizer.apply_chat_template(messages, tokenize=False, ...)` (what vLLM and SGLang call).
`ChatTemplates.render` replicates it; the ids are then `encode(text, add_special_tokens=False)`
(the template writes the BOS itself, as transformers assumes when it tokenizes a rendering).

Rendering, as transformers 5 does it (`utils/chat_template_utils.py`):

- Jinja2 `ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)` with the
  `loopcontrols` extension and a `{% generation %}...{% endgeneration %}` tag that renders
  its body (transformers uses it to mark assistant tokens; we render only).
- Globals: `raise_exception(msg)` (a template's own refusal: `ChatTemplateError(msg)`),
  `strftime_now(fmt)` (the local clock; the only clock read, and only when a template calls
  it), `namespace` that refuses underscore-prefixed names, a `dict` that only builds dicts.
  Filter `tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`:
  `json.dumps` without Jinja's HTML escaping.
- Variables: `messages`, `tools` (JSON-schema dicts exactly as given, e.g. OpenAI's
  `{"type": "function", "function": {...}}`; None when absent), `documents`,
  `add_generation_prompt`, the tokenizer's named special tokens (`bos_token`, `eos_token`,
  `unk_token`, `sep_token`, `pad_token`, `cls_token`, `mask_token` and a model's named
  extras), then `chat_template_kwargs` (which may override a special token but not the
  five variables above: such a key is a `ChatTemplateError` naming it, as the request could
  otherwise replace its own messages).
- Messages: keys whose value is None are dropped (OpenAI clients send `content: null`,
  `tool_calls: null`); a reasoning text under `reasoning_content`, `thinking` or
  `reasoning` is copied under `reasoning_content` and `thinking` (the names templates
  read). A `content` that is a list of OpenAI content parts is passed unchanged: templates
  that iterate parts (Qwen, Gemma 3, ...) render them, others render the list's repr as
  transformers would. The caller's dicts are never modified (a deep copy is rendered).
- Templates by name: a model may ship several (`default`, `tool_use`, ...); `tool_use` is
  used when the request has tools and the model has one, else `default`, else (a model
  with named templates and no default) `ChatTemplateError`.
- `continue_final_message`: the last message is left open so the model continues it: its
  content is rendered with a marker appended and the text is cut at the marker (when the
  template trimmed the message's trailing spaces, the cut text is right-stripped too).
  Errors as transformers': with `add_generation_prompt`; an empty conversation; a final
  message without content; a template that never reads `content`; a rendering in which the
  final message does not appear.

Not replicated: callables as tools (a JSON request carries schemas only), batches of
conversations, `return_assistant_tokens_mask`, `sanitize_control_tokens` (off by default
in transformers too), `continue_final_message` naming a field other than `content`.

Resolution (`load_chat_templates`), as the engines resolve it: `--chat-template FILE` (a
`.jinja` text, or a `.json` holding `{"chat_template": ...}`), else in the model directory
`chat_template.jinja` (the `default`) with any `additional_chat_templates/<name>.jinja`
(what `save_pretrained` writes; these files win over the config, as in transformers), else
`chat_template.json`, else `tokenizer_config.json`'s `chat_template` (a string, or a list of
`{"name", "template"}`). Special tokens come from `tokenizer_config.json` (a value is a
string or an AddedToken dict `{"content": ...}`) and the legacy `special_tokens_map.json`
(whose values win only when the config has no `added_tokens_decoder`, as in transformers).
Every template is compiled at load, so a bad one stops the process naming its file.

`DEFAULT_CHAT_TEMPLATE` (`ChatTemplates.builtin()`): for the byte tokenizer and models
without a template; no special tokens. Each message is `<|role|>\\n` + content + `\\n`; a
content list joins its text parts with `\\n`; the generation prompt is `<|assistant|>\\n`:

    <|system|>\\nYou are terse.\\n<|user|>\\nHi\\n<|assistant|>\\n

Errors: `ChatTemplateError` (a ValueError); its text is the reason (the template's own
message for `raise_exception`). The router answers it 400 invalid_request.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from datetime import datetime
from typing import Any

__all__ = ["ChatTemplateError", "ChatTemplates", "DEFAULT_CHAT_TEMPLATE", "load_chat_templates"]


class ChatTemplateError(ValueError):
    """A template that cannot be loaded or rendered; str() is the reason (the template's own
    message for raise_exception). The router answers it 400 invalid_request."""


DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['content'] is string %}{% set content = message['content'] %}"
    "{% elif message['content'] is defined and message['content'] is iterable %}"
    "{% set content = message['content'] | selectattr('type', 'equalto', 'text')"
    " | map(attribute='text') | join('\n') %}"
    "{% else %}{% set content = '' %}{% endif %}"
    "<|{{ message['role'] }}|>\n{{ content }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# The variables a template reads that a request's chat_template_kwargs may not replace.
RESERVED_VARIABLES = ("messages", "tools", "documents", "add_generation_prompt", "continue_final_message")

# transformers' SPECIAL_TOKENS_ATTRIBUTES: the named tokens passed to every template.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")

# Names a message's reasoning is passed under; the first two are the ones templates read.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")

# Appended to the final message for continue_final_message; the rendering is cut there.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "

# The shared jinja2 environment, built on first compile. Two threads racing here (or on a
# ChatTemplates' compiled cache) build the same thing twice and keep one: harmless.
_ENVIRONMENT: Any = None


def _environment() -> Any:
    """transformers' sandboxed environment (module docstring); jinja2 is imported here so that
    importing this module stays cheap for processes that never render a template."""
    global _ENVIRONMENT
    if _ENVIRONMENT is not None:
        return _ENVIRONMENT
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    import jinja2.utils
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(jinja2.ext.Extension):
        """`{% generation %}body{% endgeneration %}` renders body."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

        def _render_body(self, caller: Any) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    class TemplateDict:
        """`dict(...)` and `dict.fromkeys(...)` only: no attribute path out of the sandbox."""

        def __call__(self, *args: Any, **kwargs: Any) -> dict:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        """A namespace that refuses underscore-prefixed names (CPython internals)."""

        def __init__(*args: Any, **kwargs: Any) -> None:
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    "Chat templates cannot store underscore-prefixed attributes on a namespace, "
                    f"but got {name!r}. Please rename the attribute.")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    _ENVIRONMENT = env
    return env


def _compile(source: str) -> Any:
    """The compiled template; a syntax error is a ChatTemplateError with jinja's message and line."""
    import jinja2

    try:
        return _environment().from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"invalid jinja at line {exc.lineno}: {exc.message}") from None
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"invalid jinja: {exc}") from None


# Python errors a template's expressions can raise on a request's data (`'a' + 1`, `x[5]`):
# the request is what the template cannot render, so they are a ChatTemplateError too.
_RENDER_ERRORS = (TypeError, ValueError, KeyError, IndexError, AttributeError, ZeroDivisionError, OverflowError,
                  RecursionError)


@dataclasses.dataclass(frozen=True)
class ChatTemplates:
    """A model's chat templates and special tokens (module docstring); immutable: the dicts
    are copied at construction and never changed, the compiled templates are cached per name."""

    templates: dict[str, str]  # name -> jinja source ("default", "tool_use", ...)
    special_tokens: dict[str, str] = dataclasses.field(default_factory=dict)  # "bos_token", ... -> text
    origin: str = ""  # where they came from: a file path, "<dir>/tokenizer_config.json", "built-in default"
    _compiled: dict[str, Any] = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.templates:
            raise ChatTemplateError(f"chat templates from {self.origin or '?'}: no template")
        for name, source in self.templates.items():
            if not isinstance(name, str) or not isinstance(source, str):
                raise ChatTemplateError(f"chat templates from {self.origin or '?'}: template {name!r} is not text")
        for name, text in self.special_tokens.items():
            if not isinstance(text, str):
                raise ChatTemplateError(f"chat templates from {self.origin or '?'}: special token {name} is not text")
        object.__setattr__(self, "templates", dict(self.templates))
        object.__setattr__(self, "special_tokens", dict(self.special_tokens))

    @classmethod
    def builtin(cls) -> ChatTemplates:
        """DEFAULT_CHAT_TEMPLATE, no special tokens."""
        return cls(templates={"default": DEFAULT_CHAT_TEMPLATE}, origin="built-in default")

    def template_name(self, has_tools: bool) -> str:
        """The template a request uses: `tool_use` when it has tools and the model has one,
        else `default`, else the model's only template; ChatTemplateError otherwise."""
        if has_tools and "tool_use" in self.templates:
            return "tool_use"
        if "default" in self.templates:
            return "default"
        if len(self.templates) == 1:
            return next(iter(self.templates))
        raise ChatTemplateError(f"the model's chat templates ({self.origin}) have no default; "
                                f"its templates are {sorted(self.templates)}")

    def compiled(self, name: str) -> Any:
        """The compiled template `name` (compiled once); ChatTemplateError naming it and the origin."""
        template = self._compiled.get(name)
        if template is None:
            try:
                template = _compile(self.templates[name])
            except ChatTemplateError as exc:
                raise ChatTemplateError(f"chat template {name!r} from {self.origin}: {exc}") from None
            self._compiled[name] = template
        return template

    def render(self, messages: list[dict], *, tools: list[dict] | None = None, documents: list[dict] | None = None,
               add_generation_prompt: bool = False, continue_final_message: bool = False,
               chat_template_kwargs: dict | None = None) -> str:
        """The prompt text of `messages` (module docstring); ChatTemplateError when the request
        or the template cannot be rendered."""
        import jinja2

        if not isinstance(messages, list) or not messages:
            raise ChatTemplateError("Cannot apply chat template to an empty conversation. "
                                    "Provide at least one message.")
        for message in messages:
            if not isinstance(message, dict):
                raise ChatTemplateError(f"Chat messages should be dicts, but got {message!r}.")
        if continue_final_message and add_generation_prompt:
            raise ChatTemplateError(
                "continue_final_message and add_generation_prompt are not compatible. Use continue_final_message "
                "when you want the model to continue the final message, and add_generation_prompt when you want "
                "to add a header that will prompt it to start a new assistant message instead.")
        if tools is not None and not all(isinstance(t, dict) for t in tools):
            raise ChatTemplateError("Tools should be JSON schemas (dicts).")
        if documents is not None and not all(isinstance(d, dict) for d in documents):
            raise ChatTemplateError("Documents should be a list of dicts with 'title' and 'text' keys!")
        extra = dict(chat_template_kwargs or {})
        for key in RESERVED_VARIABLES:
            if key in extra:
                raise ChatTemplateError(f"chat_template_kwargs may not set {key!r}: it is the request's own")

        name = self.template_name(tools is not None)
        source = self.templates[name]
        template = self.compiled(name)

        chat = [_template_message(m) for m in messages]
        final_text = ""
        if continue_final_message:
            final_text = _mark_final_message(chat, source)

        variables = {**self.special_tokens, **copy.deepcopy(extra)}
        try:
            rendered = template.render(messages=chat, tools=copy.deepcopy(tools), documents=copy.deepcopy(documents),
                                       add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(str(exc) or type(exc).__name__) from None
        except _RENDER_ERRORS as exc:
            raise ChatTemplateError(f"chat template {name!r} failed on this request: "
                                    f"{type(exc).__name__}: {exc}") from None
        if continue_final_message:
            rendered = _cut_at_mark(rendered, final_text)
        return rendered


def _template_message(message: dict) -> dict:
    """A deep copy as the template sees it: None values dropped, reasoning aliased."""
    out = {key: copy.deepcopy(value) for key, value in message.items() if value is not None}
    reasoning = next((out[key] for key in _REASONING_FIELDS if out.get(key) is not None), None)
    if reasoning is not None:
        out = {"thinking": reasoning, **out, "reasoning_content": reasoning}
    return out


def _mark_final_message(chat: list[dict], source: str) -> str:
    """Appends the continue tag to the final message's text (its last text part for a list);
    returns that text, unmarked. Errors as transformers'."""
    final = chat[-1].get("content")
    if final is None:
        raise ChatTemplateError('continue_final_message is set but the final message has no "content" to continue!')
    if "content" not in source:
        raise ChatTemplateError('continue_final_message is set to "content" but this is not an accepted field '
                                "in the chat_template")
    if isinstance(final, (list, tuple)):
        for part in reversed(final):
            if isinstance(part, dict) and "text" in part:
                text = part["text"]
                part["text"] = f"{text}{_CONTINUE_TAG}"
                return str(text)
        raise ChatTemplateError("continue_final_message is set but we could not find any text to continue "
                                "in the final message!")
    if not isinstance(final, str):
        raise ChatTemplateError("continue_final_message is set but the final message's content is not text")
    chat[-1]["content"] = final + _CONTINUE_TAG
    return final


def _cut_at_mark(rendered: str, final_text: str) -> str:
    if final_text.strip() not in rendered or _CONTINUE_TAG.strip() not in rendered:
        raise ChatTemplateError(
            "continue_final_message is set but the final message does not appear in the chat after applying the "
            "chat template! This can happen if the chat template deletes portions of the final message.")
    at = rendered.rindex(_CONTINUE_TAG.strip())
    if rendered[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:at]
    return rendered[:at].rstrip()  # the template trimmed the message's trailing spaces


# --- loading -------------------------------------------------------------------------------


def _read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read()
    except OSError as exc:
        raise ChatTemplateError(f"chat template {path}: cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ChatTemplateError(f"chat template {path}: not UTF-8 text ({exc.reason})") from None


def _read_json(path: str) -> Any:
    text = _read_text(path)
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ChatTemplateError(f"chat template {path}: invalid JSON: {exc}") from None


def _templates_of(value: Any, path: str) -> dict[str, str]:
    """A `chat_template` value: a string (the default) or a list of {"name", "template"}."""
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list) and value and all(
            isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)
            for t in value):
        return {t["name"]: t["template"] for t in value}
    raise ChatTemplateError(f"chat template {path}: 'chat_template' is neither a string nor a list of "
                            '{"name": ..., "template": ...}')


def _token_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]  # an AddedToken
    return None


def _special_tokens(model_dir: str) -> dict[str, str]:
    """The named special tokens of a model directory (module docstring)."""
    config: dict = {}
    config_path = os.path.join(model_dir, "tokenizer_config.json")
    if os.path.isfile(config_path):
        loaded = _read_json(config_path)
        if not isinstance(loaded, dict):
            raise ChatTemplateError(f"chat template {config_path}: not a JSON object")
        config = loaded
    tokens: dict[str, str] = {}

    def take(source: dict, override: bool) -> None:
        named = {key: source.get(key) for key in SPECIAL_TOKEN_NAMES}
        extra = source.get("extra_special_tokens")
        if isinstance(extra, dict):  # a model's named extras (image_token, ...)
            named.update(extra)
        for key, value in named.items():
            text = _token_text(value)
            if text is not None and (override or key not in tokens):
                tokens[key] = text

    take(config, override=True)
    map_path = os.path.join(model_dir, "special_tokens_map.json")
    if os.path.isfile(map_path):
        legacy = _read_json(map_path)
        if not isinstance(legacy, dict):
            raise ChatTemplateError(f"chat template {map_path}: not a JSON object")
        take(legacy, override="added_tokens_decoder" not in config)
    return tokens


def _templates_in(model_dir: str) -> tuple[dict[str, str], str, dict[str, str]] | None:
    """The model directory's templates, their origin and each one's file; None when it has none."""
    jinja_path = os.path.join(model_dir, "chat_template.jinja")
    extra_dir = os.path.join(model_dir, "additional_chat_templates")
    found: dict[str, str] = {}
    if os.path.isfile(jinja_path):
        found["default"] = _read_text(jinja_path)
    if os.path.isdir(extra_dir):
        for entry in sorted(os.listdir(extra_dir)):
            if entry.endswith(".jinja"):
                found[entry.removesuffix(".jinja")] = _read_text(os.path.join(extra_dir, entry))
    if found:
        files = {name: jinja_path if name == "default" else os.path.join(extra_dir, name + ".jinja") for name in found}
        return found, jinja_path if "default" in found else extra_dir, files
    for file_name in ("chat_template.json", "tokenizer_config.json"):
        path = os.path.join(model_dir, file_name)
        if not os.path.isfile(path):
            continue
        loaded = _read_json(path)
        if not isinstance(loaded, dict):
            raise ChatTemplateError(f"chat template {path}: not a JSON object")
        if loaded.get("chat_template") is not None:
            templates = _templates_of(loaded["chat_template"], path)
            return templates, path, {name: path for name in templates}
    return None


def tool_arguments_as_objects(messages: list[dict]) -> list[dict]:
    """The messages as the template sees them: an assistant's tool calls with their
    `arguments` (a JSON string in OpenAI's shape) decoded, as vLLM hands them to the template
    (templates print them with tojson). Arguments that are not JSON: ChatTemplateError naming
    the message (vLLM refuses them too). The caller's messages are not changed."""
    out = messages
    for i, msg in enumerate(messages):
        calls = msg.get("tool_calls")
        if not isinstance(calls, list) or not any(
                isinstance(c, dict) and isinstance((c.get("function") or {}).get("arguments"), str) for c in calls):
            continue
        fixed = []
        for call in calls:
            fn = call.get("function") if isinstance(call, dict) else None
            if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                try:
                    call = {**call, "function": {**fn, "arguments": json.loads(fn["arguments"])}}
                except ValueError:
                    raise ChatTemplateError(f"messages[{i}].tool_calls: arguments are not JSON") from None
            fixed.append(call)
        if out is messages:
            out = list(messages)
        out[i] = {**msg, "tool_calls": fixed}
    return out


def load_chat_templates(chat_template: str = "", model_dir: str = "") -> ChatTemplates | None:
    """Resolved as the engines resolve it: `chat_template` (a FILE: a .jinja text, or a .json
    with {"chat_template": ...}), else the model directory's `chat_template.jinja` (with
    `additional_chat_templates/*.jinja`), else its `chat_template.json`, else
    `tokenizer_config.json`'s `chat_template` (a string, or a list of {"name", "template"}
    dicts = named templates). Special tokens from tokenizer_config.json and
    special_tokens_map.json. `model_dir` may also be a path to a tokenizer.json file: its
    directory is used. None when no template is found. A file that is missing, unreadable,
    bad JSON or bad jinja: ChatTemplateError naming the file."""
    if model_dir and os.path.isfile(model_dir):
        model_dir = os.path.dirname(os.path.abspath(model_dir))
    if model_dir and not os.path.isdir(model_dir):
        raise ChatTemplateError(f"chat template: model directory {model_dir} does not exist")
    special_tokens = _special_tokens(model_dir) if model_dir else {}

    if chat_template:
        if not os.path.isfile(chat_template):
            raise ChatTemplateError(f"chat template {chat_template}: no such file")
        if chat_template.endswith(".json"):
            loaded = _read_json(chat_template)
            if not isinstance(loaded, dict) or loaded.get("chat_template") is None:
                raise ChatTemplateError(f"chat template {chat_template}: no 'chat_template' key")
            templates = _templates_of(loaded["chat_template"], chat_template)
        else:
            templates = {"default": _read_text(chat_template)}
        origin = chat_template
        files = {name: chat_template for name in templates}
    elif model_dir:
        found = _templates_in(model_dir)
        if found is None:
            return None
        templates, origin, files = found
    else:
        return None

    result = ChatTemplates(templates=templates, special_tokens=special_tokens, origin=origin)
    for name, source in templates.items():  # compiled now: a bad template stops the start, naming its file
        try:
            result._compiled[name] = _compile(source)
        except ChatTemplateError as exc:
            label = "" if name == "default" else f" (template {name!r})"
            raise ChatTemplateError(f"chat template {files[name]}{label}: {exc}") from None
    return result
