"""The one error type of data/: its message names the culprit (file, line or row, setting) in one line."""


class DataError(ValueError):
    """A problem with the user's data or data settings; the message names the culprit."""
