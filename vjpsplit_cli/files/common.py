"""What both array file formats share: checks on keys, metadata and arrays, and chunked I/O."""

from __future__ import annotations

import errno
import io
import math
import os
import stat
import sys
import tokenize
import zipfile
import zlib
from concurrent.futures import Future
from itertools import accumulate
from pathlib import Path
from typing import Any, BinaryIO, Callable, Mapping, Sequence

import msgpack
import numpy as np
from numpy.typing import ArrayLike

from ..errors import VjpsplitError, one_line
from ..safeio import checksum, workers
from ..safeio.reading import open_for_read
from .buffers import ALIGN
from .dtypes import dtype_from_name, dtype_name

FORMAT = "vjpsplit-arrays"
# 2: metadata outside the member list (.npz archive comment; .msgpack map entry) and a
# CRC-32 per .msgpack array. 1: metadata in a "__vjpsplit__" member; still read.
VERSION = 2
OLD_META_KEY = "__vjpsplit__"
MAX_NDIM = 64  # numpy's NPY_MAXDIMS
MAX_STREAM_BYTES = 2**30  # a pipe is read whole, up to this; /dev/zero must not fill memory
CORRUPT = "the file is corrupt, re-create it"
_MAX_META_DEPTH = 100  # deeper nesting is a mistake (or a cycle), not metadata

# Everything a corrupt or foreign file can make zipfile, numpy's header reader or msgpack
# raise. MemoryError is absent on purpose: sizes are checked first, so one is real.
DECODE_ERRORS = (
    zipfile.BadZipFile,
    zipfile.LargeZipFile,
    msgpack.exceptions.UnpackException,
    ValueError,
    EOFError,
    OSError,
    KeyError,
    TypeError,
    IndexError,
    OverflowError,
    zlib.error,
    NotImplementedError,
    RuntimeError,
    SyntaxError,
    tokenize.TokenError,
)


def key_problem(key: Any) -> str | None:
    """Why ``key`` cannot name an array, or None."""
    if not isinstance(key, str):
        return f"array key {key!r} is not a string"
    if not key:
        return "an array key is empty"
    if key.startswith("/") or key.endswith("/") or "//" in key:
        return f"array key {key!r} has an empty path segment (a leading, trailing or doubled '/')"
    if key == OLD_META_KEY:
        return f"array key {key!r} is reserved for vjpsplit's own metadata"
    if "\x00" in key:  # zip cuts member names at NUL: the key would not round-trip
        return f"array key {key!r} contains a NUL character"
    try:
        key.encode("utf-8")
    except UnicodeEncodeError:
        return f"array key {key!r} is not valid Unicode (lone surrogate)"
    return None


def check_stored_key(path: Path, key: Any) -> None:
    """Refuse an array key read from ``path`` that cannot name an array (``key_problem``)."""
    problem = key_problem(key)
    if problem is not None:
        raise VjpsplitError(f"{path}: {problem}; the file is corrupt or was not written by vjpsplit")


def check_version(path: Path, version: Any) -> None:
    """Refuse a format version read from ``path`` that is not a positive int or is newer than this reader's."""
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise VjpsplitError(f"{path}: invalid format version {version!r}; {CORRUPT}")
    if version > VERSION:
        raise VjpsplitError(
            f"{path}: file format version {version} is not supported (this vjpsplit reads "
            f"versions 1 to {VERSION}); upgrade vjpsplit"
        )


