"""The Inputs and Outputs tables of deploy/terraform's READMEs, made from variables.tf and
outputs.tf (the format terraform-docs writes: name, description, type, default, required).

    .venv/bin/python -m tests.deploy.tfdocs          # rewrite the tables of every README
    .venv/bin/python -m tests.deploy.tfdocs --check  # exit 1 and name the READMEs that differ

tests/deploy/test_terraform.py checks that every README's tables are what this makes, so a
variable added, removed, retyped or redescribed without the README following fails there.
Only the two tables are generated; the prose around them is the README's own.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

from lark import Token

from tests.deploy import hcleval, tftemplate

ROOT = Path(__file__).resolve().parents[2]
MODULES = [
    ROOT / "deploy" / "terraform" / "modules" / "region",
    ROOT / "deploy" / "terraform" / "modules" / "global",
    ROOT / "deploy" / "terraform" / "examples" / "three-regions",
]

INPUTS_HEAD = (
    "| Name | Description | Type | Default | Required |\n"
    "|------|-------------|------|---------|:--------:|\n"
)
OUTPUTS_HEAD = "| Name | Description |\n|------|-------------|\n"
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _type(node: Any) -> str:
    """A ``type = ...`` expression as written, normalised: ``object({ cpu = string })``."""
    if isinstance(node, Token):
        return str(node.value)
    kids = hcleval._kids(node)
    if node.data in ("expr_term", "expression") and len(kids) == 1:
        return _type(kids[0])
    if node.data == "identifier":
        return hcleval._name(node)
    if node.data == "function_call":
        name = hcleval._name(kids[0])
        args = hcleval._kids(kids[1]) if len(kids) > 1 else []
        return f"{name}({', '.join(_type(a) for a in args)})"
    if node.data == "object":
        fields = []
        for elem in kids:
            key, value = hcleval._kids(elem)[0], hcleval._kids(elem)[-1]
            fields.append(f"{hcleval._object_key(key, hcleval.Scope())} = {_type(value)}")
        return "{ " + ", ".join(fields) + " }" if fields else "{}"
    raise ValueError(f"type {hcleval._text(node)!r} is not rendered here")


def _value(value: Any) -> str:
    """A default value in HCL syntax: ``null``, ``"x"``, ``[]``, ``{ cpu = "8" }``."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return tftemplate.number(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    if isinstance(value, dict):
        if not value:
            return "{}"
        items = [
            f"{k if _IDENT.match(k) else json.dumps(k)} = {_value(v)}" for k, v in value.items()
        ]
        return "{ " + ", ".join(items) + " }"
    raise ValueError(f"default {value!r} is not rendered here")


def _cell(text: str) -> str:
    """Markdown table cell text: ``|`` escaped, ``<`` and ``>`` as entities outside code."""
    parts = text.replace("|", "\\|").split("`")
    for i in range(0, len(parts), 2):  # outside backticks
        parts[i] = parts[i].replace("<", "&lt;").replace(">", "&gt;")
    return "`".join(parts)


def _description(block: hcleval.Block) -> str:
    value = hcleval.evaluate(block.attributes["description"], hcleval.Scope())
    assert isinstance(value, str)
    return _cell(value)


def inputs_table(module: Path) -> str:
    rows = []
    for block in hcleval.load_module(module, ["variables.tf"]).children("variable"):
        name = block.labels[0]
        if "default" in block.attributes:
            default = f"`{_value(hcleval.evaluate(block.attributes['default'], hcleval.Scope()))}`"
            required = "no"
        else:
            default, required = "n/a", "yes"
        kind = _type(block.attributes["type"])
        rows.append(f"| `{name}` | {_description(block)} | `{kind}` | {default} | {required} |\n")
    return INPUTS_HEAD + "".join(rows)


def outputs_table(module: Path) -> str:
    rows = [
        f"| `{block.labels[0]}` | {_description(block)} |\n"
        for block in hcleval.load_module(module, ["outputs.tf"]).children("output")
    ]
    return OUTPUTS_HEAD + "".join(rows)


def _replace_table(text: str, heading: str, table: str) -> str:
    """The first table after ``heading`` replaced by ``table``."""
    start = text.index(f"\n{heading}\n")
    table_start = text.index("\n|", start) + 1
    end = table_start
    while end < len(text) and text.startswith("|", end):
        end = text.index("\n", end) + 1
    return text[:table_start] + table + text[end:]


def render(module: Path) -> str:
    """The module's README with both tables made from its .tf files."""
    text = (module / "README.md").read_text()
    text = _replace_table(text, "## Inputs", inputs_table(module))
    return _replace_table(text, "## Outputs", outputs_table(module))


def main(argv: list[str]) -> int:
    stale = [m for m in MODULES if render(m) != (m / "README.md").read_text()]
    if "--check" in argv:
        for module in stale:
            print(f"{module / 'README.md'}: tables differ from the .tf files", file=sys.stderr)
        return 1 if stale else 0
    for module in stale:
        (module / "README.md").write_text(render(module))
        print(f"rewrote {module / 'README.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
