"""The Ray runner: ``RayPipeline`` runs a step on its actors, as each worker's own list or a Compiled Graph.

The actors themselves are ``group``'s (``ActorGroup``, which ``RayPipeline``
extends): placed by per-worker actor options within ``schedule_timeout`` (one
error naming the stage and the resource it lacks), their clocks measured against
the driver's, a step's wait, an actor that dies named by its stages. Here: the
arguments checked, the plans resolved against the layout, the step handed out
(``lists``) or run as a graph (``compiled``), and its result with the actors'
events on the driver's clock. May import the ray layer's other modules.
"""

from __future__ import annotations

import time
from types import ModuleType
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from ....errors import VjpsplitError
from ...schedules.catalog import Plans, Schedule, describe, schedule_of
from ...schedules.layout import Layout
from ...schedules.layout import layout_kind
from ...schedules.ops import Op
from ...schedules.stepplans import resolve
from ...stages.directory import Stages
from ..dispatch import progress_bar
from ..model import Microbatch, model_of
from ..result import PipelineResult, aux_per_microbatch, step_result
from .group import ActorGroup
from .actor import StepState, raise_first_error
from .compiled import compile_step
from .lists import submit_lists
from .setup import SCHEDULE_TIMEOUT
from ....treetypes import Leaf, PyTree

if TYPE_CHECKING:
    from ray import ObjectRef
    from ray.dag.compiled_dag_node import CompiledDAG

    from ....artifact.artifact import Artifact

    GraphKey = tuple[tuple[tuple[Op, ...], ...], int]  # a compiled step's plans and microbatches

STEP_TIMEOUT = 600.0  # seconds for one step's results, after which the step is an error, not a hang
RUNNER = "ray"


