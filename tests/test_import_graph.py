"""No import cycle inside ``specdec`` (issue 30): every ``import`` of a specdec module, at module
level or inside a function, is an edge; the graph of modules must be acyclic. A package's
``__init__`` counts as a module of its own, so a submodule importing from its own package while
that package imports it is a cycle too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "specdec"


def module_name(path: Path) -> str:
    parts = ["specdec", *path.relative_to(ROOT).with_suffix("").parts]
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in ROOT.rglob("*.py")}


def imported_modules(path: Path, known: dict[str, Path]) -> set[str]:
    """The specdec modules that ``path`` imports anywhere in its body."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            # "from pkg import sub" imports the submodule when there is one, else a name of pkg
            targets = [f"{origin}.{alias.name}" if f"{origin}.{alias.name}" in known else origin
                       for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # "specdec.a.b.name" -> the module that holds it
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_cycle_finder_finds_a_cycle_and_passes_a_tree():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_relative_imports_resolve_to_modules():
    known = modules()
    edges = imported_modules(ROOT / "compiled_attention.py", known)
    assert "specdec.attention_metadata" in edges and "specdec.cache" in edges


def test_no_import_cycle_inside_specdec():
    known = modules()
    graph = {name: imported_modules(path, known) for name, path in known.items()}
    cycle = find_cycle(graph)
    if cycle:
        pytest.fail("import cycle: " + " -> ".join(cycle))


LOOP = {"specdec.generate", "specdec.engine", "specdec.runner", "specdec.replay"}
PROFILING = {"specdec.policies.profiling", "specdec.policies.batch_profile"}  # profiling runs the loop


def test_the_policies_do_not_import_the_loop():
    """DESIGN.md: measurement helpers (profiling, cost-model fits) may import the decoding loop,
    the policies may not. Every module of specdec.policies but the profiling ones and the
    package's __init__ reaches no loop module, following imports but not through the profiling
    modules."""
    known = modules()
    graph = {name: imported_modules(path, known) for name, path in known.items()}
    policies = [n for n in known if n.startswith("specdec.policies.") and n not in PROFILING]
    assert "specdec.policies.goodput" in policies and "specdec.policies.bandit" in policies
    for name in policies:
        seen, todo = set(), [name]
        while todo:
            for nxt in graph[todo.pop()] - seen:
                seen.add(nxt)
                if nxt not in PROFILING:
                    todo.append(nxt)
        assert not seen & LOOP, (name, sorted(seen & LOOP))
