"""Skipping the update of a step whose loss or gradient norm spikes: more than `sigmas` standard deviations above
the mean of the same value over a window of recent steps.

The train step asks before optimizer.step(), with the step's loss and global gradient norm, both already reduced
over the ranks, so every rank decides the same: `if skipper.check(loss, grad_norm)`, it zeroes the gradients instead
of stepping (the learning-rate schedule and the data position advance as for any step). The window is state: a
checkpoint saves `state_dict()` (plain lists and numbers) and a resumed run decides exactly as the uninterrupted one.
"""
from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from typing import Any


def _mean_std(values: deque[float]) -> tuple[float, float]:
    """Mean and sample standard deviation, with exactly rounded sums: the same on every rank and after a resume."""
    mean = math.fsum(values) / len(values)
    return mean, math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (len(values) - 1))


class SpikeSkipper:
    """Decides, step by step, whether an update is skipped.

    window: how many recent steps' values the mean and standard deviation are taken over; sigmas: how far above
    the mean a value must be to count as a spike; min_values: no step is skipped before the window holds that many
    values (a mean over a handful of early, fast-falling losses says little); max_consecutive: after that many
    skipped steps in a row the values are taken to have moved for good (a new data mixture, a changed learning
    rate), not to spike: the window starts afresh from the next step, which is applied, and 0 never does that."""

    MIN_VALUES = 20

    def __init__(self, *, window: int = 128, sigmas: float = 6.0, min_values: int = MIN_VALUES,
                 max_consecutive: int = 10):
        if window < 2 or not 2 <= min_values <= window:
            raise ValueError(f"a spike window of {window} values and a minimum of {min_values}: need "
                             "2 <= min_values <= window")
        self.window, self.sigmas, self.min_values, self.max_consecutive = window, sigmas, min_values, max_consecutive
        self.losses: deque[float] = deque(maxlen=window)
        self.grad_norms: deque[float] = deque(maxlen=window)
        self.num_skipped = 0  # steps skipped in the run so far (resumes included)
        self.consecutive = 0  # steps skipped since the last applied one
        self.last_skipped = False  # the last checked step's decision, for its metrics row
        self.reason: str | None = None  # why it was skipped, for the log

    def check(self, loss: float, grad_norm: float) -> bool:
        """Whether this step's update is to be skipped; records the decision, and the values of an applied step.

        A non-finite value is neither skipped here nor recorded: the train step's finiteness check handles it,
        and one NaN in the window would make every later mean NaN."""
        self.last_skipped, self.reason = False, None
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            return False
        reason = self._spike(loss, grad_norm)
        if reason is not None and self.max_consecutive and self.consecutive >= self.max_consecutive:
            self.losses.clear()
            self.grad_norms.clear()
            reason = None
        if reason is not None:
            # A skipped step's values stay out of the window: in it, a spike would raise the mean and widen the
            # standard deviation for the next `window` steps, so that the next spikes (bad batches often come in
            # runs) would pass, and the values describe a model that the skipped update never produced.
            self.num_skipped += 1
            self.consecutive += 1
            self.last_skipped, self.reason = True, reason
            return True
        self.consecutive = 0
        self.losses.append(float(loss))
        self.grad_norms.append(float(grad_norm))
        return False

    def _spike(self, loss: float, grad_norm: float) -> str | None:
        if len(self.losses) < self.min_values:
            return None
        for name, value, values in (("loss", loss, self.losses), ("gradient norm", grad_norm, self.grad_norms)):
            mean, std = _mean_std(values)
            # A window of identical values has no spread to measure a spike by.
            if std > 0 and value > mean + self.sigmas * std:
                return (f"{name} {value:.6g} is {(value - mean) / std:.1f} standard deviations above the mean "
                        f"{mean:.6g} of the last {len(values)} steps")
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"losses": list(self.losses), "grad_norms": list(self.grad_norms), "num_skipped": self.num_skipped,
                "consecutive": self.consecutive}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """A saved state; a window longer than this one's keeps its newest values. ValueError for a state that is
        not one (the caller names the checkpoint)."""
        try:
            losses, grad_norms = [float(v) for v in state["losses"]], [float(v) for v in state["grad_norms"]]
            num_skipped, consecutive = int(state["num_skipped"]), int(state["consecutive"])
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"not a spike-skipping state ({type(err).__name__}: {err})") from None
        if len(losses) != len(grad_norms):
            raise ValueError(f"not a spike-skipping state ({len(losses)} losses, {len(grad_norms)} gradient norms)")
        self.losses = deque(losses, maxlen=self.window)
        self.grad_norms = deque(grad_norms, maxlen=self.window)
        self.num_skipped, self.consecutive = num_skipped, consecutive
        self.last_skipped, self.reason = False, None
