"""Exit codes of meridianctl, and the errors that carry them.

====  =====================================================================================
code  meaning
====  =====================================================================================
0     done
1     meridianctl itself failed (a bug: please report it)
2     usage: a bad command, option or argument (nothing was sent)
3     the admin API could not be reached (URL, network, TLS), or what answered at the URL is
      not the admin API (not JSON, JSON of another shape, an error that is not a problem+json)
4     not authenticated (401): no token, or a token the controller does not know
5     not allowed (403): the token's role may not do this
6     not found (404): unknown region
7     refused (400, 405, 409, 422): bad input or an unsafe action; nothing was changed
8     the controller is unavailable or failed (5xx): no leader, etcd down; retry
9     aborted: answered no at the confirmation prompt, or an action without ``--yes`` whose
      standard input is not a terminal (nothing was sent); nothing was changed
====  =====================================================================================
"""

from __future__ import annotations

from enum import IntEnum


class Exit(IntEnum):
    OK = 0
    INTERNAL = 1
    USAGE = 2
    UNREACHABLE = 3
    UNAUTHENTICATED = 4
    FORBIDDEN = 5
    NOT_FOUND = 6
    REFUSED = 7
    UNAVAILABLE = 8
    ABORTED = 9


def for_status(status: int) -> Exit:
    if status == 401:
        return Exit.UNAUTHENTICATED
    if status == 403:
        return Exit.FORBIDDEN
    if status == 404:
        return Exit.NOT_FOUND
    if 400 <= status < 500:
        return Exit.REFUSED
    return Exit.UNAVAILABLE


class CtlError(Exception):
    """An error to print (one line, then what to do) and exit with ``code``."""

    def __init__(self, message: str, *, code: Exit, fix: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.fix = fix
