"""Process plumbing shared by Meridian's daemons; it imports no other package of ours.

``settings``  settings from flags, environment and a TOML file; validation errors in words
``serving``   serve an aiohttp application until SIGINT or SIGTERM, printing ``READY <url>``
``clock``     the clocks the shells inject: monotonic for the agent, wall-clock for the controller
``version``   the installed version, and the ``--version`` flag every daemon takes
"""
