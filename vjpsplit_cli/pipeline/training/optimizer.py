"""The optimizer as a portable program: one stage's optax ``init`` and ``update`` exported with ``jax.export``.

``export_optimizer(optax_tx, param_specs)`` runs where optax is installed (the
driver); the ``OptimizerProgram`` it returns travels as bytes (``to_bytes``) and
runs, after ``load_optimizer``, in a process that imports neither optax nor the
user's code: a pipeline worker applies the update where the parameters live.

A stage's parameters are a flat ``{leaf key: array}`` mapping (the keys a
``Stages`` object names; any pytree of specs is flattened to its file keys).
``init(params) -> state`` and ``update(params, state, grads, scale, value,
reduced) -> (params, state)`` take and give flat mappings too: the optimizer state
is the file-keyed leaves of optax's state pytree (``0/mu/w``, ``0/count``), and its
structure is recorded as those keys, never pickled. ``scale`` multiplies the
gradients before the optimizer sees them (the global-norm clipping of
``pipeline.clipping``), ``value`` is the step's loss (for an update taking
``value=``), ``reduced`` the optimizer's reductions over leaves joined across
stages, which ``shares(round, ...)`` gives this stage's part of (``separable``:
each stage's programs are its share of the whole model's update).

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
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import jax
import msgpack
import numpy as np
from jax import export as jexport
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jax.typing import ArrayLike

from ...artifact.artifact import Artifact
from ...artifact.sharding import (
    SpecJSON,
    host_mesh,
    mesh_axes,
    mesh_of,
    named,
    place,
    spec_from_json,
    spec_to_json,
)
from ...errors import VjpsplitError, first_line, jax_message
from ...files.dtypes import dtype_from_name, dtype_name
from ...files.prng import data_struct, from_data, impl_name, is_key, to_data
from ...files.trees import escape_segment, flatten_with_keys
from ...trust import checks as _trust_mod
from ...trust import custom_calls, probes
from ...treetypes import Leaf, PyTree
from .separable import StageShare, WholeOptimizer

if TYPE_CHECKING:  # annotations only: optax is an optional extra, needed only where an optimizer is exported
    import optax

MAGIC = "vjpsplit-optimizer"
FORMAT = 2  # 2: the update takes the loss value= and the reductions over leaves; shares/<round> modules


@dataclasses.dataclass(frozen=True)
class OptLeaf:
    """One parameter or state leaf of an optimizer program: key, dtype name, shape, sharding, PRNG impl."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    sharding: SpecJSON | None = None
    prng_impl: str = ""

    def to_json(self) -> dict[str, object]:
        return {
            "key": self.key,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "sharding": self.sharding,
            "prng_impl": self.prng_impl,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> OptLeaf:  # msgpack's output, checked by the reader's except
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


def optimizer_name(tx: object) -> str:
    """A name for messages: the optax factory that built ``tx`` (``chain``, ``scale_by_adam``), or its type."""
    init = getattr(tx, "init", None)
    qual = getattr(init, "__qualname__", "") or type(tx).__name__
    return qual.split(".<locals>")[0]


def checked_name(tx: object) -> str:
    """``optimizer_name(tx)``, once ``tx`` is an optax ``GradientTransformation`` (else one error saying so)."""
    label = optimizer_name(tx)
    if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
        raise VjpsplitError(
            f"optimizer {label!r} is not an optax GradientTransformation (init and update); pass one, e.g. optax.adamw(1e-3)"
        )
    return label


def flat_specs(specs: PyTree) -> dict[str, jax.ShapeDtypeStruct | Leaf]:
    """``{leaf key: spec}``: a flat mapping of leaves is taken as it is, any other pytree flattened to file keys."""
    if isinstance(specs, Mapping) and all(hasattr(v, "shape") and hasattr(v, "dtype") for v in specs.values()):
        return {str(k): v for k, v in specs.items()}
    return dict(flatten_with_keys("", specs))


def _leaf(key: str, s: jax.ShapeDtypeStruct | Leaf, spec: SpecJSON | None) -> OptLeaf:
    impl = ""
    if is_key(s) and not isinstance(s, np.ndarray):  # NumPy has no key dtypes
        impl, s = impl_name(s), data_struct(s)
    return OptLeaf(key, dtype_name(s.dtype), tuple(int(d) for d in s.shape), spec, impl)


def _state_specs(
    state_entries: Sequence[tuple[str, jax.ShapeDtypeStruct]], params: Sequence[OptLeaf]
) -> list[SpecJSON]:
    """A state leaf mirroring a parameter (``.../<key>``, same shape) takes its spec; the rest are replicated."""
    out = []
    for k, s in state_entries:
        spec: SpecJSON = ()
        for p in params:
            if k.endswith("/" + escape_segment(p.key)) and tuple(s.shape) == p.shape:
                spec = p.sharding or ()
                break
        out.append(spec)
    return out


class _Flat:
    """A stage's share of the whole model's init and update (``separable.StageShare``) over flat leaf lists:
    what the modules compute. State leaves arrive as key data and are typed keys again inside."""

    def __init__(self, share: StageShare, state_impls: Sequence[str]):
        self.share, self.state_impls = share, list(state_impls)

    def _state(self, state: Sequence[ArrayLike]) -> list[ArrayLike]:
        return [from_data(x, i or None) for x, i in zip(state, self.state_impls)]

    def init(self, params: Sequence[ArrayLike]) -> list[ArrayLike]:
        return [to_data(x) for x in self.share.init(list(params))]

    def shares(self, rnd: int) -> Callable[..., list[jax.Array]]:
        def fn(
            params: Sequence[ArrayLike],
            state: Sequence[ArrayLike],
            grads: Sequence[ArrayLike],
            scale: ArrayLike,
            value: ArrayLike,
            reduced: Sequence[ArrayLike],
        ) -> list[jax.Array]:
            return self.share.shares(rnd, params, self._state(state), grads, scale, value, reduced)

        return fn

    def update(
        self,
        params: Sequence[ArrayLike],
        state: Sequence[ArrayLike],
        grads: Sequence[ArrayLike],
        scale: ArrayLike,
        value: ArrayLike,
        reduced: Sequence[ArrayLike],
    ) -> tuple[list[ArrayLike], list[ArrayLike]]:
        new_p, new_s = self.share.update(params, self._state(state), grads, scale, value, reduced)
        return list(new_p), [to_data(x) for x in new_s]


def export_optimizer(
    tx: optax.GradientTransformation,
    param_specs: PyTree,
    *,
    platforms: Sequence[str] | str = ("cpu", "cuda", "tpu"),
    name: str | None = None,
    whole: WholeOptimizer | None = None,
    stage: int = 0,
    counted: Sequence[str] | None = None,
) -> "OptimizerProgram":
    """Export optax ``tx``'s ``init`` and applied ``update`` for one stage's parameters (``param_specs``).

    ``param_specs``: ShapeDtypeStructs (or arrays), possibly with ``NamedSharding``s of one
    mesh, as a flat ``{leaf key: spec}`` mapping or any pytree. ``whole``: the whole model's
    traced optimizer (``separable.WholeOptimizer``) of which this is stage ``stage`` (its
    reductions' terms of the ``counted`` keys); without it, the stage is the whole model.

    Raises:
        VjpsplitError: a transformation that is not an optax ``GradientTransformation``, whose
            state is not a pytree of arrays, or whose code ``jax.export`` refuses, naming it.
    """
    own_name = checked_name(tx)
    label = name or own_name
    platforms = (platforms,) if isinstance(platforms, str) else tuple(platforms)
    specs = flat_specs(param_specs)
    named_: dict[str, NamedSharding] = {}
    for k, s in specs.items():
        sharding = getattr(s, "sharding", None)  # a NumPy array has none
        if isinstance(sharding, NamedSharding):
            named_[k] = sharding
    mesh = mesh_of(list(named_.values()))
    params = tuple(
        _leaf(k, s, None if mesh is None else spec_to_json(named_[k].spec) if k in named_ else ())
        for k, s in specs.items()
    )
    if any(p.prng_impl for p in params):
        raise VjpsplitError(
            f"optimizer {label!r}: parameter '{next(p.key for p in params if p.prng_impl)}' is a PRNG key; only arrays are trained"
        )
    keys = [p.key for p in params]
    pstructs = [p.struct() for p in params]
    try:
        raw = jax.eval_shape(tx.init, dict(zip(keys, pstructs)))
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
    if whole is None:
        whole = WholeOptimizer(tx, dict(zip(keys, pstructs)), {k: k for k in keys}, [keys], label)
        stage, counted = 0, None
    specs_state = _state_specs(entries, params) if mesh is not None else [None] * len(entries)
    state = tuple(_leaf(k, s, None if sp is None else tuple(sp)) for (k, s), sp in zip(entries, specs_state))
    flat = _Flat(whole.stage(stage, counted), [s.prng_impl for s in state])
    sstructs = [s.struct() for s in state]
    scale = jax.ShapeDtypeStruct((), np.float32)
    roots = whole.roots()
    reduced = [jax.ShapeDtypeStruct((), r.dtype) for r in roots]
    sh: dict[str, tuple[object, object]] | None = None  # per module: its (in_shardings, out_shardings)
    if mesh is not None:
        ps = [NamedSharding(mesh, PartitionSpec(*(p.sharding or ()))) for p in params]
        ss = [NamedSharding(mesh, PartitionSpec(*(s.sharding or ()))) for s in state]
        rep = NamedSharding(mesh, PartitionSpec())
        rr = [rep] * len(roots)
        sh = {"init": ((ps,), ss), "update": ((ps, ss, ps, rep, rep, rr), (ps, ss))}
        for r in range(whole.rounds):
            sh[f"shares/{r}"] = ((ps, ss, ps, rep, rep, rr), [rep for x in roots if x.round == r])
    upd_args = (pstructs, sstructs, pstructs, scale, scale, reduced)
    jobs: list[tuple[str, Callable[..., object], tuple[object, ...]]] = [
        ("init", flat.init, (pstructs,)),
        ("update", flat.update, upd_args),
    ]
    jobs += [(f"shares/{r}", flat.shares(r), upd_args) for r in range(whole.rounds)]
    modules = {}
    for module, fn, args in jobs:
        jitted = jax.jit(fn) if sh is None else jax.jit(fn, in_shardings=sh[module][0], out_shardings=sh[module][1])
        try:
            exp = jexport.export(jitted, platforms=platforms)(*args)
        except VjpsplitError:
            raise
        except Exception as e:
            raise VjpsplitError(
                f"cannot export the optimizer {label!r}: jax.export refuses its {module} ({jax_message(e)}); use a transformation written in jax.numpy, without host callbacks"
            ) from e
        modules[module] = bytes(exp.serialize())
    axes = mesh_axes(mesh) if mesh is not None else ()
    meta = {
        "reductions": [{"op": r.op, "dtype": dtype_name(np.dtype(r.dtype)), "round": r.round} for r in roots],
        "uses_value": bool(whole.uses_value),
    }
    return OptimizerProgram(
        label,
        params,
        state,
        axes,
        modules,
        source=f"optimizer {label!r}",
        check=False,
        meta=meta,
        abstract=mesh is not None and not isinstance(mesh, Mesh),
    )


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
        devices: Sequence[jax.Device] | None = None,
        meta: Mapping[str, Any] | None = None,  # a program file's fields, read in the try below
        abstract: bool = False,
    ):
        self.name, self.source = name, source
        meta = dict(meta or {})
        try:
            self.reductions = [(str(r["op"]), str(r["dtype"]), int(r["round"])) for r in meta.get("reductions", ())]
            self.uses_value = bool(meta.get("uses_value", False))
        except (KeyError, TypeError, ValueError) as e:
            raise VjpsplitError(f"{source}: its reductions are not readable ({first_line(e)}); export it again") from e
        self.rounds = 1 + max((r for _, _, r in self.reductions), default=-1)
        self.param_leaves, self.state_leaves = tuple(params), tuple(state)
        self.mesh_axes = tuple((str(a), int(n)) for a, n in mesh)
        self.modules = dict(modules)
        want_modules = {"init", "update", *(f"shares/{r}" for r in range(self.rounds))}
        if set(self.modules) != want_modules:
            raise VjpsplitError(
                f"{source}: needs the modules {sorted(want_modules)}, has {sorted(self.modules)}; export it again"
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
        # Exported over an AbstractMesh (``abstract``): no devices here; it runs once loaded onto some.
        self.abstract = bool(abstract and self.mesh_axes)
        self.mesh = host_mesh(self.mesh_axes, devices, source) if self.mesh_axes and not self.abstract else None

    def _check(self, exps: Mapping[str, jexport.Exported]) -> None:
        """What loading an artifact checks: signatures against the recorded leaves, custom calls."""
        found = probes.probe_modules({k: e.mlir_module_serialized for k, e in exps.items()}, self.source)
        p = _trust_mod.expected_leaves(self.param_leaves)
        s = _trust_mod.expected_leaves(self.state_leaves)
        red = [(dt, ()) for _, dt, _ in self.reductions]
        args = p + s + p + [("float32", ()), ("float32", ())] + red
        want = {"init": (p, s), "update": (args, p + s)}
        for r in range(self.rounds):
            want[f"shares/{r}"] = (args, [(dt, ()) for _, dt, rr in self.reductions if rr == r])
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

    def on_devices(self, devices: Sequence[jax.Device]) -> OptimizerProgram:
        """This program on ``devices`` (a sharded stage's device group); unsharded: self."""
        if not self.mesh_axes:
            return self
        other = OptimizerProgram.__new__(OptimizerProgram)
        other.__dict__.update(self.__dict__)
        other.mesh = host_mesh(self.mesh_axes, devices, self.source)
        other.abstract = False
        return other

    def _args(self, leaves: Sequence[OptLeaf], values: Mapping[str, Leaf], what: str) -> list[Leaf]:
        if self.abstract:
            raise VjpsplitError(
                f"{self.source}: exported over an abstract mesh of {dict(self.mesh_axes)}, it has no devices; "
                "run it after load_optimizer(program.to_bytes(), devices=...) or on_devices(...)"
            )
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

    def _state_out(self, leaves: Sequence[jax.Array]) -> dict[str, jax.Array]:
        return {s.key: from_data(v, s.prng_impl or None) for s, v in zip(self.state_leaves, leaves)}

    def init(self, params: Mapping[str, Leaf]) -> dict[str, jax.Array]:
        """The optimizer state for ``params`` (``{key: array}``), as ``{state key: array}``."""
        out = self._calls["init"](self._args(self.param_leaves, params, "parameters"))
        _trust_mod.check_outputs(self.source, "init", jax.tree_util.tree_leaves(out), self._exps["init"], {})
        return self._state_out(out)

    def _call_args(
        self,
        params: Mapping[str, Leaf],
        state: Mapping[str, Leaf],
        grads: Mapping[str, Leaf],
        scale: float,
        value: float,
        reduced: Sequence[ArrayLike],
    ) -> tuple[object, ...]:
        if len(reduced) != len(self.reductions):
            raise VjpsplitError(
                f"{self.source}: takes {len(self.reductions)} reductions over leaves, got {len(reduced)}"
            )
        scalars = [np.float32(scale), np.float32(value)]
        red = [np.asarray(v, dtype_from_name(dt)) for v, (_, dt, _) in zip(reduced, self.reductions)]
        if self.mesh is not None:
            scalars = [place(x, named(self.mesh, ())) for x in scalars]
            red = [place(x, named(self.mesh, ())) for x in red]
        return (
            self._args(self.param_leaves, params, "parameters"),
            self._args(self.state_leaves, state, "optimizer state"),
            self._args(self.param_leaves, grads, "gradients"),
            *scalars,
            red,
        )

    def shares(
        self,
        rnd: int,
        params: Mapping[str, Leaf],
        state: Mapping[str, Leaf],
        grads: Mapping[str, Leaf],
        scale: float = 1.0,
        value: float = 0.0,
        reduced: Sequence[ArrayLike] = (),
    ) -> list[jax.Array]:
        """This stage's shares of the reductions of round ``rnd`` (``reduced``: every reduction's combined
        value so far; the later ones are not read)."""
        return list(self._calls[f"shares/{rnd}"](*self._call_args(params, state, grads, scale, value, reduced)))

    def update(
        self,
        params: Mapping[str, Leaf],
        state: Mapping[str, Leaf],
        grads: Mapping[str, Leaf],
        scale: float = 1.0,
        value: float = 0.0,
        reduced: Sequence[ArrayLike] = (),
    ) -> tuple[dict[str, jax.Array], dict[str, jax.Array]]:
        """One optimizer step on ``grads * scale``: ``(new params, new state)``, keyed as given. ``value``: the
        step's loss (for an update that takes ``value=``); ``reduced``: the reductions over leaves, combined
        over the stages."""
        new_p, new_s = self._calls["update"](*self._call_args(params, state, grads, scale, value, reduced))
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
            "reductions": [{"op": o, "dtype": d, "round": r} for o, d, r in self.reductions],
            "uses_value": self.uses_value,
        }
        return msgpack.packb(top, use_bin_type=True)


