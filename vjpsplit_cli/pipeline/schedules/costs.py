"""Op times per stage and kind, and the delay of one send: what plans are played and planned under.

``Costs`` is the one form of them: ``play`` and ``simulate`` time plans with it,
``auto`` plans for it, and ``modeled`` bounds what any plan can reach under it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

from ...errors import VjpsplitError
from .ops import Kind, Op


@dataclass(frozen=True)
class Costs:
    """Op times per stage and kind, and the delay of one send between workers (any one unit).

    ``forward[s]`` is stage ``s``'s F, ``backward[s]`` its I (the backward's input
    part), ``weight[s]`` its W; a whole backward, B, costs ``backward[s] + weight[s]``.
    (The dict keys keep their names: ``"B"`` is the input part's time.) ``comm`` delays every result
    that goes to another worker (activations and cotangents between stages on
    different workers; none within a worker, as at ZB-V's turn).

    Attributes:
        forward: Per stage, the time of its F.
        backward: Per stage, the time of its I, the backward's input part.
        weight: Per stage, the time of its W.
        comm: The delay of every result sent to another worker; by default 0.
        transfer: Bytes per second of a residual copy off the device and back, ``(out, back)``
            (``offloading``); ``None``: not measured.
    """

    forward: tuple[float, ...]
    backward: tuple[float, ...]
    weight: tuple[float, ...]
    comm: float = 0.0
    transfer: tuple[float, float] | None = None

    @property
    def num_stages(self) -> int:
        """How many stages the costs describe."""
        return len(self.forward)

    @classmethod
    def of(cls, costs: Costs | Mapping[str, object], num_stages: int) -> Costs:
        """``Costs`` from ``{"F": [...], "B": [...], "W": [...], "comm": c}``, checked against ``num_stages``.

        Each of F, B and W is one time per stage or one number for every stage; a
        missing ``W`` means the backwards are whole (B is all of each); a missing
        ``comm`` means sends take no time.

        Args:
            costs: A ``Costs`` (returned as is once its stage count is checked), or a
                dict with keys ``F``, ``B`` and optionally ``W``, ``comm`` and ``transfer``
                (``gap``, which ``Trainer.costs()`` also gives, is ignored).
            num_stages: The pipeline's stage count.

        Returns:
            The ``Costs``.

        Raises:
            VjpsplitError: If the stage counts differ, ``costs`` is not a dict, has
                unknown keys or lacks ``F`` or ``B``, or a time is not a finite number
                >= 0 or not one per stage.
        """
        if isinstance(costs, Costs):
            if costs.num_stages != num_stages:
                raise VjpsplitError(f"the costs describe {costs.num_stages} stages, the pipeline has {num_stages}")
            return costs
        if not isinstance(costs, Mapping):
            raise VjpsplitError(f"costs must be a dict with keys F, B, W and comm, not {type(costs).__name__}")
        unknown = set(costs) - {"F", "B", "W", "comm", "gap", "transfer"}
        if unknown:
            raise VjpsplitError(
                f"costs has unknown keys {sorted(map(str, unknown))}; use F, B, W, comm and transfer (and gap, "
                "which Trainer.costs() gives and planning ignores)"
            )
        for key in ("F", "B"):
            if key not in costs:
                raise VjpsplitError(f"costs has no {key!r}: give the time of each stage's {key}")
        return cls(
            _per_stage(costs["F"], "F", num_stages),
            _per_stage(costs["B"], "B", num_stages),
            _per_stage(costs.get("W", 0.0), "W", num_stages),
            _number(costs.get("comm", 0.0), "'comm'"),
            None if costs.get("transfer") is None else parse_transfer_rates(costs["transfer"]),
        )

    def duration(self, op: Op) -> float:
        """``op``'s time, by its kind: F ``forward``, I ``backward``, W ``weight``, B (whole) I + W.

        Args:
            op: The operation.

        Returns:
            The operation's time, in the costs' unit.
        """
        s = op.stage
        if op.kind == Kind.F:
            return self.forward[s]
        if op.kind == Kind.I:
            return self.backward[s]
        if op.kind == Kind.B:
            return self.backward[s] + self.weight[s]
        return self.weight[s]


def _number(value: object, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise VjpsplitError(f"costs[{where}] is {value!r}; give a finite time >= 0 (any unit, the same for all)")
    return float(value)


def _per_stage(value: object, key: str, num_stages: int) -> tuple[float, ...]:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return (_number(value, repr(key)),) * num_stages
    if not isinstance(value, Sequence) or isinstance(value, str) or len(value) != num_stages:
        raise VjpsplitError(
            f"costs[{key!r}] must be one time per stage ({num_stages}) or one number for every stage, not {value!r}"
        )
    return tuple(_number(v, f"{key!r}][{s}") for s, v in enumerate(value))


def parse_transfer_rates(value: object) -> tuple[float, float]:
    """``costs["transfer"]`` as (out, back) bytes per second: one number for both ways, or ``{"out":, "back":}``.

    Raises:
        VjpsplitError: for anything else, or a rate that is not a finite number > 0.
    """
    if isinstance(value, Mapping):
        if set(value) != {"out", "back"}:
            raise VjpsplitError(
                f"costs['transfer'] is {value!r}; give bytes/s as a number or {{'out': .., 'back': ..}}"
            )
        pair = (value["out"], value["back"])
    else:
        pair = (value, value)
    for v in pair:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise VjpsplitError(f"costs['transfer'] has {v!r}; give bytes per second, a finite number > 0")
    return float(pair[0]), float(pair[1])
