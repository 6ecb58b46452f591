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
none, never a mix. An existing ``DIR`` that is not a checkpoint is refused
rather than replaced.

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
import shutil
import tempfile
from typing import Any, Mapping, Sequence

import numpy as np

from ...errors import VjpsplitError, one_line
from ...files import load_arrays, save_arrays
from ...files.prng import from_data, impl_name, is_key, to_data
from ...files.trees import flatten_with_keys
from ...safeio.filesystem import fsync_dir, renameat2
from ...safeio.signals import cleanup_on_signals
from ...safeio.temps import writer_tag

KIND = "vjpsplit-trainer-checkpoint"
# 1 (2026-12-01): per stage, ``stage-<s>.npz`` of its ``params/<key>`` and ``state/<key>`` (its own optax state).
#   Its free-form ``meta`` holds the schedule, the optimizer's name and ``params``' structure; from 2026-12-02
#   also ``microbatches``, ``clip_global_norm`` and, for the caller's plans, ``plans`` (their CSV text), which
#   ``Trainer.restore`` uses where they are not given. Older checkpoints lack those and still load.
# 2 (2026-12-01, issue 36): keyed by the model: ``params.npz`` by parameter key, ``opt_state.npz`` by the keys of
#   optax's whole-model state; the index records the parameters' structure and each leaf's key (``params``), the
#   state's keys and PRNG impls (``opt_state``). ``meta`` as in 1.
FORMAT = 2
READS = (1, 2)
INDEX = "checkpoint.json"
PARAMS, OPT_STATE = "params.npz", "opt_state.npz"


@dataclasses.dataclass(frozen=True)
class HostCheckpoint:
    """What a checkpoint holds, on the host: ``params`` by key, the structure and key of each of ``params``'
    leaves, optax's whole-model ``opt_state``, the ``step`` count and ``meta`` (the Trainer's settings)."""

    params: Mapping[str, Any]
    leaves: Sequence[str]
    structure: Any
    opt_state: Any
    step: int
    meta: Mapping[str, Any]


@dataclasses.dataclass(frozen=True)
class Saved:
    """A checkpoint as read: ``layout`` 2 fills ``params``, ``leaves``, ``structure`` and ``opt_state`` (flat
    by file key, PRNG keys typed); layout 1 fills ``stages`` (per stage, ``(params, state)`` flat by key)."""

    directory: str
    layout: int
    step: int
    meta: dict[str, Any]
    params: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    leaves: list[str] = dataclasses.field(default_factory=list)
    structure: Any = None
    opt_state: dict[str, Any] = dataclasses.field(default_factory=dict)
    stages: list[tuple[dict[str, Any], dict[str, Any]]] = dataclasses.field(default_factory=list)


def has_checkpoint(directory: str | os.PathLike[str]) -> bool:
    """Whether ``directory`` holds a checkpoint's index (what ``fit`` begins from)."""
    return os.path.isfile(os.path.join(os.fspath(directory), INDEX))


def save_checkpoint(directory: str | os.PathLike[str], ck: HostCheckpoint) -> None:
    """Write ``ck`` to ``directory`` in layout 2, all or nothing (see the module docstring)."""
    state = flatten_with_keys("", ck.opt_state)
    index = {
        "kind": KIND,
        "format": FORMAT,
        "step": int(ck.step),
        "params": {"keys": list(ck.params), "leaves": list(ck.leaves), "structure": ck.structure},
        "opt_state": {"keys": [k for k, _ in state], "prng_impls": {k: impl_name(v) for k, v in state if is_key(v)}},
        "meta": dict(ck.meta),
    }
    files = {
        PARAMS: {k: np.asarray(v) for k, v in ck.params.items()},
        OPT_STATE: {k: np.asarray(to_data(v)) for k, v in state},
    }
    write_directory(directory, files, index)


