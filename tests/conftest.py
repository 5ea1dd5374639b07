"""Shared fixtures: real etcd, BIND9 and simulated vLLM nodes on loopback (tests/support/).

etcd_server  session   one etcd for the whole run
etcd         function  that etcd with an empty keyspace (every key deleted before the test)
fresh_etcd   function  an etcd of the test's own, for tests that stop it or need revision 1
bind_server  session   one named for the whole run; tests must use names of their own
bind         function  a named of the test's own, zones as loaded (SOA, NS, ns1 A)
sim_node     function  a factory of in-process meridian-sim nodes: url = await sim_node(...)
start_agent  function  a factory of in-process agents: handle = await start_agent(urls, ...)
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import hypothesis
import pytest

from meridian_sim import node, profile
from tests.support import BindServer, EtcdServer, start_bind, start_etcd
from tests.support.agent import AgentFactory, AgentStarter
from tests.support.watchdog import pytest_runtest_call  # noqa: F401  (a hook: stacks before a timeout)

# CI draws the same examples every run (a failure there is reproducible, and a submission does
# not land or fail on a lucky draw); every other run draws new ones and finds what CI would not.
hypothesis.settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    hypothesis.settings.load_profile("ci")

_LOOPBACK = ("127.0.0.1", "localhost")
NodeFactory = Callable[..., Awaitable[str]]


@pytest.fixture(scope="session", autouse=True)
def _loopback_bypasses_proxy() -> Iterator[None]:
    """Keep test clients (grpc, urllib, aiohttp and httpx with trust_env) off any HTTP proxy
    the environment names: every test server is on loopback."""
    with pytest.MonkeyPatch.context() as patch:
        for var in ("no_proxy", "NO_PROXY"):
            listed = [h for h in os.environ.get(var, "").split(",") if h]
            patch.setenv(var, ",".join([*listed, *_LOOPBACK]))
        yield


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    with start_etcd(tmp_path_factory.mktemp("etcd")) as server:
        yield server


@pytest.fixture
def etcd(etcd_server: EtcdServer) -> EtcdServer:
    etcd_server.wipe()
    return etcd_server


@pytest.fixture
def fresh_etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    with start_etcd(tmp_path) as server:
        yield server


@pytest.fixture(scope="session")
def bind_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BindServer]:
    with start_bind(tmp_path_factory.mktemp("bind")) as server:
        yield server


@pytest.fixture
def bind(tmp_path: Path) -> Iterator[BindServer]:
    with start_bind(tmp_path) as server:
        yield server


@pytest.fixture
async def sim_node() -> AsyncIterator[NodeFactory]:
    """Start simulated nodes in this event loop: ``url = await sim_node(profile="cpu-tiny")``."""
    runners = []

    async def start(
        *,
        profile_name: str = "cpu-tiny",
        time_scale: float = 20.0,
        seed: int = 0,
        legacy_metrics: bool = False,
        model: str | None = None,
    ) -> str:
        prof = profile.load(profile_name)
        config = node.NodeConfig(
            profile=prof,
            model=model or prof.model,
            time_scale=time_scale,
            seed=seed,
            legacy_metrics=legacy_metrics,
        )
        runner, port = await node.start(node.create_app(config))
        runners.append(runner)
        return f"http://127.0.0.1:{port}"

    yield start
    for runner in runners:
        await runner.cleanup()


@pytest.fixture
async def start_agent() -> AsyncIterator[AgentFactory]:
    """``handle = await start_agent(node_urls, policy="prefix_aware", queue={...})``."""
    starter = AgentStarter()
    yield starter
    await starter.close()
