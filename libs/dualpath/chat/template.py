"""``ChatTemplate``: a checkpoint's own Jinja chat template, rendered the way Hugging Face does.

Where the template comes from (the precedence of ``transformers``' ``from_pretrained``):

1. ``chat_template.jinja`` in the checkpoint directory (the default template), and
   ``additional_chat_templates/<name>.jinja`` (named templates);
2. else ``tokenizer_config.json``'s ``chat_template``: a string, or a list of
   ``{"name", "template"}`` (named templates, ``default`` and ``tool_use`` chosen as HF does);
3. else ChatML, the format of Qwen-style checkpoints.

Rendering follows ``transformers.utils.chat_template_utils``: an
``ImmutableSandboxedEnvironment`` with ``trim_blocks`` and ``lstrip_blocks``, the
``loopcontrols`` extension, the ``tojson`` filter without HTML escaping (``ensure_ascii``,
``indent``, ``separators``, ``sort_keys``), the globals ``raise_exception``,
``strftime_now``, ``dict`` and an underscore-refusing ``namespace``, and the variables
``messages``, ``tools``, ``documents``, ``add_generation_prompt`` plus the special tokens
of ``tokenizer_config.json`` (``bos_token``, ``eos_token``, ...). Message keys whose value
is ``None`` are dropped as HF does, except the ``content`` of an assistant turn that carries
``tool_calls`` (DeepSeek's template tests ``content is none``); a template that cannot take
that ``None`` (one concatenating content) gets empty text there instead.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from dualpath.chat.errors import ChatTemplateError

__all__ = ["CHATML_TEMPLATE", "ChatTemplate"]

# Used only when a checkpoint ships no template. ``content`` may be missing (None dropped).
CHATML_TEMPLATE = (
    "{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is defined and message['content'] is not none %}{{ message['content'] }}{% endif %}"
    "{{- '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class _Namespace(jinja2.utils.Namespace):
    """Jinja's ``namespace`` refusing underscore names (no reach into CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore attributes on a namespace: {name!r}")


class _Dict:
    """The template's ``dict``: builds dicts, exposes nothing else."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters; chat templates expect plain json.dumps.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=32)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_Dict(), namespace=_Namespace)
    return env.from_string(source)


class ChatTemplate:
    """One checkpoint's chat templates (a default and any named ones) and its special tokens."""

    def __init__(self, templates: dict[str, str], *, special_tokens: dict[str, str] | None = None, source: str = "") -> None:
        self.templates = dict(templates)
        self.special_tokens = dict(special_tokens or {})
        self.source = source  # where the templates came from (for logs and /v1/models)
        try:
            for text in self.templates.values():
                _compile(text)
        except jinja2.TemplateSyntaxError as exc:
            raise ChatTemplateError(f"the chat template from {source or 'the checkpoint'} does not compile: {exc}") from None

    @classmethod
    def from_dir(cls, path: str | Path) -> ChatTemplate:
        """Load the templates of a checkpoint directory (precedence in the module docstring).

        Raises:
            ChatTemplateError: ``tokenizer_config.json`` unreadable or a template that does
                not compile.
        """
        path = Path(path)
        config = _read_config(path / "tokenizer_config.json")
        special = {k: v for k in _SPECIAL_TOKEN_KEYS if (v := _token_text(config.get(k))) is not None}
        templates: dict[str, str] = {}
        source = ""
        raw = config.get("chat_template")
        if isinstance(raw, str):
            templates["default"], source = raw, "tokenizer_config.json"
        elif isinstance(raw, list):
            templates.update({t["name"]: t["template"] for t in raw if isinstance(t, dict) and "name" in t and "template" in t})
            source = "tokenizer_config.json"
        files: dict[str, str] = {}
        if (path / "chat_template.jinja").is_file():
            files["default"] = (path / "chat_template.jinja").read_text(encoding="utf-8")
        extra = path / "additional_chat_templates"
        if extra.is_dir():
            files.update({f.name.removesuffix(".jinja"): f.read_text(encoding="utf-8") for f in sorted(extra.glob("*.jinja"))})
        if files:  # template files replace tokenizer_config's templates, as in transformers
            templates, source = files, "chat_template.jinja" if "default" in files else "additional_chat_templates"
        if not templates:
            templates, source = {"default": CHATML_TEMPLATE}, "ChatML (the checkpoint has no chat template)"
        return cls(templates, special_tokens=special, source=source)

    @property
    def default(self) -> str | None:
        return self.templates.get("default")

    def pick(self, name: str | None = None, *, tools: bool = False) -> str:
        """The template text to use: a named one, else ``tool_use`` with tools, else ``default``.

        Raises:
            ChatTemplateError: no such name, or several named templates and no default.
        """
        if name is not None:
            if name not in self.templates:
                raise ChatTemplateError(f"no chat template named {name!r}; this checkpoint has {sorted(self.templates)}")
            return self.templates[name]
        if tools and "tool_use" in self.templates:
            return self.templates["tool_use"]
        if "default" in self.templates:
            return self.templates["default"]
        if len(self.templates) == 1:
            return next(iter(self.templates.values()))
        raise ChatTemplateError(f"this checkpoint has several chat templates and no default: {sorted(self.templates)}")

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        template: str | None = None,
        documents: list[dict] | None = None,
        **kwargs: Any,
    ) -> str:
        """The prompt text of ``messages`` (HF's ``apply_chat_template(..., tokenize=False)``).

        ``kwargs`` are extra template variables (``chat_template_kwargs``), over the special tokens.

        Raises:
            ChatTemplateError: the template raised (``raise_exception``, an undefined value, a
                type error in the template) or a sandbox violation.
        """
        text = self.pick(template, tools=tools is not None)
        chat = [_normalize(m) for m in messages]
        variables = {**self.special_tokens, **kwargs}
        compiled = _compile(text)
        try:
            try:
                return compiled.render(
                    messages=chat, tools=tools, documents=documents, add_generation_prompt=add_generation_prompt, **variables
                )
            except (TypeError, jinja2.UndefinedError):
                if not any("content" in m and m["content"] is None for m in chat):
                    raise
                # A template that concatenates content (plain ChatML) cannot take the None of a
                # tool-call turn: render that turn with empty text instead.
                chat = [{**m, "content": ""} if "content" in m and m["content"] is None else m for m in chat]
                return compiled.render(
                    messages=chat, tools=tools, documents=documents, add_generation_prompt=add_generation_prompt, **variables
                )
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the chat template refused these messages: {exc}") from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            raise ChatTemplateError(f"the chat template cannot render these messages: {type(exc).__name__}: {exc}") from None

    def arguments_as_text(self, name: str | None = None, *, tools: bool = True) -> bool:
        """Whether the template concatenates tool-call ``arguments`` as a string (DeepSeek) rather
        than rendering a mapping with ``tojson`` (Qwen, Llama: HF's convention)."""
        return bool(re.search(r"arguments'?\]?\s*\+", self.pick(name, tools=tools)))


def _normalize(message: dict[str, Any]) -> dict[str, Any]:
    keep_none = {"content"} if message.get("role") == "assistant" and message.get("tool_calls") else set()
    return {k: v for k, v in message.items() if v is not None or k in keep_none}


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # an AddedToken object
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_config(file: Path) -> dict[str, Any]:
    if not file.is_file():
        return {}
    try:
        value = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ChatTemplateError(f"cannot read {file}: {exc}") from None
    return value if isinstance(value, dict) else {}
