"""One traced program labelled by leaf: which values each stage computes, and the reductions across stages.

Each value of the traced program gets one label, in program order:

* *free*: computed from no parameter leaf (state values of their own, the clip
  scale, the loss ``value``, constants); every stage computes the same one;
* *key k*: computed from leaf ``k``'s parameter, gradient and state entries (and
  free values); only the stages holding ``k`` compute it;
* a *reduction* (``Root``): an ``add``, ``max`` or ``min`` chain of scalars over several
  leaves (``optax.tree.norm``, ``tree_sum``, ``tree_max``: DoG's distance,
  D-adaptation's sums, ``clip_by_global_norm``'s norm), or one scalar per leaf
  stacked and reduced (``apply_if_finite``'s ``all``). Its result is free once
  known: every stage computes its share (the chain's terms of the leaves whose
  norm it counts, a tied leaf by its first holder only), the shares are combined
  across stages (``combine``) and handed back, and the rest of the update goes on
  from there. A reduction whose terms need another one's result comes in a later *round*;
* *spanning*: anything else that mixes leaves (ravelling them into one vector, a
  non-scalar sum of two leaves, a loop over several): refused by name, since no
  stage holds them all. A ``cond`` whose operands span leaves is first taken apart
  into its branches and a ``select_n`` of their outputs (the same values).

``Cut`` labels one program (``jaxpr_graph.InlinedGraph``), says why an output cannot
be one stage's (``problem``), and evaluates what a stage's outputs need (``evaluate``,
``shares``). ``separable`` builds the whole model's optimizer from two of them.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable, Mapping, Sequence, TypeAlias, cast

import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt
from jax.extend import core as jcore
from jax.typing import ArrayLike

from ...errors import VjpsplitError
from .jaxpr_graph import Equation, InlinedGraph, Select, made_at, run_equation

if TYPE_CHECKING:
    from jax.core import AbstractValue, ShapedArray

_REDUCE = {"add": "add", "add_any": "add", "max": "max", "min": "min"}
# A reduction over a stack of one scalar per leaf (``jnp.all(jnp.array([... for leaf in leaves]))``).
_STACKED = {"reduce_sum": "add", "reduce_max": "max", "reduce_min": "min", "reduce_and": "and", "reduce_or": "or"}


def _ops() -> dict[str, Callable[[ArrayLike, ArrayLike], jax.Array]]:
    return {
        "add": jnp.add,
        "max": jnp.maximum,
        "min": jnp.minimum,
        "and": jnp.logical_and,
        "or": jnp.logical_or,
    }


# A node's label (the module docstring): ("free",), ("key", k), ("partial",) for a reduction under way, and
# ("span", what) or ("stack", what) naming the operation that mixes leaves.
_Label: TypeAlias = tuple[str, ...]
FREE: _Label = ("free",)


@dataclasses.dataclass
class Root:
    """One reduction over leaves: ``op`` over the terms, each a leaf's (``keyed``: node, key) or free (``free``)."""

    index: int
    op: str
    dtype: np.dtype
    keyed: list[tuple[int, str]]
    free: list[int]
    round: int = 0

    def identity(self) -> np.ndarray:
        """The value of no terms: 0 (add), True (and), False (or), the dtype's lowest (max) or highest (min)."""
        dt = np.dtype(self.dtype)
        if self.op == "add":
            return np.zeros((), dt)
        if self.op in ("and", "or"):
            return np.array(self.op == "and", dt)
        info = np.finfo(dt) if dt.kind == "f" else np.iinfo(dt)
        big = np.array(np.inf, dt) if dt.kind == "f" else np.array(info.max, dt)
        return -big if self.op == "max" else big


def combine(op: str, dtype: npt.DTypeLike, parts: Sequence[ArrayLike]) -> np.ndarray:
    """The stages' shares of one reduction joined on the host (sums in float64), in the reduction's dtype."""
    dt = np.dtype(dtype)
    vals = [np.asarray(p) for p in parts]
    if op == "add":
        wide = np.float64 if dt.kind in "fc" else np.int64
        return np.asarray(np.sum([v.astype(wide) for v in vals])).astype(dt)
    if op in ("and", "or"):
        return np.asarray(np.all(vals) if op == "and" else np.any(vals)).astype(dt)
    return np.asarray(np.max(vals) if op == "max" else np.min(vals)).astype(dt)


