"""``export_stages``: one function, traced once, cut at its ``stage_boundary`` marks (or by cost) into artifacts.

Each stage is exported by ``export`` as an ordinary artifact over tuples:
``stage(params, batch)`` for the first, ``stage(params, x)`` or
``stage(params, x, batch)`` for the others, where ``params`` are exactly the
parameter leaves it reads, ``x`` the values the stage before sends (boundary
values, plus any made earlier and read later: carried through), and ``batch``
exactly the batch leaves it reads, straight from the driver. Every stage
differentiates ``params`` (and ``x`` after the first), never the batch. Beside
each artifact, the stage's evaluation program: the same function's forward
alone, without residuals (``evaluation``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ...artifact.lowering import DEFAULT_PLATFORMS, export
from ...errors import VjpsplitError
from ...files.dtypes import dtype_name
from ...files.prng import is_key
from ...files.shapes import concrete_shape, dim_str, refuse_64bit_without_x64, to_struct
from ...files.trees import flatten_with_keys
from ...tracing.signatures import fn_name, positional_names, signature_positionals, wrt_positions
from ...treetypes import PyTree
from .balance import balanced_ends
from .costmodel import ANY_DIM, COST_DIM, Shaped, aval_of, eqn_cost
from .cut import StageCut, Traced, cut, stage_function, trace_model
from .directory import Stages
from .evalprograms import EvalProgram, eval_file, export_eval
from .index import LeafEntry, StageEntry, StagesIndex

if TYPE_CHECKING:
    from jax.extend import core as jcore
    from jax.tree_util import PyTreeDef

    from ...artifact.artifact import Artifact


def _leaf_entry(key: str, s: Shaped) -> LeafEntry:
    dtype = str(s.dtype) if is_key(s) else dtype_name(s.dtype)  # a typed PRNG key by its jax name: key<fry>
    return LeafEntry(key, dtype, tuple(dim_str(d) for d in s.shape))


def _check_key_argument(
    names: Sequence[str], batch_pos: Sequence[int], b_entries: Sequence[tuple[str, Shaped]]
) -> None:
    """Refuse scalar PRNG keys the Trainer cannot hand per microbatch: one inside a batch pytree, or two arguments.

    A batch argument that is one scalar typed key (``jax.ShapeDtypeStruct((), jax.random.key(0).dtype)``) is the
    loss's key: the ``Trainer``'s ``rng=`` gives each microbatch its own (``index.StagesIndex.key_position``).
    """
    whole = {names[i] for i in batch_pos}
    scalars = [k for k, s in b_entries if is_key(s) and not s.shape]
    nested = [k for k in scalars if k not in whole]
    if nested:
        raise VjpsplitError(
            f"batch input '{nested[0]}' is a scalar PRNG key inside a pytree; make the key an argument of its own "
            "(the Trainer's rng= hands each microbatch its key there)"
        )
    if len(scalars) > 1:
        raise VjpsplitError(
            f"the function takes {len(scalars)} PRNG key arguments ({', '.join(scalars)}); take one and derive "
            "the others from it (jax.random.fold_in or split)"
        )


def _with_aux_leaves(
    flat_fn: Callable[..., object], fn: Callable[..., object]
) -> tuple[Callable[..., object], dict[str, PyTreeDef]]:
    """``flat_fn`` returning ``(loss, *aux_leaves)`` for a ``fn`` that returns ``(loss, aux)`` (``has_aux``), and
    the dict its trace puts the aux's structure in (``"tree"``).

    Raises (when traced):
        VjpsplitError: ``fn`` returns no pair, or an aux leaf that is no array (a string, a PRNG key), naming it.
    """
    seen: dict[str, PyTreeDef] = {}

    def flat(*leaves: jax.Array) -> tuple[object, ...]:
        got = flat_fn(*leaves)
        if not (isinstance(got, (tuple, list)) and len(got) == 2):
            what = f"a {len(got)}-tuple" if isinstance(got, (tuple, list)) else type(got).__name__
            raise VjpsplitError(f"has_aux=True, so {fn_name(fn)} must return a pair (loss, aux); it returned {what}")
        loss, aux = got
        out = []
        for key, leaf in flatten_with_keys("aux", aux):
            try:  # a number, a NumPy array, a symbolic dim (x.shape[0]): an array
                array = None if is_key(leaf) or isinstance(leaf, (str, bytes)) else jnp.asarray(leaf)
            except TypeError:
                array = None
            if array is None:
                what = "a PRNG key" if is_key(leaf) else f"a {type(leaf).__name__}"
                raise VjpsplitError(
                    f"{fn_name(fn)}'s aux leaf '{key}' is {what}; the aux holds arrays (an accuracy, a token "
                    "count): return jnp arrays"
                )
            out.append(array)
        seen["tree"] = jax.tree_util.tree_structure(aux)
        return (loss, *out)

    return flat, seen


def _check_arity(fn: Callable[..., object], n: int) -> list[str]:
    try:
        names, required, varargs = signature_positionals(fn)
    except (TypeError, ValueError):
        return positional_names(fn, n)
    if n < required or (varargs is None and n > len(names)):
        raise VjpsplitError(
            f"{n} specs given for {fn_name(fn)}, which takes {required}"
            + (f"..{len(names)}" if len(names) != required else "")
            + f" positional arguments ({', '.join(names)}); give one spec per argument"
        )
    return positional_names(fn, n)


def _structs(name: str, spec: PyTree) -> list[tuple[str, jax.ShapeDtypeStruct]]:
    out = []
    for key, leaf in flatten_with_keys(name, spec):
        try:
            out.append((key, to_struct(leaf)))
        except VjpsplitError as e:
            raise VjpsplitError(f"input '{key}': {e}") from e
    return out


def _check_replicas(data_parallel: int) -> None:
    """Refuse a ``data_parallel`` that is not a count of replicas."""
    if isinstance(data_parallel, bool) or not isinstance(data_parallel, int) or data_parallel < 1:
        raise VjpsplitError(f"data_parallel={data_parallel!r}: give the number of replicas of every stage, an int >= 1")


def _params_and_batch(
    fn: Callable[..., object], names: Sequence[str], wrt: int | str | Sequence[int | str]
) -> tuple[tuple[int, ...], list[int]]:
    """The positions of the one parameter argument and of the batch arguments (every other one)."""
    wrt_pos, _single = wrt_positions(names, wrt, fn_name(fn))
    if len(wrt_pos) != 1:
        raise VjpsplitError(
            f"wrt names {len(wrt_pos)} arguments; export_stages takes one parameter argument "
            "(put the parameters in one pytree)"
        )
    batch_pos = [i for i in range(len(names)) if i not in wrt_pos]
    if not batch_pos:
        raise VjpsplitError(
            f"every argument of {fn_name(fn)} is differentiated; leave the batch inputs out of wrt "
            "(the pipeline splits them into microbatches)"
        )
    return wrt_pos, batch_pos


def _over_leaves(fn: Callable[..., object], specs: Sequence[PyTree], order: Sequence[int]) -> Callable[..., object]:
    """``fn`` over the leaves of its arguments, taken in ``order`` (the parameters', then the batch's)."""
    trees = {i: jax.tree_util.tree_structure(specs[i]) for i in range(len(specs))}
    sizes = {i: trees[i].num_leaves for i in trees}  # type: ignore[attr-defined]  # PyTreeDef's stub lacks it

    def flat_fn(*leaves: jax.Array) -> object:
        it = iter(leaves)
        args = [None] * len(specs)
        for i in order:
            args[i] = jax.tree_util.tree_unflatten(trees[i], [next(it) for _ in range(sizes[i])])
        return fn(*args)

    return flat_fn


def _stage_ends(traced: Traced, stages: int | None, fn: Callable[..., object]) -> tuple[list[int], str]:
    """Where the stages end and how that was chosen: at the marks, or (``stages=N``) by balanced cost."""
    if traced.marks and stages is not None:
        raise VjpsplitError(
            f"{fn_name(fn)} has {len(traced.marks)} stage_boundary marks and stages={stages} was given; "
            "use one or the other"
        )
    if traced.marks:
        return traced.marks, "marks"
    if stages is not None:
        return balanced_ends(traced, stages), "balanced"
    raise VjpsplitError(f"{fn_name(fn)} has no stage_boundary marks; add some, or pass stages=N to cut by cost")


def _label(fn: Callable[..., object]) -> str:
    """The model's name in the stages' manifests when none is given: ``fn``'s module and qualified name."""
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"


