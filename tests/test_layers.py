"""The import graph of ``ar_torchrl``: no circle between modules or packages, and no upward arrow.

Every ``import``/``from ... import`` of an ``ar_torchrl`` module is read from the source (function-level
imports included; ``if TYPE_CHECKING:`` blocks excluded: they never run). :data:`LAYERS` is the floor
plan of docs/design.md section 2, from the ground up: a package may import from its own floor or
below, never from above. Run ``python -m pytest tests/test_layers.py -q`` to check a change; a
failure lists each offending import with its file.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "ar_torchrl"

#: Floors, from the ground up (sub-packages of ``ar_torchrl``; ``""`` is ``ar_torchrl/__init__.py``).
LAYERS: list[set[str]] = [
    {"_compat", "registry", "utils", "_lazy"},  # plumbing: no torch at import
    {"functional", "data", "tools", "weight_sync"},  # pure math, rollout records, tool protocol
    {"modules", "rewards", "models"},  # value head / actor-critic, verifiable rewards, model zoo
    {"backends", "training", "objectives"},  # engines; the plan + update; advantages and the loss
    {"envs", "distributed"},  # TorchRL envs over an engine; FSDP2
    {"checkpoint", "interop", "collectors"},  # stores; bridges to TorchRL's LLM stack; collectors
    {"recipes"},  # run management and the DAPO-PPO recipe
    {""},
]


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    tree = ast.parse(path.read_text())
    skipped = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for n in ast.walk(node)
    }
    out = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                target = full if full in modules else node.module
                if target in modules:
                    out.add(target)
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(path, modules) - {name} for name, path in modules.items()}


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_circle_between_modules():
    assert _cycles(_graph()) == []


def test_no_circle_between_packages():
    packages: dict[str, set[str]] = defaultdict(set)
    for module, targets in _graph().items():
        packages[_package(module)].update(_package(t) for t in targets)
    for name, targets in packages.items():
        targets.discard(name)
    assert _cycles(packages) == []


def _upward(graph: dict[str, set[str]]) -> list[str]:
    floor = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}
    return [
        f"{module} -> {target}"
        for module, targets in sorted(graph.items())
        for target in sorted(targets)
        if floor[_package(target)] > floor[_package(module)]
    ]


def test_every_import_goes_to_its_own_floor_or_below():
    graph = _graph()
    placed = {pkg for layer in LAYERS for pkg in layer}
    unplaced = sorted({_package(m) for m in graph} - placed)
    assert not unplaced, f"packages without a floor in LAYERS: {unplaced}"
    upward = _upward(graph)
    assert not upward, "imports from a higher floor:\n" + "\n".join(upward)


def test_the_checker_sees_a_circle_and_an_upward_arrow():
    """The checks can fail: a planted circle and a planted upward import are found."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    graph = _graph()
    graph["ar_torchrl.data.trajectory"].add("ar_torchrl.recipes.launch")
    assert _upward(graph) == ["ar_torchrl.data.trajectory -> ar_torchrl.recipes.launch"]
