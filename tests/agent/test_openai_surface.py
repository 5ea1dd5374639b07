"""The whole OpenAI surface of a vLLM node, through the agent (issue 22), driven by the official
``openai`` client against simulated nodes: model cards, embeddings, the Responses API streamed
and not (and a stored response fetched back from the node that made it), chat with ``n``,
``logprobs``, ``tools``/``tool_choice``, ``response_format`` and ``seed`` passed through
untouched, tokenize/detokenize, a multipart form, and the request id on every answer and log
line."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import re
import struct
from pathlib import Path

import aiohttp
import openai
import pytest

from meridian_sim.node import EMBEDDING_DIMENSIONS
from regional_agent.proxy import endpoints
from tests.conftest import NodeFactory
from tests.support.agent import ADMIN, AgentFactory, AgentHandle, admin_nodes, metric
from tests.support.agent import openai_client as _client

MODEL = "tiny-model"
FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "vllm" / "openapi-paths-0.32.json"
GENERATED_ID = re.compile(r"^[0-9a-f]{32}$")
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


async def _agent(sim_node: NodeFactory, start_agent: AgentFactory, n: int = 2) -> AgentHandle:
    urls = [await sim_node(profile_name="cpu-tiny", seed=i) for i in range(n)]
    return await start_agent(urls)


def test_every_path_vllm_serves_is_proxied_or_a_nodes_own() -> None:
    paths = json.loads(FIXTURE.read_text())["paths"]
    proxied = {e.path for e in endpoints.PROXIED}
    own = {entry.split(" ", 1)[1].replace("{model}", "{id}") for entry in endpoints.OWN}
    own = {p.replace("{id}", "{response_id}") if "responses" in p else p for p in own}
    missing = [
        p for p in paths if p not in proxied and p not in endpoints.NODE_ONLY and p not in own
    ]
    assert missing == []
    assert "POST" in paths["/v1/responses"] and "GET" in paths["/v1/responses/{response_id}"]


async def test_every_proxied_path_is_routed_to_a_node(
    sim_node: NodeFactory, start_agent: AgentFactory
) -> None:
    """Each path reaches a node (its answer, whatever it is, is relayed), never the agent's
    'no such path'; a path the nodes lack is the node's 404, not a 5xx."""
    handle = await _agent(sim_node, start_agent, n=1)
    async with aiohttp.ClientSession() as s:
        for e in endpoints.PROXIED:
            if e.kind == "form":
                continue  # a multipart body: test_a_form_is_routed_by_its_model_field
            async with s.post(f"{handle.url}{e.path}", json={"model": MODEL}) as r:
                body = await r.text()
                assert r.status < 500, (e.path, r.status, body)
                assert "no such path" not in body, e.path
                assert GENERATED_ID.match(r.headers["X-Request-ID"]), e.path


async def test_models_retrieve_gives_the_nodes_card_and_a_404_names_the_models(
    sim_node: NodeFactory, start_agent: AgentFactory
) -> None:
    handle = await _agent(sim_node, start_agent)
    async with _client(handle.url) as client:
        card = await client.models.retrieve(MODEL)
        assert card.id == MODEL and card.owned_by == "vllm"
        assert card.model_extra and card.model_extra["max_model_len"] == 512  # cpu-tiny's
        listed = await client.models.list()
        assert [m.id for m in listed.data] == [MODEL]
        with pytest.raises(openai.NotFoundError, match="the models served are: tiny-model"):
            await client.models.retrieve("gpt-5")
    slashed = await start_agent([await sim_node(model="meta-llama/Meta-Llama-3-8B-Instruct")])
    async with _client(slashed.url) as client:  # a Hugging Face id: the path has a slash
        card = await client.models.retrieve("meta-llama/Meta-Llama-3-8B-Instruct")
        assert card.id == "meta-llama/Meta-Llama-3-8B-Instruct"


async def test_embeddings_through_the_agent(
    sim_node: NodeFactory, start_agent: AgentFactory
) -> None:
    handle = await _agent(sim_node, start_agent)
    async with _client(handle.url) as client:
        got = await client.embeddings.create(model=MODEL, input=["the cat sat", "a dog"])
        assert [len(d.embedding) for d in got.data] == [EMBEDDING_DIMENSIONS] * 2
        assert got.usage.prompt_tokens > 0
        again = await client.embeddings.create(model=MODEL, input="the cat sat")
        assert again.data[0].embedding == pytest.approx(got.data[0].embedding)  # any node
        packed = await client.embeddings.create(
            model=MODEL, input="the cat sat", encoding_format="base64"
        )
        raw = base64.b64decode(str(packed.data[0].embedding))
        floats = struct.unpack(f"<{EMBEDDING_DIMENSIONS}f", raw)
        assert floats == pytest.approx(got.data[0].embedding, abs=1e-6)
        # a chat's body sent to embeddings: the node's 400 names the field, relayed as is
        with pytest.raises(openai.BadRequestError, match="'input' must be"):
            await client.embeddings.create(model=MODEL, input=[])


