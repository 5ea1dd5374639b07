"""regional_agent.prompts: a served model's own tokenizer and chat template.

The expectations come from transformers 5.19 itself (tests/fixtures/tiny-llama/expected.json,
written by make_expected.py there with the real-vLLM venv's transformers): the agent must
render and tokenise as ``apply_chat_template`` does.  vLLM's own ``/tokenize`` is compared in
tests/real_vllm/test_tokenize_like_vllm.py.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import re
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp
import pydantic
import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st

from policies import prompt
from regional_agent import prompts
from regional_agent.errors import BadRequest
from regional_agent.prompts import ChatOptions, ModelPrompts, TokenizerLoadError
from regional_agent.proxy import handlers
from regional_agent.settings import Settings, TokenizerSettings
from tests.conftest import NodeFactory
from tests.support.agent import AgentFactory, metric

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "tiny-llama"
TEMPLATES = FIXTURES / "templates"
EXPECTED: dict[str, Any] = json.loads((FIXTURES / "expected.json").read_text())


def _model(**files: Any) -> ModelPrompts:
    loaded = prompts.load(TokenizerSettings(**{"model_dir": FIXTURES, **files}))
    assert loaded.default is not None
    return loaded.default


def _template(tmp_path: Path, source: str, name: str = "t.jinja") -> Path:
    path = tmp_path / name
    path.write_text(source)
    return path


# -- what transformers makes of the same conversation --------------------------------------------


def test_the_models_own_template_and_tokenizer_give_transformers_ids() -> None:
    model = _model()
    assert model.template_origin == str(FIXTURES / "chat_template.jinja")
    assert model.fmt == "string"
    assert model.special_tokens["bos_token"] == "<|im_start|>"
    messages = [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "hello"},
    ]
    text = model.render_chat(messages)
    assert text == (
        "<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nhello<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = model.chat_token_ids(messages)
    assert ids[0] == 1 and ids.count(1) == 3 and ids.count(2) == 2  # <|im_start|>, <|im_end|>
    # the stand-in's ids are hashes modulo 32000: nothing like the model's 2,048-token vocabulary
    assert ids != list(prompt.tokenize(text)) and max(ids) < 2048


def test_a_template_with_bos_trim_slices_and_alternation_renders_as_transformers() -> None:
    case = EXPECTED["alternating"]
    model = _model(chat_template_file=TEMPLATES / "alternating.jinja")
    assert model.render_chat(case["messages"]) == case["text"]
    assert model.chat_token_ids(case["messages"]) == case["ids"]
    with pytest.raises(prompt.PromptError, match="Conversation roles must alternate"):
        model.render_chat([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_a_template_over_content_parts_gets_parts_tools_and_kwargs_as_transformers() -> None:
    """vLLM's "openai" content format: the template loops over message.content, so text parts
    stay parts; a tool call's JSON arguments string becomes an object; tools and
    chat_template_kwargs reach the template; tojson leaves <, > and & alone."""
    case = EXPECTED["content-parts"]
    model = _model(chat_template_file=TEMPLATES / "content-parts.jinja")
    assert model.fmt == "openai"
    openai_messages = [
        case["messages"][0],
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
    ]
    options = ChatOptions.from_body(
        {"tools": case["kwargs"]["tools"], "chat_template_kwargs": {"enable_thinking": True}}
    )
    assert model.render_chat(openai_messages, options) == case["text"]
    assert model.chat_token_ids(openai_messages, options) == case["ids"]
    # kwargs the template does not use are not passed (vLLM filters them the same way)
    quiet = ChatOptions.from_body({"chat_template_kwargs": {"unused": 1}})
    assert "<think>" not in model.render_chat(openai_messages, quiet)


def test_continue_final_message_cuts_after_the_last_message_as_transformers() -> None:
    case = EXPECTED["continued"]
    model = _model()
    options = ChatOptions.from_body(
        {"continue_final_message": True, "add_generation_prompt": False}
    )
    assert model.render_chat(case["messages"], options) == case["text"]
    with pytest.raises(prompt.PromptError, match="cannot set both"):
        ChatOptions.from_body({"continue_final_message": True})


def test_a_completion_prompt_gets_the_tokenizers_special_tokens(tmp_path: Path) -> None:
    """Completions are tokenised with special tokens (vLLM's default): none for this tokenizer
    (transformers agrees); with ``add_bos_token`` in tokenizer_config.json transformers rebuilds
    the post-processor, and so does the agent: a BOS first.  Chat prompts never get one added."""
    case = EXPECTED["completion"]
    assert _model().completion_token_ids(case["prompt"]) == case["ids"]
    shutil.copytree(FIXTURES, tmp_path / "m")
    config = json.loads((FIXTURES / "tokenizer_config.json").read_text())
    (tmp_path / "m" / "tokenizer_config.json").write_text(
        json.dumps({**config, "add_bos_token": True})
    )
    with_bos = _model(model_dir=tmp_path / "m")
    assert with_bos.completion_token_ids(case["prompt"]) == [1, *case["ids"]]
    assert with_bos.completion_token_ids(case["prompt"], add_special_tokens=False) == case["ids"]
    chat = [{"role": "user", "content": "hi"}]
    assert with_bos.chat_token_ids(chat) == _model().chat_token_ids(chat)
    assert with_bos.chat_token_ids(chat, ChatOptions(add_special_tokens=True))[:2] == [1, 1]


# -- vLLM's conversation ---------------------------------------------------------------------------


def test_text_parts_are_joined_by_newlines_for_a_string_template() -> None:
    model = _model()
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    text = model.render_chat([{"role": "user", "content": parts}])
    assert "<|im_start|>user\na\nb<|im_end|>" in text  # vLLM joins with "\n" (the stand-in: "")
    assert "user\nab<" in prompt.render_chat([{"role": "user", "content": parts}])


def test_developer_messages_become_one_system_message_unless_the_template_names_them(
    tmp_path: Path,
) -> None:
    messages = [
        {"role": "system", "content": "A"},
        {"role": "user", "content": "hi"},
        {"role": "developer", "content": "B"},
    ]
    text = _model().render_chat(messages)
    assert text.startswith("<|im_start|>system\nA\n\nB<|im_end|>\n<|im_start|>user\nhi")
    assert "developer" not in text
    own = (FIXTURES / "chat_template.jinja").read_text()
    naming = _template(tmp_path, "{% if false %}{{ 'developer' }}{% endif %}" + own)
    kept = _model(chat_template_file=naming).render_chat(messages)
    assert "<|im_start|>developer\nB<|im_end|>" in kept


def test_strftime_now_and_raise_exception_are_there(tmp_path: Path) -> None:
    path = _template(
        tmp_path,
        "{% if messages|length > 2 %}{{ raise_exception('too long: ' ~ messages|length) }}"
        "{% endif %}{{ strftime_now('%Y') }}|{{ messages[0].content }}",
    )
    model = _model(chat_template_file=path)
    year = str(datetime.datetime.now().year)
    assert model.render_chat([{"role": "user", "content": "x"}]).startswith(year)
    with pytest.raises(prompt.PromptError, match="refused the messages: too long: 3"):
        model.render_chat([{"role": "user", "content": "x"}] * 3)


@pytest.mark.parametrize(
    ("messages", "needle"),
    [
        ([], "non-empty"),
        ([{"role": "robot", "content": "x"}], r"messages\[0\]\.role"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "type 'text'"),
        ([{"role": "user", "content": "\ud800"}], "lone surrogate"),
        ([{"role": "assistant", "content": "", "tool_calls": ["x"]}], r"tool_calls\[0\]"),
    ],
)
def test_bad_messages_are_prompt_errors(messages: list[Any], needle: str) -> None:
    with pytest.raises(prompt.PromptError, match=needle):
        _model().render_chat(messages)


def test_bad_rendering_options_name_the_field() -> None:
    for body, needle in [
        ({"add_generation_prompt": "yes"}, "'add_generation_prompt' must be true or false"),
        ({"tools": {}}, "'tools' must be a list"),
        ({"chat_template_kwargs": []}, "'chat_template_kwargs' must be an object"),
        ({"chat_template_kwargs": {"chat_template": "x"}}, "may not set chat_template"),
    ]:
        with pytest.raises(prompt.PromptError, match=re.escape(needle)):
            ChatOptions.from_body(body)


def test_content_format_is_detected_as_vllm_does() -> None:
    fmt = prompts.content_format
    assert fmt("{% for m in messages %}{{ m.content }}{% endfor %}") == "string"
    assert fmt("{% for m in messages %}{% for p in m['content'] %}{% endfor %}{% endfor %}") == (
        "openai"
    )
    aliased = (
        "{% set loop_messages = messages[1:] %}{% for m in loop_messages %}"
        "{% for p in m.content %}{{ p.text }}{% endfor %}{% endfor %}"
    )
    assert fmt(aliased) == "openai"
    assert fmt("{% for m in messages %}{% set content = m.content %}"
               "{% for p in content %}{% endfor %}{% endfor %}") == "openai"  # fmt: skip


# -- settings and loading errors -------------------------------------------------------------------


def test_a_model_dir_without_tokenizer_json_is_a_settings_error(tmp_path: Path) -> None:
    with pytest.raises(pydantic.ValidationError, match=r"has no tokenizer\.json"):
        TokenizerSettings(model_dir=tmp_path)
    with pytest.raises(pydantic.ValidationError, match="is not a directory"):
        TokenizerSettings(model_dir=tmp_path / "nope")
    with pytest.raises(pydantic.ValidationError, match=r"tokenizer_file: .*does not exist"):
        TokenizerSettings(tokenizer_file=tmp_path / "tokenizer.json")
    with pytest.raises(
        pydantic.ValidationError, match="chat_template_file set without a tokenizer"
    ):
        TokenizerSettings(chat_template_file=FIXTURES / "chat_template.jinja")
    with pytest.raises(pydantic.ValidationError, match=r"chat_template_file: .*does not exist"):
        TokenizerSettings(model_dir=FIXTURES, chat_template_file=tmp_path / "t.jinja")


@pytest.mark.parametrize(
    ("template", "needle"),
    [
        ("{% for m in messages %}", r"t\.jinja does not parse: .*\(line 1\)"),
        ("{{ raise_exception('this model takes no chat') }}",
         r"t\.jinja does not render a one-message conversation: .*this model takes no chat"),
        ("{{ messages[0].content.nope() }}", r"t\.jinja does not render"),
    ],
)  # fmt: skip
def test_a_template_that_does_not_parse_or_render_is_named_at_load(
    tmp_path: Path, template: str, needle: str
) -> None:
    settings = TokenizerSettings(
        models={"m": {"model_dir": FIXTURES, "chat_template_file": _template(tmp_path, template)}}
    )
    with pytest.raises(TokenizerLoadError, match='^tokenizer.models."m": .*' + needle):
        prompts.load(settings)


def test_unreadable_files_are_named_at_load(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text('{"not": "a tokenizer"}')
    with pytest.raises(TokenizerLoadError, match=r"^tokenizer.tokenizer_file: .* is not a Hugging"):
        prompts.load(TokenizerSettings(tokenizer_file=tmp_path / "tokenizer.json"))
    (tmp_path / "config.json").write_text("{nope")
    with pytest.raises(TokenizerLoadError, match=r"^tokenizer.tokenizer_config_file: .* not JSON"):
        prompts.load(
            TokenizerSettings(model_dir=FIXTURES, tokenizer_config_file=tmp_path / "config.json")
        )
    named = {"chat_template": [{"name": "tool_use", "template": "{{ 1 }}"}]}
    (tmp_path / "config.json").write_text(json.dumps(named))
    with pytest.raises(TokenizerLoadError, match="names templates tool_use but no 'default'"):
        prompts.load(
            TokenizerSettings(
                tokenizer_file=FIXTURES / "tokenizer.json",
                tokenizer_config_file=tmp_path / "config.json",
            )
        )


def test_the_config_files_template_and_tokens_are_used_and_settings_override_them(
    tmp_path: Path,
) -> None:
    config = {
        "bos_token": {"content": "<|endoftext|>", "__type": "AddedToken"},
        "chat_template": [{"name": "default", "template": "{{ bos_token }}{{ eos_token }}|"}],
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    settings: dict[str, Any] = {
        "tokenizer_file": FIXTURES / "tokenizer.json",
        "tokenizer_config_file": tmp_path / "config.json",
    }
    model = prompts.load(TokenizerSettings(**settings)).default
    assert model is not None
    assert model.template_origin.endswith("config.json (chat_template)")
    assert model.render_chat([{"role": "user", "content": "x"}]) == "<|endoftext|>|"
    model = prompts.load(TokenizerSettings(**settings, eos_token="<|im_end|>")).default
    assert model is not None
    assert model.render_chat([{"role": "user", "content": "x"}]) == "<|endoftext|><|im_end|>|"


def test_without_a_template_chat_prompts_are_laid_out_as_chatml(tmp_path: Path) -> None:
    model = _model(model_dir=None, tokenizer_file=FIXTURES / "tokenizer.json")
    assert model.template_source is None
    messages = [{"role": "user", "content": "hi"}]
    assert model.render_chat(messages) == prompt.render_chat(messages)


def test_models_get_their_own_tokenizer_else_the_default_else_none() -> None:
    only_one = prompts.load(TokenizerSettings(models={"a": {"model_dir": FIXTURES}}))
    assert only_one.for_model("a") is not None and only_one.for_model("b") is None
    both = prompts.load(
        TokenizerSettings(
            tokenizer_file=FIXTURES / "tokenizer.json", models={"a": {"model_dir": FIXTURES}}
        )
    )
    a, b = both.for_model("a"), both.for_model("b")
    assert a is not None and b is not None and a is not b
    assert a.template_source is not None and b.template_source is None
    assert a.cache is b.cache  # one memory bound for every model
    assert not prompts.load(TokenizerSettings()).configured()


# -- where prompts are cut, and the prefix cache ---------------------------------------------------


def test_boundaries_are_the_special_tokens_that_take_no_whitespace(tmp_path: Path) -> None:
    model = _model()
    assert model.boundaries is not None
    sample = "a<|im_start|>b<|im_end|>\n<|endoftext|><|im_start"
    assert model.boundaries.findall(sample) == ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
    tok = tokenizers.Tokenizer.from_file(str(FIXTURES / "tokenizer.json"))
    tok.add_special_tokens([tokenizers.AddedToken("<|x|>", special=True, lstrip=True)])
    tok.save(str(tmp_path / "tokenizer.json"))
    stripping = _model(model_dir=None, tokenizer_file=tmp_path / "tokenizer.json")
    assert stripping.boundaries is not None
    assert re.escape("<|x|>") not in stripping.boundaries.pattern
    # cutting before a token that takes the whitespace on its left changes the tokens: the
    # check at load says so, and such a tokenizer would go without the prefix cache
    forced = dataclasses.replace(stripping, boundaries=re.compile(re.escape("<|x|>")))
    assert not prompts._splits_cleanly(forced, "a <|x|> b")
    assert prompts._splits_cleanly(model, model.render_chat([{"role": "user", "content": "a"}]))


class _Counting:
    """A tokenizer that counts the characters it is given to encode."""

    def __init__(self, inner: tokenizers.Tokenizer) -> None:
        self.inner = inner
        self.chars = 0

    def encode_batch_fast(self, texts: Sequence[str], add_special_tokens: bool) -> Any:
        self.chars += sum(len(t) for t in texts)
        return self.inner.encode_batch_fast(list(texts), add_special_tokens=add_special_tokens)


def _conversation(system: str, turns: int, tag: str) -> list[dict[str, str]]:
    """A system prompt and ``turns`` exchanges, then a question: the next turn's request
    holds this one's messages, the answer and a new question."""
    out = [{"role": "system", "content": system}]
    for i in range(turns):
        out.append({"role": "user", "content": f"question {tag} {i}: how is the cache?"})
        out.append({"role": "assistant", "content": f"answer {tag} {i}, fine and warm"})
    out.append({"role": "user", "content": f"question {tag} {turns}: how is the cache?"})
    return out


def test_a_shared_system_prompt_and_earlier_turns_are_tokenised_once_and_hash_the_same() -> None:
    model = _model()
    counting = _Counting(model.tokenizer)
    cached = dataclasses.replace(model, tokenizer=counting)  # type: ignore[arg-type]
    system = "You are the routing assistant. " * 60  # about 1,800 characters
    options = ChatOptions()
    for block_size, max_tokens in ((16, 8192), (16, 300), (7, 8192)):
        for convo, most in (
            (_conversation(system, 0, "a"), None),
            (_conversation(system, 0, "b"), 100),  # the system prompt comes from the cache
            (_conversation(system, 1, "a"), 150),  # and the first question too
            (_conversation(system, 2, "a"), 150),
            (_conversation(system, 2, "a"), 0),  # a repeat: all of it
            (_conversation("Another system prompt.", 1, "c"), None),
        ):
            ids = model.chat_token_ids(convo)
            before = counting.chars
            head = cached.encode_chat(convo, options, block_size=block_size, max_tokens=max_tokens)
            kept = ids[:max_tokens]
            assert head.block_hashes == prompt.block_hashes(kept, block_size=block_size)
            assert head.head_tokens == len(kept)
            if len(ids) <= max_tokens:
                assert head.total_tokens == len(ids) and head.complete
            else:  # from a state that had the whole head: the rest estimated
                assert abs(head.total_tokens - len(ids)) <= 0.2 * len(ids)
            if most is not None and max_tokens > len(ids):
                assert counting.chars - before <= most
    assert cached.cache.cache.hits > 0


def test_a_long_prompt_is_read_up_to_its_head_only() -> None:
    model = _model()
    counting = _Counting(model.tokenizer)
    cached = dataclasses.replace(model, tokenizer=counting)  # type: ignore[arg-type]
    text = " ".join(f"word{i % 97} routing" for i in range(20_000))  # 290k characters
    messages = [{"role": "user", "content": text}]
    head = cached.encode_chat(messages, ChatOptions(), block_size=16, max_tokens=512)
    assert counting.chars <= 512 * prompt.HEAD_CHARS_PER_TOKEN
    ids = model.chat_token_ids(messages)
    assert head.head_tokens == 512 and not head.complete
    assert head.block_hashes == prompt.block_hashes(ids[:512], block_size=16)
    assert abs(head.total_tokens - len(ids)) < 0.02 * len(ids)


# -- through the agent -----------------------------------------------------------------------------

MODEL = "tiny-model"  # the model the nodes serve, as in the real-vLLM tests


async def test_the_agent_routes_by_the_models_own_tokens_and_says_what_its_template_refused(
    sim_node: NodeFactory, start_agent: AgentFactory
) -> None:
    """An agent with the tiny model's tokenizer: repeats of a long chat prompt (over
    parse.offload_min_bytes, so parsed on the parse thread) all go to the node that has it;
    the prompt's token count is the model tokenizer's; a conversation the template refuses is
    a 400 with the template's words; a model without a tokenizer keeps the stand-in."""
    # an 8k context (cpu-tiny's 512 tokens would refuse a prompt this long), named as the tests'
    urls = [await sim_node(profile_name="h100-llama3-8b", model=MODEL, seed=i) for i in range(3)]
    template = TEMPLATES / "alternating.jinja"
    handle = await start_agent(
        urls,
        policy="prefix_aware",
        tokenizer={
            "models": {MODEL: {"model_dir": str(FIXTURES), "chat_template_file": str(template)}}
        },
    )
    own = handle.edge.prompts.for_model(MODEL)
    assert own is not None and handle.edge.prompts.for_model("other") is None
    system = "You answer questions about the routing of prompts. " * 120  # 6 KB
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "why?"}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 1}
    assert len(json.dumps(body)) >= handle.edge.settings.parse.offload_min_bytes
    async with aiohttp.ClientSession() as s:
        for _ in range(4):
            async with s.post(f"{handle.url}/v1/chat/completions", json=body) as r:
                assert r.status == 200, await r.text()
        alternating = {"model": MODEL, "messages": [{"role": "user", "content": "a"}] * 2}
        async with s.post(f"{handle.url}/v1/chat/completions", json=alternating) as r:
            assert r.status == 400
            error = (await r.json())["error"]
        assert error["param"] == "messages"
        assert (
            "chat template refused the messages: Conversation roles must alternate"
            in (error["message"])
        )
    served = {u: await metric(u, "vllm:request_success_total") for u in urls}
    assert sorted(served.values()) == [0, 0, 4], served  # one home, by the model's tokens
    parsed = handlers._parse_body(
        json.dumps(body).encode(),
        {},
        handle.edge.settings,
        kind="chat",
        prompts=handle.edge.prompts,
    )
    ids = own.chat_token_ids(messages)
    assert parsed.view.prompt_tokens == len(ids)
    assert parsed.view.block_hashes == prompt.block_hashes(ids, block_size=16)
    standin = handlers._parse_body(
        json.dumps({**body, "model": "other"}).encode(), {}, handle.edge.settings, kind="chat",
        prompts=handle.edge.prompts,
    )  # fmt: skip
    text = prompt.render_chat(messages)
    assert standin.view.prompt_tokens == prompt.count_tokens(text)


