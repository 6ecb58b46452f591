"""Save versus recompute: the policies, what each costs, the choice under a memory budget, byte arithmetic.

A policy is a ``jax.checkpoint`` policy applied to the whole function:
``everything`` (what ``jax.vjp`` keeps), ``dots`` (matmul and convolution outputs),
``nothing`` (inputs only) and ``names:a,b`` (values tagged with
``jax.ad_checkpoint.checkpoint_name``). ``policy_cost`` traces, never runs, a
function under one and measures its stored residuals and its backward's work.
``policy="auto"`` (module ``choice``) compiles and times the fixed policies that fit
a budget and picks the fastest forward + backward.
"""

from __future__ import annotations

import functools
import re
import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np

from ..errors import UsageError, VjpsplitError, first_line
from ..files.dtypes import dtype_from_name
from ..files.shapes import DIM_FUNCS, IDENTIFIER, MAX_DIM, eval_dim, is_symbolic_shape
from .jaxprs import iter_eqns, sub_jaxprs
from .vjp import Plan, fn_wrt_positions, run_backward, trace_vjp

# The fixed policies; ``names:a,b`` (any names) is the fourth form.
POLICIES = ("everything", "dots", "nothing")


def normalize_policy(policy: str | None) -> str:
    """The canonical policy string; None means ``everything``."""
    if policy is None or policy == "everything":
        return "everything"
    if policy in ("dots", "nothing"):
        return policy
    if policy.startswith("names:"):
        names = [n.strip() for n in policy[len("names:") :].split(",") if n.strip()]
        if not names:
            raise VjpsplitError("policy 'names:' needs at least one name, e.g. names:h1,h2")
        return "names:" + ",".join(names)
    if policy == "auto":
        raise VjpsplitError("policy 'auto' is resolved by split or export (choose_auto) to a concrete policy first")
    raise VjpsplitError(f"unknown policy {policy!r}; use everything, dots, nothing, auto or names:a,b")


def apply_policy(fn: Callable, policy: str | None) -> Callable:
    """``fn`` wrapped so that ``jax.vjp`` keeps what ``policy`` says and nothing more.

    ``everything`` is ``fn`` itself: note that ``jax.checkpoint(fn, policy=None)``
    would save *nothing*, the opposite.
    """
    policy = normalize_policy(policy)
    cp = jax.checkpoint_policies
    if policy == "everything":
        return fn
    if policy == "dots":
        saveable = cp.dots_saveable
    elif policy == "nothing":
        saveable = cp.nothing_saveable
    else:
        saveable = cp.save_only_these_names(*policy[len("names:") :].split(","))
    return PolicyFallback(fn, jax.checkpoint(fn, policy=saveable), policy)


class PolicyFallbackWarning(UserWarning):
    """A policy JAX cannot apply to a function that differentiates without it: the function ran as ``everything``."""


class PolicyFallback:
    """``jax.checkpoint(fn, policy)``, or ``fn`` itself where JAX fails to apply the policy but not to ``fn``.

    JAX's rematerialisation can fail on functions ``jax.vjp`` differentiates, e.g.
    a ``custom_jvp`` under ``vmap`` whose primal output is a constant (JAX's
    ``hard_stuff2`` case: ``broadcast_in_dim`` refuses the unbatched zeros). The
    error is raised while the checkpointed function is traced, so this falls back
    to ``fn`` in the same trace (every value kept, as ``everything`` keeps them),
    warns, and records it in ``fell_back``. If ``fn`` fails too, that error is raised.
    """

    def __init__(self, fn: Callable, checkpointed: Callable, policy: str):
        self.fn, self.checkpointed, self.policy = fn, checkpointed, policy
        self.fell_back = ""  # JAX's error, once the policy could not be applied
        functools.update_wrapper(self, fn, updated=())

    def __call__(self, *args, **kwargs):
        try:
            return self.checkpointed(*args, **kwargs)
        except (TypeError, ValueError, NotImplementedError) as e:
            out = self.fn(*args, **kwargs)  # the function's own error, if it fails without the policy too
            self.fell_back = first_line(e)
            warnings.warn(
                f"policy {self.policy!r} cannot be applied to {getattr(self.fn, '__name__', 'the function')} "
                f"(JAX's checkpoint fails on it: {self.fell_back[:160]}); it keeps every residual instead, "
                "as policy 'everything'",
                PolicyFallbackWarning,
                stacklevel=2,
            )
            return out


