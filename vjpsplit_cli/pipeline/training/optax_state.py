"""The whole model's optimizer state in optax's own structure, gathered from the stages and handed back to them.

Each stage's exported optimizer runs optax's ``init`` and ``update`` over a flat
``{global key: array}`` mapping of the parameter leaves it holds (``optimizer``),
so a stage's state is optax's state *for those leaves*. ``StateMap`` relates it
to ``tx.init(params)`` for the whole model from optax's state structure alone
(``jax.eval_shape`` on the driver, where optax is installed; no key string is
parsed):

* ``tx.init`` on the flat mapping of every parameter leaf gives the *skeleton*:
  each subtree with that mapping's structure is one *slot* of per-leaf state
  (Adam's ``mu`` and ``nu``, momentum's ``trace``), every other leaf a value of
  its own (a step count, a PRNG key);
* each stage's state, evaluated the same way on its own leaves, must have that
  skeleton, its slots holding its own leaves;
* ``tx.init(params)`` must be that skeleton with each slot in ``params``' structure.

Every state leaf is then named by ``(slot, parameter key)``, or ``(slot, None)``
for a value of its own. ``gather`` builds the whole model's state from the
stages' (the entries of a tied leaf and the values of their own are the same on
every stage that holds them: checked, not assumed); ``scatter`` does the reverse.
``optax.masked`` and ``optax.multi_transform`` (masks and labels given as
functions of the parameters) follow this: a stage's state holds masked-out
placeholders where the whole model's does. A transformation whose state does
not (a value sized by the number of leaves it sees, say) is one error naming it.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Mapping, Sequence

import jax
import numpy as np

from ...errors import VjpsplitError, jax_message
from ...files.prng import from_data, impl_name, is_key, to_data
from ...files.trees import flatten_with_keys
from ...treetypes import Leaf, PyTree
from .optimizer import checked_name, optimizer_name
from .ownership import Ownership
from .separable import WholeOptimizer

if TYPE_CHECKING:  # annotations only: optax is an optional extra, imported by the caller that has an optimizer
    import optax


@dataclasses.dataclass(frozen=True)
class _At:
    """Where a state leaf belongs: its slot in the skeleton, the parameter's global key (None for a value of its
    own) and its place among that parameter's entries in the slot (a transformation may keep several, or none)."""

    slot: int
    key: str | None
    index: int = 0


def _spec(v: jax.ShapeDtypeStruct | Leaf) -> jax.ShapeDtypeStruct:
    return v if isinstance(v, jax.ShapeDtypeStruct) else jax.ShapeDtypeStruct(np.shape(v), v.dtype)


def _init_shape(tx: optax.GradientTransformation, params: PyTree, label: str) -> optax.OptState:
    try:
        return jax.eval_shape(tx.init, params)
    except Exception as e:
        raise VjpsplitError(
            f"optimizer {label!r}: its init fails on the parameters ({jax_message(e)}); a pytree it was built "
            "with for the whole model's parameters (a mask, multi_transform's labels) must be a function of the "
            "parameters instead (e.g. mask=lambda params: ...), since each stage's optimizer sees only that "
            "stage's share of them"
        ) from e


def _slots(
    state: optax.OptState, keys: Sequence[str]
) -> tuple[jax.tree_util.PyTreeDef, list[dict[str, object] | None]]:
    """``state``'s skeleton, each dict keyed by exactly ``keys`` (optax's map over the flat parameters) one leaf
    of it, and per skeleton leaf that dict (a slot: each parameter's entry, a subtree) or None (a value of its own)."""
    want = set(keys)

    def is_slot(x: object) -> bool:
        return type(x) is dict and set(x) == want

    parts, skeleton = jax.tree_util.tree_flatten(state, is_leaf=is_slot)
    return skeleton, [p if is_slot(p) else None for p in parts]


def _entry(i: int, k: str, entry: object) -> object:
    """``entry`` (one parameter's part of slot ``i``) with an ``_At`` in place of each of its leaves."""
    n = len(jax.tree_util.tree_leaves(entry))
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(entry), [_At(i, k, j) for j in range(n)])


