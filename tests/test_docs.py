"""Documentation that is derived from code stays in step with it; the README and docs say what is true today."""
from __future__ import annotations

import re
import subprocess
import sys
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path

import pytest

from tests.tools.config_reference import ROOT, render

README_MAX_LINES = 220
# docs/*.md a reader finishes: every page but the generated configuration reference (the dated records in
# benchmarks/records/ are not pages).
DOCS_MAX_LINES = 1800  # room for the pages of steps or epochs, planning and the optimizers; no more

# A word of 7 to 40 hexadecimal digits with at least one letter and one digit: how git abbreviates a
# commit. Words inside other identifiers (fsdp_cpt1000, a path, #rrggbb) do not count.
HEX_WORD = re.compile(r"(?<![\w#./-])[0-9a-f]{7,40}(?![\w-])")
ISSUE_MENTION = re.compile(r"\bissues?\s+#?\d+", re.IGNORECASE)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")


RECORDS = "benchmarks/records"  # the dated records, their raw figures in results/ below


def current_docs(root: Path) -> list[Path]:
    """README.md and docs/*.md, the pages that describe today (not the dated records in benchmarks/records/)."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def records(root: Path) -> list[Path]:
    return sorted((root / RECORDS).glob("*.md"))


def all_docs(root: Path) -> list[Path]:
    return [*current_docs(root), *records(root)]


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced blocks: printed output there (a CRC32, a tracker's run id) may be hex."""
    out, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        if not fenced:
            out.append((number, line))
    return out


def commit_hashes(text: str) -> list[str]:
    found = []
    for number, line in prose_lines(text):
        for word in HEX_WORD.findall(line):
            if re.search(r"[0-9]", word) and re.search(r"[a-f]", word):
                found.append(f"line {number}: {word}")
    return found


def issue_mentions(text: str) -> list[str]:
    return [f"line {n}: {m}" for n, line in prose_lines(text) for m in ISSUE_MENTION.findall(line)]


def heading_anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {heading_anchor(line.lstrip("#")) for _, line in prose_lines(path.read_text()) if line.startswith("#")}


def broken_links(path: Path, root: Path) -> list[str]:
    broken = []
    for number, line in prose_lines(path.read_text()):
        for target in LINK.findall(line):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            where = f"{path.relative_to(root)}:{number}: {target}"
            if not dest.exists():
                broken.append(f"{where} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{where} (no such heading)")
    return broken


def test_configuration_reference_is_current():
    # Regenerating the reference from the schema must give the committed file byte for byte;
    # run `python tests/tools/config_reference.py` after changing a config field.
    assert (ROOT / "docs" / "configuration.md").read_text() == render()


