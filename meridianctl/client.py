"""The admin API over HTTP (httpx): the one place that turns HTTP failures into exit codes.

Every answer is checked for what the admin API answers: a JSON body of the route's shape
(meridianctl/shapes.py) or, for an error, an RFC 9457 problem.  Anything else means the URL
points at some other server (an agent, a node, etcd, a proxy's error page), reported with
what came back and exit code 3, never a traceback.
"""

from __future__ import annotations

import random
import ssl
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

import httpx

from meridianctl import shapes
from meridianctl.config import Config
from meridianctl.errors import CtlError, Exit, for_status


class Client:
    """Sends a request; after a network error or a 503 (no leader, a leader handover, etcd
    unavailable) it sends the very same request again, with the same ``Idempotency-Key`` for a
    write (the controller applies it once), backing off exponentially until ``retry_s`` has
    passed, and notes each retry on standard error."""

    def __init__(
        self,
        config: Config,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        rng: random.Random | None = None,
        note: Callable[[str], None] | None = None,
    ) -> None:
        verify: ssl.SSLContext | bool = True
        if config.ca_file:
            try:
                verify = ssl.create_default_context(cafile=config.ca_file)
            except (OSError, ssl.SSLError) as exc:
                raise CtlError(
                    f"ca_file {config.ca_file}: {getattr(exc, 'strerror', None) or exc}",
                    code=Exit.USAGE,
                    fix="point ca_file (MERIDIAN_CA_FILE) at the PEM CA that signed the admin "
                    "API's certificate (api.tls.ca_file of the controller)",
                ) from None
        headers = {"User-Agent": "meridianctl/1"}
        if config.token:
            headers["Authorization"] = f"Bearer {config.token}"
        self.url = config.url
        self.retry_s = config.retry_s
        self._clock = clock
        self._sleep = sleep
        self._rng = rng or random.Random()
        self._note = note or _stderr
        self._http = httpx.Client(
            base_url=config.url, headers=headers, timeout=config.timeout_s, verify=verify
        )

    def close(self) -> None:
        self._http.close()

    def get(
        self, path: str, params: dict[str, Any] | None = None, *, shape: shapes.Shape
    ) -> dict[str, Any]:
        """The JSON answer, checked against ``shape`` (meridianctl/shapes.py)."""
        return _answer(self._send("GET", path, params=params), shape)

    def text(self, path: str) -> str:
        response = self._send("GET", path)
        if _media_type(response) != "text/plain":
            raise _not_the_admin_api(response, "the admin API answers text/plain here")
        return response.text

    def post(
        self, path: str, body: dict[str, Any], *, dry_run: bool = False,
        shape: shapes.Shape = shapes.ACTION,
    ) -> dict[str, Any]:  # fmt: skip
        return self._write("POST", path, body, dry_run=dry_run, shape=shape)

    def put(
        self, path: str, body: dict[str, Any], *, dry_run: bool = False,
        shape: shapes.Shape = shapes.POLICIES,
    ) -> dict[str, Any]:  # fmt: skip
        return self._write("PUT", path, body, dry_run=dry_run, shape=shape)

    def _write(
        self, method: str, path: str, body: dict[str, Any], *, dry_run: bool, shape: shapes.Shape
    ) -> dict[str, Any]:
        # one key per command, kept across its retries: the controller applies it once
        headers = {"Idempotency-Key": str(uuid.uuid4())}
        params = {"dry_run": "true"} if dry_run else None
        response = self._send(method, path, json=body, params=params, headers=headers)
        return _answer(response, shape)

    def _send(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        # only a write with an Idempotency-Key may be sent twice (reads are safe)
        retry = method == "GET" or "Idempotency-Key" in kwargs.get("headers", {})
        deadline = self._clock() + self.retry_s
        delay_s = FIRST_DELAY_S
        attempt = 1
        while True:
            try:
                response = self._http.request(method, path, **kwargs)
            except httpx.TransportError as exc:
                why = _why(exc)
                if not retry or _TRUST in why or not self._wait(why, attempt, delay_s, deadline):
                    raise CtlError(
                        f"cannot reach the admin API at {self.url}: {why}",
                        code=Exit.UNREACHABLE,
                        fix="check MERIDIAN_URL (or --url), the network, and MERIDIAN_CA_FILE "
                        "for HTTPS",
                    ) from exc
            else:
                if response.status_code < 400:
                    return response
                problem = _problem(response)
                if (
                    not retry
                    or response.status_code != 503
                    or not self._wait(problem.message, attempt, delay_s, deadline)
                ):
                    raise problem
            attempt += 1
            delay_s = min(delay_s * 2, MAX_DELAY_S)

    def _wait(self, why: str, attempt: int, delay_s: float, deadline: float) -> bool:
        """Sleep before the next try and say so; False when the deadline leaves no time."""
        delay_s *= 0.5 + self._rng.random() / 2  # jitter: replicas' clients do not align
        left_s = deadline - self._clock()
        if left_s <= delay_s:
            return False
        self._note(
            f"meridianctl: {why.splitlines()[0]}; retrying in {delay_s:.1f} s "
            f"(try {attempt + 1}, giving up in {left_s:.0f} s; MERIDIAN_RETRY_S)"
        )
        self._sleep(delay_s)
        return True


FIRST_DELAY_S = 0.25
MAX_DELAY_S = 2.0
_TRUST = "TLS certificate is not trusted"  # not transient: retrying cannot help


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _why(exc: httpx.TransportError) -> str:
    text = str(exc) or type(exc).__name__
    if "CERTIFICATE_VERIFY_FAILED" in text:
        return "the server's TLS certificate is not trusted (set MERIDIAN_CA_FILE)"
    return text


ADMIN_PORT_FIX = (
    "point MERIDIAN_URL (or --url) at the controller's admin API: the port given to "
    "meridian-controller --admin-port (api.port; http://127.0.0.1:8091 by default), not its "
    "--port, an agent, a node or etcd"
)


def _media_type(response: httpx.Response) -> str:
    kind = str(response.headers.get("content-type", ""))
    return kind.split(";")[0].strip().lower()


def _not_the_admin_api(response: httpx.Response, why: str) -> CtlError:
    """What came back, from a server that is not the admin API (exit code 3)."""
    request = response.request
    kind = response.headers.get("content-type") or "no content type"
    reason = f" {response.reason_phrase}" if response.reason_phrase else ""
    message = (
        f"{request.url.copy_with(query=None)} is not the controller's admin API: "
        f"{request.method} answered {response.status_code}{reason} ({kind}); {why}"
    )
    body = " ".join(response.content[:160].decode("utf-8", "replace").split())
    if body:
        message += f"\n  it answered: {body}" + ("..." if len(response.content) > 160 else "")
    return CtlError(message, code=Exit.UNREACHABLE, fix=ADMIN_PORT_FIX)


def _answer(response: httpx.Response, shape: shapes.Shape) -> dict[str, Any]:
    try:
        data = response.json()
    except ValueError:
        raise _not_the_admin_api(response, "the body is not JSON") from None
    why = shapes.mismatch(data, shape)
    if why is not None:
        raise _not_the_admin_api(response, f"not the admin API's answer ({why})")
    assert isinstance(data, dict)  # every shape of an answer is an object
    return data


def _problem(response: httpx.Response) -> CtlError:
    """The admin API's RFC 9457 problem as an error to print; any other error body means the
    URL points at another server."""
    status = response.status_code
    try:
        body = response.json()
    except ValueError:
        body = None
    if shapes.mismatch(body, shapes.PROBLEM) is not None:
        return _not_the_admin_api(response, "an error that is not the admin API's problem+json")
    assert isinstance(body, dict)
    message = f"{body['title']} ({status}): {body['detail']}"
    errors = body.get("errors") or []
    if errors:
        message += "".join(f"\n  - {e}" for e in errors)
    fix = str(body.get("fix") or "")
    if status == 401 and not fix:
        fix = "set MERIDIAN_TOKEN"
    return CtlError(message, code=for_status(status), fix=fix)
