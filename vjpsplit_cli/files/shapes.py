"""Shape specs: ``f32[b,784]`` strings, symbolic dims, and matching arrays against them."""

from __future__ import annotations

import re
from typing import Any, Mapping, Sequence

import jax
import numpy as np
import numpy.typing as npt
from jax import export as jexport
from jax.sharding import NamedSharding

from ..errors import VjpsplitError
from .dimtext import FUNCS, MAX_DIM
from .dimtext import evaluate
from .dtypes import NARROWED, dtype_from_name, short_name
from .prng import is_key

_SPEC_RE = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*\[\s*([^\]]*)\]\s*$")
IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")  # a symbolic dim's (or --at entry's) name
_NAME_RE = re.compile(rf"^{IDENTIFIER.pattern}$")
_INT_RE = re.compile(r"^[0-9]+$")  # ASCII digits only: str.isdigit() also accepts '²', which int() refuses


def new_scope() -> jexport.SymbolicScope:
    """A fresh scope: every symbolic dim of one export must come from the same scope."""
    return jexport.SymbolicScope()


def parse_array_spec(text: str, scope: jexport.SymbolicScope) -> jax.ShapeDtypeStruct:
    """``'f32[b,784]'`` -> ``ShapeDtypeStruct((b, 784), float32)`` with ``b`` symbolic in ``scope``."""
    m = _SPEC_RE.match(text)
    if not m:
        raise VjpsplitError(f"shape spec {text!r} is not DTYPE[DIMS]; write e.g. f32[b,784] or f32[] for a scalar")
    dtype = dtype_from_name(m.group(1))
    dims_text = m.group(2).strip()
    if not dims_text:
        return jax.ShapeDtypeStruct((), dtype)
    dims: list[Any] = []
    elements = 1
    for d in (p.strip() for p in dims_text.split(",")):
        if _INT_RE.match(d):
            elements *= int(d)
            if int(d) > MAX_DIM:
                raise VjpsplitError(
                    f"dimension {d[:30]} in {text[:60]!r} is too large (at most 2**40); check the number"
                )
            if elements > MAX_DIM:
                raise VjpsplitError(f"the dims of {text[:60]!r} make more than 2**40 elements; check the numbers")
            dims.append(int(d))
        elif _NAME_RE.match(d):
            dims.append(_symbolic_dim(d, text, scope))
        else:
            raise VjpsplitError(f"dimension {d!r} in {text!r} must be an integer or a name like b")
    return jax.ShapeDtypeStruct(tuple(dims), dtype)


def _symbolic_dim(name: str, text: str, scope: jexport.SymbolicScope) -> object:  # jax keeps the dim class private
    """The symbolic dim ``name``; names that jax.export's shape syntax reserves (mod, max, non_negative, _) are
    refused."""
    if name in FUNCS:  # a shape function's name: jax.export takes it, but no manifest could spell the dim
        raise VjpsplitError(
            f"dimension name {name!r} in {text!r} is reserved by jax.export's shape syntax; use another name, like b"
        )
    try:
        (dim,) = jexport.symbolic_shape(name, scope=scope)
    except Exception as e:  # jax.export's parser raises plain ValueErrors with grammar details
        raise VjpsplitError(
            f"dimension name {name!r} in {text!r} is reserved by jax.export's shape syntax; use another name, like b"
        ) from e
    if isinstance(dim, (int, np.integer)):
        raise VjpsplitError(f"dimension name {name!r} in {text!r} is not a plain symbolic dim; use a name like b")
    return dim


def dim_str(d: object) -> int | str:
    """A dim as stored in manifests: an int, or the symbolic expression's text (``b``, ``2*b``)."""
    return int(d) if isinstance(d, (int, np.integer)) else str(d)


def format_shape(dtype: npt.DTypeLike, shape: Sequence[object]) -> str:
    """``bf16[32,128]``: the spelling used in every message and table."""
    return f"{short_name(dtype)}[{','.join(str(d) for d in shape)}]"


def is_symbolic_shape(shape: Sequence[object]) -> bool:
    """True when any dim is not a plain integer."""
    return any(not isinstance(d, (int, np.integer)) for d in shape)


