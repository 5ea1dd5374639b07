"""Pure decision logic shared by the agent, the controller and the simulators.

Nothing in this package does I/O, reads clocks or uses global randomness: every function takes
snapshots, ``now`` and ``rng`` as arguments and returns frozen values.
"""
