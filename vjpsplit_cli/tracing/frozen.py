"""Read-only containers for what a forward keeps: ``FrozenDict`` (a pytree) and ``Frozen`` (fields set once).

Owns the immutability that ``residuals``' types share: mappings that refuse changes and
register as dict-like pytrees, and a base whose fields are set in ``__init__`` only, with
``replace`` for a changed copy.
"""

from __future__ import annotations

from typing import Any, Iterable, NoReturn, Self

import jax
from jax.tree_util import DictKey


class FrozenDict(dict[str, Any]):
    """A dict that refuses changes: the mappings of residuals and intermediates.

    A pytree like a dict (keys in insertion order), so ``jax.device_put(res.stored)``
    and ``jax.tree.map`` work on it; ``dict(...)`` makes a changeable copy.
    """

    __slots__ = ()

    def _refuse(self, *args: object, **kwargs: object) -> NoReturn:
        raise TypeError("residual mappings are read-only; make a changed copy with .replace(...)")

    __setitem__ = __delitem__ = __ior__ = _refuse
    update = pop = popitem = clear = setdefault = _refuse

    def __reduce__(self) -> tuple[type[FrozenDict], tuple[dict[str, Any]]]:
        return (FrozenDict, (dict(self),))  # pickle and copy rebuild it whole, never item by item


def _frozen_from(keys: tuple[str, ...], values: Iterable[Any]) -> FrozenDict:
    return FrozenDict(zip(keys, values))


jax.tree_util.register_pytree_with_keys(
    FrozenDict,
    lambda d: ([(DictKey(k), v) for k, v in d.items()], tuple(d)),
    _frozen_from,
    lambda d: (list(d.values()), tuple(d)),
)


class Frozen:
    """Immutable after ``__init__``: a changed copy comes from ``replace``."""

    __slots__ = ()
    _FIELDS: tuple[str, ...] = ()

    def __setattr__(self, name: str, value: object) -> NoReturn:
        raise AttributeError(f"{type(self).__name__} is immutable; make a changed copy with .replace({name}=...)")

    def _set(self, **fields: Any) -> None:
        for name, value in fields.items():
            object.__setattr__(self, name, value)

    def replace(self, **changes: Any) -> Self:
        """A copy with ``changes`` (the arrays are shared, not copied).

        Args:
            **changes: New values of fields, by field name; the other fields are kept.

        Returns:
            A new object of the same type.
        """
        fields = {name: getattr(self, name) for name in self._FIELDS}
        fields.update(changes)
        return type(self)(**fields)
