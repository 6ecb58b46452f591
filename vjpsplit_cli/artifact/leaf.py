"""One array in the manifest (``Leaf``): its file key, dtype, shape, PRNG impl and sharding, as JSON and in words.

Also how a leaf is made from a ``(key, struct)`` pair (``leaves_of``, what ``export``
writes into the manifest). Owns the leaf's schema. The manifest that lists leaves is
``manifest``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from ..errors import VjpsplitError
from ..files.dtypes import dtype_from_name, dtype_name
from ..files.prng import data_struct, impl_name, is_key, key_ndim
from ..files.shapes import dim_str, format_shape
from .sharding import SpecJSON, spec_from_json, spec_to_json


@dataclass(frozen=True)
class Leaf:
    """One array in the manifest: its file key, dtype name and shape (ints or dim names).

    A typed PRNG key is described by its key data (``uint32[..., 2]`` for
    threefry), with ``prng_impl`` naming the impl that wraps it back.

    Attributes:
        key: The leaf's file key (``x``, ``params/w``, ``r/0``, ``in/x``).
        dtype: The dtype's name (``float32``, ``bfloat16``).
        shape: The dims: ints, or names of symbolic dims.
        input_backed: For residuals only: read from the inputs, not stored.
        prng_impl: For a typed PRNG key, the impl of its key data; ``""`` for plain arrays.
        sharding: Format >= 4: the leaf's PartitionSpec on the artifact's mesh (one
            entry per dim: ``None``, an axis name or a tuple of names); ``None`` unsharded.
    """

    key: str
    dtype: str
    shape: tuple[int | str, ...]
    input_backed: bool = False  # residuals only: read from the inputs, not stored
    prng_impl: str = ""  # typed PRNG key: the impl of its key data; "" for plain arrays
    sharding: SpecJSON | None = None  # format >= 4: PartitionSpec on the artifact's mesh; None unsharded

    def describe(self) -> str:
        """``bf16[32,128]``, or ``key<threefry2x32>[4] as u32[4,2]`` for typed keys.

        Returns:
            The leaf's dtype and shape as vjpsplit's messages write them.
        """
        data = format_shape(self.dtype, self.shape)
        if not self.prng_impl:
            return data
        return f"key<{self.prng_impl}>[{','.join(str(d) for d in self.key_shape)}] as {data}"

    @property
    def key_shape(self) -> tuple[int | str, ...]:
        """The shape of the array the function sees: the key array's shape for typed keys."""
        if not self.prng_impl:
            return self.shape
        return self.shape[: len(self.shape) - key_ndim(self.prng_impl)]

    def to_json(self, residual: bool = False) -> dict:
        """The leaf as the manifest's JSON writes it.

        Args:
            residual: Whether the leaf is a residual, whose entry says ``input_backed``.

        Returns:
            A JSON-able dict: ``key``, ``dtype``, ``shape``, and ``input_backed``,
            ``prng_impl`` and ``sharding`` where they apply.
        """
        d: dict[str, Any] = {"key": self.key, "dtype": self.dtype, "shape": list(self.shape)}
        if residual:
            d["input_backed"] = self.input_backed
        if self.prng_impl:
            d["prng_impl"] = self.prng_impl
        if self.sharding is not None:
            d["sharding"] = [list(e) if isinstance(e, tuple) else e for e in self.sharding]
        return d

    @classmethod
    def from_json(cls, d: Mapping) -> "Leaf":
        """Read a leaf from its manifest JSON entry.

        Args:
            d: The entry, as ``to_json`` writes it.

        Returns:
            The ``Leaf``.

        Raises:
            ValueError: If the shape, dtype, ``prng_impl`` or sharding is malformed
                (``Manifest.from_json`` turns it into a ``VjpsplitError``).
        """
        shape = tuple(d["shape"])
        if not all(isinstance(x, (int, str)) and not isinstance(x, bool) for x in shape):
            raise ValueError(f"bad shape {shape!r}")
        dtype_from_name(d["dtype"])
        impl = d.get("prng_impl", "")
        if not isinstance(impl, str):
            raise ValueError(f"bad prng_impl {impl!r}")
        sharding = d.get("sharding")
        if sharding is not None:
            sharding = spec_from_json(sharding)
            if len(sharding) > len(shape):
                raise ValueError(f"sharding of '{d['key']}' has more entries than its shape has dims")
        return cls(str(d["key"]), str(d["dtype"]), shape, bool(d.get("input_backed", False)), impl, sharding)


def leaves_of(
    entries: Sequence[tuple[str, Any]],
    what: str = "leaf",
    impls: Sequence[str] | None = None,
    specs: Sequence | None = None,
) -> tuple[Leaf, ...]:
    """Manifest leaves for ``(key, struct)`` pairs; typed keys become their key data.

    ``impls`` gives the PRNG impl of each entry whose struct is already key data;
    ``specs`` the sharding of each (sharded artifacts).

    Args:
        entries: ``(file key, struct)`` pairs.
        what: What to call a leaf in messages (``input``, ``output``, ``residual``).
        impls: Per entry, the PRNG impl where its struct is already key data (``""`` for none); ``None`` for none.
        specs: Per entry, its PartitionSpec (``None`` where unsharded); ``None`` for an unsharded artifact.

    Returns:
        The leaves, in order.

    Raises:
        VjpsplitError: If a leaf's dtype is not one a manifest can name.
    """
    out = []
    for i, (k, s) in enumerate(entries):
        impl = impls[i] if impls else ""
        if is_key(s):
            impl, s = impl_name(s), data_struct(s)
        try:
            dtype = dtype_name(s.dtype)
        except (VjpsplitError, TypeError) as e:
            raise VjpsplitError(f"{what} '{k}': {e}; pass arrays of a numeric, bool or PRNG key dtype") from e
        out.append(
            Leaf(
                k,
                dtype,
                tuple(dim_str(d) for d in s.shape),
                prng_impl=impl,
                sharding=spec_to_json(specs[i]) if specs and specs[i] is not None else None,
            )
        )
    return tuple(out)
