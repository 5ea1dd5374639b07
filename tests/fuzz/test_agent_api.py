"""A Hypothesis fuzzer of the agent's OpenAI endpoints: generated requests, from nearly right to
hostile (wrong types, lone surrogates, NaN, deep nesting, garbage bytes, odd methods and paths),
against a real ``meridian-agent`` process in front of a real ``meridian-sim`` node.  No answer
may be a 5xx; every refusal is an OpenAI-style error body; and the agent keeps serving.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.faults.harness import MODEL, AgentProc, start_nodes
from tests.support.ports import free_port

pytestmark = pytest.mark.fuzz


@pytest.fixture(scope="module")
def agent_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    logs = tmp_path_factory.mktemp("fuzz-agent")
    (node,) = start_nodes(1, logs, time_scale=50.0)
    config = f'[[nodes]]\nurl = "{node.url}"\n'
    agent = AgentProc(port=free_port(), log_dir=logs, config=config).start()
    try:
        yield agent.url
    finally:
        agent.stop()
        node.stop()
        log = agent.process.log_path if agent.process is not None else None
        text = Path(log).read_text(errors="replace") if log is not None else ""
        assert "Traceback" not in text, text[-3000:]  # nothing the clients sent crashed it


_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=40),
    st.sampled_from(["\ud800", "\udfff", "a\x00b", "ç\u200b", "<|im_end|>"]),  # hostile text
)
_json = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=12,
)
_content = st.one_of(
    st.text(max_size=200),
    st.lists(
        st.fixed_dictionaries(
            {"type": st.sampled_from(["text", "image_url", "audio", 5])}, optional={"text": _json}
        ),
        max_size=3,
    ),
    _json,
)
_message = st.fixed_dictionaries(
    {},
    optional={
        "role": st.one_of(st.sampled_from(["system", "user", "assistant", "tool", "x"]), _json),
        "content": _content,
        "name": _json,
    },
)
_model = st.one_of(st.just(MODEL), st.sampled_from(["other-model", ""]), _json)
_knobs: dict[str, st.SearchStrategy[Any]] = {
    "max_tokens": st.one_of(st.integers(-5, 40), _json),
    "stream": st.one_of(st.booleans(), _json),
    "temperature": st.one_of(st.floats(0, 2), _json),
    "top_p": st.one_of(st.floats(0, 1), _json),
    "n": st.one_of(st.integers(-1, 3), _json),
    "user": _json,
    "stop": _json,
}
_chat = st.fixed_dictionaries(
    {"model": _model, "messages": st.one_of(st.lists(_message, max_size=4), _json)},
    optional=_knobs,
)
_completion = st.fixed_dictionaries(
    {"model": _model, "prompt": st.one_of(st.text(max_size=200), st.lists(st.integers()), _json)},
    optional=_knobs,
)
_items = st.lists(
    st.fixed_dictionaries(
        {}, optional={"role": st.one_of(st.sampled_from(["user", "developer", "x"]), _json),
                      "content": _content, "type": st.one_of(st.just("message"), _json)}
    ),
    max_size=3,
)  # fmt: skip
_responses = st.fixed_dictionaries(
    {"model": _model},
    optional={
        "input": st.one_of(st.text(max_size=200), _items, _json),
        "instructions": _json,
        "max_output_tokens": st.one_of(st.integers(-5, 40), _json),
        "stream": st.one_of(st.booleans(), _json),
    },
)
_anthropic = st.fixed_dictionaries(
    {"model": _model, "messages": st.one_of(st.lists(_message, max_size=3), _json)},
    optional={"system": _json, "max_tokens": st.one_of(st.integers(-5, 40), _json)},
)
_embeddings = st.fixed_dictionaries(
    {},
    optional={
        "model": _model,
        "input": st.one_of(st.text(max_size=100), st.lists(st.text(max_size=20), max_size=3),
                           st.lists(st.integers(), max_size=5), _json),
        "encoding_format": _json,
        "dimensions": _json,
        "tokens": st.one_of(st.lists(st.integers(), max_size=5), _json),
        "prompt": _json,
    },
)  # fmt: skip
_raw_bodies = st.one_of(
    st.binary(max_size=300),
    st.sampled_from(
        [
            b"",
            b"{",
            b"[" * 50_000,
            b'{"model": NaN}',
            b'{"model": "tiny-model", "messages": '
            b'[{"role": "user", "content": "hi"}], "temperature": Infinity}',
            b"\xff\xfe{}",
            b"null",
        ]
    ),
)
_valid_chat = st.fixed_dictionaries(
    {
        "model": st.just(MODEL),
        "messages": st.lists(
            st.fixed_dictionaries(
                {"role": st.sampled_from(["system", "user", "assistant"]),
                 "content": st.text(max_size=300)}
            ),
            min_size=1, max_size=4,
        ),
    },
    optional={
        "max_tokens": st.integers(1, 16),
        "stream": st.booleans(),
        "temperature": st.floats(0, 2),
        "user": st.text(max_size=10),
        "seed": st.integers(0, 2**31),
        "tools": st.just([{"type": "function", "function": {"name": "f", "parameters": {}}}]),
    },
)  # fmt: skip
_request = st.one_of(
    st.tuples(st.just("POST"), st.just("/v1/chat/completions"), _valid_chat.map(json.dumps)),
    st.tuples(st.just("POST"), st.just("/v1/chat/completions"), _chat.map(json.dumps)),
    st.tuples(st.just("POST"), st.just("/v1/completions"), _completion.map(json.dumps)),
    st.tuples(st.just("POST"), st.just("/v1/responses"), _responses.map(json.dumps)),
    st.tuples(st.just("POST"), st.just("/v1/messages"), _anthropic.map(json.dumps)),
    st.tuples(
        st.just("POST"),
        st.sampled_from(["/v1/embeddings", "/tokenize", "/detokenize", "/v1/score", "/pooling"]),
        _embeddings.map(json.dumps),
    ),
    st.tuples(
        st.sampled_from(["POST", "GET", "PUT", "DELETE", "PATCH"]),
        st.sampled_from(
            [
                "/v1/chat/completions",
                "/v1/completions",
                "/v1/models",
                "/v1/models/tiny-model",
                "/v1/models/a/b/%00",
                "/v1/responses",
                "/v1/responses/resp_x",
                "/v1/responses/resp_x/cancel",
                "/v1/audio/transcriptions",
                "/v1/embeddings",
                "/v1/nope",
                "/health",
                "/admin/nodes",
                "/%00",
                "/v1/../admin/queue",
            ]
        ),
        _raw_bodies.map(lambda b: b.decode("latin-1")),
    ),
)

SEEN: Counter[str] = Counter()


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(request=_request, headers=st.dictionaries(
    st.sampled_from(["X-Priority", "X-Tenant", "X-Session-ID", "Content-Type", "X-Request-ID"]),
    st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=20),
    max_size=3,
))  # fmt: skip
def test_no_request_makes_the_agent_fail(
    agent_url: str, request: tuple[str, str, str], headers: dict[str, str]
) -> None:
    method, path, body = request
    with httpx.Client(base_url=agent_url, timeout=30, trust_env=False) as client:
        r = client.request(method, path, content=body.encode("latin-1"), headers=headers)
        SEEN[str(r.status_code)] += 1
        assert r.status_code < 500, (method, path, body[:300], r.status_code, r.text[:500])
        if r.status_code >= 400 and r.headers.get("content-type", "").startswith(
            "application/json"
        ):
            error = r.json().get("error")
            assert isinstance(error, dict) and error.get("message"), r.text[:500]
        # and everyone else is still served
        ok = client.post(
            "/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 2}
        )
        assert ok.status_code == 200, ok.text


def test_the_fuzzer_reached_both_sides(agent_url: str) -> None:
    """Runs after the fuzzer in this module: it sent requests the agent served and refused."""
    print(f"agent fuzzed: {dict(SEEN)}")
    assert sum(v for k, v in SEEN.items() if k.startswith("2")) > 0
    assert sum(v for k, v in SEEN.items() if k.startswith("4")) > 0
