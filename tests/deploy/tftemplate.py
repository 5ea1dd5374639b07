"""A renderer of the subset of Terraform's template language that deploy/terraform uses.

Terraform's ``templatefile()`` cannot run here without its providers, so the tests render the
templates themselves and load the result with Meridian's own settings loaders. The subset:

- ``${ref}``: a reference, ``name`` or ``name.attr[.attr...]`` (an attribute of a loop's
  object), whose value is a string or a number; numbers are written as Terraform writes them
  (``39.0`` as ``39``, ``-77.5`` as ``-77.5``);
- ``%{ for x in ref }`` ... ``%{ endfor }``, nested, over a list;
- everything else is literal text, newlines included (Terraform keeps them: no ``~``).

Anything else (a function call, an operator, an index, ``%{ if }``, a ``~`` strip marker, the
``$${`` and ``%%{`` escapes, a map loop, a list or null interpolated) raises
:class:`TemplateError`: the templates must stay within what is tested here. When the real
Terraform binary is present, tests/deploy/test_terraform.py also renders them with it and
compares.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

_TOKEN = re.compile(r"(\$\{|%\{)(.*?)\}", re.DOTALL)
_REF = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_FOR = re.compile(r"^for\s+([A-Za-z_][A-Za-z0-9_]*)\s+in\s+(\S+)$")


class TemplateError(ValueError):
    """The template uses something outside the subset, or a value it cannot render."""


@dataclass
class _Loop:
    var: str
    ref: str
    body: list[Any] = field(default_factory=list)


@dataclass(frozen=True)
class _Interp:
    ref: str


def _parse(text: str) -> list[Any]:
    for escape in ("$${", "%%{"):
        if escape in text:
            raise TemplateError(f"escape {escape!r} is outside the tested subset")
    root: list[Any] = []
    stack: list[list[Any]] = [root]
    pos = 0
    for match in _TOKEN.finditer(text):
        if match.start() > pos:
            stack[-1].append(text[pos : match.start()])
        pos = match.end()
        opener, inner = match.group(1), match.group(2)
        if inner.startswith("~") or inner.endswith("~"):
            raise TemplateError(f"strip marker in {match.group(0)!r} is outside the tested subset")
        body = inner.strip()
        if opener == "${":
            if not _REF.match(body):
                raise TemplateError(f"{match.group(0)!r}: only plain references are supported")
            stack[-1].append(_Interp(body))
        elif body == "endfor":
            if len(stack) == 1:
                raise TemplateError("%{ endfor } without %{ for }")
            stack.pop()
        else:
            loop = _FOR.match(body)
            if loop is None or not _REF.match(loop.group(2)):
                raise TemplateError(f"{match.group(0)!r}: only %{{ for x in ref }} is supported")
            node = _Loop(loop.group(1), loop.group(2))
            stack[-1].append(node)
            stack.append(node.body)
    for stray in ("${", "%{"):
        if stray in text[pos:]:
            raise TemplateError(f"unterminated {stray!r}")
    if pos < len(text):
        stack[-1].append(text[pos:])
    if len(stack) != 1:
        raise TemplateError("%{ for } without %{ endfor }")
    return root


def _lookup(ref: str, scope: Mapping[str, Any]) -> Any:
    head, *attrs = ref.split(".")
    if head not in scope:
        raise TemplateError(f"{ref!r}: no variable {head!r} (given: {', '.join(sorted(scope))})")
    value = scope[head]
    for attr in attrs:
        if not isinstance(value, Mapping) or attr not in value:
            raise TemplateError(f"{ref!r}: no attribute {attr!r}")
        value = value[attr]
    return value


def number(value: int | float) -> str:
    """A number as Terraform's string conversion writes it: no ``.0`` on whole numbers."""
    if isinstance(value, bool) or not math.isfinite(value):
        raise TemplateError(f"{value!r} is not a number Terraform can render")
    if float(value).is_integer():
        return str(int(value))
    return repr(float(value))


def _scalar(ref: str, value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, int | float) and not isinstance(value, bool):
        return number(value)
    raise TemplateError(f"${{{ref}}} is a {type(value).__name__}: only strings and numbers render")


def _render(nodes: Sequence[Any], scope: Mapping[str, Any], out: list[str]) -> None:
    for node in nodes:
        if isinstance(node, str):
            out.append(node)
        elif isinstance(node, _Interp):
            out.append(_scalar(node.ref, _lookup(node.ref, scope)))
        else:
            items = _lookup(node.ref, scope)
            if isinstance(items, str | Mapping) or not isinstance(items, Sequence):
                raise TemplateError(f"%{{ for }} over {node.ref!r}: only lists are supported")
            for item in items:
                _render(node.body, {**scope, node.var: item}, out)


def render(text: str, variables: Mapping[str, Any]) -> str:
    """``text`` rendered with ``variables`` as ``templatefile()`` would."""
    out: list[str] = []
    _render(_parse(text), variables, out)
    return "".join(out)
