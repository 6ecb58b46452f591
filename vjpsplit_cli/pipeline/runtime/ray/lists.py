"""A step on Ray as each worker's own list: one call per actor per step, activations sent actor to actor.

The driver hands every actor its list of operations and the batch inputs its
stages read (``submit_lists``), once per step. An actor runs its list in order
(``run_list``): an operation whose input another worker makes waits for it in the
actor's ``inbox.Inbox`` (reading the other workers' sockets meanwhile); a result
another worker reads goes to that worker's inbox straight from this actor
(``Sender``, a thread of its own, so the next operation
is dispatched while the last one's result is copied off the device and sent; a
value counts as sent once its delivery has gone out, not when it is handed to the
sender, which may still wait for it to be computed). A list notes each
operation it dispatches in ``untimed.Dispatched``, as an in-process step
does, so a stuck step names the first one whose outputs are not ready.
The driver takes no part in a step's traffic; it only learns when each list is
done, and the losses, timings (and gradients) afterwards.

Deliveries run in the actor's ``inbox`` concurrency group (Ray runs them beside
the list; every other call of the actor stays in order in the default group). A
failed or skipped operation sends None in place of its result, so no worker waits
for it; ``abort`` releases a step's waits when a worker is gone. ``RunsLists`` is
what ``run_list`` needs of the actor; a delivery is keyed by ``key_of`` its operation.
"""

from __future__ import annotations

import dataclasses
import functools
import queue
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol, Sequence, TypeVar

from ...schedules.actions import computations, destination, hands_on_early, lower
from ...schedules.ops import Kind, Op, OpKey, dependencies, received
from ..hang_report import DONE, NEXT, RUNS, WAITS, Now
from ..model import Microbatch, side_for
from ..stageops import RunsOps, run_op
from ....files.prng import is_ready, to_data
from ..untimed import Dispatched
from ....treetypes import Leaf, PyTree
from .inbox import Inbox, Key
from .peers import Links
from .setup import ActorHandle, RemoteMethod
from .wire import Unencodable

if TYPE_CHECKING:
    import jax
    import numpy as np
    from ray import ObjectRef

INBOX = "inbox"  # the actors' concurrency group for deliveries and aborts
CONCURRENCY_GROUPS = {INBOX: 1}
T = TypeVar("T")


def key_of(op: OpKey) -> Key:
    """``op`` as a plain tuple ``(kind, mb, stage)``: what a delivery is keyed by."""
    return (op.kind, op.mb, op.stage)


class Sender:
    """A thread that copies results to the host and delivers them to other workers' actors.

    Whatever has queued up by the time the thread gets to it goes in one delivery per
    receiving worker, so a busy sender makes fewer, larger ones. A delivery goes down
    the workers' sockets (``peers.Links``) where the sender has them, else (or for a
    value a frame does not carry) as a Ray call of the receiver's ``deliver``. Once a
    delivery has gone out, ``on_sent(step, keys)`` is told its values' keys.
    """

    def __init__(
        self,
        peers: Sequence[ActorHandle],
        on_error: Callable[[BaseException], None],
        links: Links | None = None,
        on_sent: Callable[[int, Sequence[Key]], None] | None = None,
    ):
        self.on_error, self.on_sent = on_error, on_sent
        self.links: Links | None = None
        self.connect(peers, links)
        self.queue: queue.Queue[tuple[int, int, Key, object]] = queue.Queue()
        self.thread = threading.Thread(target=self._serve, name="vjpsplit-sender", daemon=True)
        self.thread.start()

    def connect(self, peers: Sequence[ActorHandle], links: Links | None = None) -> None:
        """Every worker's actor, by worker index, and the sockets to them (None: Ray calls only): where ``send``
        delivers. Sockets it had before are closed."""
        self.deliveries: list[RemoteMethod] = [p.deliver.options(concurrency_group=INBOX) for p in peers]
        old, self.links = self.links, links
        if old is not None:
            old.close()

    def send(self, step: int, worker: int, key: Key, value: object) -> None:
        """Deliver ``value`` (None: failed or skipped) to ``worker`` as step ``step``'s ``key``.

        A value already computed (a cold call's, which its dispatch waited for) goes at once from this thread; one still
        being computed goes from the sender's, so that this thread dispatches on meanwhile.
        """
        if _ready(value):
            self._deliver([(step, worker, key, value)])
        else:
            self.queue.put((step, worker, key, value))

    def flush(self) -> None:
        """Wait until everything sent so far has been handed to Ray."""
        self.queue.join()

    def _serve(self) -> None:
        while True:
            batch = [self.queue.get()]
            while True:
                try:
                    batch.append(self.queue.get_nowait())
                except queue.Empty:
                    break
            self._deliver(batch)
            for _ in batch:
                self.queue.task_done()

    def _deliver(self, batch: Sequence[tuple[int, int, Key, object]]) -> None:
        """One call per receiving worker for ``batch``'s values, copied to the host first."""
        import jax
        import numpy as np

        calls: dict[tuple[int, int], list[tuple[Key, object]]] = {}
        for step, worker, key, value in batch:
            if value is not None:
                try:
                    # the object store holds host arrays; a typed key goes as its key data, which its reader takes
                    value = jax.tree_util.tree_map(lambda a: np.asarray(to_data(a)), value)
                except BaseException as e:  # noqa: BLE001 - reported by the actor; the receiver skips
                    self.on_error(e)
                    value = None
            calls.setdefault((step, worker), []).append((key, value))
        for (step, worker), items in calls.items():
            if self._delivered(step, worker, items) and self.on_sent is not None:
                self.on_sent(step, [key for key, _ in items])

    def _delivered(self, step: int, worker: int, items: list[tuple[Key, object]]) -> bool:
        """Deliver ``items`` to ``worker``: down its socket, else as a Ray call; whether they went out."""
        if self.links is not None:
            try:
                self.links.send(worker, step, items)
                return True
            except Unencodable:
                pass  # a node a frame does not carry: Ray pickles it
            except BaseException as e:  # noqa: BLE001 - a dead peer: the driver names it
                self.on_error(e)
                return False
        try:
            packed, pieces = pack(items)
            self.deliveries[worker].remote(step, packed, *pieces)
        except BaseException as e:  # noqa: BLE001 - a dead peer: the driver names it
            self.on_error(e)
            return False
        return True