class RayPipeline(ActorGroup):
    """Workers as Ray actors (one process each); a step is one call per actor running its own list of operations.

    Activations and cotangents are sent actor to actor (``lists``; mid-size ones in
    pieces inside the call rather than through Ray's object store).

    ``layout="stage"`` (default) puts one stage on each actor, for GPipe, 1F1B and
    ZB-H1; ``layout="v"`` puts two on each in ZB-V's (and DualPipeV's) V;
    ``layout="interleaved"`` two on each, round robin (interleaved 1F1B); a list of
    stage tuples, one per worker, lays them out as given (for a ``Schedule``'s plans). ``address=None`` starts (or
    joins) a local Ray instance; pass a cluster address (``ray://host:10001`` or
    ``auto``) for multi-host. ``actor_options`` gives one dict of Ray actor options
    per worker (``num_cpus``, ``num_gpus``, ``resources``, ``scheduling_strategy``
    such as a placement group bundle or ``NodeAffinitySchedulingStrategy``; see
    ``runtime.ray.setup.placement_group_options``). Actors not placed and started within
    ``schedule_timeout`` seconds are an error naming the stage and what it lacks.
    Actors persist across ``run`` calls; ``close()`` (or ``with``) ends them. The
    driver sends the batch and fetches the gradients, losses and timings once per
    step; activations and cotangents pass from actor to actor without reaching it.
    ``nodes[w]`` is the Ray node id worker ``w`` runs on; ``clock_offsets[w]`` its
    clock minus the driver's (seconds). ``compiled=True`` runs each step as a Ray
    Compiled Graph (``None``: where Ray can compile it, else actor calls; default
    False: one call per actor per step, its list of operations, whose results it
    sends to the other actors itself; ``lists``). Each actor runs its stages on its
    first device(s), as a worker in-process does. A step whose results are not back within
    ``step_timeout`` seconds is an error. ``artifacts`` may be a ``Stages``
    (``export_stages``; ``compiled`` False or None): ``params`` is then the whole parameter pytree, ``run``
    takes the batch tuple, and the result's ``grads`` have ``params``' structure
    (its steps run as actor calls: each stage's batch inputs go to it directly).

    Args:
        artifacts: A ``Stages``, or one artifact per stage.
        params: The whole parameter pytree for a ``Stages``, else one parameter pytree per stage.
        address: A Ray cluster address (``ray://host:10001`` or ``auto``); ``None``
            starts (or joins) a local Ray instance.
        runtime_env: Ray's runtime environment for the actors; ``None`` for none.
        num_cpus_per_stage: The CPUs each actor reserves (by default 0), unless its
            ``actor_options`` say otherwise.
        layout: ``"stage"``, ``"v"``, ``"interleaved"``, or one tuple of stages per worker.
        actor_options: One dict of Ray actor options per worker; ``None`` for none.
        schedule_timeout: Seconds for Ray to place and start every actor.
        compiled: ``True`` runs steps as a Ray Compiled Graph, ``None`` where Ray can
            compile it, ``False`` (default) as actor calls.
        step_timeout: Seconds for a step's results (by default 600).

    Attributes:
        nodes: Per worker, the Ray node id its actor runs on.
        clock_offsets: Per worker, its clock minus the driver's, in seconds.
        actors: The actors' handles, one per worker (empty once closed).
        layout: The ``Layout``: the stages each worker holds.
        num_stages: The pipeline's stage count.
        compiled: Whether steps run as a compiled graph (``None``: where Ray can).
        step_timeout: Seconds for a step's results.
        steps: The steps started so far.
        replicas: The replicas of every stage on each actor's devices (the Trainer's
            ``data_parallel``; a class attribute, 1 here).
        hang_report: Where a stuck step's report of the last operations goes;
            ``None`` for ``flight.default_path``.

    Raises:
        VjpsplitError: If Ray is not installed, ``compiled=True`` is asked for a
            ``Stages``, the artifacts and parameter sets differ in number, the layout
            is malformed, ``actor_options`` is not one dict per worker, or an actor is
            not placed within ``schedule_timeout`` (naming its stage and what it lacks).
    """

    def __init__(
        self,
        artifacts: Sequence[Artifact] | Stages,
        params: PyTree,
        *,
        address: str | None = None,
        runtime_env: Mapping[str, object] | None = None,
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
        self.model = model_of(artifacts, params)
        self.ray: ModuleType = ray
        # A Stages feeds each stage its own batch inputs: actor calls, not the graph's one side list.
        if compiled and self.model.sides_per_stage:
            raise VjpsplitError(
                "compiled=True runs a list of artifacts (one side input list for the graph); a Stages feeds "
                "each stage its own batch inputs through actor calls: use compiled=False (or None)"
            )
        self.compiled = False if self.model.sides_per_stage else compiled
        self.step_timeout = step_timeout
        self.graph: tuple[GraphKey, CompiledDAG] | None = None  # (key, compiled graph) of the last compiled step
        self.num_stages = self.model.num_stages
        self.layout = Layout.of(layout, self.num_stages)
        if actor_options is not None and len(actor_options) != self.layout.num_workers:
            raise VjpsplitError(
                f"actor_options has {len(actor_options)} entries for {self.layout.num_workers} workers; "
                "give one dict of Ray actor options per worker"
            )
        self.make_actors(address, runtime_env, num_cpus_per_stage, actor_options)
        n = self.layout.num_workers
        try:
            self.start_workers(range(n), schedule_timeout)
            self.connect()
        except BaseException:
            self.close()
            raise
        self.steps = 0  # steps started: what an actor's inbox tells one step's deliveries from another's
        self.hang_report: str | None = None  # where a stuck step's report goes (None: flight.default_path)

    def start_step(
        self,
        plans: Sequence[Sequence[Op]],
        mbs: Sequence[Microbatch],
        microbatches: int,
        timed: bool,
        call: str = "run_step",
        extra: Sequence[object] = (),
    ) -> list[ObjectRef[Any]]:
        """Hand every actor its list of the next step (``lists.submit_lists``); the refs of the lists.

        Args:
            plans: One list of ``Op`` per worker.
            mbs: The step's microbatches.
            microbatches: Their number.
            timed: Whether each operation waits for its results and is timed.
            call: The actors' method that runs the list (a subclass's may end the step there too).
            extra: What ``call`` takes after ``run_step``'s arguments.

        Returns:
            One Ray object ref per worker: its list's call.
        """
        self.steps += 1
        return submit_lists(self.actors, self.steps, plans, mbs, self.num_stages, microbatches, timed, call, extra)

    def probe_delivery(self, value: object, repeats: int = 50, workers: tuple[int, int] = (0, 1)) -> list[float]:
        """One actor-to-actor delivery of ``value`` timed ``repeats`` times, as a step sends its results.

        Worker ``workers[0]`` sends ``value`` to ``workers[1]``, which sends it back, through their senders and
        inboxes (``lists``); each round trip is two deliveries. What a step's send costs beyond its compute.

        Args:
            value: An array (or pytree of arrays), such as an activation one stage sends the next.
            repeats: How many round trips to time.
            workers: The two workers, by index.

        Returns:
            Each round trip's half, in seconds (the first worker's ``time.perf_counter``).

        Raises:
            VjpsplitError: If the pipeline is closed, ``workers`` are not two of its workers, an actor dies, or the
                round trips run past ``step_timeout``.
        """
        a, b = workers
        if not self.actors:
            raise VjpsplitError("this RayPipeline is closed; build a new one")
        if a == b or not all(0 <= w < len(self.actors) for w in workers):
            raise VjpsplitError(
                f"workers={workers!r}: give two different workers of this pipeline's {len(self.actors)}"
            )
        self._drop_graph()  # its actors take ordinary calls again
        self.steps += 1  # a step of its own: the inboxes drop older steps' values
        t0 = time.monotonic()
        refs = [
            self.actors[a].echo.remote(self.steps, b, value, repeats, True),
            self.actors[b].echo.remote(self.steps, a, None, repeats, False),
        ]
        # As a step's wait: within step_timeout, and one actor's death releases the other's inbox (else it would
        # wait in take for good and its queue would hold every later call).
        trips = self.fetch(refs, [a, b], t0, watch=refs)[0]
        return [t / 2 for t in trips]

    def run(
        self,
        x: PyTree,
        side: Mapping[str, Leaf] | Sequence[Leaf] = (),
        *,
        microbatches: int,
        schedule: str | Schedule | Plans = "1f1b",
        progress: bool = False,
        timed: bool = True,
    ) -> PipelineResult:
        """One training step under ``schedule`` (a name, or a ``Schedule``: plans are checked); gradients accumulate.

        ``timed`` (default): each operation waits for its results and the result's
        timeline holds their compute times; ``timed=False`` records none (a compiled
        graph's steps are always timed).

        Args:
            x: The first stage's input (for a ``Stages``, the batch tuple).
            side: The last stage's side inputs (a ``Stages`` takes none).
            microbatches: How many microbatches to split the batch into.
            schedule: A built-in schedule's name (by default ``"1f1b"``), or a ``Schedule`` (plans:
                ``Schedule(plans=plans)``, checked first).
            progress: Whether to show a progress bar over the workers' lists (then the step runs as actor calls).
            timed: Whether to time each operation.

        Returns:
            The step's ``PipelineResult`` (``runner="ray"``, ``extra={"compiled": ...}``).

        Raises:
            VjpsplitError: If the schedule or plans cannot run on these stages and
                microbatches or need another layout than this pipeline's, a stage lacks
                the split backward the plans use, the pipeline is closed, the batch does
                not split into ``microbatches``, the compiled graph cannot be built
                (``compiled=True``) or fails, the step runs past ``step_timeout``, or an
                operation or actor fails (naming its stage).
        """
        S = self.num_stages
        chosen = schedule_of(schedule)
        name, plans, layout = resolve(chosen, S, microbatches)
        self.model.check_plans(name, plans)
        if layout != self.layout:
            need = layout_kind(name) if chosen.plans is None else layout.as_lists()
            raise VjpsplitError(
                f"{describe(name)} needs RayPipeline(layout={need!r}): "
                f"it lays the stages out as {layout.as_lists()}, this one holds them as {self.layout.as_lists()}"
            )
        if not self.actors:
            raise VjpsplitError("this RayPipeline is closed; build a new one")
        mbs = self.model.microbatches(x, side, microbatches)
        if self.compiled is not False and not progress:
            graph = self._graph(plans, microbatches)
            if graph is not None:
                return self._run_graph(graph, mbs, name, microbatches, plans)
        self._drop_graph()  # its actors take ordinary calls again
        t0 = time.monotonic()
        lists = self.start_step(plans, mbs, microbatches, timed or progress)
        everyone = list(range(self.layout.num_workers))
        bar = progress_bar(len(lists), progress)  # over the workers' lists, as each is done
        try:
            if bar is not None:
                self.fetch(lists, everyone, t0, bar=bar, watch=lists)
        finally:
            if bar is not None:
                bar.close()
        states = self.fetch([a.state.remote() for a in self.actors], everyone, t0, watch=lists)
        return self._result(states, name, microbatches, time.monotonic() - t0, False, plans, timed or progress)

    def _graph(self, plans: Sequence[Sequence[Op]], microbatches: int) -> CompiledDAG | None:
        """The step's compiled graph, built once per (plans, microbatches); None where unavailable."""
        key = (tuple(map(tuple, plans)), microbatches)
        if self.graph is not None and self.graph[0] == key:
            return self.graph[1]
        self._drop_graph()  # an actor takes part in one compiled graph at a time
        try:
            graph = compile_step(self.actors, plans, self.num_stages, microbatches)
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

    def _run_graph(
        self, graph: CompiledDAG, mbs: Sequence[Microbatch], name: str, microbatches: int, plans: Sequence[Sequence[Op]]
    ) -> PipelineResult:
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
            self.get([a.clock.remote() for a in self.actors])  # names a dead actor's stages
            raise VjpsplitError(
                f"the compiled step failed ({type(e).__name__}: {e}); build a new RayPipeline to run again"
            ) from None
        return self._result(states, name, microbatches, time.monotonic() - t0, True, plans)

    def _result(
        self,
        states: Sequence[StepState],
        name: str,
        microbatches: int,
        step_time: float,
        compiled: bool,
        plans: Sequence[Sequence[Op]],
        timed: bool = True,
    ) -> PipelineResult:
        S = self.num_stages
        raise_first_error(states)
        grads = {s: g for st in states for s, g in st["grads"].items()}
        last = states[self.layout.worker_of()[S - 1]]
        return step_result(
            schedule=name,
            plans=plans,
            num_stages=S,
            microbatches=microbatches,
            runner=RUNNER,
            step_time=step_time,
            losses=last["losses"],
            grads=self.model.gather([grads[s] for s in range(S)]),
            events=self.driver_events(states),
            extra={"compiled": compiled},
            timed=timed,
            aux=aux_per_microbatch(self.model.artifacts[-1], last["aux"], microbatches),
        )

    def close(self) -> None:
        """End the actors (and the local Ray instance, if this object started it)."""
        self._drop_graph()
        self.end_actors()  # kills them, once
        self.actors = []
        if self.reports is not None:
            self.reports.close()
            self.reports = None
        if self.started:
            self.ray.shutdown()
            self.started = False

    def __enter__(self) -> RayPipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
