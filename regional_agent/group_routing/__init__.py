"""The ``groups`` routing policy's shared tables in the agent (docs/group-tables.md).

``tables``  :class:`GroupTables`: what the agent routes by and what it must publish (no I/O)
``sync``    :class:`TableSync`: reads and watches the region's tables in etcd, publishes moves

The policy's decision itself is ``policies.group_routing.GroupPolicy``, over ``GroupTables``.
"""

from regional_agent.group_routing.sync import TableSync
from regional_agent.group_routing.tables import GroupTables

__all__ = ["GroupTables", "TableSync"]
