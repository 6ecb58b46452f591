"""The key scheme of residuals: the one module that builds and parses these keys.

A residuals pytree, a residuals file and an intermediates file name their arrays so:

| key | what |
| --- | --- |
| ``r/<i>`` | the forward's ``i``-th stored residual (the backward module's ``i``-th stored argument) |
| ``in/<input key>`` | a residual that is one of the forward's inputs (the caller's array, never a copy) |
| ``c/<i>`` | the ``i``-th array the input part of a split backward computed for the weight part |

An input key (``params/layers/0/w``) names its argument by its first segment (``arg_of``).
"""

from __future__ import annotations

_STORED = "r/"
_INPUT = "in/"
_COMPUTED = "c/"


def stored(i: int) -> str:
    """The key of stored residual ``i``: ``r/<i>``."""
    return f"{_STORED}{i}"


def input_backed(input_key: str) -> str:
    """The key of the residual that is input ``input_key``: ``in/<input key>``."""
    return f"{_INPUT}{input_key}"


def intermediate(i: int) -> str:
    """The key of the ``i``-th array B computed for W: ``c/<i>``."""
    return f"{_COMPUTED}{i}"


def is_stored(key: str) -> bool:
    """True for a stored residual's key (``r/<i>``)."""
    return key.startswith(_STORED)


def is_input_backed(key: str) -> bool:
    """True for an input-backed residual's key (``in/<input key>``)."""
    return key.startswith(_INPUT)


def is_intermediate(key: str) -> bool:
    """True for the key of an array B computed for W (``c/<i>``)."""
    return key.startswith(_COMPUTED)


def input_of(key: str) -> str:
    """The input key an input-backed residual's key names (``in/x`` -> ``x``)."""
    if not is_input_backed(key):
        raise ValueError(f"{key!r} is not an input-backed residual's key")
    return key[len(_INPUT) :]


def arg_of(input_key: str) -> str:
    """The argument an input key belongs to: its first segment (``params/w`` -> ``params``)."""
    return input_key.split("/", 1)[0]
