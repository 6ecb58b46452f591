"""Values between the processes of a multi-controller JAX job (``jax.distributed``): the ``Distributed`` transport.

Every process of the job runs the same script, so every process walks the same
step and calls these functions in the same order. ``move`` sends one stage's
output (a pytree of arrays on its device) to another stage's device through
``jax.device_put`` across processes: JAX keys each such transfer by a counter
that every process advances, taking part or not, so every process calls it for
every transfer, the sender with its arrays, the others with their shapes
(``ShapeDtypeStruct``s). Nothing waits: the receiver's arrays are ready once the
bytes arrived. ``gather`` joins one small part per process (tied gradients,
squared norms, losses, a stage's state) on every process, each part's ``wire``
bytes (data only, never pickle) moved the same way to every other process. ``check_distributed`` says, when the runner is made,
what this process lacks for either.

A lost process is told from a stuck one by ``Heartbeat``: every process sets its own key
of the job's key-value store (``jax.distributed``'s coordination service, in process 0)
to a counter every ``BEAT`` seconds, from a thread of its own; after a failed transfer or
a timed-out step, the processes whose counter stopped are the lost ones (all of them
where the store itself is gone: process 0 with it). Once one is lost, ``abandon`` lets
this process exit: ``jax.distributed``'s shutdown at exit would wait for every process
of the job (its heartbeat timeout, 100 s by default), then abort.
"""

from __future__ import annotations

import threading
import time
from typing import Mapping, Sequence

import jax
import numpy as np

from ...errors import VjpsplitError, one_line
from ...treetypes import PyTree
from ..runtime.ray import wire

SOCKET_FLAG = "jax_cross_host_transfer_socket_address"
PART = "part"  # the kind every gathered item is keyed by (``wire`` items are keyed by (kind, mb, stage))
BEATS = "vjpsplit/beat/"  # the key-value store's directory of the processes' beats: BEATS + process index
BEAT = 0.5  # seconds between two beats of a process
STOPPED = 6 * BEAT  # a beat that did not change over this long is a lost process's


def check_distributed() -> None:
    """Refuse a process that cannot run the ``Distributed`` runner, naming the fix.

    Raises:
        VjpsplitError: ``jax.distributed.initialize()`` was not called; with several processes, this jax moves no
            array between processes on this platform without ``jax_cross_host_transfer_socket_address`` (or at
            all: an older jax).
    """
    if not jax.distributed.is_initialized():
        raise VjpsplitError(
            "runner=Distributed() runs on multi-controller JAX: call jax.distributed.initialize() first, in every "
            "process, before the Trainer (python -m vjpsplit_cli.pipeline.launch -n N script.py starts N local "
            "processes that can); for one process use runner='inprocess'"
        )
    if jax.process_count() == 1:
        return
    from jax._src import xla_bridge

    backend = jax.devices()[0].client
    if getattr(backend, "supports_cross_host_transfers", False):
        return
    if not hasattr(xla_bridge, "CROSS_HOST_TRANSFER_SOCKET_ADDRESS"):
        raise VjpsplitError(
            f"runner=Distributed(): jax {jax.__version__} cannot move an array between processes on "
            f"{jax.devices()[0].platform}; upgrade jax (0.10 can, with {SOCKET_FLAG})"
        )
    if not xla_bridge.CROSS_HOST_TRANSFER_SOCKET_ADDRESS.value:
        raise VjpsplitError(
            f"runner=Distributed(): {jax.devices()[0].platform} moves arrays between processes only with "
            f"{SOCKET_FLAG} set, before JAX starts its backend: jax.config.update('{SOCKET_FLAG}', "
            "'<this host's address>:<a free port>') before jax.distributed.initialize() (or the environment "
            f"variable {SOCKET_FLAG.upper()}; python -m vjpsplit_cli.pipeline.launch sets it)"
        )


