"""Where each stage runs: every stage on a device of its own, a sharded stage on its own device group.

``placement`` says, per stage, the devices it runs on: those the caller gives
(``devices=``, one list per stage), or by default worker k's stages on this host's
k-th device (k-th group of devices for sharded stages) where there are enough,
else all on the first ones, with a ``SharedDevicesWarning`` (on CPU: how to get more
devices). ``placed`` gives each sharded stage's artifact on its
group; an unsharded stage's arrays are committed to its device by its
``StageWorker`` (``jax.device_put``), and ``jit`` runs where its inputs are.
"""

from __future__ import annotations

import sys
import types
import warnings
from typing import TYPE_CHECKING, Sequence

from ...errors import VjpsplitError

if TYPE_CHECKING:
    import jax

    from ...artifact.artifact import Artifact

Devices = tuple["jax.Device", ...]  # one stage's devices: one for an unsharded stage, a sharded stage's mesh devices


class SharedDevicesWarning(UserWarning):
    """Several workers' stages share devices because this host has too few: they run, but one after another.

    Warned (``warnings.warn``) where stages are placed on this host's devices
    (``run_inprocess``, the ``Trainer``), with the fix: on CPU, more host devices
    through ``XLA_FLAGS``, or ``devices=``. The ``Trainer`` warns it too where a V
    schedule puts two stages on each worker's device while others of this host's stay
    idle (``warn_idle``): two stages on one ZB-V worker run on one device.
    """


def runs_serially(device: jax.Device) -> bool:
    """Whether ``device`` runs one program at a time, in the order they were dispatched: an accelerator's (a TPU
    core, a GPU's stream). A CPU device runs programs whose inputs are ready side by side on its threads.

    Args:
        device: A JAX device.

    Returns:
        True but for a CPU device.
    """
    return bool(device.platform != "cpu")


def _need(artifact: Artifact) -> int:
    return int(artifact.manifest.nr_devices) if artifact.manifest.sharded else 1


def placement(
    artifacts: Sequence[Artifact],
    workers: Sequence[Sequence[int]] | None = None,
    devices: Sequence[Sequence[jax.Device]] | None = None,
    warn: bool = True,
) -> list[Devices]:
    """Per stage, the devices it runs on (in mesh order for a sharded stage).

    ``workers``: the stages each worker holds (default: one stage per worker).
    ``devices``: one list per stage, taken as given (a sharded stage's list has
    its ``nr_devices`` devices; an unsharded stage's has one). By default, where
    this host's local devices cover every worker's need (one device, or a sharded
    stage's count), worker k takes the k-th consecutive group and each of its
    stages the group's first devices; otherwise every stage shares the first
    devices (the default device for an unsharded stage), with a ``SharedDevicesWarning`` unless ``warn`` is
    False (the Ray driver's placement, which only shapes programs: each actor places its stages itself).
    """
    import jax

    if devices is not None:
        if len(devices) != len(artifacts):
            raise VjpsplitError(f"{len(artifacts)} stages but {len(devices)} device groups")
        out = [tuple(g) for g in devices]
        for s, (a, g) in enumerate(zip(artifacts, out)):
            if not a.manifest.sharded and len(g) != 1:
                raise VjpsplitError(
                    f"stage {s} is not sharded: give it one device, not {len(g)} (devices=[[d0], [d1], ...])"
                )
        return out
    if workers is None:
        workers = [(s,) for s in range(len(artifacts))]
    have = jax.local_devices()
    need = [max(_need(artifacts[s]) for s in held) for held in workers]
    out_by_stage: dict[int, Devices] = {}
    start = 0
    disjoint = sum(need) <= len(have)
    if not disjoint and len(workers) > 1 and warn:
        _warn_shared(need, have)
    for held, n in zip(workers, need):
        if disjoint:
            group = have[start : start + n]
        else:  # too few devices: all share, an unsharded worker on the default device
            group = [default_device()] if n == 1 else have[:n]
        for s in held:
            out_by_stage[s] = tuple(group[: _need(artifacts[s])])
        start += n
    return [out_by_stage[s] for s in range(len(artifacts))]


def _warn_shared(need: Sequence[int], have: Sequence[jax.Device]) -> None:
    """Say that the workers share devices (they would otherwise, silently, all run on the first one)."""
    platform = getattr(have[0], "platform", "") if have else ""
    fix = (
        f"on CPU, set XLA_FLAGS=--xla_force_host_platform_device_count={sum(need)} before JAX starts (before "
        "`import jax`), or pass devices= (one list per stage; the Trainer's runner=InProcess(devices=...))"
        if platform == "cpu"
        else "pass devices= (one list per stage) or run on a host with more"
    )
    warnings.warn(
        f"{len(need)} workers need {sum(need)} devices but this host has {len(have)} {platform} device"
        f"{'s' if len(have) != 1 else ''}: every stage runs on the first ones, one after another; {fix}",
        SharedDevicesWarning,
        stacklevel=_callers_level(),
    )


def warn_idle(schedule: str, workers: Sequence[Sequence[int]], replicas: int = 1) -> None:
    """Warn where ``workers`` (the stages each worker holds, for ``schedule``, a label) stack several stages on a
    worker's device while this host has devices no worker uses; ``replicas``: devices per worker."""
    import jax

    have = len(jax.local_devices())
    used = len(workers) * replicas
    stacked = [held for held in workers if len(held) > 1]
    if not stacked or have <= used:
        return
    stages = sum(len(held) for held in workers)
    per = max(len(held) for held in workers)
    first = " and ".join(str(s) for s in stacked[0])
    warnings.warn(
        f"{schedule} puts {per} stages on each worker: {stages} stages make {len(workers)} worker"
        f"{'s' if len(workers) != 1 else ''} on {used} of this host's {have} devices, so stages {first} share one "
        f"device (one after another) while {have - used} stay idle; for a device per stage, use a schedule with one "
        f"stage per worker ('1f1b', 'zbh1'), or cut the model into {per * have // replicas} stages",
        SharedDevicesWarning,
        stacklevel=_callers_level(),
    )


def _callers_level() -> int:
    """The ``stacklevel`` of the first frame outside this package: the warning points at the user's line."""
    level: int = 1
    frame: types.FrameType | None = sys._getframe(1)  # _warn_shared's frame is stacklevel 1
    while frame is not None and frame.f_globals.get("__name__", "").startswith("vjpsplit_cli."):
        level, frame = level + 1, frame.f_back
    return level


def default_device() -> jax.Device:
    """The device JAX puts uncommitted arrays on (``jax_default_device``, else the first device)."""
    import jax

    d = getattr(jax.config, "jax_default_device", None)
    if d is None:
        return jax.devices()[0]
    return jax.devices(d)[0] if isinstance(d, str) else d


def placed(artifacts: Sequence[Artifact], where: Sequence[Devices]) -> list[Artifact]:
    """Each sharded stage's artifact on its devices; unsharded artifacts as they are."""
    return [a.on_devices(g) if a.manifest.sharded else a for a, g in zip(artifacts, where)]


def stage_devices(
    artifacts: Sequence[Artifact], devices: Sequence[Sequence[jax.Device]] | None = None
) -> list[Artifact]:
    """Each stage's artifact on its device group (sharded stages), one stage per worker; see ``placement``."""
    return placed(artifacts, placement(artifacts, None, devices))
