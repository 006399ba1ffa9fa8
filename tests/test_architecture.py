"""The import structure of docs/architecture.md, read from the source with ast (nothing is imported):
arrows point down the layers, and no module imports itself back through others.

Every import counts, also one inside a function or under TYPE_CHECKING: a late import hides an arrow
from the interpreter, not from the design.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("model", "data", "config", "fsdp_utils")
TOP_LEVEL = ("model", "data", "config", "fsdp_utils", "scripts", "benchmarks", "train_fsdp", "tests")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    return {module_name(path): path for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))}


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules (or packages) that the module `name` at `path` imports."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the package, one level up per extra dot
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            # `from package import submodule` imports the submodule; `from module import name`, the module.
            submodules = {f"{source}.{alias.name}" for alias in node.names} & modules.keys()
            found.update(submodules or {source})
    return {target for target in found if target.split(".")[0] in TOP_LEVEL and target != name}


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def _offenders(graph: dict[str, set[str]], importer: str, forbidden: tuple[str, ...]) -> list[str]:
    return sorted(f"{name} imports {target}" for name, targets in graph.items() if name.split(".")[0] == importer
                  for target in targets if target.split(".")[0] in forbidden)


def test_the_resolver_sees_relative_and_package_imports(graph):
    # Known arrows, one of each kind of import statement, so an empty graph cannot pass the rules below.
    assert "model.config" in graph["model.transformer"]  # from .config import ModelConfig
    assert "fsdp_utils.distributed" in graph["fsdp_utils.parallel.build"]  # from ..distributed import DistEnv
    assert "fsdp_utils.parallel.hf" in graph["fsdp_utils.parallel.build"]  # from . import hf
    assert "model" in graph["config.sections"]  # from model import ModelConfig


@pytest.mark.parametrize(("importer", "forbidden"), [
    # model/ (torch only; tests/test_model.py also checks it never touches torch.distributed)
    ("model", ("data", "config", "fsdp_utils", "scripts", "benchmarks", "train_fsdp")),
    ("data", ("model", "config", "fsdp_utils", "scripts", "benchmarks", "train_fsdp")),
    ("config", ("fsdp_utils", "scripts", "benchmarks", "train_fsdp")),
    ("fsdp_utils", ("scripts", "benchmarks", "train_fsdp", "tests")),
])
def test_no_upward_arrows(graph, importer, forbidden):
    assert _offenders(graph, importer, forbidden) == []


def test_no_import_cycles(graph):
    # Depth-first search for a back edge; the path to it is the cycle to report.
    state: dict[str, str] = {}  # name -> "open" while on the path, "done" after

    def visit(name: str, path: list[str]) -> list[str] | None:
        state[name] = "open"
        for target in sorted(graph.get(name, ())):
            if state.get(target) == "open":
                return path[path.index(target):] + [target]  # "open" means on the current path
            if target in graph and target not in state:
                cycle = visit(target, path + [target])
                if cycle:
                    return cycle
        state[name] = "done"
        return None

    for name in sorted(graph):
        if name not in state:
            cycle = visit(name, [name])
            assert cycle is None, " -> ".join(cycle)
