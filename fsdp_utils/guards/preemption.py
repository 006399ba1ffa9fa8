"""Stop signals: the first one asks the loop to save a checkpoint at the end of the step and exit 0; a
second one aborts at once, without saving.

Any rank may receive the signal (Slurm signals every task, a failing node only its own, torchrun
forwards a Ctrl-C to every worker); the loop all-reduces the flag each step so that all ranks stop
together after the same step. The handlers are installed before the process group starts, so that a
signal during setup never ends a worker with a traceback: the run then stops after its first step.

In an elastic job (Launch.elastic) a SIGTERM is torchrun's agent stopping its workers in order to restart
them: it sends SIGTERM whenever it restarts them (a node joins, a worker failed); signalled itself, it
passes that signal on and ends whatever the workers' exit codes. The workers save as for any stop, then
exit with RESTART_EXIT_CODE rather than 0: the agent that sent the signal restarts them whatever their
exit code, but another node's agent, whose workers stopped with them after the same step (the flag is
shared), sees them exit by themselves and would take 0 for the job's end. A user's stop reaches the
workers as another signal (the launchers forward Ctrl-C, SIGTERM and SIGHUP as SIGINT; Slurm's warning
is SIGUSR1) and still ends the job with 0.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time

import torch
import torch.distributed as dist

from ..distributed import DistEnv

log = logging.getLogger(__name__)

# Not 0, which an agent takes for the job's end: torchrun restarts the workers after any other code.
RESTART_EXIT_CODE = 75


class StopSignal:
    def __init__(self, signal_names: list[str], *, grace_s: float, elastic: bool = False):
        self.grace_s = grace_s
        self.elastic = elastic
        self.received_at: float | None = None
        self.name = ""
        for name in signal_names:
            signal.signal(getattr(signal, name), self._handle)

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.received_at is not None:
            # A second signal (Ctrl-C twice; or torchrun's SIGTERM after its own second Ctrl-C): the user
            # wants out now. The newest complete checkpoint stays as it is; an interrupted save leaves only
            # a .tmp- name, which the next save removes.
            os.write(2, f"{name} after {self.name}: aborting without saving\n".encode())
            os._exit(128 + signum)
        self.received_at = time.monotonic()
        self.name = name
        # Handlers must not log (the logging lock may be held by the interrupted frame): a thread does.
        threading.Thread(target=self._watchdog, daemon=True).start()

    @property
    def requested(self) -> bool:
        return self.received_at is not None

    @property
    def restart(self) -> bool:
        """The stop is torchrun's, in order to restart the workers (see the module docstring)."""
        return self.elastic and self.name == "SIGTERM"

    def _watchdog(self) -> None:
        log.warning("%s received: saving a checkpoint after the current step (grace period %.0f s; "
                    "a second signal aborts without saving)", self.name, self.grace_s)
        time.sleep(self.grace_s)
        # Still running after the grace period: the scheduler will kill us anyway; say so and exit non-zero
        # rather than be killed mid-write (the previous complete checkpoint stays valid either way).
        log.error("grace period of %.0f s after %s ran out before the checkpoint was saved; exiting", self.grace_s,
                  self.name)
        os._exit(1)


def after_stop(stop: StopSignal, env: DistEnv, *, step: int) -> bool:
    """After the save of a stop (every rank): whether torchrun restarts the workers, any rank's SIGTERM in an
    elastic job, decided together; and the line that says what happens next."""
    restarting = False
    if stop.elastic:
        restart = torch.tensor([float(stop.restart)], device=env.device)
        dist.all_reduce(restart, op=dist.ReduceOp.MAX)
        restarting = restart.item() > 0
    if env.is_main and restarting:
        log.info("stopped by torchrun at step %d after saving: the elastic job's nodes change, and the workers "
                 "restart from this checkpoint at the new world size", step)
    elif env.is_main:
        log.info("stopped by a signal at step %d after saving; rerun the same command to continue "
                 "(checkpoint.auto_resume), or pass --resume_from latest", step)
    return restarting
