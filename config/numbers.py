"""Numbers read from text that a user typed: command-line values, environment variables, torchrun's settings.

Python's int() and float() read the digits of every script: int("٣٠٠٠٠") is 30000, and "²" passes str.isdigit()
yet int() refuses it with a ValueError. These read ASCII text only. Their ValueError says what was refused; as an
argparse `type`, they make a bad value argparse's usage error ("invalid integer value: '²'")."""
from __future__ import annotations


def integer(text: str) -> int:
    """The whole number that ASCII `text` spells (an optional sign, decimal digits); ValueError otherwise."""
    if not text.isascii():
        raise ValueError(f"{text!r} is not a whole number in the digits 0-9")
    return int(text, 10)


def number(text: str) -> float:
    """The number that ASCII `text` spells (as float() reads it: 3e-4, -0.5, inf); ValueError otherwise."""
    if not text.isascii():
        raise ValueError(f"{text!r} is not a number in the digits 0-9")
    return float(text)


def integer_in(text: str, low: int | None = None, high: int | None = None) -> int | None:
    """The whole number that `text` spells if it is from `low` to `high` (either bound may be left out), else None."""
    try:
        value = integer(text)
    except ValueError:
        return None
    return value if (low is None or low <= value) and (high is None or value <= high) else None
