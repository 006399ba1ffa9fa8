"""Every Hugging Face loading call in the project's code reads local files only and never runs a folder's own
code: each `from_pretrained` passes trust_remote_code=False and local_files_only=True, each Auto class's
`from_config` trust_remote_code=False, each `datasets` loading call is made inside a `with hub_offline(...)` block
(data/hf_datasets.py: offline mode for datasets and the Hub) or reads given data_files, and nothing calls the Hub's
download functions. Read from the source with ast (nothing is imported), so a call on a path that no test reaches
is checked too. tests/ is not scanned: its calls load folders the tests themselves have just written."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("fsdp_utils", "scripts", "benchmarks", "data", "config", "model", "train_fsdp.py")
DOWNLOADERS = {"hf_hub_download", "snapshot_download", "cached_file", "pipeline"}
DATASET_LOADERS = {"load_dataset", "load_from_disk", "load_dataset_builder", "get_dataset_split_names"}
# load_dataset's builders of file formats: given data_files, they read those files and nothing else.
FILE_BUILDERS = {"json", "parquet", "csv", "text", "arrow"}


def _is(keywords: dict[str, ast.expr], name: str, value: bool) -> bool:
    node = keywords.get(name)
    return isinstance(node, ast.Constant) and node.value is value


def _receiver(func: ast.Attribute) -> str:
    value = func.value
    return value.id if isinstance(value, ast.Name) else value.attr if isinstance(value, ast.Attribute) else ""


def unsafe_calls(source: str, where: str = "<source>") -> list[str]:
    """'file:line: call (what it lacks)' for each loading call in `source` that could download or run code."""
    found = []
    tree = ast.parse(source)
    offline = {id(inner) for node in ast.walk(tree) if isinstance(node, ast.With) and _is_offline(node)
               for statement in node.body for inner in ast.walk(statement)}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        keywords = {k.arg: k.value for k in node.keywords if k.arg}
        lacks = []
        if name == "from_pretrained" or (name == "from_config" and _receiver(func).startswith("Auto")):
            if not _is(keywords, "trust_remote_code", False):
                lacks.append("trust_remote_code=False")
            if name == "from_pretrained" and not _is(keywords, "local_files_only", True):
                lacks.append("local_files_only=True")
        elif name in DOWNLOADERS:
            lacks.append("no download at all")
        elif name in DATASET_LOADERS and id(node) not in offline and not _reads_given_files(node, keywords):
            lacks.append("a `with hub_offline(...)` block around it")
        if lacks:
            found.append(f"{where}:{node.lineno}: {ast.unparse(func)}(...) without {', '.join(lacks)}")
    return found


def _reads_given_files(node: ast.Call, keywords: dict[str, ast.expr]) -> bool:
    """load_dataset("json", data_files=...) and the like."""
    first = node.args[0] if node.args else None
    return isinstance(first, ast.Constant) and first.value in FILE_BUILDERS and "data_files" in keywords


def _is_offline(node: ast.With) -> bool:
    """A `with hub_offline(...)` block."""
    return any(isinstance(item.context_expr, ast.Call) and isinstance(item.context_expr.func, ast.Name)
               and item.context_expr.func.id == "hub_offline" for item in node.items)


def project_files() -> list[Path]:
    return sorted(path for name in SCANNED
                  for path in ([ROOT / name] if name.endswith(".py") else (ROOT / name).rglob("*.py")))


@pytest.mark.parametrize(("source", "flagged"), [
    ("AutoConfig.from_pretrained(path)", True),
    ("AutoTokenizer.from_pretrained(path, local_files_only=True)", True),
    ("transformers.AutoModelForCausalLM.from_pretrained(p, trust_remote_code=False)", True),
    ("type(model).from_pretrained(None, trust_remote_code=False, local_files_only=flag)", True),  # not a constant
    ("AutoModelForCausalLM.from_config(config)", True),
    ("snapshot_download('org/model')", True),
    ("AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False)", False),
    ("AutoModelForCausalLM.from_config(config, trust_remote_code=False, **dtype)", False),
    ("PrepareSettings.from_config(cfg)", False),  # the project's own from_config, no transformers
    ("datasets.load_dataset(path, streaming=True)", True),
    ("load_from_disk(folder)", True),
    ("datasets.load_dataset('json', data_files={'test': path})", False),
    ("datasets.load_dataset('json')", True),
    ("with hub_offline(datasets):\n    pass\ndatasets.load_dataset(path)", True),  # after the block, not in it
    ("with hub_offline(datasets):\n    splits = datasets.load_dataset(path, name)", False),
    ("with hub_offline(datasets):\n    saved = datasets.load_from_disk(str(folder))", False),
])
def test_the_scan_tells_safe_calls_from_unsafe_ones(source, flagged):
    assert bool(unsafe_calls(source)) == flagged


def test_every_hugging_face_loading_call_is_local_and_runs_no_folder_code():
    files = project_files()
    assert ROOT / "scripts/export_hf.py" in files and ROOT / "fsdp_utils/parallel/hf.py" in files
    assert ROOT / "data/hf_datasets.py" in files
    offenders = [line for path in files for line in unsafe_calls(path.read_text(), str(path.relative_to(ROOT)))]
    assert offenders == []