async def test_responses_streamed_and_not_and_fetched_back_from_the_node_that_made_them(
    sim_node: NodeFactory, start_agent: AgentFactory
) -> None:
    handle = await _agent(sim_node, start_agent, n=3)
    async with _client(handle.url) as client:
        made = await client.responses.create(
            model=MODEL, instructions="Be brief.", input="Say hello.", max_output_tokens=5
        )
        assert made.output_text and made.status == "incomplete"
        assert made.usage is not None and made.usage.output_tokens == 5
        kinds = []
        final = None
        stream = await client.responses.create(
            model=MODEL,
            input=[{"role": "user", "content": "Stream it."}],
            max_output_tokens=4,
            stream=True,
        )
        async for event in stream:
            kinds.append(event.type)
            if event.type in ("response.completed", "response.incomplete"):
                final = event.response
        assert kinds[:2] == ["response.created", "response.in_progress"]
        assert kinds.count("response.output_text.delta") == 4
        assert final is not None and final.output_text
        # the stored responses are on the nodes that made them: the agent knows which
        for response_id in (made.id, final.id):
            fetched = await client.responses.retrieve(response_id)
            assert fetched.id == response_id
        with pytest.raises(openai.NotFoundError, match="is known to this agent"):
            await client.responses.retrieve("resp_unknown")
        with pytest.raises(openai.BadRequestError, match="'input' is required"):
            await client.responses.create(model=MODEL)  # type: ignore[call-overload]