def _dtype(aval: AbstractValue) -> np.dtype:
    """A scalar reduction's dtype: its aval has a shape, so it is an array's (``ShapedArray``)."""
    return np.dtype(cast("ShapedArray", aval).dtype)


@dataclasses.dataclass
class _Labels:
    """What labelling one program builds up, equation by equation: each node's label and ``level`` (the round
    its value is known in), how many times it is read (``uses``; an output counts twice), the reductions
    complete (``roots``) and under way at the node of their last step (``partial``), the terms of a concatenate
    of one scalar per leaf (``stacks``), each node's equation (``producer``) and the conds whose operands span
    leaves (``spanning_conds``)."""

    lab: dict[int, _Label]
    level: dict[int, int]
    uses: dict[int, int]
    roots: dict[int, Root] = dataclasses.field(default_factory=dict)
    partial: dict[int, Root] = dataclasses.field(default_factory=dict)
    stacks: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    producer: dict[int, int] = dataclasses.field(default_factory=dict)
    spanning_conds: set[int] = dataclasses.field(default_factory=set)

    @classmethod
    def start(
        cls, g: InlinedGraph, inputs: Sequence[int], outputs: Sequence[int], groups: Sequence[str | None]
    ) -> _Labels:
        """Constants free, each input its group's key (or free), and how often each node is read."""
        lab: dict[int, _Label] = {n: FREE for n in g.values}
        level: dict[int, int] = {n: 0 for n in g.values}
        for n, grp in zip(inputs, groups):
            lab[n], level[n] = (FREE if grp is None else ("key", grp)), 0
        uses: dict[int, int] = {}
        for _, _, ins, _ in g.eqns:
            for n in ins:
                uses[n] = uses.get(n, 0) + 1
        for n in outputs:
            uses[n] = uses.get(n, 0) + 2  # an output is always a finished value
        return cls(lab, level, uses)

    def finish(self, n: int) -> None:
        """A reduction's node used as a value: the reduction is complete there, and free."""
        if n in self.partial and n not in self.roots:
            r = self.partial[n]
            r.index = len(self.roots)
            terms = [m for m, _ in r.keyed] + r.free
            r.round = max((self.level[m] for m in terms), default=0)
            self.roots[n] = r
            self.lab[n], self.level[n] = FREE, r.round + 1


def _label_equation(ls: _Labels, g: InlinedGraph, i: int, eqn: Equation, ins: list[int], outs: list[int]) -> None:
    """Label equation ``i``'s outputs from its inputs' labels: a reduction it starts or continues is under way
    at its output; every other input that is a reduction's node is its finished value."""
    for o in outs:
        ls.producer[o] = i
    name = eqn.primitive.name
    op = _REDUCE.get(name)
    scalar = op is not None and all(getattr(g.avals[n], "shape", None) == () for n in [*ins, *outs])
    cont = [n for n in ins if n in ls.partial and ls.partial[n].op == op and ls.uses.get(n) == 1] if scalar else []
    for n in ins:
        if n not in cont:
            ls.finish(n)
    labs = [ls.lab[n] for n in ins if n not in cont]
    keys = sorted({lb[1] for lb in labs if lb[0] == "key"})
    spanning = next((("span", lb[1]) for lb in labs if lb[0] in ("span", "stack")), None)
    lvl = max((ls.level[n] for n in ins), default=0)
    if _reduces_a_stack(ls, eqn, ins):
        out = _stacked_reduction(ls, g, name, ins, outs)
    elif spanning is not None:
        out = spanning
    elif _stacks_scalars(g, name, keys, ins, outs):
        ls.stacks[outs[0]] = list(ins)  # one scalar per leaf: a reduction if what reads it reduces it
        out = ("stack", f"{name}{made_at(eqn)} of leaves {keys[0]!r} and {keys[1]!r}")
    elif scalar and (cont or len(keys) >= 2):
        assert op is not None
        out = _chained_reduction(ls, g, op, ins, outs, cont)
    elif len(keys) >= 2:
        out = ("span", f"{name}{made_at(eqn)} of leaves {keys[0]!r} and {keys[1]!r}")
        if name == "cond":
            ls.spanning_conds.add(id(eqn))
    elif keys:
        out = ("key", keys[0])
    else:
        out = FREE
    for o in outs:
        ls.lab[o], ls.level[o] = out, lvl