def _stages_index(
    label: str,
    how: str,
    names: Sequence[str],
    positions: tuple[Sequence[int], Sequence[int]],
    leaves: tuple[Sequence[tuple[str, jax.ShapeDtypeStruct]], Sequence[tuple[str, jax.ShapeDtypeStruct]]],
    entries: Sequence[StageEntry],
    data_parallel: int,
) -> StagesIndex:
    """The stages' index (``stages.json``): the function, how it was cut, its arguments (``positions``: the
    parameter's and the batch's), their leaves (``leaves``: the parameters' and the batch's) and each stage's entry."""
    (wrt_pos, batch_pos), (p_entries, b_entries) = positions, leaves
    return StagesIndex(
        function=label,
        cut=how,
        cost_dim=COST_DIM,
        arg_names=tuple(names),
        wrt=tuple(names[i] for i in wrt_pos),
        params_name=names[wrt_pos[0]],
        batch_names=tuple(names[i] for i in batch_pos),
        params=tuple(_leaf_entry(k, s) for k, s in p_entries),
        batch=tuple(_leaf_entry(k, s) for k, s in b_entries),
        per_stage=tuple(entries),
        data_parallel=data_parallel,
    )


def export_stages(
    fn: Callable[..., object],
    *specs: PyTree,
    wrt: int | str | Sequence[int | str] = 0,
    platforms: Sequence[str] | str = DEFAULT_PLATFORMS,
    policy: str | None = None,
    weights: bool = True,
    stages: int | None = None,
    name: str | None = None,
    data_parallel: int = 1,
    has_aux: bool = False,
) -> Stages:
    """Trace ``fn(*specs)`` once and export one artifact per stage; see the module docstring.

    Args:
        fn: The whole model's loss, as ``fn(params, batch...)`` (any argument order).
        *specs: One pytree of ``jax.ShapeDtypeStruct`` (or arrays) per argument; batch inputs describe one microbatch.
        wrt: The one parameter argument (position or name); by default the first.
        platforms: The platforms to lower each stage for; by default ``DEFAULT_PLATFORMS``.
        policy: The rematerialization policy of every stage; ``None`` keeps every residual.
        weights: Whether each stage gets the zero-bubble split backward.
        stages: Without marks, cut into this many stages of balanced cost; ``None`` cuts at ``stage_boundary`` marks.
        name: The model's name in the stages' manifests; ``None`` takes ``fn``'s module and name.
        data_parallel: The replicas of every stage recorded in ``stages.json`` (the Trainer's default; by default 1).
        has_aux: Whether ``fn`` returns ``(loss, aux)``; the last stage returns ``aux`` (not differentiated).

    Returns:
        The ``Stages``, in memory (``save`` writes them to a directory).

    Raises:
        VjpsplitError: If the specs, ``wrt``, the marks, ``stages``, ``data_parallel`` or the aux are wrong, or a
            stage's export is refused (as ``export`` raises).
    """
    _check_replicas(data_parallel)
    names = _check_arity(fn, len(specs))
    wrt_pos, batch_pos = _params_and_batch(fn, names, wrt)
    p_entries = [kv for i in wrt_pos for kv in _structs(names[i], specs[i])]
    b_entries = [kv for i in batch_pos for kv in _structs(names[i], specs[i])]
    refuse_64bit_without_x64(p_entries + b_entries)  # by the user's keys, before the stages' own exports
    _check_key_argument(names, batch_pos, b_entries)
    flat_fn = _over_leaves(fn, specs, [*wrt_pos, *batch_pos])
    aux: dict[str, PyTreeDef] = {}
    if has_aux:
        flat_fn, aux = _with_aux_leaves(flat_fn, fn)
    traced = trace_model(flat_fn, [s for _, s in p_entries], [s for _, s in b_entries], has_aux)
    ends, how = _stage_ends(traced, stages, fn)
    cuts = cut(traced, ends)
    label = name or _label(fn)
    exported = [
        _export_stage(
            traced, st, k, len(cuts), p_entries, b_entries, label, platforms, policy, weights, aux.get("tree")
        )
        for k, st in enumerate(cuts)
    ]
    entries = [e for _, e, _ in exported]
    index = _stages_index(label, how, names, (wrt_pos, batch_pos), (p_entries, b_entries), entries, data_parallel)
    arts = [a for a, _, _ in exported]
    return Stages(arts, index, [p for _, _, p in exported])


