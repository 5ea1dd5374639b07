"""Free loopback ports for test servers.

A port found here is free when the function returns; a server started right after binds it.
Another process could take it in between, so the start helpers retry with new ports when
the server's log says its port was taken.
"""

from __future__ import annotations

import socket

_TRIES = 50


def free_port(host: str = "127.0.0.1") -> int:
    """Return a port on `host` that is free for both TCP and UDP (DNS needs both)."""
    for _ in range(_TRIES):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as tcp:
            tcp.bind((host, 0))
            port: int = tcp.getsockname()[1]
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
                try:
                    udp.bind((host, port))
                except OSError:
                    continue
        return port
    raise RuntimeError(f"no port free for TCP and UDP on {host} after {_TRIES} tries")
