"""Nodes that cost almost nothing: one nginx answering as several vLLM servers with fixed bodies.

A throughput benchmark of the agent wants backends that leave the cores to it.  The simulated
node (``meridian-sim node``) is Python and costs about as much per request as the agent itself;
nginx answers the same request for 14-20 µs of CPU (measured on the development machine,
docs/benchmarks.md, "Workers").  Each node is a ``server`` block on its own loopback port of
one nginx process (one worker process, pinned where the caller says), answering:

- ``GET /health``: 200, empty;
- ``GET /v1/models``: the one model, :data:`MODEL`;
- ``GET /metrics``: a real vLLM 0.32.0 ``/metrics`` page (``tests/fixtures/vllm``, idle), so
  the agent parses what it parses in production on every scrape;
- ``POST /v1/chat/completions``: one fixed ``chat.completion`` (2 tokens), whatever was asked;
- anything else: 404.

Each node logs the ``X-Request-ID`` of every request it answered, one per line, to
``node<i>.log`` in the run directory (buffered; :meth:`StaticNodes.take_logs` flushes them).
The agent forwards the client's id, so a load generator that puts a label in the id learns
where each request went.  Scrapes of ``/metrics`` go to ``node<i>.scrapes`` instead, and health
probes to ``node<i>.probes``, unbuffered (:meth:`StaticNodes.scrapes` and
:meth:`StaticNodes.probes` count them).

Needs ``nginx`` (Debian: ``apt-get install nginx-light``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

from _peers import free_port

ROOT = Path(__file__).resolve().parents[1]
METRICS_PAGE = ROOT / "tests" / "fixtures" / "vllm" / "vllm-0.32.0-cpu-metrics.txt"
MODEL = "tiny-model"  # the model of that page, so its labels and /v1/models agree

_COMPLETION = (
    '{"id": "chatcmpl-static", "object": "chat.completion", "created": 1796442082, '
    f'"model": "{MODEL}", "choices": [{{"index": 0, "message": {{"role": "assistant", '
    '"content": " batch a"}, "logprobs": null, "finish_reason": "length", "stop_reason": null}], '
    '"usage": {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12}}'
)
_MODELS = (
    f'{{"object": "list", "data": [{{"id": "{MODEL}", "object": "model", "created": 1796442082, '
    f'"owned_by": "vllm", "root": "{MODEL}", "parent": null, "max_model_len": 8192}}]}}'
)

_SERVER = """
  server {{
    listen 127.0.0.1:{port};
    access_log {dir}/node{i}.log ids buffer=256k flush=1s;
    location = /health {{ access_log {dir}/node{i}.probes scrapes; return 200; }}
    location = /v1/models {{ default_type application/json; return 200 '{models}'; }}
    location = /metrics {{
      access_log {dir}/node{i}.scrapes scrapes;
      default_type text/plain;
      alias {dir}/metrics.txt;
    }}
    location = /v1/chat/completions {{ default_type application/json; return 200 '{completion}'; }}
    location / {{ return 404; }}
  }}
"""

_CONF = """
{user}worker_processes 1;
daemon off;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  client_body_temp_path {dir}/body;
  proxy_temp_path {dir}/proxy;
  fastcgi_temp_path {dir}/fastcgi;
  uwsgi_temp_path {dir}/uwsgi;
  scgi_temp_path {dir}/scgi;
  keepalive_requests 100000000;
  keepalive_timeout 300s;
  log_format ids '$http_x_request_id';
  log_format scrapes '$msec';
{servers}
}}
"""


class StaticNodes:
    """``count`` static nodes in one nginx (module docstring); stop with :meth:`stop`."""

    def __init__(self, count: int, directory: Path) -> None:
        if shutil.which("nginx") is None:
            raise SystemExit("nginx is not installed: apt-get install nginx-light")
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(METRICS_PAGE, self.dir / "metrics.txt")
        ports = [free_port() for _ in range(count)]
        servers = "".join(
            _SERVER.format(port=port, i=i, dir=self.dir, models=_MODELS, completion=_COMPLETION)
            for i, port in enumerate(ports)
        )
        conf = self.dir / "nginx.conf"
        # as root, nginx's worker would drop to "nobody", which cannot reopen the logs in a
        # private directory; the worker stays who started it
        user = "user root;\n" if os.geteuid() == 0 else ""
        conf.write_text(_CONF.format(user=user, dir=self.dir, servers=servers))
        self.urls = [f"http://127.0.0.1:{port}" for port in ports]
        self._proc = subprocess.Popen(
            ["nginx", "-c", str(conf), "-p", str(self.dir)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=(self.dir / "nginx.stderr").open("wb"),
        )
        deadline = time.monotonic() + 10
        for url in self.urls:
            while True:
                try:
                    with urllib.request.urlopen(url + "/health", timeout=1) as reply:
                        if reply.status == 200:
                            break
                except OSError:
                    pass
                if self._proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    said = "".join(
                        path.read_text(errors="replace")
                        for path in (self.dir / "nginx.stderr", self.dir / "error.log")
                        if path.exists()
                    )
                    raise SystemExit(f"nginx did not serve {url}: {said}")
                time.sleep(0.05)

    @property
    def pid(self) -> int:
        """nginx's master; its worker is its only child."""
        return self._proc.pid

    def take_logs(self) -> list[list[str]]:
        """The request ids each node logged since the last call (or the start), in order; its
        logs start empty again."""
        for i in range(len(self.urls)):
            log = self.dir / f"node{i}.log"
            if log.exists():
                log.rename(self.dir / f"node{i}.taken")
        self._proc.send_signal(signal.SIGUSR1)  # reopen: writes the buffers, opens new files
        time.sleep(0.3)
        out = []
        for i in range(len(self.urls)):
            taken = self.dir / f"node{i}.taken"
            lines = taken.read_text().split() if taken.exists() else []
            with contextlib.suppress(FileNotFoundError):
                taken.unlink()
            out.append(lines)
        return out

    def scrapes(self) -> list[int]:
        """How many times each node has served its ``/metrics`` page since the start (its own
        log, unbuffered: ``take_logs`` leaves it be)."""
        out = []
        for i in range(len(self.urls)):
            path = self.dir / f"node{i}.scrapes"
            out.append(len(path.read_text().split()) if path.exists() else 0)
        return out

    def probes(self) -> list[int]:
        """How many times each node has answered ``/health`` since the start (as
        :meth:`scrapes`)."""
        out = []
        for i in range(len(self.urls)):
            path = self.dir / f"node{i}.probes"
            out.append(len(path.read_text().split()) if path.exists() else 0)
        return out

    def stop(self) -> None:
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGQUIT)  # graceful: workers finish, then exit
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.dir / "nginx.pid")