def write_directory(
    directory: str | os.PathLike[str], files: Mapping[str, Mapping[str, Any]], index: Mapping[str, Any]
) -> None:
    """``files`` (name -> arrays) and ``index`` as ``checkpoint.json`` in ``directory``, swapped in whole."""
    target = os.path.abspath(os.fspath(directory))
    parent = os.path.dirname(target)
    if os.path.exists(target) and not (os.path.isdir(target) and os.path.isfile(os.path.join(target, INDEX))):
        raise VjpsplitError(
            f"{directory}: exists and is not a vjpsplit checkpoint; give a new directory or a previous checkpoint's"
        )
    if not os.path.isdir(parent):
        raise VjpsplitError(f"{directory}: directory {parent} does not exist; create it first")
    with cleanup_on_signals():
        try:
            tmp = tempfile.mkdtemp(
                prefix=f".{os.path.basename(target)[:80]}.", suffix=f".{writer_tag()}.tmp", dir=parent
            )
        except OSError as e:
            raise VjpsplitError(f"{directory}: cannot create a directory in {parent} ({one_line(e)})") from e
        try:
            for name, arrays in files.items():
                save_arrays(os.path.join(tmp, name), arrays, fsync=True)
            with open(os.path.join(tmp, INDEX), "w") as f:
                json.dump(index, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            fsync_dir(tmp)
            _swap_in(tmp, target)
        except OSError as e:
            raise VjpsplitError(f"{directory}: cannot write the checkpoint ({one_line(e)})") from e
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # the new files (on failure) or the old checkpoint (swapped out)


def _swap_in(tmp: str, target: str) -> None:
    """``tmp`` in place of ``target`` in one rename; afterwards ``tmp`` names the old copy (if any)."""
    exchange = renameat2()
    if os.path.exists(target):
        if exchange is None or not exchange(tmp, target):
            # No atomic exchange here: move the old copy aside first (a crash between leaves no DIR, the
            # old copy beside it under the temp name).
            old = tmp + ".old"
            os.rename(target, old)
            os.rename(tmp, target)
            os.rename(old, tmp)
    else:
        os.rename(tmp, target)
    fsync_dir(os.path.dirname(target))


def read_checkpoint(directory: str | os.PathLike[str]) -> Saved:
    """The checkpoint in ``directory`` (layout 1 or 2); each array checked against its CRC-32."""
    d = os.fspath(directory)
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
    meta = dict(index.get("meta") or {})
    try:
        if layout == 1:
            return Saved(d, 1, int(index["step"]), meta, stages=_read_stages(d, index["stages"]))
        p, s = index["params"], index["opt_state"]
        params = _read(d, PARAMS, [str(k) for k in p["keys"]])
        arrays = _read(d, OPT_STATE, [str(k) for k in s["keys"]])
        impls = dict(s.get("prng_impls") or {})
        state = {k: from_data(v, impls.get(k)) for k, v in arrays.items()}
        leaves = [str(k) for k in p["leaves"]]
        return Saved(d, 2, int(index["step"]), meta, params, leaves, p["structure"], state)
    except (KeyError, TypeError, ValueError) as e:
        raise VjpsplitError(f"{d}: {INDEX} lacks or garbles {one_line(e)}; the checkpoint is damaged") from e


def _read(d: str, name: str, keys: Sequence[str]) -> dict[str, np.ndarray]:
    arrays, _ = load_arrays(os.path.join(d, name))
    if sorted(arrays) != sorted(keys):
        raise VjpsplitError(f"{d}/{name}: holds other arrays than its index lists; the checkpoint is damaged")
    return {k: arrays[k] for k in keys}


def _read_stages(d: str, entries: Sequence[Mapping[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Layout 1: per stage, its ``(params, optimizer state)``."""
    snapshots = []
    for i, entry in enumerate(entries):
        name = str(entry["file"])
        if os.path.basename(name) != name or not name.endswith(".npz"):
            raise VjpsplitError(f"{d}: stage {i}'s file {name!r} is not a file name in the checkpoint")
        arrays = _read(d, name, [f"params/{k}" for k in entry["params"]] + [f"state/{k}" for k in entry["state"]])
        impls = entry.get("prng_impls") or {}
        params = {k: arrays[f"params/{k}"] for k in entry["params"]}
        state = {k: from_data(arrays[f"state/{k}"], impls.get(k)) for k in entry["state"]}
        snapshots.append((params, state))
    return snapshots
