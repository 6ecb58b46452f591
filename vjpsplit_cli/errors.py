"""The one exception type vjpsplit raises for bad input."""

from __future__ import annotations


class VjpsplitError(ValueError):
    """Bad input to vjpsplit: a malformed file, a wrong shape or dtype, a mismatched artifact.

    The message is one line that names the file or leaf at fault and says what to
    do. The CLI prints it as ``error: <message>`` and exits 1. It subclasses
    ``ValueError`` so callers that already catch that keep working.
    """


def one_line(e: BaseException, limit: int = 200) -> str:
    """The message of ``e`` on one line (white space folded), cut at ``limit`` characters."""
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def first_line(e: BaseException) -> str:
    """``TypeError: <first line of the message>``: how a foreign exception is quoted in one-line errors."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"
