"""Learning-rate schedules (train.lr_schedule: cosine, wsd, constant): the curves against formulas written
here independently, the config checks, and a WSD run resumed in-process (losses and learning rates of the
resumed steps equal the uninterrupted run's; a larger max_steps keeps the stable phase going)."""
from __future__ import annotations

import logging
import math
import shutil

import numpy as np
import pytest

from config import ConfigError, config_warnings, load_config
from fsdp_utils.train.optim import LRSchedule
from tests import helpers
from tests.helpers import ROOT, read_metrics
from tests.test_step import tiny_cfg

TINY_CONFIG = ROOT / "config/train_tiny_fsdp.yaml"


def schedule(*overrides: str) -> LRSchedule:
    return LRSchedule.from_config(load_config(TINY_CONFIG, list(overrides)).train)


# ---- the curves ------------------------------------------------------------------------------------


def test_cosine_default_is_unchanged():
    """The default (no schedule field given) is the warmup-cosine of before, value for value: its formula
    as it stood, a floor of lr * 0.1."""
    s = schedule("--train.lr=3e-3", "--train.warmup_steps=5", "--train.max_steps=40")
    assert s.kind == "cosine" and s.min_lr_ratio == 0.1

    def before(step):
        if step < 5:
            return 3e-3 * (step + 1) / 5
        progress = (step - 5) / max(1, 40 - 5)
        return 3e-3 * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))))

    assert [s(i) for i in range(45)] == [before(i) for i in range(45)]


def test_cosine_with_an_absolute_floor():
    # min_lr=3e-4 of lr=3e-3: the half cosine runs from 3e-3 (first step after warmup) down to 3e-4 (max_steps).
    s = schedule("--train.lr=3e-3", "--train.min_lr=3e-4", "--train.warmup_steps=0", "--train.max_steps=20")
    for step in range(20):
        expected = 3e-4 + (3e-3 - 3e-4) * (1 + math.cos(math.pi * step / 20)) / 2
        assert s(step) == pytest.approx(expected, rel=1e-12)
    assert s(20) == pytest.approx(3e-4, rel=1e-12)


@pytest.mark.parametrize("shape", ["linear", "1-sqrt"])
def test_wsd(shape):
    """Warmup 4 steps to 1e-2, stable, then the last 30% of 50 steps (15) decay to 1e-3."""
    s = schedule("--train.lr=1e-2", "--train.lr_schedule=wsd", "--train.decay_fraction=0.3",
                 f"--train.decay_shape={shape}", "--train.min_lr=1e-3", "--train.warmup_steps=4",
                 "--train.max_steps=50")
    steps = np.arange(50)
    # Knots of the curve: warmup reaches the peak at its 4th step (index 3); the 35 steps 0..34 outside the decay;
    # the decay's 15 steps 35..49 reach the floor at the last one, on the shape's curve of progress 1/15 .. 15/15.
    warmup = np.interp(steps, [-1, 3], [0.0, 1e-2])
    progress = np.clip((steps - 34) / 15, 0, 1)
    falls = progress if shape == "linear" else np.sqrt(progress)
    expected = np.where(steps < 4, warmup, 1e-3 + (1e-2 - 1e-3) * (1 - falls))
    np.testing.assert_allclose([s(int(i)) for i in steps], expected, rtol=1e-12, atol=0)
    assert s(34) == 1e-2 and s(49) == pytest.approx(1e-3, rel=1e-12)


def test_constant():
    s = schedule("--train.lr=2e-3", "--train.lr_schedule=constant", "--train.warmup_steps=4", "--train.max_steps=10")
    assert [s(i) for i in range(12)] == [2e-3 * k / 4 for k in (1, 2, 3)] + [2e-3] * 9


def test_extending_wsd_keeps_the_stable_phase():
    """Doubling max_steps moves the decay to the end of the longer run: up to the old run's decay the two
    curves are the same, and the longer one stays at the peak until its own decay (step 160 of 200)."""
    args = ("--train.lr=1e-3", "--train.lr_schedule=wsd", "--train.decay_fraction=0.2", "--train.warmup_steps=10")
    short, long = schedule(*args, "--train.max_steps=100"), schedule(*args, "--train.max_steps=200")
    assert (short.decay_start, long.decay_start) == (80, 160)
    assert [short(i) for i in range(80)] == [long(i) for i in range(80)]
    assert all(long(i) == 1e-3 for i in range(10, 160)) and long(199) == pytest.approx(1e-4)


def test_min_lr_and_its_ratio():
    assert schedule("--train.lr=1e-3").min_lr_ratio == 0.1
    assert schedule("--train.lr=1e-3", "--train.min_lr_ratio=0.25").min_lr_ratio == 0.25
    assert schedule("--train.lr=1e-3", "--train.min_lr=0").min_lr_ratio == 0


@pytest.mark.parametrize("overrides,problem", [
    (["--train.min_lr=1e-5", "--train.min_lr_ratio=0.1"], "train.min_lr=1e-05 and train.min_lr_ratio=0.1 are both set"),
    (["--train.lr=1e-3", "--train.min_lr=2e-3"], "train.min_lr must be in [0, train.lr=0.001], got 0.002"),
    (["--train.min_lr_ratio=1.5"], "train.min_lr_ratio must be in [0, 1], got 1.5"),
    (["--train.lr_schedule=wds"], "train.lr_schedule='wds' is not one of cosine, wsd, constant (did you mean 'wsd'?)"),
    (["--train.decay_shape=sqrt"], "train.decay_shape='sqrt' is not one of linear, 1-sqrt"),
    (["--train.decay_fraction=0"], "train.decay_fraction must be in (0, 1], got 0"),
    (["--train.lr_schedule=wsd", "--train.max_steps=60", "--train.warmup_steps=50", "--train.decay_fraction=0.2"],
     "train.lr_schedule=wsd: train.warmup_steps=50 plus the decay's 12 steps"),
    (["--train.lr_schedule=wsd", "--train.max_steps=5", "--train.warmup_steps=5"],
     "train.lr_schedule=wsd: train.warmup_steps=5 plus the decay's 1 steps"),
])
def test_config_errors(overrides, problem):
    with pytest.raises(ConfigError) as err:
        load_config(TINY_CONFIG, overrides)
    assert len(err.value.problems) == 1 and problem in err.value.problems[0]


