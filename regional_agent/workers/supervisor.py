"""The supervisor of ``meridian-agent`` with ``workers.count`` above 1: it reserves the port,
makes the shared load table and a private directory, forks the workers and keeps them running.

- **The port.**  The supervisor binds a socket with SO_REUSEPORT and never listens on it: that
  fixes the port (``--port 0`` picks one) and keeps it while workers come and go.  Each worker
  binds its own SO_REUSEPORT socket on it and listens, and the kernel spreads new connections
  over the listening sockets by a hash of their addresses (a shared, inherited socket would
  leave it to whichever worker wakes first, which under keep-alive loads one worker).
- **READY.**  Each worker says on a pipe when it listens; the supervisor prints
  ``READY http(s)://host:port`` once all have.
- **Signals.**  SIGTERM and SIGINT go to every worker as SIGTERM (each drains as a single agent
  does); a second one kills them.  SIGHUP goes to every worker (API keys, TLS certificates).
- **A worker that dies** (kill -9, a crash) is started again, after 1 s and up to 30 s when it
  keeps dying at once; what it had in flight is zeroed in the load table first.  It starts from
  the settings and then takes the admin changes made since from a sibling
  (``workers.runtime``).  A worker that fails before the first READY (its bind, its app) stops
  the start: exit status 1.
- **The supervisor dying** ends the workers too (``PR_SET_PDEATHSIG``), so none keeps the port.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from regional_agent.workers.runtime import Worker
from regional_agent.workers.shared import LoadTable
from regional_agent.workers.siblings import PrefixRings

log = logging.getLogger("meridian.agent.workers")

_SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD}
_RESTART_BASE_S = 1.0
_RESTART_MAX_S = 30.0
_STEADY_S = 10.0  # a worker that lived this long died of something other than its start


@dataclass(slots=True)
class _Child:
    index: int
    started: float
    ready: bool = False
    restarts: int = 0


def reserve(host: str, port: int) -> socket.socket:
    """A SO_REUSEPORT socket bound to ``host:port``, not listening (module docstring).  Raises
    ``OSError`` when the address cannot be had."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


def run(
    *,
    count: int,
    host: str,
    port: int,
    table_slots: int,
    scheme: str,
    start_worker: Callable[[Worker, int], int],
) -> int:
    """Run ``count`` workers, each ``start_worker(worker, port)`` in a forked process, until
    SIGTERM or SIGINT; returns the exit status.  Raises ``OSError`` when the port cannot be
    reserved."""
    reserved = reserve(host, port)
    try:
        supervisor = _Supervisor(
            count=count,
            port=reserved.getsockname()[1],
            table=LoadTable(workers=count, slots=table_slots),
            rings=PrefixRings(workers=count),
            start_worker=start_worker,
            reserved=reserved,
        )
        return supervisor.run(ready_line=f"READY {scheme}://{host}:{{port}}")
    finally:
        reserved.close()


