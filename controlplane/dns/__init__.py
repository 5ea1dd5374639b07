"""DNS steering: RFC 2136 updates signed with TSIG, diffed against what the server serves.

``settings`` (the ``[dns]`` group), ``rfc2136`` (the only code that speaks DNS), ``steering``
(the leader's reconcile loop and ``dns/applied``), ``bindconf`` (named.conf for operators).
Import the modules; this package imports nothing, so ``controlplane.settings`` can use
``dns.settings`` without a cycle.
"""
