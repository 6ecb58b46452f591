"""The Ray actor of one pipeline worker, and the environment its process starts with.

The actor imports no user code: it loads its stages' artifacts from bytes. Its
``__init__`` does nothing, so the time an actor takes to become ready is the time
Ray takes to place and start it (which the driver bounds); ``load`` does the work.
What the driver gets back of a step is a ``StepReport`` (or, with the gradients, a
``StepState``); what a worker does now, a ``WorkerStatus``.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable, Mapping, Sequence, TypedDict, TypeVar

import numpy as np

from ...schedules.ops import BACKWARDS, Kind, Op
from ...schedules.timeline import Event, Phase
from ....errors import VjpsplitError
from ..devices import placed, placement
from ..hang_report import COMPILING, PENDING, RUNS, Now, RingOp, compile_aware, idle
from ..offload import Offload
from ..replicas import ReplicaGroup, reductions, replica_placement, stage_need
from ..stageops import run_op
from ..timed import Timeline
from ..untimed import Dispatched
from ..worker import StageWorker
from ....treetypes import Leaf, PyTree
from .inbox import Inbox, Key
from .lists import Sender, run_list, unpack
from .peers import Address, Links, Listener, node_address
from .setup import ActorHandle

T = TypeVar("T")


class StepReport(TypedDict):
    """A worker's step without arrays but the aux (``StageActor.report``): losses, the last stage's aux leaves per
    microbatch (host arrays; empty without aux), timings on its clock, its first error."""

    losses: dict[int, float]
    aux: dict[int, list[np.ndarray]]
    events: list[Event]
    phases: list[Phase]
    error: BaseException | None


class StepState(StepReport):
    """A worker's step with its gradients (``StageActor.state``): per stage held, as host arrays."""

    grads: dict[int, PyTree]
    device_count: int
    devices: dict[int, list[int]]


class WorkerStatus(TypedDict):
    """What a worker does now (``StageActor.status``), on its own clock.

    ``now``: ``hang_report.Now`` with its operations as ``(kind, mb, stage)``; ``after``: with a PENDING ``now``, how
    many operations dispatched after it have not finished either; ``handed``: this step's values handed to the
    sender, and when; ``sent``: those whose delivery went out to another worker (the sender waits for a value
    still being computed), and when; ``rings``: per stage held, its last operations ``(kind, mb, start, end)``.
    """

    now: tuple[str, Key | None, Key | None, float]
    after: int
    handed: dict[Key, float]
    sent: dict[Key, float]
    rings: dict[int, list[RingOp]]


