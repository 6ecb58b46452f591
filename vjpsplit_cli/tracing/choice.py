"""Choosing a policy: under a memory budget, by measuring (``auto``), and one resolution of both.

``choose_policy`` takes the policy that recomputes least among those whose stored
residuals fit a memory budget; ``choose_auto`` compiles and times the fixed
policies that fit and picks the fastest forward + backward; ``resolve_policy``
turns what a caller gave (a policy, a budget, auto, sizes) into the concrete
policy and why, for split, export and the CLI.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import jax
import numpy as np

from ..errors import VjpsplitError
from ..files.shapes import is_symbolic_shape
from ..files.sizes import AtSizes, human_bytes, parse_at, parse_bytes
from .policies import AUTO, BUDGET_ORDER, PolicyCost, normalize_policy, policy_cost
from .signatures import Wrt, fn_wrt_positions
from .specs import concrete_specs
from .timing import time_policies


@dataclass(frozen=True)
class AutoChoice:
    """What ``policy="auto"`` chose and why: every candidate's stored bytes and forward + backward time.

    Attributes:
        policy: The concrete policy chosen (never ``"auto"``).
        method: How the times were had: ``"measured"`` (timed compiled candidates),
            ``"estimated"`` (XLA's cost analysis) or ``"only fit"`` (one candidate fits the budget).
        seconds: Median forward + backward seconds (or XLA's score) by candidate; fitting ones only.
        stored_bytes: Stored residual bytes by candidate.
        budget: The memory budget in bytes; ``None`` when none was given.
        at: The sizes of the symbolic dims the candidates were measured at.
    """

    policy: str  # the concrete policy chosen (never "auto")
    method: str  # "measured" (timed compiled candidates), "estimated" (XLA cost analysis)
    #                                      or "only fit" (one candidate fits the budget)
    seconds: dict[str, float]  # candidate -> median fwd+bwd seconds (or XLA's estimate); fitting ones only
    stored_bytes: dict[str, int]  # candidate -> stored residual bytes
    budget: int | None = None
    at: dict[str, int] = field(default_factory=dict)

    @property
    def reason(self) -> str:
        """One line: the choice, the measured (or estimated) times of all candidates, what the budget excluded."""
        what = {
            "measured": "fwd+bwd measured here",
            "estimated": "fwd+bwd estimated by XLA's cost analysis",
            "only fit": "the only policy that fits",
        }[self.method]
        best = self.seconds[self.policy]
        parts: list[str] = []
        for p, b in self.stored_bytes.items():
            if p in self.seconds:
                t = self.seconds[p]
                unit = f"{t * 1e3:.2f} ms" if self.method == "measured" else f"score {t:.3g}"
                timing = "" if self.method == "only fit" else f"{unit} ({t / best:.2f}x), "
                parts.append(f"{p} {timing}stores {human_bytes(b)}")
            else:
                parts.append(f"{p} stores {human_bytes(b)}, over the budget")
        sizes = f" at {', '.join(f'{k}={v}' for k, v in self.at.items())}" if self.at else ""
        budget = f" within {human_bytes(self.budget)}" if self.budget is not None else ""
        return f"auto chose {self.policy}{budget}{sizes}: {what}: " + "; ".join(parts)

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict.

        Returns:
            The fields by name, and ``reason``.
        """
        return {
            "policy": self.policy,
            "method": self.method,
            "seconds": self.seconds,
            "stored_bytes": self.stored_bytes,
            "budget": self.budget,
            "at": self.at,
            "reason": self.reason,
        }


_AUTO_CACHE: dict[tuple[Any, ...], AutoChoice] = {}


def _concrete(specs: tuple[Any, ...], at: dict[str, int]) -> tuple[Any, ...]:
    """``specs`` at the sizes ``at`` gives their symbolic dims, as plain ``ShapeDtypeStruct`` pytrees."""
    symbolic = any(is_symbolic_shape(s.shape) for s in jax.tree_util.tree_leaves(specs))
    if symbolic:
        if not at:
            raise VjpsplitError(
                "policy auto measures each policy at concrete sizes; pass --at NAME=SIZE "
                "(the at= argument in Python), e.g. b=256, with the sizes you will run"
            )
        specs = concrete_specs(specs, at)
    return tuple(jax.tree_util.tree_map(lambda s: jax.ShapeDtypeStruct(np.shape(s), s.dtype), s) for s in specs)


def _remembered(memo: tuple[Any, ...]) -> tuple[tuple[Any, ...] | None, AutoChoice | None]:
    """The key to remember a choice under (None for an unhashable callable: no memo), and the choice remembered."""
    try:
        return memo, _AUTO_CACHE.get(memo)
    except TypeError:  # an unhashable callable: no memo
        return None, None


def _fitting(policies: Sequence[str], stored: dict[str, int], budget: int | None) -> list[str]:
    """The policies whose stored bytes fit ``budget``; refused where none does."""
    fitting = [p for p in policies if budget is None or stored[p] <= budget]
    if not fitting:
        best = min(stored, key=lambda p: stored[p])
        raise VjpsplitError(
            f"no policy fits a memory budget of {human_bytes(budget or 0)}: the smallest is {best!r} storing "
            f"{human_bytes(stored[best])}; raise the budget or use smaller sizes"
        )
    return fitting


def _fastest(fitting: Sequence[str], seconds: dict[str, float], stored: dict[str, int]) -> str:
    """The fastest policy; within 1% of the fastest is a tie (timer noise), which the one that stores least wins."""
    fastest = min(seconds.values())
    return min((p for p in fitting if seconds[p] <= fastest * 1.01), key=lambda p: (stored[p], seconds[p]))


def choose_auto(
    fn: Callable[..., Any],
    *specs: Any,
    wrt: Wrt = None,
    has_aux: bool = False,
    at: AtSizes = None,
    memory_budget: int | str | None = None,
    policies: Sequence[str] = BUDGET_ORDER,
    method: str = "measure",
    seconds_per_candidate: float = 0.5,
) -> AutoChoice:
    """``policy="auto"``: the policy whose forward + backward is fastest at these sizes, among those that fit.

    Args:
        fn: The function, as ``split`` takes it.
        *specs: Its arguments' shapes and dtypes (``jax.ShapeDtypeStruct`` pytrees).
        wrt: The argument positions or names to differentiate; ``None`` means all.
        has_aux: Whether ``fn`` returns ``(out, aux)``.
        at: Sizes of the symbolic dims (``{"b": 256}`` or ``["b=256"]``); needed when ``specs`` have symbolic dims.
        memory_budget: Bytes (or ``"64MiB"``) the stored residuals may take; ``None`` lets every candidate compete.
        policies: The candidates (by default ``everything``, ``dots``, ``nothing``).
        method: ``"measure"`` times compiled candidates here on synthetic inputs (medians of interleaved rounds);
            ``"estimate"`` scores them by XLA's cost analysis (also the fallback when running fails).
        seconds_per_candidate: About how long to time each candidate when measuring.

    Returns:
        The ``AutoChoice``: the policy chosen, how, and every candidate's bytes and times (remembered for the
        process per function, shapes, ``wrt`` and budget).

    Raises:
        VjpsplitError: If symbolic dims lack ``at``, ``at`` or ``memory_budget`` is malformed, or nothing fits.
    """
    at = parse_at(at)
    budget = None if memory_budget is None else parse_bytes(memory_budget)
    specs = _concrete(specs, at)
    wrt_pos, single = fn_wrt_positions(fn, wrt, len(specs))
    shapes = tuple((tuple(s.shape), str(s.dtype)) for s in jax.tree_util.tree_leaves(specs))
    tree = str(jax.tree_util.tree_structure(specs))
    key, hit = _remembered((fn, tree, shapes, wrt_pos, single, has_aux, budget, tuple(policies), method))
    if hit is not None:
        return hit
    # Every dim is concrete here (_concrete above), so every size is known.
    stored = {
        p: bytes_known(policy_cost(fn, *specs, policy=p, wrt=wrt_pos, has_aux=has_aux, flops=False)) for p in policies
    }
    fitting = _fitting(policies, stored, budget)
    if len(fitting) == 1:
        seconds, used = {fitting[0]: 1.0}, "only fit"
    else:
        seconds, used = time_policies(fn, specs, fitting, (wrt_pos, single, has_aux), method, seconds_per_candidate)
    choice = AutoChoice(_fastest(fitting, seconds, stored), used, seconds, stored, budget, dict(at))
    if key is not None:
        _AUTO_CACHE[key] = choice
    return choice


def choose_policy(
    fn: Callable[..., Any],
    *specs: Any,
    memory_budget: int | str,
    wrt: Wrt = None,
    has_aux: bool = False,
    at: AtSizes = None,
    policies: Sequence[str] = BUDGET_ORDER,
) -> tuple[str, PolicyCost]:
    """The policy that recomputes least among those whose stored residual bytes fit the budget.

    Args:
        fn: The function, as ``split`` takes it.
        *specs: Its arguments' shapes and dtypes (``jax.ShapeDtypeStruct`` pytrees).
        memory_budget: The most bytes the stored residuals may take (an int or a string such as ``"64MiB"``).
        wrt: The argument positions or names to differentiate; ``None`` means all.
        has_aux: Whether ``fn`` returns ``(out, aux)``.
        at: Sizes of the symbolic dims to weigh the residuals at; needed when ``specs``
            have symbolic dims, else ``None``.
        policies: The candidates, least recompute first (by default ``everything``, ``dots``, ``nothing``).

    Returns:
        The pair ``(policy, cost)``: the first of ``policies`` that fits, and its ``PolicyCost``.

    Raises:
        VjpsplitError: If symbolic dims lack sizes in ``at``, if ``at`` or
            ``memory_budget`` is malformed, or if no policy fits the budget.
    """
    budget = parse_bytes(memory_budget)
    at = parse_at(at)
    symbolic = any(is_symbolic_shape(s.shape) for s in jax.tree_util.tree_leaves(specs))
    if symbolic and not at:
        raise VjpsplitError(
            "a memory budget needs sizes for the symbolic dims to weigh the residuals; pass --at NAME=SIZE "
            "(the at= argument in Python), e.g. b=256, with the largest sizes you will run"
        )
    costs: list[PolicyCost] = []
    for p in policies:
        cost = policy_cost(fn, *specs, policy=p, wrt=wrt, has_aux=has_aux, at=at, flops=False)
        if bytes_known(cost) <= budget:
            return p, cost
        costs.append(cost)
    best = min(costs, key=bytes_known)
    where = f" at {', '.join(f'{k}={v}' for k, v in at.items())}" if at else ""
    raise VjpsplitError(
        f"no policy fits a memory budget of {human_bytes(budget)}{where}: the smallest is {best.policy!r} "
        f"storing {human_bytes(bytes_known(best))}; raise the budget or use smaller sizes"
    )


def bytes_known(cost: PolicyCost) -> int:
    """``cost.stored_bytes``, which is known once every symbolic dim has a size."""
    if cost.stored_bytes is None:
        raise VjpsplitError(
            "a memory budget needs a size for every symbolic dim; pass --at NAME=SIZE (at= in Python) for each"
        )
    return cost.stored_bytes


@dataclass(frozen=True)
class PolicyChoice:
    """The concrete policy a call runs under, and why: auto's measurements, the budget's pick, or as given.

    Attributes:
        policy: The concrete policy.
        reason: One line for logs; ``""`` when the policy was given.
        auto: What ``auto`` measured, when it chose; else ``None``.
    """

    policy: str
    reason: str = ""  # one line for logs; "" when the policy was given
    auto: AutoChoice | None = None


def resolve_policy(
    fn: Callable[..., Any],
    *specs: Any,
    policy: str | None = None,
    memory_budget: int | str | None = None,
    wrt: Wrt = None,
    has_aux: bool = False,
    at: AtSizes = None,
) -> PolicyChoice:
    """The one place a policy, a memory budget and ``auto`` become a concrete policy.

    A budget alone picks the policy that recomputes least among those that fit.

    Args:
        fn: The function, as ``split`` takes it.
        *specs: Its arguments' shapes and dtypes (``jax.ShapeDtypeStruct`` pytrees).
        policy: The policy asked for (a name, ``"auto"`` to measure within the budget, or ``None`` for ``everything``).
        memory_budget: The most bytes the stored residuals may take; ``None`` sets no budget.
        wrt: The argument positions or names to differentiate; ``None`` means all.
        has_aux: Whether ``fn`` returns ``(out, aux)``.
        at: Sizes of the symbolic dims, for ``auto`` or a budget; ``None`` when not needed.

    Returns:
        The ``PolicyChoice``: the concrete policy and why.

    Raises:
        VjpsplitError: If a budget comes with a fixed policy other than ``everything``, if the policy is unknown, or
            as ``choose_auto`` and ``choose_policy`` raise.
    """
    if memory_budget is not None and policy not in (None, "everything", AUTO):
        raise VjpsplitError("give either a policy or a memory budget (or both with policy auto), not both")
    if policy == AUTO:
        auto = choose_auto(fn, *specs, wrt=wrt, has_aux=has_aux, at=at, memory_budget=memory_budget)
        return PolicyChoice(auto.policy, auto.reason, auto)
    if memory_budget is not None:
        chosen, _ = choose_policy(fn, *specs, memory_budget=memory_budget, wrt=wrt, has_aux=has_aux, at=at)
        return PolicyChoice(chosen, f"memory budget {memory_budget}: chose policy {chosen}")
    return PolicyChoice(normalize_policy(policy))
