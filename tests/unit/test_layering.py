"""The package's rooms depend on each other one way (docs/architecture.md, "Stages").

Read from the source with `ast`, every import counted, those inside functions too: a module
imported lazily is still a dependency, and two modules that import each other are one module.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("jaxserve", "service", "checkpoints", "pallas_kernels")


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if "gen" in path.relative_to(ROOT).parts:
                continue  # generated gRPC stubs
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def _imports(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """The project modules `path` imports (`from pkg import mod` resolves to pkg.mod)."""
    out = set()
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(path, name, modules) for name, path in modules.items()}


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for dep in graph[todo.pop()]:
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


def test_no_two_modules_import_each_other_directly_or_through_others():
    graph = _graph()
    cycles = sorted(
        {
            tuple(sorted(m for m in _reachable(graph, name) if name in _reachable(graph, m)))
            for name in graph
            if name in _reachable(graph, name)
        }
    )
    assert not cycles, f"Modules in an import cycle (each reaches the others): {cycles}"


def test_the_engine_core_imports_nothing_from_the_rooms_above_it():
    graph = _graph()
    above = (
        "jaxserve.engine.calibration",
        "jaxserve.engine.build",
        "jaxserve.bench",
        "jaxserve.cli",
        "jaxserve.jobs",
        "service",
    )
    reached = _reachable(graph, "jaxserve.engine.core")
    bad = sorted(m for m in reached if m.startswith(above))
    assert not bad, f"jaxserve.engine.core reaches modules above the engine: {bad}"


def test_scheduling_imports_no_engine_runtime_or_model_module():
    graph = _graph()
    for name in graph:
        if name.startswith("jaxserve.scheduling"):
            bad = sorted(
                m
                for m in _reachable(graph, name)
                if m.startswith(("jaxserve.engine", "jaxserve.runtime", "jaxserve.models"))
            )
            assert not bad, f"{name} reaches {bad}: scheduling sits below the runtime"


def test_models_and_kernels_import_nothing_from_the_stages_above():
    graph = _graph()
    above = (
        "jaxserve.runtime",
        "jaxserve.scheduling",
        "jaxserve.engine",
        "jaxserve.bench",
        "jaxserve.cli",
        "jaxserve.jobs",
        "service",
        "checkpoints",
    )
    for name in graph:
        if name.startswith(
            (
                "jaxserve.models",
                "pallas_kernels.ragged_paged_attention",
                "pallas_kernels.grouped_matmul",
            )
        ):
            bad = sorted(m for m in _reachable(graph, name) if m.startswith(above))
            assert not bad, f"{name} reaches {bad}"
