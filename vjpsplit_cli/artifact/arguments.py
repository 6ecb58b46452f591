"""The caller's arrays against a manifest: arguments flattened to file keys, arrays checked, gradients rebuilt.

``flatten_args`` turns argument pytrees into ``{file key: array}`` (typed PRNG keys
checked and made key data); ``check_array`` and ``check_keys`` hold arrays and key
sets to the manifest's leaves at run time; ``solved_dims`` works out the symbolic dims
that appear only inside expressions from the arrays' sizes; ``recorded_dims`` reads the dims a
residuals file records; ``grads_per_arg`` rebuilds per-argument gradient pytrees.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Protocol, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..errors import VjpsplitError
from ..files import keys
from ..files.dims import needs_solving, solve_shapes
from ..files.dtypes import dtype_from_name
from ..files.prng import impl_name, is_key, to_data
from ..files.shapes import bind_dims, concrete_shape, format_shape
from ..files.trees import ArgTrees, decode_structure, flatten_with_keys, structure_keys
from ..safeio.system import host_memory


# The manifest's Leaf and Manifest as read here. ``manifest`` still re-exports this module's
# functions for the modules that import them from there, so this module cannot import it back.
class LeafLike(Protocol):
    """What these checks read of a manifest ``Leaf``."""

    @property
    def key(self) -> str: ...
    @property
    def dtype(self) -> str: ...
    @property
    def shape(self) -> tuple[int | str, ...]: ...
    @property
    def prng_impl(self) -> str: ...
    @property
    def key_shape(self) -> tuple[int | str, ...]: ...
    def describe(self) -> str: ...


class ManifestLike(Protocol):
    """What these checks read of a ``Manifest``."""

    @property
    def arg_names(self) -> tuple[str, ...]: ...
    @property
    def dim_vars(self) -> tuple[str, ...]: ...
    @property
    def inputs(self) -> Sequence[LeafLike]: ...
    @property
    def grads(self) -> Sequence[LeafLike]: ...
    @property
    def intermediates(self) -> Sequence[LeafLike]: ...
    @property
    def structure(self) -> Mapping[str, Any]: ...


def flatten_args(
    manifest: ManifestLike | None, args: Sequence, source: str = "args", arg_names: Sequence[str] = ()
) -> tuple[dict[str, Any], tuple]:
    """The caller's argument pytrees as ``{file key: array}`` plus their structure.

    Typed PRNG keys become their key data, after checking the impl against the
    manifest; every refusal names the leaf by its key. Without a manifest the
    arguments are named by ``arg_names`` and keys are not checked.
    """
    specs = {leaf.key: leaf for leaf in manifest.inputs} if manifest is not None else None
    flat: dict[str, Any] = {}
    trees = []
    for name, arg in zip(manifest.arg_names if manifest is not None else arg_names, args):
        entries = flatten_with_keys(name, arg)
        trees.append((name, jax.tree_util.tree_structure(arg), tuple(k for k, _ in entries)))
        for key, value in entries:
            if specs is None:
                flat[key] = to_data(value)
                continue
            leaf = specs.get(key)
            if is_key(value):
                if leaf is None or not leaf.prng_impl:
                    want = f"expected {leaf.describe()}" if leaf is not None else "not an input of the artifact"
                    raise VjpsplitError(
                        f"{source}: input '{key}': got a typed PRNG key ({value.dtype}), {want}; "
                        "pass jax.random.key_data(key) for a legacy uint32 key"
                    )
                got = impl_name(value)
                if got != leaf.prng_impl:
                    raise VjpsplitError(
                        f"{source}: input '{key}': expected a {leaf.prng_impl} key, got a {got} key; "
                        f"make it with jax.random.key(seed, impl='{leaf.prng_impl}')"
                    )
                value = to_data(value)
            flat[key] = value
    return flat, tuple(trees)


def _weak_scalar_fits(value: Any, want: np.dtype) -> bool:
    if isinstance(value, bool):
        return want == np.bool_
    if isinstance(value, int):
        return want.kind in "iufc"
    if isinstance(value, float):
        return want.kind in "fc" or jnp.issubdtype(want, jnp.floating)
    if isinstance(value, complex):
        return want.kind == "c"
    return False


def as_computed(value: Any, want: Any) -> Any:
    """``value`` as an artifact computes on it: a Python scalar (weakly typed in JAX) takes the dtype ``want``."""
    want = np.dtype(want)
    return np.asarray(value, want) if _weak_scalar_fits(value, want) else value


def as_input(leaf: Any) -> Any:
    """An input-backed residual's leaf named by its input key (``in/x`` -> ``x``), as messages name it."""
    return dataclasses.replace(leaf, key=keys.input_of(leaf.key))


