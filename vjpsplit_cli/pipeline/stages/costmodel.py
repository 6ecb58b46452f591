"""The cost model of a cut: an equation's estimated FLOPs and a value's bytes, symbolic dims at ``COST_DIM``.

A value is anything ``Shaped`` (a shape and a dtype): an aval, a spec, an index's or manifest's leaf.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping, Protocol, Sequence, cast

import numpy as np
import numpy.typing as npt

from ...files.shapes import concrete_shape, dim_str, eval_dim
from ...tracing.jaxprs import sub_jaxprs

if TYPE_CHECKING:
    from jax.extend import core as jcore

COST_DIM = 8  # the size symbolic dims take in cost and byte estimates


class Shaped(Protocol):
    """What has an array's shape and dtype: an aval, a ``jax.ShapeDtypeStruct``, an index's or manifest's leaf."""

    @property
    def shape(self) -> Sequence[object]:
        """The dims: ints, or symbolic dims (or their text)."""
        ...

    @property
    def dtype(self) -> npt.DTypeLike:
        """The dtype, or its name."""
        ...


def aval_of(atom: jcore.Var | jcore.Literal) -> Shaped:
    """``atom``'s aval: a traced array's (jax types it as any abstract value, which need not have a shape)."""
    return cast("Shaped", atom.aval)


# A typed PRNG key's bytes by its dtype's name (an index's leaf holds the name): its key data's.
_KEY_BYTES = {"key<fry>": 8, "key<rbg>": 16, "key<urbg>": 16}


def itemsize(dtype: npt.DTypeLike) -> int:
    """Bytes per element of ``dtype``: a NumPy dtype or its name, a typed PRNG key's dtype or its name
    (``key<fry>``: its key data's bytes; a key impl not listed counts as threefry's 8)."""
    size = getattr(dtype, "itemsize", None)
    if isinstance(size, int):
        return size
    if isinstance(dtype, str) and dtype.startswith("key<"):
        return _KEY_BYTES.get(dtype, 8)
    return np.dtype(dtype).itemsize


def nbytes(aval: Shaped, dims: Mapping[str, int] | None = None) -> int:
    """An abstract value's bytes, symbolic dims at ``COST_DIM`` (or ``dims``)."""
    shape = concrete_shape(tuple(dim_str(d) for d in aval.shape), dims or ANY_DIM)
    return int(np.prod(shape or (), dtype=np.int64)) * itemsize(aval.dtype)


class AnyDim(dict[str, int]):
    """Every symbolic dim at ``COST_DIM``."""

    def __missing__(self, key: str) -> int:
        return COST_DIM

    def __contains__(self, key: object) -> bool:
        return True

    def get(self, key: str, default: object = None) -> int:  # type: ignore[override]  # every dim has a size
        """The dim's size: the one given, else ``COST_DIM`` (never ``default``)."""
        return self[key]


ANY_DIM = AnyDim()


def eqn_cost(eqn: jcore.JaxprEqn) -> float:
    """An equation's estimated FLOPs: 2·M·N·K for a dot, one per output element otherwise (sub-jaxprs summed)."""
    out = sum(nbytes(aval_of(v)) / max(itemsize(aval_of(v).dtype), 1) for v in eqn.outvars if hasattr(v, "aval"))
    name = eqn.primitive.name
    if name == "dot_general":
        (contract, _), _ = eqn.params["dimension_numbers"]
        lhs = aval_of(eqn.invars[0])
        k = 1
        for d in contract:
            k *= eval_dim(dim_str(lhs.shape[d]), ANY_DIM) or COST_DIM
        return 2.0 * out * k
    subs = sub_jaxprs(eqn)
    if subs:
        inner = sum(eqn_cost(e) for s in subs for e in getattr(getattr(s, "jaxpr", s), "eqns", ()))
        return inner * (int(eqn.params.get("length", 1)) if name == "scan" else 1)
    return float(out)
