"""The served models' own tokenizers and chat templates (the ``[tokenizer]`` settings).

With a tokenizer configured for a model, the agent renders a chat request's messages with the
model's chat template and tokenises the text with the model's ``tokenizer.json``, as vLLM does
for the same request, so the block hashes it routes by are those of the tokens the node caches.
Without one, ``policies.prompt``'s stand-in renders and tokenises, as before
(:meth:`Prompts.encode_stand_in_chat`: by segments, with the same prefix cache).

Rendering follows Hugging Face's ``apply_chat_template`` (transformers 5,
``utils/chat_template_utils.py``): an ``ImmutableSandboxedEnvironment`` with ``trim_blocks``
and ``lstrip_blocks``, the ``loopcontrols`` extension, ``raise_exception`` and ``strftime_now``
globals and a ``tojson`` filter that does not escape HTML; the variables ``messages``,
``tools``, ``documents``, ``add_generation_prompt``, the special tokens (``bos_token``,
``eos_token``, ...) and the request's ``chat_template_kwargs``.  The messages are first made
into vLLM's conversation (vLLM 0.32, ``renderers/chat_utils.py``): a message's text parts are
joined with newlines, or kept as ``{"type": "text", ...}`` parts when the template iterates
over a message's content (vLLM's "openai" content format, detected from the template's syntax
tree as vLLM does); tool calls' JSON arguments become objects; a ``developer`` message becomes
a ``system`` one when the template does not name that role.

Tokenising follows vLLM's ``/v1/chat/completions`` and ``/tokenize``: a chat prompt without
special tokens added (the template writes the BOS itself; the request's
``add_special_tokens`` says otherwise), a completion's prompt with them (the tokenizer's
post-processor: a BOS for Llama models).  The ``tokenizers`` library encodes in Rust and, in its
batch calls, releases the GIL, so a parse thread tokenising a long prompt leaves the event loop
free (its single-text ``encode`` does not: it is never used here).

A shared system prompt is tokenised and hashed once: a prompt is cut before each special token
(where the tokenizer's own splitting cuts it, so the pieces' tokens add up to the whole's; each
tokenizer is checked for that at load), and the state after the longest prefix of whole pieces
already seen comes from a cache (``policies.prompt.PrefixCache``, least recently used first
out, at most ``tokenizer.prefix_cache_bytes`` for all models together).

Loading (:func:`load`) reads the files and renders a probe conversation; every problem is a
``ValueError`` naming the setting and the file, which ``meridian-agent`` (and
``--check-config``) print at start.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import datetime
import functools
import hashlib
import itertools
import json
import logging
import os
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.sandbox
import tokenizers

from policies import prompt
from regional_agent.settings import TokenizerFiles, TokenizerSettings

log = logging.getLogger(__name__)

ContentFormat = Literal["string", "openai"]
# transformers 5's named special tokens (SPECIAL_TOKENS_ATTRIBUTES): template variables
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
# apply_chat_template's own parameters: a request's chat_template_kwargs may name them even when
# the template does not (vLLM's resolve_chat_template_kwargs); the two it refuses
_HF_PARAMS = frozenset(
    {
        "conversation",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)
_REFUSED_KWARGS = frozenset({"chat_template", "tokenize"})
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' marker for continue_final_message
_BILLING_HEADER = "x-anthropic-billing-header"  # vLLM drops this line from system messages


class TokenizerLoadError(ValueError):
    """A tokenizer setting whose files cannot be used: the message names the setting and file."""


class TemplateRefused(prompt.PromptError):
    """The chat template raised on a conversation (``raise_exception``, or an error of its
    own); ``reason`` is the template's words."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"the model's chat template refused the messages: {reason}")
        self.reason = reason


# -- the template ---------------------------------------------------------------------------------


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: object,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.datetime.now().strftime(format)