def byte_terms_of_shape(dtype, shape: Sequence[int | str]) -> dict[str, int]:
    """Bytes of an array as ``{symbolic factor: coefficient}``; ``""`` is the constant term."""
    coeff = dtype_from_name(dtype).itemsize if isinstance(dtype, str) else np.dtype(dtype).itemsize
    factors = []
    for d in shape:
        if isinstance(d, int):
            coeff *= d
        else:
            factors.append(d if d.replace("_", "").isalnum() else f"({d})")
    return {"·".join(sorted(factors)): coeff}


def byte_terms(leaf) -> dict[str, int]:
    """Bytes of one manifest leaf as ``{symbolic factor: coefficient}``."""
    return byte_terms_of_shape(leaf.dtype, leaf.shape)


def total_bytes(leaves: Sequence) -> dict[str, int]:
    """Summed ``byte_terms`` of ``leaves``."""
    total: dict[str, int] = defaultdict(int)
    for leaf in leaves:
        for k, v in byte_terms(leaf).items():
            total[k] += v
    return dict(total)


def evaluate_terms(terms: Mapping[str, int], at: Mapping[str, int]) -> int | None:
    """The byte count of ``terms`` with symbolic dims sized by ``at``; None if some are unbound."""
    total = 0
    for k, coeff in terms.items():
        value = coeff
        for factor in filter(None, k.split("·")):
            v = eval_dim(factor.strip("()"), at)
            if v is None:
                return None
            value *= v
        total += value
    return total


