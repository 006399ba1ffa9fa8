"""Elastic jobs (torchrun --nnodes=MIN:MAX): what the workers of a world that cannot hold the global batch do (the
world sizes a config can train at are config/launch.py's): wait for the next membership change.

torchrun's agent restarts its workers only when they fail (a non-zero exit, which uses up --max-restarts)
or when a node waits to join; workers that exit 0 end the job. Workers that refused the world size and
exited would therefore either end the job or be restarted into the same world until the restarts run out.
Instead they stay up and idle: the agent restarts them when a node joins, and a peer that dies ends the
small collective they meet in every few seconds, whose failure has them restarted without it.
"""
from __future__ import annotations

import logging
import time

import torch
import torch.distributed as dist

from config import TrainConfig, fitting_world_sizes

from ..distributed import DistEnv
from .preemption import RESTART_EXIT_CODE, StopSignal

log = logging.getLogger("train")

POLL_S = 2.0  # how often idle workers check on each other and on stop signals


def refusal_line(t: TrainConfig, world_size: int) -> str:
    """Why this world size waits (the train section's batch cannot split over it), and the sizes that can."""
    sizes = ", ".join(map(str, fitting_world_sizes(t)))
    return (f"world size {world_size} cannot hold train.global_batch_size={t.global_batch_size} "
            f"(train.micro_batch_size={t.micro_batch_size}); the world sizes that can: {sizes}. Waiting for a node "
            "to join or leave: torchrun then restarts the workers at the new size")


def wait_for_membership_change(t: TrainConfig, env: DistEnv, stop: StopSignal) -> int:
    """Idle until torchrun restarts the workers or a stop signal arrives; returns the exit code.

    Every POLL_S the ranks all-reduce their stop signals: a user's stop ends the job (0), torchrun's
    (a node joins) or a failed collective (a peer is gone) restarts it (RESTART_EXIT_CODE)."""
    if env.is_main:
        log.warning("%s", refusal_line(t, env.world_size))
    while True:
        flags = torch.tensor([float(stop.requested and not stop.restart), float(stop.restart)], device=env.device)
        try:
            dist.all_reduce(flags)
        except (RuntimeError, OSError):  # gloo/NCCL errors: a peer left the world
            return RESTART_EXIT_CODE
        user_stop, restart = flags.tolist()
        if restart:
            return RESTART_EXIT_CODE
        if user_stop:
            return 0
        time.sleep(POLL_S)
