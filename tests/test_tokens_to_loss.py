"""benchmarks/tokens_to_loss.py: the tokens a validation curve needs to reach a target, the seeds' average and the
summary across learning rates, on curves whose answers are worked out by hand."""
from __future__ import annotations

import json

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


def test_a_run_gets_a_new_folder_and_its_checkpoints_go_unless_kept(tmp_path, monkeypatch):
    import subprocess

    from benchmarks import tokens_to_loss

    def fake_train(cmd, **kwargs):  # what train_fsdp.py leaves: metrics, a config, a full and a sharded checkpoint
        run = next(a.split("=", 1)[1] for a in cmd if a.startswith("--run.output_dir="))
        (tokens_to_loss.Path(run) / "fsdp_sharded_cpt5").mkdir(parents=True)
        for name in ("metrics.jsonl", "config.yaml", "fsdp_cpt5.pth", ".fsdp_cpt5.pth.json"):
            (tokens_to_loss.Path(run) / name).write_text("x")
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(tokens_to_loss.subprocess, "run", fake_train)
    _, status, _ = tokens_to_loss.train(Run("muon", 1e-3, 1), "c.yaml", [], tmp_path, keep_checkpoints=False)
    kept = Run("muon", 1e-3, 2)
    tokens_to_loss.train(kept, "c.yaml", [], tmp_path, keep_checkpoints=True)
    left = sorted(p.name for p in (tmp_path / Run("muon", 1e-3, 1).name / "run").iterdir())
    assert status == 0 and left == ["config.yaml", "metrics.jsonl"]
    assert len(list((tmp_path / kept.name / "run").iterdir())) == 5
    with pytest.raises(FileExistsError):  # a folder of an earlier sweep is never trained into
        tokens_to_loss.train(kept, "c.yaml", [], tmp_path, keep_checkpoints=True)


def test_summarize_only_reads_finished_runs_and_names_the_ones_cut_short(tmp_path, capsys):
    from benchmarks.tokens_to_loss import main

    def write_run(name, losses, *, max_steps=20):
        run = tmp_path / name / "run"
        run.mkdir(parents=True)
        (run / "config.yaml").write_text(f"train: {{max_steps: {max_steps}, global_batch_size: 2}}\n"
                                         "data: {seq_len: 5}\n")
        rows = [{"step": 10 * (i + 1), "val_loss": loss, "tokens_per_sec_per_gpu": 100.0, "peak_mem_gib": 1.0}
                for i, loss in enumerate(losses)]
        (run / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))

    write_run("adamw-lr0.001-s1", [5.0, 4.0])
    write_run("muon-lr0.001-s1", [4.0])  # cut short at step 10 of 20
    argv = ["c.yaml", "--lrs", "1e-3", "--seeds", "1", "--out", str(tmp_path), "--summarize_only"]
    assert main(argv) == 1
    assert "muon-lr0.001-s1" in capsys.readouterr().err
    (tmp_path / "muon-lr0.001-s1" / "run" / "metrics.jsonl").unlink()
    (tmp_path / "muon-lr0.001-s1" / "run" / "config.yaml").unlink()
    (tmp_path / "muon-lr0.001-s1" / "run").rmdir()
    write_run("muon-lr0.001-s1", [4.0, 3.5])
    assert main(argv) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    # 10 tokens a step: adamw's final 4.0 at step 20 (200 tokens), muon's 4.0 at step 10 (100 tokens)
    assert summary["target_val_loss"] == 4.0 and summary["optimizers"]["muon"]["ratio"] == 0.5