def _same_entries(
    mine: dict[str, object] | None, whole: dict[str, jax.tree_util.PyTreeDef] | None, names: Sequence[str]
) -> bool:
    """Whether a stage's slot (or value) matches the whole model's: each of its parameters' entries alike."""
    if mine is None or whole is None:
        return mine is None and whole is None
    return all(jax.tree_util.tree_structure(mine[k]) == whole[k] for k in names)


class StateMap:
    """optax's whole-model state of ``tx`` against the stages' states; see the module docstring.

    ``params``: the whole parameter pytree (arrays or specs); ``keys``: the same
    structure with each leaf's global key; ``stage_names``: per stage, the global
    keys it holds (the mapping its optimizer program runs over).
    """

    def __init__(
        self, tx: optax.GradientTransformation, params: PyTree, keys: PyTree, stage_names: Sequence[Sequence[str]]
    ):
        self.name = label = checked_name(tx)
        specs = jax.tree_util.tree_map(_spec, params)
        self.leaf_keys: list[str] = jax.tree_util.tree_leaves(keys)
        flat = dict(zip(self.leaf_keys, jax.tree_util.tree_leaves(specs)))
        skeleton, slots = _slots(_init_shape(tx, flat, label), list(flat))
        whole = _init_shape(tx, specs, label)
        self.treedef: jax.tree_util.PyTreeDef = jax.tree_util.tree_structure(whole)
        self.specs: list[jax.ShapeDtypeStruct] = jax.tree_util.tree_leaves(whole)
        self.entries = [k for k, _ in flatten_with_keys("", whole)]  # file keys, for messages and checkpoints
        entry_of = [None if sl is None else {k: jax.tree_util.tree_structure(v) for k, v in sl.items()} for sl in slots]

        def in_params(i: int, sl: dict[str, object] | None) -> object:
            if sl is None:
                return _At(i, None)
            return jax.tree_util.tree_map(lambda k: _entry(i, k, sl[k]), keys)

        placed = skeleton.unflatten([in_params(i, sl) for i, sl in enumerate(slots)])
        placed_tree: jax.tree_util.PyTreeDef = jax.tree_util.tree_structure(placed)
        if self.treedef != placed_tree:
            raise self._unmappable("the whole model's")
        self.whole: list[_At] = jax.tree_util.tree_leaves(placed)
        self.label: dict[_At, str] = {}
        for at, entry in zip(self.whole, self.entries):
            self.label.setdefault(at, entry)
        whole_spec: dict[_At, jax.ShapeDtypeStruct] = {}
        for at, sp in zip(self.whole, self.specs):
            whole_spec.setdefault(at, sp)
        self.stages: list[tuple[list[str], list[_At]]] = []  # per stage: its state keys, and where each belongs
        for s, names in enumerate(stage_names):
            state = _init_shape(tx, {k: flat[k] for k in names}, label)
            sk, mine = _slots(state, names)
            if sk != skeleton or not all(_same_entries(m, e, names) for m, e in zip(mine, entry_of)):
                raise self._unmappable(f"stage {s}'s")
            marked = sk.unflatten(
                [_At(i, None) if m is None else {k: _entry(i, k, m[k]) for k in names} for i, m in enumerate(mine)]
            )
            where = jax.tree_util.tree_leaves(marked)
            # Same structure is not enough: a value of its own sized by the leaves a stage sees differs in shape.
            if any(
                (sp.shape, sp.dtype) != (whole_spec[at].shape, whole_spec[at].dtype)
                for at, sp in zip(where, jax.tree_util.tree_leaves(state))
            ):
                raise self._unmappable(f"stage {s}'s")
            self.stages.append(([k for k, _ in flatten_with_keys("", state)], where))

    def _unmappable(self, whose: str) -> VjpsplitError:
        return VjpsplitError(
            f"optimizer {self.name!r}: {whose} state does not have the shape of its state for all parameters "
            "(per-leaf entries in params' structure, other values once): its stages' states cannot be joined "
            "into optax's structure; a state sized by the leaves it sees does this"
        )

    def gather(self, states: Sequence[Mapping[str, Leaf]]) -> optax.OptState:
        """The whole model's state (host arrays, typed PRNG keys as such) from each stage's ``{state key: array}``."""
        got: dict[_At, tuple[int, np.ndarray]] = {}
        for s, ((keys, where), state) in enumerate(zip(self.stages, states)):
            for k, at in zip(keys, where):
                v = np.asarray(to_data(state[k]))
                if at not in got:
                    got[at] = (s, v)
                    continue
                s0, v0 = got[at]
                if v0.shape != v.shape or not np.array_equal(v0, v, equal_nan=v.dtype.kind in "fc"):
                    raise VjpsplitError(
                        f"optimizer state '{self.label[at]}' differs between stages {s0} and {s}, which must hold "
                        "the same value; this is a vjpsplit bug, please report it"
                    )
        host = [got[at][1] for at in self.whole]
        leaves = [from_data(v, impl_name(sp)) if is_key(sp) else v for v, sp in zip(host, self.specs)]
        return jax.tree_util.tree_unflatten(self.treedef, leaves)

    def scatter(self, opt_state: optax.OptState) -> list[dict[str, np.ndarray]]:
        """Each stage's ``{state key: array}`` (host arrays, PRNG keys as key data) from the whole model's state."""
        leaves, treedef = jax.tree_util.tree_flatten(opt_state)
        if self.treedef != treedef:
            raise VjpsplitError(f"opt_state: {self._difference(opt_state)}")
        by: dict[_At, np.ndarray] = {}
        for at, entry, spec, v in zip(self.whole, self.entries, self.specs, leaves):
            if is_key(spec) != is_key(v) or (is_key(spec) and impl_name(spec) != impl_name(v)):
                raise VjpsplitError(
                    f"opt_state '{entry}': {self.name}'s init gives a {spec.dtype} here, not {getattr(v, 'dtype', type(v).__name__)}"
                )
            data, want = np.asarray(to_data(v)), to_data(spec) if not is_key(spec) else None
            if want is not None and (data.shape != tuple(want.shape) or data.dtype != np.dtype(want.dtype)):
                raise VjpsplitError(
                    f"opt_state '{entry}' is {data.dtype}{list(data.shape)}; {self.name}'s init gives "
                    f"{np.dtype(want.dtype)}{list(want.shape)} for these parameters"
                )
            by.setdefault(at, data)  # a leaf of params more than once (the per-stage form's tied leaves): the first
        return [{k: by[at] for k, at in zip(keys, where)} for keys, where in self.stages]

    def _difference(self, opt_state: optax.OptState) -> str:
        """How ``opt_state``'s structure differs from ``tx.init(params)``'s, and the fix."""
        fix = "; pass tx.init(params) or trainer.state()'s"
        got = [k for k, _ in flatten_with_keys("", opt_state)]
        nested = _clip_nesting(got, self.entries)
        if nested == "alone":
            return (
                "it is the optimizer's state alone, as a run with clip_global_norm= holds it, but the optimizer "
                "given nests it under '1/', as optax.chain(optax.clip_by_global_norm(c), tx) does: pass "
                "opt_state=(optax.EmptyState(), opt_state), or optimizer=tx with clip_global_norm=c (the same update)"
            )
        if nested == "chained":
            return (
                "it is optax.chain(optax.clip_by_global_norm(c), tx)'s state (tx's under '1/'), but the optimizer "
                "given takes tx's alone, as with clip_global_norm=: pass opt_state=opt_state[1], or that chain as "
                "optimizer= (the same update)"
            )
        first = next((i for i, (a, b) in enumerate(zip(got, self.entries)) if a != b), min(len(got), len(self.entries)))
        if first < len(self.entries) or len(got) != len(self.entries):
            where = got[first] if first < len(got) else "(none)"
            want = self.entries[first] if first < len(self.entries) else "(none)"
            return (
                f"has {len(got)} leaves, {self.name}'s init gives these parameters {len(self.entries)}; "
                f"leaf {first} is '{where}', not '{want}'{fix}"
            )
        return f"its leaves are named as {self.name}'s init names them, but its node types differ{fix}"


