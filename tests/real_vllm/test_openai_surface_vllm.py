"""The whole OpenAI surface through the agent, against real vLLM 0.32 on CPU (issue 22): what
the tiny generative model serves works through the agent as it does on vLLM itself, what it
does not serve is vLLM's own 404 relayed (never a 5xx), fields the agent does not read reach
vLLM untouched, and every answer carries the request id.  The path list vLLM serves is held to
the fixture the fast tests check the agent's table against."""

from __future__ import annotations

import json
from pathlib import Path

import aiohttp
import openai
import pytest

from tests.support.agent import AgentFactory
from tests.support.agent import openai_client as _client
from tests.support.vllm import MAX_MODEL_LEN, MODEL_NAME, VllmServer

pytestmark = [pytest.mark.real_vllm, pytest.mark.timeout(900)]

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "vllm" / "openapi-paths-0.32.json"
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


async def test_vllm_serves_the_paths_of_the_fixture(vllm_nodes: list[VllmServer]) -> None:
    async with (
        aiohttp.ClientSession() as s,
        s.get(f"{vllm_nodes[0].url}/openapi.json") as r,
    ):
        spec = await r.json()
    live = {p: sorted(m.upper() for m in ops) for p, ops in spec["paths"].items()}
    assert live == json.loads(FIXTURE.read_text())["paths"]  # a new vLLM: update the table


async def test_the_openai_client_through_the_agent_on_vllm(
    vllm_nodes: list[VllmServer], start_agent: AgentFactory
) -> None:
    handle = await start_agent([n.url for n in vllm_nodes])
    async with _client(handle.url) as client:
        card = await client.models.retrieve(MODEL_NAME)  # vLLM itself has no such path
        assert card.id == MODEL_NAME
        assert card.model_extra and card.model_extra["max_model_len"] == MAX_MODEL_LEN

        # a generative model serves no embeddings: vLLM's 404, relayed as it said it
        with pytest.raises(openai.NotFoundError, match=r"404 Not Found \(its model does not serve"):
            await client.embeddings.create(model=MODEL_NAME, input="hello")

        made = await client.responses.create(model=MODEL_NAME, input="hello", max_output_tokens=4)
        assert made.id.startswith("resp_") and made.usage and made.usage.output_tokens <= 4
        # the agent sends it to the node that made it; vLLM keeps responses only with
        # VLLM_ENABLE_RESPONSES_API_STORE=1, so it is vLLM's own "not found" that comes back
        with pytest.raises(openai.NotFoundError, match=f"Response with id '{made.id}' not found"):
            await client.responses.retrieve(made.id)
        kinds = []
        stream = await client.responses.create(
            model=MODEL_NAME, input="hello", max_output_tokens=3, stream=True
        )
        async for event in stream:
            kinds.append(event.type)
        assert kinds[0] == "response.created"
        assert kinds[-1] in ("response.completed", "response.incomplete")

        offered = await client.chat.completions.create(
            model=MODEL_NAME,
            messages=MESSAGES,  # type: ignore[arg-type]
            tools=[WEATHER],  # type: ignore[list-item]
            tool_choice="none",
            max_tokens=3,
        )
        assert offered.choices[0].message.tool_calls in (None, [])
        # a named function needs vLLM's --tool-call-parser: vLLM read the field and says so
        with pytest.raises(openai.BadRequestError, match="requires --tool-call-parser"):
            await client.chat.completions.create(
                model=MODEL_NAME,
                messages=MESSAGES,  # type: ignore[arg-type]
                tools=[WEATHER],  # type: ignore[list-item]
                tool_choice={"type": "function", "function": {"name": "get_weather"}},
                max_tokens=3,
            )
        many = await client.chat.completions.create(
            model=MODEL_NAME,
            messages=MESSAGES,  # type: ignore[arg-type]
            n=2,
            logprobs=True,
            top_logprobs=2,
            max_tokens=3,
            seed=7,
            extra_body={"ignore_eos": True},
        )
        assert [c.index for c in many.choices] == [0, 1]
        for c in many.choices:
            assert c.logprobs and c.logprobs.content and len(c.logprobs.content) == 3
            assert all(len(t.top_logprobs) == 2 for t in c.logprobs.content)
        shaped = await client.chat.completions.create(
            model=MODEL_NAME,
            messages=MESSAGES,  # type: ignore[arg-type]
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "w", "schema": WEATHER["function"]["parameters"]},
            },
            max_tokens=8,
        )
        assert (shaped.choices[0].message.content or "").lstrip().startswith("{")

        raw = await client.chat.completions.with_raw_response.create(
            model=MODEL_NAME,
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=2,
            extra_headers={"X-Request-ID": "vllm-surface-1"},
        )
        assert raw.headers["x-request-id"] == "vllm-surface-1"  # vLLM does not echo it

    async with aiohttp.ClientSession() as s:
        body = {"model": MODEL_NAME, "max_tokens": 3, "messages": MESSAGES}
        async with s.post(f"{handle.url}/v1/messages", json=body) as r:  # Anthropic's API
            assert r.status == 200, await r.text()
            assert (await r.json())["type"] == "message"
        async with s.post(f"{handle.url}/detokenize", json={"tokens": [1, 2, 3]}) as r:
            assert r.status == 200, await r.text()  # no model named: the one the nodes serve
            assert isinstance((await r.json())["prompt"], str)
            assert r.headers["X-Request-ID"]
