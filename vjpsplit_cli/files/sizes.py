"""Sizes as users write and read them: ``--at NAME=SIZE``, byte sizes (``64MiB``), byte counts.

``parse_at`` reads the sizes of symbolic dims (``--at b=256``, or ``at=`` in Python),
``parse_bytes`` a memory budget, ``plain`` a NumPy scalar a user passes as a Python number; byte counts of arrays with symbolic dims are kept as
``{symbolic factor: coefficient}`` terms (``byte_terms``), evaluated at sizes
(``evaluate_terms``) and printed (``human_bytes``, ``format_bytes_terms``). No JAX here.
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Any, Mapping, Protocol, Sequence, TypeVar, cast

import numpy as np
import numpy.typing as npt

from ..errors import UsageError, VjpsplitError
from .dtypes import dtype_from_name
from .dimtext import MAX_DIM
from .shapes import IDENTIFIER, eval_dim

T = TypeVar("T")


def plain(value: T) -> T:
    """``value`` with NumPy integer and floating scalars (also in a list or tuple) as Python ints and floats.

    Typed as the value's own type: the caller's annotation says the number it means, and a NumPy scalar
    becomes that Python number here."""
    if isinstance(value, (list, tuple)):
        return cast(T, type(value)(plain(v) for v in value))
    if isinstance(value, np.bool_):
        return value  # not a number: left for the check that refuses it
    if isinstance(value, np.integer):
        return cast(T, int(value))
    if isinstance(value, np.floating):
        return cast(T, float(value))
    if isinstance(value, np.ndarray) and value.ndim == 0 and value.dtype.kind in "iuf":
        return cast(T, plain(value[()]))
    return value


class ShapedLeaf(Protocol):
    """What ``byte_terms`` reads of a leaf (a manifest ``Leaf`` is one): its dtype's name and its shape."""

    @property
    def dtype(self) -> str: ...

    @property
    def shape(self) -> Sequence[int | str]: ...


def byte_terms_of_shape(dtype: npt.DTypeLike, shape: Sequence[int | str]) -> dict[str, int]:
    """Bytes of an array as ``{symbolic factor: coefficient}``; ``""`` is the constant term."""
    coeff = dtype_from_name(dtype).itemsize if isinstance(dtype, str) else np.dtype(dtype).itemsize
    factors: list[str] = []
    for d in shape:
        if isinstance(d, int):
            coeff *= d
        else:
            factors.append(d if d.replace("_", "").isalnum() else f"({d})")
    return {"·".join(sorted(factors)): coeff}


def byte_terms(leaf: ShapedLeaf) -> dict[str, int]:
    """Bytes of one manifest leaf as ``{symbolic factor: coefficient}``."""
    return byte_terms_of_shape(leaf.dtype, leaf.shape)


def total_bytes(leaves: Sequence[ShapedLeaf]) -> dict[str, int]:
    """Summed ``byte_terms`` of ``leaves``."""
    total: dict[str, int] = defaultdict(int)
    for leaf in leaves:
        for k, v in byte_terms(leaf).items():
            total[k] += v
    return dict(total)


def evaluate_terms(terms: Mapping[str, int], at: Mapping[str, int]) -> int | None:
    """The byte count of ``terms`` with symbolic dims sized by ``at``; None if some are unbound."""
    total = 0
    for k, coeff in terms.items():
        value = coeff
        for factor in filter(None, k.split("·")):
            v = eval_dim(factor, at)  # "(2*b + 4)": parenthesised as byte_terms_of_shape wrote it
            if v is None:
                return None
            value *= v
        total += value
    return total


def human_bytes(n: int) -> str:
    """``1536`` -> ``1.5 KiB``."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError


def format_bytes_terms(terms: dict[str, int]) -> str:
    """``{"": 12288, "b": 8192}`` -> ``12.0 KiB + 8.0 KiB·b``."""
    if not terms:
        return "0 B"
    parts: list[str] = []
    for k in sorted(terms, key=lambda k: (k != "", k)):
        if terms[k] == 0:
            continue
        parts.append(human_bytes(terms[k]) + (f"·{k}" if k else ""))
    return " + ".join(parts) or "0 B"


_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}


def parse_bytes(text: str | int) -> int:
    """``'64MiB'`` -> 67108864; also plain integers, ``kB``/``MB``/``GB`` (powers of 1000) and ``KiB``/``GiB``."""
    if isinstance(text, (int, np.integer)) and not isinstance(text, bool):
        if text < 0:
            raise VjpsplitError(f"memory budget {text} is negative")
        return int(text)
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise VjpsplitError(f"memory budget {text!r} is not a size; write e.g. 64MiB, 1.5GB or 1048576")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


# Sizes of symbolic dims as callers give them: ``['b=256', 't=128']`` (``--at``), a mapping, or None.
AtSizes = Sequence[str] | Mapping[str, int] | None


def parse_at(items: AtSizes, option: str = "--at ") -> dict[str, int]:
    """``['b=256', 't=128']`` (or a mapping) -> ``{'b': 256, 't': 128}``; sizes must be >= 1.

    ``option``: what starts each error's message (a click parameter type passes ``""``: click names the option).
    """
    if items is None:
        return {}
    pairs: list[tuple[str, Any]]
    if isinstance(items, Mapping):
        pairs = list(items.items())
    else:
        pairs = []
        for item in items:
            for part in str(item).split(","):
                name, eq, value = part.partition("=")
                # ASCII digits only: str.isdigit() also accepts '²', which int() refuses.
                if not eq or not _AT_NAME.match(name.strip()) or not _AT_SIZE.match(value.strip()):
                    raise VjpsplitError(f"{option}{part!r} is not NAME=SIZE; write e.g. b=256")
                pairs.append((name.strip(), int(value)))
    out: dict[str, int] = {}
    for name, value in pairs:
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise VjpsplitError(f"{option}{name}={value!r}: a size must be an integer, e.g. b=256")
        if int(value) < 1:
            raise VjpsplitError(f"{option}{name}={value}: symbolic dims are >= 1")
        if int(value) > MAX_DIM:
            raise VjpsplitError(f"{option}{name}={value}: too large (at most 2**40); check the number")
        out[str(name)] = int(value)
    return out


def check_at_names(at: Mapping[str, int], known: Sequence[str], source: str) -> None:
    """Refuse ``--at`` names that are not symbolic dims of ``source`` (a usage error naming them)."""
    unknown = [n for n in at if n not in known]
    if unknown:
        have = f"its symbolic dims are {', '.join(known)}" if known else "it has no symbolic dims"
        raise UsageError(f"--at {', '.join(unknown)}: no such symbolic dim in {source}; {have}")


_AT_NAME = re.compile(rf"^{IDENTIFIER.pattern}$")
_AT_SIZE = re.compile(r"^[0-9]{1,30}$")
