"""The launch's checks, before any process group starts: the config against the launch (config/launch.py), then
what needs the library's parts to answer: the checkpoint to resume, FP8 on this rank's device, the trackers'
packages, a Hugging Face model's folder, lm-eval's tasks. Every problem is collected, one line each."""
from __future__ import annotations

from pathlib import Path

import torch

from config import Config, launch_problems

from ..checkpoint.errors import CheckpointError
from ..checkpoint.metadata import check_structure
from ..checkpoint.retention import complete_checkpoints
from ..distributed import Launch
from ..evaluation.downstream import task_problems
from ..observability.trackers import tracker_problems
from ..parallel.float8 import float8_output_problems, float8_problems
from ..parallel.hf import hf_problems
from .planning.report import launch_line
from .resume import resume_refusals
from .run_data import data_problems


def launch_checks(cfg: Config, launch: Launch, resume_from: str | None, *, any_world: bool = False) -> list[str]:
    """Everything that can be checked before the process group starts, beyond the config's own checks (which
    load_config made). With `any_world` (--check): all but what depends on the world size, and also what a run finds
    only once its process group has started, before its first step, where no GPU is needed to find it: the data files
    and what the resume would refuse. Not the output directory's lock: the nodes joining an elastic job check their
    command while the job holds it."""
    problems = launch_problems(cfg, world_size=None if any_world else launch.world_size,
                               local_world_size=launch.local_world_size, num_gpus=torch.cuda.device_count())
    problems += (resumed := resume_problems(resume_from, output_dir=cfg.output_dir))
    if any_world:
        problems += data_problems(cfg)
        if not resumed:  # the checkpoint named is whole: what would resuming it refuse?
            problems += resume_refusals(cfg, resume_from)
    problems += float8_problems(cfg.train.float8, run_device=cfg.run.device, local_rank=launch.local_rank)
    problems += float8_output_problems(cfg.train.float8_output, run_device=cfg.run.device,
                                       local_rank=launch.local_rank)
    if launch.rank == 0:  # the trackers live on rank 0 only
        problems += tracker_problems(cfg.logging.trackers)
    if cfg.model.type == "hf" and not problems:  # the folder exists (the config's checks): can it be used?
        problems += hf_problems(cfg.model, document_masking=cfg.data.document_masking)
    # lm-eval importable and every task known, before step 1 (not at the first evaluation).
    problems += task_problems(cfg.train.eval_tasks, cfg.train.eval_tasks_path, where="train.eval_tasks")
    return problems


def resume_problems(resume_from: str | None, *, output_dir: Path) -> list[str]:
    """--resume_from: latest needs a complete checkpoint in the run's output directory; a path, a checkpoint whose
    structure is whole (a torch.save file, or a folder with all its files)."""
    if resume_from == "latest" and not complete_checkpoints(output_dir):
        return [f"--resume_from latest: no complete checkpoint in {output_dir} (run.output_dir) to resume"]
    if resume_from not in (None, "latest"):
        try:
            check_structure(Path(resume_from))
        except CheckpointError as err:
            return [f"--resume_from: {err}"]
    return []


def estimate_line(cfg: Config, launch: Launch) -> str | None:
    """--check's line of the estimate (fsdp_utils/train/planning/) for the config as launched: at the world size of the
    launch, on this machine's GPU, or where it has none, on an H100 for a config meant for GPUs (run.device cuda, or a
    micro-batch or checkpointing policy chosen in GPU memory: auto). None for a run on the CPU."""
    gpu_here = torch.cuda.is_available()
    meant_for_gpus = cfg.run.device == "cuda" or "auto" in (cfg.train.micro_batch_size,
                                                            cfg.fsdp.activation_checkpointing)
    if cfg.run.device == "cpu" or not (gpu_here or meant_for_gpus):
        return None
    name = torch.cuda.get_device_name(launch.local_rank % torch.cuda.device_count()) if gpu_here else None
    nodes = max(1, launch.world_size // max(launch.local_world_size, 1))
    return launch_line(cfg, gpus=launch.world_size, nodes=nodes, device_name=name)
