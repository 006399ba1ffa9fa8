"""Failures of a running multi-rank job (gloo on the CPU): preemption by SIGTERM, Ctrl-C (SIGINT), a worker killed
outright under torchrun's restarts, a second run into a held output directory, a non-finite loss, HYBRID_SHARD
against FULL_SHARD, and a rank that stops answering. Where torchrun's own part is under test (its signals, its
restarts, its reports) the job runs under a real torchrun; the others run forked ranks (tests/launcher.py). Every
process is started here and killed here, whatever happens."""
from __future__ import annotations

import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests import launcher
from tests.helpers import (
    ROOT,
    TINY,
    alive,
    descendants,
    fault_env,
    job_env,
    kill_tree,
    losses,
    read_metrics,
    run_train,
    torchrun_cmd,
    train_argv,
    worker_tracebacks,
)

pytestmark = pytest.mark.slow  # every test here launches training processes

N = 40  # steps of the preemption/restart runs: ~0.06 s each here, so a signal sent early lands mid-run


# ---- processes --------------------------------------------------------------------------------------


def train_cmd(*args: str, nproc: int, out_dir: Path, corpus: Path, dataset_dir: Path,
              faults: bool = False) -> list[str]:
    """The command tests.helpers.run_train builds for nproc > 1 under torchrun (`faults`: the launcher that
    installs the faults given to Job through tests.helpers.fault_env)."""
    return [*torchrun_cmd(nproc), *train_argv(*args, out_dir=out_dir, corpus=corpus, dataset_dir=dataset_dir,
                                              faults=faults)]


class Job:
    """A torchrun job in the background; stdout/stderr go to files (a full pipe would block the job). For the
    tests of what torchrun does (its signals, restarts and reports); `start_ranks` for the others."""

    def __init__(self, cmd: list[str], log_dir: Path, extra_env: dict | None = None):
        log_dir.mkdir(parents=True, exist_ok=True)
        self.out_path, self.err_path = log_dir / "stdout.txt", log_dir / "stderr.txt"
        with self.out_path.open("w") as out, self.err_path.open("w") as err:
            env = job_env(extra_env)
            env = {k: v for k, v in env.items() if v is not None}  # None in extra_env: unset
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=err, start_new_session=True)

    @property
    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")

    def workers(self) -> dict[int, int]:
        """rank -> pid of the training processes (torchrun's children, each in a session of its own;
        torchrun is the job itself or, under a launcher script, the script's child)."""
        found = {}
        for pid in descendants(self.proc.pid):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if any(part.endswith(b"train_fsdp.py") for part in cmdline):
                env = dict(item.split(b"=", 1) for item in environ if b"=" in item)
                if b"RANK" in env:
                    found[int(env[b"RANK"])] = pid
        return found

    def processes(self) -> list[int]:
        """torchrun and everything below it."""
        return [self.proc.pid, *descendants(self.proc.pid)]

    def poll(self) -> int | None:
        return self.proc.poll()

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the job did not end within {timeout:.0f} s:\n{self.stderr[-4000:]}") from None

    def kill(self) -> None:
        kill_tree(self.proc)


class ForkedJob:
    """Job's interface over forked ranks (tests/launcher.py), for the failures the ranks handle themselves: a
    signal to one of them, a rank that stops answering, a second run into a held output directory."""

    def __init__(self, argv: list[str], *, nproc: int, log_dir: Path, extra_env: dict | None = None):
        self.job = launcher.Job(argv, nproc=nproc, env=job_env(extra_env), log_dir=log_dir)

    @property
    def stderr(self) -> str:
        return self.job.stderr

    def workers(self) -> dict[int, int]:
        return dict(enumerate(self.job.pids))

    def processes(self) -> list[int]:
        return self.job.pids

    def poll(self) -> int | None:
        return self.job.poll()

    def wait(self, timeout: float) -> int:
        try:
            return self.job.wait(timeout).returncode
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the job did not end within {timeout:.0f} s:\n{self.stderr[-4000:]}") from None

    def kill(self) -> None:
        self.job.kill()


