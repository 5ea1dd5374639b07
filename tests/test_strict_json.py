"""meridian_service.strict_json: msgspec decodes first, and whatever it refuses is parsed again by
``json``, so a body is accepted, with an equal value, or refused, with the same message, exactly
as the ``json`` path alone would."""

from __future__ import annotations

import json
import math
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meridian_service import strict_json

_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)  # fmt: skip


@given(value=_JSON, ascii_only=st.booleans())
def test_any_json_decodes_as_json_does(value: object, ascii_only: bool) -> None:
    raw = json.dumps(value, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")
    assert strict_json.loads(raw) == json.loads(raw)


def _refusal(raw: bytes) -> str:
    with pytest.raises(strict_json.BodyError) as caught:
        strict_json.loads(raw)
    return caught.value.problem


def test_bytes_that_are_not_utf8_are_a_body_error_not_a_crash() -> None:
    """msgspec raises UnicodeDecodeError (not its own error) for them: the json path says it."""
    assert "not valid JSON" in _refusal(b'{"model": "m", "prompt": "K\xfcche"}')
    assert "not valid JSON" in _refusal(b'{"K\xfcche": 1}')


def test_what_only_msgspec_refuses_is_accepted_as_before() -> None:
    # a lone surrogate, escaped or as (invalid) UTF-8 bytes: json keeps it (the prompt's check
    # then names the field); UTF-16 bodies and a UTF-8 BOM, which json detects
    assert strict_json.loads(b'{"p": "\\ud800"}') == {"p": "\ud800"}
    assert strict_json.loads(b'{"p": "\xed\xa0\x80"}') == {"p": "\ud800"}
    assert strict_json.loads('{"p": 1}'.encode("utf-16")) == {"p": 1}
    assert strict_json.loads(b'\xef\xbb\xbf{"p": 1}') == {"p": 1}  # a UTF-8 BOM


@pytest.mark.parametrize(
    ("raw", "field", "literal"),
    [
        (b'{"temperature": NaN}', "temperature", "NaN"),
        (b'{"a": [1, Infinity]}', "a[1]", "Infinity"),
        (b'{"x": 1e400}', "x", "1e400"),
        (b"-1e999", "", "-1e999"),
    ],
)
def test_numbers_json_cannot_hold_are_refused_naming_the_field(
    raw: bytes, field: str, literal: str
) -> None:
    with pytest.raises(strict_json.BodyError) as caught:
        strict_json.loads(raw)
    assert (caught.value.field, caught.value.literal) == (field, literal)


def test_the_rest_of_what_json_refuses_is_refused_as_json_says() -> None:
    assert "not valid JSON" in _refusal(b'{"a": 1} trailing')
    assert "not valid JSON" in _refusal(b'{"a": "line\nbreak"}')
    digits = sys.get_int_max_str_digits() + 1
    assert "digits" in _refusal(b"1" * digits)
    assert "nested too deeply" in _refusal(b"[" * 100_000 + b"]" * 100_000)


def test_large_integers_and_floats_keep_their_values() -> None:
    assert strict_json.loads(b"123456789012345678901234567890") == 123456789012345678901234567890
    assert strict_json.loads(b"[-0.0, 1e-400, 0.1]") == [-0.0, 0.0, 0.1]
    assert math.copysign(1, strict_json.loads(b"-0.0")) == -1  # type: ignore[arg-type]
