"""The import structure of docs/architecture.md, read from the source with ast (nothing is imported):
arrows point down the layers, and no module imports itself back through others.

Every import counts, also one inside a function or under TYPE_CHECKING: a late import hides an arrow
from the interpreter, not from the design.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The entry points besides train_fsdp.py are read too: scripts/ (the users' tools) and benchmarks/.
PACKAGES = ("safe_io", "model", "data", "config", "fsdp_utils", "scripts", "benchmarks")
ENTRY_POINTS = ("scripts", "benchmarks", "train_fsdp")
TOP_LEVEL = ("safe_io", "model", "data", "config", "fsdp_utils", *ENTRY_POINTS, "tests")


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
    assert "safe_io.nofollow" in graph["data.store"]  # from safe_io import nofollow


@pytest.mark.parametrize(("importer", "forbidden"), [
    # safe_io/, the floor: nothing of the project (test_the_floor_imports_the_standard_library_alone)
    ("safe_io", tuple(name for name in TOP_LEVEL if name != "safe_io")),
    # model/ (torch only; tests/test_model.py also checks it never touches torch.distributed)
    ("model", ("safe_io", "data", "config", "fsdp_utils", *ENTRY_POINTS)),
    ("data", ("model", "config", "fsdp_utils", *ENTRY_POINTS)),
    ("config", ("fsdp_utils", *ENTRY_POINTS)),
    ("fsdp_utils", (*ENTRY_POINTS, "tests")),
    # the users' tools stand without the benchmarks (which may measure them); neither needs the tests
    ("scripts", ("benchmarks", "tests")),
    # the benchmarks build the run through fsdp_utils (build_run), as the training script does, not from the script
    ("benchmarks", ("tests", "train_fsdp")),
])
def test_no_upward_arrows(graph, importer, forbidden):
    assert _offenders(graph, importer, forbidden) == []


def room(module: str) -> str:
    """fsdp_utils' room of a module (fsdp_utils.train, fsdp_utils.distributed, ...); another package's name."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "fsdp_utils" and len(parts) > 1 else parts[0]


# fsdp_utils' rooms and the rooms each may use: its floor (process group, host memory) under all; parallel/ may
# read a checkpoint's weights for a model it builds; the loop's parts (train/) use every room.
FLOOR = {"fsdp_utils.distributed", "fsdp_utils.host_memory"}
ROOMS = {
    "fsdp_utils.distributed": set(),
    "fsdp_utils.host_memory": set(),
    "fsdp_utils.checkpoint": FLOOR,
    "fsdp_utils.parallel": FLOOR | {"fsdp_utils.checkpoint"},
    "fsdp_utils.observability": FLOOR,
    "fsdp_utils.evaluation": FLOOR,
    "fsdp_utils.guards": FLOOR,
    "fsdp_utils.train": FLOOR | {"fsdp_utils.checkpoint", "fsdp_utils.parallel", "fsdp_utils.observability",
                                 "fsdp_utils.evaluation", "fsdp_utils.guards"},
}


def test_each_room_of_fsdp_utils_uses_only_the_rooms_below_it(graph):
    rooms = {room(name) for name in graph if name.startswith("fsdp_utils.")}
    assert rooms == set(ROOMS), "a room of fsdp_utils/ that the rules do not know: add it to ROOMS"
    offenders = sorted(f"{name} imports {target}" for name, targets in graph.items() if name.startswith("fsdp_utils.")
                       for target in targets if target.startswith("fsdp_utils.") and room(target) != room(name)
                       and room(target) not in ROOMS[room(name)])
    assert offenders == []


def test_the_floor_imports_the_standard_library_alone():
    # safe_io/ is under every package, data/ included: nothing it imports may be the project's, torch or any other
    # installed package, so that any module can use it and importing it costs nothing.
    found = {}
    for path in sorted((ROOT / "safe_io").rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        names = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        names |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and not node.level}
        found[path.relative_to(ROOT).as_posix()] = {name.split(".")[0] for name in names}
    assert "safe_io/nofollow.py" in found and "os" in found["safe_io/nofollow.py"]  # the reader sees the imports
    outside = {path: sorted(names - sys.stdlib_module_names - {"__future__", "safe_io"})
               for path, names in found.items()}
    assert {path: names for path, names in outside.items() if names} == {}


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


# ---- one place asks which FSDP wraps a model -----------------------------------------------------------------------

ADAPTER = "fsdp_utils/parallel/fsdp.py"


def fsdp_members() -> set[str]:
    """The attributes FSDP1's wrapper and FSDP2's sharded modules have and a plain module has not (no_sync,
    set_requires_gradient_sync, clip_grad_norm_, ...): asking a model for one tells the versions apart."""
    from torch import nn
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    return (set(dir(FullyShardedDataParallel)) | set(dir(FSDPModule))) - set(dir(nn.Module))


