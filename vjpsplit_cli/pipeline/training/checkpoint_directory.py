"""Where a training checkpoint may be saved without loss, and what a save cut short left beside it.

``check_directory`` refuses a place no checkpoint can be saved to without loss (a
file, a parent that cannot be written, files no save wrote); ``tidy`` takes back a
checkpoint a dead writer's fallback swap left aside and sweeps dead writers' temp
directories (``safeio.temps``); ``owned`` says which file names a save writes and
``has_checkpoint`` whether a directory holds one.
"""

from __future__ import annotations

import os
import re

from ...errors import VjpsplitError, one_line
from ...safeio.filesystem import fsync_dir
from ...safeio.temps import clear_temp_dir, stale_temps
from .checkpoint_layout import INDEX


def has_checkpoint(directory: str | os.PathLike[str]) -> bool:
    """Whether ``directory`` holds a checkpoint's index (what ``fit`` begins from)."""
    return os.path.isfile(os.path.join(os.fspath(directory), INDEX))


def owned(name: str) -> bool:
    """Whether a file named ``name`` in a checkpoint directory is one a checkpoint save writes (any layout)."""
    return _OWNED.match(name) is not None


_OWNED = re.compile(r"(checkpoint\.json|params\.npz|opt_state\.npz|stage-\d+\.npz)\Z")


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
