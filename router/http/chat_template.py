"""The model's chat template, rendered as transformers renders it, without transformers.

The template is the tokenizer's own: `chat_template.jinja` beside tokenizer.json, else
tokenizer_config.json's `chat_template` (a string, or a list of named templates, of which
"default" is used). It is rendered by Jinja2 in a sandbox with what templates expect from
transformers: `messages`, `tools`, `add_generation_prompt`, `bos_token`, `eos_token`, the
`raise_exception` and `strftime_now` functions and a `tojson` filter with `indent`; a request's
own variables beside them (vLLM's `chat_template_kwargs`, e.g. `enable_thinking`).

A rendered prompt that starts with the BOS text loses it when the tokenizer adds BOS itself, so
that the model sees one BOS, not two.
"""

from __future__ import annotations

import datetime
import json
import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

TEMPLATE_FILE = "chat_template.jinja"
# what the server gives the template itself (a request's own variables may not replace them)
RESERVED = frozenset(
    {
        "messages",
        "tools",
        "add_generation_prompt",
        "bos_token",
        "eos_token",
        "raise_exception",
        "strftime_now",
    }
)
CONFIG_FILE = "tokenizer_config.json"


class ChatTemplateError(ValueError):
    """The messages cannot be rendered (the template refused them, or it is broken)."""


def _raise(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, **kwargs: Any) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, **kwargs)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _token_text(value: Any) -> str:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return str(value or "")


@dataclass(frozen=True)
class ChatTemplate:
    source: str
    bos_token: str = ""
    eos_token: str = ""
    strip_bos: bool = False  # the tokenizer adds BOS: drop a rendered leading BOS text

    @cached_property
    def _template(self) -> jinja2.Template:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = _strftime_now
        try:
            return env.from_string(self.source)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the model's chat template does not compile: {exc}") from exc

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        variables: dict[str, Any] | None = None,
        continue_final_message: bool = False,
        keep_bos: bool = False,
        documents: list[dict[str, Any]] | None = None,
    ) -> str:
        """`tools`: the functions the model may call, as transformers passes them (None: none);
        `variables`: more for the template, none of RESERVED; `continue_final_message`: the
        prompt ends with the last message's text (what closes its turn cut off), so that the
        answer continues it, as transformers' apply_chat_template does; `keep_bos`: the text
        keeps a leading BOS even where the tokenizer adds one (for a caller that encodes it
        without special tokens); `documents`: texts to ground the answer in, for templates that
        read them (Granite's RAG; transformers' `documents`), also given as a variable of that
        name (None: none)."""
        taken = RESERVED.intersection(variables or {})
        if taken:
            raise ChatTemplateError(f"chat_template_kwargs may not set {', '.join(sorted(taken))}")
        context: dict[str, Any] = {"documents": None, **(variables or {})}
        if documents is not None:
            if context["documents"] is not None:
                raise ChatTemplateError("documents are given twice: as a field and in chat_template_kwargs")
            context["documents"] = documents
        try:
            text = self._template.render(
                **context,
                messages=messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the model's chat template failed on these messages: {exc}") from exc
        if self.strip_bos and not keep_bos and self.bos_token and text.startswith(self.bos_token):
            text = text[len(self.bos_token) :]
        return _cut_after(text, messages[-1]) if continue_final_message else text


def _cut_after(text: str, final: dict[str, Any]) -> str:
    """`text` up to the end of the final message's content (its last occurrence); where the
    template trimmed the content's trailing space, up to the trimmed content."""
    content = final.get("content")
    if not isinstance(content, str) or not content.strip():
        raise ChatTemplateError("continue_final_message needs a final message with text")
    at = text.rfind(content.strip())
    if at < 0:
        raise ChatTemplateError(
            "continue_final_message: the final message does not appear in the prompt the chat template wrote"
        )
    whole = content.lstrip()
    end = at + len(whole) if text[at : at + len(whole)] == whole else at + len(content.strip())
    return text[:end]


def load_chat_template(tokenizer_path: str, added_first: str) -> ChatTemplate | None:
    """The chat template stored with the tokenizer at `tokenizer_path` (its directory or its
    tokenizer.json), or None when it has none. `added_first`: the text of the token the
    tokenizer puts before any text ("" if none), to tell whether it adds BOS itself."""
    directory = Path(tokenizer_path if os.path.isdir(tokenizer_path) else os.path.dirname(tokenizer_path))
    config: dict[str, Any] = {}
    if (directory / CONFIG_FILE).is_file():
        config = json.loads((directory / CONFIG_FILE).read_text())
    source: Any = None
    if (directory / TEMPLATE_FILE).is_file():
        source = (directory / TEMPLATE_FILE).read_text()
    else:
        source = config.get("chat_template")
        if isinstance(source, list):  # named templates
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
    if not isinstance(source, str) or not source:
        return None
    bos = _token_text(config.get("bos_token"))
    return ChatTemplate(
        source,
        bos_token=bos,
        eos_token=_token_text(config.get("eos_token")),
        strip_bos=bool(bos) and added_first == bos,
    )
