"""Stop signals: the first one asks the loop to save a checkpoint at the end of the step and exit 0; a
second one aborts at once, without saving.

Any rank may receive the signal (Slurm signals every task, a failing node only its own, torchrun
forwards a Ctrl-C to every worker); the loop all-reduces the flag each step so that all ranks stop
together after the same step. The handlers are installed before the process group starts, so that a
signal during setup never ends a worker with a traceback: the run then stops after its first step.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time

log = logging.getLogger(__name__)


class StopSignal:
    def __init__(self, signal_names: list[str], *, grace_s: float):
        self.grace_s = grace_s
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

    def _watchdog(self) -> None:
        log.warning("%s received: saving a checkpoint after the current step (grace period %.0f s; "
                    "a second signal aborts without saving)", self.name, self.grace_s)
        time.sleep(self.grace_s)
        # Still running after the grace period: the scheduler will kill us anyway; say so and exit non-zero
        # rather than be killed mid-write (the previous complete checkpoint stays valid either way).
        log.error("grace period of %.0f s after %s ran out before the checkpoint was saved; exiting", self.grace_s,
                  self.name)
        os._exit(1)
