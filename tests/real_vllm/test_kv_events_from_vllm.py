"""The precise index against real vLLM 0.32 with KV-cache events on (the session nodes publish
on Unix sockets, tests/real_vllm/conftest.py).

The test keeps its own account of what vLLM reported: a subscriber of its own that replays the
engine's buffer from the start and follows the stream, decoding with msgspec alone (not with
the agent's code).  Against it: the agent's index holds exactly those blocks; the agent's own
block keys for a chat prompt (the model's tokenizer and template) are those of vLLM's blocks;
a prefix vLLM evicts leaves the index within a second; and the agent routes a prompt to the
engine that holds it, where vLLM counts the prefix-cache hit.
"""

from __future__ import annotations

import asyncio

import aiohttp
import msgspec
import pytest
import zmq
import zmq.asyncio

from policies import prompt
from policies.model import NodeId
from regional_agent import prompts
from regional_agent.app import KV_EVENTS
from regional_agent.prompts import ChatOptions
from regional_agent.settings import TokenizerSettings
from tests.support.agent import AgentFactory, AgentHandle
from tests.support.agent import metric as _metric
from tests.support.vllm import BLOCK_SIZE, MODEL_NAME, NUM_BLOCKS, VllmInstall, VllmServer
from tests.support.waits import until

pytestmark = [pytest.mark.real_vllm, pytest.mark.timeout(900)]


class _Account:
    """What one vLLM engine reported holding: its own block hashes, from its replay buffer and
    then its stream (the test's reading, independent of the agent's)."""

    def __init__(self, server: VllmServer) -> None:
        assert server.kv_events is not None and server.kv_replay is not None
        self.ctx = zmq.asyncio.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(server.kv_events)
        self.replay = server.kv_replay
        self.held: set[bytes | int] = set()
        self.last = -1
        self._task: asyncio.Task[None] | None = None

    def _apply(self, seq: int, payload: bytes) -> None:
        if seq <= self.last:
            return
        assert seq == self.last + 1, f"the test's own subscriber lost batches {self.last}..{seq}"
        self.last = seq
        _ts, events, *_ = msgspec.msgpack.decode(payload)
        for event in events:
            kind = event["type"]
            if kind == "BlockStored" and event["medium"] in (None, "GPU"):
                self.held.update(event["block_hashes"])
            elif kind == "BlockRemoved" and event["medium"] in (None, "GPU"):
                self.held.difference_update(event["block_hashes"])
            elif kind == "AllBlocksCleared":
                self.held.clear()

    async def start(self) -> None:
        await asyncio.sleep(0.3)  # the subscription reaches the publisher first
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.connect(self.replay)
        await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        while True:
            _, _topic, seq, payload = await asyncio.wait_for(dealer.recv_multipart(), 10)
            if int.from_bytes(seq, "big", signed=True) < 0:
                break
            self._apply(int.from_bytes(seq, "big"), payload)
        dealer.close(linger=0)
        self._task = asyncio.create_task(self._follow())

    async def _follow(self) -> None:
        while True:
            _topic, seq, payload = await self.sub.recv_multipart()
            self._apply(int.from_bytes(seq, "big"), payload)

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self.sub.close(linger=0)
        self.ctx.term()


def _node_id(server: VllmServer) -> NodeId:
    return NodeId(server.url.removeprefix("http://"))


async def _agent(
    start_agent: AgentFactory, install: VllmInstall, nodes: list[VllmServer]
) -> AgentHandle:
    handle = await start_agent(
        [],
        policy="meridian",
        nodes=[
            {
                "url": n.url,
                "kv_events_endpoint": n.kv_events,
                "kv_events_replay_endpoint": n.kv_replay,
            }
            for n in nodes
        ],
        tokenizer={"model_dir": str(install.model_dir)},
        routing={"prefix_block_tokens": BLOCK_SIZE},
        kv_events={"retry_interval_s": 1.0, "replay_timeout_s": 5.0},
        # probes that a busy CPU engine answers in time (tests/real_vllm/test_agent_with_vllm.py)
        health={"probe_interval_s": 1.0, "probe_timeout_s": 10.0},
        telemetry={"scrape_interval_s": 1.0, "scrape_timeout_s": 10.0},
    )
    index = handle.app[KV_EVENTS].index
    await until(lambda: all(index.is_precise(_node_id(n)) for n in nodes), 30, "both nodes in sync")
    return handle


def _own(install: VllmInstall) -> prompts.ModelPrompts:
    own = prompts.load(TokenizerSettings(model_dir=install.model_dir)).for_model(MODEL_NAME)
    assert own is not None
    return own


def _messages(install: VllmInstall, seed: int) -> list[dict[str, str]]:
    """A chat prompt of 300-400 tokens (the model's own tokenizer): two full 128-token blocks
    and part of a third, so a prompt takes three of the engine's 16 blocks."""
    own = _own(install)
    words: list[str] = []
    while True:
        words.append(f"topic{seed} item{len(words)}")
        messages = [{"role": "user", "content": " ".join(words)}]
        if len(own.chat_token_ids(messages, ChatOptions.from_body({}))) >= 300:
            return messages


