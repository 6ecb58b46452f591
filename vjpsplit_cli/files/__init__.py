"""Array files: a flat ``{key: ndarray}`` mapping plus a small JSON-able metadata dict.

The extension picks the format: ``.npz`` (:mod:`.npz`, numpy's zip of ``.npy``
members) or ``.msgpack`` (:mod:`.msgpack`, flax's ndarray layout). Either file holds
exactly the caller's arrays: ``np.load(f).files`` lists only their keys, and the
metadata (dtype names numpy lacks, ``meta``, checksums) sits where numpy does not look.

Safety: nothing is unpickled or evaluated; every dtype is checked against an
allow-list and every recorded size against the file's before memory is allocated;
bool arrays must hold 0 or 1; a pipe is read up to a bound, a device refused. Every
refusal is one :class:`VjpsplitError` line naming the file (and the key).

Speed and integrity: every array is written from its own buffer and read straight
into a fresh one (one copy each way). Writes go to a temp file renamed into place
(atomic); they are flushed to disk (fsync) only when asked, because residuals and
the like are transient and a torn file after a power loss fails its checksums.
Every array has a CRC-32 (zip's own for ``.npz``; a table beside the arrays for
``.msgpack``), checked on load unless ``verify=False``, computed by :mod:`..checksum`
(zlib-ng at ~40 GB/s where installed, zlib otherwise; the same bytes either way). (Computing CRCs on a second
thread, overlapping the I/O, was tried: on 2 shared cores it was slower, 97 vs 70 ms
to load the 44 MiB benchmark set, so it was dropped.)
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

import numpy as np
from numpy.typing import ArrayLike

from ..errors import VjpsplitError, one_line
from ..safeio.outputs import atomic_write
from . import msgpack as _msgpack
from . import npz as _npz
from . import npzwrite as _npzwrite
from .common import DECODE_ERRORS, checked_meta, open_source, prepare

__all__ = ["save_arrays", "load_arrays"]

_ZIP_MAGICS = (b"PK\x03\x04", b"PK\x05\x06")


def _kind(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix in (".npz", ".msgpack"):
        return suffix[1:]
    what = f"extension {path.suffix!r}" if path.suffix else "no extension"
    raise VjpsplitError(f"{path}: unknown array file format ({what}); use a .npz or .msgpack file name")


def save_arrays(
    path: str | os.PathLike,
    arrays: Mapping[str, ArrayLike],
    meta: Mapping[str, Any] | None = None,
    *,
    fsync: bool = False,
) -> None:
    """Write ``arrays`` (key -> numpy/jax array or scalar) and JSON-able ``meta`` to ``path``.

    Everything is validated before the file is touched, and the write is atomic (temp
    file, then rename): on any failure the previous file (or none) stays. ``fsync=True``
    (or ``VJPSPLIT_FSYNC=1`` in the environment) also flushes it to disk first, so it
    survives a power loss. Arrays are stored little-endian in C order.

    Args:
        path: The file to write; ``.npz`` or ``.msgpack`` by its extension.
        arrays: The arrays (numpy or jax arrays, or scalars), by key.
        meta: JSON-able metadata stored with them; ``None`` stores none.
        fsync: Whether to flush the file to disk before returning.

    Raises:
        VjpsplitError: If the extension is neither, ``meta`` is not JSON-able, an array
            or key cannot be stored (its dtype, or the format's size limits), naming it,
            or the file cannot be written.
    """
    path = Path(path)
    kind = _kind(path)
    meta = checked_meta(path, meta)
    prepared = prepare(path, arrays, None if kind == "npz" else _msgpack.MAX_BYTES)
    write = (_npzwrite if kind == "npz" else _msgpack).writer(path, prepared, meta)
    # About the file's size (headers are short), so a big file's blocks are reserved at once.
    size = sum(arr.nbytes + 256 + 2 * len(key) for key, _, arr in prepared)
    atomic_write(path, write, fsync=fsync, size=size)  # atomic_write also reads VJPSPLIT_FSYNC


def load_arrays(path: str | os.PathLike, *, verify: bool = True) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Read an array file; return ``(arrays, meta)`` (``meta == {}`` when the file has none).

    Arrays come back in file order, writable, each in its own memory, native byte
    order. ``verify`` (default on) checks every array's CRC-32 where the file has one.
    Files of the older layout (a ``__vjpsplit__`` member) load too. A ``.npz`` written
    by plain numpy loads with ``meta == {}``; its bfloat16/float8/int4 arrays stay raw
    void (``|V2``/``|V1``), as nothing records their real dtype.

    Args:
        path: The array file; ``.npz`` or ``.msgpack`` by its extension.
        verify: Whether to check each array's CRC-32 where the file has one.

    Returns:
        The pair ``(arrays, meta)``: the numpy arrays by key, in file order, and the
        metadata (``{}`` when the file has none).

    Raises:
        VjpsplitError: If the extension is neither, the file cannot be read, is not
            of its extension's format, is truncated or corrupt, fails a CRC-32, or
            does not fit in memory.
    """
    path = Path(path)
    kind = _kind(path)
    src = open_source(path, verify)
    try:
        head = src.read(0, min(8, src.size))
        if kind == "npz" and head[:4] not in _ZIP_MAGICS:
            raise _not_npz(path, head)
        if kind == "msgpack" and head[:4] in _ZIP_MAGICS:
            raise VjpsplitError(f"{path}: is a zip (.npz) archive, not msgpack; rename it to .npz")
        return (_npz if kind == "npz" else _msgpack).read(src)
    except VjpsplitError:
        raise
    except MemoryError as e:
        raise VjpsplitError(f"{path}: not enough memory to load the arrays; free memory or load a smaller file") from e
    except OSError as e:
        raise VjpsplitError(f"{path}: cannot read the arrays file ({e.strerror or one_line(e)})") from e
    except DECODE_ERRORS as e:
        raise VjpsplitError(
            f"{path}: cannot read it as {'an .npz archive' if kind == 'npz' else 'a msgpack arrays file'}"
            f" ({one_line(e)}); it is truncated or corrupt, re-create it"
        ) from e
    finally:
        src.f.close()


def _not_npz(path: Path, head: bytes) -> VjpsplitError:
    if head.startswith(b"\x93NUMPY"):
        return VjpsplitError(
            f"{path}: is a single-array .npy file, not an .npz archive; re-save the arrays with vjpsplit"
        )
    if head and _msgpack.is_map(head[0]):
        return VjpsplitError(f"{path}: looks like a msgpack file, not an .npz archive; rename it to .msgpack")
    return VjpsplitError(f"{path}: is not an .npz (zip) archive; it is corrupt or a different kind of file")
