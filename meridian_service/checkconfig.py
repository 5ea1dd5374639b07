"""``--check-config FILE``: a settings file loaded and validated exactly as a start would load it
(the same loader, the environment and flags applied, the same checks of the files it names),
then printed as the effective settings with every secret masked; or every problem, each naming
the file (or the environment variable), the dotted key and what to write instead.

Both daemons use it (``meridian-agent --check-config``, ``meridian-controller --check-config``)
and print load errors of a normal start with :func:`explain` too, so a start and a check say the
same thing.  What is never printed: the value of a ``SecretStr`` field (shown as ``***``), the
value of any other field named like a secret (``*secret``, ``*password``, ``*token``), the
contents of the files settings name (only their paths), and the given value of a secret-named
key in an error message.  Token *hashes* (``api.tokens[].sha256``, ``admin.token_sha256``) are
shown: they are what the files hold, and a hash is not a token.
"""

from __future__ import annotations

import argparse
import difflib
import json
import math
import os
import re
import sys
import tomllib
import types
import typing
from collections.abc import Callable, Mapping
from enum import Enum
from pathlib import Path
from typing import Any, Literal, TypeVar

import pydantic
from pydantic import BaseModel, SecretBytes, SecretStr

from meridian_service import version

MASK = "***"
Format = Literal["toml", "json"]
S = TypeVar("S", bound=BaseModel)

_SECRET_NAME = re.compile(r"(secret|password|passwd|token|api_key)s?$", re.IGNORECASE)
_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")

Loc = tuple[str | int, ...]


# -- problems, in words ------------------------------------------------------------------------


