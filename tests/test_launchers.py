"""The shell launchers (scripts/*.sh): shellcheck-clean, argument and batch-size checks, and real runs on
the CPU: fsdp_train.sh with 2 processes, and fsdp_multi_node.sh as two "nodes" on this machine, which
must train exactly like one node with the same world size. slurm_submit.sh runs against stub
scontrol/srun commands (no Slurm here): what it would launch, and how it forwards the pre-termination
signal."""
from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import ROOT, TINY, kill_tree, losses, run_train

pytestmark = pytest.mark.slow  # the launchers start real processes

SCRIPTS = sorted((ROOT / "scripts").glob("*.sh"))
CONFIG = ROOT / "config/train_tiny_fsdp.yaml"
STEPS = 3
# What the scripts read from the environment: only what a test sets may reach them.
SCRIPT_VARIABLES = {"CONFIG", "NGPU", "NPROC_PER_NODE", "MASTER_PORT", "MAX_RESTARTS", "GPUS_PER_NODE", "MICRO_BATCH",
                    "GLOBAL_BATCH", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "RDZV_ID", "RDZV_CONF", "FSDP_ELASTIC",
                    "ELASTIC_MIN_NODES", "RDZV_STORE"}


def script_env(**extra: str) -> dict:
    """The environment of a user who runs the scripts: torchrun (this interpreter's) on PATH, no Slurm."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k not in SCRIPT_VARIABLES}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["OMP_NUM_THREADS"] = "1"
    return {**env, **extra}


def train_args(out_dir: Path, corpus: Path, dataset_dir: Path, *args: str) -> list[str]:
    """What run_train passes after the config path (the scripts add the config themselves)."""
    return [*TINY, f"--run.output_dir={out_dir}", f"--data.files=[{corpus}]", f"--data.dataset_dir={dataset_dir}",
            *args]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus, dataset_dir) -> dict[int, float]:
    """Losses of STEPS steps on one node with 2 processes (also prepares the session's dataset)."""
    out = tmp_path_factory.mktemp("reference")
    run_train(f"--train.max_steps={STEPS}", nproc=2, out_dir=out, corpus=corpus, dataset_dir=dataset_dir, timeout=240)
    return losses(out)


# ---- static checks ------------------------------------------------------------------------------------


def test_scripts_pass_shellcheck():
    if shutil.which("shellcheck") is None:
        pytest.skip("the shellcheck binary is not installed (CI installs it: apt-get install shellcheck)")
    assert SCRIPTS, "no scripts/*.sh found"
    proc = subprocess.run(["shellcheck", *map(str, SCRIPTS)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_scripts_are_executable_bash(script):
    assert os.access(script, os.X_OK)
    assert script.read_text().startswith("#!/usr/bin/env bash\n")


# Every script a user runs: the shell launchers and the Python scripts with a command line.
PYTHON_SCRIPTS = sorted(path for path in [*ROOT.glob("scripts/**/*.py"), *ROOT.glob("benchmarks/*.py"),
                                          ROOT / "train_fsdp.py"] if 'if __name__ == "__main__":' in path.read_text())


def opening_comment(script: Path) -> str:
    """The comment under a shell script's first line, without its `# `: what the script does and how to run it."""
    lines = []
    for line in script.read_text().splitlines()[1:]:
        if line != "#" and not line.startswith("# "):
            break
        lines.append(line[2:])
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("script", [*SCRIPTS, *PYTHON_SCRIPTS], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_script_prints_its_usage_on_help_and_exits_0(script, tmp_path):
    """From another folder, without Slurm's variables or any script's: usage on stdout, status 0, nothing written."""
    command = ["bash", str(script)] if script.suffix == ".sh" else [sys.executable, str(script)]
    proc = subprocess.run([*command, "--help"], cwd=tmp_path, env=script_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    if script.suffix == ".sh":
        assert proc.stdout == opening_comment(script) and len(proc.stdout.splitlines()) >= 3, proc.stdout
    else:
        assert proc.stdout.startswith(f"usage: {script.name} "), proc.stdout[:500]
    assert "Traceback" not in proc.stderr and not list(tmp_path.iterdir())


def installed_from_this_checkout() -> bool:
    """Whether the environment has this checkout installed in place (`pip install -e .`): the installed copy's record
    names it (the checkout's own fsdp_lm.egg-info, which the install leaves there, names no place)."""
    return any(json.loads(found.read_text("direct_url.json") or "{}").get("url") == ROOT.as_uri()
               for found in importlib.metadata.distributions(name="fsdp-lm"))


@pytest.mark.skipif(not installed_from_this_checkout(), reason="needs this checkout installed: pip install -e .")
@pytest.mark.parametrize("script", ["scripts/generate.py", "scripts/_torchrun.py", "benchmarks/checkpoint_staging.py"])
def test_installed_scripts_import_the_project_from_any_folder(script, tmp_path):
    """Installed, the project needs no path of its own: a script run from another folder, without the PYTHONPATH
    that the tests give their processes, imports the packages, the scripts' and benchmarks' own modules and
    train_fsdp (each of these three imports some of them)."""
    env = {k: v for k, v in script_env().items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, str(ROOT / script), "--help"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.startswith("usage: "), proc.stderr[-3000:]


@pytest.mark.parametrize("script,argv", [
    ("generate", ["model.pth", "--prompt", "a", "--max_new_tokens", "٣"]),  # int() reads it as 3
    ("generate", ["model.pth", "--prompt", "a", "--temperature", "٠.٥"]),  # float() reads it as 0.5
    ("evaluate", ["model.pth", "--tasks", "hellaswag", "--limit", "²"]),  # int() fails on it with a traceback
    ("render_profile", ["trace", "trace.json", "--out", "t.png", "--step", "٢"]),
])
def test_command_line_numbers_are_read_in_the_digits_0_to_9_only(script, argv, capsys):
    import importlib

    with pytest.raises(SystemExit) as info:
        importlib.import_module(f"scripts.{script}").main(argv)
    kind = "number" if argv[-2] == "--temperature" else "integer"
    assert info.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(f"{argv[-2]}: invalid {kind} value: '{argv[-1]}'")


# ---- argument checks --------------------------------------------------------------------------------------


@pytest.mark.parametrize("args", [[], ["127.0.0.1"], ["127.0.0.1", "0"]], ids=["0args", "1arg", "2args"])
def test_multi_node_usage(args):
    proc = subprocess.run([str(ROOT / "scripts/fsdp_multi_node.sh"), *args], env=script_env(), capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 2
    assert proc.stderr.startswith("usage: ") and "MASTER_ADDR NODE_RANK NNODES" in proc.stderr


def slurm_stubs(tmp_path: Path) -> tuple[Path, Path]:
    """scontrol and srun stand-ins that log every call. The training srun (not `srun ... pkill`) runs
    until a file named `release` appears, then exits with $TRAIN_STATUS."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls.txt"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(
        f'#!/usr/bin/env bash\necho "scontrol $*" >> {calls}\nprintf "node17\\nnode18\\n"\n')
    (bin_dir / "srun").write_text(
        f'#!/usr/bin/env bash\necho "srun $*" >> {calls}\n'
        f'[[ "$*" == *pkill* ]] && exit 0\n'
        f'echo "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=$TORCH_DISABLE_SHARE_RDZV_TCP_STORE" > {tmp_path}/train_env.txt\n'
        f'for _ in $(seq 600); do [[ -e {tmp_path}/release ]] && exit "${{TRAIN_STATUS:-0}}"; sleep 0.05; done\n'
        f'exit 99\n')
    for stub in bin_dir.iterdir():
        stub.chmod(0o755)
    return bin_dir, calls


def test_slurm_rejects_indivisible_batch_before_launching(tmp_path):
    bin_dir, calls = slurm_stubs(tmp_path)
    env = script_env(SLURM_NNODES="1", GPUS_PER_NODE="2", MICRO_BATCH="3", GLOBAL_BATCH="8", SLURM_JOB_ID="1",
                     SLURM_JOB_NODELIST="node17")
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    proc = subprocess.run(["bash", str(ROOT / "scripts/slurm_submit.sh")], env=env, capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: GLOBAL_BATCH=8 is not a multiple of MICRO_BATCH * GPUs = 3 * 2"], proc.stderr
    assert not calls.exists()  # neither scontrol nor srun was called


@pytest.mark.parametrize("global_batch,error", [
    ("", "error: MICRO_BATCH=auto needs GLOBAL_BATCH (sequences per optimizer step)"),
    ("9", "error: GLOBAL_BATCH=9 is not a multiple of the GPU count 2"),
])
def test_slurm_auto_micro_batch_checks_the_global_batch_before_launching(global_batch, error, tmp_path):
    bin_dir, calls = slurm_stubs(tmp_path)
    env = script_env(SLURM_NNODES="1", GPUS_PER_NODE="2", MICRO_BATCH="auto", SLURM_JOB_ID="1",
                     SLURM_JOB_NODELIST="node17", **({"GLOBAL_BATCH": global_batch} if global_batch else {}))
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    proc = subprocess.run(["bash", str(ROOT / "scripts/slurm_submit.sh")], env=env, capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == 2
    assert [line for line in proc.stderr.splitlines() if line.startswith("error:")] == [error], proc.stderr
    assert not calls.exists()


def test_slurm_auto_micro_batch_is_passed_to_the_job(tmp_path):
    bin_dir, calls = slurm_stubs(tmp_path)
    env = script_env(SLURM_NNODES="2", GPUS_PER_NODE="2", MICRO_BATCH="auto", GLOBAL_BATCH="64", SLURM_JOB_ID="7",
                     SLURM_JOB_NODELIST="node[1-2]", SLURM_SUBMIT_DIR=str(ROOT), TRAIN_STATUS="0")
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    (tmp_path / "release").touch()  # the stub training step ends at once
    proc = subprocess.run(["bash", str(ROOT / "scripts/slurm_submit.sh")], env=env, capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert ("world 4 GPUs, global batch 64, micro-batch auto (measured by the job), 16 sequences per GPU and step"
            in proc.stdout)
    assert "--train.global_batch_size=64 --train.micro_batch_size=auto" in calls.read_text().splitlines()[1]


@pytest.mark.parametrize("train_status", [0, 3])
def test_slurm_launch_and_signal_forwarding(train_status, tmp_path):
    """What the batch script launches, that SIGUSR1 (Slurm's pre-termination signal) is forwarded to the
    training processes while the script keeps waiting, and that the training step's status is the job's."""
    bin_dir, calls = slurm_stubs(tmp_path)
    env = script_env(SLURM_NNODES="2", GPUS_PER_NODE="2", MICRO_BATCH="3", GLOBAL_BATCH="24", SLURM_JOB_ID="4242",
                     SLURM_JOB_NODELIST="node[17-18]", SLURM_SUBMIT_DIR=str(ROOT), TRAIN_STATUS=str(train_status))
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    proc = subprocess.Popen(["bash", str(ROOT / "scripts/slurm_submit.sh"), "--train.max_steps=7"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while not (calls.exists() and "torchrun" in calls.read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, "the training srun never started"
            time.sleep(0.05)
        time.sleep(0.2)  # let bash reach its `wait`
        proc.send_signal(signal.SIGUSR1)
        while "pkill" not in calls.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, "SIGUSR1 was not forwarded"
            time.sleep(0.05)
        time.sleep(0.3)
        assert proc.poll() is None  # still waiting for the training step
        (tmp_path / "release").touch()
        stdout, stderr = proc.communicate(timeout=30)
    finally:
        kill_tree(proc)
    assert proc.returncode == train_status, stderr
    assert "world 4 GPUs, global batch 24, micro-batch 3, gradient accumulation 2" in stdout
    lines = calls.read_text().splitlines()
    assert lines[0] == "scontrol show hostnames node[17-18]"
    assert re.fullmatch(
        f"srun --kill-on-bad-exit=1 python3 {ROOT}/scripts/_torchrun.py -- --nnodes=2 --nproc_per_node=2 "
        f"--rdzv_id=[0-9a-f]{{32}} --rdzv_backend=c10d --rdzv_endpoint=node17:29500 --max-restarts=1 "
        f"{ROOT}/train_fsdp.py {ROOT}/config/train1B_fsdp.yaml "
        f"--train.global_batch_size=24 --train.micro_batch_size=3 --train.max_steps=7", lines[1]), lines[1]
    assert lines[2] == r"srun --overlap --ntasks-per-node=1 pkill -USR1 -f -- -u .*train_fsdp\.py"
    assert len(lines) == 3
    # No workaround in the environment: the workers give each restart attempt a store of their own.
    assert (tmp_path / "train_env.txt").read_text() == "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=\n"


def test_slurm_elastic_launch(tmp_path):
    """ELASTIC_MIN_NODES: a node range for torchrun, a job step that outlives a lost node, and the environment of
    an elastic run (the workers take torchrun's SIGTERM for a restart; the rendezvous store is not shared)."""
    bin_dir, calls = slurm_stubs(tmp_path)
    env = script_env(SLURM_NNODES="3", GPUS_PER_NODE="2", MICRO_BATCH="2", GLOBAL_BATCH="24", SLURM_JOB_ID="9",
                     SLURM_JOB_NODELIST="node[1-3]", SLURM_SUBMIT_DIR=str(ROOT), TRAIN_STATUS="0",
                     ELASTIC_MIN_NODES="2")
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    (tmp_path / "release").touch()
    proc = subprocess.run(["bash", str(ROOT / "scripts/slurm_submit.sh")], env=env, capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert "elastic: 2:3 nodes; the rendezvous lives on node17, which must stay up" in proc.stdout
    assert re.match(
        f"srun --no-kill --kill-on-bad-exit=0 python3 {ROOT}/scripts/_torchrun.py -- --nnodes=2:3 --nproc_per_node=2 "
        "--rdzv_id=[0-9a-f]{32} --rdzv_backend=c10d --rdzv_endpoint=node17:29500 --max-restarts=100 ",
        calls.read_text().splitlines()[1])
    assert (tmp_path / "train_env.txt").read_text() == "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1\n"


def test_slurm_elastic_launch_checks_the_config_before_launching(tmp_path):
    bin_dir, calls = slurm_stubs(tmp_path)
    env = script_env(SLURM_NNODES="3", GPUS_PER_NODE="2", MICRO_BATCH="2", GLOBAL_BATCH="24", SLURM_JOB_ID="9",
                     SLURM_JOB_NODELIST="node[1-3]", SLURM_SUBMIT_DIR=str(ROOT), ELASTIC_MIN_NODES="2")
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    proc = subprocess.run(["bash", str(ROOT / "scripts/slurm_submit.sh"), "--train.max_stepz=5"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "train.max_stepz" in errors[0], proc.stderr
    assert "srun" not in calls.read_text()  # scontrol only: no job step started


# 2**64 + 1: bash's arithmetic wraps it to 1, a minimum that torch's node range then fails on with a traceback.
@pytest.mark.parametrize("value", ["4", "0", "two", "18446744073709551617", "01"])
def test_slurm_elastic_minimum_is_checked_before_launching(value, tmp_path):
    bin_dir, calls = slurm_stubs(tmp_path)
    env = script_env(SLURM_NNODES="3", GPUS_PER_NODE="2", MICRO_BATCH="2", GLOBAL_BATCH="24", SLURM_JOB_ID="9",
                     SLURM_JOB_NODELIST="node[1-3]", ELASTIC_MIN_NODES=value)
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    proc = subprocess.run(["bash", str(ROOT / "scripts/slurm_submit.sh")], env=env, capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == 2
    assert [line for line in proc.stderr.splitlines() if line.startswith("error:")] == [
        f"error: ELASTIC_MIN_NODES={value} is not a node count from 1 to the job's 3 nodes"], proc.stderr
    assert not calls.exists()


def slurm_run(tmp_path: Path, *args: str, **variables: str) -> subprocess.CompletedProcess:
    """slurm_submit.sh against the stubs, in tmp_path, a job of 2 nodes of 2 GPUs; the training step ends at once."""
    bin_dir, _ = slurm_stubs(tmp_path)
    env = script_env(**{"SLURM_NNODES": "2", "GPUS_PER_NODE": "2", "MICRO_BATCH": "2", "SLURM_JOB_ID": "9",
                        "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_SUBMIT_DIR": str(ROOT), **variables})
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    (tmp_path / "release").touch()
    return subprocess.run(["bash", str(ROOT / "scripts/slurm_submit.sh"), *args], env=env, capture_output=True,
                          text=True, cwd=tmp_path, timeout=30)


# bash evaluates a variable's text as an expression in (( )), $(( )) and [[ -gt ]]: an array subscript's command
# substitution runs. Every value is checked as text first; a leading zero (octal to bash) is refused too.
@pytest.mark.parametrize("name,value", [
    ("GPUS_PER_NODE", "HOME[$(touch PWNED)]"), ("MICRO_BATCH", "HOME[$(touch PWNED)]"),
    ("GLOBAL_BATCH", "x[$(touch PWNED)]"), ("SLURM_NNODES", "a[$(touch PWNED)]"), ("MASTER_PORT", "p[$(touch PWNED)]"),
    ("MAX_RESTARTS", "r[$(touch PWNED)]"), ("GPUS_PER_NODE", "08"), ("MASTER_PORT", "65536"), ("GLOBAL_BATCH", "-8"),
    # Past the bounds of a node or process count: nodes x GPUs x micro-batch could wrap bash's 64-bit arithmetic.
    ("GPUS_PER_NODE", "536870912"), ("SLURM_NNODES", "536870912"), ("MICRO_BATCH", "1" + "0" * 9)])
def test_slurm_checks_every_number_before_arithmetic(name, value, tmp_path):
    proc = slurm_run(tmp_path, **{name: value})
    assert not (tmp_path / "PWNED").exists(), "a value from the environment ran a command"
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(f"error: {name}={value} is not a whole number ") and proc.stderr.count("\n") == 1
    assert not (tmp_path / "calls.txt").exists()  # neither scontrol nor srun was called


def test_slurm_numbers_whose_product_wraps_are_one_error_line(tmp_path):
    """2**29 nodes x 2**29 GPUs x a micro-batch of 2**29 is 2**87, 0 in bash's 64-bit arithmetic: the batch checks
    would divide by it ("division by 0", and go on). Refused at the first number out of bounds."""
    proc = slurm_run(tmp_path, SLURM_NNODES="536870912", GPUS_PER_NODE="536870912", MICRO_BATCH="536870912")
    assert proc.returncode == 2 and "division by 0" not in proc.stderr, proc.stderr
    assert proc.stderr == "error: SLURM_NNODES=536870912 is not a whole number from 1 to 100000\n"
    assert not (tmp_path / "calls.txt").exists()


def test_slurm_outside_a_slurm_job_is_one_error_line(tmp_path):
    env = script_env(SLURM_NNODES="1", GPUS_PER_NODE="1")  # the user's Slurm variables, but no job's node list
    proc = subprocess.run(["bash", str(ROOT / "scripts/slurm_submit.sh")], env=env, capture_output=True, text=True,
                          cwd=tmp_path, timeout=30)
    assert proc.returncode == 2
    assert proc.stderr == ("error: SLURM_JOB_NODELIST is not set: submit this script with sbatch "
                           "(scripts/slurm_submit.sh --help)\n")


def test_slurm_run_id_is_random_unless_given(tmp_path):
    """The run id of the job's rendezvous: one that nobody outside the job can guess (the job id can be read by
    anyone with squeue), or RDZV_ID; an RDZV_ID torchrun cannot take is one error line."""
    def launched_id(folder: Path, **variables: str) -> str:
        folder.mkdir()
        proc = slurm_run(folder, **variables)
        assert proc.returncode == 0, proc.stderr
        return re.search(r"--rdzv_id=(\S+)", (folder / "calls.txt").read_text()).group(1)

    first, second = launched_id(tmp_path / "a"), launched_id(tmp_path / "b")
    assert re.fullmatch("[0-9a-f]{32}", first) and re.fullmatch("[0-9a-f]{32}", second) and first != second
    assert launched_id(tmp_path / "c", RDZV_ID="my-run.2") == "my-run.2"
    bad = slurm_run(tmp_path, RDZV_ID="a/b")
    assert bad.returncode == 2, bad.stderr
    assert bad.stderr == "error: RDZV_ID=a/b is not a run id (up to 128 letters, digits, '.', '_' and '-')\n"


@pytest.mark.parametrize("nnodes", ["2:1", "0:2", "1:", "a:b", "1:2:3", "01:2", "1:100001", "18446744073709551617:2"])
def test_multi_node_rejects_a_bad_node_range(nnodes):
    proc = subprocess.run([str(ROOT / "scripts/fsdp_multi_node.sh"), "127.0.0.1", "0", nnodes], env=script_env(),
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2
    assert proc.stderr == f"error: NNODES={nnodes} is not a node range MIN:MAX with 1 <= MIN <= MAX <= 100000\n"


@pytest.mark.parametrize("nnodes,name,value,culprit", [
    ("1:2", "RDZV_ID", "team/run", "RDZV_ID=team/run is not a run id (up to 128 letters, digits, '.', '_' and '-')"),
    ("1:2", "RDZV_ID", "-x", "RDZV_ID=-x is not a run id"),
    ("1:2", "MASTER_PORT", "29500x", "MASTER_PORT=29500x is not a whole number from 1 to 65535"),
    ("2", "MASTER_PORT", "0", "MASTER_PORT=0 is not a whole number from 1 to 65535"),
    ("2", "NPROC_PER_NODE", "a[$(touch P)]", "NPROC_PER_NODE=a[$(touch P)] is not a whole number from 1 to 1024"),
    ("1:2", "NPROC_PER_NODE", "536870912", "NPROC_PER_NODE=536870912 is not a whole number from 1 to 1024"),
    ("2", "MAX_RESTARTS", "many", "MAX_RESTARTS=many is not a whole number of at least 0")])
def test_multi_node_names_a_value_torchrun_cannot_take_before_starting_it(nnodes, name, value, culprit, tmp_path):
    proc = subprocess.run([str(ROOT / "scripts/fsdp_multi_node.sh"), "127.0.0.1", "0", nnodes], capture_output=True,
                          text=True, cwd=tmp_path, env=script_env(**{"NPROC_PER_NODE": "2", name: value}), timeout=60)
    assert proc.returncode == 2 and proc.stderr.startswith(f"error: {culprit}"), proc.stderr[-3000:]
    assert proc.stderr.count("\n") == 1 and not list(tmp_path.iterdir())


@pytest.mark.parametrize("name,value,culprit", [
    ("NGPU", "536870912", "NGPU=536870912 is not a whole number from 1 to 1024"),
    ("NGPU", "²", "NGPU=² is not a whole number from 1 to 1024"),
    ("MAX_RESTARTS", "18446744073709551617", "MAX_RESTARTS=18446744073709551617 is not a whole number of at least 0")])
def test_fsdp_train_names_a_value_torchrun_cannot_take_before_starting_it(name, value, culprit, tmp_path):
    proc = subprocess.run([str(ROOT / "scripts/fsdp_train.sh")], capture_output=True, text=True, cwd=tmp_path,
                          env=script_env(**{"NGPU": "2", name: value}), timeout=60)
    assert proc.returncode == 2 and proc.stderr == f"error: {culprit}\n", proc.stderr[-3000:]
    assert not list(tmp_path.iterdir())


def test_multi_node_names_a_node_rank_that_is_not_a_number(tmp_path):
    proc = subprocess.run([str(ROOT / "scripts/fsdp_multi_node.sh"), "127.0.0.1", "one", "2"], capture_output=True,
                          text=True, cwd=tmp_path, env=script_env(NPROC_PER_NODE="1"), timeout=60)
    assert proc.returncode == 2 and proc.stderr == "error: NODE_RANK=one is not a whole number from 0 to 99999\n"


def test_check_only_finds_the_config_problems_of_any_world_size_and_starts_nothing(tmp_path):
    """train_fsdp.py --check: the checks a job makes before its process group, but those against the world size
    (unknown before an elastic job's rendezvous); exit 0 or 2, and no output folder made."""
    def check(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(ROOT / "train_fsdp.py"), str(CONFIG), "--check", *TINY,
                               f"--run.output_dir={tmp_path / 'out'}", *args], capture_output=True, text=True,
                              env=script_env(), timeout=120)

    ok = check()
    assert ok.returncode == 0 and ok.stdout == "" and "error" not in ok.stderr, ok.stderr
    # A hybrid group of 3 divides some world sizes, and the batch of 8 splits over some: fine before the world is known.
    assert check("--fsdp.sharding_strategy=HYBRID_SHARD", "--fsdp.hybrid_shard_group_size=3").returncode == 0
    bad = check("--train.max_stepz=5", "--resume_from=/nonexistent/ckpt")
    assert bad.returncode == 2, bad.stderr
    assert [line for line in bad.stderr.splitlines() if line.startswith("error:")] == bad.stderr.splitlines()
    assert "train.max_stepz" in bad.stderr and not (tmp_path / "out").exists()


def test_elastic_launch_stops_at_a_config_error_once_without_starting_torchrun(tmp_path):
    # torchrun would restart workers that fail on it MAX_RESTARTS (100) times: the launcher checks first.
    proc = subprocess.run([str(ROOT / "scripts/fsdp_multi_node.sh"), "127.0.0.1", "0", "1:2", *TINY,
                           "--train.max_stepz=5"], cwd=tmp_path, env=script_env(NPROC_PER_NODE="2", CONFIG=str(CONFIG)),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "train.max_stepz" in errors[0], proc.stderr[-3000:]
    assert "torch.distributed" not in proc.stderr and not list(tmp_path.iterdir())


@pytest.mark.parametrize("bad", [["--train.max_stepz=3"], ["--resume_from=/nonexistent/ckpt"]])
def test_a_user_error_under_the_launcher_is_its_one_error_line(bad, tmp_path):
    """torchrun would follow the worker's `error:` line with its own report of the failure (a ChildFailedError
    traceback of some 40 lines) and end with status 1: the launcher ends with the line and the worker's status."""
    proc = subprocess.run([str(ROOT / "scripts/fsdp_train.sh"), *TINY, f"--run.output_dir={tmp_path / 'out'}", *bad],
                          cwd=tmp_path, env=script_env(NGPU="2", CONFIG=str(CONFIG)), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and bad[0].split("=")[0][2:] in lines[0], proc.stderr
    assert proc.stdout == "" and not (tmp_path / "out").exists()


WORKER = """import os, signal, sys, time
from torch.distributed.elastic.multiprocessing.errors import record

@record  # as train_fsdp.py: an uncaught exception reaches torchrun's error file
def main():
    if os.environ["RANK"] == "1":
        if sys.argv[1] == "raise":
            raise ValueError("a genuine bug")
        if sys.argv[1] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        print("error: a bad input", file=sys.stderr)
        sys.exit(int(sys.argv[1]))
    time.sleep(120)  # rank 0 waits to be stopped, as train_fsdp.py's ranks do after an early error

main()
"""


@pytest.mark.parametrize("how,status", [("2", 2), ("1", 1), ("raise", 1), ("kill", 128 + 9)])
def test_torchrun_wrapper_hides_torchruns_report_of_user_errors_only(how, status, tmp_path):
    """scripts/_torchrun.py, as the launchers run torchrun: a worker that exits 1 or 2 after its `error:` line ends
    the command with that line and status; a crash (an exception, a signal) keeps its traceback and torchrun's
    report, and the command ends with the worker's status (128 + the signal's number for a signal)."""
    (tmp_path / "worker.py").write_text(WORKER)
    proc = subprocess.run([sys.executable, str(ROOT / "scripts/_torchrun.py"), "--", "--standalone",
                           "--nproc_per_node=2", "worker.py", how], cwd=tmp_path, env=script_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == status, proc.stderr
    if how in ("1", "2"):
        assert proc.stderr == "error: a bad input\n"
    else:
        assert "worker.py FAILED" in proc.stderr and "Root Cause" in proc.stderr  # torchrun's report
        assert ("ValueError: a genuine bug" in proc.stderr) == (how == "raise")
        assert "Signal 9 (SIGKILL)" in proc.stderr or how != "kill"


def test_elastic_node_rank_0_serves_its_store_on_master_addr_or_says_why_not(tmp_path):
    """Node rank 0 hosts the rendezvous store listening on MASTER_ADDR only: an address of another machine is one
    line before torchrun starts (a store on every interface would serve whatever MASTER_ADDR says)."""
    proc = subprocess.run([str(ROOT / "scripts/fsdp_multi_node.sh"), "203.0.113.7", "0", "1:2", *TINY,
                           f"--run.output_dir={tmp_path / 'out'}"], cwd=tmp_path, capture_output=True, text=True,
                          env=script_env(NPROC_PER_NODE="2", CONFIG=str(CONFIG), MASTER_PORT=str(free_port())),
                          timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert [line for line in proc.stderr.splitlines() if line.startswith("error")] == [
        "error: MASTER_ADDR=203.0.113.7 is not an address of this machine (Cannot assign requested address); name "
        "one with MASTER_ADDR"], proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "out").exists()


# ---- real runs -----------------------------------------------------------------------------------------------


def test_fsdp_train_sh_two_processes(reference, corpus, dataset_dir, tmp_path):
    out = tmp_path / "out"
    args = train_args(out, corpus, dataset_dir, f"--train.max_steps={STEPS}")
    proc = subprocess.run([str(ROOT / "scripts/fsdp_train.sh"), *args],
                          cwd=tmp_path, env=script_env(NGPU="2", CONFIG=str(CONFIG)), capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "world size 2 on cpu" in proc.stderr
    assert losses(out) == reference


def test_multi_node_two_nodes_match_one_node(reference, corpus, dataset_dir, tmp_path):
    out = tmp_path / "out"
    env = script_env(NPROC_PER_NODE="1", MASTER_PORT=str(free_port()), CONFIG=str(CONFIG))
    args = train_args(out, corpus, dataset_dir, f"--train.max_steps={STEPS}")
    nodes, logs = [], []
    try:
        for node_rank in (0, 1):
            log = open(tmp_path / f"node{node_rank}.log", "w+")
            logs.append(log)
            cmd = [str(ROOT / "scripts/fsdp_multi_node.sh"), "127.0.0.1", str(node_rank), "2", *args]
            nodes.append(subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True))
        codes = [node.wait(timeout=240) for node in nodes]
    finally:
        for node in nodes:
            kill_tree(node)
        for log in logs:
            log.close()
    texts = [(tmp_path / f"node{i}.log").read_text() for i in (0, 1)]
    assert codes == [0, 0], "\n\n".join(t[-3000:] for t in texts)
    assert "world size 2 on cpu" in texts[0] and "rank0]" not in texts[1]  # rank 0 on node 0, rank 1 on node 1
    # Same world size, same ops, same reduction order: bit-for-bit the one-node run.
    assert losses(out) == reference
