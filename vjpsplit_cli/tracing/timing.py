"""Timing the policy candidates: each one's forward + backward, measured here or estimated by XLA.

Owns the synthetic inputs a measurement runs on, the interleaved timing rounds and the cost-analysis score
that stands in where running fails; ``choice`` picks among the times.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np

from ..files.prng import data_struct, from_data, impl_name, is_key
from .policies import candidate
from .traced import TracedVjp


def _example(spec: jax.ShapeDtypeStruct, rng: np.random.Generator) -> np.ndarray | jax.Array:
    """A concrete array for ``spec``: small normal floats, zero integers (valid indices), typed keys from 0."""
    if is_key(spec):
        d = data_struct(spec)
        return from_data(np.zeros(d.shape, d.dtype), impl_name(spec))
    dt = np.dtype(spec.dtype)
    if dt.kind in "fc":
        return (rng.standard_normal(spec.shape) * 0.1).astype(dt)
    return np.zeros(spec.shape, dt)


def _out_and_stored(cand: TracedVjp) -> Callable[..., tuple[Any, tuple[jax.Array, ...]]]:
    """The candidate's forward as timed: outputs and stored residuals (aux is not part of the step)."""

    def fwd(*args: Any) -> tuple[Any, tuple[jax.Array, ...]]:
        out, stored, _ = cand.forward(*args)
        return out, stored

    return fwd


def _measure(
    fn: Callable[..., Any],
    specs: tuple[Any, ...],
    policies: Sequence[str],
    wrt_pos: tuple[int, ...],
    single: bool,
    has_aux: bool,
    seconds_per_candidate: float,
) -> dict[str, float]:
    """Median forward + backward seconds of each policy, compiled and run here, rounds interleaved."""
    rng = np.random.default_rng(0)
    args = jax.tree_util.tree_map(lambda s: _example(s, rng), specs)
    flat = jax.tree_util.tree_leaves(args)
    steps: dict[str, Callable[[], Any]] = {}
    for p in policies:
        cand = candidate(fn, p, wrt_pos, single, has_aux)
        # Compiled objects run eagerly even while split() is tracing, where a jit call would be staged.
        fwd_c = jax.jit(_out_and_stored(cand)).lower(*args).compile()
        stored, inputs, cts = cand.backward_args(
            flat, cand.plan.stored_avals, lambda aval: np.ones(aval.shape, aval.dtype)
        )
        bwd_c = jax.jit(cand.backward).lower(stored, inputs, cts).compile()

        def step(
            fwd: jax.stages.Compiled = fwd_c,
            bwd: jax.stages.Compiled = bwd_c,
            inputs: list[Any] = inputs,
            cts: list[Any] = cts,
        ) -> Any:
            _, stored = fwd(*args)
            return bwd(list(stored), inputs, cts)

        jax.block_until_ready(step())
        steps[p] = step
    samples: dict[str, list[float]] = {p: [] for p in policies}
    t_start, rounds = time.perf_counter(), 0
    # At least 5 interleaved rounds, then more while the time allows (up to 25): medians of many
    # rounds keep a busy machine's noise out of the choice.
    while rounds < 25 and (rounds < 5 or time.perf_counter() - t_start < seconds_per_candidate * len(policies)):
        for p, run in steps.items():
            t0 = time.perf_counter()
            jax.block_until_ready(run())
            samples[p].append(time.perf_counter() - t0)
        rounds += 1
    return {p: statistics.median(v) for p, v in samples.items()}


def _estimate(
    fn: Callable[..., Any],
    specs: tuple[Any, ...],
    policies: Sequence[str],
    wrt_pos: tuple[int, ...],
    single: bool,
    has_aux: bool,
) -> dict[str, float]:
    """XLA's cost analysis of each policy's forward + backward: FLOPs plus bytes accessed (a relative score)."""
    out: dict[str, float] = {}
    for p in policies:
        cand = candidate(fn, p, wrt_pos, single, has_aux)
        score = 0.0
        fc = jax.jit(_out_and_stored(cand)).lower(*specs).compile()
        args = cand.backward_args(jax.tree_util.tree_leaves(specs), cand.plan.stored_avals)
        for c in (fc, jax.jit(cand.backward).lower(*args).compile()):
            a: Any = c.cost_analysis()
            if isinstance(a, list):  # older jax: one dict per computation
                a = a[0] if a else {}
            # A CPU core does ~10 FLOPs per byte it moves: weigh both on one scale.
            score += float(a.get("flops", 0.0)) + 10.0 * float(a.get("bytes accessed", 0.0))
        out[p] = score
    return out


def time_policies(
    fn: Callable[..., Any],
    specs: tuple[Any, ...],
    fitting: Sequence[str],
    how: tuple[tuple[int, ...], bool, bool],
    method: str,
    seconds_per_candidate: float,
) -> tuple[dict[str, float], str]:
    """Each fitting policy's seconds (measured, or XLA's estimate where running fails) and how they were had.

    Args:
        fn: The function, as ``split`` takes it.
        specs: Its arguments' shapes and dtypes, every dim concrete.
        fitting: The policies to time.
        how: ``(wrt positions, single gradient, has_aux)``.
        method: ``"measure"`` to time compiled candidates here, ``"estimate"`` to score them by XLA's cost analysis.
        seconds_per_candidate: About how long to time each candidate when measuring.

    Returns:
        The seconds (or XLA's score) by policy, and ``"measured"`` or ``"estimated"``.
    """
    if method == "measure":
        try:
            return _measure(fn, specs, fitting, *how, seconds_per_candidate), "measured"
        except Exception:  # inputs it cannot synthesize, or a backend that cannot run here: estimate
            pass
    return _estimate(fn, specs, fitting, *how), "estimated"
