"""The Ray runner: ``RayPipeline`` runs a step on its actors, as each worker's own list or a Compiled Graph.

``RayPipeline`` is one class. Its actors, one per worker: asked of Ray with per-worker actor options and placed
within ``schedule_timeout`` (one error naming the stage and the resource it lacks), their clocks measured against
the driver's, the values of their calls (an actor that died is one error naming its stages), a step's wait within
``step_timeout``, and what each worker of a stuck step is doing. Its steps: the arguments checked, the plans
resolved against the layout, the step handed out (``lists``) or run as a graph (``compiled``), and its result with
the actors' events on the driver's clock.
"""

from __future__ import annotations

import secrets
import time
import weakref
from types import ModuleType
from typing import TYPE_CHECKING, Any, Mapping, Sequence, TypeVar

from ....config import ray_transport
from ....errors import VjpsplitError
from ...schedules.catalog import Plans, Schedule, describe, schedule_of
from ...schedules.layout import Layout
from ...schedules.layout import layout_kind
from ...schedules.ops import Op, OpKey
from ...schedules.stepplans import resolve
from ...schedules.timeline import Event
from ...stages.directory import Stages
from ..dispatch import ProgressBar, progress_bar
from ..hang_report import StepInterrupted, clause, default_path, ring_rows, write_hang_report
from ..model import Microbatch, model_of
from ..result import PipelineResult, aux_per_microbatch, step_result
from . import waiting
from .actor import StepReport, StageActor, StepState, WorkerStatus, cpu_environment, raise_first_error, xla_threads
from .compiled import compile_step
from .lists import CONCURRENCY_GROUPS, INBOX, submit_lists
from .peers import TOKEN_BYTES, node_address
from .reports import SENT, ReportDesk
from .setup import SCHEDULE_TIMEOUT, ActorHandle, RemoteClass, clock_offset, init_ray, lack
from ....treetypes import Leaf, PyTree

if TYPE_CHECKING:
    from ray import ObjectRef
    from ray.dag.compiled_dag_node import CompiledDAG

    from ....artifact.artifact import Artifact

    GraphKey = tuple[tuple[tuple[Op, ...], ...], int]  # a compiled step's plans and microbatches

STEP_TIMEOUT = 600.0  # seconds for one step's results, after which the step is an error, not a hang
RUNNER = "ray"
REPORT_POLL = 0.05  # seconds between looks at the step's Ray calls while waiting for its reports' frames
# Seconds a report's frame may take after every call of the step said SENT (each sent its frame before returning);
# past them the frame is lost (a connection that broke), not the step's timeout later.
REPORT_GRACE = 10.0
T = TypeVar("T")


