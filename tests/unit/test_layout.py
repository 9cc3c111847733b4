"""The package's shape: no import cycles, and the pipeline readable off the file tree.

Every import counts as a dependency, wherever it is written: at module level, inside a function (a late
import is still a dependency, only a hidden one) or under `if TYPE_CHECKING:`.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "fp8convert"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that `name` imports. `from X import Y` depends on X.Y when that is a module
    (importing a submodule), else on X; a parent package's __init__ is not counted as a dependency of
    its submodules (it runs first, but it is the submodule's container, not its import)."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in modules else target)
    return {m for m in found if m in modules and m != name}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def import_graph() -> dict[str, set[str]]:
    modules = package_modules()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_cycles(tmp_path):
    # the walker sees imports inside functions and under TYPE_CHECKING, and reports a cycle through them
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    source = (
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .plan import plan\n"
        "def f():\n    from ..run import writer\n"
    )
    modules = {
        "fp8convert.x.y": None,
        "fp8convert.x.plan.plan": None,
        "fp8convert.x.plan": None,
        "fp8convert.run.writer": None,
        "fp8convert.run": None,
    }
    probe = tmp_path / "y.py"
    probe.write_text(source)
    assert imports_of("fp8convert.x.y", probe, modules) == {"fp8convert.x.plan.plan", "fp8convert.run.writer"}


def test_the_pipeline_stages_are_packages():
    modules = package_modules()
    for stage in ("source", "plan", "run", "output", "formats", "cluster", "cli"):
        assert f"fp8convert.{stage}" in modules, f"fp8convert/{stage}/ is missing"
    # `fp8convert.plan` and `fp8convert.verify` are modules; the API's functions have names of their own
    import fp8convert
    import fp8convert.plan
    import fp8convert.verify

    assert fp8convert.plan.__name__ == "fp8convert.plan" and callable(fp8convert.make_plan)
    assert fp8convert.verify.__name__ == "fp8convert.verify" and callable(fp8convert.verify.verify)
