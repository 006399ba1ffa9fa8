"""Start a training script's ranks without paying for Python and torch start-up every time.

A training job on the tiny test model spends most of its CPU time importing torch and this project
(several seconds per rank), a few hundredths of a second per step. `launch` (or `Job`, for a job that runs
in the background while the test signals its ranks) forks each rank from a multiprocessing fork server that
imported all of that once per test session, and gives every rank what torchrun would: its rank variables, a
rendezvous address, the job's environment and working directory, its own stdout and stderr; when one rank
fails, the others are stopped (SIGTERM, then SIGKILL) and the job fails with exit code 1, as torchrun reports
it. A one-rank job runs like `python script.py`.

The tests of torchrun's own behaviour (launchers, its restarts and rendezvous, signals sent to its agent, its
reports) keep real processes (tests/test_failures.py `Job`, `run_train(prefix=...)`). FSDP_TEST_LAUNCH=process
runs every job as a real torchrun or python process instead.
"""
from __future__ import annotations

import gc
import multiprocessing
import multiprocessing.connection
import os
import resource
import runpy
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRELOAD = ["tests.rank_preload"]
HUGGING_FACE_PRELOAD = "tests.rank_preload_hf"
STOP_GRACE_S = 30  # torchrun's own wait between SIGTERM and SIGKILL

_context = None


def enabled() -> bool:
    return os.environ.get("FSDP_TEST_LAUNCH", "fork") != "process"


def _fork_server():
    """The session's fork server, started with one thread per rank (what OMP_NUM_THREADS=1 gives the jobs)."""
    global _context
    if _context is None:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(PRELOAD)
        saved = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"  # read once, when the server imports torch
        try:
            from multiprocessing import forkserver
            forkserver.ensure_running()
        finally:
            if saved is None:
                os.environ.pop("OMP_NUM_THREADS")
            else:
                os.environ["OMP_NUM_THREADS"] = saved
        _context = context
    return _context


def preload_hugging_face() -> None:
    """Have the fork server import transformers too (tests/rank_preload_hf.py); before it starts."""
    if HUGGING_FACE_PRELOAD not in PRELOAD:
        PRELOAD.append(HUGGING_FACE_PRELOAD)


def shutdown() -> None:
    """Stop the fork server (end of the test session), so that it and its ranks are waited for."""
    global _context
    if _context is not None:
        from multiprocessing import forkserver
        forkserver._forkserver._stop()  # private, but the only way to stop it before the interpreter exits
        _context = None


def context():
    """The fork server's multiprocessing context, for tests that start ranks of their own."""
    return _fork_server()


def _rank_main(script: str, argv: list[str], env: dict, cwd: str, out_path: str, err_path: str,
               fsize_limit: int | None) -> None:
    """One rank: the job's environment, directory, output files and file size limit, then the script as
    `__main__`."""
    frozen_heap()
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, out_path), (2, err_path)):
        target = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(target, fd)
        os.close(target)
    if fsize_limit is not None:  # what `prlimit --fsize` sets; Python ignores SIGXFSZ, so a write past it fails EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize_limit, fsize_limit))
    import torch

    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    sys.argv = [script, *argv]
    runpy.run_path(script, run_name="__main__")


def frozen_heap() -> None:
    """In a forked rank: what it inherited from the fork server (torch, the project, transformers) is left out of
    the garbage collector's passes, so that a full collection (destroy_distributed runs one) traverses only what
    the rank made, not the whole preloaded heap."""
    gc.freeze()


