"""The optimizer as a portable program: one stage's optax ``init`` and ``update`` exported with ``jax.export``.

``export_optimizer(optax_tx, param_specs)`` runs where optax is installed (the
driver); the ``OptimizerProgram`` it returns travels as bytes (``to_bytes``) and
runs, after ``load_optimizer``, in a process that imports neither optax nor the
user's code: a pipeline worker applies the update where the parameters live.

A stage's parameters are a flat ``{leaf key: array}`` mapping (the keys a
``Stages`` object names; any pytree of specs is flattened to its file keys).
``init(params) -> state`` and ``update(params, state, grads, scale) -> (params,
state)`` take and give flat mappings too: the optimizer state is the file-keyed
leaves of optax's state pytree (``0/mu/w``, ``0/count``), and its structure is
recorded as those keys, never pickled. ``scale`` multiplies the gradients before
the optimizer sees them: the global-norm clipping of ``pipeline.clipping``.

The serialized form is a msgpack map (no pickle): the leaves' keys, dtypes,
shapes and shardings, and the two modules. Loading checks the modules as
artifacts are checked (signatures against the recorded leaves, no host
callbacks, no unvetted kernels) before anything compiles.

On a sharded stage (specs with ``NamedSharding``s) the programs keep the state
sharded as the parameters are: a state leaf named ``.../<param key>`` with that
parameter's shape (optax's ``mu``, ``nu``, ``trace``) takes its sharding; other
state leaves (step counts) are replicated.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import jax
import msgpack
import numpy as np
from jax import export as jexport
from jax.sharding import NamedSharding, PartitionSpec

from ...artifact.sharding import host_mesh, mesh_axes, mesh_of, named, place, spec_from_json, spec_to_json
from ...errors import VjpsplitError, first_line, jax_message
from ...files.dtypes import dtype_from_name, dtype_name
from ...files.prng import data_struct, from_data, impl_name, is_key, to_data
from ...files.trees import escape_segment, flatten_with_keys
from ...trust import checks as _trust_mod
from ...trust import custom_calls, probes

MAGIC = "vjpsplit-optimizer"
FORMAT = 1


@dataclasses.dataclass(frozen=True)
class OptLeaf:
    """One parameter or state leaf of an optimizer program: key, dtype name, shape, sharding, PRNG impl."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    sharding: tuple | None = None
    prng_impl: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "sharding": self.sharding,
            "prng_impl": self.prng_impl,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> OptLeaf:
        sh = d.get("sharding")
        return cls(
            str(d["key"]),
            str(d["dtype"]),
            tuple(int(n) for n in d["shape"]),
            None if sh is None else spec_from_json(sh),
            str(d.get("prng_impl") or ""),
        )

    def struct(self) -> jax.ShapeDtypeStruct:
        """The leaf as its module sees it (key data for a typed key)."""
        return jax.ShapeDtypeStruct(self.shape, dtype_from_name(self.dtype))


def optimizer_name(tx: Any) -> str:
    """A name for messages: the optax factory that built ``tx`` (``chain``, ``scale_by_adam``), or its type."""
    init = getattr(tx, "init", None)
    qual = getattr(init, "__qualname__", "") or type(tx).__name__
    return qual.split(".<locals>")[0]


def checked_name(tx: Any) -> str:
    """``optimizer_name(tx)``, once ``tx`` is an optax ``GradientTransformation`` (else one error saying so)."""
    label = optimizer_name(tx)
    if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
        raise VjpsplitError(
            f"optimizer {label!r} is not an optax GradientTransformation (init and update); pass one, e.g. optax.adamw(1e-3)"
        )
    return label


def flat_specs(specs: Any) -> dict[str, Any]:
    """``{leaf key: spec}``: a flat mapping of leaves is taken as it is, any other pytree flattened to file keys."""
    if isinstance(specs, Mapping) and all(hasattr(v, "shape") and hasattr(v, "dtype") for v in specs.values()):
        return {str(k): v for k, v in specs.items()}
    return dict(flatten_with_keys("", specs))


def _leaf(key: str, s: Any, spec: tuple[Any, ...] | None) -> OptLeaf:
    impl = ""
    if is_key(s):
        impl, s = impl_name(s), data_struct(s)
    return OptLeaf(key, dtype_name(s.dtype), tuple(int(d) for d in s.shape), spec, impl)


