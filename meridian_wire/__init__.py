"""The etcd keyspace and the models of its values: the contract between agents and controllers.

Both ``regional_agent`` and ``controlplane`` import this package (and never each other).  It
holds no I/O: key names (``meridian_wire.keys``) and pydantic models of the JSON values
(``meridian_wire.models``).
"""
