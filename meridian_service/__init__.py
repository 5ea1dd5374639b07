"""Process plumbing shared by Meridian's daemons; it imports no other package of ours.

``settings``  settings from flags, environment and a TOML file; validation errors in words
``serving``   serve an aiohttp application until SIGINT or SIGTERM, printing ``READY <url>``
``tls``       a server's certificate and key, reloaded on SIGHUP; client contexts
``hygiene``   connection limits of every server: read timeouts, keep-alive, per-address cap
``clock``     the clocks the shells inject: monotonic for the agent, wall-clock for the controller
``version``   the installed version, and the ``--version`` flag every daemon takes
``metrics``   callbacks of observable instruments: a table of counts, one labelled row each
"""
