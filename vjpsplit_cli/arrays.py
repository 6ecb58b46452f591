"""Array files: a flat ``{key: ndarray}`` mapping plus a small JSON-able metadata dict.

Two formats, picked by the file's extension:

``.npz``
    A zip of ``.npy`` members, one per key (``params/w`` -> ``params/w.npy``), as
    ``np.savez`` writes it, plus one member ``__vjpsplit__.npy``: a uint8 array of
    UTF-8 JSON ``{"format": "vjpsplit-arrays", "version": 1, "dtypes": {key: name},
    "meta": {...}}``. The recorded dtype names let bfloat16/float8/int4 arrays, which
    ``.npy`` can only describe as raw void (``|V2``, ``|V1``), come back typed.

``.msgpack``
    One map ``{"format": "vjpsplit-arrays", "version": 1, "meta": {...},
    "arrays": {key: ExtType(1, packb([shape, dtype_name, raw_bytes]))}}``, the
    ndarray ext layout of flax.serialization. Single arrays must be under 2 GiB.

Nothing is ever unpickled or evaluated, every dtype is checked against
``dtypes._ALLOWED`` and every size against the file's before memory is allocated,
and every failure is a one-line :class:`VjpsplitError` that names the file.

Speed. Saving streams each array from its own buffer to the file (no ``tobytes``
copy) and asks the kernel to start writing back every few MiB, so the closing
``fsync`` (kept: it is what makes the atomic rename crash safe) has little left to
wait for; ``.npz`` CRC-32s are computed while the disk works. Loading parses the zip
directory or the msgpack structure itself (same checks as before, nothing copied)
and then reads every array's bytes straight from the file into one fresh buffer:
one copy in all, no intermediate ``bytes``, peak memory about the size of the data,
and arrays 64-byte aligned, which jax can use without copying again. Stored
(uncompressed) ``.npz`` members are read this way; compressed ones (written by other
tools) go through numpy's reader. The files themselves are unchanged, byte for byte.

Integrity. ``save_arrays`` writes the CRC-32 of every ``.npz`` member (the zip
format requires it, and ``np.load`` checks it). ``load_arrays`` checks the CRC of
the small ``__vjpsplit__`` member always, but those of the arrays only with
``verify=True``: a CRC pass runs at ~2 GB/s, slower than reading the file from the
page cache, and would double the load time. What it would catch is bytes altered
after a complete write (storage or transfer corruption); truncated, torn or
half-written files cannot appear under the name (writes are fsynced, then renamed
into place), and truncation, bad offsets and sizes are caught by the structural
checks either way. ``.msgpack`` files carry no checksum at all.
"""

from __future__ import annotations

import io
import json
import math
import os
import re
import stat
import struct
import sys
import tokenize
import zipfile
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO, Mapping

import msgpack
import numpy as np
from numpy.typing import ArrayLike

from ._io import atomic_write, open_for_read, read_at, readinto_at, start_writeback
from .dtypes import dtype_from_name, dtype_name
from .errors import VjpsplitError

__all__ = ["save_arrays", "load_arrays"]

FORMAT = "vjpsplit-arrays"
VERSION = 1
META_KEY = "__vjpsplit__"
_EXT_NDARRAY = 1  # the ext code flax uses for ndarrays; keeps the files readable by flax tooling
# msgpack's bin/ext lengths are 32-bit and many readers treat them as signed.
# Module-level so tests can lower it instead of allocating 2 GiB.
_MSGPACK_MAX_BYTES = 2**31 - 1
_MAX_NDIM = 64  # numpy's NPY_MAXDIMS
_MAX_META_DEPTH = 100  # deeper nesting is a mistake (or a cycle), not metadata
# Deflate cannot shrink data more than ~1032:1, so a member claiming more is forged;
# refusing it stops a tiny file from making numpy allocate a huge buffer.
_MAX_COMPRESSION_RATIO = 1100
_ZIP_MAGICS = (b"PK\x03\x04", b"PK\x05\x06")
_NPY_MAGIC = b"\x93NUMPY"
# Fixed so that saving the same arrays twice gives byte-identical files (hashable, cacheable).
_ZIP_DATE = (1980, 1, 1, 0, 0, 0)
_ALIGN = 64  # loaded arrays start on this boundary (what jax needs to use memory without copying)
_WRITEBACK_EVERY = 4 * 2**20  # bytes written between writeback hints
_PARALLEL_CRC_MIN = 8 * 2**20  # less data than this: CRC-32s inline, threads cost more than they save

# Everything a corrupt or foreign file can make the decoders raise. MemoryError is
# deliberately absent: sizes are validated first, so one left is a real shortage.
_DECODE_ERRORS = (
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
    struct.error,
    zlib.error,
    NotImplementedError,
    RuntimeError,  # includes RecursionError from absurdly nested input
    SyntaxError,  # a mangled .npy header, from numpy's header parser
    tokenize.TokenError,  # likewise (numpy re-tokenizes headers it cannot parse)
)


# ---------------------------------------------------------------------------- public API


def save_arrays(path: str | os.PathLike, arrays: Mapping[str, ArrayLike], meta: Mapping | None = None) -> None:
    """Write ``arrays`` (key -> numpy/jax array or scalar) and JSON-able ``meta`` to ``path``.

    The extension picks the format (``.npz`` or ``.msgpack``). Everything is validated
    before the file is touched, and the write is atomic: on any failure the previous
    file (or no file) is left in place. Big-endian and non-contiguous inputs are
    stored as native little-endian C-order data of the same dtype.
    """
    path = Path(path)
    kind = _kind(path)
    meta = _checked_meta(path, meta)
    prepared = _prepare(path, arrays, kind)
    if kind == "npz":
        atomic_write(path, lambda f: _write_npz(f, prepared, meta))
    else:
        atomic_write(path, lambda f: _write_msgpack(f, prepared, meta))


def load_arrays(path: str | os.PathLike, *, verify: bool = False) -> tuple[dict[str, np.ndarray], dict]:
    """Read an array file written by :func:`save_arrays`; return ``(arrays, meta)``.

    ``meta`` is ``{}`` when the file stores none. Arrays come back in file order with
    their stored dtype and shape. They are views into one buffer read from the file
    (nothing keeps the file open or mapped): it is freed when the last of them is, so
    ``.copy()`` one you keep long after dropping the rest. Arrays of 64 bytes or more
    start on a 64-byte boundary. Arrays from an ``.npz`` file are writable (each has
    its own bytes in the buffer); arrays from a ``.msgpack`` file are read-only (copy
    one before writing into it). ``verify=True`` also checks every ``.npz`` member's
    CRC-32: about as costly again as the read itself, so it is off by default (see
    the module docstring); ``.msgpack`` files have no checksum to check. A ``.npz``
    written by plain numpy also loads, with ``meta == {}``; bfloat16/float8/int4
    arrays in such a file stay raw void (``|V2``/``|V1``) because nothing records
    their real dtype.
    """
    path = Path(path)
    if _kind(path) == "npz":
        return _load_npz(path, verify)
    return _load_msgpack(path)


