"""The one error type of data/: its message names the culprit (file, line or row, setting) in one line."""


class DataError(ValueError):
    """A problem with the user's data or data settings; the message names the culprit."""


def first_line(err: BaseException) -> str:
    """The first non-blank line of an exception's message (at most 200 characters): what a library said, in one
    line of ours."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[0][:200] if lines else ""
