"""The README's commands run in the order given on a fresh clone: no training command finds the folder of an
earlier run (it would resume it, or refuse a finished one) unless it is meant to continue that run
(--resume_from), and no script's output is written twice (an export refuses a folder that is not empty)."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

from config import Config, RunConfig, read_yaml_file
from config.loading import parse_override
from tests.test_docs import OUTPUTS, ROOT

BASH_FENCE = re.compile(r"^```bash\n(.*?)^```", re.MULTILINE | re.DOTALL)
# The launchers in scripts/ pass their arguments on to train_fsdp.py; the config is their CONFIG variable.
LAUNCHERS = ("scripts/fsdp_multi_node.sh", "scripts/slurm_submit.sh")


def bash_commands(text: str) -> list[str]:
    """The commands of a page's bash blocks in order: continued lines joined, comments and blank lines left out."""
    commands = []
    for block in BASH_FENCE.findall(text):
        for line in re.sub(r"\s*\\\n\s*", " ", block).splitlines():
            line = line.split(" #")[0].strip()
            if line and not line.startswith("#"):
                commands.append(line)
    return commands


def output_dir(config: Path, overrides: list[str]) -> Path:
    """Where a training command writes: run.output_dir or checkpoints/<run.name>, from the config and the
    overrides of the run section."""
    run = dict(read_yaml_file(config).get("run") or {})
    for arg in overrides:
        keys, value = parse_override(arg)
        if keys[0] == "run" and len(keys) == 2:
            run[keys[1]] = value
    return Config(run=RunConfig(**run)).output_dir


def training_run(command: str) -> tuple[Path, bool] | None:
    """(output folder, whether it resumes an earlier run) of a command that trains; None for other commands."""
    words = shlex.split(command)
    env = dict(w.split("=", 1) for w in words[:next((i for i, w in enumerate(words) if "=" not in w), 0)])
    if "train_fsdp.py" in words:
        at = words.index("train_fsdp.py")
        config, args = words[at + 1], words[at + 2:]
    elif launcher := next((w for w in words if w in LAUNCHERS), None):
        assert "CONFIG" in env, f"{command}: name the launcher's config (CONFIG=...)"
        config, args = env["CONFIG"], words[words.index(launcher) + 1:]
    else:
        return None
    if "--check" in args:  # checks the config, writes nothing
        return None
    overrides = [a for a in args if a.startswith("--") and "=" in a and "." in a.split("=", 1)[0]]
    resumes = any(a == "--resume_from" or a.startswith("--resume_from=") for a in args)
    return output_dir(ROOT / config, overrides), resumes


def collisions(commands: list[str]) -> list[str]:
    """The commands that would find an earlier command's run folder or output when run in this order."""
    found, runs, outputs = [], set(), set()
    for command in commands:
        if (run := training_run(command)) is not None:
            folder, resumes = run
            if resumes != (folder in runs):
                found.append(f"{command}: {folder} " + ("is no earlier run's" if resumes else "is an earlier run's"))
            runs.add(folder)
        for pattern, _ in OUTPUTS:
            for out in pattern.findall(command):
                if out in outputs:
                    found.append(f"{command}: {out} is written by an earlier command")
                outputs.add(out)
    return found


def test_readme_commands_do_not_reuse_a_run_or_an_output():
    commands = bash_commands((ROOT / "README.md").read_text())
    runs = [training_run(c) for c in commands]
    # The quick start, its continuation, LoRA on it, and the launchers are among those read.
    assert (Path("checkpoints/tiny"), True) in runs and (Path("checkpoints/lora16"), False) in runs, runs
    assert sum(any(launcher in c for launcher in LAUNCHERS) for c in commands) == 3, commands
    assert collisions(commands) == []


def test_collision_detection():
    tiny = "torchrun --nproc_per_node=2 train_fsdp.py config/train_tiny_fsdp.yaml"
    launched = "CONFIG=config/train_tiny_fsdp.yaml scripts/fsdp_multi_node.sh 10.0.0.1 0 2"
    export = "python scripts/export_hf.py checkpoints/{}/fsdp_cpt1000.pth exported/a"
    page = "\n".join([
        "```bash", tiny, f"{tiny} --resume_from latest  # continue", "```", "```bash", "# the same preset again",
        f"{tiny} \\", "  --train.lr=1e-3", f"{tiny} --run.name=other --resume_from latest", f"{tiny} --run.name=tiny2",
        f"{launched} --run.output_dir=checkpoints/tiny2", f"{launched} --check --run.name=tiny",
        export.format("tiny"), export.format("tiny2"), "```", ""])
    commands = bash_commands(page)
    assert len(commands) == 9 and commands[2] == f"{tiny} --train.lr=1e-3"
    assert collisions(commands) == [
        f"{tiny} --train.lr=1e-3: checkpoints/tiny is an earlier run's",
        f"{tiny} --run.name=other --resume_from latest: checkpoints/other is no earlier run's",
        f"{launched} --run.output_dir=checkpoints/tiny2: checkpoints/tiny2 is an earlier run's",
        f"{export.format('tiny2')}: exported/a is written by an earlier command",
    ]
