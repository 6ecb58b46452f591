"""Typed PRNG keys (``jax.random.key``, dtype ``key<impl>``) at the file and module boundary.

Files and exported modules hold a typed key as its key data
(``jax.random.key_data``: ``uint32[..., 2]`` for threefry); the manifest records
the impl's name, and the Python API wraps the data back into typed keys. Legacy
``uint32[2]`` keys are plain integer arrays and need none of this.
"""

from __future__ import annotations

import functools
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

_T = TypeVar("_T")
_A = TypeVar("_A", bound=ArrayLike)


def is_key(x: object) -> bool:
    """True for a typed PRNG key array, tracer or ``ShapeDtypeStruct``."""
    dtype = getattr(x, "dtype", None)
    try:
        return dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key)
    except TypeError:
        return False


def impl_name(x: jax.Array | jax.ShapeDtypeStruct) -> str:
    """The impl of a typed key (array, tracer or struct) by name, e.g. ``threefry2x32``."""
    found: list[Any] = []
    if isinstance(x, jax.ShapeDtypeStruct):
        jax.eval_shape(lambda k: found.append(jax.random.key_impl(k)), x)
    else:
        found.append(jax.random.key_impl(x))
    impl = found[0]
    # jax >= 0.7 gives the name; older releases a PRNGSpec whose str is the name.
    return getattr(impl, "name", None) or str(impl)


def data_struct(x: jax.Array | jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
    """The key data's shape and dtype for a typed key (``key<fry>[3]`` -> ``uint32[3,2]``)."""
    s = jax.ShapeDtypeStruct(tuple(x.shape), x.dtype)
    return jax.eval_shape(jax.random.key_data, s)


def to_data(x: _T) -> _T | jax.Array:
    """Key data for a typed key; anything else unchanged."""
    # is_key is a runtime check mypy cannot follow: where it holds, x is a key array.
    return jax.random.key_data(x) if is_key(x) else x  # type: ignore[arg-type]


def from_data(x: _A, impl: str | None) -> _A | jax.Array:
    """A typed key from its data when ``impl`` is given; ``x`` unchanged otherwise."""
    # jax annotates Array, and wraps numpy key data (as files hold it) just the same.
    return jax.random.wrap_key_data(x, impl=impl) if impl else x  # type: ignore[arg-type]


@functools.lru_cache(maxsize=None)  # traces once per impl; asked for every key leaf of every bwd
def key_ndim(impl: str) -> int:
    """How many trailing dims the key data of ``impl`` adds (1 for threefry and rbg)."""
    return len(jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0, impl=impl))).shape)


def is_ready(a: jax.Array) -> bool:
    """Whether ``a`` is computed (``jax.Array.is_ready``); a typed key, which lacks it, asks its key data."""
    try:
        return bool(a.is_ready())  # type: ignore[attr-defined]  # public, not in jax.Array's stub
    except AttributeError:
        return bool(jax.random.key_data(a).is_ready())  # type: ignore[attr-defined]  # as above