def checked_devices(devices: Sequence[Sequence[jax.Device]], n: int | None = None) -> list[tuple[jax.Device, ...]]:
    """``Distributed(devices=...)``: one list per stage of ``n`` devices of ``jax.devices()`` (its replicas'; ``n``
    None: the same count for every stage), all of one process, each device once.

    Raises:
        VjpsplitError: an entry is not a list of ``n`` devices of ``jax.devices()``, two stages name the same
            device, or a stage's devices are on two processes (replicas across processes are not run).
    """
    every = set(jax.devices())
    out: list[tuple[jax.Device, ...]] = []
    for s, group in enumerate(devices):
        g = tuple(group) if isinstance(group, (list, tuple)) else (group,)
        want = n if n is not None else len(out[0]) if out else None
        if not g or (want is not None and len(g) != want) or any(d not in every for d in g) or len(set(g)) != len(g):
            count = "one device" if want in (None, 1) else f"{want} devices (its replicas')"
            raise VjpsplitError(
                f"Distributed(devices=...): stage {s} has {list(g)!r}; give one list of {count} of jax.devices() "
                "per stage (devices=[[jax.devices()[0]], [jax.devices()[1]], ...])"
            )
        processes = sorted({d.process_index for d in g})
        if len(processes) > 1:
            raise VjpsplitError(
                f"Distributed(devices=...): stage {s}'s replicas are on processes {processes}; a stage's replicas "
                "run on devices of one process (replicas across processes are not supported): give each stage "
                "devices of one process, or leave devices= out (the default puts each stage's replicas on one "
                "process)"
            )
        taken = [d for d in g if any(d in o for o in out)]
        if taken:
            raise VjpsplitError(f"Distributed(devices=...): stage {s}'s device {taken[0]} is another stage's too")
        out.append(g)
    return out


def move(value: PyTree | None, spec: PyTree, src: jax.Device, dst: jax.Device) -> PyTree | None:
    """``value`` (on ``src``, in its process) on ``dst``: every process calls this for every transfer, in order.

    Args:
        value: The arrays to send, in the process of ``src``; None in every other.
        spec: ``value``'s ``ShapeDtypeStruct``s, the same in every process.
        src: The device the arrays are on.
        dst: The device they go to.

    Returns:
        The arrays on ``dst`` in its process; None in every other.
    """
    me = jax.process_index()
    if src.process_index == dst.process_index:  # within one process: JAX keys nothing, only it moves
        return jax.device_put(value, dst) if me == src.process_index else None
    leaves, treedef = jax.tree_util.tree_flatten(spec)
    mine = jax.tree_util.tree_leaves(value) if me == src.process_index else [None] * len(leaves)
    at = jax.sharding.SingleDeviceSharding(src)
    arrays = [
        jax.make_array_from_single_device_arrays(sp.shape, at, [] if v is None else [v], dtype=sp.dtype)
        for sp, v in zip(leaves, mine)
    ]
    got = jax.device_put(arrays, jax.sharding.SingleDeviceSharding(dst))
    return jax.tree_util.tree_unflatten(treedef, got) if me == dst.process_index else None


def specs(tree: PyTree) -> PyTree:
    """The ``ShapeDtypeStruct`` of each of ``tree``'s arrays: what ``move`` tells the processes without them."""
    return jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), tree)


def gather(part: Mapping[int, PyTree]) -> dict[int, PyTree]:
    """Every process's ``part`` (stage -> a tree of host arrays, tuples, lists and dicts) merged, on every process.

    Every process calls it at the same point of the step. Each sends its part's ``wire`` bytes to every other
    through ``move``: first their length (every process learns every length, as every later ``move`` needs
    the shapes), then the bytes. No JAX collective: one would hold the devices' threads while transfers of
    the step may still be under way (two CPU processes of two devices each hung so).
    """
    frame = b"".join(bytes(b) for b in wire.encode(0, [((PART, 0, int(s)), v) for s, v in part.items()]))
    me, n = jax.process_index(), jax.process_count()
    first = {d.process_index: d for d in reversed(jax.devices())}  # each process's first device
    sizes = {me: len(frame)}
    size_spec = jax.ShapeDtypeStruct((1,), np.int32)
    size = jax.device_put(np.asarray([len(frame)], np.int32), first[me]) if n > 1 else None
    received = {}
    for p, q in _pairs(n):
        got = move(size if p == me else None, size_spec, first[p], first[q])
        if q == me:
            received[p] = got
    sizes.update({p: int(np.asarray(v)[0]) for p, v in received.items()})
    data = jax.device_put(np.frombuffer(frame, np.uint8), first[me]) if n > 1 else None
    frames: dict[int, object] = {me: frame}
    for p, q in _pairs(n):
        got = move(data if p == me else None, jax.ShapeDtypeStruct((sizes[p],), np.uint8), first[p], first[q])
        if q == me:
            frames[p] = got
    out: dict[int, PyTree] = {}
    for p in range(n):
        raw = frames[p]
        _, items = _decoded(raw if isinstance(raw, bytes) else np.asarray(raw).tobytes())
        out.update({stage: v for (_, _, stage), v in items})
    return out


