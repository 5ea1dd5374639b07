"""Request bodies parsed as JSON strictly: what ``json.loads`` lets through and JSON does not.

Python's ``json`` accepts ``NaN``, ``Infinity`` and ``-Infinity``, turns ``1e999`` into an
infinity, raises ``RecursionError`` on arrays nested a few thousand deep and ``ValueError`` on
integers of more than ``sys.get_int_max_str_digits()`` digits.  :func:`loads` refuses each with a
:class:`BodyError` that says what is wrong and, for a number, where (``temperature``,
``messages[0].content``), so both HTTP edges (the agent's, the admin API's) answer a 4xx that
names the field instead of a 500 or a NaN forwarded to a node.
"""

from __future__ import annotations

import json
import math
import sys
import threading
from collections.abc import Callable

import msgspec


class BodyError(ValueError):
    """The body is not JSON a client should send.  ``problem`` reads after "the body"
    (``is not valid JSON: ...``); for a number JSON cannot hold, ``field`` is its place
    (``temperature``; ``""``: the body itself) and ``literal`` what was sent (``NaN``)."""

    def __init__(self, problem: str, *, field: str = "", literal: str = "") -> None:
        super().__init__(problem)
        self.problem = problem
        self.field = field
        self.literal = literal


class _NonFinite:
    """Stands in for a number JSON cannot hold while parsing, so the error can name its field."""

    def __init__(self, text: str) -> None:
        self.text = text


class _Refused(Exception):
    """A number JSON cannot hold, met by the fast decoder: parse again to say where."""


def _refuse(text: str) -> object:
    raise _Refused(text)


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _Refused(text)
    return value


# one decoder per thread, built once (json.loads with hooks builds a decoder and its scanner per
# call); its hooks refuse, so a body without NaN, Infinity or an overflowing number is parsed
# once, and one with them a second time by _loads_naming, which says where
_DECODERS = threading.local()


def _decoder() -> json.JSONDecoder:
    decoder: json.JSONDecoder | None = getattr(_DECODERS, "decoder", None)
    if decoder is None:
        decoder = _DECODERS.decoder = json.JSONDecoder(parse_constant=_refuse, parse_float=_finite)
    return decoder


def loads(raw: bytes | str) -> object:
    """``raw`` as JSON; :class:`BodyError` when it is not, or holds what JSON cannot.

    A body is first decoded by msgspec (several times faster than ``json``; it refuses NaN,
    Infinity and numbers out of a float's range, as JSON does); a body it refuses is parsed
    again by ``json`` below, which says what is wrong, or accepts what only msgspec refuses (a
    UTF-16 body, an escaped lone surrogate, ``1e400`` inside a value: refused below, naming the
    field)."""
    if isinstance(raw, bytes):
        try:
            return msgspec.json.decode(raw)
        except (msgspec.MsgspecError, RecursionError, ValueError):  # ValueError: bad UTF-8
            pass
    try:
        return _translated(_fast, raw)
    except _Refused:
        return _translated(_naming, raw)


def _translated(parse: Callable[[bytes | str], object], raw: bytes | str) -> object:
    """``parse(raw)``, with Python's parsing errors as :class:`BodyError`."""
    try:
        return parse(raw)
    except BodyError:
        raise
    except RecursionError:
        raise BodyError(
            "is nested too deeply: arrays and objects nested hundreds of levels deep are more "
            "than the server parses"
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BodyError(f"is not valid JSON: {exc}") from None
    except ValueError:  # Python refuses to convert an integer this long (CVE-2020-10735)
        raise BodyError(
            f"has an integer of more than {sys.get_int_max_str_digits()} digits, too long to "
            "parse; send numbers of an ordinary size"
        ) from None


def _fast(raw: bytes | str) -> object:
    """``json.loads(raw)`` on this thread's decoder; :class:`_Refused` at a number JSON
    cannot hold."""
    if isinstance(raw, str):
        if raw.startswith("\ufeff"):  # as json.loads refuses it
            raise json.JSONDecodeError("Unexpected UTF-8 BOM (decode using utf-8-sig)", raw, 0)
        text = raw
    else:
        text = raw.decode(json.detect_encoding(raw), "surrogatepass")
    return _decoder().decode(text)


def _naming(raw: bytes | str) -> object:
    """The parse of a body that holds a number JSON cannot: the error names its field."""
    bad: list[_NonFinite] = []

    def non_finite(text: str) -> object:
        bad.append(_NonFinite(text))
        return bad[-1]

    def number(text: str) -> object:
        value = float(text)
        return value if math.isfinite(value) else non_finite(text)

    data = json.loads(raw, parse_constant=non_finite, parse_float=number)
    if not bad:  # cannot be: the fast decoder refused a number
        raise BodyError("has a number that is not a JSON number")
    where = path_to(data, bad[0])
    raise BodyError(
        f"has {bad[0].text}, which is not a JSON number", field=where, literal=bad[0].text
    )


def path_to(data: object, target: object) -> str:
    """Where ``target`` is in ``data``: ``temperature``, ``messages[0].content`` (``""`` when it
    is ``data`` itself).  Iterative: ``data`` may be as deep as the parser allows."""
    stack: list[tuple[object, str]] = [(data, "")]
    while stack:
        node, path = stack.pop()
        if node is target:
            return path
        if isinstance(node, dict):
            stack.extend((v, f"{path}.{k}" if path else str(k)) for k, v in node.items())
        elif isinstance(node, list):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(node))
    return ""
