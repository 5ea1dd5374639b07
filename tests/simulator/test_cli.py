"""``meridian-sim`` as an operator runs it: a real process on a free port."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import httpx
import openai
import pytest
import zmq

from meridian_wire import kv_events

SIM = [sys.executable, "-m", "meridian_sim.cli"]


@pytest.fixture
def h100_node() -> Iterator[tuple[subprocess.Popen[str], str]]:
    proc = subprocess.Popen(
        [*SIM, "node", "--port", "0", "--profile", "h100-llama3-8b", "--time-scale", "10"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("READY "):
        proc.kill()
        pytest.fail(
            f"meridian-sim did not start: {line!r} {proc.stderr.read() if proc.stderr else ''}"
        )
    try:
        yield proc, line.split()[1]
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=10)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


def test_node_answers_the_openai_client_streaming_and_not(
    h100_node: tuple[subprocess.Popen[str], str],
) -> None:
    _, url = h100_node
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client:
        model = client.models.list().data[0].id
        assert model == "meta-llama/Meta-Llama-3-8B-Instruct"
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hello"}], max_tokens=5
        )
        assert reply.choices[0].message.content
        chunks = list(
            client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": "hello"}],
                max_tokens=5,
                stream=True,
            )
        )
        assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_injected_exit_ends_the_process(h100_node: tuple[subprocess.Popen[str], str]) -> None:
    proc, url = h100_node
    response = httpx.post(f"{url}/admin/faults", json={"exit": True})
    assert response.status_code == 200
    assert proc.wait(timeout=10) == 3


def test_sigterm_stops_cleanly(h100_node: tuple[subprocess.Popen[str], str]) -> None:
    proc, _ = h100_node
    proc.terminate()
    assert proc.wait(timeout=10) == 0


def test_unknown_profile_is_a_clear_error() -> None:
    done = subprocess.run(
        [*SIM, "node", "--port", "0", "--profile", "b200-llama5"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 2
    assert "unknown profile 'b200-llama5'" in done.stderr
    assert "h100-llama3-8b" in done.stderr


def test_bad_time_scale_is_rejected() -> None:
    done = subprocess.run(
        [*SIM, "node", "--port", "0", "--profile", "cpu-tiny", "--time-scale", "-1"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 2
    assert "--time-scale" in done.stderr


def test_profiles_lists_the_builtin_profiles() -> None:
    done = subprocess.run([*SIM, "profiles"], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0
    for name in ("a100-llama3-8b", "cpu-tiny", "h100-llama3-8b"):
        assert name in done.stdout


def test_port_in_use_is_a_clear_error(h100_node: tuple[subprocess.Popen[str], str]) -> None:
    _, url = h100_node
    port = url.rsplit(":", 1)[1]
    done = subprocess.run(
        [*SIM, "node", "--port", port, "--profile", "cpu-tiny"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr


@pytest.mark.parametrize(
    ("config", "says"),
    [
        ("{not json", "--kv-events-config is not JSON"),
        ('{"enable_kv_cache_events": true, "endpont": "tcp://*:1"}', "unknown field(s) endpont"),
        ('{"enable_kv_cache_events": true, "publisher": "nats"}', "only 'zmq' is served"),
        ('{"enable_kv_cache_events": true, "buffer_steps": 0}', "buffer_steps must be a positive"),
    ],
)
def test_a_bad_kv_events_config_is_a_clear_error(config: str, says: str) -> None:
    done = subprocess.run(
        [*SIM, "node", "--port", "0", "--profile", "cpu-tiny", "--kv-events-config", config],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 2
    assert says in done.stderr


def test_a_node_with_kv_events_publishes_what_it_caches() -> None:
    """The process as an operator starts it: the log names the bound endpoints, a subscriber
    there gets vLLM's messages for the blocks a request cached."""
    config = (
        '{"enable_kv_cache_events": true, "publisher": "zmq", '
        '"endpoint": "tcp://127.0.0.1:*", "replay_endpoint": "tcp://127.0.0.1:*"}'
    )
    proc = subprocess.Popen(
        [*SIM, "node", "--port", "0", "--profile", "h100-llama3-8b", "--time-scale", "50",
         "--kv-events-config", config],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stderr is not None
    ctx = zmq.Context()
    try:
        url = proc.stdout.readline().split()[1]
        endpoint = replay = ""
        for _ in range(50):  # the log's first lines (bounded: pytest's timeout ends a hang)
            line = proc.stderr.readline()
            if "kv events endpoint=" in line:
                fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
                endpoint, replay = fields["endpoint"], fields["replay_endpoint"]
                break
        assert endpoint.startswith("tcp://127.0.0.1:") and replay.startswith("tcp://127.0.0.1:")
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(endpoint)
        prompt = " ".join(f"word{i}" for i in range(200))
        body = {"model": "meta-llama/Meta-Llama-3-8B-Instruct", "prompt": prompt, "max_tokens": 2}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=30).status_code == 200
        dealer = ctx.socket(zmq.DEALER)  # the replay: the batch sent before the subscription
        dealer.connect(replay)
        dealer.send_multipart([b"", kv_events.encode_seq(0)])
        batches = []
        while True:
            assert dealer.poll(10_000), "no replay answer"
            frames = dealer.recv_multipart()[1:]
            seq, payload = kv_events.replay_frames(frames)
            if seq < 0:
                break
            batches.append(kv_events.decode_batch(payload))
        stored = [e for b in batches for e in b.events if isinstance(e, kv_events.BlockStored)]
        assert stored and stored[0].parent_block_hash is None and stored[0].block_size == 16
        assert len(stored[0].token_ids) == 16 * len(stored[0].block_hashes)
    finally:
        ctx.destroy(linger=0)
        proc.terminate()
        proc.wait(timeout=10)
        proc.stdout.close()
        proc.stderr.close()
