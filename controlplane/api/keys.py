"""The admin API's keys under ``/meridian/v1/`` (besides ``meridian_wire.keys``'
``regions/<r>/override`` and ``audit/``):

=============================  ==========  ====================================================
key                            writer      value
=============================  ==========  ====================================================
controller/policies            admin API   ``StoredPolicies``: failover policy set by an admin,
                                           applied by the leader from its next window
controller/admin               leader      ``AdminEndpoint``: where to forward writes
idempotency/<hash>             leader      ``IdempotencyRecord``: the answer to one key
=============================  ==========  ====================================================

Only the controller reads them, so they live here rather than in ``meridian_wire``.
"""

from __future__ import annotations

from typing import Final

from meridian_wire.keys import PREFIX

POLICIES: Final = PREFIX + "controller/policies"
ADMIN: Final = PREFIX + "controller/admin"
IDEMPOTENCY: Final = PREFIX + "idempotency/"


def idempotency(digest: str) -> str:
    return f"{IDEMPOTENCY}{digest}"
