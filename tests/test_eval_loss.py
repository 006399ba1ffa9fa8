"""The validation loss (fsdp_utils/evaluation/validation.py `evaluate`): a fixed set of sequences, whose loss is
the same at any micro-batch and world size.

The reference is one unsharded forward pass over all the sequences at once, reduced to the mean over their
trained targets; the evaluation in micro-batches (the last one partial) and over 2 FSDP ranks must give it
within float rounding."""
from __future__ import annotations

import pytest
import torch

from model import ModelConfig
from model.loss import IGNORE_INDEX
from tests.distributed_harness import cpu_env, run_ranks
from tests.helpers import random_model

CFG = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=16, ffn_hidden_dim=64)
NUM_SAMPLES = 10  # not a multiple of the micro-batches below: the last micro-batch is partial


class Sequences:
    """A validation set: sample i is a fixed random window; with `masked`, targets of chat data (a share of
    them IGNORE_INDEX, as outside the assistant's turns)."""

    def __init__(self, masked: bool = False):
        self.masked = masked

    def batch(self, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = [torch.randint(0, CFG.vocab_size, (2, 16), generator=torch.Generator().manual_seed(i))
                for i in range(first, first + count)]
        x, y = torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])
        if self.masked:
            for row, i in enumerate(range(first, first + count)):
                y[row, : 5 + i % 3] = IGNORE_INDEX  # sample i's own mask, whatever batch it is in
        return x, y


def reference_loss(model, data: Sequences) -> float:
    x, y = data.batch(0, NUM_SAMPLES)
    with torch.no_grad():
        return model(x, y).item()  # the mean over every trained target of the NUM_SAMPLES sequences


@pytest.mark.parametrize("masked", [False, True], ids=["text", "chat"])
def test_validation_loss_is_the_same_at_any_micro_batch(world_of_one, masked):
    from fsdp_utils.evaluation.validation import evaluate

    model, data = random_model(CFG), Sequences(masked)
    expected = reference_loss(model, data)
    losses = {mb: evaluate(model, data, num_samples=NUM_SAMPLES, micro_batch=mb, env=world_of_one)
              for mb in (1, 3, 4, 8, 16)}
    for mb, loss in losses.items():
        assert loss == pytest.approx(expected, rel=1e-6), (mb, losses)
    assert model.training  # evaluation leaves the model as it found it


def _evaluate_on_ranks(rank: int, world_size: int, micro_batch: int, masked: bool) -> float:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from fsdp_utils.evaluation.validation import evaluate
    from model import DecoderBlock

    model = FSDP(random_model(CFG), auto_wrap_policy=ModuleWrapPolicy({DecoderBlock}), use_orig_params=True,
                 device_id=torch.device("cpu"))
    return evaluate(model, Sequences(masked), num_samples=NUM_SAMPLES, micro_batch=micro_batch,
                    env=cpu_env(rank, world_size))


@pytest.mark.slow
@pytest.mark.parametrize("masked", [False, True], ids=["text", "chat"])
def test_validation_loss_of_two_fsdp_ranks_is_the_single_process_loss(masked):
    expected = reference_loss(random_model(CFG), Sequences(masked))
    for micro_batch in (4, 8):  # 3 and 2 micro-batches over 2 ranks: one rank has a padding pass
        losses = run_ranks(_evaluate_on_ranks, world_size=2, micro_batch=micro_batch, masked=masked)
        assert losses[0] == losses[1]  # reduced over the ranks: every rank reports the same
        assert losses[0] == pytest.approx(expected, rel=1e-6), (micro_batch, losses)
