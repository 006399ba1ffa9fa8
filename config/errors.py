"""The one error a config raises, and the "did you mean" hint its problems share."""
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
