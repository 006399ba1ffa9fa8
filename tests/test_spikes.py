"""SpikeSkipper (fsdp_utils/train/spikes.py): which steps it skips, what it records, and an exact resume.

Expected decisions are derived with the statistics module's mean and sample standard deviation of the values the
test itself keeps, not with the skipper's own arithmetic."""
from __future__ import annotations

import json
import random
import statistics

import pytest

from fsdp_utils.train.spikes import SpikeSkipper


def noisy(seed: int, n: int) -> list[tuple[float, float]]:
    """(loss, grad norm) pairs of a quiet run: Gaussian noise around 3.0 and 1.0."""
    rng = random.Random(seed)
    return [(rng.gauss(3.0, 0.05), abs(rng.gauss(1.0, 0.1))) for _ in range(n)]


def test_normal_noise_is_never_skipped():
    # Beyond 6 sigma a Gaussian lies with probability 1e-9: 2000 quiet steps never get there.
    skipper = SpikeSkipper()
    assert not any(skipper.check(loss, norm) for loss, norm in noisy(0, 2000))
    assert skipper.num_skipped == 0 and len(skipper.losses) == 128


@pytest.mark.parametrize("which", ["loss", "grad_norm"])
def test_a_spike_at_ten_sigma_is_skipped_and_stays_out_of_the_window(which):
    skipper = SpikeSkipper()
    values = noisy(1, 200)
    for loss, norm in values:
        assert not skipper.check(loss, norm)
    window = values[-128:]
    column = [v[0] if which == "loss" else v[1] for v in window]
    spike = statistics.mean(column) + 10 * statistics.stdev(column)
    loss, norm = (spike, 1.0) if which == "loss" else (3.0, spike)
    before = skipper.state_dict()
    assert skipper.check(loss, norm)
    assert skipper.last_skipped and skipper.num_skipped == 1
    assert skipper.reason is not None and "10.0 standard deviations" in skipper.reason
    assert skipper.state_dict() == {**before, "num_skipped": 1, "consecutive": 1}  # the window is unchanged
    # The next quiet step is applied; the flag is for one metrics row only.
    assert not skipper.check(3.0, 1.0)
    assert not skipper.last_skipped and skipper.num_skipped == 1 and skipper.consecutive == 0
    assert list(skipper.losses)[-1] == 3.0


def test_the_threshold_is_sigmas_above_the_mean():
    window = [float(v) for v in range(1, 21)]  # 20 values: the minimum
    mean, std = statistics.mean(window), statistics.stdev(window)  # 10.5, 5.916...
    for value, skipped in ((mean + 6 * std * 0.999, False), (mean + 6 * std * 1.001, True)):
        skipper = SpikeSkipper(window=20, min_values=20)
        for v in window:
            skipper.check(v, 1.0 + v / 100)
        assert skipper.check(value, 1.1) == skipped, value


def test_nothing_is_skipped_before_the_window_holds_min_values():
    skipper = SpikeSkipper(min_values=20)
    for loss, norm in noisy(2, 19):
        skipper.check(loss, norm)
    assert not skipper.check(1e6, 1e6)  # 19 values: too few to judge; this one enters the window
    skipper = SpikeSkipper(min_values=20)
    for loss, norm in noisy(2, 20):
        skipper.check(loss, norm)
    assert skipper.check(1e6, 1.0)


def test_a_lasting_shift_is_skipped_max_consecutive_times_then_followed():
    skipper = SpikeSkipper(max_consecutive=10)
    for loss, norm in noisy(3, 100):
        skipper.check(loss, norm)
    shifted = [(loss + 2.0, norm) for loss, norm in noisy(4, 40)]  # 40 sigma up, for good
    decisions = [skipper.check(loss, norm) for loss, norm in shifted]
    assert decisions == [True] * 10 + [False] * 30
    assert skipper.num_skipped == 10 and list(skipper.losses) == [loss for loss, _ in shifted[10:]]


def test_non_finite_values_are_left_to_the_finiteness_check():
    skipper = SpikeSkipper()
    for loss, norm in noisy(5, 50):
        skipper.check(loss, norm)
    before = skipper.state_dict()
    assert not skipper.check(float("nan"), 1.0) and not skipper.check(3.0, float("inf"))
    assert skipper.state_dict() == before


def test_a_resumed_window_decides_as_the_uninterrupted_run():
    # A run with spikes every 37 steps; one copy saves its state at step 150 through JSON (plain lists and numbers,
    # as any checkpoint format can hold them) and a fresh skipper continues from it.
    values = [(loss * (3 if i % 37 == 36 else 1), norm) for i, (loss, norm) in enumerate(noisy(6, 400))]
    uninterrupted = SpikeSkipper()
    decisions = [uninterrupted.check(loss, norm) for loss, norm in values]
    assert sum(decisions) == len(range(36, 400, 37))  # every spike after the window filled, nothing else
    first = SpikeSkipper()
    for loss, norm in values[:150]:
        first.check(loss, norm)
    resumed = SpikeSkipper()
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert [resumed.check(loss, norm) for loss, norm in values[150:]] == decisions[150:]
    assert resumed.state_dict() == uninterrupted.state_dict()