def human_bytes(n: int) -> str:
    """``1536`` -> ``1.5 KiB``."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError


def format_bytes_terms(terms: dict[str, int]) -> str:
    """``{"": 12288, "b": 8192}`` -> ``12.0 KiB + 8.0 KiB·b``."""
    if not terms:
        return "0 B"
    parts = []
    for k in sorted(terms, key=lambda k: (k != "", k)):
        if terms[k] == 0:
            continue
        parts.append(human_bytes(terms[k]) + (f"·{k}" if k else ""))
    return " + ".join(parts) or "0 B"


# Cheapest recompute first: a budget takes the first of these that fits.
BUDGET_ORDER = ("everything", "dots", "nothing")

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}


def parse_bytes(text: str | int) -> int:
    """``'64MiB'`` -> 67108864; also plain integers, ``kB``/``MB``/``GB`` (powers of 1000) and ``KiB``/``GiB``."""
    if isinstance(text, (int, np.integer)) and not isinstance(text, bool):
        if text < 0:
            raise VjpsplitError(f"memory budget {text} is negative")
        return int(text)
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise VjpsplitError(f"memory budget {text!r} is not a size; write e.g. 64MiB, 1.5GB or 1048576")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_at(items: Sequence[str] | Mapping[str, int] | None) -> dict[str, int]:
    """``['b=256', 't=128']`` (or a mapping) -> ``{'b': 256, 't': 128}``; sizes must be >= 1."""
    if items is None:
        return {}
    pairs: list[tuple[str, Any]]
    if isinstance(items, Mapping):
        pairs = list(items.items())
    else:
        pairs = []
        for item in items:
            for part in str(item).split(","):
                name, eq, value = part.partition("=")
                # ASCII digits only: str.isdigit() also accepts '²', which int() refuses.
                if not eq or not _AT_NAME.match(name.strip()) or not _AT_SIZE.match(value.strip()):
                    raise VjpsplitError(f"--at {part!r} is not NAME=SIZE; write e.g. b=256")
                pairs.append((name.strip(), int(value)))
    out: dict[str, int] = {}
    for name, value in pairs:
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise VjpsplitError(f"--at {name}={value!r}: a size must be an integer, e.g. b=256")
        if int(value) < 1:
            raise VjpsplitError(f"--at {name}={value}: symbolic dims are >= 1")
        if int(value) > MAX_DIM:
            raise VjpsplitError(f"--at {name}={value}: too large (at most 2**40); check the number")
        out[str(name)] = int(value)
    return out


def check_at_names(at: Mapping[str, int], known: Sequence[str], source: str) -> None:
    """Refuse ``--at`` names that are not symbolic dims of ``source`` (a usage error naming them)."""
    unknown = [n for n in at if n not in known]
    if unknown:
        have = f"its symbolic dims are {', '.join(known)}" if known else "it has no symbolic dims"
        raise UsageError(f"--at {', '.join(unknown)}: no such symbolic dim in {source}; {have}")


def symbolic_dim_names(specs) -> list[str]:
    """The symbolic dim names in ``specs`` (pytrees of ShapeDtypeStructs), in first-seen order."""
    names: list[str] = []
    for s in jax.tree_util.tree_leaves(specs):
        for d in getattr(s, "shape", ()):
            if not isinstance(d, (int, np.integer)):
                names += [n for n in IDENTIFIER.findall(str(d)) if n not in names and n not in DIM_FUNCS]
    return names


_AT_NAME = re.compile(rf"^{IDENTIFIER.pattern}$")
_AT_SIZE = re.compile(r"^[0-9]{1,30}$")


def concrete_specs(specs: tuple, at: Mapping[str, int]) -> tuple:
    """``specs`` with every symbolic dim replaced by its size from ``at``."""
    missing: list[str] = []

    def fix(s):
        if not is_symbolic_shape(s.shape):
            return s
        dims = []
        for d in s.shape:
            v = eval_dim(d if isinstance(d, int) else str(d), at)
            if v is None:
                missing.append(str(d))
                v = 1
            dims.append(v)
        return jax.ShapeDtypeStruct(tuple(dims), s.dtype)

    out = tuple(jax.tree_util.tree_map(fix, s) for s in specs)
    if missing:
        raise VjpsplitError(
            f"sizes needed for symbolic dim{'s' if len(set(missing)) > 1 else ''} {', '.join(sorted(set(missing)))}; "
            f"pass --at {','.join(f'{n}=SIZE' for n in sorted(set(missing)))} (the at= argument in Python)"
        )
    return out


def _nbytes(structs) -> int:
    return sum(int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize for s in structs)


def _count_ops(jaxpr) -> tuple[int, int]:
    """(all primitive applications, matmuls and convolutions) in a jaxpr and its sub-jaxprs."""
    # A call-like wrapper (jit, remat, custom_vjp) is not an op: what it runs is counted.
    prims = [e.primitive.name for e in iter_eqns(jaxpr) if not sub_jaxprs(e)]
    return len(prims), sum(p in ("dot_general", "conv_general_dilated") for p in prims)


@dataclass(frozen=True)
class PolicyCost:
    """What one policy costs: residual bytes the forward stores, and the backward's work."""

    policy: str
    stored_arrays: int
    stored_bytes: int | None  # None when symbolic dims are unbound
    stored_terms: dict = field(default_factory=dict)  # bytes as {symbolic factor: coefficient}
    input_backed: int = 0
    backward_ops: int = 0  # primitive applications in the backward
    backward_dots: int = 0  # of which matmuls / convolutions
    backward_flops: float | None = None  # XLA's cost analysis, with concrete sizes only

    def to_json(self) -> dict:
        """A JSON-able dict."""
        return {
            "policy": self.policy,
            "stored_arrays": self.stored_arrays,
            "stored_bytes": self.stored_bytes,
            "stored_terms": self.stored_terms,
            "input_backed": self.input_backed,
            "backward_ops": self.backward_ops,
            "backward_dots": self.backward_dots,
            "backward_flops": self.backward_flops,
        }


