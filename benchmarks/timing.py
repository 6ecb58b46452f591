"""Side-by-side timing: candidates interleaved round by round, medians and ratios."""

from __future__ import annotations

import statistics
import time
from typing import Callable, Mapping

import jax


def interleaved(candidates: Mapping[str, Callable[[], object]], rounds: int, warmup: int = 2) -> dict[str, float]:
    """Median seconds per call of each candidate, calls interleaved so drift hits all alike."""
    for _ in range(warmup):
        for fn in candidates.values():
            jax.block_until_ready(fn())
    samples: dict[str, list[float]] = {k: [] for k in candidates}
    for _ in range(rounds):
        for name, fn in candidates.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            samples[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in samples.items()}


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"