def check_array(source: str, what: str, leaf: LeafLike, value: Any, dims: dict[str, int]) -> Any:
    """``value`` as an array of ``leaf``'s dtype and shape, binding dims; else a clear error."""
    want = dtype_from_name(leaf.dtype)
    value = as_computed(value, want)
    a = value if hasattr(value, "dtype") and hasattr(value, "shape") else np.asarray(value)
    got = np.dtype(a.dtype)
    if got != want:
        # npz written by plain numpy holds bfloat16 & co. as raw void of the same width.
        if got.kind == "V" and got.itemsize == want.itemsize and not got.fields and isinstance(a, np.ndarray):
            a = a.view(want)
        else:
            raise VjpsplitError(
                f"{source}: {what} '{leaf.key}': expected {leaf.describe()}, got {format_shape(got, a.shape)}; "
                "write it with the expected dtype (no implicit casting)"
            )
    shape = tuple(int(d) for d in a.shape)
    ok = bind_dims(f"{source}: {what} '{leaf.key}'", leaf.shape, shape, dims)
    conc = concrete_shape(leaf.shape, dims) if ok else None
    if not ok or (conc is not None and conc != shape):
        bound = ", ".join(f"{k}={v}" for k, v in dims.items())
        raise VjpsplitError(
            f"{source}: {what} '{leaf.key}': expected {leaf.describe()}"
            f"{f' (with {bound})' if bound else ''}, got {format_shape(got, shape)}"
        )
    return a


def solved_dims(source: str, what: str, leaves: Sequence[LeafLike], values: Sequence[Any]) -> dict[str, int]:
    """The symbolic dims of ``leaves`` solved from ``values``' sizes, where some appears only inside expressions.

    ``{}`` when every name is some leaf's plain dim (``check_array`` binds those, one
    leaf at a time); see ``files.dims.solve_shapes``.
    """
    if not needs_solving(tuple(leaf.shape for leaf in leaves)):  # the common case: no array's shape is read here
        return {}
    return solve_shapes(
        [(f"{source}: {what} '{leaf.key}'", leaf.shape, np.shape(v)) for leaf, v in zip(leaves, values)]
    )


def check_keys(
    source: str, what: str, expected: Sequence[str], given: Mapping[str, Any], allow_extra: bool = False
) -> None:
    """Refuse missing keys and (unless ``allow_extra``) unknown ones, naming them and the expected set."""
    missing = [k for k in expected if k not in given]
    if missing:
        raise VjpsplitError(
            f"{source}: missing {what} key{'s' if len(missing) > 1 else ''} {', '.join(repr(k) for k in missing)}; "
            f"expected keys: {', '.join(expected) or '(none)'}"
        )
    if not allow_extra:
        extra = [k for k in given if k not in expected]
        if extra:
            raise VjpsplitError(
                f"{source}: unknown {what} key{'s' if len(extra) > 1 else ''} {', '.join(repr(k) for k in extra)}; "
                f"expected keys: {', '.join(expected) or '(none)'}"
            )


def recorded_dims(
    manifest: ManifestLike, recorded: Mapping[str, Any], source: str, what: str, fix: str
) -> dict[str, int]:
    """The symbolic dims a residuals or intermediates file (``what``) records: each >= 1, all within memory.

    Dim sizes read from a file bound what the backward allocates. A dim that no
    stored residual mentions is checked against nothing else, so an edited file
    could otherwise ask for any amount of memory: refuse what no host could hold.
    """
    dims = {}
    for name in manifest.dim_vars:
        v = recorded.get(name)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise VjpsplitError(f"{source}: symbolic dim {name!r} is missing or invalid in the {what}; {fix}")
        dims[name] = v
    total = 0
    for leaf in (*manifest.grads, *manifest.intermediates):
        shape = concrete_shape(leaf.shape, dims)
        if shape is not None:
            total += int(np.prod(shape, dtype=object)) * dtype_from_name(leaf.dtype).itemsize
    limit = host_memory()
    if total > limit:
        bound = ", ".join(f"{k}={v}" for k, v in dims.items())
        raise VjpsplitError(
            f"{source}: the recorded dims ({bound}) would make the backward's results {total / 2**30:.1f} GiB, "
            f"more than this host's {limit / 2**30:.1f} GiB of memory; the residuals metadata is corrupt, "
            "rerun the forward"
        )
    return dims


def grads_per_arg(
    manifest: ManifestLike,
    grads: Mapping[str, Any],
    names: Sequence[str],
    dims: Mapping[str, int],
    arg_trees: ArgTrees = (),
) -> dict[str, Any]:
    """Flat gradient keys -> per-argument pytrees (float0 zeros for integer leaves).

    With ``arg_trees`` (from ``fwd``'s arguments) each gradient has the caller's
    own pytree type; otherwise the manifest's structure (user classes as dicts).
    """
    known = {name: (treedef, keys) for name, treedef, keys in arg_trees}

    def zeros(k: str) -> Any:  # an integer input's gradient
        leaf = next(leaf for leaf in manifest.inputs if leaf.key == k)
        return np.zeros(concrete_shape(leaf.key_shape, dims), jax.dtypes.float0)

    out = {}
    for name in names:
        if name in known:
            treedef, keys = known[name]
            out[name] = treedef.unflatten([grads[k] if k in grads else zeros(k) for k in keys])
        else:
            arg_keys = structure_keys(name, manifest.structure["args"][name])
            values = (grads[k] if k in grads else zeros(k) for k in arg_keys)
            out[name] = decode_structure(manifest.structure["args"][name], values)
    return out
