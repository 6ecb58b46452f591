"""The Ray runner: workers as Ray actors placed by per-worker actor options, on the driver's clock.

Actors that Ray cannot place within ``schedule_timeout`` are one error naming
the stage and the resource it lacks; an actor that dies during a step is one
error naming its stages. Each actor's monotonic clock is measured against the
driver's at start, and its events are moved onto the driver's clock.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Mapping, Sequence

import numpy as np

from ....errors import VjpsplitError
from .compiled import compile_step
from ..dispatch import PreSplit, progress_bar, walk
from ...schedules.plans import describe, layout_of, layout_placement, resolve, split_ops
from .actor import StageActor, devices_for
from .setup import SCHEDULE_TIMEOUT, clock_offset, init_ray, lack
from ...schedules.builtins import Op
from ..worker import check_stages, split_batch
from ...stages.directory import is_stages
from ...schedules.timeline import PipelineResult

STEP_TIMEOUT = 600.0  # seconds for one step's results, after which the step is an error, not a hang


class RayPipeline:
    """Workers as Ray actors (one process each); activations and cotangents go through Ray's object store.

    ``layout="stage"`` (default) puts one stage on each actor, for GPipe, 1F1B and
    ZB-H1; ``layout="v"`` puts two on each in ZB-V's (and DualPipeV's) V;
    ``layout="interleaved"`` two on each, round robin (interleaved 1F1B); a list of
    stage tuples, one per worker, places them as given (for ``schedule=`` plans). ``address=None`` starts (or
    joins) a local Ray instance; pass a cluster address (``ray://host:10001`` or
    ``auto``) for multi-host. ``actor_options`` gives one dict of Ray actor options
    per worker (``num_cpus``, ``num_gpus``, ``resources``, ``scheduling_strategy``
    such as a placement group bundle or ``NodeAffinitySchedulingStrategy``; see
    ``placement_group_options``). Actors not placed and started within
    ``schedule_timeout`` seconds are an error naming the stage and what it lacks.
    Actors persist across ``run`` calls; ``close()`` (or ``with``) ends them. The
    driver sends the batch and fetches the gradients, losses and timings once per
    step; activations and cotangents pass from actor to actor without reaching it.
    ``nodes[w]`` is the Ray node id worker ``w`` runs on; ``clock_offsets[w]`` its
    clock minus the driver's (seconds). ``compiled=True`` runs each step as a Ray
    Compiled Graph (``None``: where Ray can compile it, else actor calls; default
    False: one actor call per operation). A step whose results are not back within
    ``step_timeout`` seconds is an error. ``artifacts`` may be a ``Stages``
    (``export_stages``): ``params`` is then the whole parameter pytree, ``run``
    takes the batch tuple, and the result's ``grads`` have ``params``' structure
    (its steps run as actor calls: each stage's batch inputs go to it directly).
    """

    actor_class: type = StageActor  # ray_train's Trainer actors extend it

    def __init__(
        self,
        artifacts: Sequence,
        params: Sequence,
        *,
        address: str | None = None,
        runtime_env: dict | None = None,
        num_cpus_per_stage: float = 0,
        layout: str | Sequence[Sequence[int]] = "stage",
        actor_options: Sequence[Mapping[str, Any]] | None = None,
        schedule_timeout: float = SCHEDULE_TIMEOUT,
        compiled: bool | None = False,
        step_timeout: float = STEP_TIMEOUT,
    ):
        try:
            import ray
        except ImportError as e:
            raise VjpsplitError("the Ray runner needs Ray; pip install 'vjpsplit[ray]'") from e
        given: Any = artifacts  # a Stages, or the per-stage list
        self.from_one: tuple[Any, Any] | None = (given, params) if is_stages(given) else None
        if self.from_one is not None:
            artifacts, params = list(given.artifacts), given.stage_params(params)
        if len(params) != len(artifacts):
            raise VjpsplitError(f"{len(artifacts)} stages but {len(params)} parameter sets")
        self.ray = ray
        self.compiled = compiled
        self.step_timeout = step_timeout
        self.graph: tuple | None = None  # (key, compiled graph) of the last compiled step
        self.layout = layout
        self.stages = len(artifacts)
        self.artifacts = list(artifacts)
        self.placement = layout_placement(layout, self.stages)
        if actor_options is not None and len(actor_options) != len(self.placement):
            raise VjpsplitError(
                f"actor_options has {len(actor_options)} entries for {len(self.placement)} workers; "
                "give one dict of Ray actor options per worker"
            )
        self.started = init_ray(ray, address, runtime_env, len(self.placement))
        self.actors: list = []
        self.options = []
        for w, chunks in enumerate(self.placement):
            opts = {"num_cpus": num_cpus_per_stage, **(dict(actor_options[w]) if actor_options else {})}
            devices_for(opts, max(artifacts[c].manifest.nr_devices for c in chunks))
            self.options.append(opts)
            self.actors.append(ray.remote(self.actor_class).options(**opts).remote())
        try:
            self.nodes = self._wait_placed(schedule_timeout)
            self.clock_offsets = [clock_offset(ray, a) for a in self.actors]
            self._get(
                [
                    a.load.remote([(c, artifacts[c].to_bytes(), params[c]) for c in chunks], self.stages, w)
                    for w, (a, chunks) in enumerate(zip(self.actors, self.placement))
                ]
            )
        except BaseException:
            self.close()
            raise

    def _name(self, w: int) -> str:
        chunks = self.placement[w]
        return f"stage {chunks[0]}" if len(chunks) == 1 else f"stages {' and '.join(map(str, chunks))} (worker {w})"

    def _wait_placed(self, timeout: float) -> list[str]:
        ray = self.ray
        refs = [a.ready.remote() for a in self.actors]
        _, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        if pending:
            w = refs.index(pending[0])
            raise VjpsplitError(
                f"{self._name(w)}: Ray did not place its actor within {timeout:g} s: {lack(ray, self.options[w])}"
            )
        return self._get(refs)

    def _get(self, refs, timeout: float | None = None):
        """``ray.get``, with a dead actor reported by the stages it held, and a step past ``timeout`` an error."""
        ray = self.ray
        try:
            return ray.get(refs, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise VjpsplitError(f"the step did not finish within step_timeout={timeout:g} s") from None
        except ray.exceptions.RayActorError as e:
            dead = []
            for w, a in enumerate(self.actors):
                try:
                    ray.get(a.clock.remote(), timeout=30)
                except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                    dead.append(self._name(w))
            why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise VjpsplitError(
                f"{', '.join(dead) or 'a stage'}: its Ray actor died ({why}); build a new RayPipeline to run again"
            ) from None

    def run(
        self,
        x,
        side=(),
        *,
        microbatches: int,
        schedule_name: str = "1f1b",
        progress: bool = False,
        schedule: Sequence[Sequence[Op]] | None = None,
    ) -> PipelineResult:
        """One training step under ``schedule_name`` (or the checked plans ``schedule``); gradients accumulate."""
        if self.from_one is not None:
            stages, params = self.from_one
            pre = PreSplit(stages.stage_batch(x, microbatches))
            self.from_one, compiled, self.compiled = None, self.compiled, False
            try:
                r = self.run(
                    pre,
                    (),
                    microbatches=microbatches,
                    schedule_name=schedule_name,
                    progress=progress,
                    schedule=schedule,
                )
            finally:
                self.from_one, self.compiled = (stages, params), compiled
            return dataclasses.replace(r, grads=stages.gather_grads(r.grads, params))
        ray = self.ray
        S = self.stages
        schedule_name, plans, where = resolve(schedule_name, schedule, S, microbatches)
        check_stages(self.artifacts, schedule_name, plans)
        if where != self.placement:
            raise VjpsplitError(
                f"{describe(schedule_name)} needs RayPipeline(layout={layout_of(schedule_name, schedule, S)!r}): "
                f"it places the stages as {where}, this one holds them as {self.placement}"
            )
        if not self.actors:
            raise VjpsplitError("this RayPipeline is closed; build a new one")
        split = split_ops(plans)
        mbs = split_batch(x, side, microbatches)
        if self.compiled is not False and not progress:
            graph = self._graph(plans, microbatches, split, schedule_name)
            if graph is not None:
                return self._run_graph(graph, mbs, schedule_name, microbatches, plans)
        self._drop_graph()  # its actors take ordinary calls again
        self._get([a.reset.remote() for a in self.actors])
        t0 = time.monotonic()

        def submit(w, op, data, side_):
            # Each actor runs its tasks in submission order, which walk keeps to its list.
            s = (op.chunk, op.mb) in split
            return self.actors[w].op.remote(op.kind, op.chunk, op.mb, data, side_, microbatches, s)

        refs = walk(plans, S, mbs, submit)
        if progress:
            bar = progress_bar(len(refs), progress)
            pending = list(refs)
            while pending:
                # fetch_local=False: wait for completion without copying the values here
                left = t0 + self.step_timeout - time.monotonic()
                ready, pending = ray.wait(pending, num_returns=1, fetch_local=False, timeout=max(left, 0))
                if not ready and left <= 0:
                    raise VjpsplitError(f"the step did not finish within step_timeout={self.step_timeout:g} s")
                if bar is not None:
                    bar.update(len(ready))
            if bar is not None:
                bar.close()
        states = self._get([a.state.remote() for a in self.actors], self.step_timeout)  # after each one's last op
        step = time.monotonic() - t0
        return self._result(states, schedule_name, microbatches, step, False, plans)

    def _graph(self, plans, microbatches: int, split: set, schedule_name: str):
        """The step's compiled graph, built once per (plans, microbatches); None where unavailable."""
        key = (tuple(map(tuple, plans)), microbatches)
        if self.graph is not None and self.graph[0] == key:
            return self.graph[1]
        self._drop_graph()  # an actor takes part in one compiled graph at a time
        try:
            graph = compile_step(self.actors, plans, self.stages, microbatches, split)
        except Exception as e:  # noqa: BLE001 - no Compiled Graphs here: actor calls do the same work
            if self.compiled:
                raise VjpsplitError(
                    f"Ray could not compile the step's graph ({type(e).__name__}: {e}); "
                    "use compiled=False (or None) for actor calls"
                ) from e
            self.compiled = False
            return None
        self.graph = (key, graph)
        return graph

    def _drop_graph(self) -> None:
        if self.graph is not None:
            graph, self.graph = self.graph[1], None
            try:
                graph.teardown()
            except Exception:  # noqa: BLE001 - a graph whose actor died tears down with an error
                pass

    def _run_graph(self, graph, mbs, schedule_name: str, microbatches: int, plans) -> PipelineResult:
        ray = self.ray
        t0 = time.monotonic()
        try:
            # Our own limit, not Compiled Graphs' default 10 s, which a long step exceeds.
            states = ray.get(graph.execute(*[x for x, _ in mbs], *[side for _, side in mbs]), timeout=self.step_timeout)
        except ray.exceptions.RayChannelTimeoutError:
            self._drop_graph()
            raise VjpsplitError(
                f"the compiled step did not finish within step_timeout={self.step_timeout:g} s; "
                "build a new RayPipeline (compiled=False for actor calls) to run again"
            ) from None
        except ray.exceptions.RayError as e:
            self._drop_graph()
            self._get([a.clock.remote() for a in self.actors])  # names a dead actor's stages
            raise VjpsplitError(
                f"the compiled step failed ({type(e).__name__}: {e}); build a new RayPipeline to run again"
            ) from None
        return self._result(states, schedule_name, microbatches, time.monotonic() - t0, True, plans)

    def _result(self, states, schedule_name, microbatches, step, compiled: bool, plans=None) -> PipelineResult:
        S = self.stages
        failed = [st["error"] for st in states if st["error"] is not None]
        if failed:
            raise failed[0]
        grads = {c: g for st in states for c, g in st["grads"].items()}
        losses = next(st["losses"] for st in states if S - 1 in st["grads"])
        events = [e.shifted(off) for st, off in zip(states, self.clock_offsets) for e in st["events"]]
        return PipelineResult(
            schedule_name,
            float(np.mean([losses[m] for m in range(microbatches)])),
            [grads[c] for c in range(S)],
            sorted(events, key=lambda e: e.start),
            S,
            microbatches,
            "ray",
            step,
            {"compiled": compiled},
            plans,
        )

    def close(self) -> None:
        """End the actors (and the local Ray instance, if this object started it)."""
        self._drop_graph()
        for a in self.actors:
            self.ray.kill(a)
        self.actors = []
        if self.started:
            self.ray.shutdown()
            self.started = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