def load_optimizer(
    data: bytes, *, source: str = "optimizer", devices: Sequence[jax.Device] | None = None
) -> OptimizerProgram:
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
    meta = {"reductions": top.get("reductions", []), "uses_value": top.get("uses_value", False)}
    return OptimizerProgram(
        str(top.get("name", "optimizer")), params, state, mesh, modules, source=source, devices=devices, meta=meta
    )


def stage_programs(
    optimizer: optax.GradientTransformation,
    artifacts: Sequence[Artifact],
    names: Sequence[Sequence[str]],
    placed: Sequence[PyTree],
    whole: WholeOptimizer,
    counted: Sequence[Sequence[str]],
) -> list[bytes]:
    """Each stage's exported optimizer as bytes, its specs from the stage's (placed) parameters keyed by ``names``,
    its share of ``whole`` (the reductions' terms of its ``counted`` keys)."""
    out = []
    for s, (art, n, p) in enumerate(zip(artifacts, names, placed)):
        specs = {
            k: jax.ShapeDtypeStruct(np.shape(v), v.dtype, sharding=v.sharding if art.manifest.sharded else None)
            for k, v in zip(n, jax.tree_util.tree_leaves(p))
        }
        prog = export_optimizer(
            optimizer, specs, platforms=art.manifest.platforms, whole=whole, stage=s, counted=counted[s]
        )
        out.append(prog.to_bytes())
    return out
