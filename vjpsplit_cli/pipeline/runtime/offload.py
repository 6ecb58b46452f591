"""Residuals off the device between a microbatch's F and its B: to host memory or to residual files.

``Offload`` is what a user asks for (``Trainer(..., offload=...)``); an ``Offloader``
does it for one ``StageWorker``. After a microbatch's F its stored residuals go
off the device: to an accelerator's ``pinned_host`` memory where it has one, else
(CPU devices too: their ``pinned_host`` is the same RAM, and NumPy's copy is the
cheaper) host NumPy copies made on the offloader's own thread, or, on that thread,
to the project's checksummed residual files in a directory the user names.

On an accelerator both copies are compiled calls (``packing.packer``, ``packing.unpacker``): the copy out is
dispatched right after the F, the copy back right before the B, so each runs where
the plan puts it in the device's own order, whatever the host's dispatch runs
ahead of: the bytes are off the device from the copy out until the copy back,
in an untimed step as in a timed one (a ``jax.device_put`` runs on its own
stream as soon as its input is ready, so a copy back put before the B's previous
operation was back before it ran). Host NumPy copies and files are brought back
from when the stage starts the operation before that microbatch's B, so the read
overlaps that operation's compute. The arrays come back with the shardings they
left with, so B runs the same compiled call on the same bytes: gradients are
bitwise those without offload. A file that is missing, damaged or holds another
forward run's residuals is one ``VjpsplitError`` naming the stage, the
microbatch and the file, never a wrong gradient.

The files are named ``vjpsplit-offload-<token>-stage<s>-mb<m>.npz`` (``token``: the
offloader's own), a name no user file has: a file of the user's in the directory is
never written over or removed. Those of a step that failed or was interrupted are
removed (``discard``: by the runner, and at the next step), and so are any left when
the offloader closes or is collected. The copies run on a daemon thread
(``workerthreads``), so one stuck behind a stuck operation never keeps the process
from exiting.

Input-backed residuals (the stage's parameters and arriving activation) stay
where they are: they are the caller's arrays, not copies. W's share of a split
backward (``Intermediates``) also stays on the device.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import uuid
import weakref
from concurrent.futures import Future
from typing import TYPE_CHECKING, Callable, Collection, Sequence, TypeVar

import jax
import numpy as np

from ...artifact.residual_files import load_residuals, save_residuals
from ...errors import VjpsplitError, one_line
from ...files.buffers import aligned_empty
from ...files.shapes import format_shape
from ...safeio.outputs import check_directory_option
from ...tracing.frozen import FrozenDict
from ..schedules.ops import BACKWARDS, Kind, Op, OpKey
from .devicebytes import leaf_bytes
from .packing import packable, packer, unpacker
from .workerthreads import WorkerThreads
from ...treetypes import Leaf

if TYPE_CHECKING:
    from ...artifact.artifact import Artifact
    from ...tracing.residuals import Residuals

T = TypeVar("T")
S = TypeVar("S")

HOST, FILES = "host", "files"


@dataclasses.dataclass(frozen=True)
class Offload:
    """Which residuals leave their device between F and B, and where they go.

    Args:
        to: ``"host"`` (host memory: an accelerator's ``pinned_host`` memory kind where it has
            it, else host NumPy arrays, as on CPU devices) or ``"files"`` (checksummed residual files, one per stage
            and microbatch, written with ``save_residuals`` and read back with ``load_residuals``).
        directory: where ``to="files"`` writes (required there; created if absent; a file, or a path under
            one, is refused). The files are named ``vjpsplit-offload-<token>-stage<s>-mb<m>.npz``
            (``-stage<s>-r<r>-mb<m>`` for replica r of a ``data_parallel`` stage; ``token`` is each offloader's
            own), so Trainers may share the directory, and the user's own files in it are left alone.
        microbatches: the microbatch indices to offload; None: every one.
        stages: the stage indices to offload; None: every one.
        pairs: the (stage, microbatch) pairs to offload (what ``auto`` plans); None: every pair
            ``microbatches`` and ``stages`` allow.

    A microbatch whose B is the stage's next or second operation after its F (the last
    stage's, in most schedules; 1F1B's with two stages) is never offloaded: its copy back
    would start as soon as it left, so it is away at no boundary and there is nothing to gain.
    """

    to: str = HOST
    directory: str | None = None
    microbatches: Collection[int] | None = None
    stages: Collection[int] | None = None
    pairs: Collection[tuple[int, int]] | None = None

    def __post_init__(self) -> None:
        if self.to not in (HOST, FILES):
            raise VjpsplitError(f"Offload(to={self.to!r}): give 'host' or 'files'")
        if self.to == FILES and not self.directory:
            raise VjpsplitError("Offload(to='files') needs directory=: where the residual files go")
        if self.to == HOST and self.directory is not None:
            raise VjpsplitError("Offload(directory=...) applies to to='files'")
        for name in ("microbatches", "stages"):
            v = getattr(self, name)
            if v is None:
                continue
            if isinstance(v, (str, bytes)) or not all(isinstance(i, int) and not isinstance(i, bool) for i in v):
                raise VjpsplitError(f"Offload({name}={v!r}): give a collection of int indices, or None for all")
            object.__setattr__(self, name, frozenset(v))
        if self.pairs is not None:
            try:
                pairs = frozenset((int(s), int(m)) for s, m in self.pairs)
            except (TypeError, ValueError) as e:
                raise VjpsplitError(f"Offload(pairs={self.pairs!r}): give (stage, microbatch) pairs of ints") from e
            object.__setattr__(self, "pairs", pairs)
        if self.directory is not None:
            object.__setattr__(self, "directory", os.fspath(self.directory))
            check_directory_option("Offload(directory=...)", self.directory)

    def wants(self, stage: int, mb: int) -> bool:
        """Whether the residuals of microbatch ``mb`` of ``stage`` are to leave the device.

        Args:
            stage: The stage's index.
            mb: The microbatch's index.

        Returns:
            True where ``stages``, ``microbatches`` and ``pairs`` all allow it.
        """
        return (
            (self.stages is None or stage in self.stages)
            and (self.microbatches is None or mb in self.microbatches)
            and (self.pairs is None or (stage, mb) in self.pairs)
        )


def offload_of(value: Offload | str | None) -> Offload | None:
    """``Trainer(offload=...)``'s value as an ``Offload``: None, ``"host"``, or an ``Offload``.

    Raises:
        VjpsplitError: for anything else (``"files"`` needs ``Offload(to="files", directory=...)``).
    """
    if value is None or isinstance(value, Offload):
        return value
    if value == HOST:
        return Offload(HOST)
    raise VjpsplitError(
        f"offload={value!r}: give None, 'host', or vjpsplit_cli.pipeline.Offload(to='host'|'files', directory=...)"
    )


def _movable(a: object) -> bool:
    """A stored leaf that can leave and come back bit for bit (typed PRNG keys stay: NumPy has no dtype for them)."""
    return isinstance(a, jax.Array) and not jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key)


def _has_pinned_host(a: jax.Array) -> bool:
    try:
        devices = a.sharding.device_set
        return all("pinned_host" in {m.kind for m in d.addressable_memories()} for d in devices)  # type: ignore[attr-defined]  # not in jaxlib's stub
    except (AttributeError, ValueError):
        return False


def _via_pinned_host(a: jax.Array) -> bool:
    """Whether ``a`` leaves to its devices' ``pinned_host`` memory (accelerators) rather than to host NumPy.

    A CPU device's ``pinned_host`` memory is the same RAM as its own, and JAX's copy there costs far
    more than the bytes: 0.08-0.19 ms per array of JAX's own work, where a memcpy of the mid GPT's
    residual arrays takes about 12 µs each (``benchmarks/offload_copies.py``; docs/howto/offload.md,
    "Measured"). So a CPU device's residuals go to NumPy.
    """
    try:
        on_cpu = any(d.platform == "cpu" for d in a.sharding.device_set)  # type: ignore[attr-defined]  # not in jaxlib's stub
    except (AttributeError, ValueError):
        on_cpu = False
    return not on_cpu and _has_pinned_host(a)


class Away:
    """One microbatch's residuals while they are off the device: the shell, its future, and the copy back.

    What a ``StageWorker`` holds in place of the residuals (``Offloader.send``) until ``Offloader.take``.
    """

    __slots__ = ("shell", "moved", "shardings", "specs", "nbytes", "out", "back", "path", "pinned")

    def __init__(self, shell: Residuals, moved: list[str], arrays: list[jax.Array]):
        self.shell, self.moved = shell, moved
        self.shardings = [a.sharding for a in arrays]
        self.specs = [(tuple(a.shape), np.dtype(a.dtype)) for a in arrays]
        self.nbytes = sum(map(leaf_bytes, arrays))
        self.path: str | None = None
        # The bytes in ``pinned_host`` memory (``packing.packer``), where they went there.
        self.pinned: jax.Array | None = None
        # The host copies (host: pinned_host or NumPy) or None (files), once away.
        self.out: Future[jax.Array] | Future[list[np.ndarray]] | Future[None] | None = None
        self.back: Future[Residuals] | None = None  # the residuals on the device again


class Offloader:
    """One stage's residuals off its device: ``send`` after F, ``prefetch`` before B's previous operation (host
    NumPy copies and files), ``take`` at B (and the copy back of those in ``pinned_host`` memory). Jobs run in
    order on one daemon thread of its own, so a copy back never overtakes its copy out; ``close``
    ends it and removes the residual files no B read back (``discard``), as collecting the offloader does.

    Raises:
        VjpsplitError: ``to="files"`` and its directory cannot be created (naming it).
    """

    def __init__(self, spec: Offload, artifact: Artifact, stage: int, replica: int | None = None):
        self.spec, self.art, self.stage, self.replica = spec, artifact, stage, replica
        self.name = f"vjpsplit-offload-{stage}" + ("" if replica is None else f"-r{replica}")
        self.thread: WorkerThreads | None = None  # started at the first job
        self.files = ResidualFiles()
        self._collected = weakref.finalize(self, self.files.discard)  # a Trainer nobody closed leaves no file
        self.away: dict[int, Away] = {}
        self.next_op: dict[OpKey, Op] = {}
        self.position: dict[OpKey, int] = {}  # each of the stage's operations' place in its list this step
        self.token, self.step = uuid.uuid4().hex[:12], 0
        if spec.to == FILES:
            assert spec.directory is not None
            try:
                os.makedirs(spec.directory, exist_ok=True)
            except OSError as e:
                raise VjpsplitError(
                    f"Offload(directory=...): {spec.directory}: cannot create it ({one_line(e)}); give a directory "
                    "you can write"
                ) from e

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        """``fn()`` on the offloader's thread, after the jobs before it; its result or error in the future."""
        f: Future[T] = Future()

        def job() -> None:
            try:
                f.set_result(fn())
            except BaseException as e:  # noqa: BLE001  # handed to whoever takes the result
                f.set_exception(e)

        if self.thread is None:
            self.thread = WorkerThreads(1, self.name)
        try:
            self.thread.start([job])
        except RuntimeError as e:  # closed: a job of a step abandoned while stuck, after ``close``
            f.set_exception(VjpsplitError(f"stage {self.stage}: its offload was closed ({e})"))
        return f

    def discard(self) -> None:
        """Remove the residual files this offloader wrote that no B read back (a failed or interrupted step's);
        a write still under way removes its file once done. The user's files are never touched."""
        self.files.discard()

    def close(self) -> None:
        """End the thread (after the jobs it holds; a stuck one is not waited for) and remove the residual files
        no B read back."""
        self.files.discard()
        if self.thread is not None:
            self.thread.abandon()

    def schedule(self, plans: Sequence[Sequence[Op]]) -> None:
        """Note the stage's operations in order for this step (what runs after each); residual files an earlier
        step left (it failed) are removed."""
        self.files.discard()
        mine = [op for ops in plans for op in ops if op.stage == self.stage]
        self.next_op = {a.key: b for a, b in zip(mine, mine[1:])}
        self.position = {a.key: i for i, a in enumerate(mine)}
        self.away = {}
        self.step += 1

    def tag(self, mb: int) -> str:
        """What names microbatch ``mb``'s residuals of this step in their file."""
        rep = "" if self.replica is None else f":replica{self.replica}"
        return f"offload:{self.token}:step{self.step}:stage{self.stage}{rep}:mb{mb}"

    def path(self, mb: int) -> str:
        """The residual file of microbatch ``mb`` (``to="files"``)."""
        assert self.spec.directory is not None
        rep = "" if self.replica is None else f"-r{self.replica}"
        return os.path.join(self.spec.directory, f"vjpsplit-offload-{self.token}-stage{self.stage}{rep}-mb{mb}.npz")

    def keeps(self, mb: int) -> bool:
        """Whether microbatch ``mb``'s F residuals stay: not asked for, or its B (or I) runs next or second anyway
        (its copy back would start at once: see ``Offload``)."""
        f = self.position.get(OpKey(Kind.F, mb, self.stage))
        b = self.position.get(OpKey(Kind.B, mb, self.stage))  # an I is keyed as its B (``ops.OpKey``)
        return not self.spec.wants(self.stage, mb) or (f is not None and b is not None and b - f <= 2)

    def send(self, mb: int, res: Residuals) -> Residuals | Away:
        """After microbatch ``mb``'s F: start moving its residuals off the device; what the stage holds instead."""
        if self.keeps(mb):
            return res

        moved = [k for k, a in res.stored.items() if _movable(a)]
        if not moved:
            return res
        arrays = [res.stored[k] for k in moved]
        kept = FrozenDict({k: a for k, a in res.stored.items() if k not in set(moved)})
        away = Away(res.replace(stored=kept), moved, arrays)
        if self.spec.to == FILES:
            away.path = self.path(mb)
            # The file's residuals_id names this Trainer's step, stage and microbatch: another's file is refused.
            tagged = res.replace(stored=FrozenDict(zip(moved, arrays)), residuals_id=self.tag(mb))
            away.out = self.submit(self.files.writer(away.path, tagged))
        else:
            if packable(arrays) and _via_pinned_host(arrays[0]):
                # One compiled call, in the device's order right after F: the arrays packed into one buffer of
                # bytes, which goes to pinned_host memory (one transfer: each array of its own costs about 0.5 ms
                # of the host's time on a TPU); the device's bytes go once it has run.
                away.pinned = packer(tuple(away.specs), arrays[0].sharding)(arrays)
                away.out = _done(away.pinned)
            elif all(a.is_ready() for a in arrays):  # type: ignore[attr-defined]  # not in the stub
                # A timed step's F, waited for: copied now (a memcpy), so they are off the device at this boundary.
                away.out = _now(_to_host, arrays)
            else:  # CPU devices, or no host memory kind: NumPy copies, made on this offloader's thread once F is computed
                away.out = self.submit(lambda: _to_host(arrays))
        self.away[mb] = away
        return away

    def before(self, op: Op) -> None:
        """Before operation ``op`` runs: if the stage's next one is a B or I of residuals away, start their copy
        back."""
        nxt = self.next_op.get(op.key)
        if nxt is not None and nxt.kind in BACKWARDS:
            self.prefetch(nxt.mb)

    def prefetch(self, mb: int) -> None:
        """Start bringing microbatch ``mb``'s residuals back (once) from host NumPy copies or files; those in
        ``pinned_host`` memory come back at their B (``take``), in the device's order."""
        away = self.away.get(mb)
        if away is not None and away.back is None and away.pinned is None:
            away.back = self.submit(lambda: self._back(mb, away))

    def take(self, mb: int, held: Residuals | Away) -> Residuals:
        """At B: ``mb``'s residuals on the device, from what the stage held (``held``, ``send``'s result).

        Raises:
            VjpsplitError: their file is missing, damaged or another run's (naming the stage, microbatch and file).
        """
        if not isinstance(held, Away):
            return held
        if held.pinned is not None:  # dispatched right before the B: on the device only from there on
            held.back = _done(self._back(mb, held))
        self.prefetch(mb)
        assert held.back is not None
        try:
            return held.back.result()
        finally:
            self.away.pop(mb, None)

    def device_bytes(self) -> int:
        """Bytes of offloaded residuals still (copy out not done) or again (copy back done) on the device.

        Those in ``pinned_host`` memory count none: in the device's order their copy out runs right after their F
        and their copy back right before their B, so no operation in between has them on the device.
        """
        total = 0
        for away in list(self.away.values()):
            if away.pinned is not None:
                continue
            out, back = away.out, away.back
            leaving = out is not None and not out.done()
            if leaving or (back is not None and back.done() and back.exception() is None):
                total += away.nbytes
        return total

    def _back(self, mb: int, away: Away) -> Residuals:
        assert away.out is not None
        host: object = away.out.result()  # the write's or the copy's error, if any, is this B's
        if self.spec.to == FILES:
            host = self._read(mb, away)
        if away.pinned is not None:  # one compiled call: the buffer back on the device, unpacked there
            arrays = unpacker(tuple(away.specs), away.shardings[0])(away.pinned)
        else:
            arrays = jax.device_put(host, away.shardings)
        return away.shell.replace(stored=FrozenDict({**away.shell.stored, **dict(zip(away.moved, arrays))}))

    def _read(self, mb: int, away: Away) -> list[Leaf]:
        path = away.path
        assert path is not None
        rep = "" if self.replica is None else f" replica {self.replica}"
        where = f"stage {self.stage}{rep} microbatch {mb}: offloaded residuals {path}"
        try:
            loaded = load_residuals(path, artifact=self.art)
        except VjpsplitError as e:
            said = str(e)
            said = said[len(f"{path}: ") :] if said.startswith(f"{path}: ") else said
            raise VjpsplitError(f"{where}: {said}") from e
        except OSError as e:
            raise VjpsplitError(f"{where}: cannot be read ({e}); keep the offload directory until the step ends") from e
        if loaded.residuals_id != self.tag(mb):
            raise VjpsplitError(
                f"{where}: the file holds another forward run's residuals; keep each Trainer's files apart"
            )
        out = []
        for k, (shape, dtype) in zip(away.moved, away.specs):
            a = loaded.stored.get(k)
            if a is None:
                raise VjpsplitError(f"{where}: residual {k!r} is missing from the file")
            if tuple(a.shape) != shape or np.dtype(a.dtype) != dtype:
                raise VjpsplitError(
                    f"{where}: residual {k!r}: expected {format_shape(dtype, shape)}, "
                    f"file has {format_shape(a.dtype, a.shape)}"
                )
            out.append(a)
        self.files.remove(path)
        return out