def unique_map(pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
    """A dict from JSON or msgpack pairs; a repeated key (which would hide an array) is an error."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen = set()
        for k, _ in pairs:
            if k in seen:
                raise ValueError(f"map key {k!r} appears twice")
            seen.add(k)
    return out


class MetaError(Exception):
    """Metadata that JSON and msgpack cannot store alike: too deep or a cycle, an int past 64 bits, NaN or an
    infinity, a lone surrogate, a non-string key, a value of another type; the message names where."""


def plain(value: Any, where: str, depth: int = 0) -> Any:
    """A plain-Python copy of a JSON-able value, so JSON and msgpack store exactly the same thing."""
    if depth > _MAX_META_DEPTH:
        raise MetaError(f"{where} is nested more than {_MAX_META_DEPTH} levels deep (or is a cycle)")
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        if not -(2**63) <= value < 2**64:  # msgpack ints are 64-bit: keep both formats to that
            raise MetaError(f"{where} is the integer {value}, outside the 64-bit range")
        return int(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise MetaError(f"{where} is {value!r}, which JSON cannot hold (store it as a string or None)")
        return float(value)
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise MetaError(f"{where} is a string that is not valid Unicode (lone surrogate)") from e
        return str(value)
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise MetaError(f"{where} has the non-string key {k!r}")
            out[plain(k, f"{where} key", depth + 1)] = plain(v, f"{where}[{k!r}]", depth + 1)
        return out
    if isinstance(value, (list, tuple)):
        return [plain(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value)]
    raise MetaError(f"{where} is a {type(value).__name__}, which is not JSON-able")


def checked_meta(path: Path, meta: Mapping[str, Any] | None) -> dict[str, Any]:
    """The caller's metadata for a file about to be written to ``path``, as plain JSON-able Python, or an error."""
    if meta is None:
        return {}
    if not isinstance(meta, Mapping):
        raise VjpsplitError(f"{path}: meta must be a dict, got {type(meta).__name__}; pass a dict or None")
    try:
        return plain(meta, "meta")
    except MetaError as e:
        raise VjpsplitError(
            f"{path}: {e}; meta may hold only dicts with string keys, lists, str, int, float, bool and None"
        ) from e


def stored_meta(path: Path, meta: Any) -> dict[str, Any]:
    """The metadata read from ``path``, checked to be a map of plain JSON-able values."""
    if not isinstance(meta, dict):
        raise VjpsplitError(f"{path}: stored metadata is a {type(meta).__name__}, not a map; {CORRUPT}")
    try:
        return plain(meta, "stored meta")
    except MetaError as e:
        raise VjpsplitError(f"{path}: {e}; the file is corrupt or was not written by vjpsplit") from e


def storage_dtype(name: str) -> np.dtype:
    """The dtype named ``name`` as files store it: little-endian."""
    # Files are little-endian on every machine; keep plain native dtypes where that is the same.
    dtype = dtype_from_name(name)
    return dtype if sys.byteorder == "little" else dtype.newbyteorder("<")


# What ``prepare`` gives the writers: ``(key, dtype name, little-endian C-order array)`` per array.
Prepared = list[tuple[str, str, np.ndarray]]
# What a writer returns: ``write(f)``, which writes the whole file to ``f`` (``safeio.atomic_write``'s callback).
Write = Callable[[BinaryIO], None]


def prepare(path: Path, arrays: Mapping[str, ArrayLike], max_bytes: int | None = None) -> Prepared:
    """``(key, dtype name, little-endian C-order array)`` for each entry; any bad one fails before a file exists."""
    if not isinstance(arrays, Mapping):
        raise VjpsplitError(
            f"{path}: arrays must be a dict of string keys to arrays, got {type(arrays).__name__}; pass a dict"
        )
    prepared: Prepared = []
    for key, value in arrays.items():
        problem = key_problem(key)
        if problem is not None:
            raise VjpsplitError(f"{path}: {problem}; use non-empty '/'-separated keys like 'params/layers/0/w'")
        try:
            arr = np.asarray(value)
            name = dtype_name(arr.dtype)
        except (TypeError, ValueError, OverflowError) as e:
            what = f"has dtype {arr.dtype}" if isinstance(e, VjpsplitError) else f"cannot be converted ({one_line(e)})"
            raise VjpsplitError(
                f"{path}: array {key!r} {what}, which cannot be stored; pass a numeric or bool array"
            ) from e
        target = storage_dtype(name)
        if arr.dtype != target or not arr.flags.c_contiguous:
            arr = arr.astype(target, order="C")  # astype keeps 0-d arrays 0-d
        if max_bytes is not None and arr.nbytes > max_bytes:
            raise VjpsplitError(
                f"{path}: array {key!r} is {arr.nbytes} bytes, over the msgpack limit of "
                f"{max_bytes}; use a .npz file for arrays of 2 GiB or more"
            )
        prepared.append((key, name, arr))
    return prepared


def byte_view(arr: np.ndarray) -> memoryview:
    """The bytes of a C-contiguous array without a copy (memoryview cannot export ml_dtypes types)."""
    return memoryview(arr.reshape(-1).view(np.uint8))  # type: ignore[arg-type]  # numpy's stubs: no Buffer


def crc32s(groups: list[tuple[bytes | memoryview, ...]]) -> Future[list[int]]:
    """The CRC-32 of each group of buffers (as if concatenated), as a future of their list.

    On a big file they are computed on an I/O thread, so the caller can write the bytes
    meanwhile and read ``.result()`` after; on a small one the future is already done.
    Measured on the 41.5 MiB benchmark set: see docs/performance.md.
    """
    nbytes = sum(memoryview(b).nbytes for g in groups for b in g)
    if workers.parallel(nbytes):
        return workers.submit_all(_crc32s, [(groups,)])[0]
    done: Future[list[int]] = Future()
    done.set_result(_crc32s(groups))
    return done


def _crc32s(groups: list[tuple[bytes | memoryview, ...]]) -> list[int]:
    out: list[int] = []
    for group in groups:
        value = 0
        for b in group:
            value = checksum.crc32(b, value)
        out.append(value)
    return out


_IOV_MAX = 1024  # Linux's limit on the buffers of one writev(2)


def _fileno(f: BinaryIO) -> int | None:
    """``f``'s file descriptor; None for an in-memory stream."""
    try:
        return f.fileno()
    except (AttributeError, OSError, io.UnsupportedOperation):
        return None


def write_all(f: BinaryIO, parts: Sequence[bytes | memoryview]) -> None:
    """Write ``parts`` (bytes and memoryviews) in order: with few ``writev`` calls where ``f`` is a file."""
    fd = _fileno(f)
    if fd is None or not hasattr(os, "writev"):
        for part in parts:
            f.write(part)
        return
    f.flush()
    start = f.tell()
    views = [memoryview(p).cast("B") for p in parts]
    total, i = sum(len(v) for v in views), 0
    while i < len(views):
        done = os.writev(fd, views[i : i + _IOV_MAX])
        if not done:
            raise OSError(errno.EIO, "the file took no bytes")
        while i < len(views) and done >= len(views[i]):  # a short write ends inside a buffer: go on from there
            done -= len(views[i])
            i += 1
        if done:
            views[i] = views[i][done:]
    f.seek(start + total)  # the file object's position: writev moved only the descriptor's


class Source:
    """An open array file: its size, small reads, and arrays read straight into one fresh buffer."""

    def __init__(self, path: Path, f: BinaryIO, size: int, verify: bool):
        self.path, self.f, self.size, self.verify = path, f, size, verify

    def read(self, pos: int, n: int) -> bytes:
        """Exactly ``n`` bytes at ``pos``; EOFError past the end."""
        if pos < 0 or n < 0 or pos + n > self.size:
            raise EOFError(f"unexpected end of file ({n} bytes at offset {pos}; the file has {self.size})")
        self.f.seek(pos)
        data = self.f.read(n)
        if len(data) != n:
            raise EOFError(f"the file shrank while it was being read (offset {pos})")
        return data

    def start(self, sizes: list[int]) -> None:
        """Called once every array's size is known and checked, before any is read.

        All arrays are carved out of one fresh buffer: one big allocation gets huge
        pages where the system has them, while faulting in 4 KiB pages array by array
        costs more than the read itself (on the 44 MiB benchmark set, loading took
        45 ms with one buffer per array, 18 ms with one for all, as np.load of one
        buffer). Arrays start 64-byte aligned: jax uses such memory without a copy.
        """
        slots = [-(-n // ALIGN) * ALIGN for n in sizes]
        raw = np.empty(sum(slots) + ALIGN, np.uint8)
        skip = -raw.__array_interface__["data"][0] % ALIGN
        self.slots = iter([raw[skip + a : skip + a + n] for a, n in zip(accumulate([0] + slots[:-1]), sizes)])

    def fill(self, reads: list[tuple[str, np.ndarray, int, int | None, int]]) -> None:
        """Fill each ``(key, buf, pos, seed, crc)``'s buffer from ``len(buf)`` bytes at ``pos``.

        Where ``seed`` is not None, the CRC-32 of those bytes continued from ``seed``
        must be ``crc``; the first array in ``reads`` that fails is named. A big file's
        arrays are read and checked several at once (``workers``); each array is read
        by one thread, so its CRC-32 runs while its bytes are still in cache.
        """
        for _, buf, pos, _, _ in reads:
            if pos < 0 or pos + len(buf) > self.size:
                raise EOFError(f"unexpected end of file ({len(buf)} bytes at offset {pos}; the file has {self.size})")
        by_offset = _fileno(self.f) is not None and hasattr(os, "preadv")
        read = self._pread if by_offset else self._seek_read
        nbytes = sum(len(r[1]) for r in reads) if by_offset else 0  # a stream's position is shared: one thread
        ok = workers.run_all(lambda key, buf, pos, seed, crc: self._check(read(buf, pos), seed, crc), reads, nbytes)
        for (key, *_), good in zip(reads, ok):
            if not good:
                raise crc_mismatch(self.path, key)

    @staticmethod
    def _check(buf: np.ndarray, seed: int | None, crc: int) -> bool:
        return seed is None or checksum.crc32(buf, seed) == crc

    def _pread(self, buf: np.ndarray, pos: int) -> np.ndarray:
        view, done, fd = memoryview(buf), 0, self.f.fileno()  # type: ignore[arg-type]  # numpy's stubs: no Buffer
        while done < len(buf):  # one read(2) returns at most ~2 GiB
            got = os.preadv(fd, [view[done:]], pos + done)
            if not got:
                raise EOFError(f"the file shrank while it was being read (offset {pos + done})")
            done += got
        return buf

    def _seek_read(self, buf: np.ndarray, pos: int) -> np.ndarray:
        done = 0
        self.f.seek(pos)
        while done < len(buf):
            got = self.f.readinto(buf[done:])  # type: ignore[attr-defined]  # every file Source opens has it
            if not got:
                raise EOFError(f"the file shrank while it was being read (offset {pos + done})")
            done += got
        return buf


def open_source(path: Path, verify: bool) -> Source:
    """Open ``path`` for reading; a pipe is read whole (up to a bound), a device refused."""
    f = open_for_read(path, "arrays")
    try:
        mode = os.fstat(f.fileno()).st_mode
        if stat.S_ISREG(mode):
            size = os.fstat(f.fileno()).st_size
        elif stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):
            data = f.read(MAX_STREAM_BYTES + 1)
            if len(data) > MAX_STREAM_BYTES:
                raise VjpsplitError(
                    f"{path}: is a pipe that gave more than {MAX_STREAM_BYTES} bytes; "
                    "save the arrays to a regular file and pass that"
                )
            f.close()
            f, size = io.BytesIO(data), len(data)
        else:
            raise VjpsplitError(f"{path}: is not a regular file (a device?); pass an .npz or .msgpack file")
    except OSError as e:
        f.close()
        raise VjpsplitError(f"{path}: cannot read the arrays file ({e.strerror or e})") from e
    except BaseException:
        f.close()
        raise
    if size == 0:
        f.close()
        raise VjpsplitError(f"{path}: file is empty (0 bytes); it was never written completely, re-create it")
    return Source(path, f, size, verify)


def finish(
    path: Path, key: str, buf: np.ndarray, shape: tuple[int, ...], dtype: np.dtype, fortran: bool = False
) -> np.ndarray:
    """The array over ``buf``: bool bytes checked, native byte order."""
    if dtype == np.bool_ and buf.size and buf.max() > 1:
        raise VjpsplitError(
            f"{path}: array {key!r} is bool but holds bytes other than 0 and 1; re-save it from a real bool array"
        )
    try:
        arr = np.ndarray(shape, dtype=dtype, buffer=buf, order="F" if fortran else "C")
    except ValueError as e:  # e.g. a zero-size shape whose other dims overflow numpy's index type
        raise VjpsplitError(f"{path}: array {key!r} has unusable shape {shape} ({one_line(e)}); {CORRUPT}") from e
    return arr if arr.dtype.isnative else arr.astype(arr.dtype.newbyteorder("="))


def crc_mismatch(path: Path, key: str) -> VjpsplitError:
    return VjpsplitError(
        f"{path}: array {key!r} fails its CRC-32 check (its bytes changed after it was written); {CORRUPT}"
    )