async def test_chat_fields_the_agent_does_not_read_reach_the_node_untouched(
    sim_node: NodeFactory, start_agent: AgentFactory
) -> None:
    handle = await _agent(sim_node, start_agent)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    async with _client(handle.url) as client:
        called = await client.chat.completions.create(
            model=MODEL,
            messages=messages,  # type: ignore[arg-type]
            tools=[WEATHER],  # type: ignore[list-item]
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            max_tokens=8,
            seed=7,
        )
        choice = called.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.tool_calls and choice.message.tool_calls[0].function.name == (
            "get_weather"
        )
        many = await client.chat.completions.create(
            model=MODEL,
            messages=messages,  # type: ignore[arg-type]
            n=3,
            logprobs=True,
            top_logprobs=2,
            max_tokens=4,
            extra_body={"ignore_eos": True},
        )
        assert [c.index for c in many.choices] == [0, 1, 2]
        for c in many.choices:
            assert c.logprobs and c.logprobs.content and len(c.logprobs.content) == 4
            assert all(len(t.top_logprobs) == 2 for t in c.logprobs.content)
        assert many.usage is not None and many.usage.completion_tokens == 12
        schema = {"type": "object", "properties": {"city": {"type": "string"}},
                  "required": ["city"]}  # fmt: skip
        shaped = await client.chat.completions.create(
            model=MODEL,
            messages=messages,  # type: ignore[arg-type]
            response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": schema}},
            max_tokens=8,
        )
        assert json.loads(shaped.choices[0].message.content or "") == {"city": ""}
        streamed = await client.chat.completions.create(
            model=MODEL,
            messages=messages,  # type: ignore[arg-type]
            n=2,
            max_tokens=3,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        per_choice = {0: 0, 1: 0}
        async for chunk in streamed:
            for c in chunk.choices:
                per_choice[c.index] += bool(c.delta.content)
        assert per_choice == {0: 3, 1: 3}
        with pytest.raises(openai.BadRequestError, match="enable-auto-tool-choice"):
            await client.chat.completions.create(
                model=MODEL,
                messages=messages,  # type: ignore[arg-type]
                tools=[WEATHER],  # type: ignore[list-item]
                tool_choice="auto",
            )


async def test_tokenize_and_detokenize_without_a_model_when_the_nodes_serve_one(
    sim_node: NodeFactory, start_agent: AgentFactory
) -> None:
    handle = await _agent(sim_node, start_agent, n=1)  # its pieces are known where tokenised
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{handle.url}/tokenize", json={"prompt": "hello brave new world"}) as r:
            assert r.status == 200, await r.text()
            tokens = (await r.json())["tokens"]
        async with s.post(f"{handle.url}/detokenize", json={"tokens": tokens}) as r:
            assert r.status == 200, await r.text()
            assert (await r.json())["prompt"] == "hello brave new world"


async def test_a_form_is_routed_by_its_model_field(
    sim_node: NodeFactory, start_agent: AgentFactory
) -> None:
    """An audio transcription (multipart): routed by its form's model; the simulated node has
    no speech-to-text, and its 404 is relayed, not turned into a 5xx."""
    handle = await _agent(sim_node, start_agent)
    form = aiohttp.FormData()
    form.add_field("model", MODEL)
    form.add_field("file", b"RIFF....WAVE", filename="a.wav", content_type="audio/wav")
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{handle.url}/v1/audio/transcriptions", data=form) as r:
            assert r.status == 404, await r.text()
            assert "Not Found" in await r.text()
        other = aiohttp.FormData()
        other.add_field("model", "whisper")
        other.add_field("file", b"RIFF", filename="a.wav", content_type="audio/wav")
        async with s.post(f"{handle.url}/v1/audio/transcriptions", data=other) as r:
            assert r.status == 404
            assert "whisper" in (await r.json())["error"]["message"]  # the agent's: no node
        async with s.post(f"{handle.url}/v1/audio/transcriptions", json={"model": MODEL}) as r:
            assert r.status == 400
            assert "multipart/form-data" in (await r.json())["error"]["message"]


async def test_the_request_id_is_on_every_answer_and_every_log_line(
    sim_node: NodeFactory, start_agent: AgentFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="regional_agent")
    handle = await _agent(sim_node, start_agent)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{handle.url}/v1/chat/completions", json=body) as r:
            assert r.status == 200 and GENERATED_ID.match(r.headers["X-Request-ID"])
        mine = {"X-Request-ID": "client-id-42"}
        async with s.post(
            f"{handle.url}/v1/chat/completions", json={**body, "stream": True}, headers=mine
        ) as r:
            assert r.headers["X-Request-ID"] == "client-id-42"
            assert b"[DONE]" in await r.read()
        async with s.post(
            f"{handle.url}/v1/chat/completions", json={**body, "model": "nope"}, headers=mine
        ) as r:
            assert r.status == 404 and r.headers["X-Request-ID"] == "client-id-42"
        async with s.get(f"{handle.url}/v1/nothing-here", headers=mine) as r:
            assert r.status == 404 and r.headers["X-Request-ID"] == "client-id-42"
            message = (await r.json())["error"]["message"]
            assert "POST /v1/embeddings" in message and "GET /v1/models/{model}" in message
        async with s.get(f"{handle.url}/v1/models", headers={"X-Request-ID": "x" * 201}) as r:
            assert r.status == 400 and "X-Request-ID" in (await r.json())["error"]["message"]
    refused = [r.getMessage() for r in caplog.records if "request refused" in r.getMessage()]
    assert refused and all(m.endswith("request_id=client-id-42") for m in refused)
    async with _client(handle.url) as client:
        raw = await client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        assert GENERATED_ID.match(raw.headers["x-request-id"])


def test_a_fastapi_error_of_a_node_is_put_in_openais_shape_with_the_nodes_words() -> None:
    from regional_agent.errors import UpstreamStatus
    from regional_agent.proxy import handlers

    fastapi = b'{"detail":"Not Found"}'
    exc = UpstreamStatus("node n1 answered 404", node_id="n1", status=404, body=fastapi,
                         content_type="application/json")  # fmt: skip
    relayed = handlers._relay_error(exc)
    assert relayed.status == 404 and relayed.body is not None
    error = json.loads(bytes(relayed.body))["error"]  # type: ignore[arg-type]
    assert error["message"] == (
        "the node answered 404 Not Found (its model does not serve this endpoint)"
    )
    assert error["type"] == "NotFoundError"
    openai_shaped = UpstreamStatus("node n1 answered 400", node_id="n1", status=400,
                                   body=b'{"error":{"message":"bad"}}',
                                   content_type="application/json")  # fmt: skip
    assert handlers._relay_error(openai_shaped).body == b'{"error":{"message":"bad"}}'


async def test_a_body_for_one_endpoint_sent_to_another_names_the_field(
    sim_node: NodeFactory, start_agent: AgentFactory
) -> None:
    handle = await _agent(sim_node, start_agent, n=1)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{handle.url}/v1/embeddings", json=chat) as r:  # the node's 400
            assert r.status == 400
            assert (await r.json())["error"]["param"] == "input"
        async with s.post(f"{handle.url}/v1/responses", json=chat) as r:  # the agent's 400
            assert r.status == 400
            error = (await r.json())["error"]
            assert error["param"] == "input" and "'input' is required" in error["message"]
        embed = {"model": MODEL, "input": "hi", "max_output_tokens": "lots"}
        async with s.post(f"{handle.url}/v1/responses", json=embed) as r:
            assert r.status == 400
            assert (await r.json())["error"]["param"] == "max_output_tokens"


async def test_closing_a_streamed_response_aborts_it_on_the_node_and_usage_is_counted(
    sim_node: NodeFactory, start_agent: AgentFactory
) -> None:
    url = await sim_node(profile_name="cpu-tiny", time_scale=1.0)  # slow enough to cut
    handle = await start_agent([url])
    aborted = 'vllm:request_success_total{engine="0",finished_reason="abort"'
    async with aiohttp.ClientSession() as s:
        body = {"model": MODEL, "input": "a long answer", "max_output_tokens": 400,
                "stream": True, "ignore_eos": True}  # fmt: skip
        async with s.post(f"{handle.url}/v1/responses", json=body) as r:
            assert r.status == 200
            await r.content.readline()  # the first event is out: then the client leaves
        for _ in range(100):
            async with s.get(f"{url}/metrics") as m:
                page = await m.text()
            line = next(x for x in page.splitlines() if x.startswith(aborted))
            if float(line.split()[-1]) >= 1:
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the node did not abort the abandoned response")
        before = await metric(handle.url, "meridian_agent_generated_tokens_total")
        done = {"model": MODEL, "input": "short", "max_output_tokens": 3, "stream": True,
                "ignore_eos": True}  # fmt: skip
        async with s.post(f"{handle.url}/v1/responses", json=done) as r:
            assert b"response.incomplete" in await r.read()
    after = await metric(handle.url, "meridian_agent_generated_tokens_total")
    assert after - before == 3  # from response.incomplete's usage, nested in its response


async def test_embeddings_and_responses_are_retried_on_another_node_before_the_first_byte(
    sim_node: NodeFactory, start_agent: AgentFactory
) -> None:
    """One of two nodes answers every request 503: what lands on it is retried on the other,
    for embeddings and for a streamed response as for chat."""
    bad, good = [await sim_node(profile_name="cpu-tiny", seed=i) for i in range(2)]
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{bad}/admin/faults", json={"error_rate": 1.0}) as r:
            assert r.status == 200
        handle = await start_agent([bad, good], policy="round_robin", retry={"budget_ratio": 1.0})
        for _ in range(4):
            body = {"model": MODEL, "input": "hello"}
            async with s.post(f"{handle.url}/v1/embeddings", json=body) as r:
                assert r.status == 200, await r.text()
            streamed = {**body, "max_output_tokens": 2, "stream": True}
            async with s.post(f"{handle.url}/v1/responses", json=streamed) as r:
                assert r.status == 200 and b"response.created" in await r.read()
    assert await metric(handle.url, "meridian_agent_retries_total") >= 2  # (then it is ejected)


LONG_INSTRUCTIONS = " ".join(f"rule{i % 40} keep answers short and exact" for i in range(60))


async def test_responses_and_messages_sharing_a_long_system_prompt_land_on_one_node(
    sim_node: NodeFactory, start_agent: AgentFactory
) -> None:
    """Prefix-aware where there is a prompt to share: the Responses API's ``instructions`` and
    Anthropic's ``system`` are hashed as a chat's system message, so repeats go where the prefix
    is cached (the node's own prefix-cache hits prove it); embeddings, with none, spread by load."""
    urls = [await sim_node(profile_name="cpu-tiny", seed=i) for i in range(4)]
    handle = await start_agent(urls, policy="prefix_aware")
    async with _client(handle.url) as client:
        for i in range(5):
            await client.responses.create(
                model=MODEL, instructions=LONG_INSTRUCTIONS, input=f"question {i}",
                max_output_tokens=2,
            )  # fmt: skip
    served = {u: await metric(u, "vllm:request_success_total") for u in urls}
    hits = {u: await metric(u, "vllm:prefix_cache_hits_total") for u in urls}
    (home,) = [u for u, n in served.items() if n > 0]
    assert served[home] == 5 and hits[home] > 0
    async with aiohttp.ClientSession() as s:
        for i in range(5):
            body = {"model": MODEL, "system": LONG_INSTRUCTIONS, "max_tokens": 2,
                    "messages": [{"role": "user", "content": f"question {i}"}]}  # fmt: skip
            async with s.post(f"{handle.url}/v1/messages", json=body) as r:
                assert r.status == 404  # the simulator has no Messages API: relayed, routed
    after = {u: await metric(u, "vllm:request_success_total") for u in urls}
    assert after == served  # (404s end no engine request)
    nodes = await admin_nodes(handle.url, ADMIN)
    counted = {u: n["requests_total"] for u, n in nodes.items()}
    messages_home = [u for u in urls if counted[u] > served[u]]
    assert len(messages_home) == 1  # all five Messages requests went to one node
