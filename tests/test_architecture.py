"""The package's layering, checked from the source: no import cycle, no kind-name branching.

Imports are read from the AST, so function-local imports count as much as module-level ones.
"""

from __future__ import annotations

import ast
import importlib
import os
import pkgutil
from collections import defaultdict

import pytest

import tvmamp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Repository folder -> import name (pyproject's package-dir mapping).
FOLDERS = {
    "tvmamp": "tvmamp",
    "relay_passes": "tvmamp.relay_passes",
    "schedules": "tvmamp.schedules",
    "targets": "tvmamp.targets",
}
# Only these folders may know target kinds by name.
KIND_AWARE = ("tvmamp.targets", "tvmamp.schedules")
KIND_NAMES = {"llvm", "c", "cuda", "npu", "rocm", "metal", "vulkan", "opencl"}


def _modules() -> dict[str, str]:
    """Import name -> source path of every module of the package."""
    modules = {}
    for folder, package in FOLDERS.items():
        base = os.path.join(ROOT, folder)
        for dirpath, dirnames, files in os.walk(base):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            for file in files:
                if not file.endswith(".py"):
                    continue
                parts = os.path.relpath(os.path.join(dirpath, file), base)[:-3].split(os.sep)
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                modules[".".join([package, *parts])] = os.path.join(dirpath, file)
    return modules


MODULES = _modules()


def _owner(name: str) -> str | None:
    """The module that ``name`` (a module or a name inside one) lives in."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imported(name: str, path: str) -> set[str]:
    """The package modules that ``name`` imports anywhere in its source."""
    tree = ast.parse(open(path).read())
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(_owner(alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            for alias in node.names:
                full = f"{module}.{alias.name}"
                found.add(full if full in MODULES else _owner(module))
    found.discard(None)
    found.discard(name)
    return found


def _graph() -> dict[str, set[str]]:
    # The top-level tvmamp/__init__.py re-exports the public API and may import anything.
    return {
        name: {m for m in _imported(name, path) if m != "tvmamp"}
        for name, path in MODULES.items()
        if name != "tvmamp"
    }


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
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
                    out.append(sorted(component))
    return out


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle():
    cycles = _cycles(_graph())
    assert not cycles, "import cycles (function-local imports included):\n" + "\n".join(
        " <-> ".join(c) for c in cycles
    )


def _public_packages():
    for name, path in sorted(MODULES.items()):
        if path.endswith("__init__.py"):
            yield name


@pytest.mark.parametrize("package", list(_public_packages()))
def test_no_public_name_shadows_a_submodule(package):
    module = importlib.import_module(package)
    submodules = {info.name for info in pkgutil.iter_modules(module.__path__)}
    clashes = sorted(
        name
        for name in submodules
        if not name.startswith("_")
        and hasattr(module, name)
        and not isinstance(getattr(module, name), type(tvmamp))
    )
    assert not clashes, f"{package}: public names that are also submodules: {clashes}"


def _kind_comparisons(path: str) -> list[str]:
    """Lines that compare something with a target kind name, or read ``.kind.name`` to branch."""
    tree = ast.parse(open(path).read())
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        strings = set()
        for operand in operands:
            elements = operand.elts if isinstance(operand, (ast.Tuple, ast.List, ast.Set)) else []
            for value in [operand, *elements]:
                if isinstance(value, ast.Constant) and isinstance(value.value, str):
                    strings.add(value.value)
        reads_kind = any(
            "target" in text and "kind.name" in text for text in map(ast.unparse, operands)
        )
        if reads_kind or strings & KIND_NAMES:
            lines.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}: {ast.unparse(node)}")
    return lines


def test_kind_finder_sees_a_branch(tmp_path):
    source = tmp_path / "x.py"
    source.write_text(
        "if target.kind.name == 'cuda':\n    pass\n"
        "ok = kind in ('llvm', 'c')\n"
        "if exe.target.kind.name != other:\n    pass\n"
        "if inst.kind.name == 'SampleCategorical':\n    pass\n"
    )
    assert len(_kind_comparisons(str(source))) == 3


def test_only_targets_and_schedules_branch_on_kind_names():
    found = []
    for name, path in sorted(MODULES.items()):
        if not name.startswith(KIND_AWARE):
            found += _kind_comparisons(path)
    assert not found, "kind-name branches outside targets/ and schedules/:\n" + "\n".join(found)


def test_layers_import_one_way():
    """search, tuning and debugging build through the pipeline, never through the driver."""
    graph = _graph()
    driver = {m for m in MODULES if m.startswith("tvmamp.commands") or m == "tvmamp.driver"}
    features = [
        m for m in graph if m.startswith(("tvmamp.search", "tvmamp.tuning", "tvmamp.debugging"))
    ]
    wrong = sorted(f"{m} -> {d}" for m in features for d in graph[m] & driver)
    assert not wrong, "\n".join(wrong)
    below = ("tvmamp.conversion", "tvmamp.pipeline")  # tvmamp.convert is the function
    assert set(below) <= set(graph), f"missing core modules: {set(below) - set(graph)}"
    upward = defaultdict(list)
    for m in below:
        for d in graph[m]:
            if d.startswith(("tvmamp.search", "tvmamp.tuning", "tvmamp.debugging")) or d in driver:
                upward[m].append(d)
    assert not upward, dict(upward)
