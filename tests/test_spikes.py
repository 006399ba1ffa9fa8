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
