"""Run a server binary as a child process in its own process group, with its output in a file.

`stop()` ends the whole group (the server and anything it spawned): SIGTERM, then SIGKILL
after a grace period. Output goes to a log file, not a pipe, so a chatty server never
blocks on a full pipe and the log is still there to show when it fails to start.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Protocol, TypeVar

# Debian puts named in /usr/sbin, which is not on a normal user's PATH.
_EXTRA_PATH = ("/usr/sbin", "/sbin", "/usr/local/sbin")

# What etcd (Go) and named 9.18 log when a port they were told to listen on is taken.
_PORT_TAKEN_MARKERS = (
    "address already in use",
    "address in use",
    "unable to listen on any configured interfaces",
)


class ServerStartError(RuntimeError):
    """A test server did not become ready; the message carries the tail of its log."""


class PortTaken(ServerStartError):
    """The server could not bind a port we probed as free; starting again with new ports helps."""


def find_binary(name: str) -> str:
    """Return the path of `name` from PATH or the sbin directories, or fail with a hint."""
    search = os.pathsep.join([os.environ.get("PATH", ""), *_EXTRA_PATH])
    found = shutil.which(name, path=search)
    if found is None:
        raise ServerStartError(f"{name!r} not found on PATH or in sbin; run `make setup`")
    return found


class ServerProcess:
    """One running server process; `log_path` holds its stdout and stderr."""

    def __init__(
        self,
        argv: Sequence[str],
        *,
        log_path: Path,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.argv = list(argv)
        self.log_path = log_path
        with log_path.open("wb") as log:
            self._popen = subprocess.Popen(
                [*_die_with_parent(), *self.argv],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=None if env is None else dict(env),
                start_new_session=True,
            )

    @property
    def pid(self) -> int:
        return self._popen.pid

    def exit_code(self) -> int | None:
        """The exit status if the process has ended, else None."""
        return self._popen.poll()

    def log_tail(self, max_chars: int = 4000) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError as exc:
            return f"<log unreadable: {exc}>"
        return text[-max_chars:]

    def port_taken(self) -> bool:
        """Whether the log says a listening port was already in use."""
        log = self.log_tail().lower()
        return any(marker in log for marker in _PORT_TAKEN_MARKERS)

    def failure(self, what: str) -> ServerStartError:
        """An error for a failed start, with the exit status and the log tail."""
        status = self.exit_code()
        state = "still running" if status is None else f"exited with status {status}"
        error = PortTaken if self.port_taken() else ServerStartError
        return error(
            f"{what} ({state}); command: {' '.join(self.argv)}\n"
            f"--- {self.log_path} ---\n{self.log_tail()}"
        )

    def stop(self, grace_s: float = 5.0) -> None:
        """Stop the process group: SIGTERM, then SIGKILL after `grace_s`. Idempotent."""
        if self._popen.poll() is None:
            self._signal_group(signal.SIGTERM)
            self._signal_group(signal.SIGCONT)  # a frozen group (`freeze`) acts on it only then
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._popen.wait(timeout=grace_s)
        # Children may outlive the leader; the group id is the leader's pid.
        self._signal_group(signal.SIGKILL)
        self._popen.wait()

    def kill(self) -> None:
        """SIGKILL the whole process group at once, as a crash would. Idempotent."""
        self._signal_group(signal.SIGKILL)
        self._popen.wait()

    def freeze(self) -> None:
        """SIGSTOP the whole process group: it runs no instruction until `thaw` (or a kill)."""
        self._signal_group(signal.SIGSTOP)

    def thaw(self) -> None:
        self._signal_group(signal.SIGCONT)

    def _signal_group(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._popen.pid, sig)


def _die_with_parent() -> list[str]:
    """A prefix that kills the server if the test process dies without stopping it.

    `setpriv --pdeathsig` (util-linux, essential on Debian) sets the parent-death signal and
    execs the server in place, so the pid and process group stay the server's own.
    """
    setpriv = shutil.which("setpriv")
    return [] if setpriv is None else [setpriv, "--pdeathsig", "KILL", "--"]


class _Server(Protocol):
    @property
    def process(self) -> ServerProcess: ...


S = TypeVar("S", bound=_Server)


@contextlib.contextmanager
def serve(
    launch: Callable[[], S], wait_ready: Callable[[S], None], *, attempts: int = 3
) -> Iterator[S]:
    """Launch a server, wait until it is ready, yield it, and stop it on exit.

    A start that fails because a port was taken is retried with a fresh `launch()`, which
    picks new ports. Any other failure, in start or in the body, stops the server first.
    """
    for attempt in range(attempts):
        server = launch()
        try:
            wait_ready(server)
        except PortTaken:
            server.process.stop()
            if attempt + 1 == attempts:
                raise
            continue
        except BaseException:
            server.process.stop()
            raise
        try:
            yield server
        finally:
            server.process.stop()
        return


def in_child(work: Callable[[], None]) -> None:
    """``work()`` in a forked process, which must exit 0 (a sibling worker sharing memory made
    before the fork)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            work()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
