"""The peer routers the benchmarks compare Meridian with: install, start, stop, their policies.

vllm-router 0.1.17, sglang-router 0.3.2 and smg 1.13.0 are Rust routers shipped as Python
wheels on PyPI.  Each is installed into its own virtual environment, outside the project's, under
``~/.cache/meridian/peers/<name>`` (override with ``--root`` or ``MERIDIAN_PEERS_DIR``), so their
dependencies never touch ``.venv``.  Installing is idempotent: a venv that already holds the
pinned version is left alone.

    python benchmarks/_peers.py install [NAME ...] [--root DIR]   # all three by default
    python benchmarks/_peers.py policies                           # what each one offers
    python benchmarks/_peers.py command NAME --worker URL ... [--policy P] [--port N]

A benchmark starts one with :func:`start`, which returns once the router's ``GET /health``
answers 200, and stops it with :meth:`RunningPeer.stop`.  Every router runs at log level
``warning``: sglang-router and smg log two lines per request at their default level, which costs
them 15-26 % of their throughput (measured on the development machine; docs/benchmarks.md,
"The peer routers"), and Meridian's agent runs at
``WARNING`` in the benchmarks too.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

DEFAULT_ROOT = Path.home() / ".cache" / "meridian" / "peers"
PYPI_URL = "https://pypi.org/simple/"


@dataclass(frozen=True, slots=True, kw_only=True)
class Peer:
    """One router distribution: how to install it and how to start it."""

    name: str
    version: str
    executable: str  # the console script in the venv's bin/
    subcommand: tuple[str, ...]  # ("launch",) for sglang-router and smg
    # the router's --help lists these; left out: policies that need request headers (manual,
    # passthrough) or KV events from the engine (vllm-router's kv_aware)
    policies: tuple[str, ...]
    default_policy: str
    log_level: str = "warn"  # the quietest level that still shows warnings
    extra_args: tuple[str, ...] = ()
    health_path: str = "/health"

    @property
    def requirement(self) -> str:
        return f"{self.name}=={self.version}"


PEERS: dict[str, Peer] = {
    p.name: p
    for p in (
        Peer(
            name="vllm-router",
            version="0.1.17",
            executable="vllm-router",
            subcommand=(),
            policies=(
                "cache_aware",
                "round_robin",
                "random",
                "power_of_two",
                "consistent_hash",
                "sticky_least_loaded",
            ),
            default_policy="cache_aware",
            log_level="warning",
            extra_args=("--worker-startup-check-interval", "1"),
        ),
        Peer(
            name="sglang-router",
            version="0.3.2",
            executable="sglang-router",
            subcommand=("launch",),
            policies=("cache_aware", "round_robin", "random", "power_of_two"),
            default_policy="cache_aware",
        ),
        Peer(
            name="smg",
            version="1.13.0",
            executable="smg",
            subcommand=("launch",),
            policies=(
                "cache_aware",
                "round_robin",
                "random",
                "power_of_two",
                "least_load",
                "prefix_hash",
                "consistent_hashing",
            ),
            default_policy="cache_aware",
            extra_args=("--backend", "vllm"),
        ),
    )
}


class PeerError(RuntimeError):
    """A peer that cannot be installed or started; the message says what to do."""


def root_dir(root: Path | str | None = None) -> Path:
    if root is not None:
        return Path(root).expanduser()
    env = os.environ.get("MERIDIAN_PEERS_DIR")
    return Path(env).expanduser() if env else DEFAULT_ROOT


def venv_dir(peer: Peer, root: Path | str | None = None) -> Path:
    return root_dir(root) / peer.name


def executable(peer: Peer, root: Path | str | None = None) -> Path:
    return venv_dir(peer, root) / "bin" / peer.executable


def installed_version(peer: Peer, root: Path | str | None = None) -> str | None:
    """The version installed in the peer's venv, or None (no venv, or not installed)."""
    python = venv_dir(peer, root) / "bin" / "python"
    if not python.exists() or not executable(peer, root).exists():
        return None
    out = subprocess.run(
        [str(python), "-c", f"import importlib.metadata as m; print(m.version({peer.name!r}))"],
        capture_output=True,
        text=True,
        check=False,
    )
    return out.stdout.strip() or None if out.returncode == 0 else None


def pypi_reachable(timeout_s: float = 10.0) -> bool:
    """Whether the package index answers; pip honours PIP_INDEX_URL, so this does too."""
    url = os.environ.get("PIP_INDEX_URL", PYPI_URL)
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return bool(200 <= resp.status < 400)
    except (urllib.error.URLError, OSError):
        return False