class Job:
    """`script_argv` (a script path and its arguments) started as `nproc` forked ranks, running in the background:
    their pids by rank and the output so far, then `wait` for the finished job. Its stdout and stderr go to files
    in `log_dir` (a temporary folder, removed once the job is waited for, unless given). `fsize_limit`: the largest
    file a rank may write, in bytes (RLIMIT_FSIZE, as `prlimit --fsize` sets it)."""

    def __init__(self, script_argv: list[str], *, nproc: int, env: dict, cwd: Path = ROOT,
                 log_dir: Path | None = None, fsize_limit: int | None = None):
        context = _fork_server()
        env = dict(env)
        self.argv, self._agent_store = script_argv, None
        if nproc > 1:
            # Like torchrun's agent, this process hosts a store the ranks share (on a port the system picked as
            # it bound it: parallel test jobs can't race for one); rank 0 starts the job's own store through it.
            import torch.distributed as dist

            self._agent_store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(self._agent_store.port),
                       TORCHELASTIC_USE_AGENT_STORE="True", WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                       GROUP_RANK="0", TORCHELASTIC_RUN_ID="forked-test-job", TORCHELASTIC_RESTART_COUNT="0",
                       TORCHELASTIC_MAX_RESTARTS="0")
        self._tmp = tempfile.TemporaryDirectory(prefix="job-") if log_dir is None else None
        log_dir = Path(self._tmp.name) if self._tmp else log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        self.out_path, self.err_path = log_dir / "stdout", log_dir / "stderr"
        for path in (self.out_path, self.err_path):
            path.write_text("")
        self.procs = []
        for rank in range(nproc):
            rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank)} if nproc > 1 else env
            proc = context.Process(target=_rank_main, args=(script_argv[0], script_argv[1:], rank_env, str(cwd),
                                                            str(self.out_path), str(self.err_path), fsize_limit))
            proc.start()
            self.procs.append(proc)

    @property
    def pids(self) -> list[int]:
        return [proc.pid for proc in self.procs]

    @property
    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")

    def poll(self) -> int | None:
        """None while a rank runs; then the job's exit code (see `wait`)."""
        return None if any(proc.exitcode is None for proc in self.procs) else self._returncode()

    def _returncode(self) -> int:
        codes = [proc.exitcode for proc in self.procs]
        return codes[0] if len(codes) == 1 else (0 if all(c == 0 for c in codes) else 1)

    def wait(self, timeout: float = 300) -> subprocess.CompletedProcess:
        """The finished job, like subprocess.run(capture_output=True, text=True) of torchrun or python, with
        each rank's exit code (`exitcodes`, a signal's negative). The first rank to fail has the others
        stopped, as torchrun does. TimeoutExpired past `timeout`, with every rank stopped."""
        timed_out = not _wait(self.procs, timeout, str(self.err_path))
        stdout, stderr = self.out_path.read_text(errors="replace"), self.stderr
        self.close()
        if timed_out:
            raise subprocess.TimeoutExpired(self.argv, timeout, output=stdout, stderr=stderr)
        result = subprocess.CompletedProcess(self.argv, self._returncode(), stdout, stderr)
        result.exitcodes = [proc.exitcode for proc in self.procs]  # type: ignore[attr-defined]
        return result

    def kill(self) -> None:
        """SIGKILL every rank still running (a test's cleanup, whatever happened)."""
        for proc in self.procs:
            if proc.exitcode is None:
                proc.kill()
                proc.join()
        self.close()

    def close(self) -> None:
        self._agent_store = None  # every rank has ended
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


def launch(script_argv: list[str], *, nproc: int, env: dict, cwd: Path = ROOT, timeout: float = 300,
           fsize_limit: int | None = None) -> subprocess.CompletedProcess:
    """Run `script_argv` (a script path and its arguments) as `nproc` forked ranks: the finished `Job`."""
    return Job(script_argv, nproc=nproc, env=env, cwd=cwd, fsize_limit=fsize_limit).wait(timeout)


def _wait(procs: list, timeout: float, err_path: str) -> bool:
    """Wait for every rank; the first to fail has the others stopped. False if `timeout` passed."""
    deadline = time.monotonic() + timeout
    running = list(procs)
    while running:
        left = deadline - time.monotonic()
        if left <= 0:
            _stop(running, err_path)
            return False
        multiprocessing.connection.wait([p.sentinel for p in running], timeout=left)
        running = [p for p in running if p.exitcode is None]
        if running and any(p.exitcode not in (None, 0) for p in procs):
            _stop(running, err_path)
            running = []
    return True


def _stop(procs: list, err_path: str) -> None:
    """SIGTERM, then SIGKILL for a rank still there after the grace period, said in the job's stderr as
    torchrun says it, so that a test can tell a rank that ended by itself from one that was forced out."""
    for proc in procs:
        # terminate(), not os.kill: a rank can have ended, and been reaped by the fork server, before its exit code
        # reaches this process; terminate() lets such a rank be.
        proc.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
        if proc.exitcode is None:
            proc.kill()
            proc.join()
            with open(err_path, "a") as err:
                err.write(f"launcher: process {proc.pid} did not stop {STOP_GRACE_S} s after SIGTERM: sent SIGKILL\n")
