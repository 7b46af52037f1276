"""Render a checkpoint's Jinja `chat_template` exactly as transformers' apply_chat_template does.

Same environment (sandboxed, trim_blocks, lstrip_blocks, loop controls), same helpers
(`raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII text, `{% generation %}`
blocks) and the same variables (`messages`, `add_generation_prompt`, `tools`, `documents`, the
tokenizer's special tokens as `bos_token`, `eos_token`, ...), so the prompt text, and therefore
the token ids, match what the model was trained on. Generation and fine-tuning data use it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

from lmforge.errors import ConfigError, DataError


@lru_cache(maxsize=16)
def compile_template(template: str):
    """A compiled template in transformers' sandboxed environment (cached per template text)."""
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """`{% generation %}...{% endgeneration %}` marks assistant text; it renders its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as err:
        raise ConfigError(f"chat_template line {err.lineno}: {err.message}") from err


def render_chat(
    tokenizer,
    messages: Sequence[dict[str, Any]],
    add_generation_prompt: bool = False,
    chat_template: str | None = None,
    **kwargs: Any,
) -> str:
    """The conversation as prompt text via the tokenizer's (or the given) chat template.

    `kwargs` reach the template like apply_chat_template's extra arguments (tools, documents,
    enable_thinking, ...). A template's raise_exception becomes a DataError.
    """
    import jinja2

    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise ConfigError("this tokenizer has no chat_template; pass chat_template=...")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message:
            raise DataError(f"messages[{i}] must be a dict with a 'role'")
    specials = getattr(tokenizer, "special_tokens", {}) or {}
    context = {f"{role}_token": token for role, token in specials.items()}
    context.update(tools=None, documents=None)
    context.update(kwargs)
    try:
        return compile_template(template).render(
            messages=[dict(m) for m in messages],
            add_generation_prompt=add_generation_prompt,
            **context,
        )
    except jinja2.TemplateError as err:
        raise DataError(f"chat template: {err}") from err


def encode_chat(
    tokenizer, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True, **kwargs
) -> list[int]:
    """Token ids of the rendered conversation (special tokens in the text are matched, as HF
    does with add_special_tokens=False, which apply_chat_template uses)."""
    return tokenizer.encode(render_chat(tokenizer, messages, add_generation_prompt, **kwargs))
