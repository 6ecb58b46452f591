"""What each device holds of the Trainer's: ``Trainer.memory()``'s records, one ``DeviceMemory`` per device.

A worker (this process in-process, each Ray actor on Ray) counts its own stages: the
parameters and optimizer state by the device each array's shard is on
(``devicebytes.bytes_per_device``: with data parallelism, ZeRO-1's 1/N of the state
shows), each stage's most stored residual bytes in the last step
(``StageWorker.peak_residual_bytes``, per replica) and what each device holds in all
(``devicebytes.device_use``: the device's ``memory_stats()``, or the live arrays on
CPU).
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

import jax

from ..runtime.devicebytes import bytes_per_device, device_use
from ..runtime.worker import StageWorker
from .stage_trainer import StageTrainer
from .zero1 import ReplicaTrainer


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
    """One device's bytes of the Trainer's stages (``Trainer.memory()``), between steps.

    Attributes:
        device: the device (a ``jax.Device`` in-process; on Ray, its name as the actor's JAX gives it).
        worker: the Ray worker (actor) whose device it is; None in-process (every device is this process's).
        stages: the stages whose parameters are on the device.
        params: bytes of those stages' parameters on it (a leaf several stages hold, once per stage).
        optimizer: bytes of their optimizer state on it; with ``data_parallel=N``, its ZeRO-1 shard (about 1/N of
            the stage's state: leaves no dimension of which divides by N stay whole on every replica).
        peak_residuals: the most stored residual bytes (and a split backward's intermediates) the stages held on
            it at once in the last step, each stage's most, summed over the device's stages (0 before a step;
            a sharded stage's over all its devices, counted on its first).
        in_use: bytes on the device now, of everything: its ``memory_stats()["bytes_in_use"]`` where it reports
            them (GPU, TPU), else the live JAX arrays on it (CPU).
        peak_in_use: its ``memory_stats()["peak_bytes_in_use"]`` (the most since the process started); None
            where the device does not report it (CPU).
    """

    device: jax.Device | str
    worker: int | None
    stages: tuple[int, ...]
    params: int
    optimizer: int
    peak_residuals: int
    in_use: int
    peak_in_use: int | None


def memory_records(
    trainers: Iterable[StageTrainer | ReplicaTrainer], worker: int | None = None, named: bool = False
) -> list[DeviceMemory]:
    """One ``DeviceMemory`` per device that holds any of ``trainers``' stages, in the order the stages come.

    Args:
        trainers: a worker's stage trainers (every stage's in-process, an actor's own on Ray).
        worker: the Ray worker they belong to; None in-process.
        named: the devices by name (``str``), as a Ray actor hands them to the driver.

    Returns:
        The records, a device's once.
    """
    stages: dict[jax.Device, list[int]] = {}
    params: dict[jax.Device, int] = {}
    optimizer: dict[jax.Device, int] = {}
    residuals: dict[jax.Device, int] = {}
    for t in trainers:
        s = t.stage_index
        for d, n in bytes_per_device(t.params).items():
            stages.setdefault(d, []).append(s)
            params[d] = params.get(d, 0) + n
        for d, n in bytes_per_device(t.state).items():
            optimizer[d] = optimizer.get(d, 0) + n
        workers: list[StageWorker] = t.worker.replicas if isinstance(t, ReplicaTrainer) else [t.worker]
        for w in workers:
            d = w.devices[0]
            residuals[d] = residuals.get(d, 0) + w.peak_residual_bytes
    use = device_use(list(stages))
    return [
        DeviceMemory(
            device=str(d) if named else d,
            worker=worker,
            stages=tuple(held),
            params=params.get(d, 0),
            optimizer=optimizer.get(d, 0),
            peak_residuals=residuals.get(d, 0),
            in_use=use[d][0],
            peak_in_use=use[d][1],
        )
        for d, held in stages.items()
    ]