def bind_dims(what: str, expected: Sequence[int | str], actual: Sequence[int], dims: dict[str, int]) -> bool:
    """Match ``actual`` against a stored shape, binding symbolic names in ``dims``.

    Returns False on a mismatch. A dim that is an expression (``2*b``) is not
    solved here; it is checked once all plain names are bound (``eval_dim``).
    """
    if len(expected) != len(actual):
        return False
    for e, a in zip(expected, actual):
        if isinstance(e, int):
            if e != a:
                return False
        elif _NAME_RE.match(e):
            if a < 1:
                raise VjpsplitError(f"{what}: symbolic dim {e!r} is {a}, but symbolic dims must be >= 1")
            if dims.setdefault(e, a) != a:
                return False
    return True


def eval_dim(expr: int | str, dims: Mapping[str, int]) -> int | None:
    """The value of a stored dim under ``dims``; None when it uses an unbound name.

    Every form jax.export prints is evaluated (``2*b + 1``, ``floordiv(b, 2)``,
    ``b^2``: module ``dims``); text it does not read returns None and is left to
    jax.export's own shape checks.
    """
    return evaluate(expr, dims)


def concrete_shape(shape: Sequence[int | str], dims: Mapping[str, int]) -> tuple[int, ...] | None:
    """``shape`` with every dim evaluated, or None if some dim cannot be."""
    out: list[int] = []
    for d in shape:
        v = eval_dim(d, dims)
        if v is None:
            return None
        out.append(v)
    return tuple(out)


def to_struct(leaf: object) -> jax.ShapeDtypeStruct:
    """A ShapeDtypeStruct for a spec leaf: a ShapeDtypeStruct, an array, or a Python scalar."""
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return leaf
    if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
        # A jax.Array laid out over a mesh exports with that layout, as a spec with it would.
        sharding = getattr(leaf, "sharding", None)
        if not isinstance(sharding, NamedSharding) or len(sharding.device_set) < 2:
            sharding = None
        return jax.ShapeDtypeStruct(tuple(leaf.shape), leaf.dtype, sharding=sharding)
    if isinstance(leaf, (bool, int, float, complex)):
        # What jnp.asarray gives a Python scalar: 32-bit without x64 (complex included), 64-bit with it.
        return jax.ShapeDtypeStruct((), jax.dtypes.canonicalize_dtype(np.asarray(leaf).dtype))
    raise VjpsplitError(f"spec leaf {leaf!r} is not an array or jax.ShapeDtypeStruct")


def is_64bit(spec: Any) -> bool:
    """Whether ``spec``'s dtype is one that needs ``jax_enable_x64`` (a PRNG key never is)."""
    return not is_key(spec) and np.dtype(spec.dtype).name in NARROWED


def refuse_64bit_without_x64(entries: Sequence[tuple[str, Any]], what: str = "input") -> None:
    """Refuse a 64-bit spec leaf while ``jax_enable_x64`` is off, naming its file key, dtype and the fixes.

    ``entries`` are ``(file key, ShapeDtypeStruct)`` pairs. Without x64, ``jax.export``
    would lower such a leaf in its 32-bit kin, an artifact that takes f32 where the spec
    (and a file written for it) says f64. A spec declares the artifact's interface, files
    are never cast implicitly, and the CLI exports the same spec as a 64-bit artifact
    (it turns x64 on for it): so a refusal, before anything is traced, rather than an
    artifact that differs from what was asked for.
    """
    # jax defines its options at run time: the stub does not declare jax_enable_x64.
    if jax.config.jax_enable_x64:  # type: ignore[attr-defined]
        return
    wide = [(k, np.dtype(s.dtype).name) for k, s in entries if is_64bit(s)]
    if not wide:
        return
    key, name = wide[0]
    n = len(wide) - 1
    more = f" (and {n} other 64-bit {'leaf' if n == 1 else 'leaves'})" if n else ""
    raise VjpsplitError(
        f"{what} '{key}' is {name}{more}, but jax_enable_x64 is off, so JAX would compute it in "
        f"{NARROWED[name]}; turn 64-bit types on before exporting (jax.config.update('jax_enable_x64', True) "
        f"or JAX_ENABLE_X64=1), or declare the leaf {NARROWED[name]}"
    )
