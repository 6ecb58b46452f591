"""Ray around the runner: starting or joining it, clocks, why an actor waits, placement groups.

``init_ray`` refuses settings a running Ray would silently ignore; ``clock_offset``
measures an actor's clock against the driver's; ``lack`` says in words why an actor
is not placed; ``placement_group_options`` gives one worker per node or GPU.
``ActorHandle``, ``RemoteMethod`` and ``RemoteClass`` are what the runner calls on
Ray's handles (the ``ray`` module itself is a ``types.ModuleType``: Ray is imported
where it is used, the runner's only optional dependency).
"""

from __future__ import annotations

import os
import time
from types import ModuleType
from typing import TYPE_CHECKING, Any, Mapping, Protocol

from ....errors import VjpsplitError

if TYPE_CHECKING:
    from ray import ObjectRef
    from ray.dag import DAGNode

SCHEDULE_TIMEOUT = 60.0  # seconds for Ray to place and start every actor


class RemoteMethod(Protocol):
    """One method of a Ray actor's handle: ``remote`` calls it, ``options`` sets a call's options, ``bind`` makes
    a Compiled Graph node of the call."""

    # An actor method's result is whatever that method returns: the handle does not say which.
    def remote(self, *args: object) -> ObjectRef[Any]: ...

    def options(self, **options: object) -> RemoteMethod: ...

    def bind(self, *args: object) -> DAGNode: ...


class ActorHandle(Protocol):
    """A Ray actor's handle: each method of the actor's class (``StageActor`` or a subclass) a ``RemoteMethod``."""

    def __getattr__(self, name: str) -> RemoteMethod: ...


class RemoteClass(Protocol):
    """An actor class made remote (``ray.remote(...)(cls)``): ``options(...).remote()`` starts an actor."""

    def options(self, **options: object) -> RemoteClass: ...

    def remote(self) -> ActorHandle: ...


def init_ray(ray: ModuleType, address: str | None, runtime_env: Mapping[str, object] | None, num_workers: int) -> bool:
    """Start or join Ray; True when this call started it. Refuses settings a running Ray would ignore."""
    if not ray.is_initialized():
        kwargs: dict[str, str | int] = (
            {"address": address} if address else {"num_cpus": max(num_workers, os.cpu_count() or 1)}
        )
        ray.init(include_dashboard=False, log_to_driver=False, runtime_env=runtime_env, **kwargs)
        return True
    ctx = ray.get_runtime_context()
    current = ctx.gcs_address
    if address and address != "auto" and address.removeprefix("ray://") != current:
        raise VjpsplitError(
            f"Ray is already initialised, connected to {current}; address={address!r} would be "
            "ignored: leave address out, or call ray.shutdown() first"
        )
    if runtime_env and dict(runtime_env) != dict(ctx.runtime_env or {}):
        raise VjpsplitError(
            "Ray is already initialised with another runtime_env; runtime_env would be ignored: "
            "give it per worker in actor_options, or call ray.shutdown() first"
        )
    return False


def clock_offset(ray: ModuleType, actor: ActorHandle, pings: int = 5) -> float:
    """The actor's monotonic clock minus the driver's, from the ping with the shortest round trip."""
    best: tuple[float, float] | None = None
    for _ in range(pings):
        t0 = time.monotonic()
        theirs = ray.get(actor.clock.remote())
        t1 = time.monotonic()
        if best is None or t1 - t0 < best[0]:
            best = (t1 - t0, theirs - (t0 + t1) / 2)
    if best is None:
        raise ValueError("clock_offset needs at least one ping")
    return best[1]


def asks_of(opts: Mapping[str, Any]) -> dict[str, float]:
    """What an actor with options ``opts`` asks of the cluster: ``{resource: amount}``.

    ``opts`` is Ray's actor options, each value of the type Ray takes for its key (numbers, a resources dict, a
    scheduling strategy...).
    """
    asks = {
        "CPU": opts.get("num_cpus", 1),
        "GPU": opts.get("num_gpus", 0),
        "memory": opts.get("memory", 0),
        **(opts.get("resources") or {}),
    }
    return {k: float(v) for k, v in asks.items() if v}


def lack(ray: ModuleType, opts: Mapping[str, Any]) -> str:
    """Why an actor with options ``opts`` is still waiting, in words."""
    asks, free, total = asks_of(opts), ray.available_resources(), ray.cluster_resources()
    short = [
        f"{k} (asks {v:g}, {free.get(k, 0):g} free of {total.get(k, 0):g} in the cluster)"
        for k, v in asks.items()
        if free.get(k, 0) < v
    ]
    if short:
        return "missing " + ", ".join(short)
    strategy = opts.get("scheduling_strategy")
    if strategy is not None and not isinstance(strategy, str):
        return (
            f"its scheduling_strategy ({type(strategy).__name__}) cannot be met: a node that is gone or full, "
            "or a placement group not ready"
        )
    return "the cluster has what it asks for, but it did not start in time; raise schedule_timeout on a slow cluster"


def placement_group_options(
    num_workers: int,
    bundle: Mapping[str, float] | None = None,
    *,
    strategy: str = "STRICT_SPREAD",
    timeout: float = SCHEDULE_TIMEOUT,
) -> list[dict[str, object]]:
    """``actor_options`` putting each worker in its own bundle of one new placement group.

    The group lives until ``ray.util.remove_placement_group`` (or Ray's shutdown).

    Args:
        num_workers: How many workers (bundles).
        bundle: What each worker reserves (Ray resources); ``None`` means ``{"CPU": 1}``.
        strategy: Ray's placement strategy (by default ``"STRICT_SPREAD"``: one worker per node; ``{"GPU": 1}``
            bundles with ``PACK``: one per GPU).
        timeout: Seconds for Ray to reserve the group.

    Returns:
        One dict of Ray actor options per worker (``num_cpus`` and a ``scheduling_strategy`` on its bundle).

    Raises:
        VjpsplitError: If Ray cannot reserve the group within ``timeout``, naming the bundles and the cluster's free
            resources.
    """
    import ray
    from ray.util import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    bundle = dict(bundle or {"CPU": 1})
    pg = placement_group([dict(bundle) for _ in range(num_workers)], strategy=strategy)
    ready, _ = ray.wait([pg.ready()], timeout=timeout)
    if not ready:
        remove_placement_group(pg)
        raise VjpsplitError(
            f"Ray could not reserve {num_workers} bundles of {bundle} ({strategy}) within {timeout:g} s; "
            f"the cluster has {ray.available_resources()} free"
        )
    # The actor's own CPU ask must fit its bundle (Ray's default, 1 CPU, may not).
    cpus = bundle.get("CPU", 0)
    return [
        {
            "num_cpus": min(cpus, 1) if cpus else 0,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i),
        }
        for i in range(num_workers)
    ]