def test_a_completion_and_its_special_tokens_as_vllm_reads_them(tmp_path: Path) -> None:
    shutil.copytree(FIXTURES, tmp_path / "m")
    config = json.loads((FIXTURES / "tokenizer_config.json").read_text())
    (tmp_path / "m" / "tokenizer_config.json").write_text(
        json.dumps({**config, "add_bos_token": True})
    )
    settings = Settings(tokenizer={"model_dir": tmp_path / "m"})
    loaded = prompts.load(settings.tokenizer)
    own = loaded.for_model(MODEL)
    assert own is not None
    text = EXPECTED["completion"]["prompt"]
    for extra, want in (({}, True), ({"add_special_tokens": False}, False)):
        body = json.dumps({"model": MODEL, "prompt": text, **extra}).encode()
        parsed = handlers._parse_body(body, {}, settings, kind="completion", prompts=loaded)
        ids = own.completion_token_ids(text, add_special_tokens=want)
        assert ids[0] == 1 if want else ids[0] != 1
        assert parsed.view.prompt_tokens == len(ids)
        assert parsed.view.block_hashes == prompt.block_hashes(ids, block_size=16)
    body = json.dumps({"model": MODEL, "prompt": text, "add_special_tokens": 1}).encode()
    with pytest.raises(BadRequest, match="'add_special_tokens' must be true or false"):
        handlers._parse_body(body, {}, settings, kind="completion", prompts=loaded)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": "no"}
    with pytest.raises(BadRequest, match="'tools' must be a list"):
        handlers._parse_body(json.dumps(chat).encode(), {}, settings, kind="chat", prompts=loaded)