def _reduces_a_stack(ls: _Labels, eqn: Equation, ins: Sequence[int]) -> bool:
    """Whether ``eqn`` reduces, along its one axis, a stack of one scalar per leaf that nothing else reads."""
    return (
        eqn.primitive.name in _STACKED
        and not isinstance(eqn, Select)
        and len(ins) == 1
        and ls.lab[ins[0]][0] == "stack"
        and ls.uses.get(ins[0]) == 1
        and tuple(eqn.params.get("axes", ())) == (0,)
    )


def _stacked_reduction(ls: _Labels, g: InlinedGraph, name: str, ins: Sequence[int], outs: Sequence[int]) -> _Label:
    """A reduction of a stack's terms, under way at ``outs[0]``: each term keyed by its leaf, or free."""
    terms = ls.stacks[ins[0]]
    r = Root(-1, _STACKED[name], _dtype(g.avals[outs[0]]), [], [])
    r.keyed = [(n, ls.lab[n][1]) for n in terms if ls.lab[n][0] == "key"]
    r.free = [n for n in terms if ls.lab[n][0] != "key"]
    ls.partial[outs[0]] = r
    return ("partial",)


def _stacks_scalars(g: InlinedGraph, name: str, keys: Sequence[str], ins: Sequence[int], outs: Sequence[int]) -> bool:
    """Whether the equation concatenates one scalar (shape ``(1,)``) of each of two or more leaves."""
    return (
        name == "concatenate"
        and len(keys) >= 2
        and len(outs) == 1
        and all(getattr(g.avals[n], "shape", None) == (1,) for n in ins)
    )


def _chained_reduction(
    ls: _Labels, g: InlinedGraph, op: str, ins: Sequence[int], outs: Sequence[int], cont: Sequence[int]
) -> _Label:
    """A scalar ``op`` over leaves, under way at ``outs[0]``: the terms of the reductions it continues
    (``cont``), and each other input keyed by its leaf, or free."""
    r = Root(-1, op, _dtype(g.avals[outs[0]]), [], [])
    for n in ins:
        if n in cont:
            r.keyed += ls.partial[n].keyed
            r.free += ls.partial[n].free
        elif ls.lab[n][0] == "key":
            r.keyed.append((n, ls.lab[n][1]))
        else:
            r.free.append(n)
    ls.partial[outs[0]] = r
    return ("partial",)


