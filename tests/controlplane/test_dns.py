"""DNS steering against real BIND9 and real etcd, one window and one DNS pass at a time.

Regions are published into etcd the way an agent does; ``windows.reconcile_once`` judges them
with a driven clock; ``Steering.reconcile_once`` applies the DNS plan to a BIND with two views:
``geo-a`` (clients from 127.0.0.2) serves the eu geography, ``default`` (127.0.0.1) serves us.
The whole controller is in test_dns_controller.py.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import secrets
from typing import Any

import pytest

import meridian_etcd
from controlplane.dns import rfc2136, steering
from controlplane.dns.errors import DnsRefused
from controlplane.reconcile import windows
from controlplane.settings import ControllerSettings
from meridian_service.clock import Clock as ClockProtocol
from meridian_wire import keys
from meridian_wire.models import DnsApplied, RegionStatus
from policies.dns_plan import Change, RecordSet
from tests.controlplane.dns_helpers import (
    API,
    ENDPOINTS,
    EU_ADDRESS,
    GEO,
    REGIONS,
    SRV,
    TXT,
    US_ADDRESS,
    answer,
    dns_settings,
    serial,
    srv_weights,
    view_settings,
)
from tests.support import BindServer, ManualClock

WINDOW_S = 30.0
EU, US = "127.0.0.2", "127.0.0.1"  # the client addresses of the geo-a and default views


def _settings(bind: BindServer, **dns: Any) -> ControllerSettings:
    return ControllerSettings(
        etcd={"endpoints": ["http://127.0.0.1:1"]},
        failover={"window_s": WINDOW_S, "min_hold_s": 0.0},
        regions=REGIONS,
        dns=dns_settings(bind, **dns),
    )


def _steering(
    settings: ControllerSettings, store: meridian_etcd.Store, clock: ClockProtocol
) -> steering.Steering:
    return steering.Steering(
        settings=settings,
        store=store,
        fence=None,
        clock=clock,
        client=rfc2136.Client(settings.dns),
    )


async def _window(
    store: meridian_etcd.Store,
    clock: ManualClock,
    settings: ControllerSettings,
    *,
    up: list[str],
    endpoints: dict[str, str] | None = None,
) -> None:
    clock.t += WINDOW_S
    for region in up:
        status = RegionStatus(
            region=region,
            geo=GEO[region],
            endpoints=[(endpoints or ENDPOINTS)[region]],
            nodes_healthy=2,
            nodes_total=2,
            capacity=2.0,
            updated_at=clock.now(),
        )
        await store.put(keys.status(region), status.model_dump_json().encode())
        await store.put(keys.alive(region), b"")
    await windows.reconcile_once(store=store, fence=None, settings=settings, clock=clock)


async def _applied(store: meridian_etcd.Store) -> DnsApplied:
    entry = await store.get(keys.DNS_APPLIED)
    assert entry is not None
    return DnsApplied.model_validate_json(entry.value)


async def test_each_geography_gets_its_own_answer_and_nothing_is_resent(
    store: meridian_etcd.Store, bind: BindServer
) -> None:
    clock = ManualClock()
    settings = _settings(bind)
    steer = _steering(settings, store, clock)
    await _window(store, clock, settings, up=["eu-west", "us-east"])
    assert await steer.reconcile_once() == 2  # one update per view

    assert await answer(bind, EU, API, "A") == {EU_ADDRESS}
    assert await answer(bind, US, API, "A") == {US_ADDRESS}
    assert await answer(bind, EU, SRV, "SRV") == {
        "10 100 443 eu-west.api.meridian.test.",
        "20 0 8443 us-east.api.meridian.test.",  # the standby, in failover order
    }
    assert await answer(bind, US, SRV, "SRV") == {
        "10 100 8443 us-east.api.meridian.test.",
        "20 0 443 eu-west.api.meridian.test.",
    }
    assert await answer(bind, EU, "us-east.api.meridian.test.", "A") == {US_ADDRESS}
    generation = steer.desired.generation if steer.desired else -1
    assert await answer(bind, EU, TXT, "TXT") == {f'"generation={generation}" "geo=eu"'}
    applied = await _applied(store)
    assert applied.generation == generation and applied.error is None
    assert {v.geo for v in applied.views.values()} == {"eu", "us"}
    assert all(r.ttl_s == 30 for v in applied.views.values() for r in v.records)

    # steady fleet: windows pass, the plan is the same, nothing is sent
    serials = (await serial(bind, EU), await serial(bind, US))
    for _ in range(3):
        await _window(store, clock, settings, up=["eu-west", "us-east"])
        assert await steer.reconcile_once() == 0
    assert (await serial(bind, EU), await serial(bind, US)) == serials
    assert steer.updates == 2
    assert (await _applied(store)).generation == generation


async def test_failover_flips_the_geography_to_its_backup_and_the_ramp_brings_it_back(
    store: meridian_etcd.Store, bind: BindServer
) -> None:
    clock = ManualClock()
    settings = _settings(bind)
    steer = _steering(settings, store, clock)
    await _window(store, clock, settings, up=["eu-west", "us-east"])
    await steer.reconcile_once()
    assert await answer(bind, EU, API, "A") == {EU_ADDRESS}

    await store.delete(keys.alive("eu-west"))  # eu-west's agent dies
    for _ in range(3):
        await _window(store, clock, settings, up=["us-east"])
        await steer.reconcile_once()
    assert await answer(bind, EU, API, "A") == {US_ADDRESS}
    assert srv_weights(await answer(bind, EU, SRV, "SRV")) == {"us-east": (10, 100)}
    # the failed region is not even a standby in the other geography
    assert srv_weights(await answer(bind, US, SRV, "SRV")) == {"us-east": (10, 100)}

    seen = []
    for _ in range(6):
        await _window(store, clock, settings, up=["eu-west", "us-east"])
        await steer.reconcile_once()
        seen.append(srv_weights(await answer(bind, EU, SRV, "SRV")))
    ramp = [s["eu-west"][1] for s in seen if s.get("eu-west", (0, 0))[0] == 10]
    # shares normalised within the geography: eu-west keeps w, us-east takes 1 - w
    assert ramp[:3] == [5, 25, 50]
    assert seen[-1] == {"eu-west": (10, 100), "us-east": (20, 0)}
    assert await answer(bind, EU, API, "A") == {EU_ADDRESS}
    assert await answer(bind, US, API, "A") == {US_ADDRESS}


async def test_a_wrongly_signed_update_is_refused_and_said_clearly(
    store: meridian_etcd.Store, bind: BindServer, caplog: pytest.LogCaptureFixture
) -> None:
    clock = ManualClock()
    forged = base64.b64encode(secrets.token_bytes(32)).decode()
    views = [
        view_settings(bind.view("geo-a"), "eu", secret=forged),
        view_settings(bind.view("default"), "us"),
    ]
    settings = _settings(bind, views=views)
    steer = _steering(settings, store, clock)
    await _window(store, clock, settings, up=["eu-west", "us-east"])
    with pytest.raises(DnsRefused, match="BADSIG"):
        await steer.reconcile_once()
    assert await answer(bind, EU, API, "A") == set()

    # through the runner: the error is logged as an error and recorded in dns/applied
    caplog.set_level(logging.INFO, logger="controlplane.dns")
    async with steering.steering(settings, store=store, fence=None, clock=clock) as poke:
        poke.poke()
        for _ in range(100):
            entry = await store.get(keys.DNS_APPLIED)
            if entry is not None and DnsApplied.model_validate_json(entry.value).error:
                break
            await asyncio.sleep(0.05)
    applied = await _applied(store)
    assert applied.error is not None and "BADSIG" in applied.error and "geo-a" in applied.error
    assert applied.generation == 0 and applied.desired_generation > 0
    refused = [r for r in caplog.records if "refused by the DNS server" in r.getMessage()]
    assert refused and refused[0].levelno == logging.ERROR
    assert "BADSIG" in refused[0].getMessage()
    assert forged not in caplog.text  # secrets never reach the logs


async def test_an_unsigned_update_is_refused(store: meridian_etcd.Store, bind: BindServer) -> None:
    clock = ManualClock()
    views = [
        {"name": "geo-a", "geo": "eu", "source": EU},  # no key: reads and writes from 127.0.0.2
        view_settings(bind.view("default"), "us"),
    ]
    settings = _settings(bind, views=views)
    steer = _steering(settings, store, clock)
    await _window(store, clock, settings, up=["eu-west", "us-east"])
    with pytest.raises(DnsRefused, match=r"REFUSED.*unsigned"):
        await steer.reconcile_once()
    assert await answer(bind, EU, API, "A") == set()


async def test_dry_run_logs_the_difference_and_sends_nothing(
    store: meridian_etcd.Store, bind: BindServer, caplog: pytest.LogCaptureFixture
) -> None:
    clock = ManualClock()
    settings = _settings(bind, backend="dry-run")
    steer = _steering(settings, store, clock)
    await _window(store, clock, settings, up=["eu-west", "us-east"])
    before = await serial(bind, EU)
    caplog.set_level(logging.INFO, logger="controlplane.dns")
    assert await steer.reconcile_once() == 2
    assert await serial(bind, EU) == before
    assert await answer(bind, EU, API, "A") == set()
    lines = [r.getMessage() for r in caplog.records if "dry-run" in r.getMessage()]
    assert any(f"replace {API} 30 A {EU_ADDRESS}" in line for line in lines)
    assert any("view=default" in line and US_ADDRESS in line for line in lines)
    caplog.clear()
    first = await store.get(keys.DNS_APPLIED)
    clock.t += 1.0
    await steer.reconcile_once()  # the same difference is not printed again
    assert not [r for r in caplog.records if "dry-run" in r.getMessage()]
    assert steer.updates == 0
    again = await store.get(keys.DNS_APPLIED)  # nor is dns/applied rewritten every pass
    assert first is not None and again is not None
    assert again.mod_revision == first.mod_revision


async def test_records_written_out_of_band_are_put_back(
    store: meridian_etcd.Store, bind: BindServer
) -> None:
    clock = ManualClock()
    settings = _settings(bind)
    steer = _steering(settings, store, clock)
    await _window(store, clock, settings, up=["eu-west", "us-east"])
    await steer.reconcile_once()
    # someone edits the zone by hand: a stray target and a wrong address
    client = rfc2136.Client(settings.dns)
    await client.update(
        "geo-a",
        [
            Change(op="replace", rrset=RecordSet(name=API, rdtype="A", ttl_s=30,
                                                 values=("203.0.113.9",))),
            Change(op="replace", rrset=RecordSet(name="old.api.meridian.test.", rdtype="A",
                                                 ttl_s=30, values=("203.0.113.8",))),
        ],
    )  # fmt: skip
    assert await steer.reconcile_once() == 1  # one view differs
    assert await answer(bind, EU, API, "A") == {EU_ADDRESS}
    # old.api is no region's target: only the names served and the regions' targets are
    # read, so a name made by hand below the service stays
    assert await answer(bind, EU, "old.api.meridian.test.", "A") == {"203.0.113.8"}


async def test_a_host_name_endpoint_below_the_service_is_the_operators_and_never_touched(
    store: meridian_etcd.Store, bind: BindServer
) -> None:
    clock = ManualClock()
    settings = _settings(bind)
    steer = _steering(settings, store, clock)
    host = "eu-west.api.meridian.test."
    endpoints = {**ENDPOINTS, "eu-west": "https://eu-west.api.meridian.test"}
    # the operator names eu-west's endpoint inside the service's space, with its own address
    client = rfc2136.Client(settings.dns)
    await client.update(
        "geo-a",
        [Change(op="replace", rrset=RecordSet(name=host, rdtype="A", ttl_s=300,
                                              values=("203.0.113.7",)))],
    )  # fmt: skip
    for _ in range(3):  # every pass
        await _window(store, clock, settings, up=["eu-west", "us-east"], endpoints=endpoints)
        await steer.reconcile_once()
        assert await answer(bind, EU, host, "A") == {"203.0.113.7"}
    assert await answer(bind, EU, SRV, "SRV") == {
        f"10 100 443 {host}",  # referenced by SRV only
        "20 0 8443 us-east.api.meridian.test.",
    }
    assert await answer(bind, EU, "us-east.api.meridian.test.", "A") == {US_ADDRESS}
    assert await steer.reconcile_once() == 0  # and nothing left to change


async def test_a_zone_the_view_does_not_serve_is_said_clearly(
    store: meridian_etcd.Store, bind: BindServer
) -> None:
    clock = ManualClock()
    views = [
        {**view_settings(bind.view("geo-a"), "eu"), "zone": "not-served.test."},
        view_settings(bind.view("default"), "us"),
    ]
    settings = _settings(bind, views=views)
    steer = _steering(settings, store, clock)
    await _window(store, clock, settings, up=["eu-west", "us-east"])
    with pytest.raises(DnsRefused) as refused:
        await steer.reconcile_once()
    text = str(refused.value)
    assert "geo-a" in text and "not-served.test." in text
    assert "update-policy" not in text  # a read was refused, not an update


async def test_srv_weights_follow_capacity_and_a_region_s_endpoints_split_its_share(
    store: meridian_etcd.Store, bind: BindServer
) -> None:
    """Issue 21: eu-north behind two load balancers and eu-west behind one were served 50, 50,
    50 (eu-north took 67 %); now eu-north's share is split between its records, and the shares
    follow the regions' capacity."""
    clock = ManualClock()
    regions = [*REGIONS, {"id": "eu-north", "geo": "eu", "backups": ["eu-west"]}]
    settings = ControllerSettings(
        etcd={"endpoints": ["http://127.0.0.1:1"]},
        failover={"window_s": WINDOW_S, "min_hold_s": 0.0},
        regions=regions,
        dns=dns_settings(bind),
    )
    steer = _steering(settings, store, clock)
    lbs = ["https://lb1.eu-north.example", "https://lb2.eu-north.example"]
    endpoints = {**{r: [e] for r, e in ENDPOINTS.items()}, "eu-north": lbs}
    geo = {**GEO, "eu-north": "eu"}

    async def window(capacity: dict[str, float]) -> dict[str, int]:
        clock.t += WINDOW_S
        for region, cap in capacity.items():
            status = RegionStatus(
                region=region, geo=geo[region], endpoints=endpoints[region],
                nodes_healthy=int(cap), nodes_total=int(cap), capacity=cap,
                updated_at=clock.now(),
            )  # fmt: skip
            await store.put(keys.status(region), status.model_dump_json().encode())
            await store.put(keys.alive(region), b"")
        await windows.reconcile_once(store=store, fence=None, settings=settings, clock=clock)
        await steer.reconcile_once()
        served = await answer(bind, EU, SRV, "SRV")
        records = [v.split() for v in served]
        return {t: int(w) for p, w, _port, t in records if p == "10"}

    equal = await window({"eu-west": 2.0, "eu-north": 2.0, "us-east": 2.0})
    assert equal == {
        "eu-west.api.meridian.test.": 50,
        "lb1.eu-north.example.": 25,  # 25 + 25 against 50, not 50, 50, 50
        "lb2.eu-north.example.": 25,
    }
    bigger = await window({"eu-west": 2.0, "eu-north": 6.0, "us-east": 2.0})
    assert bigger == {
        "eu-west.api.meridian.test.": 25,  # 2 of 8 node-equivalents
        "lb1.eu-north.example.": 38,
        "lb2.eu-north.example.": 37,
    }
    assert await answer(bind, EU, API, "A") == {EU_ADDRESS}  # host names get no A record
