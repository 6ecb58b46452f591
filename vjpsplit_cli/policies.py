"""Save-versus-recompute policies, as ``jax.checkpoint`` policies."""

from __future__ import annotations

from typing import Callable

import jax

from .errors import VjpsplitError

POLICIES = ("everything", "dots", "nothing", "names:a,b")


def normalize_policy(policy: str | None) -> str:
    """The canonical policy string; None means ``everything``."""
    if policy is None or policy == "everything":
        return "everything"
    if policy in ("dots", "nothing"):
        return policy
    if policy.startswith("names:"):
        names = [n.strip() for n in policy[len("names:"):].split(",") if n.strip()]
        if not names:
            raise VjpsplitError("policy 'names:' needs at least one name, e.g. names:h1,h2")
        return "names:" + ",".join(names)
    raise VjpsplitError(f"unknown policy {policy!r}; use everything, dots, nothing or names:a,b")


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
        saveable = cp.save_only_these_names(*policy[len("names:"):].split(","))
    return jax.checkpoint(fn, policy=saveable)
