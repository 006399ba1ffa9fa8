"""Train a decoder-only language model with FSDP.

    torchrun --nproc_per_node=2 train_fsdp.py config/train_tiny_fsdp.yaml        # 2 ranks (gloo on CPU, NCCL on GPU)
    python train_fsdp.py config/train_tiny_fsdp.yaml --train.max_steps=50        # one process
    torchrun --nproc_per_node=8 train_fsdp.py config/train1B_fsdp.yaml --resume_from latest

Reads top to bottom: config, process group, data, model, optimizer, resume, loop, final save, teardown.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from pathlib import Path

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from config import Config, ConfigError, config_warnings, launch_problems, load_config, split_known_args
from data import DataError
from fsdp_utils.checkpoint import CheckpointError
from fsdp_utils.checkpoint.format import check_structure
from fsdp_utils.checkpoint.retention import complete_checkpoints
from fsdp_utils.distributed import (
    DistEnv,
    Launch,
    destroy_distributed,
    init_distributed,
    prefer_expandable_segments,
    read_torchrun_env,
)
from fsdp_utils.parallel.build import ModelMemoryError
from fsdp_utils.parallel.float8 import float8_output_problems, float8_output_vocabulary_problems, float8_problems
from fsdp_utils.parallel.hf import HFModelError, hf_problems
from fsdp_utils.train.build_run import _host_free as host_free
from fsdp_utils.train.downstream import DownstreamError, task_problems
from fsdp_utils.train.elastic import unfit_world, wait_for_membership_change
from fsdp_utils.train.oom_guard import OutOfMemory
from fsdp_utils.train.preemption import RESTART_EXIT_CODE, StopSignal
from fsdp_utils.train.run_lock import RunLocked, take_run_lock
from fsdp_utils.train.trackers import tracker_problems
from fsdp_utils.train.trainer import NonFiniteError, Trainer

# Errors of the user's input or the run's state, raised alike on every rank: one line, exit 1.
USER_ERRORS = (ConfigError, DataError, CheckpointError, OutOfMemory, ModelMemoryError, HFModelError, NonFiniteError,
               DownstreamError)


OVERRIDES_HELP = """config overrides:
  --section.key=value   any config field, over the YAML file's value; sections: run, model, data, train,
                        fsdp, checkpoint, logging. Lists and mappings in YAML flow style:
                        --train.max_steps=2000 --fsdp.sharding_strategy=SHARD_GRAD_OP
                        --data.files=[a.jsonl,b.jsonl] --logging.profile_steps=[5,6]
  Every field, its default and its meaning: docs/configuration.md
