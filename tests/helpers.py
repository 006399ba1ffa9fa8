"""Run train_fsdp.py as users do (torchrun or plain python, real processes, gloo on the CPU) and read
what it wrote. Shared by the end-to-end tests."""
from __future__ import annotations

import collections
import contextlib
import glob
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from torch.utils._python_dispatch import TorchDispatchMode

from tests import launcher

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "train_fsdp.py"
WITH_FAULTS = ROOT / "tests/with_faults.py"  # runs a script with test-only faults (tests/fault_injection.py)

# A model small enough that a few steps take about a second on 2 CPU cores.
TINY = [
    "--model.dim=64", "--model.n_layers=2", "--model.n_heads=4", "--model.n_kv_heads=2", "--model.max_seq_len=32",
    "--data.seq_len=32", "--data.vocab_size=320",
    "--train.global_batch_size=8", "--train.micro_batch_size=2", "--train.lr=1e-2", "--train.warmup_steps=2",
    "--train.eval_interval=0", "--logging.interval=1", "--logging.trackers=[]",
    "--checkpoint.interval=0", "--run.device=cpu",
]


@contextlib.contextmanager
def failing_after(seconds: int):
    """Fail the test once `seconds` pass (in the main thread: pytest's failure is no Exception, so no library's
    `except Exception` keeps it), for code that would otherwise never end."""
    import pytest

    previous = signal.signal(signal.SIGALRM, lambda *_: pytest.fail(f"still running after {seconds} s"))
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def write_corpus(path: Path, num_docs: int = 60) -> Path:
    """A small deterministic text corpus: short documents of simple, repetitive sentences."""
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly box jugs of amber".split()
    docs = []
    for i in range(num_docs):
        sentence = " ".join(words[(i * 3 + k) % len(words)] for k in range(12))
        docs.append(f"Document {i}. {sentence}. " * 6)
    path.write_text("\n\n".join(docs))
    return path


def fault_env(faults: dict | None) -> dict:
    """The environment that makes tests/with_faults.py install `faults`."""
    from tests.fault_injection import ENV

    return {ENV: json.dumps(faults)} if faults else {}


# What torchrun gives a rank. A test that ran a world of one in this pytest process (init_distributed sets
# MASTER_ADDR and MASTER_PORT for it) must not hand its address to the jobs it starts after.
RANK_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                  "ROLE_RANK", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE")


@contextlib.contextmanager
def world_of_one(**variables: str):
    """A process group of one rank in this pytest process (gloo, CPU), as a plain `python train_fsdp.py`
    starts it: no rank variables from outside, and none of its own (the address init_distributed picks)
    left behind for the jobs started after it. `variables` are set for its duration too."""
    from fsdp_utils.distributed import destroy_distributed, init_distributed

    saved = {name: os.environ.pop(name, None) for name in (*RANK_VARIABLES, *variables)}
    os.environ.update(variables)
    try:
        env = init_distributed(device="cpu", timeout_s=60)
        try:
            yield env
        finally:
            destroy_distributed()
    finally:
        for name, value in saved.items():
            os.environ.pop(name, None)
            if value is not None:
                os.environ[name] = value


def job_env(extra_env: dict | None = None) -> dict:
    """The environment of a job the tests start: this process's, without rank variables, one thread per
    rank, then `extra_env`."""
    env = {k: v for k, v in os.environ.items() if k not in RANK_VARIABLES}
    return {**env, "OMP_NUM_THREADS": "1", **(extra_env or {})}


def train_argv(*args: str, out_dir: Path, corpus: Path, dataset_dir: Path, faults: bool = False) -> list[str]:
    """train_fsdp.py and its arguments for a job of the tiny model (`faults`: under tests/with_faults.py, which
    installs the faults that tests.helpers.fault_env puts in the environment)."""
    script = [str(WITH_FAULTS), str(TRAIN)] if faults else [str(TRAIN)]
    return [*script, str(ROOT / "config/train_tiny_fsdp.yaml"), *TINY, f"--run.output_dir={out_dir}",
            f"--data.files=[{corpus}]", f"--data.dataset_dir={dataset_dir}", *args]


