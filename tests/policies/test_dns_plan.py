"""policies.dns_plan: table-driven cases and Hypothesis invariants."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies import dns_plan
from policies.dns_plan import FleetDns, Generation, Names, RecordSet, ViewSpec

ZONE = "meridian.test."
NAMES = Names()
API = "api.meridian.test."
SRV = "_https._tcp.api.meridian.test."
VIEWS = (
    ViewSpec(view="geo-a", zone=ZONE, geo="eu"),
    ViewSpec(view="default", zone=ZONE, geo="us"),
)
ENDPOINTS = {
    "eu-west": ["https://192.0.2.10"],
    "eu-north": ["https://192.0.2.20:8443", "https://[2001:db8::20]:8443"],
    "us-east": ["https://us-east.example.com"],
}


def _records(view: dns_plan.ViewPlan, rdtype: str, name: str) -> set[str]:
    for r in view.records:
        if r.rdtype == rdtype and r.name == name:
            return set(r.values)
    return set()


def _plan(
    serving: dict[str, dict[str, float]],
    *,
    states: dict[str, str] | None = None,
    window: int = 7,
    previous: Generation | None = None,
) -> dns_plan.DnsPlan:
    fleet = FleetDns(
        serving=serving,
        states=states or {},
        endpoints=ENDPOINTS,
        preferences={"eu": ["eu-west", "eu-north", "us-east"], "us": ["us-east", "eu-west"]},
    )
    return dns_plan.plan(VIEWS, fleet=fleet, names=NAMES, window=window, previous=previous)


def test_serving_regions_share_the_top_priority_by_weight_and_standbys_follow() -> None:
    plan = _plan({"eu": {"eu-west": 0.05, "eu-north": 0.95}, "us": {"us-east": 1.0}})
    eu = plan.views["geo-a"]
    assert _records(eu, "A", API) == {"192.0.2.10", "192.0.2.20"}
    assert _records(eu, "AAAA", API) == {"2001:db8::20"}
    assert _records(eu, "SRV", SRV) == {
        "10 5 443 eu-west.api.meridian.test.",
        "10 95 8443 eu-north.api.meridian.test.",
        "20 0 443 us-east.example.com.",  # a host-name endpoint: targeted by name, no A
    }
    assert _records(eu, "A", "eu-north.api.meridian.test.") == {"192.0.2.20"}
    assert _records(eu, "TXT", "_meridian.api.meridian.test.") == {'"generation=7" "geo=eu"'}
    us = plan.views["default"]
    assert _records(us, "A", API) == set()  # us-east has only a host name
    assert _records(us, "SRV", SRV) == {
        "10 100 443 us-east.example.com.",
        "20 0 443 eu-west.api.meridian.test.",
    }
    assert all(r.ttl_s == 30 for v in plan.views.values() for r in v.records)


def test_a_region_s_share_is_split_among_its_endpoints_not_repeated() -> None:
    """Two eu-north load balancers and one eu-west at 50/50: 25 + 25 against 50 (BIND served
    50, 50, 50 before, and eu-north took two thirds)."""
    fleet = FleetDns(
        serving={"eu": {"eu-west": 0.5, "eu-north": 0.5}},
        endpoints={
            "eu-west": ["https://192.0.2.10"],
            "eu-north": ["https://lb-a.eu-north.example.com", "https://lb-b.eu-north.example.com"],
        },
    )
    eu = dns_plan.plan(VIEWS[:1], fleet=fleet, names=NAMES, window=1).views["geo-a"]
    assert _records(eu, "SRV", SRV) == {
        "10 50 443 eu-west.api.meridian.test.",
        "10 25 443 lb-a.eu-north.example.com.",
        "10 25 443 lb-b.eu-north.example.com.",
    }
    # two IP endpoints on one port are one SRV target with two addresses: one record
    fleet = FleetDns(
        serving={"eu": {"eu-west": 0.05, "eu-north": 0.95}},
        endpoints={
            "eu-west": ["https://192.0.2.10", "https://192.0.2.11", "https://192.0.2.10:8443"],
            "eu-north": ["https://192.0.2.20", "https://eu-north.example.com:8443"],
        },
    )
    eu = dns_plan.plan(VIEWS[:1], fleet=fleet, names=NAMES, window=1).views["geo-a"]
    assert _records(eu, "SRV", SRV) == {
        "10 3 443 eu-west.api.meridian.test.",
        "10 2 8443 eu-west.api.meridian.test.",
        "10 48 443 eu-north.api.meridian.test.",
        "10 47 8443 eu-north.example.com.",
    }
    assert _records(eu, "A", "eu-west.api.meridian.test.") == {"192.0.2.10", "192.0.2.11"}


@pytest.mark.parametrize(
    ("weight", "parts", "split"),
    [(50, 2, [25, 25]), (5, 2, [3, 2]), (100, 3, [34, 33, 33]), (1, 3, [1, 1, 1]),
     (0, 2, [0, 0]), (7, 1, [7]), (7, 0, [])],
)  # fmt: skip
def test_split_weight(weight: int, parts: int, split: list[int]) -> None:
    assert dns_plan.split_weight(weight, parts) == split


def test_failed_and_drained_regions_are_never_standbys() -> None:
    plan = _plan(
        {"eu": {"eu-north": 1.0}, "us": {"us-east": 1.0}},
        states={"eu-west": "failed", "us-east": "healthy", "eu-north": "healthy"},
    )
    srv = _records(plan.views["geo-a"], "SRV", SRV)
    assert not any("eu-west" in v for v in srv)
    assert _records(plan.views["geo-a"], "A", API) == {"192.0.2.20"}


def test_a_geography_without_an_answer_is_held_not_emptied() -> None:
    plan = _plan({"eu": {}, "us": {"us-east": 1.0}})
    assert plan.views["geo-a"].hold and plan.views["geo-a"].records == ()
    assert "no region serves" in plan.views["geo-a"].reason
    assert not plan.views["default"].hold


def test_the_generation_changes_only_with_the_records() -> None:
    first = _plan({"eu": {"eu-west": 1.0}, "us": {"us-east": 1.0}})
    previous = Generation(number=first.generation, fingerprint=first.fingerprint)
    same = _plan({"eu": {"eu-west": 1.0}, "us": {"us-east": 1.0}}, window=99, previous=previous)
    assert same.generation == first.generation == 7
    assert same.views == first.views
    moved = _plan({"eu": {"eu-north": 1.0}, "us": {"us-east": 1.0}}, window=12, previous=previous)
    assert moved.generation == 12 and moved.fingerprint != first.fingerprint
    assert moved.reason == "records changed"


@pytest.mark.parametrize(
    ("url", "host", "port", "ip"),
    [
        ("https://192.0.2.1", "192.0.2.1", 443, True),
        ("http://192.0.2.1", "192.0.2.1", 80, True),
        ("http://[2001:DB8::1]:8080/v1", "2001:db8::1", 8080, True),
        ("192.0.2.1:9000", "192.0.2.1", 9000, True),
        ("https://API.Example.com.", "api.example.com.", 443, False),
    ],
)
def test_endpoints_parse(url: str, host: str, port: int, ip: bool) -> None:
    assert dns_plan.parse_endpoint(url) == dns_plan.Endpoint(host=host, port=port, ip=ip)


def test_bad_endpoints_are_skipped() -> None:
    assert dns_plan.parse_endpoint("https://") is None
    assert dns_plan.parse_endpoint("http://host:notaport") is None


def test_diff_touches_only_managed_records() -> None:
    want = [RecordSet(name=API, rdtype="A", ttl_s=30, values=("192.0.2.1",))]
    have = [
        RecordSet(name=API, rdtype="A", ttl_s=60, values=("192.0.2.1",)),  # TTL differs
        RecordSet(name="eu-old.api.meridian.test.", rdtype="A", ttl_s=30, values=("192.0.2.9",)),
        RecordSet(name="www.meridian.test.", rdtype="A", ttl_s=30, values=("192.0.2.7",)),
        RecordSet(name=API, rdtype="TXT", ttl_s=30, values=('"x"',)),
    ]
    targets = {"eu-old.api.meridian.test."}
    changes = dns_plan.diff(want, have, names=NAMES, zone=ZONE, targets=targets)
    assert [(c.op, c.rrset.name, c.rrset.rdtype) for c in changes] == [
        ("replace", API, "A"),
        ("delete", "eu-old.api.meridian.test.", "A"),
    ]


def test_a_host_name_endpoint_below_the_service_is_never_managed() -> None:
    host = "eu-west.api.meridian.test."
    fleet = FleetDns(
        serving={"eu": {"eu-west": 1.0}, "us": {"us-east": 1.0}},
        endpoints={"eu-west": [f"https://{host}"], "us-east": ["https://192.0.2.30"]},
        preferences={"eu": ["eu-west", "us-east"], "us": ["us-east", "eu-west"]},
    )
    plan = dns_plan.plan(VIEWS, fleet=fleet, names=NAMES, window=1)
    eu = plan.views["geo-a"]
    assert eu.targets == {"us-east.api.meridian.test."}
    assert f"10 100 443 {host}" in _records(eu, "SRV", SRV)
    assert not _records(eu, "A", host)
    operators = RecordSet(name=host, rdtype="A", ttl_s=300, values=("203.0.113.7",))
    stray = RecordSet(name="www.api.meridian.test.", rdtype="A", ttl_s=30, values=("192.0.2.9",))
    changes = dns_plan.diff(
        eu.records, [*eu.records, operators, stray], names=NAMES, zone=ZONE, targets=eu.targets
    )
    assert changes == ()
    assert not dns_plan.managed(host, "A", names=NAMES, zone=ZONE, targets=eu.targets)


# -- invariants --------------------------------------------------------------------------------

REGIONS = ["eu-west", "eu-north", "us-east", "ap-south"]
STATES = ["healthy", "suspect", "failed", "recovering", "drained"]


@st.composite
def fleets(draw: st.DrawFn) -> FleetDns:
    serving: dict[str, dict[str, float]] = {}
    for geo in ("eu", "us"):
        members = draw(st.lists(st.sampled_from(REGIONS), unique=True, max_size=3))
        raw = {r: draw(st.floats(0.0, 1.0)) for r in members}
        total = sum(raw.values())
        serving[geo] = {r: s / total for r, s in raw.items() if s > 0} if total > 0 else {}
    endpoints = {
        r: draw(
            st.lists(
                st.sampled_from(
                    [
                        f"https://192.0.2.{i + 1}:{8000 + i}",
                        f"https://192.0.2.{i + 101}:{8000 + i}",  # same port: one SRV record
                        f"https://192.0.2.{i + 1}:{9000 + i}",
                        f"https://{r}-lb0.example.net",
                        f"https://{r}-lb1.example.net:8443",
                    ]
                ),
                min_size=1,
                max_size=4,
                unique=True,
            )
        )
        for i, r in enumerate(REGIONS)
        if draw(st.booleans()) or r in ("eu-west", "us-east")
    }
    states = {r: draw(st.sampled_from(STATES)) for r in REGIONS}
    prefs = {g: draw(st.permutations(REGIONS)) for g in ("eu", "us")}
    return FleetDns(serving=serving, states=states, endpoints=endpoints, preferences=prefs)


@settings(max_examples=200, deadline=None)
@given(fleet=fleets(), window=st.integers(0, 10_000), ttl=st.integers(0, 3600))
def test_invariants(fleet: FleetDns, window: int, ttl: int) -> None:
    plan = dns_plan.plan(VIEWS, fleet=fleet, names=NAMES, ttl_s=ttl, window=window)
    for spec in VIEWS:
        view = plan.views[spec.view]
        shares = {r: s for r, s in fleet.serving.get(spec.geo, {}).items() if s > 0}
        reachable = [r for r in shares if fleet.endpoints.get(r)]
        assert view.hold == (not reachable)
        if view.hold:
            assert view.records == ()
            continue
        assert all(r.ttl_s == ttl for r in view.records)
        srv: dict[str, tuple[int, int]] = {}
        records_of: dict[str, int] = {}
        for value in _records(view, "SRV", SRV):
            priority, weight, _port, target = value.split()
            region = target.split(".")[0].removesuffix("-lb0").removesuffix("-lb1")
            assert int(weight) >= 1 or int(priority) != dns_plan.PRIORITY_SERVING
            _, summed = srv.get(region, (int(priority), 0))
            srv[region] = (int(priority), summed + int(weight))
            records_of[region] = records_of.get(region, 0) + 1
        # every serving region with an endpoint is at the top priority, and its records'
        # weights sum to its share in percent, however many endpoints it has
        top = {r: w for r, (p, w) in srv.items() if p == dns_plan.PRIORITY_SERVING}
        assert set(top) == set(reachable)
        total = sum(shares[r] for r in reachable)
        for region, weight in top.items():
            share = dns_plan.region_weight(shares[region] / total)
            assert weight == max(share, records_of[region]), (region, weight, share)
        assert abs(sum(top.values()) - 100) <= sum(records_of[r] for r in top)
        # standbys are never failed or drained, never serving, and in preference order
        standby = sorted((p, r) for r, (p, w) in srv.items() if p != dns_plan.PRIORITY_SERVING)
        for _, region in standby:
            assert fleet.states.get(region) not in ("failed", "drained")
        order = [r for r in fleet.preferences[spec.geo] if r in dict((r, p) for p, r in standby)]
        assert [r for _, r in standby] == order
        # plain A records: exactly the serving regions' addresses
        want = {
            url.split("//")[1].split(":")[0]
            for r in reachable
            for url in fleet.endpoints[r]
            if url.startswith("https://192.")
        }
        assert _records(view, "A", API) == want
        txt = _records(view, "TXT", "_meridian.api.meridian.test.")
        assert txt == {f'"generation={plan.generation}" "geo={spec.geo}"'}
        # what the plan wants, the server already serving it, needs no change
        assert (
            dns_plan.diff(view.records, view.records, names=NAMES, zone=ZONE, targets=view.targets)
            == ()
        )
    # the same inputs with the previous generation: the same plan, no new generation
    again = dns_plan.plan(
        VIEWS,
        fleet=fleet,
        names=NAMES,
        ttl_s=ttl,
        window=window + 1,
        previous=Generation(number=plan.generation, fingerprint=plan.fingerprint),
    )
    assert (again.generation, again.fingerprint, again.views) == (
        plan.generation,
        plan.fingerprint,
        plan.views,
    )


@settings(max_examples=200, deadline=None)
@given(
    want=st.lists(
        st.builds(
            RecordSet,
            name=st.sampled_from([API, "a.api.meridian.test.", "b.api.meridian.test."]),
            rdtype=st.just("A"),
            ttl_s=st.sampled_from([30, 60]),
            values=st.lists(
                st.sampled_from(["192.0.2.1", "192.0.2.2", "192.0.2.3"]), min_size=1, unique=True
            ).map(lambda v: tuple(sorted(v))),
        ),
        unique_by=lambda r: r.key,
    ),
    have=st.lists(
        st.builds(
            RecordSet,
            name=st.sampled_from([API, "a.api.meridian.test.", "c.api.meridian.test."]),
            rdtype=st.just("A"),
            ttl_s=st.sampled_from([30, 60]),
            values=st.lists(
                st.sampled_from(["192.0.2.1", "192.0.2.4"]), min_size=1, unique=True
            ).map(lambda v: tuple(sorted(v))),
        ),
        unique_by=lambda r: r.key,
    ),
)
def test_applying_the_diff_gives_the_desired_records(
    want: list[RecordSet], have: list[RecordSet]
) -> None:
    served = {r.key: r for r in have}
    targets = {"a.api.meridian.test.", "b.api.meridian.test.", "c.api.meridian.test."}
    for change in dns_plan.diff(want, have, names=NAMES, zone=ZONE, targets=targets):
        if change.op == "delete":
            served.pop(change.rrset.key)
        else:
            served[change.rrset.key] = change.rrset
    assert served == {r.key: r for r in want}
