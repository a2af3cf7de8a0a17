"""No import cycle anywhere in src/ (STYLE.md). The graph is grimp's (import-linter's own
engine), which also counts imports made inside functions: a lazy import still couples two
modules both ways. The layering itself is held by the contracts in pyproject.toml."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import grimp
import pytest

pytestmark = pytest.mark.pure_pass_only(
    reason="grimp's import graph of the source; nothing of the package runs"
)


def strongly_connected(
    nodes: Iterable[str], edges: Callable[[str], Iterable[str]]
) -> list[list[str]]:
    """Tarjan's algorithm, iterative: every group of two or more modules that import each
    other, directly or through one another."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    groups: list[list[str]] = []
    counter = 0
    for root in sorted(nodes):
        if root in index:
            continue
        work: list[tuple[str, list[str]]] = [(root, sorted(edges(root)))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, pending = work[-1]
            if pending:
                child = pending.pop()
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, sorted(edges(child))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    groups.append(sorted(group))
    return groups


def cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    return strongly_connected(graph.modules, graph.find_modules_directly_imported_by)


def describe(graph: grimp.ImportGraph, group: list[str]) -> str:
    first, second = group[0], group[1]
    there = graph.find_shortest_chain(importer=first, imported=second) or ()
    back = graph.find_shortest_chain(importer=second, imported=first) or ()
    return " -> ".join(there) + " ; " + " -> ".join(back)


def test_src_has_no_import_cycle() -> None:
    graph = grimp.build_graph("fallback_mw", cache_dir=None)
    found = cycles(graph)
    assert not found, "import cycles: " + " | ".join(describe(graph, g) for g in found)


def test_the_check_sees_a_planted_cycle() -> None:
    # The negative control: the same check over the real graph with one import planted
    # against the flow (the config loader importing the command tree) must fail.
    graph = grimp.build_graph("fallback_mw", cache_dir=None)
    assert graph.chain_exists(importer="fallback_mw.cli", imported="fallback_mw.config")
    graph.add_import(importer="fallback_mw.config", imported="fallback_mw.cli")
    found = cycles(graph)
    assert any({"fallback_mw.cli", "fallback_mw.config"} <= set(group) for group in found)


def test_strongly_connected_on_small_graphs() -> None:
    edges = {"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"], "e": ["e"]}
    assert strongly_connected(edges, lambda n: edges.get(n, [])) == [["a", "b", "c"]]
    line = {"a": ["b"], "b": ["c"], "c": []}
    assert strongly_connected(line, lambda n: line[n]) == []
