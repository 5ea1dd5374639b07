"""Errors of DNS steering; dnspython's exceptions are translated in ``rfc2136`` only.

::

    ControllerError
    └── DnsError                 one read or update of the authoritative server failed
        ├── DnsUnavailable       no answer: timeout, connection refused (server down); retried
        ├── DnsRefused           the server said no: REFUSED, NOTAUTH, TSIG BADSIG/BADKEY/BADTIME
        │                        (unsigned, wrongly signed, or not allowed by update-policy)
        └── DnsFailed            any other failure (SERVFAIL, a malformed answer); retried
"""

from __future__ import annotations

from controlplane.errors import ControllerError


class DnsError(ControllerError):
    retryable = True

    def __init__(self, view: str, detail: str) -> None:
        super().__init__(f"view {view}: {detail}")
        self.view = view
        self.detail = detail


class DnsUnavailable(DnsError):
    pass


class DnsRefused(DnsError):
    """A configuration problem more than an outage: retried, slowly, and logged as an error."""


class DnsFailed(DnsError):
    pass
