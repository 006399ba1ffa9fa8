"""benchmarks/tokens_to_loss.py: the tokens a validation curve needs to reach a target, the seeds' average and the
summary across learning rates, on curves whose answers are worked out by hand."""
from __future__ import annotations

import pytest

from benchmarks.tokens_to_loss import Run, mean_curve, parse_args, summarize, tokens_to_reach


def test_tokens_to_reach_is_linear_between_evaluations():
    curve = [(100.0, 5.0), (200.0, 4.0), (300.0, 3.0)]
    assert tokens_to_reach(curve, 4.0) == 200.0  # reached at an evaluation
    assert tokens_to_reach(curve, 3.5) == 250.0  # halfway from 4.0 at 200 to 3.0 at 300
    assert tokens_to_reach(curve, 5.5) == 100.0  # already below at the first evaluation
    assert tokens_to_reach(curve, 2.9) is None  # never


def test_the_seeds_are_averaged_point_by_point():
    assert mean_curve([[(1, 4.0), (2, 3.0)], [(1, 6.0), (2, 2.0)]]) == [(1, 5.0), (2, 2.5)]


def test_the_target_is_the_first_optimizers_best_and_the_ratio_its_tokens():
    def result(*losses):
        return {"curve": [(100.0 * (i + 1), loss) for i, loss in enumerate(losses)]}

    results = {
        Run("adamw", 1e-3, 1): result(5.0, 4.5, 4.0), Run("adamw", 1e-3, 2): result(5.0, 4.5, 4.2),  # final 4.1
        Run("adamw", 2e-3, 1): result(5.0, 4.4, 4.3), Run("adamw", 2e-3, 2): result(5.0, 4.4, 4.3),  # final 4.3
        Run("muon", 1e-3, 1): result(4.6, 4.0, 3.8), Run("muon", 1e-3, 2): result(4.6, 4.2, 3.8),  # 4.6, 4.1, 3.8
    }
    summary = summarize(results, ["adamw", "muon"])
    assert summary["target_val_loss"] == pytest.approx(4.1)
    adamw, muon = summary["optimizers"]["adamw"], summary["optimizers"]["muon"]
    assert adamw["best_lr"] == 1e-3 and adamw["tokens_to_target"] == pytest.approx(300.0) and adamw["ratio"] == 1.0
    # muon's mean curve reaches 4.1 at its second evaluation (200 tokens): 200 / 300 of adamw's tokens.
    assert muon["tokens_to_target"] == pytest.approx(200.0) and muon["ratio"] == pytest.approx(2 / 3)


def test_the_overrides_after_the_separator_go_to_every_run():
    args, overrides = parse_args(["c.yaml", "--lrs", "1e-3,2e-3", "--out", "o", "--", "--train.max_steps=5"])
    assert (args.lr_list, args.seed_list, overrides) == ([1e-3, 2e-3], [1, 2], ["--train.max_steps=5"])


def test_runs_of_several_ranks_go_under_torchrun_each_on_gpus_of_its_own():
    from benchmarks.tokens_to_loss import gpu_slots, launcher

    args, _ = parse_args(["c.yaml", "--out", "o", "--nproc_per_node", "2", "--concurrent", "3"])
    assert (args.nproc_per_node, args.concurrent) == (2, 3)
    assert launcher(1)[1:] == [] and launcher(2)[1:] == ["-m", "torch.distributed.run", "--standalone",
                                                         "--nproc_per_node=2"]
    assert gpu_slots(3, 2, 8) == ["0,1", "2,3", "4,5"]
    assert gpu_slots(4, 1, 4) == ["0", "1", "2", "3"]
    assert gpu_slots(3, 2, 4) == [None, None, None]  # too few GPUs: every run sees them all (or the CPU)
    with pytest.raises(SystemExit):
        parse_args(["c.yaml", "--out", "o", "--nproc_per_node", "0"])
