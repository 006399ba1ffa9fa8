"""Test-only faults for real training jobs, kept out of the production code.

`tests/with_faults.py SCRIPT ARGS` runs train_fsdp.py (or another script) with the faults of the JSON
object in FSDP_TEST_FAULTS installed, by wrapping production functions in that process (`install`). Faults:
- "stage_fail": [steps]: staging an asynchronous save of those steps fails (0: the staging tried at
  the start of the run);
- "write": {"step": K (optional: every save), "delay_s": S, "fail": bool}: the background write of the
  save at step K sleeps S seconds first, then fails on every rank if "fail";
- "sync_write_fail": [steps]: a synchronous DCP write of those steps fails (the fallback of a failed
  background write, or a synchronous save);
- "disk_free_bytes": N: the checkpoint manager sees N bytes free on the output directory's disk;
- "nan_at_step": K: rank 0's loss of training step K (1-based) is NaN;
- "spike_at_steps": {"steps": [K, ...], "scale": S}: the loss of the K-th training step this process runs (1-based;
  every rank, every micro-batch) is multiplied by S before its backward, and with it the gradients: a spike;
- "fake_gpu_memory": {...}: GPU memory readings from a formula (FakeProbe), so the micro-batch search,
  its agreement across ranks, the cache and the hint run on the CPU;
- "gpu_memory_gib": N: each rank's GPU holds only N GiB, as a smaller card would: the micro-batch search
  reads N GiB as its capacity, and torch's allocator raises a real out-of-memory error past it (HeldGPU);
- "oom": "STEP:PHASE[:MICRO[:RANK]]": a CUDA out-of-memory error at that step (OOMInjection);
- "float8_on_cpu": true: FP8 training allowed on the CPU (torch's reference FP8 matmul, far too slow to
  train with, but it runs the real conversion, FP8 all-gather and checkpoint paths on gloo);
- "dcp_stage_fail": R: DCP's own stager (DefaultStager, benchmarks/checkpoint_staging.py's dcp_* variants) fails
  on rank R alone when it stages a training state (one with a "model" entry), in its staging thread where
  staging is asynchronous;
- "tokenizer_training_delay_s": S: training a tokenizer while preparing data sleeps S seconds first (a long
  preparation, without the CPU time of a large corpus).
"""
from __future__ import annotations

import errno
import functools
import re
import shutil
import time

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter

from fsdp_utils.train.memory import MemoryProbe

ENV = "FSDP_TEST_FAULTS"
_STEP_RE = re.compile(r"cpt(\d+)$")


def _step_of(checkpoint_id) -> int | None:
    match = _STEP_RE.search(str(checkpoint_id))
    return int(match.group(1)) if match else None


class FaultyWriter(FileSystemWriter):
    """DCP's file writer, slowed down or failing inside the write. A module-level class: the process
    writer receives it pickled and imports this module."""

    def __init__(self, path: str, *, delay_s: float, fail: bool):
        super().__init__(path)
        self.delay_s, self.fail = delay_s, fail

    def write_data(self, plan, planner):
        time.sleep(self.delay_s)
        if self.fail:
            raise OSError(errno.EIO, "injected write failure (test hook)")
        return super().write_data(plan, planner)