def dotted(loc: Loc) -> str:
    """``("nodes", 0, "weight")`` -> ``nodes[0].weight``; keys that are not bare TOML keys are
    quoted (``stall.models."meta-llama/Llama-3.1-70B".first_token_s``)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            key = part if _BARE_KEY.match(part) else json.dumps(part)
            out += f".{key}" if out else key
    return out


def _unwrap(tp: Any) -> Any:
    """``X | None``, ``Optional[X]`` and ``Annotated[X, ...]`` -> ``X`` (the first model among
    a union's members, else the first member that is not None)."""
    while True:
        origin = typing.get_origin(tp)
        if origin is typing.Annotated:
            tp = typing.get_args(tp)[0]
            continue
        if origin is typing.Union or origin is types.UnionType:
            members = [a for a in typing.get_args(tp) if a is not type(None)]
            models = [a for a in members if _is_model(a)]
            tp = (models or members or [Any])[0]
            continue
        return tp


def _is_model(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, BaseModel)


def model_at(model: type[BaseModel], loc: Loc) -> type[BaseModel] | None:
    """The settings model that holds the keys at ``loc`` (``()``: ``model`` itself), following
    fields, list items and dict values; None where ``loc`` leads to no model."""
    tp: Any = model
    for part in loc:
        tp = _unwrap(tp)
        origin = typing.get_origin(tp)
        if _is_model(tp) and isinstance(part, str):
            field = tp.model_fields.get(part)
            if field is None:
                return None
            tp = field.annotation
        elif origin in (list, tuple, set, frozenset) and isinstance(part, int):
            tp = typing.get_args(tp)[0] if typing.get_args(tp) else Any
        elif origin in (dict, Mapping) and isinstance(part, str):
            tp = typing.get_args(tp)[1] if len(typing.get_args(tp)) == 2 else Any
        else:
            return None
    tp = _unwrap(tp)
    return tp if _is_model(tp) else None


def _in_data(data: Any, loc: Loc) -> bool:
    for part in loc:
        if isinstance(part, int):
            if not isinstance(data, list) or not 0 <= part < len(data):
                return False
        elif not isinstance(data, dict) or part not in data:
            return False
        data = data[part]
    return True


def _source(
    loc: Loc,
    *,
    config_file: Path | None,
    env_prefix: str,
    overrides: Mapping[str, Any] | None,
) -> str:
    """Where the value at ``loc`` came from, in the loader's order: the command line when a flag
    set it, else the environment variable that set it (or one holding JSON above it), else the
    file (or "settings" without one)."""
    if overrides and _in_data(overrides, loc):
        return "command line"
    keys = [str(p) for p in loc if isinstance(p, str)]
    env = {name.upper() for name in os.environ}
    for n in range(len(keys), 0, -1):  # the variable itself, or one holding JSON above it
        name = f"{env_prefix}{'__'.join(keys[:n]).upper()}"
        if name in env:
            return f"environment {name}"
    return str(config_file) if config_file is not None else "settings"


def _message(error: Mapping[str, Any]) -> str:
    msg = str(error["msg"])
    for prefix in ("Value error, ", "Assertion failed, "):
        if msg.startswith(prefix):
            msg = msg[len(prefix) :]
    loc: Loc = tuple(error["loc"])
    names = [p for p in loc if isinstance(p, str)]
    secret = bool(names) and _SECRET_NAME.search(names[-1]) is not None
    value = error.get("input")
    if (
        not secret
        and error["type"] not in ("missing", "value_error", "assertion_error")
        and isinstance(value, str | int | float | bool)
        and not isinstance(value, SecretStr)
    ):
        msg += f" (got {json.dumps(value)})"
    return msg


def explain(
    exc: pydantic.ValidationError,
    *,
    model: type[BaseModel],
    config_file: Path | None,
    env_prefix: str,
    overrides: Mapping[str, Any] | None = None,
) -> list[str]:
    """One line per problem: ``<file or environment variable>: <dotted key>: <what is wrong>``.

    An unknown key (a typo: every settings group forbids extra keys) names the nearest valid key
    at its level, ``agent.toml: unknown key "routing.polcy" — did you mean "routing.policy"?``,
    or lists the valid ones when none is near."""
    lines = []
    for error in exc.errors():
        loc: Loc = tuple(error["loc"])
        where = _source(
            loc,
            config_file=config_file,
            env_prefix=env_prefix,
            overrides=overrides,
        )
        if error["type"] == "extra_forbidden" and loc and isinstance(loc[-1], str):
            holder = model_at(model, loc[:-1])
            names = sorted(holder.model_fields) if holder is not None else []
            near = difflib.get_close_matches(loc[-1], names, n=1, cutoff=0.6)
            if near and where.startswith("environment"):
                keys = [str(p) for p in (*loc[:-1], near[0])]
                fix = f"did you mean {env_prefix}{'__'.join(keys).upper()}?"
            elif near:
                fix = f'did you mean "{dotted((*loc[:-1], near[0]))}"?'
            elif names:
                level = f"[{dotted(loc[:-1])}]" if loc[:-1] else "the top level"
                fix = f"the keys of {level} are: {', '.join(names)}"
            else:
                fix = "remove it"
            lines.append(f'{where}: unknown key "{dotted(loc)}" — {fix}')
        else:
            lines.append(f"{where}: {dotted(loc) or 'settings'}: {_message(error)}")
    return lines


# -- the effective settings, masked ------------------------------------------------------------


def effective(settings: BaseModel) -> dict[str, Any]:
    """The settings as plain data (TOML and JSON types), every secret replaced by ``***``."""
    out = _plain(settings, "")
    assert isinstance(out, dict)
    return out


def _plain(value: Any, name: str) -> Any:
    if isinstance(value, SecretStr | SecretBytes):
        return MASK
    if isinstance(value, BaseModel):
        return {k: _plain(getattr(value, k), k) for k in type(value).model_fields}
    if isinstance(value, Mapping):
        return {str(k): _plain(v, str(k)) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_plain(v, name) for v in value]
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, Enum):
        return _plain(value.value, name)
    if isinstance(value, str | bytes) and value and _SECRET_NAME.search(name):
        return MASK
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return str(value)


def _toml_string(text: str) -> str:
    out = ['"']
    for ch in text:
        if ch in ('"', "\\"):
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def _toml_key(key: str) -> str:
    return key if _BARE_KEY.match(key) else _toml_string(key)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value if v is not None) + "]"
    if isinstance(value, dict):
        items = [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value.items() if v is not None]
        return "{ " + ", ".join(items) + " }" if items else "{}"
    raise TypeError(f"cannot write {type(value).__name__} as TOML")