# -- the stand-in's prompts, by segments and cached ------------------------------------------------

_WORDS = st.sampled_from(
    ["route", " token", " cache", "7", "42 ", ".", "\n", "  ", "é", "<|x", "|>"]
)
_TEXTS = st.lists(_WORDS, max_size=60).map("".join)
_ROLES = st.sampled_from(["system", "user", "assistant"])


@settings(max_examples=60, deadline=None)
@given(
    system=_TEXTS,
    turns=st.lists(st.tuples(_ROLES, _TEXTS), min_size=1, max_size=6),
    max_tokens=st.integers(1, 400),
    block_size=st.sampled_from([1, 4, 16]),
)
def test_the_stand_ins_cached_prompts_hash_as_the_whole_text_does(
    system: str, turns: list[tuple[str, str]], max_tokens: int, block_size: int
) -> None:
    """A chat prompt tokenised by segments with the prefix cache hashes as the whole rendered
    text tokenised at once (what the simulator caches by): for a prompt seen first, for one
    sharing a system prompt with it, for a conversation that grew by a turn, and for a repeat;
    the count is exact when the prompt fits the head."""
    loaded = prompts.load(TokenizerSettings())
    assert loaded.shared is not None and not loaded.configured()
    first = [{"role": "system", "content": system}, *({"role": r, "content": c} for r, c in turns)]
    other = [{"role": "system", "content": system}, {"role": "user", "content": "another"}]
    grown = [*first, {"role": "user", "content": "and then?"}]
    for messages in (first, other, grown, first):
        text = prompt.render_chat(messages)
        if len(text) > max_tokens * prompt.HEAD_CHARS_PER_TOKEN:
            continue  # past the head the cut may drop a token (encode_head's docstring)
        whole = prompt.tokenize(text)
        got = loaded.encode_stand_in_chat(messages, block_size=block_size, max_tokens=max_tokens)
        assert got.block_hashes == prompt.block_hashes(whole[:max_tokens], block_size=block_size)
        assert got.complete == (len(whole) <= max_tokens)
        if got.complete:
            assert got.total_tokens == len(whole)
        else:  # estimated when a cached state already filled the head
            assert got.total_tokens >= max_tokens


def test_the_stand_in_hashes_a_shared_system_prompt_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The second request with the same 2,000-word system prompt tokenises only its question."""
    loaded = prompts.load(TokenizerSettings())
    system = " ".join(f"word{i % 97}" for i in range(2000))
    calls: list[int] = []
    tokenize_many = prompt.PieceIds.tokenize_many

    def counting(self: prompt.PieceIds, texts: Sequence[str]) -> list[tuple[int, ...]]:
        calls.append(sum(len(t) for t in texts))
        return tokenize_many(self, texts)

    monkeypatch.setattr(prompt.PieceIds, "tokenize_many", counting)
    for question in ("first?", "second?"):
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        loaded.encode_stand_in_chat(messages, block_size=16, max_tokens=8192)
    assert calls[0] > len(system) and calls[1] < 100, calls