class ResidualFiles:
    """The residual files an ``Offloader`` wrote that no B has read back yet: what ``discard`` removes.

    Only paths it wrote are ever removed. ``round`` counts the discards: a write submitted before one does not
    run, and one under way as it happens removes its file once done, so no file of a discarded step stays.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.paths: set[str] = set()
        self.round = 0

    def writer(self, path: str, res: Residuals) -> Callable[[], None]:
        """The job that writes ``res`` to ``path`` (unless a discard comes first)."""
        at = self.round

        def write() -> None:
            with self.lock:
                if at != self.round:
                    return  # discarded before it ran: its B never runs
                self.paths.add(path)
            # Only the stored arrays: the inputs stay with the stage (their CRC-32 would cost a copy of the parameters).
            save_residuals(path, res.replace(inputs={}, bound_inputs={}))
            with self.lock:
                if at == self.round:
                    return
            _unlink(path)  # discarded while it was written

        return write

    def remove(self, path: str) -> None:
        """``path`` was read back: remove it."""
        with self.lock:
            self.paths.discard(path)
        _unlink(path)

    def discard(self) -> None:
        """Remove every file written and not read back; writes submitted before now do not keep theirs."""
        with self.lock:
            self.round += 1
            paths, self.paths = self.paths, set()
        for path in paths:
            _unlink(path)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass  # already gone: nothing left to clean


def _to_host(arrays: Sequence[Leaf]) -> list[np.ndarray]:
    """Host NumPy copies of ``arrays``, each in a buffer of its own aligned to ``files.buffers.ALIGN`` bytes.

    Copies, not ``np.asarray`` views: a CPU array's view shares its buffer and would keep it alive. The
    alignment lets ``jax.device_put`` onto a CPU device use the copy's buffer as it is: the bytes are
    copied once each way, not twice on the way back.
    """
    out = []
    for a in arrays:
        src = np.asarray(a)  # waits for ``a``; on a CPU device a view of its buffer, dropped once copied
        dst = aligned_empty(src.shape, src.dtype)
        np.copyto(dst, src)
        out.append(dst)
    return out


def _done(value: T) -> Future[T]:
    f: Future[T] = Future()
    f.set_result(value)
    return f


def _now(fn: Callable[[S], T], arg: S) -> Future[T]:
    """``fn(arg)`` run now, as a finished future: its error, if any, is raised where the result is taken (the B's)."""
    f: Future[T] = Future()
    try:
        f.set_result(fn(arg))
    except Exception as e:  # noqa: BLE001  # handed to whoever takes the result, as ``Offloader.submit``'s futures do
        f.set_exception(e)
    return f


def to_host_and_back(x: jax.Array, away: Leaf | None) -> Leaf:
    """One copy as ``to="host"`` makes it, waited for: ``away=None``, ``x`` off its device (an accelerator's
    ``pinned_host`` where it has one, else NumPy); else ``away`` back on ``x``'s device. What the Trainer's transfer probe times."""
    if away is None:
        if _via_pinned_host(x):
            out = jax.device_put(x, x.sharding.with_memory_kind("pinned_host"))
            out.block_until_ready()
            return out
        return _to_host([x])[0]
    back = jax.device_put(away, x.sharding)
    back.block_until_ready()
    return back
