"""A live local stack per test (real etcd, a real controller, stand-in agents) and ``ctl``:
meridianctl run in a worker thread against it, so the controller keeps serving meanwhile."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import pytest
from click.testing import CliRunner

from meridianctl.cli import cli
from tests.meridianctl.stack import TOKENS, Stack, leading
from tests.support import EtcdServer


@dataclass(frozen=True, slots=True)
class Ran:
    code: int
    out: str
    err: str


Ctl = Callable[..., Awaitable[Ran]]


@pytest.fixture
async def stack(etcd: EtcdServer) -> AsyncIterator[Stack]:
    async with leading(etcd.url) as s:
        yield s


@pytest.fixture
def ctl(stack: Stack) -> Ctl:
    async def run(*args: str, role: str = "operator", input: str | None = None) -> Ran:
        env = {"MERIDIAN_URL": stack.url("ctl-a"), "MERIDIAN_TOKEN": TOKENS.get(role, role),
               "MERIDIANCTL_CONFIG": None}  # fmt: skip

        def invoke() -> Ran:
            result = CliRunner().invoke(cli, list(args), env=env, input=input)
            if result.exception is not None and not isinstance(result.exception, SystemExit):
                raise result.exception
            return Ran(result.exit_code, result.stdout, result.stderr)

        return await asyncio.to_thread(invoke)

    return run