def test_config_reference_help_and_check_write_nothing(tmp_path):
    reference = ROOT / "docs" / "configuration.md"
    before = reference.stat().st_mtime_ns
    for args in (["--help"], ["--check"]):
        proc = subprocess.run([sys.executable, str(ROOT / "tests/tools/config_reference.py"), *args], cwd=tmp_path,
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        assert reference.stat().st_mtime_ns == before  # the tracked file is not rewritten
        assert args != ["--help"] or "--check" in proc.stdout


# What a documented command writes: (script, how its output is given).
OUTPUTS = [(re.compile(r"scripts/(?:convert_checkpoint|export_hf)\.py\s+\S+\s+(\S+)"), "positional"),
           (re.compile(r"--(?:output|json)\s+(\S+)"), "option")]


def documented_outputs() -> set[str]:
    """The paths, relative to the repository, that the README's and docs' commands (run from its root) write."""
    found = set()
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for pattern, _ in OUTPUTS:
            for match in pattern.finditer(page.read_text()):
                path = match.group(1).rstrip("`")
                if not path.startswith(("/", "$", "<")) and not path.endswith(".py") and not path.isupper():
                    found.add(path)
    return found


def test_what_documented_commands_write_is_ignored_by_git():
    if subprocess.run(["git", "rev-parse"], cwd=ROOT, capture_output=True).returncode != 0:
        pytest.skip("not a git checkout")
    outputs = documented_outputs()
    assert {"converted/fsdp_sharded_cpt750", "results.json", "llama1B_500.pth"} <= outputs, outputs
    # A .pth written by convert_checkpoint.py comes with its checksum record, .<name>.json beside it.
    paths = sorted(outputs | {str(Path(p).with_name(f".{Path(p).name}.json")) for p in outputs if p.endswith(".pth")})
    proc = subprocess.run(["git", "check-ignore", "--no-index", "--verbose", "--non-matching", *paths], cwd=ROOT,
                          capture_output=True, text=True)
    not_ignored = [line.split("\t")[-1] for line in proc.stdout.splitlines() if line.startswith("::")]
    assert not not_ignored, f"written by documented commands, not in .gitignore: {not_ignored}"


def test_every_field_is_documented():
    rows = [line for line in render().splitlines() if line.startswith("| `")]
    undocumented = [row.split("|")[1].strip() for row in rows if row.rstrip().endswith("|  |")]
    assert not undocumented, undocumented


def test_readme_fits_a_few_screens():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; details belong in docs/"


def test_docs_fit_a_reading():
    pages = [p for p in sorted((ROOT / "docs").glob("*.md")) if p.name != "configuration.md"]
    lines = {p.name: len(p.read_text().splitlines()) for p in pages}
    assert sum(lines.values()) <= DOCS_MAX_LINES, f"docs/*.md has {sum(lines.values())} lines: {lines}"


def test_the_layout_is_described_once():
    # The table of the repository's folders lives in architecture.md; other pages link to it.
    layout = re.compile(r"^\| `(?:model|data|config|scripts|tests)/` \|", re.MULTILINE)
    pages = [str(p.relative_to(ROOT)) for p in current_docs(ROOT) if len(layout.findall(p.read_text())) >= 2]
    assert pages == ["docs/architecture.md"], pages


@pytest.mark.parametrize("path", current_docs(ROOT), ids=lambda p: str(p.relative_to(ROOT)))
def test_current_docs_name_no_commit_and_no_issue(path: Path):
    # Commits and dates belong to the records in benchmarks/records/, history to git.
    text = path.read_text()
    assert not commit_hashes(text), commit_hashes(text)
    assert not issue_mentions(text), issue_mentions(text)


def test_hash_and_issue_detection():
    # The checks above must see a commit in prose and leave alone what only looks like one.
    assert commit_hashes("measured at commit 58f0dc5, then e2d1fa4.") == ["line 1: 58f0dc5", "line 1: e2d1fa4"]
    assert commit_hashes("```\nerror: (CRC32 5f1c09aa, recorded 9b0e4e71)\n```\n") == []
    assert commit_hashes("fsdp_cpt1000.pth, 1234567 tokens, a defaced word, colour #a1b2c3d4") == []
    assert issue_mentions("another item of issue 23; Issue #7") == ["line 1: issue 23", "line 1: Issue #7"]
    assert issue_mentions("pytorch/pytorch#135712 is torch's") == []


def test_links_between_docs_resolve():
    broken = [b for path in all_docs(ROOT) for b in broken_links(path, ROOT)]
    assert not broken, broken


# A runnable file of the repository's script folders, as the docs and the code name it: scripts/generate.py,
# benchmarks/benchmark.py, tests/tools/run_gpu_tests.py (not a longer path that merely ends so).
SCRIPT_PATH = re.compile(r"(?<![\w./-])((?:scripts|benchmarks|tests)/[\w./-]*?\.(?:py|sh))(?!\w)")
CODE = ("model", "data", "config", "fsdp_utils", "scripts", "benchmarks", "tests")


def missing_scripts(paths: list[Path], root: Path) -> list[str]:
    """`file:line: path` for each script path named in those files that is not in the repository at `root`."""
    return [f"{path.relative_to(root)}:{number}: {name}" for path in paths
            for number, line in enumerate(path.read_text().splitlines(), 1)
            for name in SCRIPT_PATH.findall(line) if not (root / name).is_file()]


def test_the_scripts_that_docs_and_code_name_exist():
    # Commands and usage lines name scripts by their path from the repository's root: a moved script leaves
    # none behind. The dated records in benchmarks/records/ name the paths of their own commit and are not read.
    code = [ROOT / "train_fsdp.py", *(p for folder in CODE for p in sorted((ROOT / folder).rglob("*"))
                                      if p.suffix in (".py", ".sh"))]
    assert ROOT / "tests/tools/run_gpu_tests.py" in code
    assert missing_scripts([*current_docs(ROOT), *code], ROOT) == []


def test_missing_script_detection(tmp_path):
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts/generate.py").write_text("")
    page = tmp_path / "page.md"
    page.write_text("python scripts/generate.py and `torchrun benchmarks/benchmark.py`\n"
                    "../shared/peers/scripts/peer.py, fsdp_utils/scripts/x.py, scripts/eval_tasks\n")
    assert missing_scripts([page], tmp_path) == ["page.md:1: benchmarks/benchmark.py"]


def test_benchmark_records_are_dated():
    names = [p.name for p in records(ROOT)]
    assert names
    undated = [n for n in names if not re.match(r"\d{4}-\d{2}-\d{2}-[a-z0-9-]+\.md$", n)]
    assert not undated, undated


# Figures quoted from the dated records: each quote sits next to a link to its record, and says what the record
# says. A quoted output block (a fence without a language) after a paragraph that links records has each of its
# lines in one of them; a table row or a paragraph that links records has each of its figures in them (as
# recorded, or rounded from a recorded figure, or, for a ratio such as 1.07x, the quotient of two of its own).
RECORD = re.compile(rf"(?:^|/){RECORDS}/\d{{4}}-\d{{2}}-\d{{2}}-[\w-]+\.md$")
# A figure: 1,959 or 0.748 or 12 (thousands grouped by commas), with or without a unit (90M, 1.07x), not a piece
# of a word (H200), a version (2.13.0) or a path.
FIGURE = re.compile(r"(?<![\w.,/])(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?![\d/]|[.,]\d)")
RESULTS = re.compile(r"(?<![\w/])results/([\w.-]+)")
LOG_LINE = re.compile(r"\brank\d+\] step \d+/\d+ \| loss ")


def linked_records(text: str, page: Path) -> list[Path]:
    targets = [(page.parent / t.partition("#")[0]).resolve() for t in LINK.findall(text)]
    return [t for t in targets if RECORD.search(t.as_posix()) and t.is_file()]


def record_text(record: Path) -> str:
    """A record and the files of its results/ folder that it names (its raw figures)."""
    named = [record.parent / "results" / name for name in RESULTS.findall(record.read_text())]
    return "\n".join([record.read_text(), *(p.read_text() for p in named if p.is_file())])


def figures(text: str) -> list[str]:
    return [f.replace(",", "") for f in FIGURE.findall(text)]


def rounds_to(exact: str, shown: str) -> bool:
    places = len(shown.partition(".")[2])
    return len(exact.partition(".")[2]) >= places and \
        Decimal(exact).quantize(Decimal(1).scaleb(-places), ROUND_HALF_UP) == Decimal(shown)


def bounds(shown: str) -> tuple[Decimal, Decimal]:
    """The values that round to a figure as shown."""
    half = Decimal(5).scaleb(-len(shown.partition(".")[2]) - 1)
    return Decimal(shown) - half, Decimal(shown) + half


def a_ratio_of(shown: str, others: list[str]) -> bool:
    """Whether a figure is the ratio of two others (each as shown, so within their rounding), as a row's
    "1.07x" is of its two tokens/s figures. Single digits (GPU counts, steps) are not ratio operands."""
    lo, hi = bounds(shown)
    operands = [bounds(o) for o in others if len(o.replace(".", "").lstrip("0")) >= 2]
    return any(a_lo / b_hi <= hi and a_hi / b_lo >= lo for a_lo, a_hi in operands for b_lo, b_hi in operands
               if b_lo > 0)


def unrecorded_figures(row: str, record: str) -> list[str]:
    recorded = figures(record)
    mine = figures(re.sub(r"\]\([^)]*\)|`[^`]*`", "", row))  # not the link targets, nor the commands' code
    ratios = {f.replace(",", "") for f in re.findall(r"([\d.,]+)x\b", row)}
    return [f for f in mine if not any(rounds_to(r, f) for r in recorded)
            and not (f in ratios and a_ratio_of(f, [o for o in mine if o != f]))]


def quoted_blocks(text: str) -> list[tuple[str, list[tuple[int, str]]]]:
    """(the paragraph before it, its (line number, line)s) for each fenced block without a language."""
    blocks, lines, n = [], text.splitlines(), 0
    while n < len(lines):
        if FENCE.match(lines[n].lstrip()):
            end = next(i for i in range(n + 1, len(lines)) if FENCE.match(lines[i].lstrip()))
            if lines[n].strip() in ("```", "~~~"):
                last = max((i for i in range(n) if lines[i].strip()), default=-1)
                first = max((i for i in range(last) if not lines[i].strip()), default=-1) + 1
                blocks.append(("\n".join(lines[first:last + 1]), list(enumerate(lines[n + 1:end], n + 2))))
            n = end
        n += 1
    return blocks


def misquoted(page: Path, root: Path) -> list[str]:
    """`file:line: what` for each quoted line or table figure of a page that its linked records do not hold."""
    where, text, found = page.relative_to(root), page.read_text(), []
    for paragraph, quote in quoted_blocks(text):
        records = linked_records(paragraph, page)
        held = {line.strip() for r in records for line in record_text(r).splitlines()}
        for number, line in quote:
            if records and line.strip() not in held:
                found.append(f"{where}:{number}: {line}")
            elif not records and LOG_LINE.search(line) and page.name == "README.md":
                found.append(f"{where}:{number}: a training log line without the link to its record")
    for number, line in quoting_lines(text):
        if records := linked_records(line, page):
            record = "\n".join(record_text(r) for r in records)
            found += [f"{where}:{number}: {f} not in {', '.join(r.name for r in records)}"
                      for f in unrecorded_figures(line, record)]
    return found


def quoting_lines(text: str) -> list[tuple[int, str]]:
    """(first line number, text) of each table row and each paragraph outside the fenced blocks."""
    out: list[tuple[int, list[str]]] = []
    previous = 0  # the number of the paragraph's line before; 0 after anything else
    for number, line in prose_lines(text):
        if line.startswith("|"):
            out.append((number, [line]))
        elif line.strip() and not line.startswith("#"):
            if previous and previous == number - 1:
                out[-1][1].append(line)
            else:
                out.append((number, [line]))
            previous = number
            continue
        previous = 0
    return [(number, "\n".join(lines)) for number, lines in out]


def test_quoted_figures_are_their_records():
    # The README's sample output lines and the figures of docs/benchmarks.md are checked against the records they
    # link; a figure that is stale or copied wrongly names its line. At least the quick start's line is checked.
    assert linked_records((ROOT / "README.md").read_text(), ROOT / "README.md")
    assert [p for p in current_docs(ROOT) for b in quoted_blocks(p.read_text()) if linked_records(b[0], p)]
    assert [p for p in current_docs(ROOT) if misquoted(p, ROOT)] == [], \
        [m for p in current_docs(ROOT) for m in misquoted(p, ROOT)]


def test_misquote_detection(tmp_path):
    (tmp_path / RECORDS / "results").mkdir(parents=True)
    (tmp_path / RECORDS / "results/run.jsonl").write_text('{"tokens_per_sec": 601329.4, "peer": 564320.2}\n')
    (tmp_path / RECORDS / "2026-01-02-cpu-run.md").write_text(
        "raw figures: [results/run.jsonl](results/run.jsonl); 3.52 s and 25.39 s\n\n"
        "```\n[01:02:03 rank0] step 10/10 | loss 2.0200 | lr 3.00e-04\n```\n")
    page = tmp_path / "README.md"
    link = f"([record]({RECORDS}/2026-01-02-cpu-run.md))"
    page.write_text(
        f"The last line {link}:\n\n```\n[01:02:03 rank0] step 10/10 | loss 2.0200 | lr 3.00e-04\n```\n\n"
        f"Stale {link}:\n\n```\n[01:02:03 rank0] step 10/10 | loss 2.0145 | lr 3.00e-04\n```\n\n"
        "No record:\n\n```\n[01:02:03 rank0] step 10/10 | loss 2.0145 | lr 3.00e-04\n```\n\n```bash\necho 2\n```\n\n"
        f"| 601,329 | 564,320 | 1.07x | 3.5 s, 25.4 s, 7.2x | `--steps 8` {link} |\n"
        f"| 601,330 | 1.06x | 7.3x | {link} |\n\n"
        f"A paragraph: 3.52 s, then\n4.25 s on 2 cores {link}.\n")
    assert misquoted(page, tmp_path) == [
        "README.md:10: [01:02:03 rank0] step 10/10 | loss 2.0145 | lr 3.00e-04",
        "README.md:16: a training log line without the link to its record",
        "README.md:24: 601330 not in 2026-01-02-cpu-run.md",
        "README.md:24: 1.06 not in 2026-01-02-cpu-run.md",
        "README.md:24: 7.3 not in 2026-01-02-cpu-run.md",
        "README.md:26: 4.25 not in 2026-01-02-cpu-run.md",
    ]
