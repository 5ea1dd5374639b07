"""policies.discovery: node ids of discovered endpoints and the plan for one DNS answer."""

from __future__ import annotations

import pytest

from policies.discovery import Held, Plan, apply_empty, endpoint, plan
from policies.model import NodeId

A, B, C = NodeId("10.0.0.1:8000"), NodeId("10.0.0.2:8000"), NodeId("10.0.0.3:8000")


def _answer(*ids: NodeId) -> dict[NodeId, str]:
    return {i: f"http://{i}" for i in ids}


def _held(node_id: NodeId, *, draining: bool = False, ours: bool = True, busy: int = 0) -> Held:
    return Held(
        node_id=node_id,
        draining=draining,
        drained_by_discovery=draining and ours,
        in_flight=busy,
    )


@pytest.mark.parametrize(
    ("scheme", "address", "port", "node_id", "url"),
    [
        ("http", "10.0.0.5", 8000, "10.0.0.5:8000", "http://10.0.0.5:8000"),
        ("https", "fd00::5", 443, "fd00::5:443", "https://[fd00::5]:443"),
        ("http", "FD00:0:0::5", 8000, "fd00::5:8000", "http://[fd00::5]:8000"),  # one spelling
    ],
)
def test_an_endpoint_is_address_port_with_the_url_of_that_address(
    scheme: str, address: str, port: int, node_id: str, url: str
) -> None:
    assert endpoint(scheme, address, port) == (node_id, url)


@pytest.mark.parametrize(
    ("args", "message"),
    [(("ftp", "10.0.0.1", 1), "scheme"), (("http", "vllm", 1), "IP"), (("http", "::1", 0), "port")],
)
def test_an_endpoint_refuses_what_is_no_node_address(
    args: tuple[str, str, int], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        endpoint(*args)


def test_new_endpoints_are_added_and_ids_held_elsewhere_are_skipped() -> None:
    got = plan(_answer(A, B, C), [_held(A)], taken={B})
    assert got.add == ((C, f"http://{C}"),)
    assert got.skipped == (B,)
    assert not (got.drain or got.remove or got.undrain or got.handover)


def test_a_node_that_left_is_drained_then_removed_once_nothing_is_in_flight() -> None:
    assert plan(_answer(A), [_held(A), _held(B, busy=3)], taken=()).drain == (B,)
    assert plan(_answer(A), [_held(A), _held(B, draining=True, busy=3)], taken=()) == Plan()
    assert plan(_answer(A), [_held(A), _held(B, draining=True)], taken=()).remove == (B,)


def test_a_node_back_in_dns_is_undrained_unless_an_admin_drained_it() -> None:
    assert plan(_answer(A), [_held(A, draining=True)], taken=()).undrain == (A,)
    assert plan(_answer(A), [_held(A, draining=True, ours=False)], taken=()) == Plan()
    # an admin's drain of a node that then leaves DNS: removed once empty
    assert plan({}, [_held(A, draining=True, ours=False)], taken=()).remove == (A,)


def test_a_node_another_source_still_has_is_handed_over_not_drained() -> None:
    got = plan(_answer(A), [_held(A), _held(B, busy=1)], taken=(), elsewhere={B})
    assert got.handover == (B,)
    assert not got.drain and not got.remove
    assert got.changes


def test_an_unchanged_answer_changes_nothing() -> None:
    got = plan(_answer(A, B), [_held(A), _held(B, busy=2)], taken={C})
    assert got == Plan()
    assert not got.changes


@pytest.mark.parametrize(
    ("consecutive", "empty_after", "applied"),
    [(1, 0, False), (100, 0, False), (1, 3, False), (2, 3, False), (3, 3, True), (4, 3, True)],
)
def test_an_empty_answer_is_applied_only_after_empty_after_in_a_row(
    consecutive: int, empty_after: int, applied: bool
) -> None:
    assert apply_empty(consecutive, empty_after=empty_after) is applied