class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (transformers' AssistantTracker): renders its
    body; the agent has no use for the assistant masks it marks."""

    tags = {"generation"}  # noqa: RUF012 (jinja's own attribute)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render(self, caller: Callable[[], str]) -> str:
        return caller()


@functools.lru_cache(maxsize=32)
def compile_template(source: str) -> jinja2.Template:
    """The template as transformers compiles it; ``jinja2.TemplateSyntaxError`` when it does
    not parse."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def template_variables(source: str) -> frozenset[str]:
    env = compile_template(source).environment
    return frozenset(jinja2.meta.find_undeclared_variables(env.parse(source)))


# The content format, as vLLM detects it (vllm/renderers/hf.py, Apache-2.0): "openai" when the
# template loops over a message's content (``for part in message['content']``, through any
# variable assigned from ``messages``), else "string".  Macro parameters bound to a message's
# content are not followed (vLLM follows them): such a template is taken as "string".


def _is_var(node: jinja2.nodes.Node, name: str) -> bool:
    return isinstance(node, jinja2.nodes.Name) and node.ctx == "load" and node.name == name


def _is_attr(node: jinja2.nodes.Node, name: str, key: str) -> bool:
    if isinstance(node, jinja2.nodes.Getitem):
        return (
            _is_var(node.node, name)
            and isinstance(node.arg, jinja2.nodes.Const)
            and node.arg.value == key
        )
    if isinstance(node, jinja2.nodes.Getattr):
        return _is_var(node.node, name) and node.attr == key
    return False


def _is_access(node: jinja2.nodes.Node, name: str, key: str | None = None) -> bool:
    if isinstance(node, jinja2.nodes.Filter):
        return node.node is not None and _is_access(node.node, name, key)
    if isinstance(node, jinja2.nodes.Test):
        return _is_access(node.node, name, key)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return _is_access(node.node, name, key)
    return _is_attr(node, name, key) if key else _is_var(node, name)


def _aliases(root: jinja2.nodes.Template, name: str) -> list[str]:
    names = [name]
    queue = collections.deque([name])
    while queue:
        current = queue.popleft()
        for assign in root.find_all(jinja2.nodes.Assign):
            target = assign.target
            if (
                _is_access(assign.node, current)
                and isinstance(target, jinja2.nodes.Name)
                and target.name not in names
            ):
                names.append(target.name)
                queue.append(target.name)
    return names


def content_format(source: str) -> ContentFormat:
    root = compile_template(source).environment.parse(source)
    messages = _aliases(root, "messages")
    loop_vars = [
        loop.target.name
        for loop in root.find_all(jinja2.nodes.For)
        if isinstance(loop.target, jinja2.nodes.Name)
        and any(_is_access(loop.iter, m) for m in messages)
    ]
    in_macros = {id(loop) for macro in root.find_all(jinja2.nodes.Macro) for loop in
                 macro.find_all(jinja2.nodes.For)}  # fmt: skip
    for loop in root.find_all(jinja2.nodes.For):
        if any(_is_access(loop.iter, v, "content") for v in loop_vars):
            return "openai"
        if id(loop) not in in_macros and _is_var(loop.iter, "content"):
            return "openai"
    return "string"


# -- messages into vLLM's conversation ------------------------------------------------------------


def _text_parts(content: object, index: int, *, role: str) -> list[dict[str, Any]]:
    """A message's content as text parts (``None``: none), or ``PromptError`` naming it."""
    if content is None:
        return []
    if isinstance(content, str):
        return [
            {"type": "text", "text": prompt.check_text(content, field=f"messages[{index}].content")}
        ]
    if not isinstance(content, list):
        raise prompt.PromptError(
            f"messages[{index}].content must be a string or a list of text parts"
        )
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        if not isinstance(part, Mapping) or part.get("type") != "text":
            raise prompt.PromptError(
                f"messages[{index}].content[{j}]: only parts of type 'text' are supported"
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise prompt.PromptError(f"messages[{index}].content[{j}].text must be a string")
        prompt.check_text(text, field=f"messages[{index}].content[{j}].text")
        extra = {k: v for k, v in part.items() if k not in ("type", "text")}
        parts.append({"type": "text", "text": text, **extra})
    if role == "system":
        parts = _without_billing_header(parts)
    return parts


def _without_billing_header(parts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for part in parts:
        text = part["text"]
        if text.startswith(_BILLING_HEADER):
            rest = text.partition("\n")[2]
            if rest:
                out.append({**part, "text": rest})
            continue
        out.append(part)
    return out


def _arguments(value: object) -> object:
    """A tool call's arguments as the object a template expects (vLLM: malformed JSON, or JSON
    that is not an object, becomes ``{}``)."""
    if not value:
        return {}
    if isinstance(value, dict):
        return value
    parsed: object = value
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            return {}
    return parsed if isinstance(parsed, dict) else {}


def conversation(
    messages: Sequence[object], *, fmt: ContentFormat, developer_role: bool
) -> list[dict[str, Any]]:
    """OpenAI chat messages as vLLM hands them to the chat template."""
    if not messages:
        raise prompt.PromptError("messages must be a non-empty list")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise prompt.PromptError(f"messages[{i}] must be an object with 'role' and 'content'")
        role = message.get("role")
        if not isinstance(role, str) or role not in prompt.ROLES:
            allowed = ", ".join(sorted(prompt.ROLES))
            raise prompt.PromptError(f"messages[{i}].role must be one of {allowed}; got {role!r}")
        parts = _text_parts(message.get("content"), i, role=role)
        content: object
        if fmt == "openai" and role != "tool":
            content = parts
        else:
            content = "\n".join(p["text"] for p in parts)
        result: dict[str, Any] = {"role": role, "content": content}
        if role == "assistant":
            calls = message.get("tool_calls")
            if isinstance(calls, list) and calls:
                result["tool_calls"] = [_tool_call(call, i, j) for j, call in enumerate(calls)]
            reasoning = message.get("reasoning")
            if reasoning is not None:
                result["reasoning"] = result["reasoning_content"] = reasoning
        elif role == "tool" and "tool_call_id" in message:
            result["tool_call_id"] = message["tool_call_id"]
        if isinstance(message.get("name"), str):
            result["name"] = message["name"]
        if role == "developer":
            result["tools"] = message.get("tools")
        out.append(result)
    if not developer_role and any(m["role"] == "developer" for m in out):
        out = _consolidated_system(out)
    return out


def _tool(tool: object, i: int) -> dict[str, Any]:
    """A request's tool as vLLM hands it to the template (its ChatCompletionToolsParam dumped):
    type, then the function's name, description and parameters (null when not given), strict
    and defer_loading when given; other fields dropped."""
    function = tool.get("function") if isinstance(tool, Mapping) else None
    if not isinstance(tool, Mapping) or not isinstance(function, Mapping):
        raise prompt.PromptError(f"tools[{i}] must be an object with a 'function'")
    if tool.get("type", "function") != "function":
        raise prompt.PromptError(f"tools[{i}].type must be 'function'")
    if not isinstance(function.get("name"), str):
        raise prompt.PromptError(f"tools[{i}].function.name must be a string")
    defer = tool.get("defer_loading")
    out_function: dict[str, Any] = {
        "name": function["name"],
        "description": function.get("description"),
        "parameters": function.get("parameters"),
    }
    for key in ("strict", "defer_loading"):
        value = function.get(key)
        if key == "defer_loading" and value is None:
            value = defer
        if value is not None:
            out_function[key] = value
    out: dict[str, Any] = {"type": "function", "function": out_function}
    if defer is not None:
        out["defer_loading"] = defer
    return out


def _tool_call(call: object, i: int, j: int) -> dict[str, Any]:
    if not isinstance(call, Mapping):
        raise prompt.PromptError(f"messages[{i}].tool_calls[{j}] must be an object")
    function = call.get("function")
    if call.get("type", "function") != "function" or not isinstance(function, Mapping):
        raise prompt.PromptError(
            f"messages[{i}].tool_calls[{j}]: only tool calls of type 'function' are supported"
        )
    item = copy.deepcopy(dict(call))
    item["function"] = {**function, "arguments": _arguments(function.get("arguments"))}
    return item


def _consolidated_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """vLLM's _convert_developer_to_system then _consolidate_system_messages: developer
    messages become system ones, and several system messages (or one not first) one at the
    start, their texts joined by a blank line."""
    converted = []
    for message in messages:
        if message["role"] == "developer":
            message = {k: v for k, v in message.items() if k != "tools"}
            message["role"] = "system"
        converted.append(message)
    texts: list[str] = []
    others: list[dict[str, Any]] = []
    merge = False
    for i, message in enumerate(converted):
        if message["role"] != "system":
            others.append(message)
            continue
        if i > 0 or texts:
            merge = True
        content = message.get("content", "")
        if isinstance(content, list):
            content = "\n".join(p["text"] for p in content if isinstance(p, dict) and "text" in p)
        if content:
            texts.append(content)
    if not merge:
        return converted
    return [{"role": "system", "content": "\n\n".join(texts)}, *others]


# -- a chat request's rendering options ------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class ChatOptions:
    """The fields of a chat request (or ``/tokenize``) that change its rendering, as vLLM reads
    them; :meth:`from_body` raises ``PromptError`` naming a bad one."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    tools: list[Any] | None = None
    documents: list[Any] | None = None
    template_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> ChatOptions:
        flags: dict[str, bool] = {}
        for name, default in (
            ("add_generation_prompt", True),
            ("continue_final_message", False),
            ("add_special_tokens", False),
        ):
            value = body.get(name, default)
            if value is None:
                value = default
            if not isinstance(value, bool):
                raise prompt.PromptError(f"'{name}' must be true or false")
            flags[name] = value
        if flags["continue_final_message"] and flags["add_generation_prompt"]:
            raise prompt.PromptError(
                "cannot set both 'continue_final_message' and 'add_generation_prompt' to true"
            )
        lists: dict[str, list[Any] | None] = {}
        for name in ("tools", "documents"):
            value = body.get(name)
            if value is not None and not isinstance(value, list):
                raise prompt.PromptError(f"'{name}' must be a list")
            lists[name] = value
        if lists["tools"] is not None:
            lists["tools"] = [_tool(tool, i) for i, tool in enumerate(lists["tools"])]
        kwargs = body.get("chat_template_kwargs")
        if kwargs is None:
            kwargs = {}
        if not isinstance(kwargs, dict):
            raise prompt.PromptError("'chat_template_kwargs' must be an object")
        refused = _REFUSED_KWARGS & kwargs.keys()
        if refused:
            raise prompt.PromptError(
                f"'chat_template_kwargs' may not set {', '.join(sorted(refused))}"
            )
        extra: dict[str, Any] = {}
        effort = body.get("reasoning_effort")
        if effort is not None and effort != "auto":
            extra["reasoning_effort"] = effort
            if "enable_thinking" not in kwargs:
                extra["enable_thinking"] = effort != "none"
        return cls(
            add_generation_prompt=flags["add_generation_prompt"],
            continue_final_message=flags["continue_final_message"],
            add_special_tokens=flags["add_special_tokens"],
            tools=lists["tools"],
            documents=lists["documents"],
            template_kwargs={**kwargs, **extra},
        )


# -- one model's tokenizer and template ------------------------------------------------------------


class _LockedCache:
    """A :class:`policies.prompt.PrefixCache` shared by the event loop and the parse threads."""

    def __init__(self, cache: prompt.PrefixCache) -> None:
        self.cache = cache
        self._lock = threading.Lock()

    def longest(self, keys: Sequence[bytes]) -> tuple[int, prompt.PrefixState] | None:
        with self._lock:
            return self.cache.longest(keys)

    def put(self, key: bytes, state: prompt.PrefixState) -> None:
        with self._lock:
            self.cache.put(key, state)


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelPrompts:
    """One model's tokenizer and chat template (:func:`load_model`)."""

    setting: str  # where it was configured: "tokenizer" or 'tokenizer.models."m"'
    tokenizer: tokenizers.Tokenizer
    template_source: str | None  # None: chat prompts rendered by the stand-in (ChatML)
    template_origin: str  # the file it came from, for messages
    special_tokens: Mapping[str, str]  # bos_token, eos_token, ...: template variables
    fmt: ContentFormat
    developer_role: bool  # the template names the developer role
    variables: frozenset[str]  # the template's undeclared variables
    boundaries: re.Pattern[str] | None  # where prompts split for the prefix cache
    cache: _LockedCache
    namespace: bytes  # the cache keys' prefix for this tokenizer and template

    # -- whole prompts, exactly as vLLM makes them (no bound: tests, /tokenize-like uses) --------

    def render_chat(self, messages: Sequence[object], options: ChatOptions | None = None) -> str:
        """The prompt text of a chat request, or ``PromptError`` (a bad message, or one the
        template refused: its own words)."""
        options = options or ChatOptions()
        if self.template_source is None:
            return prompt.render_chat(messages, add_generation_prompt=options.add_generation_prompt)
        chat = conversation(messages, fmt=self.fmt, developer_role=self.developer_role)
        variables = dict(self.special_tokens)
        accepted = self.variables | _HF_PARAMS
        variables.update({k: v for k, v in options.template_kwargs.items() if k in accepted})
        for name in ("messages", "tools", "documents", "add_generation_prompt"):
            variables.pop(name, None)
        for name in ("continue_final_message", "conversation"):
            variables.pop(name, None)
        final_text = ""
        if options.continue_final_message:
            chat, final_text = _tag_final_message(chat)
        try:
            text = compile_template(self.template_source).render(
                messages=chat,
                tools=options.tools,
                documents=options.documents,
                add_generation_prompt=options.add_generation_prompt,
                **variables,
            )
        except Exception as exc:  # a template refuses input by raising (raise_exception)
            raise TemplateRefused(_reason(exc)) from None
        if options.continue_final_message:
            text = _untag(text, final_text)
        return text

    def chat_token_ids(
        self, messages: Sequence[object], options: ChatOptions | None = None
    ) -> list[int]:
        options = options or ChatOptions()
        text = self.render_chat(messages, options)
        return self._encode([text], special=options.add_special_tokens)[0]

    def completion_token_ids(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return self._encode([text], special=add_special_tokens)[0]

    # -- routing heads, bounded and cached -------------------------------------------------------

    def encode_chat(
        self,
        messages: Sequence[object],
        options: ChatOptions,
        *,
        block_size: int,
        max_tokens: int,
    ) -> prompt.Encoded:
        text = self.render_chat(messages, options)
        if options.add_special_tokens:
            return self._encode_head(
                text, block_size=block_size, max_tokens=max_tokens, special=True
            )
        return prompt.encode_head(
            text,
            tokenize=self.plain,
            block_size=block_size,
            max_tokens=max_tokens,
            boundaries=self.boundaries,
            cache=self.cache,
            namespace=self.namespace,
        )

    def encode_completion(
        self, text: str, *, add_special_tokens: bool, block_size: int, max_tokens: int
    ) -> prompt.Encoded:
        return self._encode_head(
            text, block_size=block_size, max_tokens=max_tokens, special=add_special_tokens
        )

    def _encode_head(
        self, text: str, *, block_size: int, max_tokens: int, special: bool
    ) -> prompt.Encoded:
        return prompt.encode_head(
            text,
            tokenize=functools.partial(self._encode, special=special),
            block_size=block_size,
            max_tokens=max_tokens,
        )

    def plain(self, texts: Sequence[str]) -> list[list[int]]:
        return self._encode(texts, special=False)

    def _encode(self, texts: Sequence[str], *, special: bool) -> list[list[int]]:
        # the batch call: it releases the GIL while it tokenises (encode() does not)
        encodings = self.tokenizer.encode_batch_fast(list(texts), add_special_tokens=special)
        return [e.ids for e in encodings]


def _tag_final_message(chat: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], str]:
    """transformers' continue_final_message: the final message's text marked, to cut the
    rendering after it."""
    chat = copy.deepcopy(chat)
    final = chat[-1].get("content")
    if isinstance(final, list):
        for part in reversed(final):
            if "text" in part:
                text: str = part["text"]
                part["text"] = text + _CONTINUE_TAG
                return chat, text
        raise prompt.PromptError(
            "continue_final_message is set but the final message has no text to continue"
        )
    if not isinstance(final, str):
        raise prompt.PromptError(
            "continue_final_message is set but the final message has no content to continue"
        )
    chat[-1]["content"] = final + _CONTINUE_TAG
    return chat, final


def _untag(text: str, final: str) -> str:
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in text or tag not in text:
        raise prompt.PromptError(
            "continue_final_message is set but the chat template dropped part of the final message"
        )
    at = text.rindex(tag)
    if text[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return text[:at]
    return text[:at].rstrip()


def _reason(exc: BaseException) -> str:
    """The most specific reason in an exception chain: a template error's own message."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, jinja2.TemplateError):
            return str(current)
        current = current.__cause__ or current.__context__
    return f"{type(exc).__name__}: {exc}"


# -- loading ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Prompts:
    """Every configured model's :class:`ModelPrompts`; :meth:`for_model` picks one."""

    models: Mapping[str, ModelPrompts] = dataclasses.field(default_factory=dict)
    default: ModelPrompts | None = None
    cache: prompt.PrefixCache | None = None
    shared: _LockedCache | None = None  # ``cache`` behind its lock, for every model's prompts
    pieces: prompt.PieceIds = dataclasses.field(default_factory=prompt.PieceIds)  # stand-in's

    def for_model(self, model: str) -> ModelPrompts | None:
        """The model's own entry, else the default, else None (the stand-in)."""
        return self.models.get(model, self.default)

    def encode_stand_in_chat(
        self, messages: Sequence[object], *, block_size: int, max_tokens: int
    ) -> prompt.Encoded:
        """A chat prompt rendered and tokenised by the stand-in (a model without a tokenizer),
        by segments before its special tokens with the prefix cache, as a model's own are: a
        shared system prompt is tokenised and hashed once.  The hashes are those of
        ``block_hashes(tokenize(render_chat(messages))[:max_tokens])`` for a prompt of at most
        ``max_tokens * HEAD_CHARS_PER_TOKEN`` characters (``policies.prompt.encode_head``)."""
        return prompt.encode_head(
            prompt.render_chat(messages),
            tokenize=self.pieces.tokenize_many,
            block_size=block_size,
            max_tokens=max_tokens,
            boundaries=prompt.STAND_IN_SPECIAL,
            cache=self.shared,
            namespace=b"stand-in",
        )

    def configured(self) -> bool:
        return self.default is not None or bool(self.models)


def load(settings: TokenizerSettings) -> Prompts:
    """Every tokenizer the settings name, loaded and checked; ``TokenizerLoadError`` names the
    setting and the file of the first that fails."""
    cache = prompt.PrefixCache(max_bytes=settings.prefix_cache_bytes)
    shared = _LockedCache(cache)
    if not settings.configured() and not settings.models:
        return Prompts(cache=cache, shared=shared)  # the stand-in's prompts use it too
    # a single-threaded tokenizer: the parse thread is the concurrency, and a process that
    # forks after the library's thread pool ran gets a warning on every fork
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    default = (
        load_model(settings, setting="tokenizer", cache=shared) if settings.configured() else None
    )
    models = {
        name: load_model(files, setting=f"tokenizer.models.{json.dumps(name)}", cache=shared)
        for name, files in settings.models.items()
    }
    return Prompts(models=models, default=default, cache=cache, shared=shared)


def load_model(files: TokenizerFiles, *, setting: str, cache: _LockedCache) -> ModelPrompts:
    paths = files.paths()
    tokenizer_file = paths.tokenizer_file
    try:
        raw = tokenizer_file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TokenizerLoadError(
            f"{setting}.tokenizer_file: cannot read {tokenizer_file}: {_why(exc)}"
        ) from None
    try:
        tokenizer = tokenizers.Tokenizer.from_str(raw)
    except Exception as exc:  # the library's own error type is a plain Exception
        raise TokenizerLoadError(
            f"{setting}.tokenizer_file: {tokenizer_file} is not a Hugging Face tokenizer.json: "
            f"{exc}"
        ) from None
    config = _read_config(paths.tokenizer_config_file, setting)
    special = _special_tokens(config, files)
    _apply_config(tokenizer, config, special)
    template_source, origin = _chat_template(paths, config, setting)
    fmt: ContentFormat = "string"
    developer = False
    variables: frozenset[str] = frozenset()
    if template_source is not None:
        try:
            compile_template(template_source)
        except jinja2.TemplateSyntaxError as exc:
            raise TokenizerLoadError(
                f"{setting}: the chat template in {origin} does not parse: {exc.message} "
                f"(line {exc.lineno})"
            ) from None
        fmt = content_format(template_source)
        developer = '"developer"' in template_source or "'developer'" in template_source
        variables = template_variables(template_source)
    namespace = hashlib.blake2b(
        json.dumps([raw, template_source, sorted(special.items())]).encode(), digest_size=16
    ).digest()
    model = ModelPrompts(
        setting=setting,
        tokenizer=tokenizer,
        template_source=template_source,
        template_origin=origin,
        special_tokens=special,
        fmt=fmt,
        developer_role=developer,
        variables=variables,
        boundaries=_boundaries(tokenizer),
        cache=cache,
        namespace=namespace,
    )
    probe = _probe(model)
    if model.boundaries is not None and not _splits_cleanly(model, probe):
        log.warning(
            "%s: %s does not split at its special tokens as expected: prompts are tokenised "
            "whole, without the prefix cache",
            setting, tokenizer_file,
        )  # fmt: skip
        model = dataclasses.replace(model, boundaries=None)
    return model


def _why(exc: BaseException) -> str:
    if isinstance(exc, OSError):
        return exc.strerror or str(exc)
    return str(exc)


def _read_config(path: Path | None, setting: str) -> dict[str, Any]:
    if path is None:
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise TokenizerLoadError(
            f"{setting}.tokenizer_config_file: cannot read {path}: {_why(exc)}"
        ) from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TokenizerLoadError(
            f"{setting}.tokenizer_config_file: {path} is not JSON: {exc}"
        ) from None
    if not isinstance(data, dict):
        raise TokenizerLoadError(f"{setting}.tokenizer_config_file: {path} is not a JSON object")
    return data


def _token_text(value: object) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken object."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _special_tokens(config: Mapping[str, Any], files: TokenizerFiles) -> dict[str, str]:
    special = {}
    for name in SPECIAL_TOKEN_NAMES:
        text = _token_text(config.get(name))
        if text is not None:
            special[name] = text
    for name, value in (("bos_token", files.bos_token), ("eos_token", files.eos_token)):
        if value is not None:
            special[name] = value
    return special


def _apply_config(
    tokenizer: tokenizers.Tokenizer, config: Mapping[str, Any], special: Mapping[str, str]
) -> None:
    """What transformers does to the tokenizer.json's tokenizer on loading (TokenizersBackend):
    named special tokens missing from its vocabulary are added; with ``add_bos_token`` or
    ``add_eos_token`` in the config, or no post-processor, the post-processor is rebuilt to add
    exactly those."""
    extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
    named = [*special.values(), *(t for t in map(_token_text, extra) if t is not None)]
    missing = [t for t in named if tokenizer.token_to_id(t) is None]
    if missing:
        tokenizer.add_special_tokens(
            [tokenizers.AddedToken(t, special=True, normalized=False) for t in missing]
        )
    explicit = "add_bos_token" in config or "add_eos_token" in config
    if not explicit and tokenizer.post_processor is not None:
        return
    bos, eos = special.get("bos_token"), special.get("eos_token")
    add_bos = bool(config.get("add_bos_token", False)) and bos is not None
    add_eos = bool(config.get("add_eos_token", False)) and eos is not None
    single = f"{f'{bos}:0 ' if add_bos else ''}$A:0{f' {eos}:0' if add_eos else ''}"
    pair = f"{single}{f' {bos}:1' if add_bos else ''} $B:1{f' {eos}:1' if add_eos else ''}"
    tokens: list[tuple[str, int]] = []
    for text, on in ((bos, add_bos), (eos, add_eos)):
        token_id = tokenizer.token_to_id(text) if on and text is not None else None
        if text is not None and token_id is not None:
            tokens.append((text, token_id))
    tokenizer.post_processor = tokenizers.processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=tokens
    )


def _chat_template(
    paths: TokenizerFiles.Paths, config: Mapping[str, Any], setting: str
) -> tuple[str | None, str]:
    """The chat template's text and where it came from: ``chat_template_file`` (or the model
    directory's ``chat_template.jinja``), else ``tokenizer_config.json``'s ``chat_template``
    (its ``default`` when it names several); None when neither has one."""
    if paths.chat_template_file is not None:
        try:
            return paths.chat_template_file.read_text(encoding="utf-8"), str(
                paths.chat_template_file
            )
        except (OSError, UnicodeDecodeError) as exc:
            raise TokenizerLoadError(
                f"{setting}.chat_template_file: cannot read {paths.chat_template_file}: {_why(exc)}"
            ) from None
    where = f"{paths.tokenizer_config_file} (chat_template)"
    template = config.get("chat_template")
    if template is None:
        return None, ""
    if isinstance(template, list):  # [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
        if template is None:
            raise TokenizerLoadError(
                f"{setting}.tokenizer_config_file: {where} names templates "
                f"{', '.join(map(str, named))} but no 'default' one: set "
                f"{setting}.chat_template_file"
            )
    if not isinstance(template, str):
        raise TokenizerLoadError(f"{setting}.tokenizer_config_file: {where} is not a string")
    return template, where


def _boundary_texts(tokenizer: tokenizers.Tokenizer) -> list[str]:
    """The special tokens that the tokenizer cuts a text at before anything else (not
    normalised, taking no whitespace around them), longest first."""
    return sorted(
        {
            t.content
            for t in tokenizer.get_added_tokens_decoder().values()
            if t.special and not (t.normalized or t.lstrip or t.rstrip or t.single_word)
            and t.content
        },
        key=lambda t: (-len(t), t),
    )  # fmt: skip


def _boundaries(tokenizer: tokenizers.Tokenizer) -> re.Pattern[str] | None:
    texts = _boundary_texts(tokenizer)
    return re.compile("|".join(map(re.escape, texts))) if texts else None


_PROBES: tuple[tuple[dict[str, Any], ...], ...] = (
    (
        {"role": "system", "content": "You are terse.  Réponds en français ✓\n"},
        {"role": "user", "content": " Hello there\n\nWhat's 12345 + 678?"},
        {"role": "assistant", "content": "13023 . "},
        {"role": "user", "content": "\tand 日本語 ?"},
    ),
    (
        {"role": "user", "content": " Hello there\n\nWhat's 12345 + 678?"},
        {"role": "assistant", "content": "13023 . "},
        {"role": "user", "content": "\tand 日本語 ?"},
    ),
    ({"role": "user", "content": "Hello"},),
)


def _probe(model: ModelPrompts) -> str:
    """A conversation rendered with the template: the first of the probes it accepts, or
    ``TokenizerLoadError`` with the template's reason for refusing the simplest."""
    if model.template_source is None:
        return prompt.render_chat(list(_PROBES[0]))
    reason = ""
    for probe in _PROBES:
        try:
            text = model.render_chat(list(probe))
        except TemplateRefused as exc:
            reason = exc.reason
            continue
        model.chat_token_ids(list(probe))
        return text
    raise TokenizerLoadError(
        f"{model.setting}: the chat template in {model.template_origin} does not render a "
        f"one-message conversation: {reason}"
    )


def _splits_cleanly(model: ModelPrompts, text: str) -> bool:
    """Whether the tokens of ``text``, and of samples around each special token, are those of
    their pieces cut before each special token (what the prefix cache relies on)."""
    boundaries = model.boundaries
    assert boundaries is not None
    samples = [text]
    samples += [f"a {t} b\n{t}\n\n c{t} d {t}" for t in _boundary_texts(model.tokenizer)[:16]]
    for sample in samples:
        starts = (m.start() for m in boundaries.finditer(sample))
        edges = [0, *(e for e in starts if e > 0), len(sample)]
        pieces = [sample[a:b] for a, b in itertools.pairwise(edges) if b > a]
        whole = model.plain([sample])[0]
        if whole != [t for ids in model.plain(pieces) for t in ids]:
            return False
    return True
