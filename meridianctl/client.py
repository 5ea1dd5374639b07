"""The admin API over HTTP (httpx): the one place that turns HTTP failures into exit codes."""

from __future__ import annotations

import ssl
import uuid
from typing import Any

import httpx

from meridianctl.config import Config
from meridianctl.errors import CtlError, Exit, for_status


class Client:
    def __init__(self, config: Config) -> None:
        verify: ssl.SSLContext | bool = True
        if config.ca_file:
            verify = ssl.create_default_context(cafile=config.ca_file)
        headers = {"User-Agent": "meridianctl/1"}
        if config.token:
            headers["Authorization"] = f"Bearer {config.token}"
        self.url = config.url
        self._http = httpx.Client(
            base_url=config.url, headers=headers, timeout=config.timeout_s, verify=verify
        )

    def close(self) -> None:
        self._http.close()

    def get(self, path: str, params: dict[str, Any] | None = None) -> Any:
        return self._send("GET", path, params=params).json()

    def text(self, path: str) -> str:
        return self._send("GET", path).text

    def post(self, path: str, body: dict[str, Any], *, dry_run: bool = False) -> Any:
        # one key per command: a retry after a lost answer is applied once
        headers = {"Idempotency-Key": str(uuid.uuid4())}
        params = {"dry_run": "true"} if dry_run else None
        return self._send("POST", path, json=body, params=params, headers=headers).json()

    def put(self, path: str, body: dict[str, Any]) -> Any:
        headers = {"Idempotency-Key": str(uuid.uuid4())}
        return self._send("PUT", path, json=body, headers=headers).json()

    def _send(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        tries = 3 if method == "GET" or "headers" in kwargs else 1
        for attempt in range(tries):
            try:
                response = self._http.request(method, path, **kwargs)
            except httpx.TransportError as exc:
                if attempt + 1 < tries:
                    continue
                raise CtlError(
                    f"cannot reach the admin API at {self.url}: {_why(exc)}",
                    code=Exit.UNREACHABLE,
                    fix="check MERIDIAN_URL (or --url), the network, and MERIDIAN_CA_FILE for "
                    "HTTPS",
                ) from exc
            if response.status_code < 400:
                return response
            raise _problem(response)
        raise AssertionError("unreachable")


def _why(exc: httpx.TransportError) -> str:
    text = str(exc) or type(exc).__name__
    if "CERTIFICATE_VERIFY_FAILED" in text:
        return "the server's TLS certificate is not trusted (set MERIDIAN_CA_FILE)"
    return text


def _problem(response: httpx.Response) -> CtlError:
    status = response.status_code
    try:
        body = response.json()
    except ValueError:
        body = {}
    if not isinstance(body, dict):
        body = {}
    detail = str(body.get("detail") or response.text[:200] or response.reason_phrase)
    title = str(body.get("title") or response.reason_phrase)
    errors = body.get("errors") or []
    message = f"{title} ({status}): {detail}"
    if errors and isinstance(errors, list):
        message += "".join(f"\n  - {e}" for e in errors)
    fix = str(body.get("fix") or "")
    if status == 401 and not fix:
        fix = "set MERIDIAN_TOKEN"
    return CtlError(message, code=for_status(status), fix=fix)