def start_ranks(*args: str, nproc: int, out_dir: Path, corpus: Path, dataset_dir: Path, log_dir: Path,
                faults: dict | None = None) -> Job | ForkedJob:
    """A training job in the background as forked ranks, or under torchrun with FSDP_TEST_LAUNCH=process; with
    `faults` (tests/fault_injection.py) installed."""
    if launcher.enabled():
        argv = train_argv(*args, out_dir=out_dir, corpus=corpus, dataset_dir=dataset_dir, faults=bool(faults))
        return ForkedJob(argv, nproc=nproc, log_dir=log_dir, extra_env=fault_env(faults))
    cmd = train_cmd(*args, nproc=nproc, out_dir=out_dir, corpus=corpus, dataset_dir=dataset_dir, faults=bool(faults))
    return Job(cmd, log_dir, extra_env=fault_env(faults))


def poll(condition, *, job: Job | ForkedJob, timeout: float, what: str):
    """Wait until condition() is truthy (returning it); fail if the job ends first or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        if (code := job.poll()) is not None:
            raise AssertionError(f"the job ended ({code}) before {what}:\n{job.stderr[-4000:]}")
        time.sleep(0.02)
    raise AssertionError(f"no {what} within {timeout:.0f} s:\n{job.stderr[-4000:]}")


def logged_steps(out_dir: Path) -> list[int]:
    path = out_dir / "metrics.jsonl"
    if not path.exists():
        return []
    steps = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:  # a line still being written
            continue
        if "loss" in row:
            steps.append(row["step"])
    return steps


def checkpoint_steps(out_dir: Path) -> list[int]:
    """Steps of the complete checkpoints, full or sharded (a sharded one gets its name once complete)."""
    if not out_dir.is_dir():
        return []
    found = (re.fullmatch(r"fsdp_(?:sharded_)?cpt(\d+)(?:\.pth)?", p.name) for p in out_dir.iterdir())
    return sorted(int(m.group(1)) for m in found if m)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus, dataset_dir) -> dict[int, float]:
    """Losses of an uninterrupted 2-rank run of N steps (checkpoints do not change the numbers)."""
    out = tmp_path_factory.mktemp("reference")
    run_train(f"--train.max_steps={N}", nproc=2, out_dir=out, corpus=corpus, dataset_dir=dataset_dir, timeout=240)
    ref = losses(out)
    assert sorted(ref) == list(range(1, N + 1))
    return ref


# ---- preemption ---------------------------------------------------------------------------------------


def test_sigterm_to_one_worker_saves_and_resumes_exactly(reference, corpus, dataset_dir, tmp_path):
    out = tmp_path / "out"
    args = (f"--train.max_steps={N}", "--run.preemption_grace_s=60", "--checkpoint.keep_last_n=0")
    job = start_ranks(*args, nproc=2, out_dir=out, corpus=corpus, dataset_dir=dataset_dir, log_dir=tmp_path / "run1")
    try:
        poll(lambda: len(logged_steps(out)) >= 2, job=job, timeout=180, what="second metrics row")
        workers = job.workers()
        assert sorted(workers) == [0, 1], workers
        # Rank 1 only: it does not write checkpoints, so the all-reduced stop flag must carry the signal.
        os.kill(workers[1], signal.SIGTERM)
        assert job.wait(timeout=120) == 0, job.stderr[-4000:]
    finally:
        job.kill()
    stderr = job.stderr
    steps = logged_steps(out)
    k = steps[-1]
    assert k < N, f"the signal landed after the run had finished all {N} steps: the test proved nothing"
    assert steps == list(range(1, k + 1))
    assert checkpoint_steps(out) == [k]  # checkpoint.interval=0: the only save is the one the signal asked for
    assert not list(out.glob(".tmp-*"))
    assert "rank1] SIGTERM received" in stderr, stderr[-4000:]
    assert f"stopped by a signal at step {k}" in stderr, stderr[-4000:]

    # The same command again: auto_resume continues from step k, and the steps after it match the
    # uninterrupted run bit for bit (same max_steps, so the same learning-rate schedule).
    proc = run_train(*args, nproc=2, out_dir=out, corpus=corpus, dataset_dir=dataset_dir, timeout=240)
    assert f"loaded checkpoint {out / f'fsdp_cpt{k}.pth'}" in proc.stderr
    assert logged_steps(out) == list(range(1, N + 1))  # the resumed run logs k+1..N, nothing twice
    assert losses(out) == reference


def test_ctrl_c_under_bare_torchrun_saves_and_resumes_exactly(reference, corpus, dataset_dir, tmp_path):
    """Ctrl-C at a terminal signals the foreground process group: torchrun (its workers run in sessions of
    their own), which sends SIGINT to every worker. They save after the current step and exit 0; torchrun
    then ends with its own report of the signal it got (its exit status, which we cannot change). Running
    the same command again continues bit for bit. (Before, SIGINT was no stop signal: no checkpoint, and
    a KeyboardInterrupt traceback from every worker.)"""
    out = tmp_path / "out"
    args = (f"--train.max_steps={N}", "--checkpoint.keep_last_n=0")
    job = Job(train_cmd(*args, nproc=2, out_dir=out, corpus=corpus, dataset_dir=dataset_dir), tmp_path / "run1")
    try:
        poll(lambda: len(logged_steps(out)) >= 2, job=job, timeout=180, what="second metrics row")
        os.killpg(job.proc.pid, signal.SIGINT)  # the job leads its own process group, as torchrun at a terminal
        job.wait(timeout=120)
    finally:
        job.kill()
    stderr = job.stderr
    k = logged_steps(out)[-1]
    assert k < N, f"the signal landed after the run had finished all {N} steps: the test proved nothing"
    assert checkpoint_steps(out) == [k] and not list(out.glob(".tmp-*"))
    assert "rank0] SIGINT received" in stderr and "rank1] SIGINT received" in stderr, stderr[-4000:]
    assert f"stopped by a signal at step {k}" in stderr, stderr[-4000:]
    # No worker traceback: the one traceback is torchrun's own, reporting the signal.
    assert stderr.count("Traceback") == 1 and "SignalException: Process" in stderr, stderr[-4000:]
    assert "KeyboardInterrupt" not in stderr

    proc = run_train(*args, nproc=2, out_dir=out, corpus=corpus, dataset_dir=dataset_dir, timeout=240)
    assert f"loaded checkpoint {out / f'fsdp_cpt{k}.pth'}" in proc.stderr
    assert logged_steps(out) == list(range(1, N + 1))
    assert losses(out) == reference


def test_ctrl_c_through_the_launcher_exits_0(corpus, dataset_dir, tmp_path):
    """scripts/fsdp_train.sh keeps torchrun out of the terminal's process group and passes Ctrl-C to the
    training processes: they save, and the script ends with status 0 and no traceback at all."""
    out = tmp_path / "out"
    cmd = [str(ROOT / "scripts/fsdp_train.sh"), *TINY, f"--run.output_dir={out}", f"--data.files=[{corpus}]",
           f"--data.dataset_dir={dataset_dir}", f"--train.max_steps={N}"]
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"  # the script runs `torchrun`
    job = Job(cmd, tmp_path / "run", extra_env={"NGPU": "2", "PATH": path,
                                                "CONFIG": str(ROOT / "config/train_tiny_fsdp.yaml")})
    try:
        poll(lambda: len(logged_steps(out)) >= 2, job=job, timeout=180, what="second metrics row")
        os.killpg(job.proc.pid, signal.SIGINT)  # the script's process group: what a terminal's Ctrl-C reaches
        assert job.wait(timeout=120) == 0, job.stderr[-4000:]
    finally:
        job.kill()
    stderr = job.stderr
    k = logged_steps(out)[-1]
    assert k < N, f"the signal landed after the run had finished all {N} steps: the test proved nothing"
    assert checkpoint_steps(out) == [k]
    assert f"stopped by a signal at step {k}" in stderr and "Traceback" not in stderr, stderr[-4000:]


def test_a_second_signal_aborts_at_once():
    """The first stop signal only sets the flag the loop reads; a second one ends the process at once,
    with one line and the shell's status for a signal (128 + its number)."""
    code = ("import os, signal, sys, time; from fsdp_utils.guards.preemption import "
            "StopSignal; "
            "stop = StopSignal(['SIGINT', 'SIGTERM'], grace_s=60); os.kill(os.getpid(), signal.SIGINT); "
            "time.sleep(0.5); "
            "print('first: requested' if stop.requested else 'first: ignored', flush=True); "
            "os.kill(os.getpid(), signal.SIGINT); time.sleep(10); print('not aborted')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 128 + signal.SIGINT, proc.stderr
    assert proc.stdout == "first: requested\n"
    assert "SIGINT after SIGINT: aborting without saving" in proc.stderr and "Traceback" not in proc.stderr


def kill_rank0_and_check_restart(job: Job, out: Path, reference: dict[int, float]) -> None:
    """Kill rank 0 (-9) once a checkpoint is complete and a later step logged; the job must restart from
    the newest checkpoint, end with status 0, and log the uninterrupted run's losses."""
    try:
        # Kill once step 2's checkpoint is complete and a later step was logged past the newest checkpoint
        # (an odd step: checkpoints are at even ones), so that the restart repeats at least one step.
        poll(lambda: checkpoint_steps(out) and (s := logged_steps(out)) and s[-1] % 2 == 1 and s[-1] >= 3,
             job=job, timeout=180, what="checkpoint and an odd step after it")
        workers = job.workers()
        assert sorted(workers) == [0, 1], workers
        # Rank 0: the one that writes metrics and checkpoints, possibly mid-save.
        os.kill(workers[0], signal.SIGKILL)
        killed_after = logged_steps(out)[-1]
        assert job.wait(timeout=240) == 0, job.stderr[-4000:]
    finally:
        job.kill()
    stderr = job.stderr
    assert killed_after < N, "the worker was killed after the last step: nothing was restarted"
    assert "failed (exitcode: -9)" in stderr, stderr[-4000:]  # torchrun saw the kill and restarted the group
    resumed = re.findall(r"loaded checkpoint \S*fsdp_(?:sharded_)?cpt(\d+)", stderr)
    assert len(resumed) == 1, stderr[-4000:]
    c = int(resumed[0])
    steps = logged_steps(out)
    first_attempt = steps[: len(steps) - (N - c)]
    # The first attempt logged 1..x (x >= the step seen at the kill), the restarted one c+1..N, c <= x.
    assert first_attempt == list(range(1, len(first_attempt) + 1))
    assert steps[len(first_attempt):] == list(range(c + 1, N + 1))
    assert 2 <= c <= len(first_attempt) and killed_after <= len(first_attempt), (c, killed_after, steps)
    assert losses(out) == reference  # the last row of each step: the restarted attempt's


def test_kill_9_under_torchrun_restarts_from_checkpoint(reference, corpus, dataset_dir, tmp_path):
    """kill -9 of rank 0 under `torchrun --max-restarts=1`, started as users do (scripts/fsdp_train.sh with
    MAX_RESTARTS=1, which runs a plain torchrun) and nothing set in the environment. torchrun shares its store
    with the workers and it outlives a restart: unless each attempt keys its own (fsdp_utils/distributed.py),
    the restarted workers read the previous attempt's addresses and gloo's connectFullMesh is refused
    (pytorch#135712). Saved asynchronously by the process writer, whose processes meet through that store too,
    in both attempts (a port found free beforehand could be taken by another process first)."""
    out = tmp_path / "out"
    cmd = [str(ROOT / "scripts/fsdp_train.sh"), *TINY, f"--run.output_dir={out}", f"--data.files=[{corpus}]",
           f"--data.dataset_dir={dataset_dir}", f"--train.max_steps={N}", "--checkpoint.interval=2",
           "--checkpoint.format=sharded", "--checkpoint.async_save=true", "--checkpoint.async_writer=process"]
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"  # the script runs `torchrun`
    job = Job(cmd, tmp_path / "run", extra_env={"NGPU": "2", "MAX_RESTARTS": "1", "PATH": path,
                                                "CONFIG": str(ROOT / "config/train_tiny_fsdp.yaml"),
                                                "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": None})
    kill_rank0_and_check_restart(job, out, reference)


# ---- two runs, one output directory ------------------------------------------------------------------------


def tree_state(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}


def test_a_second_run_in_the_same_output_directory_is_refused(reference, corpus, dataset_dir, tmp_path):
    """While a run holds its output directory, a second one started into it (here with 2 ranks) is refused
    with one line naming the holder, exits non-zero, and touches nothing; the first run ends unharmed.
    (Before: no lock; each run's retention deleted the other's checkpoints, their files mixed.)"""
    out = tmp_path / "out"
    args = (f"--train.max_steps={N}", "--checkpoint.interval=5", "--checkpoint.keep_last_n=1")
    first = start_ranks(*args, nproc=2, out_dir=out, corpus=corpus, dataset_dir=dataset_dir,
                        log_dir=tmp_path / "first")
    try:
        poll(lambda: len(logged_steps(out)) >= 2, job=first, timeout=180, what="second metrics row")
        holder = first.workers()[0]
        paused = first.processes()
        for pid in paused:  # hold the first run still, so that any write into its directory would show
            os.kill(pid, signal.SIGSTOP)
        before = tree_state(out)
        second = run_train(*args, nproc=2, out_dir=out, corpus=corpus, dataset_dir=dataset_dir, check=False,
                           timeout=120)
        assert tree_state(out) == before
        for pid in paused:
            os.kill(pid, signal.SIGCONT)
        assert first.wait(timeout=180) == 0, first.stderr[-4000:]
    finally:
        first.kill()
    errors = [line for line in second.stderr.splitlines() if line.startswith("error:")]
    assert second.returncode != 0 and len(errors) == 1, second.stderr[-4000:]
    assert f"{out} is in use by another run (host {socket.gethostname()}, pid {holder}, started " in errors[0], errors
    assert worker_tracebacks(second.stderr) == 0, second.stderr[-4000:]
    assert logged_steps(out) == list(range(1, N + 1)) and losses(out) == reference
    assert checkpoint_steps(out) == [N]


# ---- non-finite loss ------------------------------------------------------------------------------------


def all_tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from all_tensors(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from all_tensors(value)


class _ExitCodeSeenLate:
    """A rank whose exit code reaches the launcher only once it waits for it: the rank ended, and the fork server
    reaped it, before the launcher stopped it."""

    def __init__(self, proc):
        self.proc, self.waited = proc, False

    def __getattr__(self, name):
        return getattr(self.proc, name)

    def join(self, timeout=None):
        self.waited = True
        self.proc.join(timeout)

    @property
    def exitcode(self):
        return self.proc.exitcode if self.waited else None


def test_launcher_stops_ranks_that_end_as_they_are_stopped(tmp_path):
    from tests import launcher

    # os._exit, not sys.exit: a tracker's exit hook (wandb) may have replaced sys.exit in this process, and
    # the replacement cannot be sent to the fork server.
    proc = launcher._fork_server().Process(target=os._exit, args=(1,))
    proc.start()
    deadline = time.monotonic() + 60
    while Path(f"/proc/{proc.pid}").exists() and time.monotonic() < deadline:  # reaped; exit code not yet read
        time.sleep(0.01)
    assert not Path(f"/proc/{proc.pid}").exists()
    err = tmp_path / "stderr"
    err.write_text("")
    launcher._stop([_ExitCodeSeenLate(proc)], str(err))
    assert proc.exitcode == 1 and err.read_text() == ""  # ended by itself: no SIGKILL said


def test_nan_loss_stops_before_the_update(corpus, dataset_dir, tmp_path):
    out = tmp_path / "out"
    proc = run_train("--train.max_steps=6", "--checkpoint.interval=1", "--checkpoint.keep_last_n=0", nproc=2,
                     out_dir=out, corpus=corpus, dataset_dir=dataset_dir, check=False, timeout=180,
                     faults={"nan_at_step": 3})
    assert proc.returncode != 0, proc.stderr[-4000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "non-finite" in errors[0] and "step 3" in errors[0], proc.stderr[-4000:]
    assert checkpoint_steps(out) == [1, 2]
    assert not list(out.glob(".tmp-*"))
    for step in (1, 2):
        payload = torch.load(out / f"fsdp_cpt{step}.pth", map_location="cpu", weights_only=True)
        tensors = list(all_tensors({"model": payload["model"], "optimizer": payload["optimizer"]}))
        assert tensors and all(torch.isfinite(t).all() for t in tensors if t.is_floating_point())
    assert [row["step"] for row in read_metrics(out)] == [1, 2]  # nothing at all logged for step 3


def test_nan_loss_skipped_with_max_bad_steps(corpus, dataset_dir, tmp_path):
    out = tmp_path / "out"
    proc = run_train("--train.max_steps=6", "--train.max_bad_steps=1", nproc=2, out_dir=out, corpus=corpus,
                     dataset_dir=dataset_dir, timeout=180, faults={"nan_at_step": 3})
    # Every rank decides the same way and each logs the warning (ranks other than 0 log warnings too).
    warnings = sorted(line.split("] ", 1) for line in proc.stderr.splitlines() if "non-finite" in line)
    assert [tag.split()[-1] for tag, _ in warnings] == ["rank0", "rank1"], proc.stderr[-4000:]
    message = warnings[0][1]
    assert warnings[1][1] == message and "at step 3: skipping the update (1 of train.max_bad_steps=1)" in message
    loss = losses(out)
    assert sorted(loss) == list(range(1, 7))
    assert math.isnan(loss[3]) and all(math.isfinite(loss[s]) for s in (1, 2, 4, 5, 6))
    payload = torch.load(out / "fsdp_cpt6.pth", map_location="cpu", weights_only=True)
    assert all(torch.isfinite(t).all() for t in all_tensors(payload["model"]) if t.is_floating_point())


# ---- HYBRID_SHARD -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("version", [1, 2])
def test_hybrid_shard_matches_full_shard_and_checkpoints_cross_over(version, corpus, dataset_dir, tmp_path):
    common = ("--train.max_steps=6", "--train.global_batch_size=8", "--train.micro_batch_size=2",
              f"--fsdp.version={version}", "--checkpoint.format=sharded", "--checkpoint.interval=3",
              "--checkpoint.keep_last_n=0")
    result = {}
    for strategy in ("FULL_SHARD", "HYBRID_SHARD"):
        out = tmp_path / strategy
        extra = ("--fsdp.hybrid_shard_group_size=2",) if strategy == "HYBRID_SHARD" else ()
        proc = run_train(*common, f"--fsdp.sharding_strategy={strategy}", *extra, nproc=4, out_dir=out, corpus=corpus,
                         dataset_dir=dataset_dir, timeout=240)
        assert f"FSDP{version} {strategy}" in proc.stderr
        result[strategy] = losses(out)
    full, hybrid = result["FULL_SHARD"], result["HYBRID_SHARD"]
    assert sorted(full) == sorted(hybrid) == list(range(1, 7))
    # Not bit-exact, by design: FULL_SHARD sums each gradient over the 4 ranks in one reduce-scatter, HYBRID_SHARD
    # reduce-scatters within each pair and then all-reduces across the pairs, so the same fp32 numbers are added
    # in another order. Measured (torch 2.13, gloo, fp32), for both versions: steps 1-2 identical, later steps
    # differ by at most one float32 ulp (relative 1.0e-7). rel=1e-6 leaves ~10x margin for a few more steps and
    # is far below what a wrong reduction does (a missing or double-counted replica changes the update itself).
    assert hybrid == pytest.approx(full, rel=1e-6, abs=0)

    # Checkpoints cross over, one direction per version: FSDP1's hybrid step-3 checkpoint continues as
    # FULL_SHARD, FSDP2's FULL_SHARD one as HYBRID_SHARD, each reproducing steps 4-6 of the run it continues
    # (same tolerance, same reason).
    source, strategy = ("HYBRID_SHARD", "FULL_SHARD") if version == 1 else ("FULL_SHARD", "HYBRID_SHARD")
    extra = ("--fsdp.hybrid_shard_group_size=2",) if strategy == "HYBRID_SHARD" else ()
    out = tmp_path / f"{source}-to-{strategy}"
    run_train(*common, f"--fsdp.sharding_strategy={strategy}", *extra,
              f"--resume_from={tmp_path / source / 'fsdp_sharded_cpt3'}", nproc=4, out_dir=out, corpus=corpus,
              dataset_dir=dataset_dir, timeout=240)
    resumed = losses(out)
    assert sorted(resumed) == [4, 5, 6]
    assert resumed == pytest.approx({s: result[source][s] for s in resumed}, rel=1e-6, abs=0)


# ---- a rank that stops answering ---------------------------------------------------------------------------


def test_stopped_rank_ends_the_job_within_the_timeout(reference, corpus, dataset_dir, tmp_path):
    timeout_s = 15  # not less: under load, rank 1 may reach the first collectives seconds after rank 0
    out = tmp_path / "out"
    job = start_ranks(f"--train.max_steps={N}", f"--run.timeout_s={timeout_s}", nproc=2, out_dir=out, corpus=corpus,
                      dataset_dir=dataset_dir, log_dir=tmp_path / "run")
    try:
        poll(lambda: len(logged_steps(out)) >= 2, job=job, timeout=180, what="second metrics row")
        workers = job.workers()
        assert sorted(workers) == [0, 1], workers
        os.kill(workers[1], signal.SIGSTOP)  # alive, sockets open, never answers again
        stopped_at = time.monotonic()
        poll(lambda: not alive(workers[0]), job=job, timeout=timeout_s + 60, what="rank 0 to end")
        took = time.monotonic() - stopped_at
        # The launcher (torchrun, or tests/launcher.py alike) then sends the stopped rank SIGTERM, which a stopped
        # process never handles, and SIGKILL 30 s later (its grace, not ours): the test sends that SIGKILL now.
        os.kill(workers[1], signal.SIGKILL)
        rc = job.wait(timeout=60)
        stderr = job.stderr
        assert rc != 0, stderr[-4000:]
        # torchrun tags each worker's lines with its rank; forked ranks share one stderr, where rank 1 (stopped
        # before its collectives could time out, then killed) wrote nothing of the kind.
        tag = r"\[rank0\]: " if isinstance(job, Job) else ""
        assert re.search(tag + r"RuntimeError: .*Timed out waiting \d+ms", stderr), stderr[-4000:]
        assert took >= timeout_s - 1, f"rank 0 ended {took:.1f} s after SIGSTOP: sooner than the collective timeout"
        assert not alive(workers[0]) and not alive(workers[1])
        assert logged_steps(out)[-1] < N
    finally:
        job.kill()