def _pairs(n: int) -> list[tuple[int, int]]:
    """Every (sender, receiver) pair of ``n`` processes, in the one order every process goes through them."""
    return [(p, q) for p in range(n) for q in range(n) if p != q]


def _decoded(data: bytes) -> tuple[int, list[wire.Item]]:
    """One ``wire`` frame from ``data``."""
    view = memoryview(data)
    at = 0

    def read_exactly(n: int) -> bytes:
        nonlocal at
        if at + n > len(view):
            raise EOFError("the frame ends early")
        out = bytes(view[at : at + n])
        at += n
        return out

    def read_into(target: memoryview) -> None:
        target = target.cast("B")
        target[:] = read_exactly(len(target))

    return wire.decode(read_exactly, read_into)


class Heartbeat:
    """This process's beat in the job's key-value store, and which processes' beats stopped (the module docstring).

    Args:
        client: ``jax.distributed``'s client of the coordination service (``global_state.client``).
    """

    def __init__(self, client: object):
        self.client = client  # held here, and by the thread, for as long as the process lives (``abandon``)
        self.me, self.n = jax.process_index(), jax.process_count()
        self.error: str | None = None  # why the beats stopped (the store is unreachable), if they did
        self.thread = threading.Thread(target=self._beat, name="vjpsplit-heartbeat", daemon=True)
        self.thread.start()

    def _beat(self) -> None:
        count = 0
        while True:
            try:
                self.client.key_value_set(f"{BEATS}{self.me}", str(count), allow_overwrite=True)  # type: ignore[attr-defined]
            except Exception as e:  # noqa: BLE001 - the store is gone (process 0 with it): said by ``lost``
                self.error = one_line(e)
                return
            count += 1
            time.sleep(BEAT)

    def _beats(self) -> dict[int, str] | None:
        """Every process's last beat, by process; None where the store cannot be read."""
        try:
            got = self.client.key_value_dir_get(BEATS)  # type: ignore[attr-defined]
        except Exception:  # noqa: BLE001 - the store is gone: the caller says so
            return None
        return {int(k.rsplit("/", 1)[-1]): v for k, v in got}

    def lost(self) -> list[int]:
        """The other processes whose beat did not change over ``STOPPED`` seconds (waited here), by index; every
        other process where the store cannot be read (it lives in process 0: with it, the job's every link is gone).
        """
        first = self._beats()
        time.sleep(STOPPED)
        then = self._beats()
        if first is None or then is None:
            return [0] if self.me != 0 else [p for p in range(1, self.n)]
        return [p for p in range(self.n) if p != self.me and (p not in then or first.get(p) == then[p])]


_HEARTBEAT: list[Heartbeat] = []  # this process's one Heartbeat, once a Distributed backend started it


def heartbeat() -> Heartbeat | None:
    """This process's ``Heartbeat``, started at the first call; None in a job of one process."""
    if jax.process_count() == 1:
        return None
    if not _HEARTBEAT:
        from jax._src import distributed

        _HEARTBEAT.append(Heartbeat(distributed.global_state.client))
    return _HEARTBEAT[0]


def abandon() -> None:
    """Let this process exit without ``jax.distributed``'s shutdown, which waits for every process of the job: once
    one is lost, that wait ends only at the coordination service's heartbeat timeout, in an abort. The client and
    the service stay referenced (by the ``Heartbeat``), never shut down; ``jax.distributed.is_initialized()`` is
    False from now on."""
    from jax._src import distributed

    st = distributed.global_state
    kept = [st.preemption_sync_manager, st.client, st.service]
    _ABANDONED.extend(k for k in kept if k is not None)
    st.preemption_sync_manager = st.client = st.service = None


_ABANDONED: list[object] = []