def _state_specs(state_entries: Sequence[tuple[str, Any]], params: Sequence[OptLeaf]) -> list[tuple[Any, ...]]:
    """A state leaf mirroring a parameter (``.../<key>``, same shape) takes its spec; the rest are replicated."""
    out = []
    for k, s in state_entries:
        spec = ()
        for p in params:
            if k.endswith("/" + escape_segment(p.key)) and tuple(s.shape) == p.shape:
                spec = p.sharding or ()
                break
        out.append(spec)
    return out


class _Flat:
    """optax's init and update over flat leaf lists (keys in a fixed order): what the modules compute."""

    def __init__(self, tx: Any, param_keys: Sequence[str]):
        self.tx, self.keys = tx, list(param_keys)
        self.state_tree: Any = None
        self.state_impls: list[str] = []

    def tree(self, leaves: Sequence[Any]) -> dict[str, Any]:
        return dict(zip(self.keys, leaves))

    def init(self, params: Sequence[Any]) -> list[Any]:
        state = self.tx.init(self.tree(params))
        leaves, self.state_tree = jax.tree_util.tree_flatten(state)
        return [to_data(x) for x in leaves]

    def update(
        self, params: Sequence[Any], state: Sequence[Any], grads: Sequence[Any], scale: Any
    ) -> tuple[list[Any], list[Any]]:
        import optax

        state = self.state_tree.unflatten([from_data(x, i or None) for x, i in zip(state, self.state_impls)])
        p = self.tree(params)
        g = {k: v * scale.astype(v.dtype) for k, v in self.tree(grads).items()}
        updates, new_state = self.tx.update(g, state, p)
        new_p = optax.apply_updates(p, updates)
        return [new_p[k] for k in self.keys], [to_data(x) for x in jax.tree_util.tree_leaves(new_state)]


def export_optimizer(
    tx: Any, param_specs: Any, *, platforms: Sequence[str] | str = ("cpu", "cuda", "tpu"), name: str | None = None
) -> "OptimizerProgram":
    """Export optax ``tx``'s ``init`` and applied ``update`` for one stage's parameters (``param_specs``).

    ``param_specs``: ShapeDtypeStructs (or arrays), possibly with ``NamedSharding``s of one
    mesh, as a flat ``{leaf key: spec}`` mapping or any pytree. A transformation that is not
    an optax ``GradientTransformation``, or whose state is not a pytree of arrays, or whose
    code ``jax.export`` refuses, is one ``VjpsplitError`` naming it.
    """
    own_name = checked_name(tx)
    label = name or own_name
    platforms = (platforms,) if isinstance(platforms, str) else tuple(platforms)
    specs = flat_specs(param_specs)
    named_ = {k: s.sharding for k, s in specs.items() if isinstance(getattr(s, "sharding", None), NamedSharding)}
    mesh = mesh_of(list(named_.values()))
    params = tuple(
        _leaf(k, s, None if mesh is None else spec_to_json(named_[k].spec) if k in named_ else ())
        for k, s in specs.items()
    )
    if any(p.prng_impl for p in params):
        raise VjpsplitError(
            f"optimizer {label!r}: parameter '{next(p.key for p in params if p.prng_impl)}' is a PRNG key; only arrays are trained"
        )
    flat = _Flat(tx, [p.key for p in params])
    pstructs = [p.struct() for p in params]
    try:
        raw = jax.eval_shape(tx.init, flat.tree(pstructs))
        entries = flatten_with_keys("", raw)
    except VjpsplitError:
        raise
    except Exception as e:
        raise VjpsplitError(
            f"cannot export the optimizer {label!r}: its init fails on the stage's parameters ({jax_message(e)}); "
            "its state must be a pytree of arrays, and a pytree it was built with for the whole model's parameters "
            "(a mask, multi_transform's labels) must be a function of the parameters instead (e.g. "
            "mask=lambda params: ...), since each stage's optimizer sees only that stage's share of them"
        ) from e
    specs_state = _state_specs(entries, params) if mesh is not None else [None] * len(entries)
    state = tuple(_leaf(k, s, None if sp is None else tuple(sp)) for (k, s), sp in zip(entries, specs_state))
    flat.state_tree, flat.state_impls = jax.tree_util.tree_structure(raw), [s.prng_impl for s in state]
    sstructs = [s.struct() for s in state]
    scale = jax.ShapeDtypeStruct((), np.float32)
    sh = None
    if mesh is not None:
        ps = [NamedSharding(mesh, PartitionSpec(*(p.sharding or ()))) for p in params]
        ss = [NamedSharding(mesh, PartitionSpec(*(s.sharding or ()))) for s in state]
        rep = NamedSharding(mesh, PartitionSpec())
        sh = {"init": ((ps,), ss), "update": ((ps, ss, ps, rep), (ps, ss))}
    modules = {}
    for module, fn, args in (
        ("init", flat.init, (pstructs,)),
        ("update", flat.update, (pstructs, sstructs, pstructs, scale)),
    ):
        kw: dict[str, Any] = {} if sh is None else {"in_shardings": sh[module][0], "out_shardings": sh[module][1]}
        try:
            exp = jexport.export(jax.jit(fn, **kw), platforms=platforms)(*args)
        except Exception as e:
            raise VjpsplitError(
                f"cannot export the optimizer {label!r}: jax.export refuses its {module} ({jax_message(e)}); use a transformation written in jax.numpy, without host callbacks"
            ) from e
        modules[module] = bytes(exp.serialize())
    axes = mesh_axes(mesh) if mesh is not None else ()
    return OptimizerProgram(label, params, state, axes, modules, source=f"optimizer {label!r}", check=False)


