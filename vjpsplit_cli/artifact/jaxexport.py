"""Calls into ``jax.export``: lowering with errors that name the failing platform, and the sharding probes.

``lower`` exports one module (refusing what it cannot serialize in one line);
``Sharded`` holds an export's mesh and asks XLA which shardings it picks for the
values no spec fixes; ``platforms_of`` checks the ``--platforms`` list and
``refuse_host_callbacks`` the host callbacks ``jax.export`` cannot serialize.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence

import jax
from jax import export as jexport
from jax.sharding import Mesh, NamedSharding, PartitionSpec

if TYPE_CHECKING:
    from jax.sharding import AbstractMesh

from ..errors import VjpsplitError, first_line, jax_message
from ..files.shapes import concrete_shape, dim_str
from ..files.sizes import parse_at
from ..tracing.jaxprs import iter_eqns
from .sharding import mesh_axes

KNOWN_PLATFORMS = ("cpu", "cuda", "rocm", "tpu")


_CALLBACK_PRIMITIVES = ("debug_callback", "debug_print", "pure_callback", "io_callback", "callback")


def _host_callbacks(jaxpr: Any) -> list[str]:
    """Names of host-callback primitives anywhere in ``jaxpr`` (sub-jaxprs included)."""
    return [e.primitive.name for e in iter_eqns(jaxpr) if e.primitive.name in _CALLBACK_PRIMITIVES]


def refuse_host_callbacks(fn: Callable, structs: Sequence[Any]) -> None:
    """jax.export cannot serialize host callbacks: say so before lowering fails obscurely."""
    try:
        jaxpr = jax.make_jaxpr(fn)(*structs)
    except Exception:
        return  # tracing errors surface, with context, from the export itself
    found = _host_callbacks(jaxpr)
    if found:
        raise VjpsplitError(
            f"cannot export {getattr(fn, '__name__', 'the function')}: it uses {sorted(set(found))[0]} "
            "(jax.debug.print, jax.debug.callback or another host callback), which jax.export cannot "
            "serialize; remove them before exporting"
        )


def lower(
    what: str, fn: Callable, platforms: tuple[str, ...], args: Sequence, shardings: tuple[Any, Any] | None = None
) -> jexport.Exported:
    """``jax.export`` with errors that say what went wrong and, if one platform failed, which.

    ``shardings`` is ``(in_shardings, out_shardings)`` for a sharded artifact.
    """
    jit_kw = {} if shardings is None else {"in_shardings": shardings[0], "out_shardings": shardings[1]}
    try:
        return jexport.export(jax.jit(fn, **jit_kw), platforms=platforms)(*args)
    except NotImplementedError as e:  # host callbacks were refused before tracing (refuse_host_callbacks)
        raise VjpsplitError(f"cannot export the {what}: {first_line(e)}") from e
    except VjpsplitError:
        raise
    except Exception as e:
        failing = []
        if len(platforms) > 1:
            for p in platforms:
                try:
                    jexport.export(jax.jit(fn, **jit_kw), platforms=(p,))(*args)
                except Exception:
                    failing.append(p)
        where = f" for platform(s) {', '.join(failing)}" if failing and len(failing) < len(platforms) else ""
        hint = f"; drop them with --platforms {','.join(p for p in platforms if p not in failing)}" if where else ""
        raise VjpsplitError(f"cannot export the {what}{where}: {jax_message(e)}{hint}") from e


class Sharded:
    """One export's shardings: the mesh, and probes of the shardings XLA chooses for outputs.

    XLA picks the layout of values that no spec fixes (residuals, intermediates)
    when it compiles. A probe lowers the module for this host's platform with
    those outputs unspecified, compiles it at concrete sizes (symbolic dims from
    ``at``, else a multiple of the device count, which every mesh axis divides)
    and reads what XLA chose; the real export then fixes exactly that, so the
    backward takes residuals as the forward leaves them.
    """

    def __init__(self, mesh: Mesh | AbstractMesh, dim_vars: Sequence[str], at: Any) -> None:
        self.mesh = mesh
        self.axes = mesh_axes(mesh)
        self.nr_devices = int(mesh.devices.size)
        given = parse_at(at)
        self.probe_dims = {n: given.get(n, 4 * self.nr_devices) for n in dim_vars}
        d = jax.devices()[0]
        self.platform = "cuda" if d.platform == "gpu" else d.platform

    def shardings(self, specs: Any) -> Any:
        """NamedShardings for a pytree of PartitionSpecs (``None``, unspecified, stays None)."""
        return jax.tree_util.tree_map(
            lambda sp: None if sp is None else NamedSharding(self.mesh, sp), specs, is_leaf=is_spec
        )

    def probe(self, what: str, fn: Callable, args: Sequence[Any], in_specs: Any, out_specs: Any) -> list:
        """The spec of every output of ``fn``: ``out_specs``'s where given, XLA's choice where None."""
        exp = lower(what, fn, (self.platform,), args, (self.shardings(in_specs), self.shardings(out_specs)))
        flat_args = jax.tree_util.tree_leaves(args)
        flat_specs = jax.tree_util.tree_leaves(in_specs, is_leaf=is_spec)
        concrete = []
        for a, sp in zip(flat_args, flat_specs):
            shape = concrete_shape(tuple(dim_str(d) for d in a.shape), self.probe_dims)
            if shape is None:
                raise VjpsplitError(
                    f"cannot size {format_struct(a)} to find the shardings XLA picks for the {what}; "
                    f"pass at= (--at NAME=SIZE) for {', '.join(self.probe_dims) or 'its dims'}"
                )
            concrete.append(jax.ShapeDtypeStruct(shape, a.dtype, sharding=NamedSharding(self.mesh, sp)))
        tree = jax.tree_util.tree_structure(args)
        compiled = jax.jit(exp.call).lower(*jax.tree_util.tree_unflatten(tree, concrete)).compile()
        return [
            o.spec if isinstance(o, NamedSharding) else None
            for o in jax.tree_util.tree_leaves(compiled.output_shardings)
        ]


def is_spec(x: Any) -> bool:
    """A PartitionSpec, or None (a value no spec fixes): the leaves of a specs pytree."""
    return x is None or isinstance(x, PartitionSpec)


def format_struct(a: Any) -> str:
    """``f32[b,4]``: an array or struct's dtype and (symbolic) shape, for messages."""
    return f"{a.dtype}[{','.join(str(d) for d in a.shape)}]"


def platforms_of(platforms: Sequence[str] | str) -> tuple[str, ...]:
    """``"cpu,cuda"`` or a sequence of names, checked: at least one, each one jax.export knows."""
    if isinstance(platforms, str):
        platforms = tuple(p.strip() for p in platforms.split(",") if p.strip())
    try:
        platforms = tuple(platforms)
    except TypeError:
        raise VjpsplitError(
            f"platforms={platforms!r} is not a list of platform names; pass e.g. 'cpu,cuda,tpu' or ['cpu']"
        ) from None
    for p in platforms:
        if p not in KNOWN_PLATFORMS:
            raise VjpsplitError(f"unknown platform {p!r}; use some of {', '.join(KNOWN_PLATFORMS)}")
    if not platforms:
        raise VjpsplitError("no platforms given; use e.g. cpu,cuda,tpu")
    return platforms
