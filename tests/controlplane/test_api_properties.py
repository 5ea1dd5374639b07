"""Property-based tests of the admin API against its own OpenAPI document, on a live stack.

For every operation in ``/v1/openapi.json``, Hypothesis draws path and query parameters, a
body (valid by the document's JSON Schema, near-valid, or arbitrary JSON and bytes) and a token
of any role or none.  Whatever comes in: no 5xx; every refusal is ``application/problem+json``
with a detail; calls without a valid token get 401; writes with a viewer token get 403.
(Strategies are built here from the document's schemas: schemathesis would pull a dependency
tree this project does not otherwise need.)
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.meridianctl.stack import TOKENS, Stack, leading
from tests.support import EtcdServer

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner,
                                                                 max_size=4),
    max_leaves=10,
)  # fmt: skip


def from_schema(schema: dict[str, Any], defs: dict[str, Any]) -> st.SearchStrategy[Any]:
    """A strategy for values valid by ``schema`` (the subset of JSON Schema pydantic emits)."""
    if "$ref" in schema:
        return from_schema(defs[schema["$ref"].rsplit("/", 1)[1]], defs)
    if "anyOf" in schema:
        return st.one_of([from_schema(s, defs) for s in schema["anyOf"]])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if kind == "null":
        return st.none()
    if kind == "boolean":
        return st.booleans()
    if kind == "integer":
        return st.integers(schema.get("minimum"), schema.get("maximum"))
    if kind == "number":
        low = schema.get("minimum", schema.get("exclusiveMinimum"))
        high = schema.get("maximum", schema.get("exclusiveMaximum"))
        return st.floats(
            low, high, allow_nan=False, allow_infinity=False,
            exclude_min="exclusiveMinimum" in schema, exclude_max="exclusiveMaximum" in schema,
        )  # fmt: skip
    if kind == "string":
        return st.text(min_size=schema.get("minLength", 0), max_size=schema.get("maxLength", 30))
    if kind == "array":
        return st.lists(
            from_schema(schema.get("items", {}), defs),
            min_size=schema.get("minItems", 0),
            max_size=min(schema.get("maxItems", 5), 5),
        )
    if kind == "object":
        props = schema.get("properties", {})
        required = set(schema.get("required", []))
        return st.fixed_dictionaries(
            {k: from_schema(v, defs) for k, v in props.items() if k in required},
            optional={k: from_schema(v, defs) for k, v in props.items() if k not in required},
        )
    return JSON


REGIONS = st.sampled_from(["eu-west", "eu-north", "us-east", "mars-1", "EU", "a%2Fb", "x" * 70])
TOKEN = st.sampled_from([None, "viewer", "operator", "admin", "bogus"])


@pytest.fixture
async def stack(etcd: EtcdServer) -> AsyncIterator[Stack]:
    async with leading(etcd.url) as s:
        yield s


async def test_no_input_makes_the_api_fail(stack: Stack) -> None:
    base = stack.url("ctl-a")
    async with httpx.AsyncClient() as c:
        doc = (await c.get(base + "/v1/openapi.json")).json()
    defs = doc["components"]["schemas"]
    operations = [
        (path, method, op) for path, ops in doc["paths"].items() for method, op in ops.items()
    ]

    @st.composite
    def calls(draw: st.DrawFn) -> dict[str, Any]:
        path, method, op = draw(st.sampled_from(operations))
        url = path.replace("{region}", draw(REGIONS))
        params = {}
        for p in op["parameters"]:
            if p["in"] == "query" and draw(st.booleans()):
                valid = from_schema(p["schema"], defs).map(
                    lambda v: json.dumps(v) if isinstance(v, bool) else str(v)
                )
                params[p["name"]] = draw(valid | st.text(max_size=10))
        content: bytes | None = None
        if "requestBody" in op:
            schema = op["requestBody"]["content"]["application/json"]["schema"]
            body = draw(
                from_schema(schema, defs)
                | from_schema(schema, defs).map(lambda b: {**b, "reason": ""})
                | JSON
            )
            content = json.dumps(body).encode()
            if draw(st.integers(0, 9)) == 0:
                content = draw(st.binary(max_size=40))
        role = draw(TOKEN)
        headers = {"Content-Type": "application/json"}
        if role is not None:
            headers["Authorization"] = f"Bearer {TOKENS.get(role, role)}"
        if draw(st.booleans()):
            headers["Idempotency-Key"] = draw(st.text("abc", min_size=1, max_size=3))
        needs = op.get("x-role")
        return {"method": method.upper(), "url": url, "params": params, "content": content,
                "headers": headers, "role": role, "needs": needs}  # fmt: skip

    client = httpx.Client(base_url=base, timeout=15)

    @settings(max_examples=250, deadline=None, suppress_health_check=list(HealthCheck))
    @given(calls())
    def check(call: dict[str, Any]) -> None:
        r = client.request(
            call["method"], call["url"], params=call["params"], content=call["content"],
            headers=call["headers"],
        )  # fmt: skip
        assert r.status_code < 500, (call, r.status_code, r.text)
        if r.status_code >= 400:
            assert r.headers["content-type"].startswith("application/problem+json"), call
            problem = r.json()
            assert problem["status"] == r.status_code and problem["detail"], call
        if call["needs"] is not None and call["role"] in (None, "bogus"):
            assert r.status_code == 401, (call, r.text)
        if call["needs"] in ("operator", "admin") and call["role"] == "viewer":
            assert r.status_code == 403, (call, r.text)

    def run() -> None:
        with client:
            check()

    await asyncio.to_thread(run)