# ---------------------------------------------------------------------------- shared checks


def _kind(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix == ".npz":
        return "npz"
    if suffix == ".msgpack":
        return "msgpack"
    what = f"extension {path.suffix!r}" if path.suffix else "no extension"
    raise VjpsplitError(f"{path}: unknown array file format ({what}); use a .npz or .msgpack file name")


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= 200 else text[:197] + "..."


def _key_problem(key: Any) -> str | None:
    if not isinstance(key, str):
        return f"array key {key!r} is not a string"
    if not key:
        return "an array key is empty"
    if key.startswith("/") or key.endswith("/") or "//" in key:
        return f"array key {key!r} has an empty path segment (a leading, trailing or doubled '/')"
    if key == META_KEY:
        return f"array key {key!r} is reserved for vjpsplit's own metadata"
    if "\x00" in key:
        # zip truncates member names at NUL, so such a key would not round-trip.
        return f"array key {key!r} contains a NUL character"
    try:
        key.encode("utf-8")
    except UnicodeEncodeError:
        return f"array key {key!r} is not valid Unicode (lone surrogate)"
    return None


def _check_stored_key(path: Path, key: Any) -> None:
    problem = _key_problem(key)
    if problem is not None:
        raise VjpsplitError(f"{path}: {problem}; the file is corrupt or was not written by vjpsplit")


def _check_version(path: Path, version: Any) -> None:
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise VjpsplitError(f"{path}: invalid format version {version!r}; the file is corrupt, re-create it")
    if version != VERSION:
        raise VjpsplitError(
            f"{path}: file format version {version} is not supported (this vjpsplit reads version {VERSION});"
            " upgrade vjpsplit"
        )


class _MetaError(Exception):
    pass


def _unique_map(pairs: list[tuple[Any, Any]]) -> dict:
    # JSON and msgpack both allow repeated map keys, silently keeping the last;
    # in an array file that would hide an array or a dtype, so refuse it.
    out = dict(pairs)
    if len(out) != len(pairs):
        seen = set()
        for k, _ in pairs:
            if k in seen:
                raise ValueError(f"map key {k!r} appears twice")
            seen.add(k)
    return out


def _plain(value: Any, where: str, depth: int = 0) -> Any:
    """A plain-python copy of a JSON-able value, so JSON and msgpack store exactly the same thing."""
    if depth > _MAX_META_DEPTH:
        raise _MetaError(f"{where} is nested more than {_MAX_META_DEPTH} levels deep (or is a cycle)")
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        # msgpack ints are 64-bit; keep both formats to the same range.
        if not -(2**63) <= value < 2**64:
            raise _MetaError(f"{where} is the integer {value}, outside the 64-bit range")
        return int(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise _MetaError(f"{where} is {value!r}, which JSON cannot hold (store it as a string or None)")
        return float(value)
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise _MetaError(f"{where} is a string that is not valid Unicode (lone surrogate)") from e
        return str(value)
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise _MetaError(f"{where} has the non-string key {k!r}")
            out[str(_plain(k, f"{where} key", depth + 1))] = _plain(v, f"{where}[{k!r}]", depth + 1)
        return out
    if isinstance(value, (list, tuple)):
        return [_plain(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value)]
    kind = "msgpack ext value" if isinstance(value, _Ext) else type(value).__name__
    raise _MetaError(f"{where} is a {kind}, which is not JSON-able")


def _checked_meta(path: Path, meta: Mapping | None) -> dict:
    if meta is None:
        return {}
    if not isinstance(meta, Mapping):
        raise VjpsplitError(f"{path}: meta must be a dict, got {type(meta).__name__}; pass a dict or None")
    try:
        return _plain(meta, "meta")
    except _MetaError as e:
        raise VjpsplitError(
            f"{path}: {e}; meta may hold only dicts with string keys, lists, str, int, float, bool and None"
        ) from e


def _stored_meta(path: Path, meta: Any) -> dict:
    if not isinstance(meta, dict):
        raise VjpsplitError(f"{path}: stored metadata is a {type(meta).__name__}, not a map; the file is corrupt")
    try:
        return _plain(meta, "stored meta")
    except _MetaError as e:
        raise VjpsplitError(f"{path}: {e}; the file is corrupt or was not written by vjpsplit") from e


def _storage_dtype(name: str) -> np.dtype:
    # Files are little-endian whatever the machine. On little-endian machines keep the
    # plain native dtype, so loaded arrays show float32 rather than '<f4'.
    dtype = dtype_from_name(name)
    return dtype if sys.byteorder == "little" else dtype.newbyteorder("<")


def _native(arr: np.ndarray) -> np.ndarray:
    if arr.dtype.isnative:
        return arr
    return arr.astype(arr.dtype.newbyteorder("="))


def _prepare(path: Path, arrays: Mapping[str, ArrayLike], kind: str) -> list[tuple[str, str, np.ndarray]]:
    """Validate and convert every array up front, so a bad one fails before any file is created."""
    if not isinstance(arrays, Mapping):
        raise VjpsplitError(
            f"{path}: arrays must be a dict of string keys to arrays, got {type(arrays).__name__}; pass a dict"
        )
    prepared = []
    for key, value in arrays.items():
        problem = _key_problem(key)
        if problem is not None:
            raise VjpsplitError(f"{path}: {problem}; use non-empty '/'-separated keys like 'params/layers/0/w'")
        try:
            arr = np.asarray(value)
        except (TypeError, ValueError, OverflowError) as e:
            raise VjpsplitError(
                f"{path}: array {key!r} cannot be converted to a numpy array ({_one_line(e)}); pass a numeric array"
            ) from e
        try:
            name = dtype_name(arr.dtype)
        except VjpsplitError as e:
            raise VjpsplitError(
                f"{path}: array {key!r} has dtype {arr.dtype}, which cannot be stored;"
                " convert it to a numeric or bool dtype"
            ) from e
        target = _storage_dtype(name)
        if arr.dtype != target or not arr.flags.c_contiguous:
            # astype keeps 0-d arrays 0-d (np.ascontiguousarray would make them shape (1,)).
            arr = arr.astype(target, order="C")
        if kind == "msgpack" and arr.nbytes > _MSGPACK_MAX_BYTES:
            raise VjpsplitError(
                f"{path}: array {key!r} is {arr.nbytes} bytes, over the msgpack limit of {_MSGPACK_MAX_BYTES};"
                " use a .npz file for arrays of 2 GiB or more"
            )
        prepared.append((key, name, arr))
    return prepared


def _byte_view(arr: np.ndarray) -> memoryview:
    # A flat uint8 view of a C-contiguous array: no copy, and memoryview cannot
    # export ml_dtypes dtypes directly. reshape(-1) also handles 0-d arrays.
    return memoryview(arr.reshape(-1).view(np.uint8))


# ---------------------------------------------------------------------------- reading


class _Source:
    """Reads one open file by absolute offset (positioned reads; the file position is not used).

    Small pieces (zip and msgpack headers, metadata) come through a cached window;
    array data is read straight from the file into the arrays' buffer, so each byte
    is copied once. A pipe or device, which has neither a size nor positioned reads,
    is read whole first.
    """

    _WINDOW = 64 * 1024

    def __init__(self, f: BinaryIO, size: int, data: bytes | None = None):
        self.f, self.size = f, size
        self._start, self._buf = 0, data if data is not None else b""
        self._whole = data is not None

    @classmethod
    def open(cls, f: BinaryIO) -> "_Source":
        st = os.fstat(f.fileno())
        if stat.S_ISREG(st.st_mode):
            return cls(f, st.st_size)
        data = f.read()  # a pipe or device: no size and no positioned reads, so take it whole
        return cls(f, len(data), data)

    def read(self, pos: int, n: int) -> bytes:
        """Exactly ``n`` bytes from ``pos``; EOFError if the file is shorter."""
        if pos < 0 or n < 0 or pos + n > self.size:
            raise EOFError(f"unexpected end of file ({n} bytes at offset {pos}; the file has {self.size})")
        off = pos - self._start
        if 0 <= off and off + n <= len(self._buf):
            return self._buf[off : off + n]
        data = read_at(self.f, pos, min(max(n, self._WINDOW), self.size - pos))
        if len(data) < n:
            raise EOFError(f"the file shrank while it was being read (offset {pos})")
        self._start, self._buf = pos, data
        return data[:n] if len(data) > n else data

    def seekable(self) -> BinaryIO:
        """The file itself, or (for a pipe) its bytes as a file, at offset 0, for zipfile and numpy."""
        if self._whole:
            return io.BytesIO(self._buf)
        self.f.seek(0)
        return self.f

    def byte(self, pos: int) -> int:
        off = pos - self._start
        if 0 <= off < len(self._buf):
            return self._buf[off]
        return self.read(pos, 1)[0]

    def arrays(self, spans: list[tuple[int, int]]) -> list[np.ndarray]:
        """The ``(pos, nbytes)`` stretches of the file as uint8 arrays.

        All of them are carved out of one fresh buffer (about the size of the data):
        one big allocation gets transparent huge pages where the system has them,
        while faulting in 4 KiB pages one array at a time costs more than the read
        itself. The arrays share that buffer, which lives until the last of them is
        gone. Arrays of 64 bytes or more start on a 64-byte boundary, so jax can use
        their memory as is (it copies anything less aligned); smaller ones on 16.
        """
        for pos, nbytes in spans:
            if pos < 0 or nbytes < 0 or pos + nbytes > self.size:
                raise EOFError(f"unexpected end of file ({nbytes} bytes at offset {pos}; the file has {self.size})")
        raw = np.empty(sum(n + _slack(n) for _, n in spans) + _ALIGN, np.uint8)
        addr = raw.__array_interface__["data"][0]
        at = 0
        out = []
        for pos, nbytes in spans:
            align = _ALIGN if nbytes >= _ALIGN else 16
            start = at + (-(addr + at) % align)
            # For big reads, avoid a start 1..31 bytes (mod 4 KiB) after the data's file
            # offset: the kernel's copy runs ~4x slower at that distance (4K aliasing).
            if nbytes >= 4096 and 0 < (addr + start - pos) % 4096 < 32:
                start += _ALIGN
            buf = raw[start : start + nbytes]
            off = pos - self._start
            if 0 <= off and off + nbytes <= len(self._buf):
                buf[:] = np.frombuffer(self._buf, np.uint8, nbytes, off)
            elif readinto_at(self.f, buf, pos) != nbytes:
                raise EOFError(f"the file shrank while it was being read (offset {pos})")
            out.append(buf)
            at = start + nbytes
        return out


def _slack(nbytes: int) -> int:
    """Room ``_Source.arrays`` may need around an array of ``nbytes``: alignment, and the 4K-aliasing step."""
    return 2 * _ALIGN if nbytes >= 4096 else _ALIGN if nbytes >= _ALIGN else 16


def _from_bytes(buf: np.ndarray, shape: tuple, dtype: np.dtype, fortran: bool = False) -> np.ndarray:
    return np.ndarray(shape, dtype=dtype, buffer=buf, order="F" if fortran else "C")


# ---------------------------------------------------------------------------- npz


_LOCAL_HEADER = struct.Struct("<4s2B4HL2L2H")  # zip local file header, as zipfile spells it
_CENTRAL_HEADER = struct.Struct("<4s4B4HL2L5H2L")
_END_RECORD = struct.Struct("<4s4H2LH")
_END_RECORD64 = struct.Struct("<4sQ2H2L4Q")
_END_LOCATOR64 = struct.Struct("<4sLQL")
_ZIP64_EXTRA = struct.Struct("<HHQQ")
# The thresholds and fields zipfile uses, so files stay byte-identical to what
# zipfile.ZipFile(...).open(info, "w", force_zip64=True) wrote before.
_ZIP64_LIMIT = (1 << 31) - 1
_ZIP_FILECOUNT_LIMIT = (1 << 16) - 1
_ZIP64_VERSION = 45
_ZIP_UNIX = 3
_ZIP_UTF8_NAME = 0x800
_ZIP_ENCRYPTED = 0x1
_DOS_DATE = (_ZIP_DATE[0] - 1980) << 9 | _ZIP_DATE[1] << 5 | _ZIP_DATE[2]
_CRC_AT = 14  # offset of the CRC-32 field in a local header
_DOS_TIME = _ZIP_DATE[3] << 11 | _ZIP_DATE[4] << 5 | _ZIP_DATE[5] // 2
_NPY_HEADER_MAX = 12 + 10000  # magic, version, length field, and numpy's own header size limit


def _zip_name(name: str) -> tuple[bytes, int]:
    try:
        return name.encode("ascii"), 0
    except UnicodeEncodeError:
        return name.encode("utf-8"), _ZIP_UTF8_NAME


def _npy_header(arr: np.ndarray) -> bytes:
    out = io.BytesIO()
    d = np.lib.format.header_data_from_array_1_0(arr)
    try:
        np.lib.format.write_array_header_1_0(out, d)
    except ValueError:  # header over 64 KiB: cannot happen with <= 64 dims, but write_array would do this
        out = io.BytesIO()
        np.lib.format.write_array_header_2_0(out, d)
    return out.getvalue()


def _write_npz(f: BinaryIO, prepared: list[tuple[str, str, np.ndarray]], meta: dict) -> None:
    header = {"format": FORMAT, "version": VERSION, "dtypes": {k: n for k, n, _ in prepared}, "meta": meta}
    blob = json.dumps(header, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")
    # A stored zip of .npy members, as np.savez writes it, spelled out by hand (np.savez
    # takes keys as **kwargs, so "file" or "allow_pickle" would collide). The bytes are
    # exactly those zipfile writes with force_zip64=True, but each array goes from its
    # own buffer to the file (no tobytes copy), and the CRC-32s, the one costly part
    # (~2 GB/s), are computed while the disk writes the data back: on other cores where
    # there are any, else here, each array right after it is written. The local headers
    # get their CRC-32s patched in at the end.
    members = []
    for key, arr in [(META_KEY, np.frombuffer(blob, dtype=np.uint8))] + [(k, a) for k, _, a in prepared]:
        if arr.dtype.isbuiltin == 2:  # a user-defined (ml_dtypes) type
            # ml_dtypes types (bfloat16, float8, int4, ...) have no .npy spelling numpy can
            # read back (float8_e5m2 even writes an unloadable '<f1'), so store the raw
            # bytes as void; the dtype table in __vjpsplit__ restores the real type.
            arr = arr.view(np.dtype((np.void, arr.dtype.itemsize)))
        members.append((key, _npy_header(arr), _byte_view(arr)))
    background = _background_crc32s([(npy, data) for _, npy, data in members])
    crcs = []
    central = []
    offset = unsynced = 0
    for key, npy, data in members:
        size = len(npy) + data.nbytes
        name, flags = _zip_name(key + ".npy")
        f.write(
            _LOCAL_HEADER.pack(
                b"PK\x03\x04", _ZIP64_VERSION, 0, flags, zipfile.ZIP_STORED, _DOS_TIME, _DOS_DATE, 0,  # CRC: below
                0xFFFFFFFF, 0xFFFFFFFF, len(name), _ZIP64_EXTRA.size,
            )
            + name
            + _ZIP64_EXTRA.pack(1, _ZIP64_EXTRA.size - 4, size, size)
            + npy
        )
        f.write(data)
        central.append((name, flags, size, offset))
        offset += _LOCAL_HEADER.size + len(name) + _ZIP64_EXTRA.size + size
        unsynced += size
        if unsynced >= _WRITEBACK_EVERY:
            start_writeback(f)  # let the disk work while the rest is written
            unsynced = 0
        if background is None:
            crcs.append(_crc32(npy, data))
    if background is not None:
        crcs = [fut.result() for fut in background]
    for (_, _, _, header_offset), crc in zip(central, crcs):
        f.seek(header_offset + _CRC_AT)
        f.write(struct.pack("<L", crc))
    f.seek(offset)
    start_dir = offset
    for (name, flags, size, header_offset), crc in zip(central, crcs):
        extra = []
        if size > _ZIP64_LIMIT:
            extra += [size, size]
        if header_offset > _ZIP64_LIMIT:
            extra.append(header_offset)
        extra_data = struct.pack(f"<HH{len(extra)}Q", 1, 8 * len(extra), *extra) if extra else b""
        record = _CENTRAL_HEADER.pack(
            b"PK\x01\x02", _ZIP64_VERSION, _ZIP_UNIX, _ZIP64_VERSION, 0, flags, zipfile.ZIP_STORED,
            _DOS_TIME, _DOS_DATE, crc, 0xFFFFFFFF if size > _ZIP64_LIMIT else size,
            0xFFFFFFFF if size > _ZIP64_LIMIT else size, len(name), len(extra_data), 0, 0, 0, 0o644 << 16,
            0xFFFFFFFF if header_offset > _ZIP64_LIMIT else header_offset,
        )
        f.write(record + name + extra_data)
        offset += len(record) + len(name) + len(extra_data)
    count, dir_size = len(central), offset - start_dir
    if count > _ZIP_FILECOUNT_LIMIT or start_dir > _ZIP64_LIMIT or dir_size > _ZIP64_LIMIT:
        f.write(_END_RECORD64.pack(b"PK\x06\x06", 44, 45, 45, 0, 0, count, count, dir_size, start_dir))
        f.write(_END_LOCATOR64.pack(b"PK\x06\x07", 0, offset, 1))
        count, dir_size, start_dir = min(count, 0xFFFF), min(dir_size, 0xFFFFFFFF), min(start_dir, 0xFFFFFFFF)
    f.write(_END_RECORD.pack(b"PK\x05\x06", 0, 0, count, count, dir_size, start_dir, 0))


def _crc32(npy: bytes, data: memoryview) -> int:
    return zlib.crc32(data, zlib.crc32(npy))


def _background_crc32s(parts: list[tuple[bytes, memoryview]]) -> list[Future] | None:
    """With spare cores and enough data, start computing each ``header + data``'s CRC-32 in threads.

    zlib releases the GIL while it works, so they run while the caller writes. None
    where it would not pay (one core, or too little data for threads to be worth it).
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    if cores < 2 or sum(data.nbytes for _, data in parts) < _PARALLEL_CRC_MIN:
        return None
    pool = ThreadPoolExecutor(min(cores - 1, 4), thread_name_prefix="vjpsplit-crc")
    try:
        return [pool.submit(_crc32, npy, data) for npy, data in parts]
    finally:
        pool.shutdown(wait=False)  # the threads end once the queue is done


def _not_npz(path: Path, head: bytes) -> VjpsplitError:
    if head.startswith(_NPY_MAGIC):
        return VjpsplitError(
            f"{path}: is a single-array .npy file, not an .npz archive; re-save the arrays with vjpsplit"
        )
    if head and (0x80 <= head[0] <= 0x8F or head[0] in (0xDE, 0xDF)):
        return VjpsplitError(f"{path}: looks like a msgpack file, not an .npz archive; rename it to .msgpack")
    return VjpsplitError(f"{path}: is not an .npz (zip) archive; it is corrupt or a different kind of file")


def _open_source(path: Path, fh, n: int):
    """The file as a ``_Source`` and its first ``n`` bytes; an empty file is an error."""
    try:
        src = _Source.open(fh)
        head = src.read(0, min(n, src.size))
    except OSError as e:
        raise VjpsplitError(f"{path}: cannot read the arrays file ({e.strerror or e})") from e
    if not head:
        raise VjpsplitError(f"{path}: file is empty (0 bytes); it was never written completely, re-create it")
    return src, head


def _load_npz(path: Path, verify: bool) -> tuple[dict[str, np.ndarray], dict]:
    with open_for_read(path, "arrays") as fh:
        src, head = _open_source(path, fh, 8)
        if head[:4] not in _ZIP_MAGICS:
            raise _not_npz(path, head)
        try:
            with zipfile.ZipFile(src.seekable()) as zf:  # reads the central directory only
                infos = zf.infolist()
                if all(i.compress_type == zipfile.ZIP_STORED and not i.flag_bits & _ZIP_ENCRYPTED for i in infos):
                    return _read_stored_npz(path, src, zf, _npz_members(path, infos), verify)
            # Compressed (or otherwise unusual) members: numpy's reader, which inflates them.
            # The zip magic checked above is what makes np.load return an NpzFile.
            with np.load(src.seekable(), allow_pickle=False) as npz:
                members = _npz_members(path, npz.zip.infolist())
                headers = {key: _member_header(path, npz.zip, info, key, src.size) for key, info in members.items()}
                return _read_npz(path, members, headers, lambda keys: [npz[members[k].filename] for k in keys])
        except VjpsplitError:
            raise
        except _DECODE_ERRORS as e:
            raise VjpsplitError(
                f"{path}: cannot read it as an .npz archive ({_one_line(e)}); it is truncated or corrupt, re-create it"
            ) from e


def _npz_members(path: Path, infos: list[zipfile.ZipInfo]) -> dict[str, zipfile.ZipInfo]:
    members: dict[str, zipfile.ZipInfo] = {}
    for info in infos:
        if not info.filename.endswith(".npy"):
            raise VjpsplitError(
                f"{path}: entry {info.filename!r} is not a .npy array; the file is not an array archive"
            )
        key = info.filename[: -len(".npy")]
        if key in members:
            raise VjpsplitError(f"{path}: array {key!r} is stored twice; the file is corrupt, re-create it")
        members[key] = info
    return members


def _check_zip_sizes(path: Path, info: zipfile.ZipInfo, key: str, archive_size: int) -> None:
    corrupt = f"{path}: array {key!r} is corrupt"
    if info.compress_size > archive_size:
        raise VjpsplitError(f"{corrupt} (its zip entry is larger than the file); re-create the file")
    if info.compress_type == zipfile.ZIP_STORED:
        if info.file_size != info.compress_size:
            raise VjpsplitError(f"{corrupt} (inconsistent zip entry sizes); re-create the file")
    elif info.file_size > info.compress_size * _MAX_COMPRESSION_RATIO + 1024:
        raise VjpsplitError(
            f"{corrupt} (its zip entry claims an implausible compression ratio); re-create the file"
        )


def _parse_npy_header(path: Path, info: zipfile.ZipInfo, key: str, member: BinaryIO) -> tuple[tuple, np.dtype, bool]:
    """Shape, dtype and order from a .npy header, read from ``member`` (positioned at its start)."""
    if member.read(len(_NPY_MAGIC)) != _NPY_MAGIC:
        raise VjpsplitError(f"{path}: entry {info.filename!r} is not a .npy array; the file is not an array archive")
    member.seek(0)
    version = np.lib.format.read_magic(member)
    if version == (1, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_1_0(member)
    elif version == (2, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_2_0(member)
    else:
        raise VjpsplitError(
            f"{path}: array {key!r} uses .npy format version {version}, which vjpsplit does not read;"
            " re-save it with numpy's default format"
        )
    _check_npy_dtype_ndim(path, key, shape, dtype)
    return shape, dtype, fortran


def _check_npy_dtype_ndim(path: Path, key: str, shape: tuple, dtype: np.dtype) -> None:
    if dtype.hasobject:
        raise VjpsplitError(
            f"{path}: array {key!r} holds pickled objects; vjpsplit never unpickles, so re-save it"
            " with a numeric or bool dtype"
        )
    if len(shape) > _MAX_NDIM:
        raise VjpsplitError(f"{path}: array {key!r} is corrupt (it has {len(shape)} dimensions); re-create the file")


# The .npy 1.0 header exactly as numpy writes it for a plain dtype, e.g.
# {'descr': '<f4', 'fortran_order': False, 'shape': (8, 128), } + space padding + newline.
# Matching it directly skips numpy's parser (ast + compile, ~0.1 ms a member); any
# other header goes to numpy's, which reaches the same result for these.
_NPY_V1_HEADER = re.compile(
    rb"\{'descr': '([<>|=]?[A-Za-z]\d*)', 'fortran_order': (True|False), 'shape': \(((?:\d+, )*\d+,?|)\), \} *\n"
)


def _fast_npy_header(prefix: bytes) -> tuple[tuple, bool, np.dtype, int] | None:
    """Shape, order, dtype and header length of a plain numpy-written .npy 1.0 header; None for anything else."""
    if len(prefix) < 10 or prefix[:8] != _NPY_MAGIC + b"\x01\x00":
        return None
    end = 10 + int.from_bytes(prefix[8:10], "little")
    m = _NPY_V1_HEADER.fullmatch(prefix, 10, end) if end <= len(prefix) else None
    if m is None:
        return None
    descr, fortran, dims = m.groups()
    shape = tuple(int(d) for d in dims.split(b",") if d.strip())
    return shape, fortran == b"True", np.dtype(descr.decode("ascii")), end


def _check_npy_size(path: Path, info: zipfile.ZipInfo, key: str, shape: tuple, dtype: np.dtype, data_start: int):
    if data_start + math.prod(shape) * dtype.itemsize != info.file_size:
        raise VjpsplitError(
            f"{path}: array {key!r} is corrupt (its size does not match its shape {shape}); re-create the file"
        )


def _member_header(path: Path, zf: zipfile.ZipFile, info: zipfile.ZipInfo, key: str, archive_size: int):
    """Shape and dtype of one (compressed) member, checked against the archive's sizes before numpy allocates."""
    _check_zip_sizes(path, info, key, archive_size)
    with zf.open(info) as member:
        shape, dtype, _fortran = _parse_npy_header(path, info, key, member)
        data_start = member.tell()
    _check_npy_size(path, info, key, shape, dtype, data_start)
    return shape, dtype


class _Stored:
    """Where one stored member's array data lies in the file, and what it is."""

    __slots__ = ("shape", "dtype", "fortran", "pos", "nbytes", "npy_header", "crc", "end")

    def __init__(self, shape, dtype, fortran, pos, nbytes, npy_header, crc, end):
        self.shape, self.dtype, self.fortran, self.pos, self.nbytes = shape, dtype, fortran, pos, nbytes
        self.npy_header, self.crc, self.end = npy_header, crc, end


def _stored_member(path: Path, src: _Source, info: zipfile.ZipInfo, key: str, limit: int) -> _Stored:
    """Locate one stored member by its local header and check it, all before anything is allocated."""
    _check_zip_sizes(path, info, key, src.size)
    (magic, _, _, _, _, _, _, _, _, _, name_len, extra_len) = _LOCAL_HEADER.unpack(
        src.read(info.header_offset, _LOCAL_HEADER.size)
    )
    if magic != b"PK\x03\x04":
        raise zipfile.BadZipFile(f"bad magic number for the local header of {info.filename!r}")
    name = src.read(info.header_offset + _LOCAL_HEADER.size, name_len)
    want = info.orig_filename.encode("utf-8" if info.flag_bits & _ZIP_UTF8_NAME else "cp437")
    if name != want:
        raise zipfile.BadZipFile(f"file name in directory {info.orig_filename!r} and header {name!r} differ")
    start = info.header_offset + _LOCAL_HEADER.size + name_len + extra_len
    end = start + info.compress_size
    if end > limit:
        raise VjpsplitError(
            f"{path}: array {key!r} is corrupt (its data runs past the end of the archive); re-create the file"
        )
    prefix = src.read(start, min(info.file_size, 4096))
    if len(prefix) >= 12 and prefix[:6] == _NPY_MAGIC:
        # Make sure the whole header is in hand (it can be longer than 4 KiB, if rarely).
        width = 2 if prefix[6] == 1 else 4  # the header-length field: 2 bytes in .npy 1.0, 4 after
        hlen = 8 + width + int.from_bytes(prefix[8 : 8 + width], "little")
        if len(prefix) < hlen <= min(info.file_size, _NPY_HEADER_MAX):
            prefix = src.read(start, hlen)
    fast = _fast_npy_header(prefix)
    if fast is not None:
        shape, fortran, dtype, header_len = fast
        _check_npy_dtype_ndim(path, key, shape, dtype)
    else:
        member = io.BytesIO(prefix)
        shape, dtype, fortran = _parse_npy_header(path, info, key, member)
        header_len = member.tell()
    _check_npy_size(path, info, key, shape, dtype, header_len)
    return _Stored(shape, dtype, fortran, start + header_len, info.file_size - header_len,
                   prefix[:header_len], info.CRC, end)


def _read_stored_npz(path: Path, src: _Source, zf: zipfile.ZipFile, members: dict, verify: bool):
    # The central directory starts after the last member's data.
    limit = min(getattr(zf, "start_dir", src.size), src.size)
    stored = {key: _stored_member(path, src, info, key, limit) for key, info in members.items()}
    # Members must not overlap: one stretch of the file read as many arrays would let a
    # small file claim far more memory than it holds.
    order = sorted(members, key=lambda k: members[k].header_offset)
    for a, b in zip(order, order[1:]):
        if stored[a].end > members[b].header_offset:
            raise VjpsplitError(
                f"{path}: arrays {a!r} and {b!r} overlap in the archive; the file is corrupt, re-create it"
            )

    def read(keys: list[str]) -> list[np.ndarray]:
        out = []
        for key, buf in zip(keys, src.arrays([(stored[k].pos, stored[k].nbytes) for k in keys])):
            s = stored[key]
            if (verify or key == META_KEY) and zlib.crc32(buf, zlib.crc32(s.npy_header)) != s.crc:
                raise VjpsplitError(
                    f"{path}: array {key!r} fails its CRC-32 check (its bytes changed after it was written);"
                    " the file is corrupt, re-create it"
                )
            out.append(_from_bytes(buf, s.shape, s.dtype, s.fortran))
        return out

    headers = {key: (s.shape, s.dtype) for key, s in stored.items()}
    return _read_npz(path, members, headers, read)


def _is_raw_void(dtype: np.dtype) -> bool:
    return dtype.kind == "V" and dtype.fields is None and dtype.subdtype is None and type(dtype) is np.dtypes.VoidDType


def _read_npz(path: Path, members: dict, headers: dict, read) -> tuple[dict[str, np.ndarray], dict]:
    """Check an archive's members against its metadata, then read them: ``read(keys)`` -> arrays."""
    names: dict[str, str] | None = None
    meta: dict = {}
    members = dict(members)
    if META_KEY in members:
        shape, dtype = headers[META_KEY]
        if dtype != np.uint8 or len(shape) != 1:
            raise VjpsplitError(f"{path}: entry {META_KEY!r} is not vjpsplit metadata; the file is corrupt")
        del members[META_KEY]
        names, meta = _parse_npz_header(path, read([META_KEY])[0])
        missing = [k for k in names if k not in members]
        extra = [k for k in members if k not in names]
        if missing or extra:
            which = f"lists {missing[0]!r}, which the archive lacks" if missing else f"does not list {extra[0]!r}"
            raise VjpsplitError(f"{path}: the metadata {which}; the file is corrupt or was edited, re-create it")

    for key in members:
        _check_stored_key(path, key)
        shape, dtype = headers[key]
        if names is not None:
            want = _storage_dtype(names[key])
            if dtype != want and not (_is_raw_void(dtype) and dtype.itemsize == want.itemsize):
                raise VjpsplitError(
                    f"{path}: array {key!r} is stored as {dtype} but the metadata says {names[key]};"
                    " the file is corrupt, re-create it"
                )
        elif not _is_raw_void(dtype):
            try:
                dtype_name(dtype)
            except VjpsplitError as e:
                raise VjpsplitError(
                    f"{path}: array {key!r} has dtype {dtype}, which vjpsplit cannot use;"
                    " re-save it with a numeric or bool dtype"
                ) from e

    arrays: dict[str, np.ndarray] = {}
    for key, arr in zip(members, read(list(members))):
        if names is not None and arr.dtype != _storage_dtype(names[key]):
            arr = arr.view(_storage_dtype(names[key]))  # raw void -> bfloat16 etc.; itemsize checked above
        arrays[key] = _native(arr)
    return arrays, meta


def _parse_npz_header(path: Path, blob: np.ndarray) -> tuple[dict[str, str], dict]:
    try:
        header = json.loads(blob.tobytes().decode("utf-8"), object_pairs_hook=_unique_map)
    except (ValueError, RecursionError) as e:
        raise VjpsplitError(
            f"{path}: entry {META_KEY!r} is not valid JSON ({_one_line(e)}); the file is corrupt, re-create it"
        ) from e
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise VjpsplitError(f"{path}: entry {META_KEY!r} is not vjpsplit metadata; the file is corrupt, re-create it")
    _check_version(path, header.get("version"))
    names = header.get("dtypes")
    if not isinstance(names, dict) or not all(isinstance(v, str) for v in names.values()):
        raise VjpsplitError(f"{path}: the metadata's dtype table is malformed; the file is corrupt, re-create it")
    for key, name in names.items():
        try:
            dtype_from_name(name)
        except VjpsplitError as e:
            raise VjpsplitError(f"{path}: array {key!r} has unknown dtype {name!r} recorded; {e}") from e
    return names, _stored_meta(path, header.get("meta", {}))


# ---------------------------------------------------------------------------- msgpack


def _ext_header(code: int, size: int) -> bytes:
    # The same (shortest) encoding msgpack.packb(ExtType(...)) produces.
    fixed = {1: 0xD4, 2: 0xD5, 4: 0xD6, 8: 0xD7, 16: 0xD8}
    if size in fixed:
        return struct.pack(">Bb", fixed[size], code)
    if size < 2**8:
        return struct.pack(">BBb", 0xC7, size, code)
    if size < 2**16:
        return struct.pack(">BHb", 0xC8, size, code)
    return struct.pack(">BIb", 0xC9, size, code)


def _bin_header(size: int) -> bytes:
    if size < 2**8:
        return struct.pack(">BB", 0xC4, size)
    if size < 2**16:
        return struct.pack(">BH", 0xC5, size)
    return struct.pack(">BI", 0xC6, size)


def _write_msgpack(f: BinaryIO, prepared: list[tuple[str, str, np.ndarray]], meta: dict) -> None:
    # Streamed piece by piece rather than msgpack.packb of the whole tree, so each
    # array's bytes go from its own buffer straight to the file: no copy per array
    # and no second in-memory image of the file. The bytes are exactly packb's.
    packer = msgpack.Packer(use_bin_type=True)
    f.write(packer.pack_map_header(4))
    for k, v in (("format", FORMAT), ("version", VERSION), ("meta", meta)):
        f.write(packer.pack(k))
        f.write(packer.pack(v))
    f.write(packer.pack("arrays"))
    f.write(packer.pack_map_header(len(prepared)))
    unsynced = 0
    for key, name, arr in prepared:
        head = packer.pack_array_header(3) + packer.pack(list(arr.shape)) + packer.pack(name) + _bin_header(arr.nbytes)
        f.write(packer.pack(key) + _ext_header(_EXT_NDARRAY, len(head) + arr.nbytes) + head)
        f.write(_byte_view(arr))
        unsynced += arr.nbytes
        if unsynced >= _WRITEBACK_EVERY:
            start_writeback(f)  # let the disk work while the next arrays are written
            unsynced = 0


class _Ext:
    """An ext value decoded inside the unpacker, so its raw bytes are freed early; checked later, by key."""

    __slots__ = ("code", "payload", "problem")

    def __init__(self, code: int, payload: Any, problem: str | None):
        self.code, self.payload, self.problem = code, payload, problem


class _Span:
    """An array's raw bytes, left in the file: ``length`` bytes at offset ``pos``."""

    __slots__ = ("pos", "length")

    def __init__(self, pos: int, length: int):
        self.pos, self.length = pos, length

    def __len__(self) -> int:
        return self.length


def _unpack_ext(code: int, data: bytes) -> _Ext:
    # Must not raise: the unpacker does not know the key, and errors should name it.
    if code != _EXT_NDARRAY:
        return _Ext(code, None, None)
    n = len(data)
    try:
        payload = msgpack.unpackb(
            data, raw=False, strict_map_key=True, use_list=True, object_pairs_hook=_unique_map,
            max_str_len=n, max_bin_len=n, max_array_len=n, max_map_len=n // 2, max_ext_len=n,
        )
    except _DECODE_ERRORS as e:
        return _Ext(code, None, _one_line(e))
    return _Ext(code, payload, None)


def _ext_spec(path: Path, key: str, ext: Any) -> tuple[list, str, np.dtype, bytes | _Span]:
    """Check one encoded array; return its shape, dtype name, dtype and raw bytes (or where they lie)."""
    bad = f"{path}: array {key!r}"
    fix = "the file is corrupt, re-create it"
    if not isinstance(ext, _Ext):
        raise VjpsplitError(f"{bad} is a {type(ext).__name__}, not an encoded array; {fix}")
    if ext.code != _EXT_NDARRAY:
        raise VjpsplitError(f"{bad} has msgpack ext code {ext.code}, expected {_EXT_NDARRAY}; {fix}")
    if ext.problem is not None:
        raise VjpsplitError(f"{bad} cannot be decoded ({ext.problem}); {fix}")
    payload = ext.payload
    if not isinstance(payload, list) or len(payload) != 3:
        raise VjpsplitError(f"{bad} is not a [shape, dtype, bytes] triple; {fix}")
    shape, name, raw = payload
    if (
        not isinstance(shape, list)
        or len(shape) > _MAX_NDIM
        or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**63 for d in shape)
    ):
        raise VjpsplitError(f"{bad} has invalid shape {shape!r}; {fix}")
    if not isinstance(name, str):
        raise VjpsplitError(f"{bad} has invalid dtype name {name!r}; {fix}")
    try:
        dtype = _storage_dtype(name)
    except VjpsplitError as e:
        raise VjpsplitError(f"{bad} has dtype {name!r}, which vjpsplit cannot use; {fix}") from e
    if not isinstance(raw, (bytes, _Span)):
        raise VjpsplitError(f"{bad} has no raw byte string; {fix}")
    want = math.prod(shape) * dtype.itemsize
    if len(raw) != want:
        raise VjpsplitError(
            f"{bad} holds {len(raw)} bytes but shape {tuple(shape)} of {name} needs {want}; {fix}"
        )
    return shape, name, dtype, raw


def _ext_array(path: Path, key: str, spec: tuple, buf: np.ndarray) -> np.ndarray:
    shape, name, dtype, raw = spec
    try:
        arr = _from_bytes(buf, tuple(shape), dtype)
    except ValueError as e:
        raise VjpsplitError(
            f"{path}: array {key!r} has unusable shape {tuple(shape)} ({_one_line(e)});"
            " the file is corrupt, re-create it"
        ) from e
    arr = _native(arr)
    arr.flags.writeable = False
    return arr


# msgpack type bytes this reader walks itself; everything else goes to msgpack.
_MP_MAP16, _MP_MAP32 = 0xDE, 0xDF
_MP_FIXEXT = {0xD4: 1, 0xD5: 2, 0xD6: 4, 0xD7: 8, 0xD8: 16}
_MP_EXT = {0xC7: 1, 0xC8: 2, 0xC9: 4}  # ext 8/16/32: width of the length field
_MP_BIN = {0xC4: 1, 0xC5: 2, 0xC6: 4}


class _Reader:
    """The file as a stream for msgpack.Unpacker, over ``[pos, end)`` of a _Source."""

    def __init__(self, src: _Source, pos: int, end: int):
        self.src, self.pos, self.end = src, pos, end

    def read(self, n: int = -1) -> bytes:
        n = self.end - self.pos if n < 0 else min(n, self.end - self.pos)
        data = self.src.read(self.pos, n)
        self.pos += n
        return data


class _Msgpack:
    """Walks a msgpack arrays file without copying array data.

    The top-level map and the "arrays" map are walked here; every array's ext header
    and ``[shape, dtype, bin]`` triple is parsed in place and its bytes are left in the
    file (a _Span) to be read later straight into the array. Everything else (keys,
    meta, shapes, and any array not laid out exactly so) is decoded by msgpack itself,
    with the same options and file-size limits as decoding the whole file at once, so
    the result and the errors are those of msgpack.unpackb(data).
    """

    def __init__(self, src: _Source):
        self.src = src
        n = src.size
        self.opts = dict(
            raw=False, strict_map_key=True, use_list=True, ext_hook=_unpack_ext, object_pairs_hook=_unique_map,
            max_str_len=n, max_bin_len=n, max_array_len=n, max_map_len=n // 2, max_ext_len=n,
        )

    def top(self) -> Any:
        src = self.src
        count, pos = self._map_header(0)
        if count is None:
            value, pos = self._decode(0, src.size)
        else:
            pairs = []
            for _ in range(count):
                key, pos = self._key(pos, src.size)
                if key == "arrays" and self._map_header(pos)[0] is not None:
                    value, pos = self._arrays(pos)
                else:
                    value, pos = self._decode(pos, src.size)
                pairs.append((key, value))
            value = _unique_map(pairs)
        if pos != src.size:
            raise ValueError(f"{src.size - pos} bytes of extra data after the msgpack value")
        return value

    def _decode(self, pos: int, end: int) -> tuple[Any, int]:
        """Decode the one value at ``pos`` (which must end by ``end``) with msgpack; the value and where it ends."""
        if pos >= end:
            raise EOFError("msgpack data is truncated")
        room = end - pos
        unpacker = msgpack.Unpacker(
            _Reader(self.src, pos, end), read_size=min(4096, room), max_buffer_size=room, **self.opts
        )
        value = unpacker.unpack()
        return value, pos + unpacker.tell()

    def _key(self, pos: int, end: int) -> tuple[Any, int]:
        key, pos = self._decode(pos, end)
        if not isinstance(key, (str, bytes)):
            raise ValueError(f"{type(key).__name__} is not allowed for map key when strict_map_key=True")
        return key, pos

    def _map_header(self, pos: int) -> tuple[int | None, int]:
        b = self.src.byte(pos)
        if 0x80 <= b <= 0x8F:
            return b & 0x0F, pos + 1
        if b in (_MP_MAP16, _MP_MAP32):
            width = 2 if b == _MP_MAP16 else 4
            return int.from_bytes(self.src.read(pos + 1, width), "big"), pos + 1 + width
        return None, pos

    def _arrays(self, pos: int) -> tuple[dict, int]:
        count, pos = self._map_header(pos)
        pairs = []
        for _ in range(count):
            key, pos = self._key(pos, self.src.size)
            value, pos = self._array(pos)
            pairs.append((key, value))
        return _unique_map(pairs), pos

    def _array(self, pos: int) -> tuple[Any, int]:
        src = self.src
        b = src.byte(pos)
        if b in _MP_FIXEXT:
            length, start = _MP_FIXEXT[b], pos + 2
        elif b in _MP_EXT:
            width = _MP_EXT[b]
            length, start = int.from_bytes(src.read(pos + 1, width), "big"), pos + 2 + width
        else:
            return self._decode(pos, src.size)
        code = struct.unpack("b", src.read(start - 1, 1))[0]
        end = start + length
        if code != _EXT_NDARRAY or end > src.size:
            return self._decode(pos, src.size)
        payload = self._payload(start, end)
        if payload is None:  # not laid out as packb lays it out: let msgpack decode (and judge) it
            return _unpack_ext(code, src.read(start, length)), end
        return _Ext(code, payload, None), end

    def _payload(self, start: int, end: int) -> list | None:
        src = self.src
        try:
            if start >= end or src.byte(start) != 0x93:  # a fixarray of 3
                return None
            shape, pos = self._decode(start + 1, end)
            name, pos = self._decode(pos, end)
            width = _MP_BIN.get(src.byte(pos)) if pos < end else None
            if width is None:
                return None
            length = int.from_bytes(src.read(pos + 1, width), "big")
            data = pos + 1 + width
            if data + length != end:
                return None
        except _DECODE_ERRORS:
            return None
        return [shape, name, _Span(data, length)]


def _load_msgpack(path: Path) -> tuple[dict[str, np.ndarray], dict]:
    with open_for_read(path, "arrays") as fh:
        src, head = _open_source(path, fh, 4)
        if head in _ZIP_MAGICS:
            raise VjpsplitError(f"{path}: is a zip (.npz) archive, not msgpack; rename it to .npz")
        try:
            top = _Msgpack(src).top()
        except _DECODE_ERRORS as e:
            raise VjpsplitError(
                f"{path}: cannot read it as a msgpack arrays file ({_one_line(e)}); it is truncated or corrupt,"
                " re-create it"
            ) from e

        if not isinstance(top, dict) or top.get("format") != FORMAT:
            raise VjpsplitError(
                f"{path}: is not a vjpsplit arrays file (no format {FORMAT!r} at the top level); re-create it with vjpsplit"
            )
        _check_version(path, top.get("version"))
        meta = _stored_meta(path, top.get("meta", {}))
        stored = top.get("arrays")
        if not isinstance(stored, dict):
            raise VjpsplitError(f"{path}: has no 'arrays' map; the file is corrupt, re-create it")
        specs = {}
        for key, ext in stored.items():  # check every array before reading any
            _check_stored_key(path, key)
            specs[key] = _ext_spec(path, key, ext)
        try:
            bufs = iter(src.arrays([(raw.pos, raw.length) for *_, raw in specs.values() if isinstance(raw, _Span)]))
        except OSError as e:
            raise VjpsplitError(f"{path}: cannot read the arrays file ({e.strerror or e})") from e
        except EOFError as e:
            raise VjpsplitError(f"{path}: cannot read the arrays file ({_one_line(e)}); re-create it") from e
        arrays = {}
        for key, spec in specs.items():
            raw = spec[3]
            buf = next(bufs) if isinstance(raw, _Span) else np.frombuffer(raw, np.uint8)
            arrays[key] = _ext_array(path, key, spec, buf)
        return arrays, meta
