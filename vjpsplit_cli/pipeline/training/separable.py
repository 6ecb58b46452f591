"""The whole model's optimizer update, cut by stage: what each stage computes, and what crosses stages.

A stage's optimizer program runs optax's ``update`` (and ``init``) for the
*whole* model's parameter tree, traced once on the driver (``jax.make_jaxpr``,
abstract: no arrays), but evaluates only what its own leaves' outputs need. So a
value that depends on the tree as a whole and on no leaf (``noisy_sgd``'s key
split over every leaf, a step count) is computed by every stage exactly as in
one process, each leaf taking its own share of it.

Each value of the traced program is labelled *free*, *key k*, a *reduction* or
*spanning* (``leaf_labels``, which says each). The outputs must fit: leaf ``k``'s
new parameter and state entries *key k* or free, a state value of its own free.
``WholeOptimizer.refusal`` is the one error naming the optimizer, the state entry
or parameter and the operation that spans stages. ``StageShare`` is one stage's
init, reduction shares and update over its own flat leaves.

``combine`` (the stages' shares of one reduction joined) is also importable from here.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Callable, Sequence

import jax
import numpy as np
from jax.extend import core as jcore
from jax.typing import ArrayLike

from ...errors import VjpsplitError, jax_message
from ...treetypes import PyTree
from .leaf_labels import Cut, Root
from .leaf_labels import combine as combine

if TYPE_CHECKING:  # annotations only: optax is an optional extra, imported where an optimizer is traced
    import optax


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
