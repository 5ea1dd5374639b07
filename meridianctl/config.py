"""Where meridianctl finds the admin API and its token.

Precedence: command-line options > environment (``MERIDIAN_URL``, ``MERIDIAN_TOKEN``,
``MERIDIAN_CA_FILE``, ``MERIDIAN_TIMEOUT_S``, ``MERIDIAN_RETRY_S``) > the config file
(``--config``, else ``MERIDIANCTL_CONFIG``, else ``~/.config/meridian/meridianctl.toml``
when it exists) > defaults (``http://127.0.0.1:8091``).

.. code-block:: toml

    url = "https://controller.example:8091"
    token_file = "~/.config/meridian/token"    # or: token = "..."
    ca_file = "/etc/meridian/admin.crt"
    timeout_s = 10      # one HTTP request
    retry_s = 15        # keep retrying a network error or a 503 this long (0: never retry)
"""

from __future__ import annotations

import math
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from meridianctl.errors import CtlError, Exit

DEFAULT_URL = "http://127.0.0.1:8091"
DEFAULT_FILE = Path("~/.config/meridian/meridianctl.toml")
# a leader handover lasts up to the election's lease TTL (a few seconds): outlast it
DEFAULT_RETRY_S = 15.0


@dataclass(frozen=True, slots=True, kw_only=True)
class Config:
    url: str = DEFAULT_URL
    token: str | None = None
    ca_file: str | None = None
    timeout_s: float = 10.0
    retry_s: float = DEFAULT_RETRY_S


def load(
    *,
    url: str | None = None,
    token: str | None = None,
    config_file: str | None = None,
    env: Mapping[str, str] | None = None,
) -> Config:
    env = os.environ if env is None else env
    path = config_file or env.get("MERIDIANCTL_CONFIG")
    data: dict[str, object] = {}
    if path is not None:
        data = _read(Path(path).expanduser(), required=True)
    elif DEFAULT_FILE.expanduser().is_file():
        data = _read(DEFAULT_FILE.expanduser(), required=False)
    file_token = data.get("token")
    if file_token is None and isinstance(data.get("token_file"), str):
        token_path = Path(str(data["token_file"])).expanduser()
        try:
            file_token = token_path.read_text().strip()
        except OSError as exc:
            raise CtlError(f"cannot read token_file {token_path}: {exc.strerror}",
                           code=Exit.USAGE) from exc  # fmt: skip
    timeout = env.get("MERIDIAN_TIMEOUT_S") or data.get("timeout_s")
    if timeout is None:  # not `or 10.0`: a 0 in the file is refused below, not replaced
        timeout = 10.0
    try:
        timeout_s = float(str(timeout))
    except ValueError as exc:
        raise CtlError(f"timeout_s {timeout!r} is not a number", code=Exit.USAGE) from exc
    if not timeout_s > 0:  # also refuses nan
        raise CtlError(
            f"timeout_s {timeout!r} (MERIDIAN_TIMEOUT_S or the config file) must be a number of "
            "seconds above 0",
            code=Exit.USAGE,
        )
    retry = env.get("MERIDIAN_RETRY_S") or data.get("retry_s")
    retry_s = DEFAULT_RETRY_S if retry is None else _retry_s(retry)
    return Config(
        url=(url or env.get("MERIDIAN_URL") or str(data.get("url") or DEFAULT_URL)).rstrip("/"),
        token=token or env.get("MERIDIAN_TOKEN") or (str(file_token) if file_token else None),
        ca_file=env.get("MERIDIAN_CA_FILE") or _opt(data.get("ca_file")),
        timeout_s=timeout_s,
        retry_s=retry_s,
    )


def _retry_s(value: object) -> float:
    try:
        retry_s = float(str(value))
    except ValueError:
        retry_s = math.nan
    if not (math.isfinite(retry_s) and retry_s >= 0):
        raise CtlError(
            f"retry_s {value!r} (MERIDIAN_RETRY_S or the config file) must be a number of "
            "seconds, 0 or more (0: never retry)",
            code=Exit.USAGE,
        )
    return retry_s


def _opt(value: object) -> str | None:
    return str(Path(str(value)).expanduser()) if value else None


def _read(path: Path, *, required: bool) -> dict[str, object]:
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError as exc:
        if not required:
            return {}
        raise CtlError(f"config file {path} does not exist", code=Exit.USAGE) from exc
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise CtlError(f"config file {path}: {exc}", code=Exit.USAGE) from exc
