"""A fleet on loopback for Prometheus to scrape, every part a real process: etcd and BIND9
(tests/support), ``meridian-sim node`` processes behind ``meridian-agent`` processes
(tests/faults/harness.py), and ``meridian-controller`` processes, two on etcd and one, ``ctl-c``,
pointed at an etcd endpoint where nothing listens (a replica cut off from etcd: its
``etcd_connected`` is 0 and its ``etcd_errors_total`` counts, which the dashboards show).

Regions as in tests/meridianctl/stack.py: eu-west (backup eu-north) and eu-north, geography and
residency eu; us-east, geography us.  eu-north has two nodes (one is killed to see an
ejection), the others one.  eu-north also has a second agent, ``eu-north-workers``, with two
workers (``--workers``; it publishes nothing, so the region's status stays the other agent's):
its series come once per worker, labelled ``worker``, as every query over agents must take.
The BIND fixture's view ``geo-a`` serves eu, ``default`` us.
Windows of 1 s, 2 strikes, a 2 s agent lease: a dead region is failed about 5 s after its
agent dies.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meridian_service.checkconfig import to_toml
from tests.controlplane.dns_helpers import dns_settings
from tests.faults.harness import AgentProc, NodeProc, fast_agent_toml, wait_http
from tests.meridianctl.stack import REGIONS, TOKENS, token_settings
from tests.support import BindServer, relaunch_bind
from tests.support.ports import free_port
from tests.support.process import ServerProcess

WINDOW_S, STRIKES = 1.0, 2
AGENT_TTL_S, HEARTBEAT_S = 2, 1.0
NODES = {"eu-west": 1, "eu-north": 2, "us-east": 1}
ADDRESSES = {"eu-west": "192.0.2.11", "eu-north": "192.0.2.12", "us-east": "198.51.100.13"}
OPERATOR_TOKEN = TOKENS["operator"]


WORKERS_AGENT = "eu-north-workers"  # Fleet.agents' key of the agent with two workers


def workers_agent_toml(region: dict[str, Any], nodes: list[NodeProc]) -> str:
    """An agent of ``region`` with two workers, publishing nothing (no etcd)."""
    return fast_agent_toml(
        region=region["id"], geo=region["geo"], residency=region["residency"],
        endpoint=f"https://{ADDRESSES[region['id']]}", etcd=[], nodes=[n.url for n in nodes],
        workers=2,
    )  # fmt: skip


def agent_toml(region: dict[str, Any], nodes: list[NodeProc], etcd_url: str) -> str:
    return fast_agent_toml(
        region=region["id"], geo=region["geo"], residency=region["residency"],
        endpoint=f"https://{ADDRESSES[region['id']]}", etcd=[etcd_url],
        nodes=[n.url for n in nodes], lease_ttl_s=AGENT_TTL_S, window_s=HEARTBEAT_S,
    )  # fmt: skip


@dataclass(slots=True)
class ControllerProc:
    """A ``meridian-controller`` process: its read port (``/metrics``, ``/health``) and its
    admin port (the admin API, plain HTTP on loopback)."""

    name: str
    etcd: list[str]
    bind: BindServer
    logs: Path
    port: int = field(default_factory=free_port)
    admin_port: int = field(default_factory=free_port)
    process: ServerProcess | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    def settings(self) -> dict[str, Any]:
        return {
            "etcd": {"endpoints": self.etcd, "timeout_s": 1.0},
            "election": {"id": self.name, "lease_ttl_s": 2},
            "failover": {
                "window_s": WINDOW_S,
                "strikes": STRIKES,
                "recovery_windows": 1,
                "ramp": [0.5, 1.0],
                "min_hold_s": 0.0,
                "status_stale_s": 3 * HEARTBEAT_S,
                "agent_heartbeat_s": HEARTBEAT_S,
            },
            "regions": [dict(r) for r in REGIONS],
            "server": {"host": "127.0.0.1", "port": self.port},
            "api": {"host": "127.0.0.1", "port": self.admin_port, "tokens": token_settings()},
            "dns": dns_settings(self.bind),
        }

    def start(self) -> ControllerProc:
        config = self.logs / f"{self.name}.toml"
        config.write_text(to_toml(self.settings()))
        argv = [sys.executable, "-m", "controlplane.cli", "--config", str(config)]
        log = self.logs / f"{self.name}-{time.monotonic_ns()}.log"
        self.process = ServerProcess(argv, log_path=log)
        wait_http(f"{self.url}/health", what=self.name, process=self.process)
        return self

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()


@dataclass(slots=True)
class Fleet:
    etcd_url: str
    bind: BindServer
    logs: Path
    nodes: dict[str, list[NodeProc]] = field(default_factory=dict)
    agents: dict[str, AgentProc] = field(default_factory=dict)
    controllers: dict[str, ControllerProc] = field(default_factory=dict)
    relaunched: list[BindServer] = field(default_factory=list)

    def start(self) -> Fleet:
        seed = 0
        for region in REGIONS:
            rid = region["id"]
            self.nodes[rid] = []
            for _ in range(NODES[rid]):
                node = NodeProc(port=free_port(), log_dir=self.logs, seed=seed, time_scale=10.0)
                self.nodes[rid].append(node.start())
                seed += 1
            config = agent_toml(region, self.nodes[rid], self.etcd_url)
            self.agents[rid] = AgentProc(port=free_port(), log_dir=self.logs, config=config)
            self.agents[rid].start()
        north = next(r for r in REGIONS if r["id"] == "eu-north")
        config = workers_agent_toml(north, self.nodes["eu-north"])
        self.agents[WORKERS_AGENT] = AgentProc(port=free_port(), log_dir=self.logs, config=config)
        self.agents[WORKERS_AGENT].start()
        nowhere = f"http://127.0.0.1:{free_port()}"  # nothing listens there
        for name, etcd in (("ctl-a", [self.etcd_url]), ("ctl-b", [self.etcd_url]),
                           ("ctl-c", [nowhere])):  # fmt: skip
            self.controllers[name] = ControllerProc(name, etcd, self.bind, self.logs).start()
        return self

    def scrape_config(self) -> list[dict[str, Any]]:
        """Prometheus ``scrape_configs``: the job names docs/observability.md uses, and the
        nodes' own vLLM metrics with their region as a target label."""

        def target(url: str) -> str:
            return url.removeprefix("http://")

        return [
            {
                "job_name": "meridian-controller",
                "static_configs": [{"targets": [target(c.url) for c in self.controllers.values()]}],
            },
            {
                "job_name": "meridian-agent",
                "static_configs": [{"targets": [target(a.url) for a in self.agents.values()]}],
            },
            {
                "job_name": "vllm",
                "static_configs": [
                    {"targets": [target(n.url) for n in nodes], "labels": {"region": region}}
                    for region, nodes in self.nodes.items()
                ],
            },
        ]

    def kill_bind(self) -> None:
        """SIGKILL named: the leader's DNS passes fail until :meth:`restart_bind`."""
        self.bind.process.kill()

    def restart_bind(self) -> None:
        """named again, on the same port with the same zones (journals included)."""
        self.relaunched.append(relaunch_bind(self.bind))

    def stop(self) -> None:
        for b in self.relaunched:
            b.process.stop()
        for c in self.controllers.values():
            c.stop()
        for a in self.agents.values():
            a.stop()
        for nodes in self.nodes.values():
            for n in nodes:
                n.stop()