"""


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=OVERRIDES_HELP)
    parser.add_argument("config", help="YAML config, e.g. config/train_tiny_fsdp.yaml")
    parser.add_argument("--resume_from", default=None, help="checkpoint file, sharded folder, or 'latest'")
    parser.add_argument("--check", action="store_true",
                        help="only check the config, --resume_from and what the options need on this machine "
                             "(all but the world size): print the problems and exit 2, or exit 0; the elastic "
                             "launchers run it first, since torchrun would repeat a config error at every restart")
    return split_known_args(parser, argv)


def setup_logging(env: DistEnv) -> None:
    # Rank 0 speaks; the others report warnings and errors only, tagged with their rank.
    level = logging.INFO if env.is_main else logging.WARNING
    logging.basicConfig(level=level, format=f"[%(asctime)s rank{env.rank}] %(message)s", datefmt="%H:%M:%S", force=True)


def early_problems(cfg: Config, launch: Launch, resume_from: str | None, *, any_world: bool = False) -> list[str]:
    """Everything that can be checked before the process group starts, beyond the config itself; with
    `any_world`, all but what depends on the world size."""
    problems = launch_problems(cfg, world_size=None if any_world else launch.world_size,
                               local_world_size=launch.local_world_size, num_gpus=torch.cuda.device_count())
    if resume_from == "latest" and not complete_checkpoints(cfg.output_dir):
        problems.append(f"--resume_from latest: no complete checkpoint in {cfg.output_dir} (run.output_dir) to resume")
    elif resume_from not in (None, "latest"):
        try:
            check_structure(Path(resume_from))  # exists, a torch.save file or a folder with all its files
        except CheckpointError as err:
            problems.append(f"--resume_from: {err}")
    problems += float8_problems(cfg.train.float8, run_device=cfg.run.device, local_rank=launch.local_rank)
    problems += float8_output_problems(cfg.train.float8_output, run_device=cfg.run.device,
                                       local_rank=launch.local_rank)
    problems += float8_output_vocabulary_problems(cfg)
    if launch.rank == 0:  # the trackers live on rank 0 only
        problems += tracker_problems(cfg.logging.tracker_names)
    if cfg.model.type == "hf" and not problems:  # the folder exists (launch_problems): can it be used?
        main = launch.rank == 0  # reads the weights and holds their full copy, on this host
        problems += hf_problems(cfg.model, document_masking=cfg.data.document_masking,
                                host_free=host_free() if main else None, weights=main)
    # lm-eval importable and every task known, before step 1 (not at the first evaluation).
    problems += task_problems(cfg.train.eval_tasks, cfg.train.eval_tasks_path, where="train.eval_tasks")
    return problems


def exit_early(problems: list[str], launch: Launch) -> int:
    """Report problems found before the process group as `error:` lines, once: rank 0 prints them.

    Under torchrun the other ranks then wait to be stopped: torchrun stops every worker as soon as one
    ends, so a rank that ended first could have rank 0 stopped before it printed anything."""
    if launch.rank == 0:
        for line in problems:
            print(f"error: {line}", file=sys.stderr)
    elif launch.under_torchrun:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: os._exit(2))
        time.sleep(60)
    return 2


def check_passed(cfg: Config, launch: Launch) -> int:
    """--check found no problem: print the config's warnings (a run logs them at its start) and exit 0."""
    if launch.rank == 0:
        for line in config_warnings(cfg):
            print(f"warning: {line}", file=sys.stderr)
    return 0


@record  # an uncaught error lands in torchrun's error file, reported with its rank
def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    prefer_expandable_segments()  # before anything touches the GPU
    launch = read_torchrun_env()
    # Every problem with the config and the launch is found before any process group starts.
    unfit: list[str] = []
    try:
        cfg = load_config(args.config, overrides)
        problems = early_problems(cfg, launch, args.resume_from, any_world=args.check)
        if launch.elastic:  # a world size that cannot hold the batch waits for the next (fsdp_utils/train/elastic.py)
            unfit = unfit_world(cfg, launch.world_size)
            problems = [p for p in problems if p not in unfit]
    except ConfigError as err:
        problems = err.problems
    if problems:
        return exit_early(problems, launch)
    if args.check:
        return check_passed(cfg, launch)

    stop = StopSignal(cfg.run.stop_signals, grace_s=cfg.run.preemption_grace_s,  # Ctrl-C from here on saves
                      elastic=launch.elastic)
    env = init_distributed(device=cfg.run.device, timeout_s=cfg.run.timeout_s)
    lock = None
    try:
        setup_logging(env)
        if unfit:
            return wait_for_membership_change(cfg, env, stop)
        lock = take_run_lock(cfg.output_dir, env)  # before anything is written into the output directory
        trainer = Trainer(cfg, env, stop=stop, resume_from=args.resume_from)
        trainer.fit()
        return RESTART_EXIT_CODE if trainer.restarting else 0
    except RunLocked as err:
        if env.is_main:
            print(f"error: {err}", file=sys.stderr)
        return 2
    except USER_ERRORS as err:
        if env.is_main:
            print(f"error: {err}", file=sys.stderr)
        return 1
    except OSError as err:  # a file this rank could not write (a full disk): said by the rank that met it
        print(f"error: rank {env.rank}: {err}", file=sys.stderr)
        return 1
    finally:
        destroy_distributed()
        if lock is not None:
            os.close(lock)  # the operating system would release it at exit anyway


if __name__ == "__main__":
    sys.exit(main())
