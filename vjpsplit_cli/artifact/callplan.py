"""``CallPlan``: what the checks of one signature of a module's arguments worked out, kept for every call like it.

Also ``avals_key`` (the plan key of arguments that are each one concrete jax array) and ``wrap_keys``
(typed PRNG keys back from key data). ``binding.Binding`` makes the plans and ``Artifact`` calls
through them.
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Sequence

import jax.numpy as jnp

from ..files.prng import from_data
from ..files.trees import ArgTrees
from ..tracing.frozen import FrozenDict


def avals_key(args: Sequence, aval_type: type[Any] | None) -> tuple | None:
    """The plan key of arguments that are each one concrete jax array (of ``aval_type``): each aval's
    shape and dtype, which say what ``leaves_signature`` says of them. None if some argument is not one
    (or no such type was seen yet: ``aval_type`` None). A loop: measured cheaper than ``map`` here.
    """
    out = []
    for v in args:
        if type(v) is not aval_type:
            return None
        a = v.aval
        out.append((a.shape, a.dtype))
    return ("avals", tuple(out))


def wrap_keys(leaves: Sequence[Any], values: Sequence) -> Sequence:
    """Typed PRNG keys back from their key data, where the manifest's ``leaves`` say so (else ``values`` itself)."""
    if not any(leaf.prng_impl for leaf in leaves):
        return values
    return [from_data(jnp.asarray(v), leaf.prng_impl) if leaf.prng_impl else v for leaf, v in zip(leaves, values)]


class CallPlan:
    """What the checks of one signature of ``fwd``'s arguments worked out, for every call like it.

    Made once per signature (``Binding.arguments``): the leaves' order (None: as they
    come), which leaves are typed keys passed as key data, the dims, the arguments'
    trees. The residuals a forward makes from it point back to it (``remember``), so
    that ``bwd`` on them takes the gradients' layout from it too (``layout``): what
    depends only on the artifact and the call's signature is worked out once.
    """

    __slots__ = ("order", "keyed", "dims", "trees", "mutable", "_layouts", "ready", "gather")

    def __init__(self, order: tuple[int, ...] | None, keyed: frozenset[int], dims: FrozenDict, trees: ArgTrees):
        self.order = order
        self.keyed = keyed
        self.dims = dims
        self.trees = trees
        # The residuals' ``mutable_signature`` (a function of the leaves' types, shapes and dtypes: of the
        # signature), worked out by the first forward; None until then.
        self.mutable: tuple | None = None
        self._layouts: dict[tuple[str, ...], Any] = {}
        # Each module's jitted call once ``ModuleRunner.ready`` gave it at these dims, with the runner's
        # epoch it was asked at (a later epoch asks again): ``Artifact.fwd`` and ``bwd`` call it straight.
        self.ready: dict[str, tuple[int, Callable]] = {}
        # ``bwd``'s result from the module's gradients (``gather_of``), once worked out; None until then.
        self.gather: Callable[[Sequence], Any] | None = None

    def layout(self, names: tuple[str, ...], grad_keys: tuple[str, ...]) -> tuple | None:
        """How the gradients (``grad_keys`` order) become the pytrees of arguments ``names``; None: not by index.

        Each entry ``(name, treedef, indices)``: the argument's tree from ``fwd``'s call (None
        for a bare array) and where its leaves are among the gradients. None when some argument's tree is not
        known or some leaf has no gradient (an integer input: float0 zeros, made per call).
        """
        got = self._layouts.get(names, False)
        if got is not False:
            return got
        position = {k: i for i, k in enumerate(grad_keys)}
        known = {name: (treedef, keys) for name, treedef, keys in self.trees}
        entries: list[tuple] = []
        for name in names:
            if name not in known or any(k not in position for k in known[name][1]):
                self._layouts[names] = None
                return None
            treedef, keys = known[name]
            # An argument that is one array: its gradient as it comes (no tree to rebuild).
            bare = treedef.num_nodes == 1 and treedef.num_leaves == 1
            entries.append((name, None if bare else treedef, tuple(position[k] for k in keys)))
        layout = tuple(entries)
        self._layouts[names] = layout
        return layout

    def gather_of(self, names: tuple[str, ...], grad_keys: tuple[str, ...], single: bool) -> Callable | None:
        """``bwd``'s result from the gradients (``grad_keys`` order): ``names``' pytrees, one or a tuple.

        None where ``layout`` is None. Arguments that are each one array take their
        gradients by one ``itemgetter``, with no tree to rebuild.
        """
        layout = self.layout(names, grad_keys)
        if layout is None:
            return None
        if all(tree is None for _, tree, _ in layout):
            where = [w[0] for _, _, w in layout]
            if single:
                return operator.itemgetter(where[0])
            if len(where) > 1:
                return operator.itemgetter(*where)  # a tuple already

        def gather(values: Sequence) -> Any:
            grads = tuple(
                [values[w[0]] if tree is None else tree.unflatten([values[i] for i in w]) for _, tree, w in layout]
            )
            return grads[0] if single else grads

        return gather
