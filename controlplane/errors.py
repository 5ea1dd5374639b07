"""Errors of the global controller.

::

    ControllerError
    ├── StoreUnavailable     etcd cannot be reached (every endpoint tried); retry later
    ├── NotLeader            a fenced write was refused: this replica no longer leads
    └── BadValue             a value in etcd does not validate; carries its key

Foreign exceptions (aetcd's, grpc's) are translated in ``store/`` only.
"""

from __future__ import annotations


class ControllerError(Exception):
    retryable = False


class StoreUnavailable(ControllerError):
    retryable = True


class NotLeader(ControllerError):
    """The leader key is no longer ours: the write did not land."""


class BadValue(ControllerError):
    def __init__(self, key: str, problem: str) -> None:
        super().__init__(f"{key}: {problem}")
        self.key = key
        self.problem = problem