class Cut:
    """One traced program (``fn`` on the whole model's abstract inputs) labelled as the module docstring says.

    ``groups``: per flat input, the parameter key it belongs to (None: free).
    ``owners``: per flat output, the key it belongs to (None: a value of its own).
    ``names``: per flat output, its name for messages.
    """

    def __init__(
        self,
        closed: jcore.ClosedJaxpr,
        groups: Sequence[str | None],
        owners: Sequence[str | None],
        names: Sequence[str],
        label: str,
        what: str,
    ):
        self.label, self.what = label, what
        inline: set[int] = set()
        while True:  # a cond whose operands span leaves is inlined, and the program labelled again
            more = self._label(closed, groups, inline)
            if not more - inline:
                break
            inline |= more
        self._check(owners, names, what)

    def _label(self, closed: jcore.ClosedJaxpr, groups: Sequence[str | None], inline: set[int]) -> set[int]:
        """Label every node (the module docstring); return the conds whose operands span leaves."""
        self.g = g = InlinedGraph(inline)
        self.inputs = [g.node(v.aval) for v in closed.jaxpr.invars]
        self.outputs = g.flatten(closed, self.inputs)
        ls = _Labels.start(g, self.inputs, self.outputs, groups)
        for i, (eqn, _, ins, outs) in enumerate(g.eqns):
            _label_equation(ls, g, i, eqn, ins, outs)
        for n in self.outputs:
            ls.finish(n)
        self.roots, self.producer = ls.roots, ls.producer
        self.lab, self.level = ls.lab, ls.level
        self.rounds = 1 + max((r.round for r in self.roots.values()), default=-1)
        return ls.spanning_conds

    def _check(self, owners: Sequence[str | None], names: Sequence[str], what: str) -> None:
        """``problem``: why an output cannot be one stage's (None: every output can)."""
        lab = self.lab
        self.problem: str | None = None
        for n, owner, nm in zip(self.outputs, owners, names):
            lb = lab[n]
            if lb[0] in ("span", "stack"):
                self.problem = f"its {what} of {nm} takes {lb[1]}, which no stage holds both of"
            elif lb[0] == "key" and lb[1] != owner:
                whose = "a value of its own" if owner is None else f"leaf {owner!r}'s"
                self.problem = f"its {what} computes {nm} ({whose}) from leaf {lb[1]!r}, which another stage may hold"
            if self.problem:
                break

    def root_list(self) -> list[Root]:
        """The reductions in the order their values are handed to the programs."""
        return sorted(self.roots.values(), key=lambda r: r.index)

    def uses_input(self, i: int) -> bool:
        """Whether flat input ``i`` enters any equation or output."""
        n = self.inputs[i]
        return n in self.outputs or any(n in ins for _, _, ins, _ in self.g.eqns)

    def evaluate(
        self,
        bound: Mapping[int, ArrayLike],
        targets: Sequence[int],
        reduced: Sequence[ArrayLike] | None = (),
    ) -> list[ArrayLike]:
        """The values of output nodes ``targets`` from the flat inputs ``bound`` (index -> value) and the
        reductions' combined keyed terms ``reduced`` (in ``root_list`` order; None: from their terms here, where
        every term is bound); computes only what they need."""
        g, roots = self.g, self.roots
        env: dict[int, ArrayLike] = {self.inputs[i]: v for i, v in bound.items()}
        need: set[int] = set()
        stack = list(targets)
        while stack:
            n = stack.pop()
            if n in need:
                continue
            need.add(n)
            if n in roots:
                stack.extend(roots[n].free)
                if reduced is None:
                    stack.extend(m for m, _ in roots[n].keyed)
            elif n in self.producer:
                stack.extend(g.eqns[self.producer[n]][2])
        for n in need:
            if n in g.values:
                env[n] = g.values[n]
        for eqn, invars, ins, outs in g.eqns:
            if not any(o in need and o not in roots for o in outs):
                continue  # not needed, or a reduction's last step: its value comes from the stages' shares
            for n in ins:
                if n not in env:
                    env[n] = self._root_value(n, env, reduced)
            for o, v in zip(outs, run_equation(eqn, invars, [env[n] for n in ins])):
                if o not in roots and v is not None:  # None: a dropped output, which nothing reads
                    env[o] = v
        return [env[n] if n in env else self._root_value(n, env, reduced) for n in targets]

    def _root_value(self, n: int, env: Mapping[int, ArrayLike], reduced: Sequence[ArrayLike] | None) -> jax.Array:
        r = self.roots.get(n)
        if r is None:
            raise VjpsplitError(f"optimizer {self.label!r}: its {self.what} needs a value no stage computes")
        fn = _ops()[r.op]
        if reduced is None:
            v = jnp.asarray(r.identity())
            for m, _ in r.keyed:
                v = fn(v, jnp.reshape(jnp.asarray(env[m], r.dtype), ()))
        else:
            v = jnp.asarray(reduced[r.index], r.dtype)
        for m in r.free:
            v = fn(v, jnp.reshape(jnp.asarray(env[m], r.dtype), ()))
        return v

    def shares(
        self, bound: Mapping[int, ArrayLike], counted: set[str], rnd: int, reduced: Sequence[ArrayLike]
    ) -> list[jax.Array]:
        """Per reduction of round ``rnd`` (``root_list`` order), this stage's share: its terms of the ``counted`` keys."""
        mine = [r for r in self.root_list() if r.round == rnd]
        targets = [n for r in mine for n, k in r.keyed if k in counted]
        vals = dict(zip(targets, self.evaluate(bound, targets, reduced)))
        fn = _ops()
        out = []
        for r in mine:
            v = jnp.asarray(r.identity())
            for n, k in r.keyed:
                if k in counted:
                    v = fn[r.op](v, jnp.reshape(jnp.asarray(vals[n], r.dtype), ()))
            out.append(v)
        return out
