"""Calls already checked: the signatures whose checks passed, so that a repeated call skips them.

Every check a call gets before and after a module runs (keys, dtypes, shapes, the dims
they bind, typed keys' impls; the module's results against its declared avals) is a
function of the call's *signature*: the pytree structure (with a dict's keys), each
leaf's array type, shape and dtype, the dims; and, for the kernel checks at call
shapes, each argument's sharding. Weak types and committed devices change no check
(the module's results have the dtypes it declares either way): they are not part of
it. ``CheckedCalls`` keeps the signatures whose checks passed, and what those checks worked
out (the arrays' order, the dims), so a call with a signature seen before runs its
module straight away. A signature that failed is never kept: a repeated bad call gets
every check again, and the same error.

A signature holds values only, never an object's ``id``: an id is reused once its
object is collected, so a cache keyed on one could take a new object for an old one.
Only NumPy and concrete ``jax.Array`` leaves make a signature (``leaves_signature``);
anything else (Python scalars, tracers, array-likes) is checked on every call, as is a
signature whose checks changed an array (a cast Python scalar, a bfloat16 read as void).

What stays per call is what no signature can say: which artifact made a set of
residuals (its fingerprint), which forward run and microbatch (``residuals_id``, the
dims), whether this host can run the artifact now.
"""

from __future__ import annotations

import itertools
import os
import sys
import threading
from collections import OrderedDict
from typing import Any, Hashable, Iterable, Iterator, Sequence

import jax
import numpy as np

CHECKED_KEPT = 128  # signatures remembered per artifact: a handful of shapes in a loop; bounded all the same

# type -> how it makes a signature (_NONE, _ATTRS, _AVAL); types live as long as the process
_ARRAY_TYPES: dict[type, int] = {}
_NONE, _ATTRS, _AVAL = 0, 1, 2


def _signature_kind(t: type) -> int:
    kind = _ARRAY_TYPES.get(t)
    if kind is None:
        # A tracer is inside a caller's jit: checked at trace time, once per trace anyway.
        kind = _NONE
        if issubclass(t, (np.ndarray, jax.Array)) and not issubclass(t, jax.core.Tracer):
            kind = _AVAL if reads_aval(t) else _ATTRS
        if len(_ARRAY_TYPES) < 256:
            _ARRAY_TYPES[t] = kind
    return kind


def reads_aval(t: type) -> bool:
    """Whether ``t`` is jax's concrete array type, whose ``shape`` and ``dtype`` are its aval's.

    Its ``aval`` is a C++ attribute, and ``shape`` and ``dtype`` are Python properties
    that read it: the aval's own cost a third as much per leaf. jax does not export the
    type, so it is known by name (``tests/test_checked_calls.py`` holds both readings
    equal on jax's arrays).
    """
    return t.__name__ == "ArrayImpl" and t.__module__.startswith("jaxlib") and hasattr(t, "aval")


def leaves_signature(leaves: Iterable[Any]) -> tuple | None:
    """What every check of these leaves depends on: each one's array type, shape and dtype.

    None if some leaf makes no signature (only a NumPy array or a concrete ``jax.Array`` does).
    """
    out = []
    for v in leaves:
        t = type(v)
        kind = _ARRAY_TYPES.get(t) or _signature_kind(t)
        if kind == _AVAL:
            a = v.aval
            out.append((t, a.shape, a.dtype))
        elif kind:
            out.append((t, v.shape, v.dtype))
        else:
            return None
    return tuple(out)


def placed_signature(leaves: Sequence[Any]) -> tuple | None:
    """``leaves_signature`` with each array's sharding: what a check of kernels at call shapes also reads."""
    sig = leaves_signature(leaves)
    return None if sig is None else (sig, tuple(getattr(v, "sharding", None) for v in leaves))


_IMMUTABLE: dict[type, bool] = {}  # type -> whether its arrays never change shape or dtype


def _immutable(t: type) -> bool:
    ok = _IMMUTABLE.get(t)
    if ok is None:
        ok = issubclass(t, jax.Array) and not issubclass(t, jax.core.Tracer)
        if len(_IMMUTABLE) < 256:
            _IMMUTABLE[t] = ok
    return ok


def mutable_signature(values: Any) -> tuple | None:
    """``(key, type, shape, dtype)`` of the values that can change in place (all but concrete jax arrays).

    A NumPy array's shape and dtype can be set on the array itself; a ``jax.Array``'s
    never change. None when some value has no shape or dtype.
    """
    out = []
    for k, v in values.items():
        t = type(v)
        if _IMMUTABLE.get(t) or _immutable(t):
            continue
        try:
            out.append((k, t, v.shape, v.dtype))
        except AttributeError:
            return None
    return tuple(out)


