"""One stage artifact's calls, jitted once and kept as long as the artifact: what a ``StageWorker`` runs.

Owns ``Forward`` (``art.fwd`` as one dispatch per microbatch once a signature has
been through the checked first call), ``ForwardInput`` (the last stage's F and I of
one microbatch as one call), ``StageCalls`` (F, B, I and W, each one jitted call
around the artifact's public methods, the gradient sum inside the backward's call;
the last stage's F and B of one microbatch as one call), ``calls_for`` (one
``StageCalls`` per artifact and role, shared by every worker and step) and
``signature_of`` (what a compiled call is cached by); ``worker`` builds on it.
"""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING, Callable, Sequence

import jax
import numpy as np

from ...tracing.residuals import Intermediates
from ...treetypes import Leaf, PyTree

if TYPE_CHECKING:
    from jax.tree_util import PyTreeDef

    from ...artifact.artifact import Artifact
    from ...tracing.residuals import Residuals

    Signature = tuple[tuple[int, ...], object]  # a leaf's shape, and its dtype (a Python scalar's type)
    # A split backward's input part: the input cotangent now, and what its weight part reads.
    SplitInput = Callable[[Residuals, PyTree], tuple[PyTree | None, Intermediates]]
    # A forward signature's jitted call, which residual leaves are its inputs, how many leaves, their structure.
    Traced = tuple[Callable[..., tuple[PyTree, list[jax.Array]]], dict[int, int], int, dict[str, PyTreeDef]]


class Forward:
    """``art.fwd`` as one dispatch per microbatch (its output ``(loss, aux)`` for an artifact with aux).

    The first call for an input signature goes through the public ``fwd`` and all
    its checks. It also notes which residual leaves are the caller's own arrays
    (input-backed: ``fwd`` never copies them). Later calls run one jitted
    function that returns the other leaves; the input-backed ones are put back
    from the arguments, since returning them from ``jit`` would copy them.
    """

    WARMUP = 2  # the calls before a signature's are warm: the checked first one, then the jitted one compiles

    def __init__(self, art: Artifact):
        self.art = art
        self.cache: dict[tuple[PyTreeDef, tuple[Signature, ...]], Traced] = {}

    def __call__(self, *args: PyTree) -> tuple[PyTree, Residuals]:
        leaves, tree = jax.tree_util.tree_flatten(args)
        key = (tree, tuple(map(_signature, leaves)))
        hit = self.cache.get(key)
        if hit is None:
            out, res = self._fwd(*args)
            res_leaves = jax.tree_util.tree_leaves(res)
            where = {id(a): i for i, a in enumerate(leaves)}
            backed = {j: where[id(r)] for j, r in enumerate(res_leaves) if id(r) in where}
            traced: dict[str, PyTreeDef] = {}

            def run(*a: PyTree) -> tuple[PyTree, list[jax.Array]]:
                o, r = self._fwd(*a)
                flat, traced["tree"] = jax.tree_util.tree_flatten(r)
                return o, [x for j, x in enumerate(flat) if j not in backed]

            self.cache[key] = (jax.jit(run), backed, len(res_leaves), traced)
            return out, res
        fn, backed, n, traced = hit
        out, kept = fn(*args)
        it = iter(kept)
        flat = [leaves[backed[j]] if j in backed else next(it) for j in range(n)]
        return out, traced["tree"].unflatten(flat)

    def _fwd(self, *args: PyTree) -> tuple[PyTree, Residuals]:
        """``art.fwd``'s output and residuals; an artifact exported with ``has_aux`` (the last stage of a function
        with aux) gives ``(loss, aux)`` as its output."""
        got = self.art.fwd(*args)
        return ((got[0], got[2]) if self.art.manifest.has_aux else got[0]), got[1]


def _signature(a: Leaf | complex) -> Signature:
    try:
        return a.shape, a.dtype  # type: ignore[union-attr]  # a Python scalar has neither: below
    except AttributeError:  # a Python scalar
        return np.shape(a), type(a)


