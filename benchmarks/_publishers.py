"""Lightweight agent publishers for ``control_plane_scale.py``: what N regions of 1..10 agent
replicas each write to etcd, without the agents.

Each simulated agent replica does what ``regional_agent.publisher`` does with its default
settings: a lease of ``lease_ttl_s`` (10 s) refreshed every TTL/3; its ``alive`` key and its
``status`` key under that lease; the status rewritten every ``--status-every-s`` (the agents'
heartbeat, ``region.window_s``, 30 s by default; a region whose load keeps moving writes at most
every 5 s, ``load_min_interval_s``), at a random phase.  Not simulated: the agents' watches of
their ``desired`` key and of their siblings, and the group tables.

Agents share ``--clients`` etcd connections (a real agent has its own).  Region ``i`` (from 0)
has ``1 + i % 10`` agents, serves geography ``g<i // 10>`` and publishes one IP endpoint.

    python benchmarks/_publishers.py --etcd URL --regions N [--status-every-s 30]

Prints ``ready <agents>`` once every lease is granted and every status written, then
``stats <keepalives> <status writes> <errors>`` every 5 s; stops on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import meridian_etcd
from meridian_wire import keys
from meridian_wire.models import RegionLoad, RegionStatus

LEASE_TTL_S = 10  # regional_agent.settings: region.lease_ttl_s


def region_name(i: int) -> str:
    return f"r{i:04d}"


def geo_of(i: int) -> str:
    return f"g{i // 10:02d}"


def agents_of(i: int) -> int:
    return 1 + i % 10


class Counts:
    up = 0
    keepalives = 0
    statuses = 0
    errors = 0


def _status(i: int, agent: str, rng: random.Random) -> bytes:
    nodes = 2 + i % 7
    status = RegionStatus(
        region=region_name(i),
        geo=geo_of(i),
        residency=[geo_of(i)],
        endpoints=[f"https://10.{i // 250}.{i % 250}.1"],
        nodes_healthy=nodes,
        nodes_total=nodes,
        capacity=float(nodes),
        load=RegionLoad(
            in_flight=rng.randint(0, 40),
            queue_depth=rng.randint(0, 5),
            kv_util=round(rng.uniform(0.1, 0.8), 3),
            ttft_p99_s=round(rng.uniform(0.1, 0.9), 3),
            error_rate=0.0,
        ),
        agent_id=agent,
        updated_at=time.time(),
    )
    return status.model_dump_json().encode()


async def agent(
    store: meridian_etcd.Store, i: int, a: int, *, every_s: float, ready: asyncio.Event
) -> None:
    region, name = region_name(i), f"agent-{a}"
    rng = random.Random(i * 100 + a)
    lease = await store.grant(ttl_s=LEASE_TTL_S)
    await store.put(keys.agent_alive(region, name), b"", lease=lease)
    await store.put(keys.agent_status(region, name), _status(i, name, rng), lease=lease)
    Counts.up += 1
    await ready.wait()  # every agent up before the steady state begins
    loop = asyncio.get_running_loop()
    refresh_s = LEASE_TTL_S / 3
    next_refresh = loop.time() + rng.uniform(0, refresh_s)
    next_status = loop.time() + rng.uniform(0, every_s)
    while True:
        await asyncio.sleep(max(0.0, min(next_refresh, next_status) - loop.time()))
        try:
            if loop.time() >= next_refresh:
                next_refresh += refresh_s
                await store.keep_alive(lease)
                Counts.keepalives += 1
            if loop.time() >= next_status:
                next_status += every_s
                value = _status(i, name, rng)
                await store.put(keys.agent_status(region, name), value, lease=lease)
                Counts.statuses += 1
        except meridian_etcd.EtcdError:
            Counts.errors += 1


async def main(args: argparse.Namespace) -> None:
    stores = [
        meridian_etcd.Store(meridian_etcd.ClientConfig(endpoints=[args.etcd], timeout_s=10.0))
        for _ in range(args.clients)
    ]
    ready = asyncio.Event()
    tasks = []
    n = 0
    for i in range(args.regions):
        for a in range(agents_of(i)):
            tasks.append(
                asyncio.create_task(
                    agent(stores[n % len(stores)], i, a, every_s=args.status_every_s, ready=ready)
                )
            )
            n += 1
            if n % 200 == 0:
                await asyncio.sleep(0.05)  # spread the grants
    while Counts.up < n:
        failed = [t for t in tasks if t.done()]
        if failed:
            failed[0].result()  # raises what stopped it
        await asyncio.sleep(0.1)
    ready.set()
    print(f"ready {n}", flush=True)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), timeout=5.0)
        except TimeoutError:
            print(f"stats {Counts.keepalives} {Counts.statuses} {Counts.errors}", flush=True)
    for t in tasks:
        t.cancel()
    for s in stores:
        await s.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--etcd", required=True)
    parser.add_argument("--regions", type=int, required=True)
    parser.add_argument("--status-every-s", type=float, default=30.0)
    parser.add_argument("--clients", type=int, default=8)
    asyncio.run(main(parser.parse_args()))