class OptimizerProgram:
    """One stage's optimizer: ``init`` and ``update`` as exported modules over flat ``{key: array}`` mappings."""

    def __init__(
        self,
        name: str,
        params: Sequence[OptLeaf],
        state: Sequence[OptLeaf],
        mesh: Sequence[tuple[str, int]],
        modules: Mapping[str, bytes],
        *,
        source: str = "optimizer",
        check: bool = True,
        devices: Any = None,
    ):
        self.name, self.source = name, source
        self.param_leaves, self.state_leaves = tuple(params), tuple(state)
        self.mesh_axes = tuple((str(a), int(n)) for a, n in mesh)
        self.modules = dict(modules)
        if set(self.modules) != {"init", "update"}:
            raise VjpsplitError(
                f"{source}: needs the modules init and update, has {sorted(self.modules)}; export it again"
            )
        exps = {}
        for k, data in self.modules.items():
            try:
                exps[k] = jexport.deserialize(bytearray(data))
            except Exception as e:
                raise VjpsplitError(
                    f"{source}: cannot read its {k} module ({first_line(e)}); export it again with this jax"
                ) from e
        if check:
            self._check(exps)
        self._exps = exps
        self._calls = {k: jax.jit(e.call) for k, e in exps.items()}
        self.mesh = host_mesh(self.mesh_axes, devices, source) if self.mesh_axes else None

    def _check(self, exps: Mapping[str, Any]) -> None:
        """What loading an artifact checks: signatures against the recorded leaves, custom calls."""
        found = probes.probe_modules({k: e.mlir_module_serialized for k, e in exps.items()}, self.source)
        p = _trust_mod.expected_leaves(self.param_leaves)
        s = _trust_mod.expected_leaves(self.state_leaves)
        want = {"init": (p, s), "update": (p + s + p + [("float32", ())], p + s)}
        for module, exp in exps.items():
            info = found.get(module) or {}
            _trust_mod.check_avals(self.source, module, exp, *want[module], info.get("main"))
            custom_calls.check_calls(
                self.source, module, info.get("calls", ()), trusted_signer=False, allow_kernels=False
            )

    @property
    def param_keys(self) -> list[str]:
        """The stage's parameter keys, in the modules' order."""
        return [p.key for p in self.param_leaves]

    @property
    def state_keys(self) -> list[str]:
        """The optimizer state's leaf keys (its structure, as data)."""
        return [s.key for s in self.state_leaves]

    def on_devices(self, devices: Any) -> OptimizerProgram:
        """This program on ``devices`` (a sharded stage's device group); unsharded: self."""
        if not self.mesh_axes:
            return self
        other = OptimizerProgram.__new__(OptimizerProgram)
        other.__dict__.update(self.__dict__)
        other.mesh = host_mesh(self.mesh_axes, devices, self.source)
        return other

    def _args(self, leaves: Sequence[OptLeaf], values: Mapping[str, Any], what: str) -> list:
        keys = [leaf.key for leaf in leaves]
        if set(values) != set(keys):
            extra, missing = sorted(set(values) - set(keys)), sorted(set(keys) - set(values))
            raise VjpsplitError(
                f"{self.source}: {what} "
                + (f"lack {missing[0]!r}" if missing else f"have an unknown key {extra[0]!r}")
                + f"; pass exactly the keys {keys[:4]}{'...' if len(keys) > 4 else ''}"
            )
        out = []
        for leaf in leaves:
            v = to_data(values[leaf.key])
            if tuple(np.shape(v)) != leaf.shape or np.dtype(v.dtype) != np.dtype(dtype_from_name(leaf.dtype)):
                raise VjpsplitError(
                    f"{self.source}: {what} '{leaf.key}' is {v.dtype}{list(np.shape(v))}, the program takes {leaf.dtype}{list(leaf.shape)}"
                )
            out.append(place(v, named(self.mesh, leaf.sharding)) if self.mesh is not None else v)
        return out

    def _state_out(self, leaves: Sequence[Any]) -> dict[str, Any]:
        return {s.key: from_data(v, s.prng_impl or None) for s, v in zip(self.state_leaves, leaves)}

    def init(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """The optimizer state for ``params`` (``{key: array}``), as ``{state key: array}``."""
        out = self._calls["init"](self._args(self.param_leaves, params, "parameters"))
        _trust_mod.check_outputs(self.source, "init", jax.tree_util.tree_leaves(out), self._exps["init"], {})
        return self._state_out(out)

    def update(
        self, params: Mapping[str, Any], state: Mapping[str, Any], grads: Mapping[str, Any], scale: float = 1.0
    ) -> tuple[dict, dict]:
        """One optimizer step on ``grads * scale``: ``(new params, new state)``, keyed as given."""
        s = np.float32(scale)
        if self.mesh is not None:
            s = place(s, named(self.mesh, ()))
        args = (
            self._args(self.param_leaves, params, "parameters"),
            self._args(self.state_leaves, state, "optimizer state"),
            self._args(self.param_leaves, grads, "gradients"),
            s,
        )
        new_p, new_s = self._calls["update"](*args)
        _trust_mod.check_outputs(self.source, "update", [*new_p, *new_s], self._exps["update"], {})
        return dict(zip(self.param_keys, new_p)), self._state_out(new_s)

    def to_bytes(self) -> bytes:
        """The program as msgpack bytes (no pickle): what a worker loads with ``load_optimizer``."""
        top = {
            "magic": MAGIC,
            "format": FORMAT,
            "name": self.name,
            "jax_version": jax.__version__,
            "mesh": [list(a) for a in self.mesh_axes],
            "params": [p.to_json() for p in self.param_leaves],
            "state": [s.to_json() for s in self.state_leaves],
            "modules": self.modules,
        }
        return msgpack.packb(top, use_bin_type=True)


def load_optimizer(data: bytes, *, source: str = "optimizer", devices: Any = None) -> OptimizerProgram:
    """An ``OptimizerProgram`` from ``to_bytes`` output, checked before anything compiles; optax is not needed."""
    try:
        top = msgpack.unpackb(bytes(data), raw=False, strict_map_key=True)
        if not isinstance(top, dict) or top.get("magic") != MAGIC:
            raise ValueError("not an optimizer program")
        if top.get("format") != FORMAT:
            raise VjpsplitError(
                f"{source}: optimizer program format {top.get('format')!r}, this vjpsplit reads {FORMAT}; export it again"
            )
        params = [OptLeaf.from_json(d) for d in top["params"]]
        state = [OptLeaf.from_json(d) for d in top["state"]]
        mesh = [(str(a), int(n)) for a, n in top["mesh"]]
        modules = {str(k): bytes(v) for k, v in top["modules"].items()}
    except VjpsplitError:
        raise
    except Exception as e:
        raise VjpsplitError(
            f"{source}: is not a vjpsplit optimizer program ({first_line(e)}); pass the bytes OptimizerProgram.to_bytes wrote"
        ) from e
    return OptimizerProgram(
        str(top.get("name", "optimizer")), params, state, mesh, modules, source=source, devices=devices
    )


def stage_programs(
    optimizer: Any, artifacts: Sequence[Any], names: Sequence[Sequence[str]], placed: Sequence[Any]
) -> list[bytes]:
    """Each stage's exported optimizer as bytes, its specs from the stage's (placed) parameters keyed by ``names``."""
    out = []
    for art, n, p in zip(artifacts, names, placed):
        specs = {
            k: jax.ShapeDtypeStruct(np.shape(v), v.dtype, sharding=v.sharding if art.manifest.sharded else None)
            for k, v in zip(n, jax.tree_util.tree_leaves(p))
        }
        out.append(export_optimizer(optimizer, specs, platforms=art.manifest.platforms).to_bytes())
    return out
