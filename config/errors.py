"""The one error a config raises, and what its problems share: the "did you mean" hint, the range checks."""
from __future__ import annotations

import difflib
from collections.abc import Iterable


class ConfigError(ValueError):
    """Raised with every problem found, one per line."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(problems))


def closest(name: str, options: Iterable[str], prefix: str = "") -> str:
    """" (did you mean 'prefix<option>'?)" for the option nearest to `name`, or "" when none is near."""
    match = difflib.get_close_matches(name, list(options), n=1, cutoff=0.5)
    return f" (did you mean '{prefix}{match[0]}'?)" if match else ""


# A range a number must be in: its words in a problem, and the test.
RANGES = {"> 0": ("must be positive", lambda v: v > 0), ">= 0": ("must not be negative", lambda v: v >= 0),
          "[0, 1)": ("must be in [0, 1)", lambda v: 0 <= v < 1)}


def range_problems(section: object, where: str, **ranges: str) -> list[str]:
    """Each named field of `section` outside its range (a key of RANGES), in the order given, named `where.field`."""
    return [f"{where}.{name} {RANGES[r][0]}, got {getattr(section, name)}" for name, r in ranges.items()
            if not RANGES[r][1](getattr(section, name))]