def install(peer: Peer, *, root: Path | str | None = None, progress: IO[str] = sys.stderr) -> Path:
    """Install ``peer`` at its pinned version into its own venv; return the executable.

    Idempotent: a venv that already has the version is left as it is."""
    exe = executable(peer, root)
    have = installed_version(peer, root)
    if have == peer.version:
        print(
            f"peers: {peer.requirement} already installed in {venv_dir(peer, root)}", file=progress
        )
        return exe
    venv = venv_dir(peer, root)
    venv.parent.mkdir(parents=True, exist_ok=True)
    if not (venv / "bin" / "python").exists():
        print(f"peers: creating venv {venv}", file=progress, flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    if not pypi_reachable():
        raise PeerError(
            f"cannot reach the package index ({os.environ.get('PIP_INDEX_URL', PYPI_URL)}) to "
            f"install {peer.requirement}; connect to the network, or point PIP_INDEX_URL at a "
            f"mirror, and run `python benchmarks/_peers.py install {peer.name}` again"
        )
    print(
        f"peers: installing {peer.requirement} into {venv} (was {have or 'absent'})...",
        file=progress,
        flush=True,
    )
    log_path = venv / "install.log"
    started = time.monotonic()
    with log_path.open("w") as log:
        proc = subprocess.run(
            [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", peer.requirement],
            stdout=log,
            stderr=subprocess.STDOUT,
            check=False,
        )
    if proc.returncode != 0 or installed_version(peer, root) != peer.version:
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-15:])
        raise PeerError(f"pip could not install {peer.requirement} (log {log_path}):\n{tail}")
    print(
        f"peers: {peer.requirement} installed in {time.monotonic() - started:.0f} s",
        file=progress,
        flush=True,
    )
    return exe


def command(
    peer: Peer,
    *,
    worker_urls: Sequence[str],
    policy: str,
    port: int,
    prometheus_port: int,
    host: str = "127.0.0.1",
    root: Path | str | None = None,
) -> list[str]:
    """The argv that starts ``peer`` in front of ``worker_urls`` with ``policy``."""
    if policy not in peer.policies:
        raise ValueError(f"{peer.name} has no policy {policy!r}; it has {', '.join(peer.policies)}")
    if not worker_urls:
        raise ValueError("a router needs at least one worker URL")
    return [
        str(executable(peer, root)),
        *peer.subcommand,
        "--host",
        host,
        "--port",
        str(port),
        "--worker-urls",
        *worker_urls,
        "--policy",
        policy,
        "--prometheus-host",
        host,
        "--prometheus-port",
        str(prometheus_port),
        "--log-level",
        peer.log_level,
        *peer.extra_args,
    ]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(slots=True)
class RunningPeer:
    peer: Peer
    policy: str
    url: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def log_tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5.0)


def wait_healthy(url: str, *, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise PeerError(f"exited with status {proc.returncode} before {url} was healthy")
        try:
            with urllib.request.urlopen(url, timeout=1.0) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    raise PeerError(f"{url} not healthy within {timeout_s:g} s")


def start(
    peer: Peer,
    *,
    worker_urls: Sequence[str],
    policy: str,
    logdir: Path,
    root: Path | str | None = None,
    cpu: int | None = None,
    timeout_s: float = 60.0,
) -> RunningPeer:
    """Start ``peer`` on a free loopback port; return once ``GET /health`` answers 200.

    ``cpu`` pins the router to that core with ``taskset`` (when the machine has it)."""
    exe = executable(peer, root)
    if not exe.exists():
        raise PeerError(
            f"{peer.name} is not installed ({exe} missing); run "
            f"`python benchmarks/_peers.py install {peer.name}`"
        )
    port = free_port()
    argv = command(
        peer,
        worker_urls=worker_urls,
        policy=policy,
        port=port,
        prometheus_port=free_port(),
        root=root,
    )
    if cpu is not None and shutil.which("taskset"):
        argv = ["taskset", "-c", str(cpu), *argv]
    log_path = logdir / f"{peer.name}-{policy}.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    running = RunningPeer(
        peer=peer, policy=policy, url=f"http://127.0.0.1:{port}", proc=proc, log_path=log_path
    )
    try:
        wait_healthy(running.url + peer.health_path, proc=proc, timeout_s=timeout_s)
    except PeerError as exc:
        running.stop()
        raise PeerError(f"{peer.name} ({policy}): {exc}\n{running.log_tail()}") from None
    return running


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Install and run the peer routers.")
    parser.add_argument("--root", help=f"where the venvs live (default {DEFAULT_ROOT})")
    sub = parser.add_subparsers(dest="cmd", required=True)
    inst = sub.add_parser("install", help="install peers into their own venvs (idempotent)")
    inst.add_argument("names", nargs="*", choices=[*PEERS, []], help="default: all")
    sub.add_parser("policies", help="list each peer's policies")
    cmd = sub.add_parser("command", help="print the command line that starts a peer")
    cmd.add_argument("name", choices=list(PEERS))
    cmd.add_argument("--worker", action="append", required=True)
    cmd.add_argument("--policy", default="cache_aware")
    cmd.add_argument("--port", type=int, default=30000)
    cmd.add_argument("--prometheus-port", type=int, default=30001)
    args = parser.parse_args(argv)
    if args.cmd == "install":
        try:
            for name in args.names or list(PEERS):
                install(PEERS[name], root=args.root)
        except PeerError as exc:
            print(f"peers: {exc}", file=sys.stderr)
            return 1
    elif args.cmd == "policies":
        for peer in PEERS.values():
            print(f"{peer.requirement:22} {', '.join(peer.policies)}")
    else:
        peer = PEERS[args.name]
        print(
            " ".join(
                command(
                    peer,
                    worker_urls=args.worker,
                    policy=args.policy,
                    port=args.port,
                    prometheus_port=args.prometheus_port,
                    root=args.root,
                )
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