def policy_cost(
    fn: Callable,
    *specs,
    policy: str | None = None,
    wrt=None,
    has_aux: bool = False,
    at: Mapping[str, int] | None = None,
    flops: bool = True,
) -> PolicyCost:
    """Trace (never run) ``fn`` under ``policy`` and measure its residuals and backward."""
    policy = normalize_policy(policy)
    at = dict(at or {})
    symbolic = any(is_symbolic_shape(s.shape) for s in jax.tree_util.tree_leaves(specs))
    wrt_pos, single = fn_wrt_positions(fn, wrt, len(specs))

    def traced(specs_):
        cand = Candidate(fn, policy, wrt_pos, single, has_aux)
        stored_ = jax.eval_shape(lambda *a: cand.fwd(*a)[1], *specs_)
        stored_, inputs_, cts_ = cand.bwd_args(jax.tree_util.tree_leaves(specs_), stored_)
        return stored_, cand.plan, cand.bwd, inputs_, cts_

    # Counted on the symbolic trace, as export lowers it (at concrete sizes JAX folds values
    # such as 1/b into constants, so an artifact would store more than such a count says).
    stored, plan, bwd, inputs, cts = traced(specs)
    ops, dots = _count_ops(jax.make_jaxpr(bwd)(stored, inputs, cts))
    n_stored, n_input_backed = len(stored), len(plan.input_backed)
    terms: dict[str, int] = {}
    for s in stored:
        for k, v in byte_terms_of_shape(s.dtype, [d if isinstance(d, int) else str(d) for d in s.shape]).items():
            terms[k] = terms.get(k, 0) + v
    total = evaluate_terms(terms, at) if symbolic else _nbytes(stored)
    if symbolic and at:
        stored, plan, bwd, inputs, cts = traced(concrete_specs(specs, at))
        if total is None:  # a dim expression evaluate_terms does not read: the concrete trace's bytes
            total = _nbytes(stored)
        symbolic = False
    fl = None
    if flops and not symbolic:
        try:
            analysis = jax.jit(bwd).lower(stored, inputs, cts).compile().cost_analysis()
            if isinstance(analysis, list):  # older jax: one dict per computation
                analysis = analysis[0] if analysis else {}
            fl = float(analysis.get("flops", 0.0)) if analysis else None
        except Exception:  # cost analysis is best effort: not every backend offers it
            fl = None
    return PolicyCost(policy, n_stored, total, terms, n_input_backed, ops, dots, fl)


def plan_policies(
    fn: Callable,
    *specs,
    wrt=None,
    has_aux: bool = False,
    at=None,
    policies: Sequence[str] = BUDGET_ORDER,
    flops: bool = True,
) -> list[PolicyCost]:
    """``policy_cost`` for each policy, cheapest recompute first."""
    return [policy_cost(fn, *specs, policy=p, wrt=wrt, has_aux=has_aux, at=at, flops=flops) for p in policies]


def choose_policy(
    fn: Callable,
    *specs,
    memory_budget,
    wrt=None,
    has_aux: bool = False,
    at=None,
    policies: Sequence[str] = BUDGET_ORDER,
) -> tuple[str, PolicyCost]:
    """The policy that recomputes least among those whose stored residual bytes fit the budget."""
    budget = parse_bytes(memory_budget)
    at = parse_at(at)
    symbolic = any(is_symbolic_shape(s.shape) for s in jax.tree_util.tree_leaves(specs))
    if symbolic and not at:
        raise VjpsplitError(
            "a memory budget needs sizes for the symbolic dims to weigh the residuals; pass --at NAME=SIZE "
            "(the at= argument in Python), e.g. b=256, with the largest sizes you will run"
        )
    costs = []
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


# ---------------------------------------------------------------------------------------------
# policy="auto" (module choice) picks among the fixed policies by measuring them.

AUTO = "auto"


class Candidate:
    """``fn`` under one policy as a traceable forward ``(out, stored)`` and backward.

    The backward's plan comes from the forward's trace, so trace (or lower) the
    forward first; ``bwd_args`` then gives the backward's arguments.
    """

    def __init__(self, fn: Callable, policy: str | None, wrt_pos, single: bool, has_aux: bool):
        inner = apply_policy(fn, policy)
        self._plan: Plan | None = None

        def fwd(*args):
            out, stored, _, plan = trace_vjp(inner, args, wrt_pos, single, has_aux)
            self._plan = plan
            return out, stored

        def bwd(stored, inputs, cts):
            return run_backward(self.plan, stored, inputs, cts)

        self.fwd, self.bwd = fwd, bwd

    @property
    def plan(self) -> Plan:
        """The backward's plan, from the forward's trace (trace or lower ``fwd`` first)."""
        if self._plan is None:
            raise AssertionError("Candidate.plan is known once fwd has been traced")
        return self._plan

    def bwd_args(self, flat_args: Sequence, stored: Sequence, cotangent: Callable = lambda aval: aval) -> tuple:
        """``(stored, input-backed leaves of flat_args, one cotangent per floating output)``."""
        plan = self.plan
        return (
            list(stored),
            [flat_args[k] for k in plan.input_backed],
            [cotangent(plan.out_avals[i]) for i in plan.out_diff],
        )
