"""Training checkpoints: each stage's parameters and optimizer state and the step count, as one directory.

Layout of ``DIR``::

    checkpoint.json     format, step count, per stage: its file, parameter and state keys, optimizer name
    stage-0.npz ...     per stage: ``params/<key>`` and ``state/<key>`` arrays (keys as the stage names them)

The arrays go through the project's array-file writer (``save_arrays``): no
pickle, every dtype exact (bfloat16 included), a CRC-32 per array checked on
load; typed PRNG keys in optimizer state are stored as key data with their impl
recorded. The directory is written all-or-nothing: every file is written and
flushed into a fresh temp directory beside ``DIR``, which is then swapped into
place in one rename (``renameat2(RENAME_EXCHANGE)`` where ``DIR`` exists, the
old copy then removed); a crash or signal at any point leaves the previous
checkpoint, or none, never a mix. An existing ``DIR`` that is not a checkpoint
is refused rather than replaced.

Why not orbax: a checkpoint here is a handful of flat, host-gathered arrays per
stage whose keys the ``Stages`` already name, read back by workers that may not
have orbax (or the user's code) installed; the project's writer already gives
atomic, checksummed, pickle-free files with every JAX dtype, so orbax would add a
dependency (and its tensorstore stack) for features (async multi-host sharded
writes, pytree restoration into user classes) that this layout does not use.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any, Mapping, Sequence

import numpy as np

from ...errors import VjpsplitError, one_line
from ...files import load_arrays, save_arrays
from ...files.prng import from_data, impl_name, is_key, to_data
from ...safeio.filesystem import fsync_dir, renameat2
from ...safeio.signals import cleanup_on_signals
from ...safeio.temps import writer_tag

KIND = "vjpsplit-trainer-checkpoint"
# 1 (2026-12-01): the first checkpoint. Its free-form ``meta`` holds the schedule, the optimizer's name and
#   ``params``' structure; from 2026-12-02 also ``microbatches``, ``clip_global_norm`` and, for the caller's
#   plans, ``plans`` (their CSV text), which ``Trainer.restore`` uses where they are not given. Older
#   checkpoints lack those and still load.
FORMAT = 1
INDEX = "checkpoint.json"


def _host(v: Any) -> np.ndarray:
    return np.asarray(to_data(v))


def _stage_file(path: str, params: Mapping[str, Any], state: Mapping[str, Any]) -> dict[str, Any]:
    arrays = {f"params/{k}": _host(v) for k, v in params.items()}
    arrays.update({f"state/{k}": _host(v) for k, v in state.items()})
    save_arrays(path, arrays, fsync=True)
    impls = {k: impl_name(v) for k, v in state.items() if is_key(v)}
    return {"params": list(params), "state": list(state), "prng_impls": impls}


def save_checkpoint(
    directory: str | os.PathLike,
    snapshots: Sequence[tuple[Mapping[str, Any], Mapping[str, Any]]],
    step: int,
    meta: Mapping | None = None,
) -> None:
    """Write ``snapshots`` (per stage: ``(params, optimizer state)``, flat ``{key: array}``) and ``step`` to ``directory``.

    All-or-nothing: the directory is replaced in one rename (see the module docstring).
    ``meta`` is a small JSON-able dict kept in the index (optimizer names, schedule).
    """
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
            entries = []
            for i, (params, state) in enumerate(snapshots):
                name = f"stage-{i}.npz"
                entries.append({"file": name, **_stage_file(os.path.join(tmp, name), params, state)})
            index = {"kind": KIND, "format": FORMAT, "step": int(step), "stages": entries, "meta": dict(meta or {})}
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


def load_checkpoint(directory: str | os.PathLike) -> tuple[list[tuple[dict, dict]], int, dict]:
    """``(snapshots, step, meta)`` as ``save_checkpoint`` wrote them; each array checked against its CRC-32."""
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
    if index.get("format") != FORMAT:
        raise VjpsplitError(f"{d}: checkpoint format {index.get('format')!r}; this vjpsplit reads {FORMAT}")
    snapshots = []
    for i, entry in enumerate(index["stages"]):
        name = str(entry["file"])
        if os.path.basename(name) != name or not name.endswith(".npz"):
            raise VjpsplitError(f"{d}: stage {i}'s file {name!r} is not a file name in the checkpoint")
        arrays, _ = load_arrays(os.path.join(d, name))
        want = [f"params/{k}" for k in entry["params"]] + [f"state/{k}" for k in entry["state"]]
        if sorted(arrays) != sorted(want):
            raise VjpsplitError(f"{d}/{name}: holds other arrays than its index lists; the checkpoint is damaged")
        impls = entry.get("prng_impls") or {}
        params = {k: arrays[f"params/{k}"] for k in entry["params"]}
        state = {k: from_data(arrays[f"state/{k}"], impls.get(k)) for k in entry["state"]}
        snapshots.append((params, state))
    return snapshots, int(index["step"]), dict(index.get("meta") or {})
