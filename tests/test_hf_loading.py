"""Every Hugging Face loading call in the project's code reads local files only and never runs a folder's own
code: each `from_pretrained` passes trust_remote_code=False and local_files_only=True, each Auto class's
`from_config` trust_remote_code=False, and nothing calls the Hub's download functions. Read from the source
with ast (nothing is imported), so a call on a path that no test reaches is checked too. tests/ is not
scanned: its calls load folders the tests themselves have just written."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("fsdp_utils", "scripts", "data", "config", "model", "train_fsdp.py")
DOWNLOADERS = {"hf_hub_download", "snapshot_download", "cached_file", "pipeline"}


def _is(keywords: dict[str, ast.expr], name: str, value: bool) -> bool:
    node = keywords.get(name)
    return isinstance(node, ast.Constant) and node.value is value


def _receiver(func: ast.Attribute) -> str:
    value = func.value
    return value.id if isinstance(value, ast.Name) else value.attr if isinstance(value, ast.Attribute) else ""


def unsafe_calls(source: str, where: str = "<source>") -> list[str]:
    """'file:line: call (what it lacks)' for each loading call in `source` that could download or run code."""
    found = []
    for node in ast.walk(ast.parse(source)):
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
        if lacks:
            found.append(f"{where}:{node.lineno}: {ast.unparse(func)}(...) without {', '.join(lacks)}")
    return found


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
])
def test_the_scan_tells_safe_calls_from_unsafe_ones(source, flagged):
    assert bool(unsafe_calls(source)) == flagged


def test_every_hugging_face_loading_call_is_local_and_runs_no_folder_code():
    files = project_files()
    assert ROOT / "scripts/export_hf.py" in files and ROOT / "fsdp_utils/parallel/hf.py" in files
    offenders = [line for path in files for line in unsafe_calls(path.read_text(), str(path.relative_to(ROOT)))]
    assert offenders == []
