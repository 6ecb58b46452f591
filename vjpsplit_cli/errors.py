"""The one exception type vjpsplit raises for bad input."""

from __future__ import annotations

import re

from .terminal import printable


class VjpsplitError(ValueError):
    """Bad input to vjpsplit: a malformed file, a wrong shape or dtype, a mismatched artifact.

    The message is one line that names the file or leaf at fault and says what to
    do. The CLI prints it as ``error: <message>`` and exits 1. It subclasses
    ``ValueError`` so callers that already catch that keep working.

    Names in a message may come from a file (a forged manifest's argument names):
    control characters are escaped (``terminal.printable``), so no file can break
    the line or write a line of its own.

    Args:
        *args: The message (and any further exception arguments); strings have their
            control characters escaped.
    """

    def __init__(self, *args: object) -> None:
        super().__init__(*(printable(a) if isinstance(a, str) else a for a in args))


def one_line(e: BaseException, limit: int = 200) -> str:
    """The message of ``e`` on one line (white space folded), cut at ``limit`` characters."""
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def first_line(e: BaseException) -> str:
    """``TypeError: <first line of the message>``: how a foreign exception is quoted in one-line errors."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def raised_line(e: BaseException) -> str:
    """What ``e`` says, on one line, with its type: ``first_line``, except for a runtime error that carries a
    Python traceback (a host callback that raised inside a compiled call: ``INTERNAL: CpuCallback error
    calling callback: Traceback ...``), which is given as its status and the callback's own last line."""
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    if len(lines) > 1 and lines[0].endswith("Traceback (most recent call last):"):
        status = xla_status(e)
        return f"{type(e).__name__}: {status + ': ' if status else ''}{lines[-1]}"
    return first_line(e)


# A shape tuple in JAX's messages: ``(783,)``, ``(c, 1)``, ``()`` (dims are ints or symbolic names).
_TUPLE_RE = re.compile(r"\((\w+(?:, *\w+)+),?\)|\((\w+),\)|\(\)")


def jax_message(e: BaseException) -> str:
    """The first line of an error JAX raised while tracing, without its exception type, and with
    shapes written as vjpsplit writes them (``[783]``, not the Python tuple ``(783,)``)."""
    lines = str(e).strip().splitlines()
    text = lines[0].rstrip(".") if lines else type(e).__name__
    return _TUPLE_RE.sub(lambda m: "[" + (m.group(1) or m.group(2) or "").replace(" ", "") + "]", text)


class UsageError(VjpsplitError):
    """A mistake in the command line or the call itself (the CLI exits 2 for these)."""


class CorruptModule(VjpsplitError):
    """A module's StableHLO did not parse: damaged or forged, or written by a jax this one cannot read.

    ``module`` names it (``fwd``, ``bwd``, ...); ``unreadable`` is true when the parser said it
    could not deserialize the bytes at all, which is also what a module from a newer jax gets.
    Callers tell the cases apart by these attributes, never by the message.
    """

    def __init__(self, message: str, module: str, *, unreadable: bool = False):
        super().__init__(message)
        self.module = module
        self.unreadable = unreadable


# What jaxlib and XLA report only in their messages: recognised here, in one place.
_DESERIALIZE_FAILED = "Failed to deserialize StableHLO"


def xla_status(e: BaseException) -> str:
    """The status code an XLA runtime error starts with (``RESOURCE_EXHAUSTED``, ...); "" if none.

    jaxlib's ``XlaRuntimeError`` carries its status only as the first word of its message.
    """
    head = str(e).lstrip().split(":", 1)[0]
    return head if head.isupper() and head.replace("_", "").isalpha() else ""


def cannot_deserialize(message: object) -> bool:
    """True if a jaxlib/MLIR message says StableHLO bytes could not be deserialized at all."""
    text = str(message)
    return text.find(_DESERIALIZE_FAILED) >= 0
