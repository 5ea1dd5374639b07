"""Write docs/agent-settings.md from the agent's settings classes (their defaults and descriptions).

    .venv/bin/python scripts/settings_reference.py [--check]

``--check`` exits 1 when the file is out of date (the test suite runs it).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from policies import routing  # noqa: E402
from regional_agent.settings import (  # noqa: E402
    DnsDiscoverySettings,
    KeyEntry,
    NodeSettings,
    Settings,
    TenantEntry,
)

OUT = ROOT / "docs" / "agent-settings.md"


def _default(field: object) -> str:
    value = getattr(field, "default", PydanticUndefined)
    factory = getattr(field, "default_factory", None)
    if value is PydanticUndefined and factory is not None:
        value = factory()
    if value is PydanticUndefined:
        return "(required)"
    if isinstance(value, BaseModel):
        return ""
    return f"`{value!r}`" if value not in (None, {}, []) else f"`{value}`"


def render() -> str:
    lines = [
        "# meridian-agent settings",
        "",
        "Generated from `regional_agent/settings.py` by `scripts/settings_reference.py`; do",
        "not edit by hand. Set them in the TOML file given with `--config` (`[group]` tables,",
        "`[[nodes]]` entries), as environment variables (`MERIDIAN_AGENT_<GROUP>__<FIELD>`, e.g.",
        "`MERIDIAN_AGENT_QUEUE__MAX_DEPTH=200`), or with the flags `--host`, `--port`, `--node`,",
        "`--discover-dns NAME:PORT`, `--discover-srv NAME`, `--policy`, `--region`, `--geo`,",
        "`--residency`, `--endpoint`, `--etcd` and `--actuator`. Flags win over the",
        "environment, which wins over the file. Secrets never",
        "go on the command line: the admin token comes from `admin.token_file`,",
        "`admin.token_sha256` or `MERIDIAN_AGENT_ADMIN__TOKEN` (docs/security.md).",
        "",
    ]
    for name, field in Settings.model_fields.items():
        annotation = field.annotation
        group = (
            annotation
            if isinstance(annotation, type) and issubclass(annotation, BaseModel)
            else None
        )
        if name == "nodes":
            group = NodeSettings
            lines += ["## `[[nodes]]`", "", f"{field.description}: one table per node.", ""]
        elif group is not None:
            lines += [f"## `[{name}]`", ""]
        if group is None:
            continue
        lines += ["| setting | default | meaning |", "|---|---|---|"]
        nested: list[tuple[str, type[BaseModel], str]] = []
        for sub, f in group.model_fields.items():
            kind = f.annotation
            if isinstance(kind, type) and issubclass(kind, BaseModel):
                nested.append((sub, kind, f.description or ""))
                lines.append(f"| `{sub}` | | the `[{name}.{sub}]` table below |")
                continue
            lines.append(f"| `{sub}` | {_default(f)} | {f.description or ''} |")
        lines.append("")
        for sub, model, description in nested:
            lines += [f"### `[{name}.{sub}]`", "", description, ""] if description else [
                f"### `[{name}.{sub}]`", ""]  # fmt: skip
            lines += ["| setting | default | meaning |", "|---|---|---|"]
            for leaf, f in model.model_fields.items():
                lines.append(f"| `{leaf}` | {_default(f)} | {f.description or ''} |")
            lines.append("")
        if name == "routing":
            lines += [
                "`[routing.tuning]` accepts these `policies.routing.RoutingConfig` fields "
                "(docs/agent.md explains each):",
                "",
                "| tuning field | default |",
                "|---|---|",
            ]
            lines += [
                f"| `{f.name}` | `{f.default!r}` |"
                for f in dataclasses.fields(routing.RoutingConfig)
            ]
            lines.append("")
        if name == "discovery":
            lines += [
                "Each `[[discovery.dns]]` table is one DNS name whose records are nodes",
                '(docs/agent.md, "Node discovery"):',
                "",
                "| `[[discovery.dns]]` field | default | meaning |",
                "|---|---|---|",
            ]
            for sub, f in DnsDiscoverySettings.model_fields.items():
                lines.append(f"| `{sub}` | {_default(f)} | {f.description or ''} |")
            lines.append("")
        if name == "tokenizer":
            lines += [
                'Each `[tokenizer.models."MODEL"]` table takes the file fields of `[tokenizer]`',
                "(`model_dir`, `tokenizer_file`, `chat_template_file`, `tokenizer_config_file`,",
                '`bos_token`, `eos_token`) for that model alone (docs/agent.md, "Prompts with the',
                "model's own tokenizer\").",
                "",
            ]
        if name == "tenants":
            lines += [
                "The keys file (`tenants.keys_file`, a TOML file of its own) holds one",
                "`[[tenants]]` table per tenant, each with its `[[tenants.keys]]` (docs/agent.md,",
                '"Tenants, keys and rate limits"):',
                "",
            ]
            for table, model in (("[[tenants]]", TenantEntry), ("[[tenants.keys]]", KeyEntry)):
                lines += [f"| `{table}` field | default | meaning |", "|---|---|---|"]
                for sub, f in model.model_fields.items():
                    if sub != "keys":
                        lines.append(f"| `{sub}` | {_default(f)} | {f.description or ''} |")
                lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="fail if the file is out of date")
    args = parser.parse_args()
    text = render()
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is out of date: run scripts/settings_reference.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