class ForwardInput:
    """The last stage's F and I of one microbatch in one call (ZB-H1's last stage runs its I right after its F): the
    output, the input cotangent and the intermediates its W reads; the other residuals never leave the call.

    W reads some of the stage's own inputs (input-backed residuals): returned from ``jit`` they would come back as
    copies, so they are put back from the arguments, at the positions ``learn`` noted from an unfused F of the same
    signature (the checked path). Until then ``__call__`` gives ``None`` and the stage runs F and I apart.
    """

    def __init__(self, artifact: Artifact, b_input: SplitInput):
        m = artifact.manifest

        def run(params: PyTree, xs: list[PyTree], ct: PyTree) -> tuple[PyTree, PyTree | None, Intermediates, dict]:
            got = artifact.fwd(params, *xs)  # (out, res), or (loss, res, aux) exported with has_aux
            gx, inter = b_input(got[1], ct)
            stored, _ = artifact.weight_part_residuals(got[1])
            return ((got[0], got[2]) if m.has_aux else got[0]), gx, inter, stored

        self.art, self._run = artifact, jax.jit(run)
        self.cache: dict[tuple[PyTreeDef, tuple[Signature, ...]], tuple[dict[str, int], tuple]] = {}
        # ``ready``'s flattened inputs and hit, for the call that follows it on the same objects (one flatten).
        self._ready: tuple[PyTree, list[PyTree], list[Leaf], tuple[dict[str, int], tuple]] | None = None

    def learn(self, args: Sequence[PyTree], res: Residuals) -> None:
        """Note, from an unfused F's arguments ``(params, *xs)`` and residuals, where W's input-backed residuals
        are among the arguments' leaves (nothing is noted if one of them is not an argument's own array)."""
        leaves, tree = jax.tree_util.tree_flatten((args[0], list(args[1:])))
        key = (tree, tuple(map(_signature, leaves)))
        if key in self.cache:
            return
        where = {id(a): i for i, a in enumerate(leaves)}
        _, inputs = self.art.weight_part_residuals(res)
        if all(id(v) in where for v in inputs.values()):
            self.cache[key] = ({k: where[id(v)] for k, v in inputs.items()}, res.arg_trees)

    def _hit(self, params: PyTree, xs: list[PyTree]) -> tuple[list[Leaf], tuple[dict[str, int], tuple] | None]:
        leaves, tree = jax.tree_util.tree_flatten((params, xs))
        return leaves, self.cache.get((tree, tuple(map(_signature, leaves))))

    def ready(self, params: PyTree, xs: list[PyTree]) -> bool:
        """Whether ``learn`` saw these inputs' signature (the call can run)."""
        leaves, hit = self._hit(params, xs)
        self._ready = None if hit is None else (params, xs, leaves, hit)
        return hit is not None

    def __call__(self, params: PyTree, xs: list[PyTree], ct: PyTree) -> tuple[PyTree, PyTree | None, Intermediates]:
        """``(output, input cotangent, intermediates)`` in one dispatch, for inputs whose signature is ``ready``."""
        last, self._ready = self._ready, None
        if last is not None and last[0] is params and last[1] is xs:  # just checked by ``ready``
            leaves, hit = last[2], last[3]
        else:  # a cold call run again (a timed step's warm-up)
            leaves, h = self._hit(params, xs)
            assert h is not None  # ready
            hit = h
        inputs, arg_trees = hit
        out, gx, inter, stored = self._run(params, xs, ct)
        backed = {k: leaves[i] for k, i in inputs.items()}
        return out, gx, Intermediates(inter.arrays, inter.dims, inter.fingerprint, "", stored, backed, arg_trees)


