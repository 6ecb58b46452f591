"""The whole model's optimizer update, cut by stage: what each stage computes, and what crosses stages.

A stage's optimizer program runs optax's ``update`` (and ``init``) for the
*whole* model's parameter tree, traced once on the driver (``jax.make_jaxpr``,
abstract: no arrays), but evaluates only what its own leaves' outputs need. So a
value that depends on the tree as a whole and on no leaf (``noisy_sgd``'s key
split over every leaf, a step count) is computed by every stage exactly as in
one process, each leaf taking its own share of it.

Each value of the traced program gets one label, in program order:

* *free*: computed from no parameter leaf (state values of their own, the clip
  scale, the loss ``value``, constants); every stage computes the same one;
* *key k*: computed from leaf ``k``'s parameter, gradient and state entries (and
  free values); only the stages holding ``k`` compute it;
* a *reduction*: an ``add``, ``max`` or ``min`` chain of scalars over several
  leaves (``optax.tree.norm``, ``tree_sum``, ``tree_max``: DoG's distance,
  D-adaptation's sums, ``clip_by_global_norm``'s norm), or one scalar per leaf
  stacked and reduced (``apply_if_finite``'s ``all``). Its result is free once
  known: every stage computes its share (the chain's terms of the leaves whose
  norm it counts, a tied leaf by its first holder only), the shares are combined
  across stages and handed back, and the rest of the update goes on from there.
  A reduction whose terms need another one's result comes in a later *round*;
* *spanning*: anything else that mixes leaves (ravelling them into one vector, a
  non-scalar sum of two leaves, a loop over several): refused by name, since no
  stage holds them all. A ``cond`` whose operands span leaves is first taken apart
  into its branches and a ``select_n`` of their outputs (the same values).

The outputs must fit: leaf ``k``'s new parameter and state entries *key k* or
free, a state value of its own free. ``WholeOptimizer.refusal`` is the one error
naming the optimizer, the state entry or parameter and the operation that spans
stages.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from typing import TYPE_CHECKING, Callable, Mapping, Sequence, TypeAlias, cast

import jax
import numpy as np
import numpy.typing as npt
from jax.extend import core as jcore
from jax.typing import ArrayLike

from ...errors import VjpsplitError, jax_message
from ...treetypes import PyTree

if TYPE_CHECKING:  # annotations only: optax is an optional extra, imported where an optimizer is traced
    import optax
    from jax.core import AbstractValue, ShapedArray

_CALLS = ("pjit", "jit", "closed_call", "core_call")
_CUSTOM = ("custom_jvp_call", "custom_vjp_call")
_REDUCE = {"add": "add", "add_any": "add", "max": "max", "min": "min"}
# A reduction over a stack of one scalar per leaf (``jnp.all(jnp.array([... for leaf in leaves]))``).
_STACKED = {"reduce_sum": "add", "reduce_max": "max", "reduce_min": "min", "reduce_and": "and", "reduce_or": "or"}


def _ops() -> dict[str, Callable[[ArrayLike, ArrayLike], jax.Array]]:
    import jax.numpy as jnp

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


class _Select:
    """A ``lax.select_n`` over a cond's branches' outputs: how a cond whose operands span leaves is inlined."""

    class primitive:  # noqa: N801 - read as an equation's ``primitive.name``
        name = "select_n"


_SELECT = _Select()
_Eqn: TypeAlias = "jcore.JaxprEqn | _Select"  # an equation of a ``_Graph``


class _Graph:
    """A jaxpr with its calls inlined: nodes are ints, each equation evaluated alone as ``eval_jaxpr`` would.

    A ``cond`` named in ``inline`` becomes its branches, each inlined, and a ``select_n`` of their outputs
    by its index: the same values (the branches have no effects), each leaf's part of them apart."""

    def __init__(self, inline: set[int] = frozenset()) -> None:  # type: ignore[assignment]
        self.inline = inline
        self.values: dict[int, ArrayLike] = {}  # literal and constant nodes
        self.avals: dict[int, AbstractValue] = {}
        # eqn, its invars, their nodes, out nodes
        self.eqns: list[tuple[_Eqn, list[jcore.Var], list[int], list[int]]] = []
        self.count = 0

    def node(self, aval: AbstractValue) -> int:
        self.count += 1
        self.avals[self.count] = aval
        return self.count

    def const(self, value: ArrayLike) -> int:
        n = self.node(jax.typeof(value))
        self.values[n] = value
        return n

    def flatten(self, closed: jcore.ClosedJaxpr, ins: Sequence[int]) -> list[int]:
        env: dict[jcore.Var, int] = {v: self.const(c) for v, c in zip(closed.jaxpr.constvars, closed.consts)}
        env.update(zip(closed.jaxpr.invars, ins))

        def read(a: jcore.Var | jcore.Literal) -> int:
            if isinstance(a, jcore.Literal):
                return self.const(a.val)
            return env[a]

        for eqn in closed.jaxpr.eqns:
            name = eqn.primitive.name
            inner = (
                eqn.params.get("jaxpr") if name in _CALLS else eqn.params.get("call_jaxpr") if name in _CUSTOM else None
            )
            if inner is not None:
                if not hasattr(inner, "consts"):
                    inner = jcore.ClosedJaxpr(inner, [])
                outs = self.flatten(inner, [read(a) for a in eqn.invars])
            elif name == "cond" and id(eqn) in self.inline:
                index, ops = read(eqn.invars[0]), [read(a) for a in eqn.invars[1:]]
                cases = [self.flatten(b, ops) for b in eqn.params["branches"]]
                outs = []
                for j, v in enumerate(eqn.outvars):
                    outs.append(self.node(v.aval))
                    self.eqns.append((_SELECT, [], [index, *[c[j] for c in cases]], [outs[-1]]))
            else:
                invars = list(dict.fromkeys(a for a in eqn.invars if not isinstance(a, jcore.Literal)))
                outs = [self.node(v.aval) for v in eqn.outvars]
                self.eqns.append((eqn, invars, [env[v] for v in invars], outs))
            env.update((v, o) for v, o in zip(eqn.outvars, outs) if not _dropped(v))
        return [read(a) for a in closed.jaxpr.outvars]