@pytest.mark.parametrize("kind", ["cosine", "wsd", "constant"])
def test_a_warmup_longer_than_the_run_is_a_warning_not_an_error(kind):
    """A smoke run of a preset lowers train.max_steps alone (the tiny preset warms up over 50 steps): it starts, and
    a warning says that it ends inside its warmup, where the schedule is the plain ramp."""
    cfg = load_config(TINY_CONFIG, [f"--train.lr_schedule={kind}", "--train.max_steps=10", "--train.lr=1e-3"])
    assert config_warnings(cfg) == ["train.warmup_steps=50 exceeds train.max_steps=10: the run ends inside its "
                                    "warmup, at 20% of train.lr; for a real run, set train.warmup_steps below "
                                    "train.max_steps"]
    s = LRSchedule.from_config(cfg.train)
    assert [s(i) for i in range(10)] == pytest.approx([1e-3 * k / 50 for k in range(1, 11)])
    assert config_warnings(load_config(TINY_CONFIG, [f"--train.lr_schedule={kind}", "--train.max_steps=100"])) == []


def test_a_warmup_as_long_as_the_run_is_accepted():
    """warmup_steps == max_steps reaches train.lr at the last step, for cosine and constant."""
    for kind in ("cosine", "constant"):
        s = schedule("--train.lr=1e-3", f"--train.lr_schedule={kind}", "--train.max_steps=4", "--train.warmup_steps=4")
        assert [s(i) for i in range(4)] == [1e-3 * k / 4 for k in (1, 2, 3, 4)]


# ---- resuming a WSD run (in-process set_up and loop, one rank) ------------------------------------------------

WSD = ("--train.lr_schedule=wsd", "--train.decay_fraction=0.5", "--train.decay_shape=1-sqrt",
       "--train.min_lr=1e-3", "--train.warmup_steps=2", "--checkpoint.keep_last_n=0")


def fit(cfg, resume_from=None, env=None):
    helpers.fit(cfg, env, resume_from=resume_from)
    return {row["step"]: (row["loss"], row["lr"]) for row in read_metrics(cfg.output_dir) if "loss" in row}


@pytest.mark.slow
def test_wsd_resume_is_exact_and_extends(tmp_path, corpus, dataset_dir, world_of_one, caplog):
    caplog.set_level(logging.INFO, logger="train")
    # Uninterrupted: 6 steps, decay over steps 4-6 (0.5 of 6), a checkpoint after every step.
    full_cfg = tiny_cfg(tmp_path / "a", corpus, dataset_dir, *WSD, "--train.max_steps=6", "--checkpoint.interval=1")
    uninterrupted = fit(full_cfg, env=world_of_one)
    lrs = [uninterrupted[k][1] for k in range(1, 7)]
    # Warmup 1e-2/2, 1e-2, stable 1e-2, then 1-sqrt of progress 1/3, 2/3, 1 from 1e-2 to 1e-3.
    expected = [5e-3, 1e-2, 1e-2] + [1e-3 + 9e-3 * (1 - math.sqrt(k / 3)) for k in (1, 2, 3)]
    assert lrs == pytest.approx(expected, rel=1e-12)

    # Half the run, then a resume from its step-3 checkpoint in another process's place (a fresh set_up):
    # the steps 4-6 have the uninterrupted run's losses and learning rates, bit for bit.
    resumed_cfg = tiny_cfg(tmp_path / "b", corpus, dataset_dir, *WSD, "--train.max_steps=6")
    resumed = fit(resumed_cfg, resume_from=str(full_cfg.output_dir / "fsdp_cpt3.pth"), env=world_of_one)
    assert sorted(resumed) == [4, 5, 6]
    assert all(resumed[k] == uninterrupted[k] for k in (4, 5, 6)), (resumed, uninterrupted)

    # Extended before its decay began (step 3): max_steps 10 keeps the peak through step 5, decays over 6-10.
    caplog.clear()
    extended_cfg = tiny_cfg(tmp_path / "c", corpus, dataset_dir, *WSD, "--train.max_steps=10")
    extended = fit(extended_cfg, resume_from=str(full_cfg.output_dir / "fsdp_cpt3.pth"), env=world_of_one)
    assert [extended[k][1] for k in (4, 5)] == [1e-2, 1e-2]
    assert [extended[k][1] for k in range(6, 11)] == pytest.approx(
        [1e-3 + 9e-3 * (1 - math.sqrt(k / 5)) for k in range(1, 6)], rel=1e-12)
    assert extended[4][0] == uninterrupted[4][0]  # the same step at the same lr on the same weights and data
    assert "does not continue" not in caplog.text

    # Extended after its decay began (step 5): the lr would go back up to the peak, and the log says so.
    caplog.clear()
    late = tiny_cfg(tmp_path / "d", corpus, dataset_dir, *WSD, "--train.max_steps=10")
    helpers.set_up(late, world_of_one, resume_from=str(full_cfg.output_dir / "fsdp_cpt5.pth")).ckpt.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "taken during its WSD decay" in warnings[0], warnings
    assert f"step 5 ran at lr {lrs[4]:.6g}" in warnings[0]
    shutil.rmtree(tmp_path / "d", ignore_errors=True)
