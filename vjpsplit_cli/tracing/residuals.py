"""What a forward keeps for its backward: ``Residuals``, ``SplitResiduals`` and ``Intermediates``.

Immutable pytrees whose key paths are the keys their files use (``r/0``,
``in/x``, ``c/0``); the files themselves are module ``residual_files``.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping, Sequence

import jax
import numpy as np
from jax.tree_util import DictKey

from ..errors import VjpsplitError
from ..files import keys
from ..files.trees import ArgTree, ArgTrees
from .frozen import Frozen
from .frozen import FrozenDict
from .vjp import Plan


class Residuals(Frozen):
    """What a forward kept for its backward: stored arrays, and references to input arrays.

    Immutable (read-only mappings; ``replace`` makes a changed copy) and a pytree whose key paths are the file keys
    (``r/0``, ``in/x``), so it passes through ``jax.jit`` and ``jax.device_put``; ``split``'s are ``SplitResiduals``.

    Args:
        stored: The stored residuals, by ``r/i`` key.
        inputs: The input-backed residuals, by input key: the very arrays the forward was given (never copies).
        dims: The values of the symbolic dimensions, by name; ``None`` means none.
        fingerprint: The fingerprint of the artifact that made them; ``""`` when not known.
        arg_names: The artifact's argument names.
        arg_trees: The forward's argument structure (gradients come in the caller's pytree types); ``()`` if unknown.
        plan: The in-memory backward of ``split``; ``None`` for an artifact's residuals.
        residuals_id: Names one forward run (the weight part refuses another run's intermediates); ``""`` if unknown.
        inputs_source: Where the input-backed arrays came from, for messages; ``None`` if not known.
        source: The file the residuals were loaded from, for messages; ``None`` if not known.
        bound_inputs: Every input the forward ran on (references, keyed like ``inputs``), read by the backward or not;
            ``None`` means none.
    """

    _FIELDS = (
        "stored",
        "inputs",
        "dims",
        "fingerprint",
        "arg_names",
        "arg_trees",
        "plan",
        "residuals_id",
        "inputs_source",
        "source",
        "bound_inputs",
    )
    __slots__ = (*_FIELDS, "__weakref__")  # an artifact notes the residuals its fwd made without keeping them
    stored: FrozenDict
    inputs: FrozenDict
    dims: FrozenDict
    fingerprint: str
    arg_names: tuple[str, ...]
    arg_trees: tuple[ArgTree, ...]
    plan: Plan | None
    residuals_id: str
    inputs_source: str | None
    source: str | None
    bound_inputs: FrozenDict

    def __init__(
        self,
        stored: Mapping[str, Any],
        inputs: Mapping[str, Any],
        *,
        dims: Mapping[str, int] | None = None,
        fingerprint: str = "",
        arg_names: Sequence[str] = (),
        arg_trees: ArgTrees = (),
        plan: Plan | None = None,
        residuals_id: str = "",
        inputs_source: str | None = None,
        source: str | None = None,
        bound_inputs: Mapping[str, Any] | None = None,
    ) -> None:
        put = object.__setattr__  # field by field, not through _set: an artifact's fwd makes one per call
        put(self, "stored", FrozenDict(stored))
        put(self, "inputs", FrozenDict(inputs))
        put(self, "dims", FrozenDict(dims or ()))
        put(self, "fingerprint", fingerprint)
        put(self, "arg_names", tuple(arg_names))
        # The structure of the arguments fwd was called with, so bwd can give
        # gradients in the caller's own pytree types; () when not known (files).
        put(self, "arg_trees", tuple(arg_trees))
        put(self, "plan", plan)
        # Names one forward run, so the weight part can refuse another run's
        # intermediates; "" where unknown. Not part of the pytree's static data,
        # where a per-run value would make every jit over residuals retrace.
        put(self, "residuals_id", residuals_id)
        put(self, "inputs_source", inputs_source)  # where the input-backed arrays came from, for messages
        put(self, "source", source)  # the file they were loaded from, for messages
        # Every input the forward ran on (references, keyed like ``inputs``), read by the
        # backward or not: a residuals file records each one's shape and CRC-32, so the
        # backward refuses another microbatch's inputs even where it never reads them.
        # Not pytree data: residuals rebuilt by a pytree operation bind only ``inputs``.
        put(self, "bound_inputs", FrozenDict(bound_inputs or ()))

    @classmethod
    def of_forward(
        cls,
        stored: FrozenDict,
        inputs: FrozenDict,
        dims: FrozenDict,
        bound_inputs: FrozenDict,
        fingerprint: str,
        arg_names: tuple[str, ...],
        arg_trees: tuple[ArgTree, ...],
        residuals_id: str,
    ) -> "Residuals":
        """Residuals an artifact's forward just made, from mappings it froze itself: nothing is copied.

        The same fields as ``Residuals(...)`` gives (no plan, no sources); a forward makes one per call.

        Args:
            stored: The stored residuals, already frozen.
            inputs: The input-backed residuals, already frozen.
            dims: The symbolic dimensions' values, already frozen.
            bound_inputs: Every input the forward ran on, already frozen.
            fingerprint: The artifact's fingerprint.
            arg_names: The artifact's argument names.
            arg_trees: The structure of the arguments the forward was called with.
            residuals_id: The id of this forward run.

        Returns:
            The new ``Residuals`` (of ``cls``), holding the given mappings themselves.
        """
        res = object.__new__(cls)
        # Each slot's own setter, called in turn: a forward makes one of these per call.
        s0, s1, s2, s3, s4, s5, s6, s7, s8, s9, s10 = _SETTERS
        s0(res, stored)
        s1(res, inputs)
        s2(res, dims)
        s3(res, bound_inputs)
        s4(res, fingerprint)
        s5(res, arg_names)
        s6(res, arg_trees)
        s7(res, residuals_id)
        s8(res, None)
        s9(res, None)
        s10(res, None)
        return res

    def __repr__(self) -> str:
        owner = (
            "split"
            if isinstance(self, SplitResiduals)
            else f"fingerprint={self.fingerprint[:12]}, dims={dict(self.dims)}"
        )
        return f"{type(self).__name__}(stored={len(self.stored)}, input_backed={len(self.inputs)}, {owner})"

    def signature(self) -> tuple[tuple[Any, ...], ...] | None:
        """Keys, shapes, dtypes and array types of the arrays, and the dims; None if some value is not an array.

        Returns:
            A tuple of three tuples: ``(key, shape, dtype, type)`` of each stored array,
            the same of each input-backed array, and the ``(name, value)`` pairs of the
            dims; ``None`` if some value has no shape or dtype.
        """
        try:
            return (
                tuple([(k, v.shape, v.dtype, type(v)) for k, v in self.stored.items()]),
                tuple([(k, v.shape, v.dtype, type(v)) for k, v in self.inputs.items()]),
                tuple(self.dims.items()),
            )
        except AttributeError:
            return None

    @property
    def stored_nbytes(self) -> int:
        """Bytes of the stored (not input-backed) residuals."""
        return sum(int(np.prod(np.shape(a))) * np.dtype(a.dtype).itemsize for a in self.stored.values())


# The slot setters ``of_forward`` fills a new object with, every field once, in this order.
_FORWARD_FIELDS = (
    "stored",
    "inputs",
    "dims",
    "bound_inputs",
    "fingerprint",
    "arg_names",
    "arg_trees",
    "residuals_id",
    "plan",
    "inputs_source",
    "source",
)
assert sorted(_FORWARD_FIELDS) == sorted(Residuals._FIELDS)
_SETTERS = tuple(getattr(Residuals, name).__set__ for name in _FORWARD_FIELDS)


class SplitResiduals(Residuals):
    """Residuals of ``split``'s forward: their backward (``plan``) lives in this process's memory.

    Their input keys are flat argument positions; they load only in the process
    that made them (``load_residuals`` refuses them elsewhere).

    Args:
        stored: The stored residuals, by ``r/i`` key.
        inputs: The input-backed residuals, by flat argument position (as a string).
        plan: The backward of the forward that made them (required).
        **fields: The other keyword fields of ``Residuals``.

    Raises:
        VjpsplitError: If ``plan`` is ``None``.
    """

    __slots__ = ()
    plan: Plan

    def __init__(self, stored: Mapping[str, Any], inputs: Mapping[str, Any], *, plan: Plan, **fields: Any) -> None:
        if plan is None:
            raise VjpsplitError("SplitResiduals need the plan of the forward that made them")
        super().__init__(stored, inputs, plan=plan, **fields)


def _residuals_aux(r: Residuals) -> tuple[Any, ...]:
    return (
        tuple(r.stored),
        tuple(r.inputs),
        tuple(sorted(r.dims.items())),
        r.fingerprint,
        r.arg_names,
        r.arg_trees,
        r.plan,
    )


def _residuals_keys(r: Residuals) -> tuple[list[tuple[DictKey, Any]], tuple[Any, ...]]:
    # Key paths are the file keys: r/0 for stored residuals, in/<input key> for input-backed ones.
    children = [(DictKey(k), v) for k, v in r.stored.items()] + [
        (DictKey(keys.input_backed(k)), v) for k, v in r.inputs.items()
    ]
    return children, _residuals_aux(r)


def _residuals_flat(r: Residuals) -> tuple[list[Any], tuple[Any, ...]]:
    # Every jit call, device_put and tree_leaves of residuals flattens them: no key paths made, the aux once.
    return [*r.stored.values(), *r.inputs.values()], _residuals_aux(r)


def _residuals_from(cls: type[Residuals]) -> Callable[[tuple[Any, ...], Iterable[Any]], Residuals]:
    def unflatten(aux: tuple[Any, ...], leaves: Iterable[Any]) -> Residuals:
        children = list(leaves)
        n = len(aux[0])
        return cls(
            dict(zip(aux[0], children[:n])),
            dict(zip(aux[1], children[n:])),
            dims=dict(aux[2]),
            fingerprint=aux[3],
            arg_names=aux[4],
            arg_trees=aux[5],
            plan=aux[6],
        )

    return unflatten


for _cls in (Residuals, SplitResiduals):
    jax.tree_util.register_pytree_with_keys(
        _cls,
        _residuals_keys,
        _residuals_from(_cls),
        _residuals_flat,
    )


class Intermediates(Frozen):
    """What the input part of a split backward hands to the weight part.

    Holding these alone, a stage can free the rest of a microbatch's residuals as soon as B has run. Immutable, and
    a pytree whose key paths are the intermediates file's keys (``c/0``, ``r/1``, ``in/x``).

    Args:
        arrays: What B computed for W, by ``c/i`` key.
        dims: The values of the symbolic dimensions, by name.
        fingerprint: The fingerprint of the artifact whose backward made them.
        residuals_id: The forward run whose residuals the input part read; ``""`` when not known.
        stored: The stored residuals W reads, by ``r/i`` key (references, not copies); ``None`` means none.
        inputs: The input-backed residuals W reads, by input key (the caller's own arrays); ``None`` means none.
        arg_trees: The forward's argument structure, when known (in memory only); ``()`` otherwise.
    """

    _FIELDS = ("arrays", "dims", "fingerprint", "residuals_id", "stored", "inputs", "arg_trees")
    __slots__ = _FIELDS
    arrays: FrozenDict
    dims: FrozenDict
    fingerprint: str
    residuals_id: str
    stored: FrozenDict
    inputs: FrozenDict
    arg_trees: tuple[ArgTree, ...]

    def __init__(
        self,
        arrays: Mapping[str, Any],
        dims: Mapping[str, int],
        fingerprint: str,
        residuals_id: str = "",
        stored: Mapping[str, Any] | None = None,
        inputs: Mapping[str, Any] | None = None,
        arg_trees: ArgTrees = (),
    ) -> None:
        self._set(
            arrays=FrozenDict(dict(arrays)),
            stored=FrozenDict(dict(stored or {})),
            inputs=FrozenDict(dict(inputs or {})),
            dims=FrozenDict(dict(dims)),
            fingerprint=fingerprint,
            residuals_id=residuals_id,  # the forward run whose residuals the input part read; "" unknown
            arg_trees=tuple(arg_trees),
        )  # the forward's argument structure, when known (in memory only)

    def __repr__(self) -> str:
        return (
            f"Intermediates({len(self.arrays)} arrays, {len(self.stored)} residuals, {len(self.inputs)} inputs, "
            f"dims={dict(self.dims)}, fingerprint={self.fingerprint[:12]})"
        )


def _intermediates_keys(r: Intermediates) -> tuple[list[tuple[DictKey, Any]], tuple[Any, ...]]:
    children = (
        [(DictKey(k), v) for k, v in r.arrays.items()]
        + [(DictKey(k), v) for k, v in r.stored.items()]
        + [(DictKey(keys.input_backed(k)), v) for k, v in r.inputs.items()]
    )
    aux = (tuple(r.arrays), tuple(r.stored), tuple(r.inputs), tuple(sorted(r.dims.items())), r.fingerprint, r.arg_trees)
    return children, aux


def _intermediates_from(aux: tuple[Any, ...], leaves: Iterable[Any]) -> Intermediates:
    children = list(leaves)
    a, b = len(aux[0]), len(aux[0]) + len(aux[1])
    return Intermediates(
        dict(zip(aux[0], children[:a])),
        dict(aux[3]),
        aux[4],
        "",
        dict(zip(aux[1], children[a:b])),
        dict(zip(aux[2], children[b:])),
        arg_trees=aux[5],
    )


jax.tree_util.register_pytree_with_keys(
    Intermediates,
    _intermediates_keys,
    _intermediates_from,
    lambda r: ([v for _, v in _intermediates_keys(r)[0]], _intermediates_keys(r)[1]),
)