def _dropped(v: jcore.Var) -> bool:
    """Whether ``v`` is an equation's unused output (``DropVar``): named by its type, since ``jax.extend.core``
    has no ``DropVar`` before jax 0.7 and the oldest supported jax is 0.6.2."""
    return type(v).__name__ == "DropVar"


def _where(eqn: _Eqn) -> str:
    """`` (file:line)`` of the code that made ``eqn``, for messages; empty where JAX does not say."""
    if isinstance(eqn, _Select):
        return ""  # an inlined cond's select: made by this module, not by user code
    try:
        frame = jax.extend.source_info_util.user_frame(eqn.source_info)  # type: ignore[attr-defined]
        return "" if frame is None else f" ({frame.file_name.rsplit('/', 1)[-1]}:{frame.start_line})"
    except Exception:  # noqa: BLE001 - where, in words, is a nicety
        return ""


def _dtype(aval: AbstractValue) -> np.dtype:
    """A scalar reduction's dtype: its aval has a shape, so it is an array's (``ShapedArray``)."""
    return np.dtype(cast("ShapedArray", aval).dtype)


def _run_eqn(eqn: _Eqn, invars: Sequence[jcore.Var], vals: Sequence[ArrayLike]) -> list[jax.Array | None]:
    if isinstance(eqn, _Select):
        return [jax.lax.select_n(vals[0], *vals[1:])]
    outs = [v for v in eqn.outvars if not _dropped(v)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        one = jcore.Jaxpr([], list(invars), outs, [eqn], eqn.effects)
    got = iter(jcore.jaxpr_as_fun(jcore.ClosedJaxpr(one, []))(*vals))
    return [None if _dropped(v) else next(got) for v in eqn.outvars]


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
        self.g = g = _Graph(inline)
        self.inputs = [g.node(v.aval) for v in closed.jaxpr.invars]
        self.outputs = g.flatten(closed, self.inputs)
        spanning_conds: set[int] = set()
        lab: dict[int, _Label] = {n: FREE for n in g.values}
        level: dict[int, int] = {n: 0 for n in g.values}
        for n, grp in zip(self.inputs, groups):
            lab[n], level[n] = (FREE if grp is None else ("key", grp)), 0
        uses: dict[int, int] = {}
        for _, _, ins, _ in g.eqns:
            for n in ins:
                uses[n] = uses.get(n, 0) + 1
        for n in self.outputs:
            uses[n] = uses.get(n, 0) + 2  # an output is always a finished value
        self.roots: dict[int, Root] = {}
        partial: dict[int, Root] = {}  # a reduction under way, at the node of its last step
        stacks: dict[int, list[int]] = {}  # a concatenate of one scalar per leaf: its terms
        self.producer: dict[int, int] = {}

        def finish(n: int) -> None:
            """A reduction's node used as a value: the reduction is complete there, and free."""
            if n in partial and n not in self.roots:
                r = partial[n]
                r.index = len(self.roots)
                terms = [m for m, _ in r.keyed] + r.free
                r.round = max((level[m] for m in terms), default=0)
                self.roots[n] = r
                lab[n], level[n] = FREE, r.round + 1

        for i, (eqn, _, ins, outs) in enumerate(g.eqns):
            for o in outs:
                self.producer[o] = i
            name = eqn.primitive.name
            op = _REDUCE.get(name)
            scalar = op is not None and all(getattr(g.avals[n], "shape", None) == () for n in [*ins, *outs])
            cont = [n for n in ins if n in partial and partial[n].op == op and uses.get(n) == 1] if scalar else []
            for n in ins:
                if n not in cont:
                    finish(n)
            labs = [lab[n] for n in ins if n not in cont]
            keys = sorted({lb[1] for lb in labs if lb[0] == "key"})
            spanning = next((("span", lb[1]) for lb in labs if lb[0] in ("span", "stack")), None)
            lvl = max((level[n] for n in ins), default=0)
            stacked = (
                name in _STACKED
                and not isinstance(eqn, _Select)
                and len(ins) == 1
                and lab[ins[0]][0] == "stack"
                and uses.get(ins[0]) == 1
                and tuple(eqn.params.get("axes", ())) == (0,)
            )
            if stacked:
                terms = stacks[ins[0]]
                r = Root(-1, _STACKED[name], _dtype(g.avals[outs[0]]), [], [])
                r.keyed = [(n, lab[n][1]) for n in terms if lab[n][0] == "key"]
                r.free = [n for n in terms if lab[n][0] != "key"]
                partial[outs[0]] = r
                out: _Label = ("partial",)
            elif spanning is not None:
                out = spanning
            elif (
                name == "concatenate"
                and len(keys) >= 2
                and len(outs) == 1
                and all(getattr(g.avals[n], "shape", None) == (1,) for n in ins)
            ):
                stacks[outs[0]] = list(ins)  # one scalar per leaf: a reduction if what reads it reduces it
                out = ("stack", f"{name}{_where(eqn)} of leaves {keys[0]!r} and {keys[1]!r}")
            elif scalar and (cont or len(keys) >= 2):
                assert op is not None
                r = Root(-1, op, _dtype(g.avals[outs[0]]), [], [])
                for n in ins:
                    if n in cont:
                        r.keyed += partial[n].keyed
                        r.free += partial[n].free
                    elif lab[n][0] == "key":
                        r.keyed.append((n, lab[n][1]))
                    else:
                        r.free.append(n)
                partial[outs[0]] = r
                out = ("partial",)
            elif len(keys) >= 2:
                out = ("span", f"{name}{_where(eqn)} of leaves {keys[0]!r} and {keys[1]!r}")
                if name == "cond":
                    spanning_conds.add(id(eqn))
            elif keys:
                out = ("key", keys[0])
            else:
                out = FREE
            for o in outs:
                lab[o], level[o] = out, lvl
        for n in self.outputs:
            finish(n)
        self.lab, self.level = lab, level
        self.rounds = 1 + max((r.round for r in self.roots.values()), default=-1)
        return spanning_conds

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
            for o, v in zip(outs, _run_eqn(eqn, invars, [env[n] for n in ins])):
                if o not in roots and v is not None:  # None: a dropped output, which nothing reads
                    env[o] = v
        return [env[n] if n in env else self._root_value(n, env, reduced) for n in targets]

    def _root_value(self, n: int, env: Mapping[int, ArrayLike], reduced: Sequence[ArrayLike] | None) -> jax.Array:
        import jax.numpy as jnp

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
        import jax.numpy as jnp

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


def trace_optimizer(fn: Callable[..., object], args: Sequence[object], label: str, what: str) -> jcore.ClosedJaxpr:
    """``jax.make_jaxpr(fn)(*args)`` on abstract values, a failure one error naming the optimizer."""
    try:
        return jax.make_jaxpr(fn)(*args)
    except VjpsplitError:
        raise
    except TypeError as e:
        msg = str(e)
        extra = [w for w in ("value_fn", "grad", "obj_fn") if f"'{w}'" in msg]
        inner = re.search(r"(\w+)\.<locals>\.update_fn\(\)", msg)
        part = f" ({inner.group(1)})" if inner and inner.group(1) != label else ""
        if extra:
            raise VjpsplitError(
                f"optimizer {label!r}{part}: its update needs {' and '.join(extra)} (a line search or a second "
                "evaluation of the loss), which a pipeline step does not have; use an optimizer whose update "
                "takes the gradients, the state, the parameters and at most the step's loss value="
            ) from e
        raise _cannot(label, what, e) from e
    except Exception as e:
        raise _cannot(label, what, e) from e


def _cannot(label: str, what: str, e: BaseException) -> VjpsplitError:
    msg = jax_message(e)
    hint = (
        "its update needs obj_fn (a Hessian estimate from the loss function), which a pipeline step does not have"
        if "obj_fn" in msg
        else "its update must take (gradients, state, parameters) and at most the step's loss value=, "
        "the parameters as one pytree (not a wrapper such as lookahead's LookaheadParams)"
    )
    return VjpsplitError(f"optimizer {label!r}: its {what} fails on the whole model's parameters ({msg}); {hint}")


def _uses_value(tx: optax.GradientTransformation) -> bool:
    """Whether ``tx.update`` takes extra keyword arguments (optax's ``GradientTransformationExtraArgs``)."""
    import optax

    return isinstance(tx, optax.GradientTransformationExtraArgs)


class WholeOptimizer:
    """optax ``tx``'s init and update traced once for the whole model, and each stage's share of them.

    ``params`` and ``keys``: the whole parameter tree as specs, and the same tree of global keys (a key may
    appear twice: the per-stage form's tied leaves). ``stage_names``: per stage, the keys it holds.
    ``state_owner`` and ``state_names``: per leaf of ``tx.init(params)``, the key it belongs to (None: a
    value of its own) and its entry name; ``state_index``: per stage, per leaf of that stage's own state
    (``tx.init`` of its flat leaves), the leaves of the whole state it is. None for all three: one stage
    holding every leaf, its state the whole one.
    """

    def __init__(
        self,
        tx: optax.GradientTransformation,
        params: PyTree,
        keys: PyTree,
        stage_names: Sequence[Sequence[str]],
        label: str,
        state_owner: Sequence[str | None] | None = None,
        state_names: Sequence[str] | None = None,
        state_index: Sequence[Sequence[Sequence[int]]] | None = None,
    ):
        import optax

        self.tx, self.label = tx, label
        self.param_leaves, tree = jax.tree_util.tree_flatten(params)
        self.param_tree: jax.tree_util.PyTreeDef = tree
        self.param_keys: list[str] = jax.tree_util.tree_leaves(keys)
        whole_state = jax.eval_shape(tx.init, params)
        self.state_leaves, stree = jax.tree_util.tree_flatten(whole_state)
        self.state_tree: jax.tree_util.PyTreeDef = stree
        n_state = len(self.state_leaves)
        self.single = state_owner is None
        owners = list(state_owner) if state_owner is not None else [None] * n_state
        names = list(state_names) if state_names is not None else [f"state leaf {j}" for j in range(n_state)]
        self.state_index = (
            [list(x) for x in state_index] if state_index is not None else [[[j] for j in range(n_state)]]
        )
        self.stage_names = [list(n) for n in stage_names]
        self.value = _uses_value(tx)
        P = len(self.param_leaves)
        scalar = jax.ShapeDtypeStruct((), np.float32)

        def update(
            p: list[jax.Array], s: list[jax.Array], g: list[jax.Array], scale: jax.Array, value: jax.Array
        ) -> tuple[list[jax.Array], list[jax.Array]]:
            pt = self.param_tree.unflatten(p)
            gt = self.param_tree.unflatten([v * scale.astype(v.dtype) for v in g])
            st = self.state_tree.unflatten(s)
            kw = {"value": value} if self.value else {}
            upd, new = tx.update(gt, st, pt, **kw)
            new_p = optax.apply_updates(pt, upd)
            new_leaves, new_tree = jax.tree_util.tree_flatten(new)
            if new_tree != self.state_tree:
                raise VjpsplitError(
                    f"optimizer {label!r}: its update returns a state of another structure than its init's"
                )
            return jax.tree_util.tree_leaves(new_p), new_leaves

        closed = trace_optimizer(
            update, (self.param_leaves, self.state_leaves, self.param_leaves, scalar, scalar), label, "update"
        )
        keyed = list(self.param_keys)
        groups = [*keyed, *owners, *keyed, None, None]
        out_names = [f"parameter {k!r}" for k in keyed] + [f"state entry {n!r}" for n in names]
        self.update = Cut(closed, groups, [*keyed, *owners], out_names, label, "update")
        self.uses_value = self.value and self.update.uses_input(len(groups) - 1)
        init_closed = trace_optimizer(
            lambda p: jax.tree_util.tree_leaves(tx.init(self.param_tree.unflatten(p))),
            (self.param_leaves,),
            label,
            "init",
        )
        self.init = Cut(init_closed, keyed, owners, [f"state entry {n!r}" for n in names], label, "init")
        # An init that reduces over leaves (DoWG's first distance estimate) runs once, for the whole model.
        self.init_whole = bool(self.init.roots) or self.init.problem is not None
        self.P = P

    def refusal(self) -> VjpsplitError | None:
        """The error for an update that no stage-wise program computes as one process does (None: it can)."""
        if self.single or self.update.problem is None:
            return None
        return VjpsplitError(
            f"optimizer {self.label!r}: {self.update.problem}; the pipeline runs each stage's update on its own "
            "leaves, so it cannot train this optimizer as one process does. Use an optimizer whose update is "
            "per leaf or reduces over leaves by sums, maxima or norms (adamw, lion, dowg, prodigy, "
            "chain(clip_by_global_norm(c), ...)), or Trainer(clip_global_norm=c) for clipping"
        )

    def roots(self) -> list[Root]:
        """The update's reductions over leaves that cross stages, in the order the programs take their combined
        values (none for one stage holding every leaf: it reduces on its own)."""
        return [] if self.single else self.update.root_list()

    @property
    def rounds(self) -> int:
        """How many exchanges of reductions a step needs (one per round)."""
        return 0 if self.single else self.update.rounds

    def stage(self, s: int, counted: Sequence[str] | None = None) -> StageShare:
        """Stage ``s``'s functions over its flat leaves (in ``stage_names[s]``'s order), for export; ``counted``:
        the keys whose terms it adds to the reductions (a tied leaf's first holder; default: all it holds)."""
        return StageShare(self, s, counted)


class StageShare:
    """One stage's init, reduction shares and update over its own flat leaves, from the whole model's programs."""

    def __init__(self, whole: WholeOptimizer, s: int, counted: Sequence[str] | None = None):
        self.w, self.s = whole, s
        self.keys = whole.stage_names[s]
        pos = {k: i for i, k in enumerate(self.keys)}
        self.param_pos = [(i, pos[k]) for i, k in enumerate(whole.param_keys) if k in pos]
        self.state_pos = [(j, t) for t, js in enumerate(whole.state_index[s]) for j in js]
        first: dict[int, int] = {}
        for t, js in enumerate(whole.state_index[s]):
            first[t] = js[0]
        self.state_first = [first[t] for t in range(len(whole.state_index[s]))]
        own = set(self.keys)
        self.param_out: dict[str, int] = {}
        for i, k in enumerate(whole.param_keys):
            self.param_out.setdefault(k, i)
        self.param_targets = [self.param_out[k] for k in self.keys]
        self.counted: set[str] = own if counted is None else set(counted)

    def _bound(
        self,
        p: Sequence[ArrayLike],
        st: Sequence[ArrayLike],
        g: Sequence[ArrayLike],
        scale: ArrayLike,
        value: ArrayLike,
    ) -> dict[int, ArrayLike]:
        w = self.w
        P, n_state = w.P, len(w.state_leaves)
        b: dict[int, ArrayLike] = {}
        for i, local in self.param_pos:
            b[i] = p[local]
            b[P + n_state + i] = g[local]
        for j, t in self.state_pos:
            b[P + j] = st[t]
        b[2 * P + n_state] = scale
        b[2 * P + n_state + 1] = value
        return b

    def init(self, p: Sequence[ArrayLike]) -> list[ArrayLike]:
        """The stage's state from its parameters (an init that is separable by leaf)."""
        cut = self.w.init
        outs = [cut.outputs[j] for j in self.state_first]
        reduced: list[np.ndarray] | None = None  # one stage holding every leaf: its reductions are its own
        if not self.w.single:
            # An init reducing over leaves runs once on the driver (WholeOptimizer.init_whole) and its state is
            # handed to the stages; this module is then never what a stage starts from: NaN marks any such use.
            reduced = [np.full((), np.nan if np.dtype(r.dtype).kind in "fc" else 0, r.dtype) for r in cut.root_list()]
        return cut.evaluate({i: p[local] for i, local in self.param_pos}, outs, reduced)

    def shares(
        self,
        rnd: int,
        p: Sequence[ArrayLike],
        st: Sequence[ArrayLike],
        g: Sequence[ArrayLike],
        scale: ArrayLike,
        value: ArrayLike,
        reduced: Sequence[ArrayLike],
    ) -> list[jax.Array]:
        """This stage's shares of the reductions of round ``rnd``."""
        return self.w.update.shares(self._bound(p, st, g, scale, value), self.counted, rnd, reduced)

    def update(
        self,
        p: Sequence[ArrayLike],
        st: Sequence[ArrayLike],
        g: Sequence[ArrayLike],
        scale: ArrayLike,
        value: ArrayLike,
        reduced: Sequence[ArrayLike],
    ) -> tuple[list[ArrayLike], list[ArrayLike]]:
        """The stage's new parameters and state."""
        cut, P = self.w.update, self.w.P
        targets = [cut.outputs[i] for i in self.param_targets] + [cut.outputs[P + j] for j in self.state_first]
        got = cut.evaluate(self._bound(p, st, g, scale, value), targets, None if self.w.single else reduced)
        return got[: len(self.keys)], got[len(self.keys) :]
