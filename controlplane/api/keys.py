"""The admin API's keys under ``/meridian/v1/`` (besides ``meridian_wire.keys``'
``regions/<r>/override`` and ``audit/``):

=============================  ==========  ====================================================
key                            writer      value
=============================  ==========  ====================================================
controller/admin               leader      ``AdminEndpoint``: where to forward writes
idempotency/<hash>             leader      ``IdempotencyRecord``: the answer to one key
=============================  ==========  ====================================================

Only the controller reads them, so they live here rather than in ``meridian_wire``.  The failover
policy an admin sets, ``controller/policies``, is ``controlplane.failover_policy.KEY``: the window
loop reads it too.
"""

from __future__ import annotations

from typing import Final

from meridian_wire.keys import PREFIX

ADMIN: Final = PREFIX + "controller/admin"
IDEMPOTENCY: Final = PREFIX + "idempotency/"


def idempotency(digest: str) -> str:
    return f"{IDEMPOTENCY}{digest}"
