"""The optimizer exported: one stage's optax ``init`` and ``update`` as ``jax.export`` modules.

``export_optimizer(optax_tx, param_specs)`` runs where optax is installed (the
driver); the ``OptimizerProgram`` it returns (``optimizer_program``) travels as
bytes (``to_bytes``) and runs, after ``load_optimizer``, in a process that imports
neither optax nor the user's code: a pipeline worker applies the update where the
parameters live.

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

On a sharded stage (specs with ``NamedSharding``s) the programs keep the state
sharded as the parameters are: a state leaf named ``.../<param key>`` with that
parameter's shape (optax's ``mu``, ``nu``, ``trace``) takes its sharding; other
state leaves (step counts) are replicated.

``OptimizerProgram``, ``OptLeaf`` and ``load_optimizer`` are also importable from here.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

import jax
import numpy as np
from jax import export as jexport
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jax.typing import ArrayLike

from ...artifact.artifact import Artifact
from ...artifact.sharding import SpecJSON, mesh_axes, mesh_of, spec_to_json
from ...errors import VjpsplitError, jax_message
from ...files.dtypes import dtype_name
from ...files.prng import data_struct, from_data, impl_name, is_key, to_data
from ...files.trees import escape_segment, flatten_with_keys
from ...treetypes import Leaf, PyTree
from .leaf_labels import Root
from .optimizer_program import OptimizerProgram, OptLeaf
from .optimizer_program import load_optimizer as load_optimizer
from .separable import StageShare, WholeOptimizer

if TYPE_CHECKING:  # annotations only: optax is an optional extra, needed only where an optimizer is exported
    import optax
    from jax.sharding import AbstractMesh


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


@dataclasses.dataclass(frozen=True)
class _Stage:
    """What ``export_optimizer``'s steps pass along: the program's name, one stage's parameter and state leaves
    (``OptLeaf``s, their shardings given on a mesh), the mesh (None: unsharded) and the stage's share of the
    whole model's optimizer (``flat``), with the whole's reductions over leaves (``roots``) and rounds."""

    label: str
    params: tuple[OptLeaf, ...]
    state: tuple[OptLeaf, ...]
    mesh: Mesh | AbstractMesh | None
    flat: _Flat
    roots: list[Root]
    rounds: int
    uses_value: bool


def export_optimizer(
    tx: optax.GradientTransformation,
    param_specs: PyTree,
    *,
    platforms: Sequence[str] | str = ("cpu", "cuda", "tpu"),
    name: str | None = None,
    whole: WholeOptimizer | None = None,
    stage: int = 0,
    counted: Sequence[str] | None = None,
) -> OptimizerProgram:
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
    mesh, params = _param_leaves(label, flat_specs(param_specs))
    entries = _state_entries(tx, label, params)
    if whole is None:
        keys = [p.key for p in params]
        whole = WholeOptimizer(tx, dict(zip(keys, [p.struct() for p in params])), {k: k for k in keys}, [keys], label)
        stage, counted = 0, None
    state = _state_leaves(entries, params, mesh)
    flat = _Flat(whole.stage(stage, counted), [s.prng_impl for s in state])
    st = _Stage(label, params, state, mesh, flat, whole.roots(), whole.rounds, bool(whole.uses_value))
    return _program(st, _export_modules(st, platforms))


def _param_leaves(
    label: str, specs: Mapping[str, jax.ShapeDtypeStruct | Leaf]
) -> tuple[Mesh | AbstractMesh | None, tuple[OptLeaf, ...]]:
    """The parameters' mesh (the one their ``NamedSharding``s share; None: unsharded) and their leaves, each
    with its spec on that mesh (replicated where it has none); a PRNG key among them is refused."""
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
    return mesh, params


def _state_entries(
    tx: optax.GradientTransformation, label: str, params: Sequence[OptLeaf]
) -> list[tuple[str, jax.ShapeDtypeStruct]]:
    """``tx.init``'s state for the stage's parameters, abstract, as file-keyed leaves (one error if it fails)."""
    try:
        raw = jax.eval_shape(tx.init, {p.key: p.struct() for p in params})
        return flatten_with_keys("", raw)
    except VjpsplitError:
        raise
    except Exception as e:
        raise VjpsplitError(
            f"cannot export the optimizer {label!r}: its init fails on the stage's parameters ({jax_message(e)}); "
            "its state must be a pytree of arrays, and a pytree it was built with for the whole model's parameters "
            "(a mask, multi_transform's labels) must be a function of the parameters instead (e.g. "
            "mask=lambda params: ...), since each stage's optimizer sees only that stage's share of them"
        ) from e


def _state_leaves(
    entries: Sequence[tuple[str, jax.ShapeDtypeStruct]],
    params: Sequence[OptLeaf],
    mesh: Mesh | AbstractMesh | None,
) -> tuple[OptLeaf, ...]:
    """The state's leaves, on a mesh each sharded as the parameter it mirrors (``_state_specs``)."""
    specs_state = _state_specs(entries, params) if mesh is not None else [None] * len(entries)
    return tuple(_leaf(k, s, None if sp is None else tuple(sp)) for (k, s), sp in zip(entries, specs_state))


