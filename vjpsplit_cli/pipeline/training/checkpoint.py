"""Training checkpoints keyed by the model, not the cut: parameters by their keys, optax's state by its own keys.

Layout of ``DIR`` (layout 2)::

    checkpoint.json     kind, layout version, step count, the parameter keys and structure, the state's keys
    params.npz          one array per parameter leaf, keyed as the Stages name it (``params/embed``)
    opt_state.npz       optax's state for the whole model (``tx.init(params)``'s structure), by its file keys
                        (``0/mu/embed``, ``0/count``); typed PRNG keys as key data, their impl in the index

Nothing in it says how the model was cut, so any ``Stages`` of the same
function (another number of stages, other marks) continues from it, and so does
a one-process optax loop (``load_checkpoint``). Layout 1 (one ``stage-<s>.npz``
of ``params/<key>`` and ``state/<key>`` arrays per stage) is still read; it
loads only into the cut that wrote it.

The arrays go through the project's array-file writer (``save_arrays``): no
pickle, every dtype exact (bfloat16 included), a CRC-32 per array checked on
load. The directory is written all-or-nothing: every file is written and flushed
into a fresh temp directory beside ``DIR``, which is then swapped into place in
one rename (``renameat2(RENAME_EXCHANGE)`` where ``DIR`` exists, the old copy
then removed); a crash or signal at any point leaves the previous checkpoint, or
none, never a mix. An existing ``DIR`` that is not a checkpoint (or is one beside
files no save wrote) is refused rather than replaced: nothing a user put there is
deleted (``check_directory``); an empty directory is taken. The temp directory is
named like the project's temp files (``safeio.temps``), so one a killed writer
left is swept by the next save or read once that process is gone, and the old
copy a killed fallback swap left aside is renamed back (``tidy``).

The index is checked field by field on reading, each array file against its
CRC-32 and against the index's save id (``id``, repeated in every file's
metadata): a read that races a save reads again, never pairing one save's index
with another's arrays.

Why not orbax for these files: a worker or a one-process loop reads them with
vjpsplit alone, and the project's writer already gives atomic, checksummed,
pickle-free files with every JAX dtype. ``Trainer.state()`` gives optax's own
structure, which orbax's ``StandardCheckpointer`` saves and restores as it is
(docs/pipeline.md shows how).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import secrets
import time
from typing import Mapping, Sequence, TypedDict, cast

import numpy as np
from jax.typing import ArrayLike

from ...errors import VjpsplitError, one_line
from ...files import load_arrays, save_arrays
from ...files.prng import from_data, impl_name, is_key, to_data
from ...files.trees import flatten_with_keys, structure_keys
from ...safeio.filesystem import fsync_dir, renameat2
from ...safeio.signals import cleanup_on_signals
from ...safeio.temps import clear_temp_dir, new_temp_dir, stale_temps
from ...treetypes import JSON, JSONObject, Leaf, PyTree

KIND = "vjpsplit-trainer-checkpoint"
# 1 (2026-12-01): per stage, ``stage-<s>.npz`` of its ``params/<key>`` and ``state/<key>`` (its own optax state).
#   Its free-form ``meta`` holds the schedule, the optimizer's name and ``params``' structure; from 2026-12-02
#   also ``microbatches``, ``clip_global_norm`` and, for the caller's plans, ``plans`` (their CSV text), which
#   ``Trainer.restore`` uses where they are not given. Older checkpoints lack those and still load.
# 2 (2026-12-01, issue 36): keyed by the model: ``params.npz`` by parameter key, ``opt_state.npz`` by the keys of
#   optax's whole-model state; the index records the parameters' structure and each leaf's key (``params``), the
#   state's keys and PRNG impls (``opt_state``). ``meta`` as in 1. From 2026-12-02 (issue 43) also ``id``, one
#   per save, which every array file's metadata repeats (``checkpoint``); read without it as before.
FORMAT = 2
READS = (1, 2)
INDEX = "checkpoint.json"
PARAMS, OPT_STATE = "params.npz", "opt_state.npz"


class MetaJSON(TypedDict, total=False):
    """``meta`` as ``checkpoint.json`` holds it: a key is there only where it is recorded (``CheckpointMeta``)."""

    schedule: str
    optimizer: str
    structure: JSON
    microbatches: int
    clip_global_norm: float | None
    plans: str
    memory_limit: int | list[int] | None
    memory_limit_bytes: int | str | list[int | str] | None


@dataclasses.dataclass(frozen=True)
class CheckpointMeta:
    """The Trainer's settings a checkpoint records (``checkpoint.json``'s ``meta``), for ``Trainer.restore``.

    None: not recorded (a checkpoint of an older vjpsplit lacks ``microbatches``, ``clip_global_norm`` and
    ``plans``), except in ``structure`` and ``clip_global_norm``, which are always written: None is per-stage
    parameters (artifacts, no one structure) and no clipping. ``schedule``: the schedule's name; ``optimizer``:
    the optimizer's, for messages; ``structure``: the parameters' encoded structure
    (``files.trees.encode_structure``; layout 1 reads it); ``plans``: the caller's plans as CSV text.

    ``auto``: an auto schedule's run, whose ``memory_limit`` and ``memory_limit_bytes`` are both recorded (as
    given, either None), so that ``restore`` measures again on its own hosts.
    """

    schedule: str | None = None
    optimizer: str | None = None
    structure: JSON = None
    microbatches: int | None = None
    clip_global_norm: float | None = None
    plans: str | None = None
    auto: bool = False
    memory_limit: int | list[int] | None = None
    memory_limit_bytes: int | str | list[int | str] | None = None

    def as_dict(self) -> MetaJSON:
        """The record as ``checkpoint.json`` holds it, its keys in the order the Trainer has always written them."""
        out = MetaJSON()
        if self.schedule is not None:
            out["schedule"] = self.schedule
        if self.optimizer is not None:
            out["optimizer"] = self.optimizer
        out["structure"] = self.structure
        if self.microbatches is not None:
            out["microbatches"] = self.microbatches
        out["clip_global_norm"] = self.clip_global_norm
        if self.plans is not None:
            out["plans"] = self.plans
        if self.auto:
            out["memory_limit"] = self.memory_limit
            out["memory_limit_bytes"] = self.memory_limit_bytes
        return out

    @classmethod
    def from_dict(cls, directory: str, value: JSON) -> CheckpointMeta:
        """``meta`` as read from ``directory``'s index, each setting ``restore`` takes checked for its type
        (missing ones are left to the caller; keys it does not know are not read).

        Raises:
            VjpsplitError: ``value`` is not an object, or a setting is not of its type (naming it).
        """
        d = directory
        meta = _object(d, "meta", value)
        m = meta.get("microbatches")
        if "microbatches" in meta and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
            raise _damaged(d, "meta.microbatches", m, "an int >= 1")
        c = meta.get("clip_global_norm")
        if c is not None and (isinstance(c, bool) or not isinstance(c, (int, float)) or not c > 0):
            raise _damaged(d, "meta.clip_global_norm", c, "a positive number or null")
        for key in ("schedule", "plans"):
            if key in meta and not isinstance(meta[key], str):
                raise _damaged(d, f"meta.{key}", meta[key], "a string")
        for key, kinds in (("memory_limit", (int,)), ("memory_limit_bytes", (int, str))):
            v = meta.get(key)
            if v is None:
                continue
            if not all(isinstance(x, kinds) and not isinstance(x, bool) for x in (v if isinstance(v, list) else [v])):
                raise _damaged(d, f"meta.{key}", v, "a limit or one per worker")
        schedule, optimizer, plans = meta.get("schedule"), meta.get("optimizer"), meta.get("plans")
        return cls(
            schedule=schedule if isinstance(schedule, str) else None,
            optimizer=optimizer if isinstance(optimizer, str) else None,  # for messages only: never refused
            structure=meta.get("structure"),
            microbatches=m if isinstance(m, int) else None,
            clip_global_norm=c if isinstance(c, (int, float)) else None,
            plans=plans if isinstance(plans, str) else None,
            auto="memory_limit" in meta or "memory_limit_bytes" in meta,
            # Checked just above, element by element.
            memory_limit=cast("int | list[int] | None", meta.get("memory_limit")),
            memory_limit_bytes=cast("int | str | list[int | str] | None", meta.get("memory_limit_bytes")),
        )


@dataclasses.dataclass(frozen=True)
class HostCheckpoint:
    """What a checkpoint holds, on the host: ``params`` by key, the structure (``encode_structure``'s JSON) and
    key of each of ``params``' leaves, optax's whole-model ``opt_state``, the ``step`` count and ``meta`` (the
    Trainer's settings: a ``CheckpointMeta``, or a mapping of ``meta``'s keys, written as given)."""

    params: Mapping[str, Leaf]
    leaves: Sequence[str]
    structure: JSON
    opt_state: PyTree
    step: int
    meta: CheckpointMeta | Mapping[str, object]


# Layout 1: one stage's ``(params, optimizer state)`` flat by key (typed PRNG keys as such).
StageArrays = tuple[dict[str, np.ndarray], dict[str, Leaf]]


@dataclasses.dataclass(frozen=True)
class Saved:
    """A checkpoint as read, of one of two layouts, each made by its constructor: ``by_model`` (layout 2) fills
    ``params``, ``leaves``, ``structure`` and ``opt_state`` (flat by file key, PRNG keys typed); ``by_stage``
    (layout 1) fills ``stages`` (per stage, ``(params, state)`` flat by key). The other layout's fields are empty."""

    directory: str
    layout: int
    step: int
    meta: CheckpointMeta
    params: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    leaves: list[str] = dataclasses.field(default_factory=list)
    structure: JSON = None
    opt_state: dict[str, Leaf] = dataclasses.field(default_factory=dict)
    stages: list[StageArrays] = dataclasses.field(default_factory=list)

    @classmethod
    def by_model(
        cls,
        directory: str,
        step: int,
        meta: CheckpointMeta,
        params: dict[str, np.ndarray],
        leaves: list[str],
        structure: JSON,
        opt_state: dict[str, Leaf],
    ) -> Saved:
        """A layout 2 checkpoint: keyed by the model."""
        return cls(directory, 2, step, meta, params, leaves, structure, opt_state)

    @classmethod
    def by_stage(cls, directory: str, step: int, meta: CheckpointMeta, stages: list[StageArrays]) -> Saved:
        """A layout 1 checkpoint: one ``(params, state)`` per stage of the cut that wrote it."""
        return cls(directory, 1, step, meta, stages=stages)


def has_checkpoint(directory: str | os.PathLike[str]) -> bool:
    """Whether ``directory`` holds a checkpoint's index (what ``fit`` begins from)."""
    return os.path.isfile(os.path.join(os.fspath(directory), INDEX))


def owned(name: str) -> bool:
    """Whether a file named ``name`` in a checkpoint directory is one a checkpoint save writes (any layout)."""
    return _OWNED.match(name) is not None


_OWNED = re.compile(r"(checkpoint\.json|params\.npz|opt_state\.npz|stage-\d+\.npz)\Z")
READ_TRIES = 5  # a read that races a save reads again (the save's swap takes one rename)


def tidy(directory: str | os.PathLike[str]) -> None:
    """Before a save or a read: take back a checkpoint a dead writer's fallback swap left aside, and sweep the
    temp directories of dead writers beside ``directory``.

    Where ``RENAME_EXCHANGE`` is missing, a save moves the old copy aside (``<tmp>.old``), renames the new one
    in, then removes the old; a writer killed between the first two renames leaves no ``directory``, the old
    (complete) checkpoint under ``<tmp>.old`` and the new one under ``<tmp>``: the old copy is renamed back, so
    the run goes on from it (the steps since run again), and the new one is swept.
    """
    target = os.path.abspath(os.fspath(directory))
    parent, base = os.path.dirname(target), os.path.basename(target)
    mine = f".{base[:80]}."
    stale = [e for e in stale_temps(parent) if e.name.startswith(mine) and e.is_dir(follow_symlinks=False)]
    if not os.path.lexists(target):
        aside = [e for e in stale if e.name.endswith(".tmp.old") and os.path.isfile(os.path.join(e.path, INDEX))]
        if aside:
            newest = max(aside, key=lambda e: e.stat(follow_symlinks=False).st_mtime)
            try:
                os.rename(newest.path, target)
            except OSError as err:
                raise VjpsplitError(
                    f"{directory}: a save cut short left the previous checkpoint at {newest.path}, and it cannot be "
                    f"moved back ({one_line(err)}); rename it to {target}"
                ) from err
            fsync_dir(parent)
    for entry in stale:
        clear_temp_dir(entry.path, owned)  # one renamed back just now is gone from there


def check_directory(directory: str | os.PathLike[str]) -> None:
    """Refuse a place no checkpoint can be saved to without loss, before any step runs (``fit``) or any file is
    written (``save``): a file, a parent that does not exist or cannot be written, a directory holding files
    that are not a checkpoint, or a checkpoint with files a save did not write (a save replaces the whole
    directory, so it would delete them). A new name, an empty directory and a previous checkpoint pass."""
    target = os.path.abspath(os.fspath(directory))
    parent = os.path.dirname(target)
    if os.path.lexists(target) and not os.path.isdir(target):
        raise VjpsplitError(f"{directory}: is a file, not a directory; give a directory for the checkpoint")
    if not os.path.isdir(parent):
        raise VjpsplitError(f"{directory}: directory {parent} does not exist; create it first")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise VjpsplitError(
            f"{directory}: cannot write in {parent} (a checkpoint is written beside its directory, then renamed "
            "into place); give a directory in a place you can write"
        )
    if not os.path.isdir(target):
        return
    try:
        entries = sorted(os.listdir(target))
    except OSError as e:
        raise VjpsplitError(f"{directory}: cannot list the directory ({one_line(e)})") from e
    if entries and INDEX not in entries:
        raise VjpsplitError(
            f"{directory}: exists and is not a vjpsplit checkpoint (it holds {entries[0]!r}); give a new or empty "
            "directory, or a previous checkpoint's"
        )
    foreign = [n for n in entries if not owned(n)]
    if foreign:
        raise VjpsplitError(
            f"{directory}: holds {foreign[0]!r}, which no checkpoint save wrote; a save replaces the whole "
            "directory and would delete it: move it elsewhere"
        )
    if entries and not os.access(target, os.W_OK | os.X_OK):
        raise VjpsplitError(f"{directory}: cannot write in it (a save removes the previous checkpoint's files)")


def save_checkpoint(directory: str | os.PathLike[str], ck: HostCheckpoint) -> None:
    """Write ``ck`` to ``directory`` in layout 2, all or nothing (see the module docstring)."""
    state = flatten_with_keys("", ck.opt_state)
    index = {
        "kind": KIND,
        "format": FORMAT,
        "step": int(ck.step),
        "params": {"keys": list(ck.params), "leaves": list(ck.leaves), "structure": ck.structure},
        "opt_state": {"keys": [k for k, _ in state], "prng_impls": {k: impl_name(v) for k, v in state if is_key(v)}},
        "meta": ck.meta.as_dict() if isinstance(ck.meta, CheckpointMeta) else dict(ck.meta),
    }
    files = {
        PARAMS: {k: np.asarray(v) for k, v in ck.params.items()},
        OPT_STATE: {k: np.asarray(to_data(v)) for k, v in state},
    }
    write_directory(directory, files, index)


def _index_text(directory: str | os.PathLike[str], index: Mapping[str, object]) -> str:
    """``index`` as JSON; a value JSON cannot hold is one error naming its field."""
    try:
        return json.dumps(index, indent=1)
    except (TypeError, ValueError) as e:
        meta = index.get("meta")
        fields = [(f"meta {k!r}", v) for k, v in meta.items()] if isinstance(meta, Mapping) else []
        fields += [(repr(k), v) for k, v in index.items() if k != "meta"]
        for name, value in fields:
            try:
                json.dumps(value)
            except (TypeError, ValueError):
                raise VjpsplitError(
                    f"{directory}: cannot record {name} = {value!r} ({type(value).__name__}) in {INDEX}; "
                    "pass plain Python numbers and strings"
                ) from e
        raise VjpsplitError(f"{directory}: cannot write {INDEX} ({one_line(e)})") from e


def write_directory(
    directory: str | os.PathLike[str], files: Mapping[str, Mapping[str, ArrayLike]], index: Mapping[str, object]
) -> None:
    """``files`` (name -> arrays) and ``index`` as ``checkpoint.json`` in ``directory``, swapped in whole.

    Each file and the index carry one id of this write (``id``), so a reader can tell a file of another save
    (``read_checkpoint``). A file in ``directory`` that no save wrote is refused, not deleted (``check_directory``).
    """
    target = os.path.abspath(os.fspath(directory))
    parent = os.path.dirname(target)
    if os.path.isdir(parent):
        tidy(target)
    check_directory(directory)
    write_id = secrets.token_hex(8)
    text = _index_text(directory, {**index, "id": write_id})
    with cleanup_on_signals():
        try:
            tmp = new_temp_dir(parent, os.path.basename(target))
        except OSError as e:
            raise VjpsplitError(f"{directory}: cannot create a directory in {parent} ({one_line(e)})") from e
        try:
            for name, arrays in files.items():
                save_arrays(os.path.join(tmp, name), arrays, {"checkpoint": write_id}, fsync=True)
            with open(os.path.join(tmp, INDEX), "w") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            fsync_dir(tmp)
            _swap_in(tmp, target)
        except OSError as e:
            raise VjpsplitError(f"{directory}: cannot write the checkpoint ({one_line(e)})") from e
        finally:
            # The new files (on failure) or the old checkpoint (swapped out); a file someone put in the old
            # directory meanwhile keeps it (under the temp name), never deleted.
            clear_temp_dir(tmp, owned)


def _swap_in(tmp: str, target: str) -> None:
    """``tmp`` in place of ``target`` in one rename; afterwards ``tmp`` names the old copy (if any)."""
    exchange = renameat2()
    if os.path.exists(target):
        if exchange is None or not exchange(tmp, target):
            # No atomic exchange here: move the old copy aside first (a crash between leaves no DIR and the
            # old copy beside it as <tmp>.old, which ``tidy`` renames back).
            old = tmp + ".old"
            os.rename(target, old)
            os.rename(tmp, target)
            os.rename(old, tmp)
    else:
        os.rename(tmp, target)
    fsync_dir(os.path.dirname(target))


def _damaged(d: str, field: str, value: object, want: str) -> VjpsplitError:
    shown = repr(value)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    return VjpsplitError(f"{d}: {INDEX}'s {field} is {shown}, not {want}; the checkpoint is damaged")


def _count(d: str, field: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise _damaged(d, field, value, "an int >= 0")
    return value


def _strings(d: str, field: str, value: object) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _damaged(d, field, value, "a list of strings")
    return value


def _object(d: str, field: str, value: object) -> JSONObject:
    if not isinstance(value, dict):
        raise _damaged(d, field, value, "an object")
    return value


def read_checkpoint(directory: str | os.PathLike[str]) -> Saved:
    """The checkpoint in ``directory`` (layout 1 or 2); its index checked field by field, each array against its
    CRC-32, and every file against the index's write id (a read that races a save reads again).

    Raises:
        VjpsplitError: no checkpoint there, or a damaged one (naming the field or the file).
    """
    d = os.fspath(directory)
    if os.path.isdir(os.path.dirname(os.path.abspath(d))):
        tidy(d)
    for attempt in range(READ_TRIES):
        index = _read_index(d)
        try:
            return _read_arrays(d, index)
        except _Raced:
            time.sleep(0.01 * (attempt + 1))
        except VjpsplitError:
            try:
                again = _read_index(d)
            except VjpsplitError:
                again = None
            if again is None or again.get("id") == index.get("id"):
                raise  # the files are damaged, not replaced meanwhile
    raise VjpsplitError(
        f"{d}: its files changed while they were read, {READ_TRIES} times (another process is saving into it); "
        "read it again when that save is done"
    )


class _Raced(Exception):
    """A file of the checkpoint belongs to another save than the index read (a save swapped it in meanwhile)."""


def _read_index(d: str) -> JSONObject:
    try:
        with open(os.path.join(d, INDEX)) as f:
            index = json.load(f)
    except FileNotFoundError as e:
        raise VjpsplitError(f"{d}: is not a vjpsplit checkpoint (no {INDEX}); pass the directory save wrote") from e
    except (OSError, ValueError) as e:
        raise VjpsplitError(f"{d}: cannot read {INDEX} ({one_line(e)}); the checkpoint is damaged") from e
    if not isinstance(index, dict) or index.get("kind") != KIND:
        raise VjpsplitError(f"{d}: {INDEX} is not a vjpsplit trainer checkpoint's index")
    layout = index.get("format")
    if layout not in READS:
        raise VjpsplitError(f"{d}: checkpoint layout {layout!r}; this vjpsplit reads layouts {list(READS)}")
    _count(d, "step", index.get("step"))
    CheckpointMeta.from_dict(d, index.get("meta", {}))
    if layout == 1:
        for i, entry in enumerate(_strings_of_objects(d, "stages", index.get("stages"))):
            file = entry.get("file")
            if not isinstance(file, str) or os.path.basename(file) != file or not file.endswith(".npz"):
                raise _damaged(d, f"stages[{i}].file", file, "a .npz file name in the checkpoint")
            _strings(d, f"stages[{i}].params", entry.get("params"))
            _strings(d, f"stages[{i}].state", entry.get("state"))
            _object(d, f"stages[{i}].prng_impls", entry.get("prng_impls") or {})
        return index
    p = _object(d, "params", index.get("params"))
    keys = _strings(d, "params.keys", p.get("keys"))
    leaves = _strings(d, "params.leaves", p.get("leaves"))
    missing = sorted(set(keys) - set(leaves))
    unknown = sorted(set(leaves) - set(keys))
    if missing or unknown:
        what = f"lacks '{missing[0]}'" if missing else f"names '{unknown[0]}', which params.keys lacks"
        raise VjpsplitError(f"{d}: {INDEX}'s params.leaves {what}; the checkpoint is damaged")
    try:
        n = len(structure_keys("", p.get("structure")))
    except VjpsplitError:
        n = -1
    if n != len(leaves):
        raise _damaged(d, "params.structure", p.get("structure"), f"a pytree of {len(leaves)} leaves")
    s = _object(d, "opt_state", index.get("opt_state"))
    _strings(d, "opt_state.keys", s.get("keys"))
    impls = _object(d, "opt_state.prng_impls", s.get("prng_impls") or {})
    if not all(isinstance(v, str) for v in impls.values()):
        raise _damaged(d, "opt_state.prng_impls", impls, "an object of PRNG impl names")
    return index


def _strings_of_objects(d: str, field: str, value: object) -> list[JSONObject]:
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise _damaged(d, field, value, "a list of objects")
    return value


def _read_arrays(d: str, index: JSONObject) -> Saved:
    """The arrays of a checkpoint whose index ``_read_index`` checked (so the fields are narrowed again here,
    never refused)."""
    step, meta, wid = (
        _count(d, "step", index["step"]),
        CheckpointMeta.from_dict(d, index.get("meta", {})),
        index.get("id"),
    )
    if index["format"] == 1:
        return Saved.by_stage(d, step, meta, _read_stages(d, _strings_of_objects(d, "stages", index["stages"]), wid))
    p, s = _object(d, "params", index["params"]), _object(d, "opt_state", index["opt_state"])
    params = _read(d, PARAMS, _strings(d, "params.keys", p["keys"]), wid)
    arrays = _read(d, OPT_STATE, _strings(d, "opt_state.keys", s["keys"]), wid)
    impls = dict(_object(d, "opt_state.prng_impls", s.get("prng_impls") or {}))
    state = {k: _key(d, OPT_STATE, k, v, impls.get(k)) for k, v in arrays.items()}
    leaves = _strings(d, "params.leaves", p["leaves"])
    return Saved.by_model(d, step, meta, params, list(leaves), p["structure"], state)


def _key(d: str, name: str, key: str, data: np.ndarray, impl: JSON) -> Leaf:
    try:
        # A PRNG impl's name; a damaged layout 1 index's other value fails in wrap_key_data as a wrong name does.
        return from_data(data, cast("str | None", impl))
    except (TypeError, ValueError) as e:
        raise VjpsplitError(f"{d}/{name}: '{key}' is not {impl} key data ({one_line(e)}); the file is damaged") from e


def _read(d: str, name: str, keys: Sequence[str], wid: JSON) -> dict[str, np.ndarray]:
    arrays, file_meta = load_arrays(os.path.join(d, name))
    if wid is not None and file_meta.get("checkpoint") != wid:
        raise _Raced(name)
    if sorted(arrays) != sorted(keys):
        raise VjpsplitError(f"{d}/{name}: holds other arrays than its index lists; the checkpoint is damaged")
    return {k: arrays[k] for k in keys}


def _read_stages(d: str, entries: Sequence[JSONObject], wid: JSON) -> list[StageArrays]:
    """Layout 1: per stage, its ``(params, optimizer state)``."""
    snapshots = []
    for i, entry in enumerate(entries):
        name = str(entry["file"])
        keys = _strings(d, f"stages[{i}].params", entry["params"])
        skeys = _strings(d, f"stages[{i}].state", entry["state"])
        arrays = _read(d, name, [f"params/{k}" for k in keys] + [f"state/{k}" for k in skeys], wid)
        impls = _object(d, f"stages[{i}].prng_impls", entry.get("prng_impls") or {})
        params = {k: arrays[f"params/{k}"] for k in keys}
        state = {k: _key(d, name, k, arrays[f"state/{k}"], impls.get(k)) for k in skeys}
        snapshots.append((params, state))
    return snapshots