class _Supervisor:
    def __init__(
        self,
        *,
        count: int,
        port: int,
        table: LoadTable,
        rings: PrefixRings,
        start_worker: Callable[[Worker, int], int],
        reserved: socket.socket,
    ) -> None:
        self.count = count
        self.port = port
        self.table = table
        self.rings = rings
        self.start_worker = start_worker
        self.reserved = reserved  # the port's socket; the children close their copy
        self.directory = Path(tempfile.mkdtemp(prefix="meridian-agent-"))  # mode 0700
        self.children: dict[int, _Child] = {}  # pid -> child
        self.waiting: dict[int, tuple[float, int]] = {}  # index -> (start again at, restarts)
        self.ready_r, self.ready_w = os.pipe()
        os.set_blocking(self.ready_r, False)
        self.announced = False
        self.stopping = False
        self.status = 0
        self.secret = secrets.token_urlsafe(32)  # sibling to sibling (workers.runtime)
        self.started: set[int] = set()  # worker indexes started at least once

    def run(self, *, ready_line: str) -> int:
        signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)
        try:
            for index in range(self.count):
                self.spawn(index, restarts=0)
            while self.children or (self.waiting and not self.stopping):
                self.step(ready_line)
            return self.status
        finally:
            _signal_all(self.children, signal.SIGKILL)
            for pid in list(self.children):
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, 0)
            os.close(self.ready_r)
            os.close(self.ready_w)
            shutil.rmtree(self.directory, ignore_errors=True)
            while signal.sigtimedwait(_SIGNALS, 0) is not None:
                pass  # a SIGTERM after the last worker ended is done with: do not die of it
            signal.pthread_sigmask(signal.SIG_UNBLOCK, _SIGNALS)

    def step(self, ready_line: str) -> None:
        got = signal.sigtimedwait(_SIGNALS, 0.1)
        if got is not None and got.si_signo in (signal.SIGTERM, signal.SIGINT):
            self.stop(signal.SIGKILL if self.stopping else signal.SIGTERM)
        elif got is not None and got.si_signo == signal.SIGHUP:
            _signal_all(self.children, signal.SIGHUP)
        for index in _read_ready(self.ready_r):
            for child in self.children.values():
                if child.index == index:
                    child.ready = True
        if (
            not self.announced
            and len(self.children) == self.count
            and all(c.ready for c in self.children.values())
        ):
            self.announced = True
            log.info("meridian-agent workers ready workers=%d port=%d", self.count, self.port)
            print(ready_line.format(port=self.port), flush=True)
        for pid, status in _reap():
            self.exited(self.children.pop(pid), status)
        now = time.monotonic()
        for index, (when, restarts) in list(self.waiting.items()):
            if now >= when:
                del self.waiting[index]
                self.spawn(index, restarts=restarts)

    def stop(self, how: signal.Signals) -> None:
        self.stopping = True
        self.waiting.clear()
        log.info("stopping workers=%d signal=%s", len(self.children), how.name)
        _signal_all(self.children, how)

    def exited(self, child: _Child, status: int) -> None:
        if self.stopping:
            return
        how = _how(status)
        if not self.announced:
            log.error("worker %d %s before it was ready: stopping", child.index, how)
            self.status = 1
            self.stop(signal.SIGTERM)
            return
        self.table.clear_worker(child.index)
        self.table.count_exit(child.index, signaled=os.WIFSIGNALED(status))
        quick = time.monotonic() - child.started < _STEADY_S
        restarts = child.restarts + 1 if quick else 0
        delay = min(_RESTART_MAX_S, _RESTART_BASE_S * 2 ** max(0, restarts - 1))
        log.warning(
            "worker %d %s: its in-flight counts are cleared and it starts again in %g s",
            child.index,
            how,
            delay,
        )
        self.waiting[child.index] = (time.monotonic() + delay, restarts)

    def spawn(self, index: int, *, restarts: int) -> None:
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:
            self._child(index, parent)  # never returns
        self.children[pid] = _Child(index=index, started=time.monotonic(), restarts=restarts)
        self.started.add(index)

    def _child(self, index: int, parent: int) -> None:
        code = 1
        try:
            os.close(self.ready_r)
            self.reserved.close()
            signal.signal(signal.SIGINT, signal.default_int_handler)
            for sig in (signal.SIGTERM, signal.SIGCHLD):
                signal.signal(sig, signal.SIG_DFL)
            signal.signal(signal.SIGHUP, signal.SIG_IGN)  # until the worker's own handler is in
            signal.pthread_sigmask(signal.SIG_SETMASK, set())
            _die_with_parent(parent)
            worker = Worker(
                index=index,
                count=self.count,
                directory=self.directory,
                table=self.table,
                rings=self.rings,
                secret=self.secret,
                restarted=index in self.started,
                ready_fd=self.ready_w,
            )
            code = self.start_worker(worker, self.port)
        except BaseException:  # the child never returns into the supervisor's loop
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)


def _signal_all(children: dict[int, _Child], sig: signal.Signals) -> None:
    for pid in children:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _read_ready(fd: int) -> bytes:
    try:
        return os.read(fd, 256)
    except BlockingIOError:
        return b""


def _reap() -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return out
        if pid == 0:
            return out
        out.append((pid, status))


def _how(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"was killed by {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exited with status {os.waitstatus_to_exitcode(status)}"


def _die_with_parent(parent: int) -> None:
    """Ask the kernel for SIGTERM when the supervisor dies (Linux); exit if it already has."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        if libc.prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    if os.getppid() != parent:
        os._exit(1)


__all__ = ["reserve", "run"]