def _export_stage(
    traced: Traced,
    st: StageCut,
    k: int,
    n: int,
    p_entries: Sequence[tuple[str, jax.ShapeDtypeStruct]],
    b_entries: Sequence[tuple[str, jax.ShapeDtypeStruct]],
    label: str,
    platforms: Sequence[str] | str,
    policy: str | None,
    weights: bool,
    aux_tree: PyTreeDef | None = None,
) -> tuple[Artifact, StageEntry, EvalProgram | None]:
    """Stage ``k`` of ``n`` as an artifact, its entry in ``stages.json`` and its evaluation program (``aux_tree``:
    the structure of the aux the last stage returns, None without one)."""
    first, last = k == 0, k == n - 1
    aux_tree = aux_tree if last else None
    sfn = stage_function(traced, st, first, last, aux_tree)
    p_spec = tuple(p_entries[i][1] for i in st.params)
    x_spec = tuple(jax.ShapeDtypeStruct(aval_of(v).shape, aval_of(v).dtype) for v in st.recv)
    b_spec = tuple(b_entries[i][1] for i in st.batch)
    arg_specs = (p_spec, b_spec) if first else ((p_spec, x_spec, b_spec) if st.batch else (p_spec, x_spec))
    arg_names = ("params", "batch") if first else (("params", "x", "batch") if st.batch else ("params", "x"))
    art = export(
        sfn,
        *arg_specs,
        wrt=("params",) if first else ("params", "x"),
        has_aux=aux_tree is not None,
        platforms=platforms,
        policy=policy,
        arg_names=arg_names,
        name=f"{label} stage {k}",
        weights="params" if weights else None,
    )
    xla = _xla_flops(art)
    program = export_eval(sfn, arg_specs, art, f"{label} stage {k}")
    entry = StageEntry(
        file=f"stage{k}.vjp",
        params=tuple(st.params),
        batch=tuple(st.batch),
        receives=tuple(_leaf_entry(f"x/{j}", aval_of(v)) for j, v in enumerate(st.recv)),
        sends=() if last else tuple(_leaf_entry(f"out/{j}", aval_of(v)) for j, v in enumerate(st.sent)),
        cost=xla if xla is not None else sum(eqn_cost(e) for e in st.eqns),
        cost_source="xla" if xla is not None else "estimate",
        cut_after=None if last else _describe(st.eqns[-1]),
        evaluation=None if program is None else (eval_file(k), program.sha256),
    )
    return art, entry, program


