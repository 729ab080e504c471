"""A generator's chat template, compiled at registration: one that does not compile is refused then,
not found out at the first chat request (and every one after it).

The template is compiled as transformers compiles it (a sandboxed jinja2 environment with its two
extensions, `loopcontrols` and the `{% generation %}` block), and nothing is rendered: a template that
refuses some conversations (`raise_exception`) is the client's concern, answered per request.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jinja2
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from runtimes.base import UnsupportedModel


class _Generation(Extension):
    """transformers' `{% generation %}...{% endgeneration %}` (it marks assistant text), here only to compile."""

    tags = frozenset({"generation"})

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def check_chat_template(folder: Path) -> None:
    """Raise `UnsupportedModel` when a chat template of the folder does not compile; none at all is fine."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols", _Generation]
    )
    for where, template in _templates(folder):
        try:
            env.from_string(template)
        except jinja2.TemplateSyntaxError as exc:
            raise UnsupportedModel(
                f"the chat template in {where} does not compile: {exc.message} (line {exc.lineno})"
            ) from None


def _templates(folder: Path) -> list[tuple[str, str]]:
    """(file, template) for each chat template the folder holds, where transformers looks for them."""
    found: list[tuple[str, str]] = []
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        found.append((str(jinja_file), jinja_file.read_text(errors="replace")))
    named = folder / "additional_chat_templates"
    if named.is_dir():
        found += [(str(path), path.read_text(errors="replace")) for path in sorted(named.glob("*.jinja"))]
    for name in ("chat_template.json", "tokenizer_config.json"):
        path = folder / name
        value = _json(path).get("chat_template") if path.is_file() else None
        found += [(str(path), template) for template in _strings(value)]
    return found


def _strings(value: Any) -> list[str]:
    """A `chat_template` entry's templates: a string, or a list of `{"name", "template"}`."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        return [
            entry["template"] for entry in value if isinstance(entry, dict) and isinstance(entry.get("template"), str)
        ]
    return []


def _json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (ValueError, RecursionError):  # malformed: the tokenizer's own load says so
        return {}
    return value if isinstance(value, dict) else {}
