"""``bounded_candidates.py``: the bounded sets it runs, and a clear error for a malformed one."""

from __future__ import annotations

import _fleet
import bounded_candidates
import pytest

from policies import routing


def test_a_task_sets_only_the_bounds_it_names() -> None:
    default = routing.RoutingConfig()
    task = _fleet.Task("bounded", "meridian", 64, 0.8, 1.0, None, 0)
    assert _fleet._routing_config(task) == default
    both = _fleet._routing_config(
        _fleet.Task("bounded", "meridian", 64, 0.8, 1.0, None, 0, candidates=8, sampled=6)
    )
    assert (both.meridian_candidates, both.meridian_sampled) == (8, 6)
    assert both.meridian_prefix_weight == default.meridian_prefix_weight
    exact = _fleet._routing_config(
        _fleet.Task("bounded", "meridian", 64, 0.8, 1.0, None, 0, candidates=0)
    )
    assert (exact.meridian_candidates, exact.meridian_sampled) == (0, default.meridian_sampled)


@pytest.mark.parametrize("bounds", ["16", "16x", "16x0", "axb", "16x8x2"])
def test_a_malformed_bound_is_refused_with_what_to_give(
    bounds: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        bounded_candidates.main(["--bounds", bounds])
    assert exit_.value.code == 2
    assert "HOLDERSxDRAWN" in capsys.readouterr().err
