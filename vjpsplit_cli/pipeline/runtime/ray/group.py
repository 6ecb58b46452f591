"""A Ray runner's actors, one per worker: asked of Ray, placed, loaded with their stages, waited on, described.

``ActorGroup`` is the actors' side of ``pipeline.RayPipeline`` (which runs steps on
them): Ray's actor options per worker, the wait for Ray to place each within
``schedule_timeout`` (one error naming the stage and the resource it lacks), each
actor's node and its monotonic clock against the driver's, the values of their
calls (an actor that died is one error naming its stages), a step's wait within
``step_timeout``, and what each worker of a stuck step is doing. May import the
ray layer's ``setup``, ``actor``, ``lists``, ``peers``, ``reports`` and ``waiting``, and the runtime's
``flight``, ``dispatch`` and ``model``; not ``pipeline``, which builds on it.
"""

from __future__ import annotations

import secrets
import time
import weakref
from types import ModuleType
from typing import TYPE_CHECKING, Any, Mapping, Sequence, TypeVar

from ....config import ray_transport
from ....errors import VjpsplitError
from ...schedules.layout import Layout
from ...schedules.ops import OpKey
from ...schedules.timeline import Event
from ..dispatch import ProgressBar
from ..flight import StepInterrupted, clause, default_path, ring_rows, write_flight
from ..model import Model
from . import waiting
from .actor import StepReport, StageActor, WorkerStatus, cpu_environment, xla_threads
from .lists import CONCURRENCY_GROUPS, INBOX
from .peers import TOKEN_BYTES, node_address
from .reports import SENT, ReportDesk
from .setup import ActorHandle, RemoteClass, clock_offset, init_ray, lack

if TYPE_CHECKING:
    from ray import ObjectRef

REPORT_POLL = 0.05  # seconds between looks at the step's Ray calls while waiting for its reports' frames
# Seconds a report's frame may take after every call of the step said SENT (each sent its frame before returning);
# past them the frame is lost (a connection that broke), not the step's timeout later.
REPORT_GRACE = 10.0
T = TypeVar("T")


class ActorGroup:
    """One Ray actor per worker of a layout, and the driver's calls on them (``RayPipeline`` runs steps on it).

    The subclass sets ``ray``, ``model``, ``layout``, ``num_stages``, ``step_timeout``,
    ``steps`` and ``hang_report`` before ``make_actors``; see ``RayPipeline`` for each.
    """

    actor_class: type[StageActor] = StageActor  # the Trainer's actors extend it
    replicas = 1  # replicas of every stage on each actor's devices (the Trainer's data_parallel)
    ray: ModuleType
    model: Model
    layout: Layout
    num_stages: int
    step_timeout: float
    steps: int
    hang_report: str | None

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

        Each worker's state is said as ``flight.clause`` says it (on the driver's clock,
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
        written = write_flight(path, text[2:], rows)
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


def _kill_actors(ray: ModuleType, actors: list[ActorHandle]) -> None:
    """Kill ``actors`` and empty the list (``ActorGroup.close``, or a group collected without it)."""
    for a in actors:
        try:
            ray.kill(a)
        except Exception:  # noqa: BLE001 - already gone, or Ray itself shut down
            pass
    actors.clear()