class StageActor:
    """The Ray actor around one worker's StageWorkers (one, or ZB-V's two).

    An operation that fails records its error and returns None; operations that get
    None in place of an activation or cotangent skip, so ``state`` reports the first
    error and nothing downstream runs on garbage.
    """

    def __init__(self) -> None:
        # By stage index: a StageWorker, or a ReplicaGroup. Any: a TrainActor hands each to the trainer of its
        # kind after an isinstance, which a union here would refuse.
        self.stage_workers: dict[int, Any] = {}
        self.worker = -1
        self.num_stages = 0
        self.error: BaseException | None = None
        self.inbox = Inbox()
        self.sender: Sender | None = None
        self.listener: Listener | None = None  # where the other workers' sockets deliver (``listen``)
        self.to_driver: Links | None = None  # the connection to the driver's socket for reports (``connect``)
        self.worker_of: dict[int, int] = {}
        self.now: Now = idle()  # what this worker does now (runtime.hang_report), set by run_list
        self.list_thread: int | None = None  # the thread running the step's list (what ``status`` looks into)
        self.step = -1  # the step whose list runs (or ran) last
        self.handed: dict[Key, float] = {}  # this step's values handed to the sender, and when
        self.sent: dict[Key, float] = {}  # those whose delivery went out, and when (``Sender``)
        self.record: Dispatched | None = None  # a step's operations as dispatched (``untimed``)
        self.timeline = Timeline()  # a timed step's watchers, a thread per device (daemon threads, kept)
        self.phases: list[Phase] = []  # this step's reductions and updates (a TrainActor's)

    def ready(self) -> str:
        """This actor's Ray node id (answered as soon as the actor runs)."""
        import ray

        return ray.get_runtime_context().get_node_id()

    def clock(self) -> float:
        """This process's ``time.monotonic()``, for the driver's clock offset."""
        return time.monotonic()

    def load(self, held: Sequence[tuple[int, bytes, PyTree]], num_stages: int, worker: int, replicas: int = 1) -> None:
        """Load ``(stage index, artifact bytes, params)`` for each stage this worker (``worker``) holds;
        ``replicas`` > 1: each stage as a ``ReplicaGroup`` over this actor's first ``replicas`` devices."""
        from ....artifact.loading import loads

        arts = [loads(data, source=f"stage {s}") for s, data, _ in held]
        self.worker, self.num_stages = worker, num_stages
        if replicas > 1:
            import jax

            have = jax.local_devices()
            need = replicas * max(stage_need(a) for a in arts)
            if len(have) < need:
                raise VjpsplitError(
                    f"worker {worker}: data_parallel={replicas} needs {need} devices in its actor, it sees "
                    f"{len(have)}; give the actor {need} GPUs in actor_options (on CPU its runtime_env's "
                    f"XLA_FLAGS sets --xla_force_host_platform_device_count={need})"
                )
            # All of this worker's stages on the same devices, as worker k's are in-process (a sharded stage's
            # replicas each on a group of its mesh's size).
            where = replica_placement(arts, [tuple(range(len(arts)))], replicas)
            self.stage_workers = {
                s: ReplicaGroup(a, params, s, num_stages, g) for (s, _, params), a, g in zip(held, arts, where)
            }
            return
        # This actor is one worker: its stages on its first device (first devices, sharded), as in-process.
        where = placement(arts, [tuple(range(len(arts)))])
        self.stage_workers = {
            s: StageWorker(a, params, s, num_stages, g[0])
            for (s, _, params), a, g in zip(held, placed(arts, where), where)
        }

    def listen(self, token: bytes) -> Address:
        """Take the other workers' deliveries on a socket of this node that opens to ``token`` (``peers``); its
        address. Called again (after a worker was replaced): the same socket's address."""
        if self.listener is None:
            self.listener = Listener(token, lambda conn: self.inbox.attach(conn, self.fail), node_address())
        return self.listener.address

    def connect(
        self,
        peers: Sequence[ActorHandle],
        worker_of: dict[int, int],
        addresses: Sequence[Address | None] | None = None,
        token: bytes = b"",
        driver: Address | None = None,
    ) -> None:
        """Every worker's actor handle and which worker holds each stage: where this one's results go.

        ``addresses``: every worker's ``listen`` address, by worker index (this one connects to each other's with
        ``token``); None: results go as Ray calls. ``driver``: the driver's socket for reports (``reports``).
        """
        links = None if addresses is None else Links(addresses, token, self.worker)
        if self.to_driver is not None:
            self.to_driver.close()
        self.to_driver = None if driver is None else Links([driver], token, -1)
        if self.sender is not None:
            self.sender.connect(peers, links)
        else:
            self.sender = Sender(peers, self.fail, links, self._sent)
        self.worker_of = {int(s): int(w) for s, w in worker_of.items()}

    def _sent(self, step: int, keys: Sequence[Key]) -> None:
        """The sender's word that the values of ``keys`` went out for step ``step`` (kept for this step's only)."""
        if step == self.step:
            at = time.monotonic()
            for k in keys:
                self.sent[k] = at

    def fail(self, e: BaseException) -> None:
        """Record ``e`` as the step's error unless one came first (what ``report`` hands the driver)."""
        if self.error is None:
            self.error = picklable(e)

    def guarded(self, fn: Callable[[], T]) -> T | None:
        """``fn()``, unless the step has already failed (then None); what it raises becomes the step's error
        (``fail``) and gives None, so the rest of the step runs on without it."""
        if self.error is not None:
            return None
        try:
            return fn()
        except BaseException as e:  # noqa: BLE001 - handed to the driver by report()
            self.fail(e)
            return None

    def run_step(
        self,
        step: int,
        ops: Sequence[tuple[str, int, int]],
        batch: dict[tuple[int, int], tuple[PyTree, list[Leaf]]],
        microbatches: int,
        timed: bool,
        scales: Sequence[float] | None = None,
    ) -> None:
        """Step ``step``: reset, then this worker's list of operations (see ``lists.run_list``), each operation noted
        as it is dispatched (``record``); timed, a watcher per device times them (``timed.Timeline``) and this returns
        once all are timed. ``scales``: as ``StageWorker.reset``'s."""
        plan = [Op(Kind(kind), mb, stage) for kind, mb, stage in ops]
        self.reset(timed, [plan], scales)
        self.now, self.handed, self.sent, self.step = idle(), {}, {}, step
        self.record = Dispatched([plan], self.num_stages)
        self.list_thread = threading.get_ident()
        self.inbox.begin(step)
        if not timed:
            run_list(self, step, ops, batch, microbatches)
            return
        # Timed, the list dispatches as an untimed one: a watcher per device times each operation (``timed``), so a
        # timed step overlaps dispatch with compute as the untimed one does; the step ends once they are timed.
        with self.timeline.step(list(self.stage_workers.values())):  # detached after: a compiled graph's ``op`` waits
            run_list(self, step, ops, batch, microbatches)

    def deliver(self, step: int, items: Sequence[tuple[Key, object]], *pieces: bytes) -> None:
        """Results another worker sent for step ``step`` (runs in the ``inbox`` concurrency group); ``pieces``:
        its arrays' bytes, where ``lists.pack`` cut them."""
        self.inbox.put(step, unpack(items, pieces) if pieces else items)

    def echo(self, step: int, peer: int, value: object, repeats: int, starts: bool) -> list[float]:
        """Deliveries timed for step ``step`` (see ``RayPipeline.probe_delivery``): ``value`` sent to worker
        ``peer`` and back ``repeats`` times, as a step's results go (``Sender``, then ``Inbox``); ``starts``: this
        worker sends first and times each round trip (seconds), the other sends back what it takes."""
        assert self.sender is not None  # connected before any step
        self.inbox.begin(step)
        trips = []
        for i in range(repeats):
            if starts:
                t0 = time.perf_counter()
                self.sender.send(step, peer, ("echo", i, self.worker), value)
                self.inbox.take(step, ("echo", i, peer))
                trips.append(time.perf_counter() - t0)
            else:
                got = self.inbox.take(step, ("echo", i, peer))
                self.sender.send(step, peer, ("echo", i, self.worker), got)
        return trips

    def abort(self, step: int) -> None:
        """Stop waiting for step ``step``'s inputs: a worker is gone (runs in the ``inbox`` group)."""
        self.inbox.abort(step)

    def status(self) -> WorkerStatus:
        """What this worker does now, the values it sent this step and each stage's last operations (this
        process's clock; runs in the ``inbox`` group, beside a list that may be stuck). An operation whose
        thread is inside JAX's compiler is said to be compiling (``hang_report.compile_aware``). In an untimed step,
        unless the list is inside an operation's dispatch, the first operation it dispatched whose outputs are
        not ready (``untimed.Dispatched``) is what it does: its device runs it, or it waits for its input."""
        state, op, src, since = compile_aware(self.now, self.list_thread)
        after = 0
        if state not in (RUNS, COMPILING) and self.record is not None:
            (first,), (behind,) = self.record.nows()
            if first[0] == PENDING:
                (state, op, src, since), after = first, behind
        return {
            "now": (
                state,
                None if op is None else (str(op.kind), op.mb, op.stage),
                None if src is None else (src.kind, src.mb, src.stage),
                since,
            ),
            "after": after,
            "handed": dict(self.handed),
            "sent": dict(self.sent),
            "rings": {s: list(st.ring) for s, st in self.stage_workers.items()},
        }

    def placement(self) -> dict[int, list[str]]:
        """Per stage held, the devices that hold its parameters, as this actor's JAX names them."""
        return {s: [str(d) for d in st.devices] for s, st in self.stage_workers.items()}

    def offload(self, spec: Offload | None) -> None:
        """Residuals of this worker's stages off their device between F and B (``offload.Offload``; None: not)."""
        for st in self.stage_workers.values():
            st.set_offload(spec)

    def reset(
        self, timed: bool = True, plans: Sequence[Sequence[Op]] | None = None, scales: Sequence[float] | None = None
    ) -> None:
        """Forget the last step's residuals, gradients, timings and error; ``timed``: the next step's mode;
        ``plans``: this worker's operations of the next step (what an offloading stage reads); ``scales``: per
        microbatch, the last stage's starting cotangent (``StageWorker.reset``; None: equal)."""
        for st in self.stage_workers.values():
            st.reset(timed, plans, scales)
        self.error = None
        self.phases = []

    def op(
        self,
        kind: str,
        stage: int,
        mb: int,
        data: PyTree,
        side: list[Leaf],
        microbatches: int,
        after: object = None,
    ) -> PyTree:
        """Run one scheduled operation (see ``stageops.run_op``); None when skipped or failed.

        ``after`` is ignored: a compiled graph passes the worker's previous result to order its calls.
        """
        st = self.stage_workers[stage]
        needed = data is not None or (kind in BACKWARDS and st.is_last) or (kind == Kind.W and st.weight_pending(mb))
        if not needed:
            return None

        def run() -> PyTree:
            import jax

            out = run_op(st, Op(Kind(kind), mb, stage), data, side, microbatches, self.worker)
            # An activation may be a tuple of arrays (stages from one function).
            return None if out is None else jax.tree_util.tree_map(np.asarray, out)

        return self.guarded(run)

    def state(self) -> StepState:
        """Gradients, losses, timings (this process's clock) and the first error of the step."""
        import jax

        held = self.stage_workers
        return {
            "grads": {s: jax.tree_util.tree_map(np.asarray, st.grads) for s, st in held.items()},
            "device_count": jax.device_count(),
            "devices": {s: [d.id for d in st.art.devices] for s, st in held.items()},
            **self.report(),
        }

    def report(self) -> StepReport:
        """The step's losses and aux (both in one transfer), timings (this process's clock) and first error; no
        arrays but the aux's."""
        held = self.stage_workers.values()
        outputs = [st.fetch_outputs() for st in held]
        return {
            "losses": {m: v for losses, _ in outputs for m, v in losses.items()},
            "aux": {m: v for _, aux in outputs for m, v in aux.items()},
            "events": [e for st in held for e in st.events],
            "phases": [*self.phases, *reductions(held)],
            "error": self.error,
        }

    def collect(self, after: object) -> StepState:
        """``state``, then ``reset``: the end of a compiled step (``after``: the worker's last result)."""
        out = self.state()
        self.reset()
        return out