def _jobs(st: _Stage) -> list[tuple[str, Callable[..., object], tuple[object, ...]]]:
    """Per module to export (``init``, ``update``, ``shares/<round>``): its name, function and abstract arguments."""
    pstructs = [p.struct() for p in st.params]
    sstructs = [s.struct() for s in st.state]
    scale = jax.ShapeDtypeStruct((), np.float32)
    reduced = [jax.ShapeDtypeStruct((), r.dtype) for r in st.roots]
    upd_args = (pstructs, sstructs, pstructs, scale, scale, reduced)
    jobs: list[tuple[str, Callable[..., object], tuple[object, ...]]] = [
        ("init", st.flat.init, (pstructs,)),
        ("update", st.flat.update, upd_args),
    ]
    jobs += [(f"shares/{r}", st.flat.shares(r), upd_args) for r in range(st.rounds)]
    return jobs


def _shardings(st: _Stage) -> dict[str, tuple[object, object]] | None:
    """Per module, its ``(in_shardings, out_shardings)`` on the stage's mesh; None: unsharded."""
    if st.mesh is None:
        return None
    ps = [NamedSharding(st.mesh, PartitionSpec(*(p.sharding or ()))) for p in st.params]
    ss = [NamedSharding(st.mesh, PartitionSpec(*(s.sharding or ()))) for s in st.state]
    rep = NamedSharding(st.mesh, PartitionSpec())
    rr = [rep] * len(st.roots)
    sh: dict[str, tuple[object, object]] = {"init": ((ps,), ss), "update": ((ps, ss, ps, rep, rep, rr), (ps, ss))}
    for r in range(st.rounds):
        sh[f"shares/{r}"] = ((ps, ss, ps, rep, rep, rr), [rep for x in st.roots if x.round == r])
    return sh


def _export_modules(st: _Stage, platforms: tuple[str, ...]) -> dict[str, bytes]:
    """Each module exported with ``jax.export`` and serialized; a refusal is one error naming the module."""
    sh = _shardings(st)
    modules = {}
    for module, fn, args in _jobs(st):
        jitted = jax.jit(fn) if sh is None else jax.jit(fn, in_shardings=sh[module][0], out_shardings=sh[module][1])
        try:
            exp = jexport.export(jitted, platforms=platforms)(*args)
        except VjpsplitError:
            raise
        except Exception as e:
            raise VjpsplitError(
                f"cannot export the optimizer {st.label!r}: jax.export refuses its {module} ({jax_message(e)}); use a transformation written in jax.numpy, without host callbacks"
            ) from e
        modules[module] = bytes(exp.serialize())
    return modules


def _program(st: _Stage, modules: Mapping[str, bytes]) -> OptimizerProgram:
    """The ``OptimizerProgram`` of the exported modules, its reductions recorded (not checked again: just made)."""
    meta = {
        "reductions": [{"op": r.op, "dtype": dtype_name(np.dtype(r.dtype)), "round": r.round} for r in st.roots],
        "uses_value": st.uses_value,
    }
    return OptimizerProgram(
        st.label,
        st.params,
        st.state,
        mesh_axes(st.mesh) if st.mesh is not None else (),
        modules,
        source=f"optimizer {st.label!r}",
        check=False,
        meta=meta,
        abstract=st.mesh is not None and not isinstance(st.mesh, Mesh),
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