PIECE = 64 << 10  # below Ray's max_direct_call_object_size (100 KiB): such an argument rides inside the call
PIECES_AT_MOST = 4 << 20  # a call's bytes sent as pieces; beyond them, arrays go through the object store


@dataclasses.dataclass(frozen=True)
class _Pieces:
    """An array sent as bytes in positional arguments ``first`` ... ``first + count - 1`` of the call."""

    dtype: np.dtype
    shape: tuple[int, ...]
    first: int
    count: int


def pack(items: Sequence[tuple[Key, object]]) -> tuple[list[tuple[Key, object]], list[bytes]]:
    """``items`` with each array of a mid-size call cut into pieces small enough for Ray to send inside the
    call rather than through its object store (on one host that saves a round trip per delivery)."""
    import jax
    import numpy as np

    pieces: list[bytes] = []

    def cut(a: object) -> object:
        if not isinstance(a, np.ndarray) or a.nbytes <= PIECE or len(pieces) * PIECE + a.nbytes > PIECES_AT_MOST:
            return a
        raw = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        first = len(pieces)
        pieces.extend(raw[i : i + PIECE].tobytes() for i in range(0, raw.size, PIECE))
        return _Pieces(a.dtype, tuple(a.shape), first, len(pieces) - first)

    return [(key, jax.tree_util.tree_map(cut, value)) for key, value in items], pieces


def unpack(items: Sequence[tuple[Key, object]], pieces: Sequence[bytes]) -> list[tuple[Key, object]]:
    """``pack``'s items back, each array whole."""
    import jax
    import numpy as np

    def join(a: object) -> object:
        if not isinstance(a, _Pieces):
            return a
        return np.frombuffer(b"".join(pieces[a.first : a.first + a.count]), a.dtype).reshape(a.shape)

    return [
        (key, jax.tree_util.tree_map(join, value, is_leaf=lambda x: isinstance(x, _Pieces))) for key, value in items
    ]


def _ready(value: object) -> bool:
    """Whether every array of ``value`` is computed (None counts as ready)."""
    import jax

    arrays: list[jax.Array] = [a for a in jax.tree_util.tree_leaves(value) if isinstance(a, jax.Array)]
    return all(is_ready(a) for a in arrays)


def action_lists(plans: Sequence[Sequence[Op]], splits: Sequence[bool], worker_of: Mapping[int, int]) -> list[list[Op]]:
    """Each worker's computations as untimed lists run ``plans`` on Ray (``actions.lower``'s, without the moves):
    each B that hands its cotangent on early (``actions.hands_on_early``) as its I then its W, the cotangent
    leaving at the I's end. A lower bound on a Ray step is the makespan of these: the plans as scheduled charge
    such a B's weight part before its cotangent leaves."""
    return [computations(a) for a in lower(plans, worker_of, splits, len(worker_of))]