def _is_tables(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, dict) for v in value)


def _table(lines: list[str], path: list[str], table: Mapping[str, Any]) -> None:
    for key, value in table.items():
        if isinstance(value, dict) or _is_tables(value):
            continue
        if value is None:
            lines.append(f"# {_toml_key(key)}: unset")
        else:
            lines.append(f"{_toml_key(key)} = {_toml_value(value)}")
    for key, value in table.items():
        name = ".".join(_toml_key(k) for k in [*path, key])
        if isinstance(value, dict):
            lines += ["", f"[{name}]"]
            _table(lines, [*path, key], value)
        elif _is_tables(value):
            for item in value:
                lines += ["", f"[[{name}]]"]
                _table(lines, [*path, key], item)


def to_toml(data: Mapping[str, Any]) -> str:
    """``data`` as a TOML document that ``tomllib`` reads back to ``data`` without its None
    values (which TOML cannot hold: each is a ``# key: unset`` comment)."""
    lines: list[str] = []
    _table(lines, [], data)
    return "\n".join(lines).strip("\n") + "\n"


# -- the check ---------------------------------------------------------------------------------


def check(
    load: Callable[[], S],
    *,
    prog: str,
    config_file: Path,
    model: type[BaseModel],
    env_prefix: str,
    overrides: Mapping[str, Any] | None = None,
    start_checks: Callable[[S], object] = lambda _: None,
    output: Format = "toml",
    out: typing.TextIO | None = None,
    err: typing.TextIO | None = None,
) -> int:
    """Load with ``load`` (the start's own loader), run ``start_checks`` (what a start checks
    after loading: TLS pairs, a node list; a ``ValueError`` names the setting), print the
    effective settings on ``out`` and return 0; or print every problem on ``err`` and return
    2."""
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    try:
        settings = load()
        start_checks(settings)
    except pydantic.ValidationError as exc:
        lines = explain(
            exc, model=model, config_file=config_file, env_prefix=env_prefix, overrides=overrides
        )
        err.write(f"{prog}: {config_file}: invalid settings:\n")
        err.write("".join(f"  {line}\n" for line in lines))
        return 2
    except tomllib.TOMLDecodeError as exc:
        err.write(f"{prog}: {config_file}: not valid TOML: {exc}\n")
        return 2
    except FileNotFoundError as exc:
        err.write(f"{prog}: {exc}\n")
        return 2
    except (OSError, ValueError) as exc:
        err.write(f"{prog}: {config_file}: invalid settings:\n  {exc}\n")
        return 2
    data = effective(settings)
    if output == "json":
        out.write(json.dumps(data, indent=2) + "\n")
    else:
        out.write(
            f"# {prog} {version.version()}: the effective settings of {config_file} (flags >\n"
            f"# environment {env_prefix}* > the file > defaults), secrets shown as {MASK}\n"
        )
        out.write(to_toml(data))
    return 0


def add_flags(parser: argparse.ArgumentParser, *, prog: str) -> None:
    """``--check-config FILE`` and ``--output {toml,json}`` on an ``argparse`` parser."""
    parser.add_argument(
        "--check-config",
        type=Path,
        metavar="FILE",
        help=f"load FILE (with the environment and the other flags) as a start of {prog} "
        "would, check it as a start does, print the effective settings with secrets masked "
        "and exit: 0 when valid, 2 with every problem named otherwise; starts nothing",
    )
    parser.add_argument(
        "--output",
        choices=["toml", "json"],
        default="toml",
        help="what --check-config prints the settings as (default toml)",
    )


def same_file(config: Path | None, check_config: Path) -> str | None:
    """Why ``--config`` and ``--check-config`` cannot be given together, or None."""
    if config is None or config.resolve() == check_config.resolve():
        return None
    return f"--config {config} and --check-config {check_config} name two files: give one"
