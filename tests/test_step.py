"""The one training step (fsdp_utils/train/step.py) and the Trainer, in-process (a world of one on gloo).

The training loop, scripts/benchmark.py and the micro-batch search's trial steps must run the same step:
they used to have three copies, which drifted (the trials skipped the FP8 scales). Here each is run and
seen to call `train_step`, the benchmark's step is checked to change the weights exactly as `train_step`
does, and the Trainer trains in-process.
"""
from __future__ import annotations

import argparse

import pytest
import torch
import torch.distributed as dist

from config import load_config
from fsdp_utils.train import microbatch, step, trainer
from fsdp_utils.train.batch import BatchSplit
from fsdp_utils.train.preemption import StopSignal
from tests.helpers import ROOT, TINY, read_metrics

TINY_CONFIG = ROOT / "config/train_tiny_fsdp.yaml"


def tiny_cfg(tmp_path, corpus, dataset_dir, *extra: str):
    overrides = [*TINY, f"--run.output_dir={tmp_path / 'out'}", f"--data.files=[{corpus}]",
                 f"--data.dataset_dir={dataset_dir}", "--fsdp.version=2", *extra]
    return load_config(TINY_CONFIG, overrides)


class Spy:
    """Wraps train_step and records each call's keyword arguments."""

    def __init__(self):
        self.calls = []

    def __call__(self, model, optimizer, batches, **kwargs):
        self.calls.append({"model": model, "optimizer": optimizer, **kwargs})
        return step.train_step(model, optimizer, batches, **kwargs)


def test_loop_benchmark_and_trials_import_the_one_step():
    from scripts import benchmark

    assert trainer.train_step is step.train_step
    assert microbatch.train_step is step.train_step
    assert benchmark.train_step is step.train_step


@pytest.mark.slow
def test_trainer_fits_in_process_through_train_step(tmp_path, corpus, dataset_dir, world_of_one, monkeypatch):
    spy = Spy()
    monkeypatch.setattr(trainer, "train_step", spy)
    cfg = tiny_cfg(tmp_path, corpus, dataset_dir, "--train.max_steps=4")
    run = trainer.Trainer(cfg, world_of_one, stop=StopSignal([], grace_s=60))
    last = run.fit()
    # global batch 8 = micro-batch 2 x accumulation 4 on one rank
    assert len(spy.calls) == 4 and {c["grad_accum"] for c in spy.calls} == {4}
    assert all(c["model"] is run.model and c["optimizer"] is run.optimizer for c in spy.calls)
    losses = [row["loss"] for row in read_metrics(cfg.output_dir) if "loss" in row]
    assert len(losses) == 4 and losses[-1] < losses[0] and last["step"] == 4
    assert run.state.step == 4 and run.state.samples_seen == 4 * 8
    assert (cfg.output_dir / "fsdp_cpt4.pth").is_file()  # the final save


@pytest.mark.slow
def test_micro_batch_trials_run_train_step(tmp_path, corpus, dataset_dir, world_of_one, monkeypatch):
    from tests.fault_injection import FakeProbe

    spy = Spy()
    monkeypatch.setattr(microbatch, "train_step", spy)
    cfg = tiny_cfg(tmp_path, corpus, dataset_dir, "--train.max_steps=1")
    run = trainer.Trainer.__new__(trainer.Trainer)  # only the model and optimizer of a Trainer
    run.cfg, run.env, run.stop = cfg, world_of_one, StopSignal([], grace_s=60)
    run._setup_data()
    run._setup_model()
    probe = FakeProbe({"capacity_gib": 10, "fixed_gib": 1, "per_sample_gib": 1}, 0)
    choice = microbatch.search_micro_batch(run.model, run.optimizer, per_rank=8, seq_len=cfg.data.seq_len,
                                           vocab_size=run.vocab_size, grad_clip=1.0, margin=0.1, compile=False,
                                           env=world_of_one, probe=probe)
    assert choice.micro_batch_size == 8 and spy.calls  # 1 + 8 GiB fits the 9 GiB budget
    assert all(c["model"] is run.model and c["optimizer"] is run.optimizer for c in spy.calls)


def test_benchmark_step_is_train_step(tmp_path, corpus, dataset_dir, world_of_one, monkeypatch):
    """The benchmark's step changes the weights exactly as train_step on the same batches does."""
    from scripts import benchmark

    cfg = tiny_cfg(tmp_path, corpus, dataset_dir, "--train.micro_batch_size=2", "--model.vocab_size=320")
    args = argparse.Namespace(fused_projections=False, unfused_adamw=True, doc_len=0)
    spy = Spy()
    monkeypatch.setattr(benchmark, "train_step", spy)
    step_fn, model, optimizer, micro_batch, grad_accum = benchmark.build_ours(cfg, world_of_one, args, micro_batch=2,
                                                                              grad_accum=None)
    assert (micro_batch, grad_accum) == (2, BatchSplit(8, 1, 2).grad_accum)

    def weights():
        return [p.to_local().detach().clone() for p in model.parameters()]

    before = weights()
    step_fn()
    after_benchmark = weights()
    with torch.no_grad():  # back to the same start: weights, empty optimizer state
        for p, value in zip(model.parameters(), before, strict=True):
            p.to_local().copy_(value)
    optimizer.state.clear()
    # The benchmark draws its random tokens from a generator seeded by the rank: the same stream here.
    batches = benchmark.random_batches(cfg.model.vocab_size, micro_batch=2, seq_len=cfg.data.seq_len,
                                       device=world_of_one.device, seed=world_of_one.rank)
    step.train_step(model, optimizer, batches, grad_accum=grad_accum, grad_clip=cfg.train.grad_clip, world_size=1)
    assert len(spy.calls) == 1 and spy.calls[0]["grad_accum"] == grad_accum
    for got, want, old in zip(after_benchmark, weights(), before, strict=True):
        assert torch.equal(got, want) and not torch.equal(got, old)
    assert dist.is_initialized()
