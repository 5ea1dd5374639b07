"""The operators' admin API: reads, actions (drain, failover, ...), policies, audit.

::

    server      the aiohttp app on its own port (``api.port``), TLS, leader forwarding
    routes      route table -> handlers and the OpenAPI document
    auth        bearer tokens (hashes), roles, problem+json refusals
    actions     drain / undrain / failover / failback: plan, check, apply fenced, audit
    models      request and response bodies; values the API keeps in etcd
    keys        the API's etcd keys (policies, leader endpoint, idempotency)
    settings    ``ApiSettings`` (``ControllerSettings.api``)

Kept import-light: ``reconcile.windows`` imports ``models`` and ``keys``.
"""