class StageCalls:
    """One stage artifact's operations, each one jitted call around the artifact's public methods.

    The checks those methods make (keys, shapes, dtypes, fingerprints) run when a
    signature is first traced rather than on every microbatch, and the gradient
    sum is in the same call as the weight gradient.
    """

    def __init__(self, artifact: Artifact, feeds_back: bool):
        m = artifact.manifest
        w, x = m.arg_names[0], (m.arg_names[1] if feeds_back else None)

        def add(acc: PyTree, g: PyTree) -> PyTree:
            return jax.tree_util.tree_map(lambda a, b: a + b, acc, g)

        def fused(res: Residuals, ct: PyTree) -> tuple[PyTree, PyTree | None]:
            g = artifact.bwd(res, ct)
            g = {m.wrt[0]: g} if m.single_grad else dict(zip(m.wrt, g))
            return g[w], (g[x] if x else None)

        def fused_acc(acc: PyTree, res: Residuals, ct: PyTree) -> tuple[PyTree, PyTree | None]:
            gw, gx = fused(res, ct)
            return add(acc, gw), gx

        def b_input(res: Residuals, ct: PyTree) -> tuple[PyTree | None, Intermediates]:
            g, inter = artifact.bwd_input(res, ct)
            # Without the residuals W reads: out of a jitted call they would come back as copies
            # (XLA copies an argument it returns), the stage's own arrays are put back below.
            return (g[x] if x else None), Intermediates(inter.arrays, inter.dims, inter.fingerprint)

        def b_input_with_residuals(res: Residuals, ct: PyTree) -> tuple[PyTree | None, Intermediates]:
            gx, inter = jitted_input(res, ct)
            stored, inputs = artifact.weight_part_residuals(res)
            return gx, Intermediates(
                inter.arrays, inter.dims, inter.fingerprint, res.residuals_id, stored, inputs, res.arg_trees
            )

        def b_weight(inter: Intermediates) -> PyTree:
            # The intermediates carry the residuals W reads: the rest were freed after B.
            return artifact.bwd_weight(inter)[w]

        def forward_backward(params: PyTree, xs: list[PyTree], ct: PyTree) -> tuple[PyTree, PyTree, PyTree | None]:
            got = artifact.fwd(params, *xs)  # (out, res), or (loss, res, aux) exported with has_aux
            gw, gx = fused(got[1], ct)
            return ((got[0], got[2]) if m.has_aux else got[0]), gw, gx

        def forward_backward_acc(
            acc: PyTree, params: PyTree, xs: list[PyTree], ct: PyTree
        ) -> tuple[PyTree, PyTree, PyTree | None]:
            out, gw, gx = forward_backward(params, xs, ct)
            return out, add(acc, gw), gx

        jitted_input = jax.jit(b_input)  # traced at its first call: none without the split backward
        self.forward = Forward(artifact)
        self.backward, self.backward_acc = jax.jit(fused), jax.jit(fused_acc)
        # The last stage's F and B of one microbatch in one call (its residuals never leave it): see
        # ``StageWorker.forward``.
        self.forward_backward = jax.jit(forward_backward)
        self.forward_backward_acc = jax.jit(forward_backward_acc)
        # The split backward's calls, None without one (plans with I or W are refused before they run).
        self.backward_input_jitted: SplitInput | None = (
            jitted_input if m.splits_backward else None
        )  # the compiled part (FLOPs, HLO)
        self.backward_input: SplitInput | None = b_input_with_residuals if m.splits_backward else None
        self.forward_input: ForwardInput | None = ForwardInput(artifact, b_input) if m.splits_backward else None
        self.backward_weight: Callable[[Intermediates], PyTree] | None = (
            jax.jit(b_weight) if m.splits_backward else None
        )
        self.backward_weight_acc: Callable[[PyTree, Intermediates], PyTree] | None = (
            jax.jit(lambda acc, inter: add(acc, b_weight(inter))) if m.splits_backward else None
        )


# Compiled calls live as long as their artifact, so repeated steps (and run_inprocess
# calls) reuse them instead of tracing and compiling again.
_CALLS: "weakref.WeakKeyDictionary[Artifact, dict[bool, StageCalls]]" = weakref.WeakKeyDictionary()
_CALLS_LOCK = threading.Lock()


def calls_for(artifact: Artifact, feeds_back: bool) -> StageCalls:
    """The jitted calls of ``artifact``'s stage, made once per artifact (and per ``feeds_back``) and shared."""
    with _CALLS_LOCK:
        per = _CALLS.setdefault(artifact, {})
        if feeds_back not in per:
            per[feeds_back] = StageCalls(artifact, feeds_back)
        return per[feeds_back]


def signature_of(args: Sequence[PyTree]) -> tuple[object, ...]:
    """What a compiled call is cached by: the inputs' structure, and each leaf's shape, dtype and placement."""
    leaves, tree = jax.tree_util.tree_flatten(args)
    return (tree, *((*_signature(a), getattr(a, "sharding", None)) for a in leaves))