def test_a_bad_state_is_refused():
    skipper = SpikeSkipper()
    with pytest.raises(ValueError, match="not a spike-skipping state"):
        skipper.load_state_dict({"losses": [1.0], "grad_norms": []})
    with pytest.raises(ValueError, match="not a spike-skipping state"):
        skipper.load_state_dict({"losses": None, "grad_norms": [1.0], "num_skipped": 0, "consecutive": 0})


# ---- train.skip_spikes in real runs ---------------------------------------------------------------------------
# The tiny model's first 24 steps fill the window (min_values 20); the test-only fault scales the loss of chosen
# steps, and with it their gradients, tenfold (tests/fault_injection.py "spike_at_steps").

SPIKE_STEPS = 30
SPIKE_ARGS = (f"--train.max_steps={SPIKE_STEPS}", "--train.warmup_steps=5", "--checkpoint.interval=1",
              "--checkpoint.keep_last_n=0")


@pytest.mark.slow  # launches training jobs
@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_a_spiking_step_is_skipped_counted_and_resumed_with_its_window(optimizer, tmp_path, corpus, dataset_dir):
    import math

    import torch

    from tests.helpers import losses, read_metrics, run_train

    args = (*SPIKE_ARGS, "--fsdp.version=2", f"--train.optimizer={optimizer}")
    out = tmp_path / "uninterrupted"
    proc = run_train(*args, nproc=2, out_dir=out, corpus=corpus, dataset_dir=dataset_dir,
                     faults={"spike_at_steps": {"steps": [25, 28], "scale": 10}})
    warnings = [line for line in proc.stderr.splitlines() if "update skipped (train.skip_spikes)" in line]
    assert len(warnings) == 2 and "rank0] step 25: update skipped (train.skip_spikes): " in warnings[0], warnings
    assert "standard deviations above the mean" in warnings[0]
    assert warnings[1].endswith("; 2 steps skipped so far"), warnings

    rows = {row["step"]: row for row in read_metrics(out) if "loss" in row}
    assert [s for s, row in rows.items() if row.get("skipped")] == [25, 28]
    assert all(row["skipped"] is True for s, row in rows.items() if s in (25, 28))
    assert [rows[s]["skipped_steps"] for s in (1, 24, 25, 27, 28, 30)] == [0, 0, 1, 1, 2, 2]
    assert rows[25]["loss"] > 5 * rows[24]["loss"] and math.isfinite(rows[26]["loss"])

    # The skipped step changed nothing: weights and optimizer state after step 25 are those after step 24.
    before, after = (torch.load(out / f"fsdp_cpt{s}.pth", weights_only=True) for s in (24, 25))
    assert before["model"].keys() == after["model"].keys()
    assert all(torch.equal(tensor, after["model"][name]) for name, tensor in before["model"].items())
    state, state_after = before["optimizer"]["state"], after["optimizer"]["state"]
    assert state.keys() == state_after.keys() and all(
        torch.equal(value, state_after[name][key]) for name, kept in state.items() for key, value in kept.items())
    window = after["train_state"]["spike_skipper"]
    assert window["num_skipped"] == 1 and len(window["losses"]) == 24
    assert window == {**before["train_state"]["spike_skipper"], "num_skipped": 1, "consecutive": 1}
    # The next step trains on: its update is applied.
    nxt = torch.load(out / "fsdp_cpt26.pth", weights_only=True)
    assert not torch.equal(nxt["model"]["tok_embeddings.weight"], after["model"]["tok_embeddings.weight"])

    # Resumed after the first skip, the run skips the second spike (3 steps later: its 2nd step) as the
    # uninterrupted one did, which it could not with a fresh window of fewer than 20 values.
    resumed = tmp_path / "resumed"
    run_train(*args, f"--resume_from={out / 'fsdp_cpt26.pth'}", nproc=2, out_dir=resumed, corpus=corpus,
              dataset_dir=dataset_dir, faults={"spike_at_steps": {"steps": [2], "scale": 10}})
    got = {row["step"]: row for row in read_metrics(resumed) if "loss" in row}
    assert losses(resumed) == {s: rows[s]["loss"] for s in range(27, SPIKE_STEPS + 1)}
    assert [s for s, row in got.items() if row.get("skipped")] == [28]
    assert got[SPIKE_STEPS]["skipped_steps"] == 2


@pytest.mark.slow  # launches a training job
def test_a_quiet_run_skips_nothing(tmp_path, corpus, dataset_dir):
    from tests.helpers import read_metrics, run_train

    out = tmp_path / "quiet"
    proc = run_train("--train.max_steps=60", "--train.warmup_steps=5", nproc=2, out_dir=out, corpus=corpus,
                     dataset_dir=dataset_dir)
    rows = [row for row in read_metrics(out) if "loss" in row]
    assert len(rows) == 60 and all(row["skipped_steps"] == 0 and "skipped" not in row for row in rows)
    assert "train.skip_spikes" not in proc.stderr