def fsdp_questions(source: str) -> list[str]:
    """Where `source` asks which FSDP a model has, by function (`Class.method`, `<module>`): isinstance or issubclass
    with a class of torch.distributed.fsdp (whatever it is imported as), hasattr or getattr of an FSDP member, or
    FullyShardedDataParallel.fsdp_modules (which lists a model's FSDP1 units)."""
    tree = ast.parse(source)
    fsdp_names = {alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                  and (node.module or "").startswith("torch.distributed.fsdp") for alias in node.names}
    members = fsdp_members()

    def names_fsdp(node: ast.AST) -> bool:
        return any((isinstance(n, ast.Name) and n.id in fsdp_names) or
                   (isinstance(n, ast.Attribute) and n.attr in ("FullyShardedDataParallel", "FSDPModule"))
                   for n in ast.walk(node))

    def asks(node: ast.AST) -> bool:
        if not isinstance(node, ast.Call):
            return False
        func = node.func
        if isinstance(func, ast.Name) and func.id in ("isinstance", "issubclass") and len(node.args) == 2:
            return names_fsdp(node.args[1])
        if isinstance(func, ast.Name) and func.id in ("hasattr", "getattr") and len(node.args) >= 2:
            attr = node.args[1]
            return isinstance(attr, ast.Constant) and attr.value in members
        return isinstance(func, ast.Attribute) and func.attr == "fsdp_modules" and names_fsdp(func.value)

    found = []

    def visit(node: ast.AST, where: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                visit(child, child.name if where == "<module>" else f"{where}.{child.name}")
            else:
                if asks(child):
                    found.append(where)
                visit(child, where)

    visit(tree, "<module>")
    return found


def test_the_fsdp_question_detector_sees_each_form():
    # Each way of asking is flagged, else the next test proves nothing; other type questions are not.
    asked = """
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, FSDPModule
import torch.distributed.fsdp

def a(model):
    return isinstance(model, FSDP)

class B:
    def c(self, model):
        return isinstance(model, (nn.Linear, FSDPModule)) or hasattr(model, "no_sync")

    def d(self, model):
        return getattr(model, "set_requires_gradient_sync", None) or FSDP.fsdp_modules(model)

e = isinstance(m, torch.distributed.fsdp.FullyShardedDataParallel)
"""
    assert fsdp_questions(asked) == ["a", "B.c", "B.c", "B.d", "B.d", "<module>"]
    assert fsdp_questions("from torch.distributed.tensor import DTensor\n"
                          "def f(t):\n    return isinstance(t, DTensor) or hasattr(t, 'local_shards')\n") == []


def test_only_the_fsdp_adapter_asks_which_fsdp_wraps_a_model():
    paths = [path for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))] + [ROOT / "train_fsdp.py"]
    assert ROOT / ADAPTER in paths and fsdp_questions((ROOT / ADAPTER).read_text())  # the reader sees the adapter's
    found = {(path.relative_to(ROOT).as_posix(), where) for path in paths if path != ROOT / ADAPTER
             for where in fsdp_questions(path.read_text())}
    assert found == set()


# ---- set_up shows the wrap that build_run makes ---------------------------------------------------------------------


def calls_in(path: Path, function: str) -> list[tuple[str, str]]:
    """(name, source) of each call of `function`'s body in the file `path`, in order: `name` the called function's
    (wrap for parts.fsdp.wrap), `source` as ast.dump writes the call (its arguments included)."""
    tree = ast.parse(path.read_text())
    body = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == function)
    calls = [n for n in ast.walk(body) if isinstance(n, ast.Call)]
    name = lambda call: getattr(call.func, "attr", getattr(call.func, "id", ""))  # noqa: E731
    return [(name(call), ast.dump(call)) for call in sorted(calls, key=lambda c: (c.lineno, c.col_offset))]


def test_set_up_calls_build_wrap_and_finish_in_order_and_wraps_as_build_run_does():
    # train_fsdp.py's set_up shows the wrap; the benchmarks and the tests build through build_run. The two wraps are
    # the same call, so what is measured is what trains; build, the wrap and finish run in this order in both.
    ours, theirs = (calls_in(ROOT / "train_fsdp.py", "set_up"),
                    calls_in(ROOT / "fsdp_utils/train/build_run.py", "build_run"))
    for calls in (ours, theirs):
        order = [name for name, _ in calls if name in ("build", "wrap", "finish")]
        assert order == ["build", "wrap", "finish"], order
    assert [source for name, source in ours if name == "wrap"] == [source for name, source in theirs if name == "wrap"]
    assert "ModuleWrapPolicy" in dict(ours)["wrap"] and "MixedPrecision" in dict(ours)["wrap"]
