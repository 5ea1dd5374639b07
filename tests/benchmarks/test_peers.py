"""The peers helper builds the command lines the field notes give; nothing is installed here."""

from __future__ import annotations

from pathlib import Path

import _peers
import pytest

URLS = ["http://127.0.0.1:8001", "http://127.0.0.1:8002"]


def _cmd(name: str, policy: str = "cache_aware") -> list[str]:
    return _peers.command(
        _peers.PEERS[name],
        worker_urls=URLS,
        policy=policy,
        port=30000,
        prometheus_port=30001,
        root=Path("/peers"),
    )


def test_vllm_router_command() -> None:
    assert _cmd("vllm-router") == [
        "/peers/vllm-router/bin/vllm-router",
        "--host", "127.0.0.1", "--port", "30000",
        "--worker-urls", *URLS,
        "--policy", "cache_aware",
        "--prometheus-host", "127.0.0.1", "--prometheus-port", "30001",
        "--log-level", "warning",
        "--worker-startup-check-interval", "1",
    ]  # fmt: skip


def test_sglang_router_and_smg_commands() -> None:
    sgl = _cmd("sglang-router", "round_robin")
    assert sgl[:2] == ["/peers/sglang-router/bin/sglang-router", "launch"]
    assert sgl[sgl.index("--policy") + 1] == "round_robin"
    assert sgl[sgl.index("--log-level") + 1] == "warn"
    smg = _cmd("smg", "prefix_hash")
    assert smg[:2] == ["/peers/smg/bin/smg", "launch"]
    assert smg[-2:] == ["--backend", "vllm"]
    i = smg.index("--worker-urls")
    assert smg[i + 1 : i + 3] == URLS


def test_pinned_versions_and_policies() -> None:
    assert {p.requirement for p in _peers.PEERS.values()} == {
        "vllm-router==0.1.17",
        "sglang-router==0.3.2",
        "smg==1.13.0",
    }
    for peer in _peers.PEERS.values():
        assert peer.default_policy == "cache_aware" in peer.policies
        assert {"round_robin", "random", "power_of_two"} <= set(peer.policies)


def test_unknown_policy_and_no_workers_are_refused() -> None:
    with pytest.raises(ValueError, match="sglang-router has no policy 'consistent_hash'"):
        _cmd("sglang-router", "consistent_hash")
    with pytest.raises(ValueError, match="at least one worker"):
        _peers.command(
            _peers.PEERS["smg"], worker_urls=[], policy="random", port=1, prometheus_port=2
        )


def test_venvs_live_outside_the_project_and_the_root_can_be_moved(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("MERIDIAN_PEERS_DIR", raising=False)
    assert _peers.venv_dir(_peers.PEERS["smg"]) == Path.home() / ".cache/meridian/peers/smg"
    monkeypatch.setenv("MERIDIAN_PEERS_DIR", str(tmp_path))
    assert _peers.venv_dir(_peers.PEERS["smg"]) == tmp_path / "smg"
    assert _peers.installed_version(_peers.PEERS["smg"]) is None  # nothing there


def test_start_without_install_says_how_to_install(tmp_path: Path) -> None:
    with pytest.raises(_peers.PeerError, match=r"_peers\.py install vllm-router"):
        _peers.start(
            _peers.PEERS["vllm-router"],
            worker_urls=URLS,
            policy="random",
            logdir=tmp_path,
            root=tmp_path,
        )