async def _chat(url: str, messages: list[dict[str, str]]) -> None:
    body = {"model": MODEL_NAME, "messages": messages, "max_tokens": 2}
    async with aiohttp.ClientSession() as s, s.post(f"{url}/v1/chat/completions", json=body) as r:
        assert r.status == 200, await r.text()


async def _routed(agent: AgentHandle, messages: list[dict[str, str]]) -> NodeId:
    before = {n.node_id: n.requests_total for n in agent.edge.pool}
    await _chat(agent.url, messages)
    moved = [n.node_id for n in agent.edge.pool if n.requests_total != before.get(n.node_id)]
    assert len(moved) == 1, moved
    return moved[0]


def _keys(install: VllmInstall, messages: list[dict[str, str]]) -> tuple[int, ...]:
    """The agent's block hashes of a chat prompt, with the model's own tokenizer and template."""
    ids = _own(install).chat_token_ids(messages, ChatOptions.from_body({}))
    return prompt.block_hashes(ids, block_size=BLOCK_SIZE)


async def test_the_index_is_what_vllm_reports_and_the_agents_keys_are_vllms_blocks(
    vllm_nodes: list[VllmServer], vllm_install: VllmInstall, start_agent: AgentFactory
) -> None:
    accounts = [_Account(n) for n in vllm_nodes]
    try:
        for account in accounts:
            await account.start()
        agent = await _agent(start_agent, vllm_install, vllm_nodes)
        index = agent.app[KV_EVENTS].index
        messages = _messages(vllm_install, 1)
        keys = _keys(vllm_install, messages)
        assert len(keys) >= 2
        went = await _routed(agent, messages)
        # the prompt's BlockStored events travel apart from its answer and may come after it:
        # until they are in, the index and the test's subscriber agree on the state before
        await until(
            lambda: index.match(keys) == {went: len(keys)},
            10.0,
            "the agent's keys to find vLLM's blocks",
        )
        for server, account in zip(vllm_nodes, accounts, strict=True):
            node = _node_id(server)
            await until(
                lambda node=node, account=account: index.engine_hashes(node) == account.held,
                10.0,
                f"{node}: the index holds what vLLM reported",
            )
        assert set(keys) <= index.keys(went)
    finally:
        for account in accounts:
            account.close()


async def test_a_prefix_vllm_evicts_leaves_the_index(
    vllm_nodes: list[VllmServer], vllm_install: VllmInstall, start_agent: AgentFactory
) -> None:
    server = vllm_nodes[0]
    account = _Account(server)
    try:
        await account.start()
        agent = await _agent(start_agent, vllm_install, [server])
        index = agent.app[KV_EVENTS].index
        node = _node_id(server)
        first = _messages(vllm_install, 2)
        keys = _keys(vllm_install, first)
        await _chat(agent.url, first)
        await until(
            lambda: index.match(keys) == {node: len(keys)}, 10.0, "the first prompt indexed"
        )
        held = {h for h in index.engine_hashes(node) if index.key_of(node, h) in set(keys)}
        for seed in range(3, 3 + NUM_BLOCKS):  # about three blocks each: the cache turns over
            await _chat(server.url, _messages(vllm_install, seed))
            if not held & account.held:
                break
        assert not held & account.held, "vLLM kept the first prompt's blocks"
        await until(lambda: not held & index.engine_hashes(node), 1.0, "the evicted blocks gone")
        assert index.match(keys).get(node, 0) < len(keys)
        # the agent and the test's own subscriber take the same events at their own pace (a CI
        # run compared them while the last prompt's events were still on the way): the index
        # must come to hold what vLLM holds
        await until(
            lambda: index.engine_hashes(node) == account.held, 10.0, "the index to hold vLLM's"
        )
    finally:
        account.close()


async def test_routing_follows_vllms_own_prefix_cache_hits(
    vllm_nodes: list[VllmServer], vllm_install: VllmInstall, start_agent: AgentFactory
) -> None:
    """Prompts sent straight to one engine or the other: the agent sends each one's repeat to
    the engine that holds it (all four by chance: one run in 16), and that engine's own
    prefix-cache counters count the hit."""
    agent = await _agent(start_agent, vllm_install, vllm_nodes)
    index = agent.app[KV_EVENTS].index
    for turn in range(4):
        server = vllm_nodes[turn % 2]
        messages = _messages(vllm_install, 100 + turn)
        keys = _keys(vllm_install, messages)
        await _chat(server.url, messages)  # behind the agent's back
        await until(
            lambda keys=keys, server=server: (
                index.match(keys).get(_node_id(server), 0) == len(keys)
            ),
            10.0,
            "the engine's blocks indexed",
        )
        hits_before = await _metric(server.url, "vllm:prefix_cache_hits_total")
        went = await _routed(agent, messages)
        assert went == _node_id(server), f"turn {turn}: {went}, not {server.url}"
        hits = await _metric(server.url, "vllm:prefix_cache_hits_total") - hits_before
        assert hits >= len(keys) * BLOCK_SIZE, f"turn {turn}: vLLM counted {hits} cached tokens"