class FakeProbe(MemoryProbe):
    """Memory readings from a formula instead of a GPU ("fake_gpu_memory"). The JSON object has
    capacity_gib, fixed_gib (the resident part) and per_sample_gib, each a number or a list of one per
    rank, and optionally table_gib {"micro-batch": GiB} for sizes that do not follow the formula: a
    phase at micro-batch b reads fixed + per_sample * b, and raises an out-of-memory error where
    that is over the capacity, as a GPU would. For fsdp.activation_checkpointing=auto,
    policy_per_sample_gib {policy: GiB} replaces per_sample_gib under that policy, and step_seconds
    {policy: s} makes a timed step take s / b seconds at micro-batch b (default: 1 / b). name: the GPU's name
    (default "fake", which the planner does not know; a known one, e.g. "NVIDIA H100 80GB HBM3", has the search
    ordered by the estimate)."""

    def __init__(self, spec: dict, rank: int):
        def pick(value):
            return float(value[rank] if isinstance(value, list) else value) * 2**30

        self.capacity_bytes = pick(spec["capacity_gib"])
        self.fixed, self.default_per_sample = pick(spec.get("fixed_gib", 0)), pick(spec.get("per_sample_gib", 0))
        self.per_sample = self.default_per_sample
        self.policy_per_sample = {k: pick(v) for k, v in spec.get("policy_per_sample_gib", {}).items()}
        self.step_seconds = spec.get("step_seconds", {})
        self.table = {int(k): pick(v) for k, v in spec.get("table_gib", {}).items()}
        self.micro_batch, self.policy = 0, None
        self.gpu_name = spec.get("name", "fake")

    @property
    def name(self) -> str:
        return self.gpu_name

    def total(self) -> int:
        return int(self.capacity_bytes)

    def capacity(self) -> int:
        return int(self.capacity_bytes)

    def begin(self, micro_batch: int, checkpointing: str | None = None) -> None:
        self.micro_batch, self.policy = micro_batch, checkpointing
        self.per_sample = self.policy_per_sample.get(checkpointing, self.default_per_sample)

    def time(self, step, repeats: int = 2) -> float:
        step()  # the real step runs (once), the clock is the formula's
        return float(self.step_seconds.get(self.policy, 1.0)) / self.micro_batch

    def peak_reserved(self) -> int:
        peak = self.table.get(self.micro_batch, self.fixed + self.per_sample * self.micro_batch)
        if peak > self.capacity_bytes:  # as on a GPU: a step that needs more than there is does not finish
            raise torch.OutOfMemoryError(f"CUDA out of memory (fake: {peak / 2**30:.2f} GiB needed, "
                                         f"{self.capacity_bytes / 2**30:.2f} GiB there)")
        return int(peak)

    def peak_allocated(self) -> int:
        return self.peak_reserved()

    def allocated(self) -> int:
        return int(self.fixed)

    def reserved(self) -> int:
        return self.peak_reserved()


class HeldGPU(MemoryProbe):
    """A real GPU held to `gib` GiB ("gpu_memory_gib"): the search's probe reports that capacity, and the
    caching allocator's per-process limit makes anything past it a real out-of-memory error, so a trial
    step the search did not predict to fit fails as it would on the smaller card (the margin alone only
    lowers the budget, and a trial over it still finishes on a large card)."""

    def __init__(self, device: torch.device, gib: float):
        super().__init__(device)
        self.bytes = int(gib * 2**30)
        torch.cuda.set_per_process_memory_fraction(min(1.0, self.bytes / super().total()), device)

    def total(self) -> int:
        return self.bytes

    def capacity(self) -> int:
        return min(self.bytes, super().capacity())