def _clip_nesting(got: Sequence[str], want: Sequence[str]) -> str:
    """How state keys ``got`` relate to the keys ``want``: ``"alone"`` where ``want`` are ``got`` under ``1/`` (a
    state saved with ``clip_global_norm=``, asked for as ``chain(clip_by_global_norm(c), tx)``'s, whose first
    element has no leaves), ``"chained"`` for the reverse, else ``""``."""
    if got and list(want) == [f"1/{k}" for k in got]:
        return "alone"
    if want and list(got) == [f"1/{k}" for k in want]:
        return "chained"
    return ""


def state_map(tx: optax.GradientTransformation, ownership: Ownership) -> StateMap:
    """The ``StateMap`` of ``tx`` for the parameters and stages ``ownership`` describes."""
    names = ownership.names
    specs = [
        dict(zip(n, (_spec(v) for v in jax.tree_util.tree_leaves(p)))) for n, p in zip(names, ownership.stage_params)
    ]
    keys = ownership.gather([{k: k for k in n} for n in names])
    return StateMap(tx, ownership.gather(specs), keys, names)


def opt_state_from_file(
    tx: optax.GradientTransformation, params: PyTree, arrays: Mapping[str, Leaf], source: str
) -> optax.OptState:
    """optax's whole-model state of ``tx`` for ``params`` from ``{state file key: array}`` (PRNG keys as key data)."""
    label = optimizer_name(tx)
    whole = _init_shape(tx, jax.tree_util.tree_map(_spec, params), label)
    leaves = []
    entries = flatten_with_keys("", whole)
    nested = _clip_nesting(sorted(arrays), sorted(k for k, _ in entries))
    if nested == "alone":
        raise VjpsplitError(
            f"{source}: its optimizer state is the optimizer's alone, as a run with clip_global_norm= saves it, but "
            "the optimizer given nests it under '1/', as optax.chain(optax.clip_by_global_norm(c), tx) does: restore "
            "with optimizer=tx and clip_global_norm=c (the same update)"
        )
    if nested == "chained":
        raise VjpsplitError(
            f"{source}: its optimizer state is optax.chain(optax.clip_by_global_norm(c), tx)'s (tx's under '1/'), "
            "but the optimizer given takes tx's alone, as with clip_global_norm=: restore with that chain as "
            "optimizer= and clip_global_norm=None (the same update)"
        )
    for key, spec in entries:
        if key not in arrays:
            raise VjpsplitError(
                f"{source}: its optimizer state has no '{key}', which {label}'s init gives these parameters; "
                "pass the optimizer the run was saved with"
            )
        leaves.append(from_data(arrays[key], impl_name(spec)) if is_key(spec) else arrays[key])
    extra = sorted(set(arrays) - {k for k, _ in entries})
    if extra:
        raise VjpsplitError(
            f"{source}: its optimizer state has '{extra[0]}', which {label}'s init does not give; "
            "pass the optimizer the run was saved with"
        )
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(whole), leaves)


def whole_optimizer(tx: optax.GradientTransformation, ownership: Ownership, smap: StateMap) -> WholeOptimizer:
    """``tx`` traced for the whole model of ``ownership``, each stage's state leaves placed by ``smap``."""
    names = ownership.names
    specs = [
        dict(zip(n, (_spec(v) for v in jax.tree_util.tree_leaves(p)))) for n, p in zip(names, ownership.stage_params)
    ]
    keys = ownership.gather([{k: k for k in n} for n in names])
    where: dict[_At, list[int]] = {}
    for j, at in enumerate(smap.whole):
        where.setdefault(at, []).append(j)
    index = [[where[at] for at in ats] for _, ats in smap.stages]
    return WholeOptimizer(
        tx,
        ownership.gather(specs),
        keys,
        names,
        smap.name,
        state_owner=[at.key for at in smap.whole],
        state_names=smap.entries,
        state_index=index,
    )
