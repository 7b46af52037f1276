"""The one chat renderer: messages -> prompt text, used by fine-tuning data, chat, generate, serve,
RAG and chat evaluation.

A checkpoint's Jinja `chat_template` is rendered exactly as transformers' apply_chat_template does:
same environment (sandboxed, trim_blocks, lstrip_blocks, loop controls), same helpers
(`raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII text, `{% generation %}`
blocks) and the same variables (`messages`, `add_generation_prompt`, `tools`, `documents`, the
tokenizer's special tokens as `bos_token`, `eos_token`, ...), so the prompt text, and therefore
the token ids, match what the model was trained on. A tokenizer without a template (lmforge's own
from-scratch ones) gets a built-in template of its role tokens: `<|user|>hi<|end|><|assistant|>`.
Templates are compiled once per text, not once per example (which dominated an SFT stage's
set-up).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

from lmforge.errors import ConfigError, DataError
from lmforge.tokenizer.tokenizer import DEFAULT_SPECIAL_TOKENS


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


BUILTIN_TEMPLATE = (
    "{% for m in messages %}{{ roles.get(m['role'], '<|' + m['role'] + '|>') }}"
    "{{ m['content'] }}{{ end }}{% endfor %}"
    "{% if add_generation_prompt %}{{ roles['assistant'] }}{% endif %}"
)


def render_chat(
    tokenizer,
    messages: Sequence[dict[str, Any]],
    add_generation_prompt: bool = False,
    chat_template: str | None = None,
    **kwargs: Any,
) -> str:
    """The conversation as prompt text via the given template, else the tokenizer's
    `chat_template`, else the built-in role-token template.

    `kwargs` reach the template like apply_chat_template's extra arguments (tools, documents,
    enable_thinking, ...). A message without a role, or a template's raise_exception, is a
    DataError; a template that does not compile is a ConfigError.
    """
    import jinja2

    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message:
            raise DataError(f"messages[{i}] must be a dict with a 'role'")
    specials = dict(getattr(tokenizer, "special_tokens", {}) or {})
    context: dict[str, Any] = {f"{role}_token": token for role, token in specials.items()}
    context.update(tools=None, documents=None)
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:  # the built-in template uses the tokenizer's role tokens
        tokens = {**DEFAULT_SPECIAL_TOKENS, **specials}
        context["roles"] = {r: tokens[r] for r in ("system", "user", "assistant")}
        context["end"] = tokens["end"]
        template = BUILTIN_TEMPLATE
    context.update(kwargs)
    try:
        return compile_template(template).render(
            messages=[dict(m) for m in messages],
            add_generation_prompt=add_generation_prompt,
            **context,
        )
    except jinja2.TemplateError as err:
        raise DataError(f"chat template: {err}") from err