class RunsLists(Protocol):
    """What ``run_list`` reads and sets on a worker's actor (a ``StageActor``; see its attributes)."""

    num_stages: int
    worker: int
    worker_of: dict[int, int]
    inbox: Inbox
    sender: Sender | None
    now: Now
    handed: dict[Key, float]
    record: Dispatched | None

    @property
    def stage_workers(self) -> Mapping[int, RunsOps]: ...

    def guarded(self, fn: Callable[[], T]) -> T | None: ...


def run_list(
    actor: RunsLists,
    step: int,
    ops: Sequence[Key],
    batch: Mapping[tuple[int, int], tuple[PyTree, list[Leaf]]],
    microbatches: int,
) -> None:
    """Run this worker's ``ops`` of step ``step`` on ``actor`` (a ``StageActor``, reset for the step, timed or not).

    ``batch[(stage, mb)]`` is what the F of that stage and microbatch takes from the
    batch: the first stage's input (else None) and its side inputs. A B whose cotangent goes to another worker is
    sent after the backward's input part, while its weight part computes, where the stage has the split backward
    (``hands_on_early``; ``stageops.run_op``'s ``hand_on``): timed or not, the same actions in the same order, a timed
    step's events of such a B an I and a W.
    ``actor.record`` (the step's ``untimed.Dispatched`` of this list, or None) is handed each operation as it is
    dispatched.
    """
    S, me, worker_of, sender = actor.num_stages, actor.worker, actor.worker_of, actor.sender
    assert sender is not None  # connected before any step
    local: dict[OpKey, object] = {}  # results this worker's own later operations read (a V's two stages)
    splits = {s: w.splits_backward for s, w in actor.stage_workers.items()}
    record = actor.record

    def send(to: int, key: Key, value: PyTree) -> None:
        actor.handed[key] = time.monotonic()  # the sender sends it once it is computed
        sender.send(step, to, key, value)

    for kind, mb, stage in ops:
        op = Op(Kind(kind), mb, stage)
        st = actor.stage_workers[stage]
        src = received(op, dependencies(op, S))
        if src is None:
            data = batch[(stage, mb)][0] if op.kind == Kind.F else None
        elif worker_of[src.stage] == me:
            data = local.pop(src, None)
        else:
            actor.now = (WAITS, op, src, time.monotonic())
            data = actor.inbox.take(step, key_of(src))
        needed = data is not None or src is None and (op.kind != Kind.W or st.weight_pending(mb))
        dest = destination(op, S)
        to = None if dest is None or worker_of[dest] == me else worker_of[dest]
        key = key_of(op.key)
        out = None
        if needed:  # called at once, in this iteration: the lambda's loop variables are this operation's
            side = batch[(stage, mb)][1] if op.kind == Kind.F else []
            actor.now = (RUNS, op, None, time.monotonic())
            early = hands_on_early(op, splits, worker_of)
            hand_on = functools.partial(send, to, key) if early and to is not None else None
            if record is not None:
                record.begin(0, op)
            out = actor.guarded(lambda: run_op(st, op, data, side, microbatches, me, hand_on))
            if record is not None:  # a B that handed its cotangent on early is finished once its W is
                record.end(0, op, None if early else out, st)
        actor.now = (NEXT, None, None, time.monotonic())
        if dest is not None and to is None:
            local[op.key] = out
        elif to is not None and key not in actor.handed:  # sent early (hand_on), it stays sent if W then failed
            send(to, key, out)
    sender.flush()
    if record is not None:
        record.dispatched()
    actor.now = (DONE, None, None, time.monotonic())


def submit_lists(
    actors: Sequence[ActorHandle],
    step: int,
    plans: Sequence[Sequence[Op]],
    mbs: Sequence[Microbatch],
    num_stages: int,
    microbatches: int,
    timed: bool,
    call: str = "run_step",
    extra: Sequence[object] = (),
) -> list[ObjectRef[Any]]:
    """Every actor's ``call`` (``run_step``, or a subclass's method taking the same arguments then ``extra``) of
    step ``step``: its list and the batch inputs its stages read; the refs."""
    refs = []
    for actor, ops in zip(actors, plans):
        batch = {
            (o.stage, o.mb): (mbs[o.mb][0] if o.stage == 0 else None, side_for(mbs[o.mb][1], o.stage, num_stages))
            for o in ops
            if o.kind == Kind.F
        }
        keys = [(str(o.kind), o.mb, o.stage) for o in ops]
        refs.append(getattr(actor, call).remote(step, keys, batch, microbatches, timed, *extra))
    return refs
