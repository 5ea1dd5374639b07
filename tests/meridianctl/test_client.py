"""meridianctl's retries against a real HTTP server on 127.0.0.1 that answers 503 a few times
(a leader handover) and then 200: the same Idempotency-Key each time, a backoff that grows,
a note per retry, and a deadline after which it gives up."""

from __future__ import annotations

import json
import random
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from meridianctl import config as ctl_config
from meridianctl.client import Client
from meridianctl.errors import CtlError, Exit
from tests.support import free_port


class Flaky:
    """Answers ``failures`` 503s, then 200; records each request's method and key."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.seen: list[tuple[str, str | None]] = []
        flaky = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                self.rfile.read(length)
                flaky.seen.append((self.command, self.headers.get("Idempotency-Key")))
                if len(flaky.seen) <= flaky.failures:
                    status, body = 503, {"title": "Service Unavailable", "detail": "no leader"}
                else:
                    status, body = 200, {"ok": "yes"}
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PUT = _answer

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"


@pytest.fixture
def flaky(request: pytest.FixtureRequest) -> Iterator[Flaky]:
    server = Flaky(request.param)
    thread = threading.Thread(target=server.server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.server.shutdown()
        server.server.server_close()
        thread.join()


class FakeTime:
    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.now += s


def _client(url: str, t: FakeTime, notes: list[str], retry_s: float = 15.0) -> Client:
    config = ctl_config.Config(url=url, token="x", retry_s=retry_s)
    return Client(config, clock=lambda: t.now, sleep=t.sleep, rng=random.Random(1),
                  note=notes.append)  # fmt: skip


@pytest.mark.parametrize("flaky", [3], indirect=True)
def test_a_write_retries_503_with_the_same_key_and_a_growing_backoff(flaky: Flaky) -> None:
    t, notes = FakeTime(), list[str]()
    client = _client(flaky.url, t, notes)
    try:
        assert client.post("/v1/regions/eu-west/drain", {"reason": "x"}) == {"ok": "yes"}
    finally:
        client.close()
    assert len(flaky.seen) == 4
    assert {key for _, key in flaky.seen} == {flaky.seen[0][1]} and flaky.seen[0][1]
    assert len(t.slept) == 3 and t.slept[0] < t.slept[1] < t.slept[2]
    assert len(notes) == 3 and all("503" in n and "retrying in" in n for n in notes)


@pytest.mark.parametrize("flaky", [2], indirect=True)
def test_a_read_retries_503(flaky: Flaky) -> None:
    t, notes = FakeTime(), list[str]()
    client = _client(flaky.url, t, notes)
    try:
        assert client.get("/v1/regions") == {"ok": "yes"}
    finally:
        client.close()
    assert [m for m, _ in flaky.seen] == ["GET"] * 3 and len(notes) == 2


@pytest.mark.parametrize("flaky", [1000], indirect=True)
def test_503_past_the_deadline_exits_8(flaky: Flaky) -> None:
    t, notes = FakeTime(), list[str]()
    client = _client(flaky.url, t, notes, retry_s=5.0)
    try:
        with pytest.raises(CtlError) as caught:
            client.put("/v1/policies", {"reason": "x"})
    finally:
        client.close()
    assert caught.value.code == Exit.UNAVAILABLE and "no leader" in caught.value.message
    assert 0 < sum(t.slept) <= 5.0 and len(flaky.seen) == len(t.slept) + 1


@pytest.mark.parametrize("flaky", [1], indirect=True)
def test_retry_s_0_never_retries(flaky: Flaky) -> None:
    t, notes = FakeTime(), list[str]()
    client = _client(flaky.url, t, notes, retry_s=0.0)
    try:
        with pytest.raises(CtlError):
            client.get("/v1/regions")
    finally:
        client.close()
    assert len(flaky.seen) == 1 and not notes


def test_a_network_error_is_retried_until_the_deadline() -> None:
    t, notes = FakeTime(), list[str]()
    client = _client(f"http://127.0.0.1:{free_port()}", t, notes, retry_s=3.0)
    try:
        with pytest.raises(CtlError) as caught:
            client.post("/v1/regions/eu-west/drain", {"reason": "x"})
    finally:
        client.close()
    assert caught.value.code == Exit.UNREACHABLE
    assert len(notes) >= 2 and sum(t.slept) <= 3.0


def test_a_retry_deadline_that_is_not_a_number_of_seconds_is_a_usage_error() -> None:
    for bad in ("-1", "nan", "inf", "soon"):
        with pytest.raises(CtlError, match="MERIDIAN_RETRY_S") as caught:
            ctl_config.load(env={"MERIDIAN_RETRY_S": bad})
        assert caught.value.code == Exit.USAGE
    assert ctl_config.load(env={}).retry_s == 15.0
    assert ctl_config.load(env={"MERIDIAN_RETRY_S": "0"}).retry_s == 0.0
