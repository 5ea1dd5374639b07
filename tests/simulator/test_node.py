"""The simulated node over HTTP, through the official ``openai`` client and plain aiohttp."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from tests.simulator.conftest import NodeFactory

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm"
LONG_PROMPT = " ".join(f"word{i % 50} alpha beta gamma" for i in range(80))  # 400 tokens

# The names a router reads, checked one by one against real vLLM 0.32's page.
ROUTING_METRICS = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:num_preemptions",
    "vllm:prompt_tokens",
    "vllm:generation_tokens",
    "vllm:request_success",
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:request_inference_time_seconds",
    "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds",
    "vllm:iteration_tokens_total",
    "vllm:request_num_preemptions",
    "vllm:cache_config_info",
)


def _client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


async def _scrape(url: str) -> dict[str, list[Sample]]:
    async with aiohttp.ClientSession() as s, s.get(f"{url}/metrics") as r:
        assert r.status == 200
        text = await r.text()
    return {f.name: list(f.samples) for f in text_string_to_metric_families(text)}


def _value(metrics: dict[str, list[Sample]], family: str, **labels: str) -> float:
    total = 0.0
    for sample in metrics[family]:
        if sample.name.endswith("_created"):
            continue
        if all(sample.labels.get(k) == v for k, v in labels.items()):
            total += sample.value
    return total


async def test_chat_and_completions_through_the_openai_client(sim_node: NodeFactory) -> None:
    url = await sim_node(profile_name="h100-llama3-8b", time_scale=20)
    async with _client(url) as client:
        models = await client.models.list()
        assert [m.id for m in models.data] == ["meta-llama/Meta-Llama-3-8B-Instruct"]
        model = models.data[0].id

        chat = await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Say hi"}],
            max_tokens=7,
            extra_body={"ignore_eos": True},
        )
        assert chat.choices[0].message.role == "assistant"
        assert chat.choices[0].finish_reason == "length"
        assert chat.usage is not None and chat.usage.completion_tokens == 7
        assert chat.choices[0].message.content

        completion = await client.completions.create(model=model, prompt="Once upon", max_tokens=4)
        assert completion.usage is not None and completion.usage.prompt_tokens == 2
        assert 1 <= completion.usage.completion_tokens <= 4

        stream = await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Stream please"}],
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        pieces: list[str] = []
        finish = None
        usage = None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                pieces.append(choice.delta.content or "")
                finish = choice.finish_reason or finish
        assert finish == "length"
        assert usage is not None and usage.completion_tokens == 6
        assert len([p for p in pieces if p]) == 6

        text_stream = await client.completions.create(
            model=model, prompt="Count", max_tokens=3, stream=True, extra_body={"min_tokens": 3}
        )
        texts = [c.choices[0].text async for c in text_stream if c.choices]
        assert len(texts) == 3


async def test_same_long_prompt_twice_hits_whole_blocks(sim_node: NodeFactory) -> None:
    url = await sim_node(profile_name="cpu-tiny")
    async with _client(url) as client:
        first = await client.completions.create(
            model="tiny-model", prompt=LONG_PROMPT, max_tokens=2
        )
        assert first.usage is not None
        prompt_tokens = first.usage.prompt_tokens
        assert prompt_tokens == 400  # three full 128-token blocks and a partial one
        before = await _scrape(url)
        second = await client.completions.create(
            model="tiny-model", prompt=LONG_PROMPT, max_tokens=2
        )
        after = await _scrape(url)
    gained = _value(after, "vllm:prefix_cache_hits") - _value(before, "vllm:prefix_cache_hits")
    assert gained > 0
    assert gained % 128 == 0  # whole CPU blocks
    assert gained == (prompt_tokens - 1) // 128 * 128
    assert second.usage is not None
    assert second.usage.prompt_tokens_details is not None
    assert second.usage.prompt_tokens_details.cached_tokens == gained
    queries = _value(after, "vllm:prefix_cache_queries") - _value(
        before, "vllm:prefix_cache_queries"
    )
    assert queries == prompt_tokens


async def test_metrics_match_vllm_names_types_labels_and_buckets(sim_node: NodeFactory) -> None:
    url = await sim_node(profile_name="cpu-tiny")
    async with _client(url) as client:
        await client.completions.create(model="tiny-model", prompt="warm up", max_tokens=3)
    ours = {f.name: f for f in text_string_to_metric_families(await _text(url))}
    real_text = (FIXTURES / "vllm-0.32.0-cpu-metrics-after-load.txt").read_text()
    real = {f.name: f for f in text_string_to_metric_families(real_text)}
    for name in ROUTING_METRICS:
        assert name in real, f"{name} is not in the real vLLM scrape: fix the test list"
        assert name in ours, f"simulator does not export {name}"
        assert ours[name].type == real[name].type, name
        ours_labels = {k for s in ours[name].samples for k in s.labels if k != "le"}
        real_labels = {k for s in real[name].samples for k in s.labels if k != "le"}
        if name == "vllm:cache_config_info":
            assert {"block_size", "num_gpu_blocks", "enable_prefix_caching"} <= ours_labels
            continue
        assert ours_labels == real_labels, name
        if real[name].type == "histogram" and name != "vllm:iteration_tokens_total":
            real_le = [s.labels["le"] for s in real[name].samples if s.name.endswith("_bucket")]
            ours_le = [s.labels["le"] for s in ours[name].samples if s.name.endswith("_bucket")]
            if "tokens" not in name:
                assert ours_le == real_le, name
    info = ours["vllm:cache_config_info"].samples[0].labels
    assert info["block_size"] == "128"
    assert info["num_gpu_blocks"] == "16"
    usage = [s.value for s in ours["vllm:kv_cache_usage_perc"].samples]
    assert all(0.0 <= v <= 1.0 for v in usage)


async def _text(url: str) -> str:
    async with aiohttp.ClientSession() as s, s.get(f"{url}/metrics") as r:
        return await r.text()


async def test_legacy_metric_names_are_a_switch(sim_node: NodeFactory) -> None:
    plain = await _scrape(await sim_node(profile_name="cpu-tiny"))
    legacy = await _scrape(await sim_node(profile_name="cpu-tiny", legacy_metrics=True))
    for name in (
        "vllm:gpu_cache_usage_perc",
        "vllm:gpu_prefix_cache_queries",
        "vllm:gpu_prefix_cache_hits",
    ):
        assert name not in plain
        assert name in legacy
    assert "vllm:kv_cache_usage_perc" in legacy


@pytest.mark.parametrize(
    ("path", "body", "status", "needle"),
    [
        ("/v1/completions", b"{not json", 400, "not valid JSON"),
        ("/v1/completions", b"[1, 2]", 400, "JSON object"),
        ("/v1/completions", b'{"prompt": "hi", "max_tokens": -3}', 400, "max_tokens"),
        ("/v1/completions", b'{"prompt": "hi", "max_tokens": "ten"}', 400, "max_tokens"),
        ("/v1/completions", b'{"prompt": ""}', 400, "prompt"),
        ("/v1/completions", b'{"prompt": "hi", "n": 0}', 400, "at least 1"),
        ("/v1/completions", b'{"model": "gpt-5", "prompt": "hi"}', 404, "does not exist"),
        ("/v1/completions", b'{"prompt": "hi", "max_tokens": 600}', 400, "maximum context length"),
        ("/v1/completions", b'{"prompt": "hi", "stream": "yes"}', 400, "stream"),
        (
            "/v1/completions",
            b'{"prompt": "hi", "max_tokens": 2, "min_tokens": 5}',
            400,
            "min_tokens",
        ),
        ("/v1/chat/completions", b'{"messages": []}', 400, "non-empty"),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "wizard", "content": "x"}]}',
            400,
            "role",
        ),
        ("/v1/chat/completions", b'{"messages": "hello"}', 400, "messages"),
        ("/admin/faults", b'{"error_status": 418}', 400, "error_status"),
        ("/admin/faults", b'{"explode": true}', 400, "unknown fault"),
    ],
)
async def test_bad_requests_get_a_clear_openai_error(
    sim_node: NodeFactory, path: str, body: bytes, status: int, needle: str
) -> None:
    url = await sim_node(profile_name="cpu-tiny")
    async with aiohttp.ClientSession() as s:
        async with s.post(
            f"{url}{path}", data=body, headers={"Content-Type": "application/json"}
        ) as r:
            assert r.status == status
            payload = await r.json()
        assert needle in payload["error"]["message"]
        assert payload["error"]["code"] == status
        assert payload["error"]["type"] in ("BadRequestError", "NotFoundError")
        # the node keeps serving everyone else
        async with s.post(
            f"{url}/v1/completions", json={"prompt": "still here", "max_tokens": 2}
        ) as r:
            assert r.status == 200


async def test_too_long_prompt_through_the_openai_client(sim_node: NodeFactory) -> None:
    url = await sim_node(profile_name="cpu-tiny")
    async with _client(url) as client:
        with pytest.raises(openai.BadRequestError, match="maximum context length"):
            await client.completions.create(model="tiny-model", prompt="word " * 600, max_tokens=4)


async def test_tokenize_and_health(sim_node: NodeFactory) -> None:
    url = await sim_node(profile_name="cpu-tiny")
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{url}/health") as r:
            assert r.status == 200
        async with s.post(f"{url}/tokenize", json={"prompt": "Once upon"}) as r:
            body = await r.json()
            assert body["count"] == 2 and len(body["tokens"]) == 2
            assert body["max_model_len"] == 512
        async with s.post(
            f"{url}/tokenize", json={"messages": [{"role": "user", "content": "Say hi"}]}
        ) as r:
            chat_count = (await r.json())["count"]
        # /tokenize counts exactly what a chat request is charged
        async with s.post(
            f"{url}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 1},
        ) as r:
            assert (await r.json())["usage"]["prompt_tokens"] == chat_count


async def test_injected_errors_health_and_latency(sim_node: NodeFactory) -> None:
    url = await sim_node(profile_name="cpu-tiny", time_scale=20)
    async with aiohttp.ClientSession() as s:
        async with s.post(
            f"{url}/admin/faults", json={"error_rate": 1.0, "error_status": 429}
        ) as r:
            assert (await r.json())["error_rate"] == 1.0
        async with s.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2}) as r:
            assert r.status == 429
            assert (await r.json())["error"]["type"] == "RateLimitError"
        async with s.post(
            f"{url}/admin/faults", json={"error_rate": 0.0, "fail_health": True}
        ) as r:
            assert r.status == 200
        async with s.get(f"{url}/health") as r:
            assert r.status == 503
        async with s.delete(f"{url}/admin/faults") as r:
            assert (await r.json())["fail_health"] is False
        async with s.get(f"{url}/health") as r:
            assert r.status == 200

        async def mean_itl(body: dict[str, object]) -> float:
            before = await _scrape(url)
            async with s.post(f"{url}/v1/completions", json=body) as r:
                assert r.status == 200
                await r.read()
            after = await _scrape(url)
            family = "vllm:inter_token_latency_seconds"
            total = _sum(after, family) - _sum(before, family)
            count = _count(after, family) - _count(before, family)
            return total / count

        request = {"prompt": "x", "max_tokens": 20, "ignore_eos": True}
        normal = await mean_itl(request)
        await s.post(f"{url}/admin/faults", json={"latency_multiplier": 8.0})
        slow = await mean_itl(request)
        assert slow == pytest.approx(8 * normal, rel=0.01)


def _sum(metrics: dict[str, list[Sample]], family: str) -> float:
    return sum(s.value for s in metrics[family] if s.name == f"{family}_sum")


def _count(metrics: dict[str, list[Sample]], family: str) -> float:
    return sum(s.value for s in metrics[family] if s.name == f"{family}_count")


async def test_error_rate_is_deterministic_under_a_seed(sim_node: NodeFactory) -> None:
    async def pattern(url: str) -> list[int]:
        async with aiohttp.ClientSession() as s:
            await s.post(f"{url}/admin/faults", json={"error_rate": 0.5, "error_status": 500})
            out = []
            for _ in range(12):
                async with s.post(
                    f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 1}
                ) as r:
                    out.append(r.status)
            return out

    a = await pattern(await sim_node(profile_name="cpu-tiny", seed=7))
    b = await pattern(await sim_node(profile_name="cpu-tiny", seed=7))
    assert a == b
    assert set(a) == {200, 500}


async def test_hang_stalls_requests_until_cleared(sim_node: NodeFactory) -> None:
    url = await sim_node(profile_name="cpu-tiny", time_scale=20)
    async with aiohttp.ClientSession() as s:
        await s.post(f"{url}/admin/faults", json={"hang": True})
        pending = asyncio.ensure_future(
            s.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2})
        )
        done, _ = await asyncio.wait({pending}, timeout=0.5)
        assert not done
        metrics = await _scrape(url)
        assert _value(metrics, "vllm:num_requests_waiting") == 1
        await s.delete(f"{url}/admin/faults")
        response = await asyncio.wait_for(pending, timeout=5)
        assert response.status == 200
        response.release()


async def test_drop_mid_stream_cuts_the_connection_and_aborts(sim_node: NodeFactory) -> None:
    url = await sim_node(profile_name="cpu-tiny", time_scale=20)
    async with aiohttp.ClientSession() as s:
        await s.post(f"{url}/admin/faults", json={"drop_after_tokens": 3})
        lines: list[bytes] = []
        with pytest.raises(aiohttp.ClientPayloadError):
            async with s.post(
                f"{url}/v1/completions",
                json={"prompt": "x", "max_tokens": 50, "ignore_eos": True, "stream": True},
            ) as r:
                async for line in r.content:
                    if line.strip():
                        lines.append(line)
        assert len(lines) == 3
        assert not any(b"[DONE]" in line for line in lines)
        with pytest.raises(aiohttp.ClientError):
            async with s.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 50}) as r:
                await r.read()
        await s.delete(f"{url}/admin/faults")
        metrics = await _scrape(url)
    assert _value(metrics, "vllm:request_success", finished_reason="abort") == 2
    assert _value(metrics, "vllm:kv_cache_usage_perc") == 0.0


async def test_client_disconnect_aborts_the_request_in_the_engine(sim_node: NodeFactory) -> None:
    url = await sim_node(profile_name="cpu-tiny", time_scale=1)
    body = {"prompt": LONG_PROMPT, "max_tokens": 100, "ignore_eos": True}  # about 0.5 s
    async with aiohttp.ClientSession() as s:
        # a non-streaming request whose client gives up
        with pytest.raises(TimeoutError):
            async with s.post(
                f"{url}/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=0.2)
            ) as r:
                await r.read()
        # a stream read for a while and then closed
        async with s.post(f"{url}/v1/completions", json={**body, "stream": True}) as r:
            await r.content.readline()
        for _ in range(50):
            metrics = await _scrape(url)
            if _value(metrics, "vllm:request_success", finished_reason="abort") == 2:
                break
            await asyncio.sleep(0.05)
    assert _value(metrics, "vllm:request_success", finished_reason="abort") == 2
    assert _value(metrics, "vllm:num_requests_running") == 0
    assert _value(metrics, "vllm:kv_cache_usage_perc") == 0.0