def _describe(eqn: jcore.JaxprEqn) -> str:
    src = eqn.source_info
    where = ""
    try:
        frame = jax.extend.source_info_util.user_frame(src) if hasattr(jax, "extend") else None  # type: ignore[attr-defined]
        if frame is not None:
            where = f" ({frame.file_name.rsplit('/', 1)[-1]}:{frame.start_line})"
    except Exception:  # noqa: BLE001 - where a cut is, in words, is a nicety
        where = ""
    return f"{eqn.primitive.name}{where}"


def _xla_flops(art: Artifact) -> float | None:
    """XLA's FLOP count for the stage's forward at symbolic dims = COST_DIM; None where the backend has none."""
    flops = module_flops(art, "fwd")
    return flops if flops else None


def module_flops(art: Artifact, module: str) -> float | None:
    """XLA's FLOP count for one of ``art``'s modules (``fwd``, ``bwd``, ``bwd_input``, ``bwd_weight``) at
    symbolic dims = COST_DIM (0 for a module that computes nothing, such as the first stage's input part); None
    where the backend gives none or the module cannot compile here."""
    try:
        exp = art.exported[module]
        args, kwargs = jax.tree_util.tree_unflatten(
            exp.in_tree,
            [
                jax.ShapeDtypeStruct(concrete_shape(tuple(dim_str(d) for d in a.shape), ANY_DIM), a.dtype)
                for a in exp.in_avals
            ],
        )
        # compiled: a shape-polymorphic module is refined to these sizes only when it compiles
        cost = jax.jit(exp.call).lower(*args, **kwargs).compile().cost_analysis()
    except Exception:  # noqa: BLE001 - the estimate stands in
        return None
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else None
    if not cost:
        return None
    flops = cost.get("flops", 0.0)  # XLA leaves out a count of 0
    return max(0.0, float(flops)) if np.isfinite(flops) else None
