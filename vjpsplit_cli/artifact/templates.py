"""Template array files: exactly the keys, dtypes and shapes an artifact expects, filled with a constant or noise.

``vjpsplit template`` is a thin layer over ``template``: where an inputs or
cotangents file comes from is then never a question of reading key rules and
writing Python.
"""

from __future__ import annotations

import os
from typing import Mapping, Sequence

import numpy as np

from ..errors import UsageError
from ..files import save_arrays
from ..files.dtypes import dtype_from_name
from ..files.dimtext import names, parse
from ..files.shapes import concrete_shape, eval_dim
from ..files.sizes import check_at_names, parse_at
from .artifact import Artifact
from .loading import load
from .leaf import Leaf

WHAT = ("inputs", "cotangents")
FILLS = ("zeros", "ones", "normal")


def _leaves(art: Artifact, what: str) -> tuple[Leaf, ...]:
    m = art.manifest
    if what == "inputs":
        return tuple(m.inputs)
    # run-bwd wants a key for every leaf of out (integer ones included, whose value it ignores).
    return tuple(leaf for leaf in m.outputs if leaf.key in m.out_keys)


def _fill(leaf: Leaf, shape: tuple[int, ...], fill: str, rng: np.random.Generator) -> np.ndarray:
    dtype = dtype_from_name(leaf.dtype)
    if fill == "zeros":
        return np.zeros(shape, dtype)
    if fill == "ones":
        return np.ones(shape, dtype)
    if leaf.prng_impl:  # any bits are valid key data
        return rng.integers(0, 2**32, size=shape, dtype=np.uint64).astype(dtype)
    kind = np.dtype(dtype).kind
    if kind == "b":
        return rng.random(shape) < 0.5
    if kind in "iu":  # small non-negative values: integer inputs are often labels or indices
        return rng.integers(0, 8, size=shape).astype(dtype)
    if kind == "c":
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dtype)
    return rng.standard_normal(shape).astype(np.float32).astype(dtype)


def template(
    artifact: Artifact | str | os.PathLike,
    what: str = "inputs",
    at: Mapping[str, int] | Sequence[str] | None = None,
    fill: str = "zeros",
    seed: int = 0,
) -> dict[str, np.ndarray]:
    """The ``{key: array}`` an artifact expects for its ``inputs`` or ``cotangents``, ready for a file.

    Typed PRNG keys are given as their key data, as array files hold them.

    Args:
        artifact: The artifact, or the path of its file (loaded with ``load``'s defaults).
        what: ``"inputs"`` or ``"cotangents"``.
        at: Sizes of the symbolic dims (``{"b": 4}`` or ``["b=4"]``); ``None`` when there are none.
        fill: ``"zeros"``, ``"ones"`` or ``"normal"`` (standard normal floats; integers 0..7; random bools, keys).
        seed: The random seed for ``fill="normal"``.

    Returns:
        The arrays by flat key, as an array file holds them.

    Raises:
        VjpsplitError: If ``what`` or ``fill`` is not one of the choices, ``at`` is malformed or names a dim the
            artifact does not have, a symbolic dim is left unsized, or the artifact file cannot be loaded.
    """
    art = artifact if isinstance(artifact, Artifact) else load(artifact)
    if what not in WHAT:
        raise UsageError(f"what must be one of {', '.join(WHAT)}, not {what}")
    if fill not in FILLS:
        raise UsageError(f"fill must be one of {', '.join(FILLS)}, not {fill}")
    sizes = parse_at(at)
    check_at_names(sizes, art.manifest.dim_vars, art.source)
    leaves = _leaves(art, what)
    # The names to size, not the dims they make: ``2*b1`` asks for --at b1=SIZE.
    dims = {str(d) for leaf in leaves for d in leaf.shape if eval_dim(d, sizes) is None}
    unsized = sorted({n for d in dims for n in names(parse(d))} - set(sizes)) or sorted(dims)
    if unsized:
        example = ",".join(f"{n}=4" for n in unsized)
        raise UsageError(
            f"{art.source}: the {what} have symbolic dims {', '.join(unsized)}; give their sizes with --at {example}"
        )
    rng = np.random.default_rng(seed)
    out = {}
    for leaf in leaves:
        shape = concrete_shape(leaf.shape, sizes)
        assert shape is not None, leaf.key  # every dim is sized: checked above
        out[leaf.key] = _fill(leaf, shape, fill, rng)
    return out


def save_template(
    path: str | os.PathLike,
    artifact: Artifact | str | os.PathLike,
    what: str = "inputs",
    at: Mapping[str, int] | Sequence[str] | None = None,
    fill: str = "zeros",
    seed: int = 0,
    fsync: bool = False,
) -> dict[str, np.ndarray]:
    """Write ``template(...)`` to ``path`` (``.npz`` or ``.msgpack``, atomically) and return it.

    Args:
        path: The file to write.
        artifact: The artifact, or the path of its file.
        what: ``"inputs"`` or ``"cotangents"``.
        at: Sizes of the symbolic dims; ``None`` when there are none.
        fill: ``"zeros"``, ``"ones"`` or ``"normal"``.
        seed: The random seed for ``fill="normal"``.
        fsync: Whether to flush the file to disk before returning.

    Returns:
        The arrays written, by flat key.

    Raises:
        VjpsplitError: As ``template`` raises, and if the file cannot be written.
    """
    art = artifact if isinstance(artifact, Artifact) else load(artifact)
    arrays = template(art, what, at, fill, seed)
    save_arrays(path, arrays, {"kind": f"vjpsplit-{what}", "fingerprint": art.manifest.fingerprint}, fsync=fsync)
    return arrays


__all__ = ["template", "save_template", "WHAT", "FILLS"]
