"""meridianctl's retries against a real HTTP server on 127.0.0.1 that answers 503 a few times
(a leader handover) and then 200: the same Idempotency-Key each time, a backoff that grows,
a note per retry, and a deadline after which it gives up.  Then answers no Meridian server
gives (another server behind the URL), and a real admin API's 405 problem."""

from __future__ import annotations

import asyncio
import json
import random
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from meridianctl import config as ctl_config
from meridianctl import shapes
from meridianctl.client import Client
from meridianctl.errors import CtlError, Exit
from tests.meridianctl.stack import TOKENS, Stack
from tests.support import free_port

# what a controller replica answers while no leader is elected (controlplane/api/problems.py)
NO_LEADER = {"type": "urn:meridian:problem:unavailable", "title": "Unavailable: retry",
             "status": 503, "detail": "no leader", "fix": "retry in a few seconds"}  # fmt: skip
OK = {"ok": str}  # the shape of the 200 answer


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
                    status, body = 503, NO_LEADER
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
        assert client.post("/v1/regions/eu-west/drain", {"reason": "x"}, shape=OK) == {"ok": "yes"}
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
        assert client.get("/v1/regions", shape=OK) == {"ok": "yes"}
    finally:
        client.close()
    assert [m for m, _ in flaky.seen] == ["GET"] * 3 and len(notes) == 2


@pytest.mark.parametrize("flaky", [1000], indirect=True)
def test_503_past_the_deadline_exits_8(flaky: Flaky) -> None:
    t, notes = FakeTime(), list[str]()
    client = _client(flaky.url, t, notes, retry_s=5.0)
    try:
        with pytest.raises(CtlError) as caught:
            client.put("/v1/policies", {"reason": "x"}, shape=OK)
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
            client.get("/v1/regions", shape=OK)
    finally:
        client.close()
    assert len(flaky.seen) == 1 and not notes


def test_a_network_error_is_retried_until_the_deadline() -> None:
    t, notes = FakeTime(), list[str]()
    client = _client(f"http://127.0.0.1:{free_port()}", t, notes, retry_s=3.0)
    try:
        with pytest.raises(CtlError) as caught:
            client.post("/v1/regions/eu-west/drain", {"reason": "x"}, shape=OK)
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


class Canned:
    """A real HTTP server on loopback that answers every request the same: the bodies no
    Meridian server gives (a proxy's error page, a web server, a JSON API of another kind)."""

    def __init__(self, status: int, content_type: str, body: bytes) -> None:
        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = do_PUT = _answer

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"


@pytest.fixture
def canned(request: pytest.FixtureRequest) -> Iterator[Canned]:
    server = Canned(*request.param)
    server.server.timeout = 0.05  # handle_request() returns after this long with nothing to do
    stop = threading.Event()

    def serve() -> None:  # not serve_forever: its shutdown() hung once in a loaded CI run
        while not stop.is_set():
            server.server.handle_request()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        stop.set()
        thread.join(timeout=10)
        server.server.server_close()
        assert not thread.is_alive(), "the canned server did not stop"


PROXY_500 = b"<h1>Internal Server Error</h1>"
NOT_A_ROW = b'{"regions": [{"region": "eu-west"}], "window": 1, "serving": {}}'
ODD = [
    (200, "text/html", b"<html><body>It works!</body></html>", "the body is not JSON"),
    (200, "application/json", b'["regions"]', "the answer: an array, not an object"),
    (200, "application/json", b'{"regions": "none"}', "regions: a string, not an array"),
    (200, "application/json", NOT_A_ROW, "regions[0].state: missing"),
    (200, "application/json", b"", "the body is not JSON"),
    (500, "text/html", PROXY_500, "not the admin API's problem+json"),
    (502, "text/html", b"<html>502 Bad Gateway</html>", "not the admin API's problem+json"),
    (404, "application/json", b'{"error": {"message": "x"}}', "not the admin API's problem+json"),
    (401, "application/json", b'{"detail": 7}', "not the admin API's problem+json"),
]


@pytest.mark.parametrize("canned, why", [((s, t, b), w) for s, t, b, w in ODD], indirect=["canned"])
def test_an_answer_the_admin_api_never_gives_says_what_came_back_and_exits_3(
    canned: Canned, why: str
) -> None:
    t, notes = FakeTime(), list[str]()
    client = _client(canned.url, t, notes, retry_s=0.0)
    try:
        with pytest.raises(CtlError) as caught:
            client.get("/v1/regions", shape=shapes.REGIONS)
    finally:
        client.close()
    error = caught.value
    first = error.message.splitlines()[0]
    assert error.code == Exit.UNREACHABLE, error.message
    assert first.startswith(f"{canned.url}/v1/regions is not the controller's admin API: GET ")
    assert why in first, first
    assert "MERIDIAN_URL (or --url)" in error.fix and "--admin-port" in error.fix


@pytest.mark.parametrize(
    "canned", [(200, "application/json", b'"named.conf"')], indirect=["canned"]
)
def test_text_that_is_not_text_plain_is_not_the_admin_api(canned: Canned) -> None:
    client = _client(canned.url, FakeTime(), [], retry_s=0.0)
    try:
        with pytest.raises(CtlError) as caught:
            client.text("/v1/dns/bind-config")
    finally:
        client.close()
    assert caught.value.code == Exit.UNREACHABLE
    assert "200 OK (application/json)" in caught.value.message


async def test_a_405_problem_is_printed_as_its_detail_and_fix(stack: Stack) -> None:
    """The real admin API answers a method a route does not take with a 405 problem+json:
    meridianctl prints its detail and fix, as for any problem."""
    config = ctl_config.Config(url=stack.url("ctl-a"), token=TOKENS["admin"], retry_s=0.0)
    client = Client(config)
    try:
        with pytest.raises(CtlError) as caught:
            await asyncio.to_thread(client.put, "/v1/regions", {"reason": "x"})
    finally:
        client.close()
    error = caught.value
    assert error.code == Exit.REFUSED, error.message
    assert "(405): PUT is not allowed on /v1/regions" in error.message
    assert "openapi" in error.fix
