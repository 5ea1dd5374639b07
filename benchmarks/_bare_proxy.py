"""The floor for an aiohttp router: a bare reverse proxy, round robin over the nodes.

It reads the body, posts it to the next node and relays the answer (chunk by chunk for a stream),
nothing else: no parsing, no routing state, no metrics.  ``benchmarks/router_cpu.py`` runs it
next to Meridian and the peers to show what aiohttp itself costs per request on this machine.

    python benchmarks/_bare_proxy.py --port 0 --node URL [--node URL ...] [--no-uvloop]

Prints ``READY http://127.0.0.1:PORT`` once it listens.
"""

from __future__ import annotations

import argparse
import itertools
import socket
import sys

import aiohttp
from aiohttp import web


def make_app(nodes: list[str]) -> web.Application:
    turn = itertools.cycle(nodes)
    app = web.Application()

    async def session_ctx(app: web.Application):  # type: ignore[no-untyped-def]
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=30)
        app["session"] = aiohttp.ClientSession(connector=connector, auto_decompress=False)
        yield
        await app["session"].close()

    async def proxy(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        url = next(turn) + request.path
        async with request.app["session"].post(
            url, data=body, headers={"Content-Type": "application/json"}
        ) as up:
            if up.headers.get("Content-Type", "").startswith("text/event-stream"):
                out = web.StreamResponse(
                    status=up.status, headers={"Content-Type": up.headers["Content-Type"]}
                )
                await out.prepare(request)
                async for chunk in up.content.iter_any():
                    await out.write(chunk)
                await out.write_eof()
                return out
            data = await up.read()
            return web.Response(body=data, status=up.status, content_type="application/json")

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app.cleanup_ctx.append(session_ctx)
    app.router.add_post("/v1/chat/completions", proxy)
    app.router.add_post("/v1/completions", proxy)
    app.router.add_get("/health", health)
    return app


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--node", action="append", required=True)
    parser.add_argument("--no-uvloop", action="store_true")
    args = parser.parse_args()
    if not args.no_uvloop:
        import uvloop

        uvloop.install()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", args.port))
    print(f"READY http://127.0.0.1:{sock.getsockname()[1]}", flush=True)
    web.run_app(make_app([n.rstrip("/") for n in args.node]), sock=sock, print=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