class RayPipeline:
    """Workers as Ray actors (one process each); a step is one call per actor running its own list of operations.

    Actors persist across ``run`` calls until ``close()`` (or ``with``); ``nodes[w]`` is worker ``w``'s Ray node id,
    ``clock_offsets[w]`` its clock minus the driver's (seconds). docs/howto/ray.md says the rest.

    Args:
        artifacts: A ``Stages`` (``run`` then takes the batch tuple), or one artifact per stage.
        params: The whole parameter pytree for a ``Stages``, else one parameter pytree per stage.
        address: A Ray cluster address (``ray://host:10001`` or ``auto``); ``None`` starts (or joins) a local instance.
        runtime_env: Ray's runtime environment for the actors; ``None`` for none.
        num_cpus_per_stage: The CPUs each actor reserves (by default 0), unless its ``actor_options`` say otherwise.
        layout: ``"stage"`` (one per actor), ``"v"`` (ZB-V's V), ``"interleaved"``, or a tuple of stages per worker.
        actor_options: One dict of Ray actor options per worker (see ``placement_group_options``); ``None`` for none.
        schedule_timeout: Seconds for Ray to place and start every actor.
        compiled: ``True`` runs steps as a Ray Compiled Graph, ``None`` where Ray can, ``False`` (default) never.
        step_timeout: Seconds for a step's results (by default 600).

    Raises:
        VjpsplitError: If Ray is missing, ``compiled=True`` meets a ``Stages``, the artifacts and parameter sets
            differ in number, the layout or ``actor_options`` is malformed, or an actor is not placed in time.
    """

    actor_class: type[StageActor] = StageActor  # the Trainer's actors extend it
    replicas = 1  # replicas of every stage on each actor's devices (the Trainer's data_parallel)

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
        self.hang_report: str | None = None  # where a stuck step's report goes (None: hang_report.default_path)

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

        Args:
            x: The first stage's input (for a ``Stages``, the batch tuple).
            side: The last stage's side inputs (a ``Stages`` takes none).
            microbatches: How many microbatches to split the batch into.
            schedule: A built-in schedule's name (by default ``"1f1b"``), or a ``Schedule``.
            progress: Whether to show a progress bar over the workers' lists (then the step runs as actor calls).
            timed: Whether each operation waits for its results, so the timeline holds compute times (a compiled
                graph's steps are always timed).

        Returns:
            The step's ``PipelineResult`` (``runner="ray"``, ``extra={"compiled": ...}``).

        Raises:
            VjpsplitError: If the schedule cannot run on these stages, microbatches and layout, the pipeline is
                closed, the batch does not split into ``microbatches``, the compiled graph cannot be built or fails,
                the step runs past ``step_timeout``, or an operation or actor fails (naming its stage).
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

    # -- the actors, one per worker: asked of Ray, placed, loaded, waited on, described ------------
    def make_actors(
        self,
        address: str | None,
        runtime_env: Mapping[str, object] | None,
        num_cpus_per_stage: float,
        actor_options: Sequence[Mapping[str, Any]] | None,
    ) -> None:
        """Start (or join) Ray and ask it for one actor per worker, with its actor options (not waited for).

        Args:
            address: A Ray cluster address; ``None`` starts (or joins) a local Ray instance.
            runtime_env: Ray's runtime environment for the actors; ``None`` for none.
            num_cpus_per_stage: The CPUs each actor reserves, unless its ``actor_options`` say otherwise.
            actor_options: One dict of Ray actor options per worker; ``None`` for none.
        """
        self.transport = ray_transport()  # read once: every actor this runner starts sends the same way
        self.started = init_ray(self.ray, address, runtime_env, self.layout.num_workers)
        self.token = secrets.token_bytes(TOKEN_BYTES)  # what opens the actors' sockets to one another
        self.reports: ReportDesk | None = None  # the driver's socket for untimed reports (``connect``)
        self.actors: list[ActorHandle] = []
        # A group dropped without ``close`` kills its actors when collected: they hold one another's handles
        # (``connect``), so Ray would keep them alive. The finalizer holds the list (``replace`` swaps in place).
        self.end_actors = weakref.finalize(self, _kill_actors, self.ray, self.actors)
        self.end_actors.atexit = False  # at exit Ray ends a driver's actors itself
        self.options: list[dict[str, Any]] = []  # per worker, Ray's actor options
        arts = self.model.artifacts
        # Through the untyped module: ray.remote's typed overloads lack concurrency_groups (deliveries beside the list).
        self._remote_class: RemoteClass = self.ray.remote(concurrency_groups=CONCURRENCY_GROUPS)(self.actor_class)
        # A Ray of one node joined without an address is this host's: every actor shares its cores.
        one_node = address is None and sum(1 for node in self.ray.nodes() if node["Alive"]) == 1
        threads = xla_threads(self.layout.num_workers if one_node else None)
        # The job's runtime_env as Ray holds it: the one given here, or that of a Ray the user initialised.
        job_env_vars = dict(self.ray.get_runtime_context().runtime_env or {}).get("env_vars")
        job_env = job_env_vars if isinstance(job_env_vars, Mapping) else None
        for w, held in enumerate(self.layout.workers):
            opts = {"num_cpus": num_cpus_per_stage, **(dict(actor_options[w]) if actor_options else {})}
            devices = self.replicas * max(arts[s].manifest.nr_devices for s in held)
            cpu_environment(opts, devices, threads, job_env)
            self.options.append(opts)
            self.actors.append(self.new_actor(w))
        n = self.layout.num_workers
        self.nodes: list[str] = [""] * n
        self.clock_offsets: list[float] = [0.0] * n

    def new_actor(self, worker: int) -> ActorHandle:
        """A new actor for ``worker``, with its actor options: at the start, or in place of one that was lost.

        Args:
            worker: The worker's index.

        Returns:
            The new actor's handle (not yet ready: see ``start_workers``).
        """
        return self._remote_class.options(**self.options[worker]).remote()

    def connect(self) -> None:
        """Tell every actor every worker's handle, socket address and which worker holds each stage (after any
        replaced); with ``VJPSPLIT_RAY_TRANSPORT=ray``, handles only."""
        worker_of = self.layout.worker_of()
        addresses = None
        if self.transport == "socket":
            addresses = self.get([a.listen.remote(self.token) for a in self.actors])
            if self.reports is None:
                self.reports = ReportDesk(self.token, node_address())
        driver = None if self.reports is None else self.reports.address
        self.get([a.connect.remote(self.actors, worker_of, addresses, self.token, driver) for a in self.actors])

    def start_workers(self, workers: Sequence[int], timeout: float, what: str = "its actor") -> None:
        """Wait until Ray has placed ``workers``' actors, note their nodes and clocks, and load each its stages.

        Within ``timeout`` seconds, else one error naming the worker and what its
        options lack. Each is loaded with its stages as this pipeline began: at the
        start, or for actors replacing lost ones (``what`` says which, in the error).

        Args:
            workers: The workers' indices.
            timeout: Seconds for Ray to place their actors.
            what: What to call each actor in the error.

        Raises:
            VjpsplitError: If an actor is not placed within ``timeout``, or one dies
                (naming the stages it held).
        """
        ray = self.ray
        refs = [self.actors[w].ready.remote() for w in workers]
        _, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        if pending:
            w = list(workers)[refs.index(pending[0])]
            raise VjpsplitError(
                f"{self.layout.label(w)}: Ray did not place {what} within {timeout:g} s: {lack(ray, self.options[w])}"
            )
        for w, node in zip(workers, self.get(refs)):
            self.nodes[w], self.clock_offsets[w] = node, clock_offset(ray, self.actors[w])
        arts, params, held = self.model.artifacts, self.model.stage_params, self.layout.workers
        self.get(
            [
                self.actors[w].load.remote(
                    [(s, arts[s].to_bytes(), params[s]) for s in held[w]], self.num_stages, w, self.replicas
                )
                for w in workers
            ]
        )

    def get(self, refs: Sequence[ObjectRef[T]]) -> list[T]:
        """The values of ``refs``; a dead actor is one error naming the stages it held.

        Args:
            refs: Ray object refs of the actors' calls.

        Returns:
            Their values, in order.

        Raises:
            VjpsplitError: If an actor died, naming the stages it held.
        """
        return waiting.get(self.ray, refs, self.actors, self.layout)

    def fetch(
        self,
        refs: Sequence[ObjectRef[T]],
        owners: Sequence[int],
        t0: float,
        *,
        hint: str = "",
        bar: ProgressBar | None = None,
        watch: Sequence[ObjectRef[Any]] = (),
    ) -> list[T]:
        """The values of ``refs`` (worker ``owners[i]``'s) once all are done, within ``step_timeout`` of ``t0``.

        ``watch``: the step's lists (``start_step``); one whose actor died ends the wait at once and
        releases the other workers, and ``get`` names the stages it held.

        Args:
            refs: Ray object refs of the actors' calls.
            owners: Per ref, the worker whose call it is.
            t0: The step's start on the driver's ``time.monotonic`` clock.
            hint: Words added to a timeout's error.
            bar: A progress bar to advance as refs finish; ``None`` for none.
            watch: The step's lists, watched for a dead actor.

        Returns:
            The values of ``refs``, in order.

        Raises:
            VjpsplitError: If the step runs past ``step_timeout`` (saying what each
                worker is doing), or an actor died (naming the stages it held).
        """
        waiting.wait_step(
            self.ray,
            refs,
            owners,
            t0 + self.step_timeout,
            self.step_timeout,
            self.layout,
            hint=hint,
            bar=bar,
            watch=watch,
            on_stop=lambda: self._abort(self.steps),
            describe=lambda: self.describe(t0),
        )
        return self.get([*watch, *refs])[len(watch) :]

    def fetch_reports(
        self, refs: Sequence[ObjectRef[Any]], owners: Sequence[int], t0: float, *, hint: str = ""
    ) -> list[Any]:
        """``fetch(refs, owners, t0, hint=hint, watch=refs)`` for calls that may send their reports as frames
        (``reports``): each worker's frame of this step where it came, else what its call returned.

        While frames come, nothing is fetched from Ray; a call done before its frame (a report with an error
        or timings, an actor gone) or the deadline hands the whole wait to ``fetch``, which names what went
        wrong, and the calls that said ``SENT`` take their frames. A frame not here ``REPORT_GRACE`` seconds
        after every call said ``SENT`` is lost: one error naming its stage.

        Args:
            refs: Ray object refs of the actors' calls.
            owners: Per ref, the worker whose call it is.
            t0: The step's start on the driver's ``time.monotonic`` clock.
            hint: Words added to a timeout's error.

        Returns:
            Per ref, in order, its worker's report: its frame, or what its call returned.

        Raises:
            VjpsplitError: A frame lost (naming its stage), or as ``fetch`` raises.
        """
        desk, step = self.reports, self.steps
        got: dict[int, Any] = {}
        pending = dict(zip(owners, refs))  # workers whose frame has not come
        running = {id(r): r for r in refs}  # calls not yet seen to return SENT
        deadline = t0 + self.step_timeout
        try:
            while pending and desk is not None:
                for w in list(pending):
                    frame = desk.take(step, w)
                    if frame is not None:
                        got[w] = frame
                        del pending[w]
                if not pending or time.monotonic() > deadline:
                    break
                done = (
                    self.ray.wait(list(running.values()), num_returns=1, timeout=0, fetch_local=False)[0]
                    if running
                    else []
                )
                if done:
                    try:
                        values = self.ray.get(done)
                    except self.ray.exceptions.RayError:
                        break  # an actor gone: the general wait below names it and releases the others
                    if any(v != SENT for v in values):
                        break  # a report through Ray (an error, timings): the general wait below
                    for r in done:
                        running.pop(id(r), None)
                    if not running:
                        deadline = min(deadline, time.monotonic() + REPORT_GRACE)
                desk.wait(step, pending, REPORT_POLL)
        except KeyboardInterrupt as e:
            detail = self.describe(t0)
            self._abort(step)
            raise StepInterrupted(f"the step was interrupted{detail}") from e
        if not pending:
            return [got[w] for w in owners]
        values = self.fetch(list(refs), owners, t0, hint=hint, watch=list(refs))
        out = []
        for w, v in zip(owners, values):
            while v == SENT and w not in got and desk is not None and time.monotonic() <= deadline:
                frame = desk.take(step, w)
                if frame is None:
                    desk.wait(step, (w,), REPORT_POLL)
                else:
                    got[w] = frame
            out.append(got.get(w, v))
        if any(v == SENT for v in out):  # a frame that never came: its connection was lost
            raise VjpsplitError(f"{self.layout.label(owners[out.index(SENT)])}: its report was lost on the way")
        return out

    def describe(self, t0: float, wait: float = 1.0) -> str:
        """What each worker is doing, its last operations written as JSON: the tail of a stuck step's error.

        Each worker's state is said as ``hang_report.clause`` says it (on the driver's clock,
        ms since ``t0``), for a stuck or interrupted step. An actor that does not answer
        within ``wait`` seconds is said to be so.

        Args:
            t0: The step's start on the driver's ``time.monotonic`` clock.
            wait: Seconds to wait for each actor's answer.

        Returns:
            ``"; "`` then one clause per worker, and where the last operations were
            written (or that they could not be).
        """
        ray = self.ray
        refs = [a.status.options(concurrency_group=INBOX).remote() for a in self.actors]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=wait)
        got: dict[int, WorkerStatus] = {}
        for w, ref in enumerate(refs):
            if ref in ready:
                try:
                    got[w] = ray.get(ref)
                except Exception:  # noqa: BLE001 - a dead actor: said below
                    pass
        sent = {
            OpKey(*k): t - self.clock_offsets[w] for w, st in got.items() for k, t in st["sent"].items()
        }  # each value whose delivery went out, on the driver's clock
        worker_of = self.layout.worker_of()
        parts, rows = [], []
        for w in range(len(self.actors)):
            if w not in got:
                parts.append(f"worker {w}: its actor did not answer within {wait:g} s")
                rows.append({"worker": w, "now": parts[-1], "ops": []})
                continue
            state, op, src, since = got[w]["now"]
            off = self.clock_offsets[w]
            now = (state, None if op is None else OpKey(*op), None if src is None else OpKey(*src), since - off)
            # A value whose delivery went out but this worker never took is a delivery that hangs.
            parts.append(clause(w, now, t0, worker_of, sent, got[w]["after"]))
            ops = [
                r
                for s, ring in got[w]["rings"].items()
                for r in ring_rows([(k, m, a - off, b - off, waited) for k, m, a, b, waited in ring], int(s), t0)
            ]
            rows.append({"worker": w, "now": parts[-1], "ops": sorted(ops, key=lambda r: r["start_ms"])})
        path = self.hang_report or default_path()
        text = "; " + "; ".join(parts)
        written = write_hang_report(path, text[2:], rows)
        return text + (f"; the last operations of every worker: {path}" if written else f" (could not write {path})")

    def _abort(self, step: int) -> None:
        for a in self.actors:
            try:
                a.abort.options(concurrency_group=INBOX).remote(step)
            except Exception:  # noqa: BLE001 - a dead actor: nothing of it waits
                pass

    def driver_events(self, states: Sequence[StepReport]) -> list[Event]:
        """The events in each worker's ``state`` (or ``report``), moved onto the driver's clock.

        Args:
            states: Per worker, the state (or report) its actor returned, with its ``"events"``.

        Returns:
            Every worker's events, shifted by its clock offset.
        """
        return [e.shifted(off) for st, off in zip(states, self.clock_offsets) for e in st["events"]]

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


def _kill_actors(ray: ModuleType, actors: list[ActorHandle]) -> None:
    """Kill ``actors`` and empty the list (``RayPipeline.close``, or a runner collected without it)."""
    for a in actors:
        try:
            ray.kill(a)
        except Exception:  # noqa: BLE001 - already gone, or Ray itself shut down
            pass
    actors.clear()