def mapping_signature(values: Any) -> tuple | None:
    """``(key, type, shape, dtype)`` of every item of a plain dict, in its order; None for any other mapping.

    Only a dict: another mapping (an ``.npz`` file) may make its values afresh on each read.
    """
    if not isinstance(values, dict):
        return None
    out = []
    for k, v in values.items():
        t = type(v)
        kind = _ARRAY_TYPES.get(t) or _signature_kind(t)
        if kind == _AVAL:
            a = v.aval
            out.append((k, t, a.shape, a.dtype))
        elif kind:
            out.append((k, t, v.shape, v.dtype))
        else:
            return None
    return tuple(out)


def dims_signature(dims: Any) -> tuple | None:
    """Recorded dims with each value's type: ``2.0 == 2`` and ``True == 1``, but only an int is a valid dim."""
    try:
        return tuple((k, type(v), v) for k, v in dims.items())
    except (AttributeError, TypeError):
        return None


def residuals_signature(stored: Any, inputs: Any, dims: Any, *more: Any) -> tuple | None:
    """The signature of residuals (or intermediates): each mapping's items, then the dims with their types."""
    parts = []
    for values in (stored, inputs, *more):
        s = mapping_signature(values)
        if s is None:
            return None
        parts.append(s)
    d = dims_signature(dims)
    return None if d is None else (*parts, d)


class CheckedCalls:
    """Signatures whose checks passed, each with what the checks worked out; bounded, safe across threads.

    Look-ups are plain dict reads; additions take a lock and drop the oldest entry
    past ``limit``. Two threads checking one new signature at once both check it.
    """

    def __init__(self, limit: int = CHECKED_KEPT) -> None:
        self._limit = limit
        self.entries: OrderedDict[Hashable, Any] = OrderedDict()  # read in place where a key surely hashes
        self._lock = threading.Lock()

    def get(self, key: Hashable | None) -> Any:
        """What was kept for ``key``; None when it was never seen, failed, or was dropped (or ``key`` is None)."""
        if key is None:
            return None
        try:
            return self.entries.get(key)
        except TypeError:  # an unhashable part (a sharding of a type without __hash__): not seen
            return None

    def add(self, key: Hashable | None, value: Any) -> None:
        """Keep ``value`` for ``key`` (a signature whose checks just passed); None keys are ignored."""
        if key is None or value is None:
            return
        with self._lock:
            try:
                self.entries[key] = value
            except TypeError:
                return
            while len(self.entries) > self._limit:
                self.entries.popitem(last=False)  # the oldest, at once (a dict skips its deleted slots)

    def clear(self) -> None:
        """Forget every signature (what the checks depend on changed)."""
        with self._lock:
            self.entries.clear()


# Whether the GIL serialises C calls: a free-threaded build has none, and takes locks instead.
_GIL = getattr(sys, "_is_gil_enabled", lambda: True)()


class Recent:
    """The values noted last by string key (one per forward: its run id), at most ``limit``; safe across threads.

    ``CheckedCalls`` for keys a forward makes on every call: a ``str`` hashes and compares in C,
    so under the GIL the ordered dict's own operations need no lock of ours (the oldest
    entry leaves at once past ``limit``). Free-threaded builds take the lock.
    """

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self.entries: OrderedDict[str, Any] = OrderedDict()  # read by ``get`` in place, on every backward
        self._lock = threading.Lock()

    def add(self, key: str, value: Any) -> None:
        """Keep ``value`` for ``key``, dropping the oldest entry past ``limit``."""
        entries = self.entries
        if not _GIL:
            with self._lock:
                entries[key] = value
                if len(entries) > self._limit:
                    entries.popitem(last=False)
            return
        entries[key] = value
        if len(entries) > self._limit:
            try:
                entries.popitem(last=False)
            except KeyError:  # emptied by another thread between the two
                pass

    def get(self, key: str) -> Any:
        """What was kept for ``key``; None when never noted or dropped since."""
        return self.entries.get(key)


# One forward run's id: unique in this process (a counter) and across processes (a random
# prefix), 32 hex digits like the uuid4 it replaces, without a system call per forward.
# ``next`` on a ``map`` over ``itertools.count`` runs in C from end to end: under the GIL no
# other thread can take the same number, without a lock to take per forward.
def _run_ids() -> Iterator[str]:
    return map(f"{os.urandom(8).hex()}%016x".__mod__, itertools.count())


class _Runs:
    ids = _run_ids()


def _new_prefix() -> None:
    _Runs.ids = _run_ids()


os.register_at_fork(after_in_child=_new_prefix)  # a forked child must not repeat its parent's ids


def new_run_id() -> str:
    """A fresh ``residuals_id``: 32 hex digits, never the same twice."""
    return next(_Runs.ids)


if not _GIL:  # a free-threaded build: no GIL to serialise ``next``
    _run_id_lock = threading.Lock()

    def new_run_id() -> str:  # noqa: F811  (the same function, with the lock the GIL gave)
        """A fresh ``residuals_id``: 32 hex digits, never the same twice."""
        with _run_id_lock:
            return next(_Runs.ids)