def torchrun_cmd(nproc: int) -> list[str]:
    """A real torchrun of `nproc` ranks on this machine, before the script and its arguments."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]


def run_job(argv: list[str], *, nproc: int = 1, env: dict, cwd: Path = ROOT, timeout: float = 300,
            prefix: tuple[str, ...] = (), fsize_limit: int | None = None,
            real_processes: bool = False) -> subprocess.CompletedProcess:
    """`argv` (a script and its arguments) run as `nproc` forked ranks (tests/launcher.py), or as real processes,
    under torchrun for nproc > 1, when `real_processes` asks for them, when `prefix` runs them under another
    command (e.g. unshare), or with FSDP_TEST_LAUNCH=process. `fsize_limit` caps the size of the files they
    write (RLIMIT_FSIZE, what `prlimit --fsize` sets). Returns the finished job."""
    if launcher.enabled() and not prefix and not real_processes:  # no start-up cost (tests/launcher.py)
        return launcher.launch(argv, nproc=nproc, env=env, cwd=cwd, timeout=timeout, fsize_limit=fsize_limit)
    if fsize_limit is not None:
        prefix = ("prlimit", f"--fsize={fsize_limit}", *prefix)
    launcher_cmd = [*prefix, sys.executable] if nproc == 1 else [*prefix, *torchrun_cmd(nproc)]
    return subprocess.run([*launcher_cmd, *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def run_train(*args: str, nproc: int = 1, out_dir: Path, corpus: Path, dataset_dir: Path, extra_env: dict | None = None,
              check: bool = True, timeout: float = 300, prefix: tuple[str, ...] = (),
              faults: dict | None = None, fsize_limit: int | None = None) -> subprocess.CompletedProcess:
    """Run one training job (run_job: forked ranks unless `prefix` asks for real processes); `faults`
    (tests/fault_injection.py) runs it with those faults installed. Returns the finished job."""
    argv = train_argv(*args, out_dir=out_dir, corpus=corpus, dataset_dir=dataset_dir, faults=bool(faults))
    proc = run_job(argv, nproc=nproc, env=job_env({**(extra_env or {}), **fault_env(faults)}), timeout=timeout,
                   prefix=prefix, fsize_limit=fsize_limit)
    if check and proc.returncode != 0:
        raise AssertionError(f"training failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    return proc


def assert_refused_before_the_process_group(proc: subprocess.CompletedProcess) -> None:
    """A multi-rank job that a problem found before the process group ended: rank 0 exits 2, and no rank leaves
    a traceback (a real torchrun reports the failure in a traceback of its own). A rank that was still starting
    up (imports) when the launcher stopped the job ends by its SIGTERM (-15) before it could set its own handler,
    which is a race, not a fault; any other signal (-9 after the shutdown timeout, -11, -6) would be one."""
    assert proc.returncode != 0 and worker_tracebacks(proc.stderr) == 0, proc.stderr[-4000:]
    if hasattr(proc, "exitcodes"):  # forked ranks (tests/launcher.py)
        statuses = [str(code) for code in proc.exitcodes]
    else:  # torchrun's report of its failed workers
        statuses = re.findall(r"exitcode\s*:\s*(-?\d+)", proc.stderr)
    assert "2" in statuses and set(statuses) <= {"2", "-15"}, (statuses, proc.stderr[-4000:])


def worker_tracebacks(stderr: str) -> int:
    """Tracebacks in a failed job's stderr besides torchrun's own report of the failure (ChildFailedError),
    which a real torchrun job prints and forked ranks (tests/launcher.py) do not."""
    return stderr.count("Traceback") - ("ChildFailedError" in stderr)


def read_metrics(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def losses(out_dir: Path) -> dict[int, float]:
    """step -> training loss, from metrics.jsonl (the last row wins for a step logged twice)."""
    return {row["step"]: row["loss"] for row in read_metrics(out_dir) if "loss" in row}


def random_model(cfg, seed: int = 0):
    """Our Transformer with random weights large enough that next-token distributions are peaked (greedy choices
    are no near-ties that float noise could flip), norm weights random too (a swapped norm shows)."""
    import torch

    from model import Transformer

    torch.manual_seed(seed)
    model = Transformer(cfg)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn_like(param)
            param.copy_(1 + 0.2 * noise if name.endswith("norm.weight") else 0.3 * noise)
    return model


def alive(pid: int) -> bool:
    """Whether the process runs (a zombie, ended but not yet reaped, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def children(pid: int) -> list[int]:
    kids = []
    for path in glob.glob(f"/proc/{pid}/task/*/children"):
        try:
            kids += [int(k) for k in Path(path).read_text().split()]
        except OSError:
            pass
    return kids


def descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        for kid in children(todo.pop()):
            found.append(kid)
            todo.append(kid)
    return found


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a launcher and everything below it (torchrun's workers live in sessions of their own)."""
    for pid in [proc.pid, *descendants(proc.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass


class CountOps(TorchDispatchMode):
    """Counts the aten ops run inside it, by name (e.g. counts["mm"]), and the `mm` ops by their output's width
    (its last dimension: mm_widths[64])."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()
        self.mm_widths = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.counts[func.overloadpacket.__name__] += 1
        if func.overloadpacket.__name__ == "mm":
            self.mm_widths[out.shape[-1]] += 1
        return out


def set_up(cfg, env, *, resume_from: str | None = None):
    """train_fsdp.py's set_up in this process (no stop signals handled): the Run, before its loop."""
    import train_fsdp
    from fsdp_utils.guards.preemption import StopSignal

    return train_fsdp.set_up(cfg, env, stop=StopSignal([], grace_s=60), resume_from=resume_from)


def fit(cfg, env, *, resume_from: str | None = None):
    """train_fsdp.py's set_up and loop in this process: the Run after its loop (its last logged row as `last`)."""
    import train_fsdp
    from fsdp_utils.guards.preemption import StopSignal

    stop = StopSignal([], grace_s=60)
    run = train_fsdp.set_up(cfg, env, stop=stop, resume_from=resume_from)
    run.last = train_fsdp.train(run, stop)
    return run


def parallelize(module, *, fsdp, block_classes, precision, compile: bool = False, init=None):
    """A built module made trainable as a run makes it (fsdp_utils/train/build_run.py): activation checkpointing
    (the adapter's fsdp section) and compile on its blocks, the adapter's wrap of its units in `precision`, then the
    weights materialised where built on the meta device (`init`). Returns the model to train."""
    import torch
    from torch.distributed.fsdp import MixedPrecision
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from fsdp_utils.parallel.parallelize import prepare_blocks

    blocks = [m for m in module.modules() if type(m) in block_classes]
    prepare_blocks(blocks, fsdp.f, compile=compile)
    model = fsdp.wrap(module, auto_wrap_policy=ModuleWrapPolicy(fsdp.units(module, blocks)), compile=compile,
                      mixed_precision=MixedPrecision(param_dtype=precision.compute, reduce_dtype=precision.reduce),
                      init=init)
    if init is not None:
        init.init_sharded(model, torch.device("cpu") if fsdp.offload else fsdp.env.device)
    return model
