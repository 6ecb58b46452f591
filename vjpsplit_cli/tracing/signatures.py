"""Reading a function's arguments: ``wrt`` as positions, positional parameter names, and names for messages.

Owns what split, export and the CLI ask of a user's function before tracing it: which arguments
``wrt`` names, its positional parameters (``inspect.signature``), whether it is something JAX
can trace at all, and its name in messages.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Sequence, Union

import numpy as np

from ..errors import VjpsplitError

# What ``wrt`` may be: an argument position or name, a sequence of them, or None (every argument).
Wrt = Union[int, np.integer, str, Sequence[Union[int, str]], None]


def wrt_positions(names: Sequence[str], wrt: Wrt, owner: str = "") -> tuple[tuple[int, ...], bool]:
    """Normalise ``wrt`` (int, name, or sequence of them; None = all) to positions in ``names``.

    Also says whether one gradient (not a tuple) is wanted: a single int or name.
    """
    n = len(names)
    if wrt is None:
        return tuple(range(n)), False
    items: list[object]
    if isinstance(wrt, (int, np.integer, str)):
        single, items = True, [wrt]
    else:
        single = False
        try:
            items = list(wrt)
        except TypeError:  # not a sequence (wrt=1.5): refused below as a bad entry
            items = [wrt]
    out: list[int] = []
    for w in items:
        if isinstance(w, str):
            if w not in names:
                raise VjpsplitError(
                    f"wrt names {w!r}, which is not an argument{f' of {owner}' if owner else ''}; "
                    f"the arguments are {', '.join(names)}"
                )
            out.append(list(names).index(w))
        elif isinstance(w, (int, np.integer)) and not isinstance(w, bool) and -n <= w < n:
            out.append(int(w) % n)
        else:
            raise VjpsplitError(f"wrt entry {w!r} is not an argument name or position (0..{n - 1})")
    if len(set(out)) != len(out):
        raise VjpsplitError(f"wrt names an argument twice: {wrt!r}")
    return tuple(out), single


def fn_wrt_positions(fn: Callable[..., Any], wrt: Wrt, nargs: int) -> tuple[tuple[int, ...], bool]:
    """``wrt_positions`` against ``fn``'s own parameter names."""
    return wrt_positions(positional_names(fn, nargs), wrt, fn_name(fn))


def signature_positionals(fn: Callable[..., Any]) -> tuple[list[str], int, str | None]:
    """``fn``'s positional parameter names, how many are required, and its ``*args`` name (None without).

    Raises TypeError or ValueError where ``fn`` has no signature to read.
    """
    names: list[str] = []
    required, var = 0, None
    for p in inspect.signature(fn).parameters.values():
        if p.kind == p.VAR_POSITIONAL:
            var = p.name
        elif p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            names.append(p.name)
            if p.default is p.empty:
                required = len(names)
    return names, required, var


def positional_names(fn: Callable[..., Any], nargs: int) -> list[str]:
    """Parameter names for ``nargs`` positional arguments; ``arg{i}`` past ``*args``."""
    try:
        names = signature_positionals(fn)[0]
    except (TypeError, ValueError):
        names = []
    names += [f"arg{i}" for i in range(len(names), nargs)]
    return names[:nargs]


def not_traceable(fn: object) -> str | None:
    """What ``fn`` is, when it is not a Python function JAX can trace (None when it may be one).

    A NumPy function (a ufunc such as ``numpy.sin`` included) computes on NumPy
    arrays and cannot take JAX's tracers; a class makes an object, not an output.
    """
    if not callable(fn):
        return f"an object of type {type(fn).__name__}, not a function"
    if isinstance(fn, type):
        return f"a class ({fn.__name__}), not a function; construct it inside a function that computes the output"
    module = getattr(fn, "__module__", None) or type(fn).__module__ or ""
    if module == "numpy" or module.startswith("numpy."):
        name = getattr(fn, "__name__", type(fn).__name__)
        kind = "NumPy ufunc" if type(fn).__name__ == "ufunc" else "NumPy function"
        return f"a {kind} (numpy.{name}), which JAX cannot trace; use jax.numpy.{name} instead"
    return None


def fn_name(fn: object) -> str:
    """A function's name for messages."""
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
