"""Where each stage runs: a sharded stage's artifact on its own group of this host's devices."""

from __future__ import annotations

from typing import Any, Sequence

from ...errors import VjpsplitError


def stage_devices(artifacts: Sequence[Any], devices: Sequence[Sequence[Any]] | None = None) -> list[Any]:
    """Each stage's artifact on its device group (sharded stages); unsharded stages as they are.

    ``devices`` gives one group per stage. By default, stages take consecutive
    disjoint groups of this host's devices when there are enough (stage s on
    devices n*s ... n*s+n-1), else all share the first ones (one mesh).
    """
    import jax

    if devices is not None:
        if len(devices) != len(artifacts):
            raise VjpsplitError(f"{len(artifacts)} stages but {len(devices)} device groups")
        return [a.on_devices(g) if a.manifest.sharded else a for a, g in zip(artifacts, devices)]
    have = jax.devices()
    need = [a.manifest.nr_devices if a.manifest.sharded else 0 for a in artifacts]
    if not any(need):
        return list(artifacts)
    out: list[Any] = []
    start = 0
    disjoint = sum(need) <= len(have)
    for a, n in zip(artifacts, need):
        if not n:
            out.append(a)
            continue
        out.append(a.on_devices(have[start : start + n]) if disjoint else a)
        start += n if disjoint else 0
    return out
