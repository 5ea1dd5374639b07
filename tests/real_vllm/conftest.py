"""Fixtures for tests against real vLLM on CPU (marker ``real_vllm``; ``make test-real-vllm``).

vllm_install  session   the venv and tiny model from ``make real-vllm``; fails (never skips)
                        with that advice when either is missing
vllm_nodes    session   two vLLM OpenAI servers, started in parallel once for the whole run,
                        each pinned to its own core; stopped with all their children at the end
                        (with ``--enable-log-requests``: vLLM logs each abort there; and
                        ``--trust-request-chat-template``: /tokenize takes a request's template;
                        and KV-cache events on Unix sockets: ``server.kv_events``)
vllm_extra    function  a factory of further servers that a test may kill:
                        ``server = vllm_extra(cpu="1")``; stopped after the test
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support import vllm
from tests.support.vllm import VllmInstall, VllmServer

SESSION_ARGS = ["--enable-log-requests", "--trust-request-chat-template"]


@pytest.fixture(scope="session")
def vllm_install() -> VllmInstall:
    try:
        return vllm.find_install()
    except vllm.VllmMissing as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture(scope="session")
def vllm_nodes(
    vllm_install: VllmInstall, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[VllmServer]]:
    workdir = tmp_path_factory.mktemp("vllm")
    with vllm.serve(
        vllm_install, workdir=workdir, cpus=["0", "1"], extra_args=SESSION_ARGS, kv_events=True
    ) as servers:
        yield servers


@pytest.fixture
def vllm_extra(vllm_install: VllmInstall, tmp_path: Path) -> Iterator[Callable[..., VllmServer]]:
    with contextlib.ExitStack() as stack:
        count = 0

        def start(*, cpu: str = "0") -> VllmServer:
            nonlocal count
            count += 1
            workdir = tmp_path / f"extra{count}"
            (server,) = stack.enter_context(vllm.serve(vllm_install, workdir=workdir, cpus=[cpu]))
            return server

        yield start