class OOMInjection:
    """("oom": "STEP:PHASE[:MICRO[:RANK]]") Raise a CUDA out-of-memory error once, at
    optimizer step STEP (1-based), in the middle block's forward (PHASE forward), in its backward
    (backward) or in an evaluation's forward (eval), at the MICRO-th micro-batch of the step (default 1),
    on rank RANK only (default: every rank). Not with train.compile (the hooks would be traced)."""

    def __init__(self, step: int, phase: str, micro: int, rank: int | None):
        self.step, self.phase, self.micro, self.rank = step, phase, micro, rank
        self.current_step, self.count, self.done = 0, 0, False

    @classmethod
    def parse(cls, spec: str, rank: int) -> OOMInjection | None:
        step, phase, *rest = spec.split(":")
        assert phase in ("forward", "backward", "eval"), spec
        only = int(rest[1]) if len(rest) > 1 else None
        return cls(int(step), phase, int(rest[0]) if rest else 1, only) if only in (None, rank) else None

    def arm(self, step: int) -> None:
        self.current_step, self.count = step, 0

    def install(self, model: nn.Module, block_classes: set[type]) -> None:
        # isinstance: FSDP2 swaps each sharded block's class for a subclass of it.
        blocks = [m for m in model.modules() if isinstance(m, tuple(block_classes))]
        block = blocks[len(blocks) // 2]
        block.register_forward_pre_hook(self._pre_hook)
        block.register_forward_hook(self._hook)

    def _due(self, module: nn.Module, phase: str) -> bool:
        if self.done or self.current_step != self.step or self.phase != phase:
            return False
        if module.training != (phase != "eval"):
            return False
        self.count += 1
        self.done = self.count == self.micro
        return self.done

    def _pre_hook(self, module, args):
        # Inside the block's FSDP unit: its weights are gathered, its forward not run.
        if self._due(module, "forward") or self._due(module, "eval"):
            raise torch.OutOfMemoryError("CUDA out of memory (injected by the tests)")

    def _hook(self, module, args, output):
        if self._due(module, "backward"):
            return _RaiseInBackward.apply(output)
        return output


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise torch.OutOfMemoryError("CUDA out of memory (injected by the tests)")


# Each installer takes its fault's value from the spec and `current`, shared by all of one install: the
# step of the save being staged or of the training step running (0 before any: the start-of-run staging).


def _install_stage_fail(steps: list[int], *, current: dict) -> None:
    from fsdp_utils.checkpoint import staging
    from fsdp_utils.checkpoint.async_save import AsyncSaver

    failing = set(steps)
    real_start, real_stage = AsyncSaver.start, staging.HostStaging.stage

    @functools.wraps(real_start)
    def start(self, contents):
        current["step"] = contents.state.step
        return real_start(self, contents)

    @functools.wraps(real_stage)
    def stage(self, state_dict, *, live):
        if current["step"] in failing:
            raise RuntimeError(f"injected staging failure at step {current['step']} (test hook)")
        return real_stage(self, state_dict, live=live)

    AsyncSaver.start, staging.HostStaging.stage = start, stage


def _install_write(fault: dict, *, current: dict) -> None:
    real_async_save = dcp.async_save

    @functools.wraps(real_async_save)
    def faulty_async_save(state_dict, **kwargs):
        if fault.get("step") in (None, _step_of(kwargs["checkpoint_id"])):
            kwargs["storage_writer"] = FaultyWriter(kwargs["checkpoint_id"], delay_s=fault.get("delay_s", 0),
                                                    fail=fault.get("fail", False))
        return real_async_save(state_dict, **kwargs)

    dcp.async_save = faulty_async_save


def _install_sync_write_fail(steps: list[int], *, current: dict) -> None:
    failing_sync = set(steps)
    real_save = dcp.save

    @functools.wraps(real_save)
    def faulty_save(state_dict, **kwargs):
        if _step_of(kwargs.get("checkpoint_id")) in failing_sync:
            raise OSError(errno.EIO, "injected synchronous write failure (test hook)")
        return real_save(state_dict, **kwargs)

    dcp.save = faulty_save


def _install_disk_free_bytes(free: int, *, current: dict) -> None:
    from fsdp_utils.checkpoint import base

    class _Shutil:  # the disk-space check's view of shutil: the same, but for disk_usage
        def __getattr__(self, name):
            return getattr(shutil, name)

        @staticmethod
        def disk_usage(path):
            real = shutil.disk_usage(path)
            return type(real)(real.total, real.total - free, free)

    base.shutil = _Shutil()


def _install_nan_at_step(nan_step: int, *, current: dict) -> None:
    import torch.distributed as dist

    from fsdp_utils.train import step as step_module

    real_forward_backward = step_module.forward_backward

    @functools.wraps(real_forward_backward)
    def forward_backward(*args, **kwargs):
        # One call a training step (the faulted runs start afresh and never retry a step): the call's count is the
        # step's number.
        current["training_steps"] = current.get("training_steps", 0) + 1
        loss = real_forward_backward(*args, **kwargs)
        return loss * float("nan") if current["training_steps"] == nan_step and dist.get_rank() == 0 else loss

    step_module.forward_backward = forward_backward


def _install_spike_at_steps(spike: dict, *, current: dict) -> None:
    from fsdp_utils.train import step as step_module

    real_forward_backward = step_module.forward_backward
    steps, scale = set(spike["steps"]), float(spike["scale"])

    @functools.wraps(real_forward_backward)
    def forward_backward(model, *args, **kwargs):
        current["spike_steps"] = current.get("spike_steps", 0) + 1  # one call a training step
        if current["spike_steps"] not in steps:
            return real_forward_backward(model, *args, **kwargs)
        hook = model.register_forward_hook(lambda module, inputs, loss: loss * scale)
        try:
            return real_forward_backward(model, *args, **kwargs)
        finally:
            hook.remove()

    step_module.forward_backward = forward_backward


def _install_fake_gpu_memory(fake: dict, *, current: dict) -> None:
    from fsdp_utils.train import build_run

    build_run.memory_probe = lambda device, rank: FakeProbe(fake, rank)  # the one caller


def _install_gpu_memory_gib(gib: float, *, current: dict) -> None:
    from fsdp_utils.train import build_run

    real = build_run.memory_probe

    def held(device, rank):
        return HeldGPU(device, gib) if device.type == "cuda" else real(device, rank)

    build_run.memory_probe = held


def _install_oom(oom: str, *, current: dict) -> None:
    from fsdp_utils.train.oom_guard import OutOfMemoryGuard
    from model.transformer import DecoderBlock

    real_attempt = OutOfMemoryGuard.attempt

    @functools.wraps(real_attempt)
    def attempt(self, work, *, step, phase, split, model, optimizer):
        if not hasattr(self, "injection"):
            self.injection = OOMInjection.parse(oom, self.env.rank)
            if self.injection is not None:
                self.injection.install(model, {DecoderBlock})
        if self.injection is not None:
            self.injection.arm(step)
        return real_attempt(self, work, step=step, phase=phase, split=split, model=model, optimizer=optimizer)

    OutOfMemoryGuard.attempt = attempt


def _install_float8_on_cpu(allowed: bool, *, current: dict) -> None:
    if not allowed:
        return
    from fsdp_utils.parallel import float8

    real_hardware_problem = float8.hardware_problem
    float8.hardware_problem = lambda recipe, *, device_type, **kw: (
        None if device_type == "cpu" else real_hardware_problem(recipe, device_type=device_type, **kw))


def _install_dcp_stage_fail(rank: int, *, current: dict) -> None:
    import os

    from torch.distributed.checkpoint.staging import DefaultStager

    real_stage = DefaultStager._stage  # what stage() runs, in the calling thread or the stager's own

    @functools.wraps(real_stage)
    def stage(self, state_dict, **kwargs):
        if int(os.environ.get("RANK", "0")) == rank and "model" in state_dict:
            raise RuntimeError(f"injected DCP staging failure on rank {rank} (test hook)")
        return real_stage(self, state_dict, **kwargs)

    DefaultStager._stage = stage


def _install_tokenizer_training_delay(delay_s: float, *, current: dict) -> None:
    from data import prepare

    real_train_tokenizer = prepare.train_tokenizer

    @functools.wraps(real_train_tokenizer)
    def train_tokenizer(*args, **kwargs):
        time.sleep(delay_s)
        return real_train_tokenizer(*args, **kwargs)

    prepare.train_tokenizer = train_tokenizer


_INSTALLERS = {  # in the order they are installed
    "stage_fail": _install_stage_fail,
    "write": _install_write,
    "sync_write_fail": _install_sync_write_fail,
    "disk_free_bytes": _install_disk_free_bytes,
    "nan_at_step": _install_nan_at_step,
    "spike_at_steps": _install_spike_at_steps,
    "fake_gpu_memory": _install_fake_gpu_memory,
    "gpu_memory_gib": _install_gpu_memory_gib,
    "oom": _install_oom,
    "float8_on_cpu": _install_float8_on_cpu,
    "dcp_stage_fail": _install_dcp_stage_fail,
    "tokenizer_training_delay_s": _install_tokenizer_training_delay,
}


def install(spec: dict) -> None:
    """Install the faults of `spec` (the module docstring lists them) in this process."""
    current = {"step": 0}
    for name, installer in _INSTALLERS.items():
        if name in spec:
            installer(spec[name], current=current)
