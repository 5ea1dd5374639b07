"""policies.model: ``node_view`` makes the value ``NodeView(...)`` makes, and stays frozen;
``decision_later`` writes its reason once, when first read, and is a ``Decision`` otherwise."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
from hypothesis import given
from hypothesis import strategies as st

from policies.model import (
    AdminState,
    Decision,
    Health,
    NodeId,
    NodeView,
    Telemetry,
    decision_later,
    node_view,
)

_telemetry = st.none() | st.builds(
    Telemetry,
    age_s=st.floats(0, 60),
    running=st.integers(0, 256),
    waiting=st.integers(0, 256),
    kv_util=st.floats(0, 1),
    prefix_hit_rate=st.none() | st.floats(0, 1),
    block_size=st.none() | st.integers(1, 64),
)

_fields = st.fixed_dictionaries(
    {
        "node_id": st.text(min_size=1, max_size=12).map(NodeId),
        "models": st.frozensets(st.text(max_size=8), max_size=3),
        "admin": st.sampled_from(AdminState),
        "health": st.sampled_from(Health),
        "weight": st.floats(1e-6, 100),
        "in_flight": st.integers(0, 1000),
        "in_flight_tokens": st.integers(0, 10**7),
        "prefill_tokens": st.integers(0, 10**7),
        "slots": st.integers(0, 1000),
        "slow_start": st.floats(0, 1),
        "telemetry": _telemetry,
    }
)


def test_node_view_takes_every_field_of_the_class() -> None:
    """A field added to ``NodeView`` must be added to ``node_view`` too (else its slot stays
    unset, and reading it raises)."""
    taken = set(inspect.signature(node_view).parameters)
    assert taken == {f.name for f in dataclasses.fields(NodeView)}


@given(fields=_fields)
def test_node_view_makes_the_value_the_constructor_makes(fields: dict[str, object]) -> None:
    built = node_view(**fields)  # type: ignore[arg-type]
    made = NodeView(**fields)  # type: ignore[arg-type]
    assert type(built) is NodeView
    assert built == made
    assert hash(built) == hash(made)
    assert dataclasses.asdict(built) == dataclasses.asdict(made)
    assert dataclasses.replace(built, in_flight=built.in_flight + 1).in_flight == made.in_flight + 1


def test_a_node_view_stays_frozen() -> None:
    made = NodeView(node_id=NodeId("n1"), models=frozenset({"m"}))
    view = node_view(**{f.name: getattr(made, f.name) for f in dataclasses.fields(made)})
    with pytest.raises(dataclasses.FrozenInstanceError):
        view.in_flight = 1  # type: ignore[misc]


def test_a_later_reason_is_written_once_when_read_and_the_decision_is_a_decisions_value() -> None:
    written: list[tuple[object, ...]] = []

    def write(*args: object) -> str:
        written.append(args)
        return f"meridian: prefix {args[0]}, in flight {args[1]}"

    later = decision_later(NodeId("n2"), "meridian", write, "50%", 3, expected_hit_tokens=32)
    assert isinstance(later, Decision)
    assert (later.node, later.expected_hit_tokens, later.trial) == ("n2", 32, False)
    assert later.tag == "meridian"
    assert written == []  # the tag, what the agent counts, writes nothing
    assert later.reason == "meridian: prefix 50%, in flight 3"
    assert later.reason == "meridian: prefix 50%, in flight 3"
    plain = Decision(
        node=NodeId("n2"), reason="meridian: prefix 50%, in flight 3", expected_hit_tokens=32
    )
    assert repr(later) == repr(plain)
    assert later == plain and plain == later and hash(later) == hash(plain)
    assert later != dataclasses.replace(plain, trial=True)
    assert written == [("50%", 3)]  # once
    twin = decision_later(NodeId("n2"), "meridian", write, "50%", 3, expected_hit_tokens=32)
    assert twin == later and hash(twin) == hash(later)
    other = decision_later(NodeId("n2"), "meridian", write, "60%", 3, expected_hit_tokens=32)
    assert other != later
    claimed = dataclasses.replace(later, reason=f"sibling-claim: {later.reason}")
    assert claimed.reason == "sibling-claim: meridian: prefix 50%, in flight 3"
    assert claimed.tag == "sibling-claim"
    assert (claimed.node, claimed.expected_hit_tokens) == ("n2", 32)
    with pytest.raises(dataclasses.FrozenInstanceError):
        later.reason = "changed"  # type: ignore[misc]


def test_a_decisions_tag_is_its_reason_up_to_the_first_colon() -> None:
    assert Decision(node=None, reason="no candidates: every node is full").tag == "no candidates"
    assert Decision(node=NodeId("n1"), reason="round_robin").tag == "round_robin"
