"""Errors of the global controller.

::

    ControllerError
    └── BadValue             a value in etcd does not validate; carries its key
    dns.errors.DnsError      the DNS server refused or did not answer (``dns/errors.py``)

etcd's failures are the etcd layer's own (``meridian_etcd.errors``): ``Unavailable`` (fail
static, retry later), ``Fenced`` (a fenced write was refused: this replica no longer leads),
``Refused`` and ``LeaseLost``.  Foreign exceptions are translated there and in ``dns/`` only.
"""

from __future__ import annotations


class ControllerError(Exception):
    retryable = False


class BadValue(ControllerError):
    def __init__(self, key: str, problem: str) -> None:
        super().__init__(f"{key}: {problem}")
        self.key = key
        self.problem = problem