def raise_first_error(reports: Sequence[StepReport]) -> None:
    """Raise the first error the workers' ``report`` (or ``state``) dicts hold, in worker order; none: return."""
    for report in reports:
        if report["error"] is not None:
            raise report["error"]


def picklable(e: BaseException) -> BaseException:
    """``e`` itself if it survives Ray's serialization, else a RuntimeError with its text."""
    import pickle

    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # noqa: BLE001 - some runtime errors do not survive pickling; keep their text
        return RuntimeError(f"{type(e).__name__}: {e}")


DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def cpu_environment(
    opts: dict[str, Any], n: int, threads: int | None, job_env_vars: Mapping[str, str] | None = None
) -> None:
    """Start an actor that drives ``n`` devices with ``n`` host devices and ``threads`` XLA CPU threads.

    An actor inherits its raylet's environment (on a local Ray, the driver's): without this, every actor would get
    the driver's host device count and a CPU thread pool as wide as the host. So each actor's ``XLA_FLAGS`` gets
    ``--xla_force_host_platform_device_count=n`` (the other flags kept from the job's ``runtime_env``, else the
    driver's) wherever ``n`` > 1 or those flags set a count, and ``PJRT_NPROC=threads`` when ``threads`` is given,
    unless the job's ``runtime_env`` sets it; the actor's own ``runtime_env`` setting either leaves that one alone.
    Both affect JAX's CPU platform only (docs/howto/ray.md).

    Args:
        opts: The actor's Ray options (each value of the type Ray takes for its key), changed in place.
        n: The devices the actor drives (its replicas times its stages' devices).
        threads: XLA CPU threads for the actor; ``None`` leaves XLA's default (the node's cores).
        job_env_vars: The ``env_vars`` of the runner's (job's) ``runtime_env``, which the actor's extend.
    """
    env = dict(opts.get("runtime_env") or {})
    env_vars = dict(env.get("env_vars") or {})
    job = dict(job_env_vars or {})
    if "XLA_FLAGS" not in env_vars:
        flags = str(job.get("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))).split()
        kept = [f for f in flags if not f.startswith(DEVICE_COUNT_FLAG)]
        if n > 1 or len(kept) < len(flags):
            env_vars["XLA_FLAGS"] = " ".join([*kept, f"{DEVICE_COUNT_FLAG}={n}"])
    if threads is not None and "PJRT_NPROC" not in {**job, **env_vars}:
        env_vars["PJRT_NPROC"] = str(threads)
    if env_vars:
        env["env_vars"] = env_vars
        opts["runtime_env"] = env


def xla_threads(local_workers: int | None) -> int | None:
    """XLA CPU threads for one actor: on a local Ray, this host's cores shared among its
    ``local_workers`` actors (as one in-process runner's pool is shared among its workers);
    ``None`` on a cluster, where which actors share a node is Ray's choice (XLA's default)."""
    if local_workers:
        return max(1, len(os.sched_getaffinity(0)) // local_workers)
    return None
