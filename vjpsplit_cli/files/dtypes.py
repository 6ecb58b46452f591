"""Dtype names: the short spellings of ``--shapes`` and the safe name <-> dtype mapping of files."""

from __future__ import annotations

import ml_dtypes  # noqa: F401  (registers bfloat16 & co. with numpy)
import numpy as np
import numpy.typing as npt

from ..errors import VjpsplitError

SHORT_NAMES: dict[str, str] = {
    "f64": "float64",
    "f32": "float32",
    "f16": "float16",
    "bf16": "bfloat16",
    "i64": "int64",
    "i32": "int32",
    "i16": "int16",
    "i8": "int8",
    "u64": "uint64",
    "u32": "uint32",
    "u16": "uint16",
    "u8": "uint8",
    "bool": "bool",
    "c64": "complex64",
    "c128": "complex128",
}
_LONG_TO_SHORT = {v: k for k, v in SHORT_NAMES.items()}

# The dtypes JAX holds only with jax_enable_x64, each with the 32-bit dtype JAX computes in without it.
NARROWED = {"float64": "float32", "int64": "int32", "uint64": "uint32", "complex128": "complex64"}

# Every dtype a JAX array can have. Files may name only these: anything else
# (object, str, void, datetime) is refused before any byte is interpreted.
_ALLOWED = frozenset(
    [
        "bool",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "float32",
        "float64",
        "complex64",
        "complex128",
        "bfloat16",
        "float8_e4m3fn",
        "float8_e4m3fnuz",
        "float8_e5m2",
        "float8_e5m2fnuz",
        "float8_e4m3b11fnuz",
        "float8_e3m4",
        "float8_e4m3",
        "float8_e8m0fnu",
        "float4_e2m1fn",
        "int2",
        "int4",
        "uint2",
        "uint4",
    ]
)


def dtype_from_name(name: str) -> np.dtype:
    """The dtype for a short (``bf16``) or numpy (``bfloat16``) name; refuses non-array dtypes."""
    long = SHORT_NAMES.get(name, name)
    if long not in _ALLOWED:
        raise VjpsplitError(f"unknown dtype {name!r}; use one of {', '.join(SHORT_NAMES)} or a numpy name like float32")
    try:
        return np.dtype(long)
    except TypeError as e:  # an ml_dtypes name this ml_dtypes version lacks
        raise VjpsplitError(f"dtype {name!r} is not known to the installed ml_dtypes; upgrade it") from e


def dtype_name(dtype: npt.DTypeLike) -> str:
    """The canonical (numpy) name stored in files and manifests, e.g. ``bfloat16``."""
    name = np.dtype(dtype).name
    if name not in _ALLOWED:
        raise VjpsplitError(f"dtype {name!r} cannot be stored: only numeric and bool array dtypes can")
    return name


def short_name(dtype: npt.DTypeLike) -> str:
    """The short spelling used in messages and tables, e.g. ``bf16``; numpy name where none."""
    name = np.dtype(dtype).name
    return _LONG_TO_SHORT.get(name, name)
