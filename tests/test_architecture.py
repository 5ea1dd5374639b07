"""The import graph of Meridian's packages has no circle (import-linter's contracts in
pyproject.toml forbid the upward arrows; a circle inside one layer would slip past them)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[1]


def _packages() -> list[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages: list[str] = config["tool"]["importlinter"]["root_packages"]
    return packages


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_of_ours_imports_itself_back_through_others() -> None:
    packages = _packages()
    graph = grimp.build_graph(*packages)
    edges = {
        m: {i for i in graph.find_modules_directly_imported_by(m) if i.split(".")[0] in packages}
        for m in graph.modules
        if m.split(".")[0] in packages
    }
    assert len(edges) > 100  # the graph holds the whole repository
    assert _cycles(edges) == []
