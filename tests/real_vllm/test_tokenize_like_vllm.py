"""The agent's token ids, with the model's own tokenizer, are vLLM's: for chat requests (the
model's chat template, and templates sent with the request) and completion prompts, what
``regional_agent.prompts`` makes of a request equals what vLLM 0.32's ``/tokenize`` returns for
the same request, and the agent routes by exactly those tokens (its parsed request's token count
and block hashes).  The session's nodes trust request templates
(``--trust-request-chat-template``, tests/real_vllm/conftest.py) for the other templates.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from policies import prompt
from regional_agent import prompts
from regional_agent.prompts import ChatOptions
from regional_agent.proxy import handlers
from regional_agent.settings import Settings
from tests.support.agent import AgentFactory
from tests.support.agent import openai_client as _client
from tests.support.vllm import MODEL_NAME, VllmInstall, VllmServer

pytestmark = [pytest.mark.real_vllm, pytest.mark.timeout(900)]

TEMPLATES = Path(__file__).resolve().parents[1] / "fixtures" / "tiny-llama" / "templates"
SYSTEM = "You are Meridian's test assistant. Réponds brièvement; 日本語も可. ✓"

CHATS: list[dict[str, Any]] = [
    {"messages": [{"role": "user", "content": "hello there"}]},
    {
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "What is 12345 + 678?\n\nShow  your   work."},
            {"role": "assistant", "content": "13023. Ünïcödé: naïve café, Ελληνικά, 😀."},
            {"role": "user", "content": "\tAnd the <|im_end|> token, typed out?"},
        ]
    },
    {  # text parts: joined with newlines for this template (vLLM's "string" format)
        "messages": [
            {"role": "system", "content": [{"type": "text", "text": SYSTEM}]},
            {
                "role": "user",
                "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "二"}],
            },
        ]
    },
    {  # a developer message, which this template does not name: merged into the system one
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "hi"},
            {"role": "developer", "content": "Answer in French."},
            {"role": "user", "content": "again"},
        ]
    },
    {
        "messages": [
            {"role": "user", "content": "Say hi"},
            {"role": "assistant", "content": "Hi, I am "},
        ],
        "continue_final_message": True,
        "add_generation_prompt": False,
    },
    {
        "messages": [{"role": "user", "content": "no generation prompt"}],
        "add_generation_prompt": False,
    },
    {"messages": [{"role": "user", "content": "with a BOS added"}], "add_special_tokens": True},
    {  # a template of the Llama kind: BOS, system message sliced off, trim, alternation
        "template": "alternating.jinja",
        "messages": [
            {"role": "system", "content": "  " + SYSTEM + "  "},
            {"role": "user", "content": "Hi <b>&</b>\n"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "日本語?"},
        ],
    },
    {  # a template over content parts (vLLM's "openai" format), tools, tool calls, kwargs
        "template": "content-parts.jinja",
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two <&>"}],
            },
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "get", "arguments": '{"city": "Zürich <x>"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "22 °C"}]},
            {"role": "user", "content": "and tomorrow?"},
        ],
        "tools": [
            {"type": "function", "function": {"name": "get", "parameters": {"type": "object"}}}
        ],
        "chat_template_kwargs": {"enable_thinking": True},
    },
]

COMPLETIONS = [
    "Once upon a time",
    "Ünïcödé ✓ 日本語 and 12345 digits\n\n  spaces\tand tabs",
    "<|im_start|>user\nspecial tokens typed in a prompt<|im_end|>\n",
]


async def _tokenize(url: str, body: dict[str, Any]) -> list[int]:
    async with (
        aiohttp.ClientSession() as s,
        s.post(f"{url}/tokenize", json={"model": MODEL_NAME, **body}) as r,
    ):
        answer = await r.json()
        assert r.status == 200, answer
    tokens: list[int] = answer["tokens"]
    assert answer["count"] == len(tokens)
    return tokens


def _settings(install: VllmInstall, template: str | None = None) -> Settings:
    files: dict[str, Any] = {"model_dir": install.model_dir}
    if template is not None:
        files["chat_template_file"] = TEMPLATES / template
    return Settings(tokenizer=files, routing={"prefix_max_tokens": 8192})


def _parsed(
    settings: Settings, loaded: prompts.Prompts, body: dict[str, Any], *, chat: bool
) -> Any:
    raw = json.dumps({"model": MODEL_NAME, **body}).encode()
    return handlers._parse_body(
        raw, {}, settings, kind="chat" if chat else "completion", prompts=loaded
    ).view


@pytest.mark.parametrize("case", range(len(CHATS)))
async def test_a_chat_requests_token_ids_are_vllms(
    vllm_nodes: list[VllmServer], vllm_install: VllmInstall, case: int
) -> None:
    spec = dict(CHATS[case])
    template = spec.pop("template", None)
    settings = _settings(vllm_install, template)
    loaded = prompts.load(settings.tokenizer)
    own = loaded.for_model(MODEL_NAME)
    assert own is not None
    request = dict(spec)
    if template is not None:
        request["chat_template"] = (TEMPLATES / template).read_text()
    want = await _tokenize(vllm_nodes[0].url, request)
    ids = own.chat_token_ids(spec["messages"], ChatOptions.from_body(spec))
    assert ids == want, (own.render_chat(spec["messages"], ChatOptions.from_body(spec)), ids, want)
    view = _parsed(settings, loaded, spec, chat=True)  # the agent's own parse, prefix cache and all
    assert view.prompt_tokens == len(want)
    assert view.block_hashes == prompt.block_hashes(want, block_size=16)
    again = _parsed(settings, loaded, spec, chat=True)  # now from the prefix cache
    assert again.block_hashes == view.block_hashes and again.prompt_tokens == len(want)


@pytest.mark.parametrize("text", COMPLETIONS)
async def test_a_completion_prompts_token_ids_are_vllms(
    vllm_nodes: list[VllmServer], vllm_install: VllmInstall, text: str
) -> None:
    settings = _settings(vllm_install)
    loaded = prompts.load(settings.tokenizer)
    own = loaded.for_model(MODEL_NAME)
    assert own is not None
    for special in (True, False):
        want = await _tokenize(vllm_nodes[0].url, {"prompt": text, "add_special_tokens": special})
        assert own.completion_token_ids(text, add_special_tokens=special) == want
        view = _parsed(
            settings, loaded, {"prompt": text, "add_special_tokens": special}, chat=False
        )
        assert view.prompt_tokens == len(want)
        assert view.block_hashes == prompt.block_hashes(want, block_size=16)


async def test_an_agent_with_the_models_tokenizer_counts_the_prompt_as_vllm_does(
    vllm_nodes: list[VllmServer], vllm_install: VllmInstall, start_agent: AgentFactory
) -> None:
    """Through a running agent: a chat request served by vLLM, whose prompt_tokens in the
    usage are the agent's own count of the request's tokens."""
    urls = [n.url for n in vllm_nodes]
    handle = await start_agent(
        urls, policy="prefix_aware", tokenizer={"model_dir": str(vllm_install.model_dir)}
    )
    messages = CHATS[1]["messages"]
    async with _client(handle.url) as client:
        reply = await client.chat.completions.create(
            model=MODEL_NAME, messages=messages, max_tokens=2, extra_body={"ignore_eos": True}
        )
    assert reply.usage is not None
    view = _parsed(handle.edge.settings, handle.edge.prompts, {"messages": messages}, chat=True)
    assert view.prompt_tokens == reply.usage.prompt_tokens
    assert view.prompt_tokens != prompt.count_tokens(
        prompt.render_chat(messages)
    )  # not the stand-in
