"""The package's imports run one way: no cycle between its parts (``fusemla.ops``,
``fusemla.reference``, ``fusemla.contracts``, ``fusemla.rope``, ...), lazy imports inside
functions included, and the references never import a kernel."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "fusemla"


def _unit(module: str) -> str:
    return ".".join(module.split(".")[:2])


def _graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for path in PKG.rglob("*.py"):
        module = ".".join(path.relative_to(PKG.parent).with_suffix("").parts)
        module = module.removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            for t in targets:
                if t.startswith("fusemla.") and _unit(t) not in (_unit(module), "fusemla"):
                    edges.setdefault(_unit(module), set()).add(_unit(t))
    return edges


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(u: str, path: list[str]) -> list[str] | None:
        state[u] = 1
        for v in sorted(edges.get(u, ())):
            if state.get(v) == 1:
                return path[path.index(v) :] + [v]
            if v not in state and (found := visit(v, path + [v])):
                return found
        state[u] = 2
        return None

    for u in sorted(edges):
        if u not in state and (found := visit(u, [u])):
            return found
    return None


def test_no_import_cycle_between_the_packages_parts():
    cycle = _cycle(_graph())
    assert cycle is None, " -> ".join(cycle)


def test_the_reference_imports_no_kernel_and_the_contract_stands_below_both():
    edges = _graph()
    assert "fusemla.ops" not in edges.get("fusemla.reference", set())
    assert not edges.get("fusemla.contracts", set()) & {"fusemla.ops", "fusemla.reference"}
    assert (
        "fusemla.contracts" in edges["fusemla.ops"]
        and "fusemla.contracts" in edges["fusemla.reference"]
    )


def test_the_cycle_finder_finds_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}}) is None
