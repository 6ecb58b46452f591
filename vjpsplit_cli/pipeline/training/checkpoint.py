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
(docs/howto/checkpoints.md shows how).

The layout's names and records (``KIND``, ``INDEX``, ``HostCheckpoint``, ``CheckpointMeta``, ``Saved``) and
``tidy`` are also importable from here.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from typing import Mapping, Sequence, cast

import numpy as np
from jax.typing import ArrayLike

from ...errors import VjpsplitError, one_line
from ...files import load_arrays, save_arrays
from ...files.prng import from_data, impl_name, is_key, to_data
from ...files.trees import flatten_with_keys, structure_keys
from ...safeio.filesystem import fsync_dir, renameat2
from ...safeio.signals import cleanup_on_signals
from ...safeio.temps import clear_temp_dir, new_temp_dir
from ...treetypes import JSON, JSONObject, Leaf
from .checkpoint_directory import check_directory, owned
from .checkpoint_directory import tidy as tidy
from .checkpoint_layout import (
    FORMAT,
    INDEX,
    KIND,
    OPT_STATE,
    PARAMS,
    READS,
    CheckpointMeta,
    HostCheckpoint,
    Saved,
    StageArrays,
    damaged,
    field_count,
    field_object,
    field_objects,
    field_strings,
)

READ_TRIES = 5  # a read that races a save reads again (the save's swap takes one rename)


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
    field_count(d, "step", index.get("step"))
    CheckpointMeta.from_dict(d, index.get("meta", {}))
    if layout == 1:
        for i, entry in enumerate(field_objects(d, "stages", index.get("stages"))):
            file = entry.get("file")
            if not isinstance(file, str) or os.path.basename(file) != file or not file.endswith(".npz"):
                raise damaged(d, f"stages[{i}].file", file, "a .npz file name in the checkpoint")
            field_strings(d, f"stages[{i}].params", entry.get("params"))
            field_strings(d, f"stages[{i}].state", entry.get("state"))
            field_object(d, f"stages[{i}].prng_impls", entry.get("prng_impls") or {})
        return index
    p = field_object(d, "params", index.get("params"))
    keys = field_strings(d, "params.keys", p.get("keys"))
    leaves = field_strings(d, "params.leaves", p.get("leaves"))
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
        raise damaged(d, "params.structure", p.get("structure"), f"a pytree of {len(leaves)} leaves")
    s = field_object(d, "opt_state", index.get("opt_state"))
    field_strings(d, "opt_state.keys", s.get("keys"))
    impls = field_object(d, "opt_state.prng_impls", s.get("prng_impls") or {})
    if not all(isinstance(v, str) for v in impls.values()):
        raise damaged(d, "opt_state.prng_impls", impls, "an object of PRNG impl names")
    return index


def _read_arrays(d: str, index: JSONObject) -> Saved:
    """The arrays of a checkpoint whose index ``_read_index`` checked (so the fields are narrowed again here,
    never refused)."""
    step, meta, wid = (
        field_count(d, "step", index["step"]),
        CheckpointMeta.from_dict(d, index.get("meta", {})),
        index.get("id"),
    )
    if index["format"] == 1:
        return Saved.by_stage(d, step, meta, _read_stages(d, field_objects(d, "stages", index["stages"]), wid))
    p, s = field_object(d, "params", index["params"]), field_object(d, "opt_state", index["opt_state"])
    params = _read(d, PARAMS, field_strings(d, "params.keys", p["keys"]), wid)
    arrays = _read(d, OPT_STATE, field_strings(d, "opt_state.keys", s["keys"]), wid)
    impls = dict(field_object(d, "opt_state.prng_impls", s.get("prng_impls") or {}))
    state = {k: _key(d, OPT_STATE, k, v, impls.get(k)) for k, v in arrays.items()}
    leaves = field_strings(d, "params.leaves", p["leaves"])
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
        keys = field_strings(d, f"stages[{i}].params", entry["params"])
        skeys = field_strings(d, f"stages[{i}].state", entry["state"])
        arrays = _read(d, name, [f"params/{k}" for k in keys] + [f"state/{k}" for k in skeys], wid)
        impls = field_object(d, f"stages[{i}].prng_impls", entry.get("prng_impls") or {})
        params = {k: arrays[f"params/{k}"] for k in keys}
        state = {k: _key(d, name, k, arrays[f"state/{k}"], impls.get(k)) for k in skeys}
        snapshots.append((params, state))
    return snapshots
