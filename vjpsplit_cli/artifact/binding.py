"""Binding: what a caller hands a module, checked against the manifest and bound to its symbolic dims.

``Binding`` owns the checks of inputs, residuals, cotangents and intermediates (keys,
dtypes, shapes, the dims they bind, and whose forward made them), and returns each
module's arguments by slot of its signature (``trust.module_io``). It remembers the
residuals its own artifact's forward made, so a backward on them unchanged skips the
per-leaf checks, and every signature whose checks passed (module ``checked_calls``), so a call
like one before skips them too; which artifact, forward run and microbatch made the
residuals is checked on every call.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np

from ..errors import VjpsplitError
from ..files import keys
from ..files.dtypes import dtype_from_name
from ..files.prng import is_key, to_data
from ..files.trees import ArgTrees
from ..tracing.frozen import FrozenDict
from ..tracing.residuals import Residuals, SplitResiduals
from ..trust.module_io import input_backed_leaves
from .callplan import CallPlan, avals_key
from .weight_binding import WeightPartBinding
from .arguments import as_input, check_array, check_keys, flatten_args, recorded_dims, solved_dims
from .manifest import Manifest
from .checked_calls import (
    Recent,
    CheckedCalls,
    new_run_id,
    dims_signature,
    leaves_signature,
    mapping_signature,
    mutable_signature,
    reads_aval,
    residuals_signature,
)

_MADE_KEPT = 256  # residuals ids remembered (weak references and signatures, never arrays: keeps no memory alive)
PLANS_MADE = [0]  # CallPlans made in this process: what tests count to see that a signature is prepared once


class Binding:
    """Checks of a module's arguments against one artifact's manifest (``source`` names the artifact)."""

    def __init__(self, manifest: Manifest, source: str) -> None:
        self.manifest = manifest
        self.source = source
        # residuals_id -> (weak reference, mutable inputs, plan), of the residuals this fwd made
        self.made = Recent(_MADE_KEPT)
        self._checked = CheckedCalls()  # signatures whose checks passed -> what they worked out
        self.plans = self._checked.entries  # read in place by ``Artifact.fwd`` where a key surely hashes
        # jax's concrete array type, set by the first ``fwd`` whose arguments are each one such array: such
        # arguments are keyed by their avals' shapes and dtypes alone (``avals_key``).
        self.aval_type: type[Any] | None = None
        # The manifest's keys in order, read on every call.
        self.input_keys = tuple(leaf.key for leaf in manifest.inputs)
        self.stored_keys = tuple(r.key for r in manifest.stored_residuals)
        self.backed_keys = manifest.input_backed_keys  # input keys of the input-backed residuals
        self.all_backed = self.backed_keys == self.input_keys  # every input backs a residual, in order
        self.grad_keys = tuple(g.key for g in manifest.grads)  # what ``bwd`` returns, in order
        self.typed_outputs = any(leaf.prng_impl for leaf in manifest.outputs)  # some output is a typed key
        self.weights = WeightPartBinding(manifest, source, self._checked, self.residuals)  # the split backward's
        self._unit: jax.Array | None = None  # the cotangent 1 of a scalar output
        self.units: list | None = None  # ``[unit]``, as ``cotangents(None, ...)`` gives it, once made

    # -- inputs and residuals ------------------------------------------------------------
    def planned(self, args: Sequence) -> tuple[CallPlan | None, tuple[tuple | None, Sequence]]:
        """The plan of ``fwd``'s arguments where their signature was seen before (else None), and what
        ``arguments`` takes as ``signed`` (their key and leaves, so that it works neither out again)."""
        signed = self._signed(args)
        key = signed[0]
        if key is not None and key[0] != "args":  # each argument one array: a key that always hashes
            return self.plans.get(key), signed
        return self._checked.get(key), signed

    def ordered(self, plan: CallPlan, leaves: Sequence) -> list:
        """The leaves of arguments of ``plan``'s signature, in manifest order and typed keys as key data."""
        if plan.order is None:  # the leaves as they are, in order: the common case
            return list(leaves)
        keyed = plan.keyed
        return [to_data(leaves[i]) if i in keyed else leaves[i] for i in plan.order]

    def arguments(
        self,
        args: Sequence,
        runnable: Callable[[], None],
        source: str = "args",
        signed: tuple[tuple | None, Sequence] | None = None,
    ) -> tuple[list, dict[str, int], ArgTrees, CallPlan | None]:
        """``fwd``'s argument pytrees checked: the arrays in manifest order, the dims, the arguments' trees, the plan.

        ``runnable`` refuses a host that cannot run the artifact; it is called after the
        arguments are flattened and before their arrays are checked, the order in which
        their errors have always come. A signature (tree structure, leaf types, shapes,
        dtypes) seen before skips the key paths and checks: its leaves are taken in the
        order its ``CallPlan`` worked out then, typed keys made key data. The plan is
        None where the call makes no signature (it is checked every time). ``signed``:
        what ``planned`` gave for these arguments, if it was asked first.
        """
        key, leaves = self._signed(args) if signed is None else signed
        plan: CallPlan | None = self._checked.get(key)
        if plan is not None:
            runnable()
            return self.ordered(plan, leaves), plan.dims, plan.trees, plan
        flat, trees = flatten_args(self.manifest, args, source)
        runnable()
        arrays, dims = self._check_inputs(flat, source)
        plan = None if key is None else self._arguments_plan(leaves, flat, arrays, dims, trees)
        if plan is not None:
            self._checked.add(key, plan)
        return arrays, dims, trees, plan

    def _signed(self, args: Sequence) -> tuple[tuple | None, Sequence]:
        """The key of ``fwd``'s arguments' plan (None: they make no signature), and their leaves.

        The key is their signature, with their tree where they are not all arrays: arguments
        that are each one array are their own leaves, with no tree to flatten (the signature
        says their number); where each is a concrete jax array, its aval's shape and dtype
        (``avals_key``; ``Artifact.fwd`` keys them so too).
        """
        key = avals_key(args, self.aval_type)
        if key is not None:
            return key, args
        sig = leaves_signature(args)
        if sig is not None:
            if args and all(reads_aval(type(v)) for v in args):
                self.aval_type = type(args[0])
                return avals_key(args, self.aval_type), args
            return ("bare", sig), args
        try:
            leaves, treedef = jax.tree_util.tree_flatten(args)
        except (TypeError, ValueError):  # flatten_args says why, naming the argument
            return None, []
        sig = leaves_signature(leaves)
        return (None if sig is None else ("args", treedef, sig)), leaves

    def _arguments_plan(
        self, leaves: Sequence, flat: dict, arrays: list, dims: dict, trees: ArgTrees
    ) -> CallPlan | None:
        """How ``arguments`` takes a seen signature's leaves; None where the checks changed an array."""
        if len(flat) != len(leaves) or any(a is not flat[k] for a, k in zip(arrays, self.input_keys)):
            return None
        keyed = []
        for i, value in enumerate(flat.values()):
            if value is not leaves[i]:
                if not is_key(leaves[i]):
                    return None
                keyed.append(i)  # a typed key, passed as its key data
        position = {k: i for i, k in enumerate(flat)}
        order: tuple[int, ...] | None = tuple(position[k] for k in self.input_keys)
        if not keyed and order == tuple(range(len(leaves))):
            order = None
        PLANS_MADE[0] += 1
        return CallPlan(order, frozenset(keyed), FrozenDict(dims), tuple(trees))

    def inputs(self, inputs: Mapping[str, Any], source: str = "inputs") -> tuple[list, dict[str, int]]:
        """Check ``inputs`` (flat keys) against the manifest; return the arrays in order and the dims."""
        sig = mapping_signature(inputs)
        key = None if sig is None else ("inputs", sig)
        dims = self._checked.get(key)
        if dims is not None:
            return [inputs[k] for k in self.input_keys], dict(dims)
        arrays, bound = self._check_inputs(inputs, source)
        if key is not None and all(a is inputs[k] for a, k in zip(arrays, self.input_keys)):
            self._checked.add(key, tuple(bound.items()))
        return arrays, bound

    def _check_inputs(self, inputs: Mapping[str, Any], source: str) -> tuple[list, dict[str, int]]:
        m = self.manifest
        check_keys(source, "input", list(self.input_keys), inputs)
        dims = solved_dims(source, "input", m.inputs, [inputs[k] for k in self.input_keys])
        arrays = [check_array(source, "input", leaf, inputs[leaf.key], dims) for leaf in m.inputs]
        return arrays, dims

    def forward_residuals(
        self, arrays: Sequence, stored: Sequence, dims: Mapping[str, int], trees: ArgTrees, plan: CallPlan | None
    ) -> Residuals:
        """The residuals of a forward that ran on ``arrays`` (checked inputs, manifest order), remembered.

        ``stored``: the forward's stored residuals, in order; ``plan``: the arguments' plan, if any.
        """
        m = self.manifest
        by_key = FrozenDict(zip(self.input_keys, arrays))
        res = Residuals.of_forward(
            FrozenDict(zip(self.stored_keys, stored)),
            by_key if self.all_backed else FrozenDict([(k, by_key[k]) for k in self.backed_keys]),
            dims if type(dims) is FrozenDict else FrozenDict(dims),  # a seen signature's dims: frozen already
            by_key,
            m.fingerprint,
            m.arg_names,
            tuple(trees),
            new_run_id(),
        )
        mutable = plan.mutable if plan is not None else None
        if mutable is not None:  # remember(res, plan), in this frame: a forward makes residuals on every call
            self.made.add(res.residuals_id, (weakref.ref(res), mutable, plan))
        else:
            self.remember(res, plan)
        return res

    def remember(self, res: Residuals, plan: CallPlan | None = None) -> None:
        """Note residuals this artifact's forward just made: a backward on them unchanged skips the checks.

        Unchanged means the very object (residuals are immutable: ``replace`` makes
        another) and, for input arrays that can change in place (a NumPy array's shape
        and dtype can be set), the same keys, types, shapes and dtypes. A weak
        reference: the residuals are freed when the caller drops them. ``plan``: the
        arguments' plan the forward ran on (``bwd`` takes the gradients' layout from
        it); its residuals' inputs have one mutable signature, worked out once.
        """
        mutable = plan.mutable if plan is not None else None
        if mutable is None:
            mutable = mutable_signature(res.inputs)
            if plan is not None:
                plan.mutable = mutable
        if mutable is not None:
            self.made.add(res.residuals_id, (weakref.ref(res), mutable, plan))

    def own_residuals(self, res: Any) -> tuple | None:
        """``remember``'s entry ``(ref, mutable, plan)`` if ``res`` is this artifact's forward's own, unchanged.

        None for anything else (checked on the general path, which refuses it by name or checks it).
        """
        if type(res) is not Residuals or res.fingerprint != self.manifest.fingerprint:
            return None
        made = self.made.entries.get(res.residuals_id)  # as _made_here, in one frame: bwd asks on every call
        if made is None or made[0]() is not res or (made[1] and mutable_signature(res.inputs) != made[1]):
            return None
        return made

    def _made_here(self, res: Residuals) -> tuple | None:
        """``remember``'s entry if ``res`` is residuals this artifact's forward made, unchanged since; else None."""
        made = self.made.entries.get(res.residuals_id)
        if made is None or made[0]() is not res:
            return None
        # No mutable signature (): every input is a jax array, whose shape and dtype never change, held in
        # a mapping that refuses changes by residuals that refuse them too. Nothing to read again.
        if made[1] and mutable_signature(res.inputs) != made[1]:
            return None
        return made

    def _check_origin(self, res: Any, source: str) -> None:
        m = self.manifest
        if not isinstance(res, Residuals) or isinstance(res, SplitResiduals):
            what = (
                "residuals of split(), whose backward lives in this process"
                if isinstance(res, Residuals)
                else type(res).__name__
            )
            raise VjpsplitError(f"{source}: expected residuals from an artifact's fwd, got {what}")
        if res.fingerprint != m.fingerprint:
            raise VjpsplitError(
                f"{source}: these residuals were written by another artifact (fingerprint {res.fingerprint[:12]}, "
                f"this artifact is {m.fingerprint[:12]}); run the forward of this artifact to make matching residuals"
            )

    def residuals(self, res: Residuals, source: str = "residuals") -> tuple[list, list, dict[str, int]]:
        """Validate residuals against this artifact; return stored, input-backed arrays and dims."""
        return self.residuals_planned(res, source)[:3]

    def residuals_planned(
        self, res: Residuals, source: str = "residuals"
    ) -> tuple[list, list, dict[str, int], CallPlan | None]:
        """``residuals``, and the plan of the forward call that made them (None: not this artifact's own)."""
        self._check_origin(res, source)
        made = self._made_here(res)
        if made is not None:
            # Exactly what this artifact's fwd returned, in its order (keys, shapes, dtypes, dims): checked then.
            return list(res.stored.values()), list(res.inputs.values()), res.dims, made[2]
        return (*self._residuals_checked(res, source), None)

    def _residuals_checked(self, res: Residuals, source: str) -> tuple[list, list, dict[str, int]]:
        m = self.manifest
        sig = residuals_signature(res.stored, res.inputs, res.dims)
        key = None if sig is None else ("residuals", sig)
        if self._checked.get(key) is not None:
            return (
                [res.stored[k] for k in self.stored_keys],
                [res.inputs[k] for k in self.backed_keys],
                {n: res.dims[n] for n in m.dim_vars},
            )
        stored, inputs, dims = self._check_residuals(res, source)
        if (
            key is not None
            and all(a is res.stored[k] for a, k in zip(stored, self.stored_keys))
            and all(a is res.inputs[k] for a, k in zip(inputs, self.backed_keys))
        ):
            self._checked.add(key, True)
        return stored, inputs, dims

    def _check_residuals(self, res: Residuals, source: str) -> tuple[list, list, dict[str, int]]:
        m = self.manifest
        dims = recorded_dims(m, res.dims, source, "residuals", "rerun the forward")
        check_keys(source, "residual", list(self.stored_keys), res.stored)
        stored = [
            check_array(source, "residual", leaf, res.stored[leaf.key], dict(dims)) for leaf in m.stored_residuals
        ]
        inputs = []
        for leaf in input_backed_leaves(m):
            key = keys.input_of(leaf.key)
            if key not in res.inputs:
                raise VjpsplitError(
                    f"{source}: the residuals need input '{key}', which was left out of the file to avoid a copy; "
                    "pass the forward's inputs (--inputs FILE, or load_residuals(path, inputs=args))"
                )
            inputs.append(
                check_array(res.inputs_source or source, "input", as_input(leaf), res.inputs[key], dict(dims))
            )
        return stored, inputs, dims

    def cotangents(self, cotangents: Mapping[str, Any] | None, dims: Mapping[str, int], ct_source: str) -> list:
        """The cotangents of ``out``'s floating leaves, checked; None: 1 for a floating scalar output."""
        if cotangents is None and self._unit is not None:  # made once the manifest's checks below passed
            return [self._unit]
        m = self.manifest
        ct_leaves = m.cotangent_leaves
        if cotangents is None:
            if len(m.out_keys) != 1 or len(ct_leaves) != 1 or ct_leaves[0].shape != ():
                raise VjpsplitError(
                    f"{self.source}: the output is not a single floating-point scalar, so cotangents are required; "
                    f"pass --cotangents FILE with keys {', '.join(m.out_keys)}"
                )
            if self._unit is None:
                # One for every call, on JAX's default device once rather than copied there by every call;
                # uncommitted, so jax moves it beside arguments committed elsewhere. Made concrete also
                # when the first call is traced under a caller's jit: no tracer is kept.
                with jax.ensure_compile_time_eval():
                    self._unit = jax.device_put(np.ones((), dtype_from_name(ct_leaves[0].dtype)))
                self.units = [self._unit]
            return [self._unit]
        sig = mapping_signature(cotangents)
        key = None if sig is None else ("cotangents", sig, dims_signature(dims))
        if self._checked.get(key) is not None:
            return [cotangents[leaf.key] for leaf in ct_leaves]
        check_keys(ct_source, "cotangent", list(m.out_keys), cotangents)
        cts = [check_array(ct_source, "cotangent", leaf, cotangents[leaf.key], dict(dims)) for leaf in ct_leaves]
        if key is not None and all(a is cotangents[leaf.key] for a, leaf in zip(cts, ct_leaves)):
            self._checked.add(key, True)
        return cts

    # -- the split backward's weight part ------------------------------------------------------
