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
"""

from __future__ import annotations

import json
import math
import os
import struct
import sys
import zipfile
import zlib
from pathlib import Path
from typing import Any, BinaryIO, Mapping

import msgpack
import numpy as np
from numpy.typing import ArrayLike

from ._io import atomic_write, open_for_read, read_bytes
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
_CHUNK = 16 * 2**20

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


def load_arrays(path: str | os.PathLike) -> tuple[dict[str, np.ndarray], dict]:
    """Read an array file written by :func:`save_arrays`; return ``(arrays, meta)``.

    ``meta`` is ``{}`` when the file stores none. Arrays come back in file order with
    their stored dtype and shape. Arrays from a ``.msgpack`` file are read-only views
    of the file's bytes (copy one before writing into it). A ``.npz`` written by plain
    numpy also loads, with ``meta == {}``; bfloat16/float8/int4 arrays in such a file
    stay raw void (``|V2``/``|V1``) because nothing records their real dtype.
    """
    path = Path(path)
    if _kind(path) == "npz":
        return _load_npz(path)
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


# ---------------------------------------------------------------------------- npz


def _write_npz(f: BinaryIO, prepared: list[tuple[str, str, np.ndarray]], meta: dict) -> None:
    header = {"format": FORMAT, "version": VERSION, "dtypes": {k: n for k, n, _ in prepared}, "meta": meta}
    blob = json.dumps(header, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")
    # This is what np.savez does (a stored zip of write_array members), spelled out because
    # np.savez takes keys as **kwargs: keys named "file" or "allow_pickle" would collide.
    with zipfile.ZipFile(f, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
        _write_member(zf, META_KEY, np.frombuffer(blob, dtype=np.uint8))
        for key, _, arr in prepared:
            _write_member(zf, key, arr)


def _write_member(zf: zipfile.ZipFile, key: str, arr: np.ndarray) -> None:
    info = zipfile.ZipInfo(key + ".npy", date_time=_ZIP_DATE)
    info.compress_type = zipfile.ZIP_STORED
    info.external_attr = 0o644 << 16
    if arr.dtype.isbuiltin == 2:  # a user-defined (ml_dtypes) type
        # ml_dtypes types (bfloat16, float8, int4, ...) have no .npy spelling numpy can
        # read back (float8_e5m2 even writes an unloadable '<f1'), so store the raw
        # bytes as void; the dtype table in __vjpsplit__ restores the real type.
        arr = arr.view(np.dtype((np.void, arr.dtype.itemsize)))
    with zf.open(info, "w", force_zip64=True) as out:
        np.lib.format.write_array(out, arr, allow_pickle=False)


def _not_npz(path: Path, head: bytes) -> VjpsplitError:
    if head.startswith(_NPY_MAGIC):
        return VjpsplitError(
            f"{path}: is a single-array .npy file, not an .npz archive; re-save the arrays with vjpsplit"
        )
    if head and (0x80 <= head[0] <= 0x8F or head[0] in (0xDE, 0xDF)):
        return VjpsplitError(f"{path}: looks like a msgpack file, not an .npz archive; rename it to .msgpack")
    return VjpsplitError(f"{path}: is not an .npz (zip) archive; it is corrupt or a different kind of file")


def _load_npz(path: Path) -> tuple[dict[str, np.ndarray], dict]:
    with open_for_read(path, "arrays") as fh:
        try:
            head = fh.read(8)
            size = os.fstat(fh.fileno()).st_size
            fh.seek(0)
        except OSError as e:
            raise VjpsplitError(f"{path}: cannot read the arrays file ({e.strerror or e})") from e
        if not head:
            raise VjpsplitError(f"{path}: file is empty (0 bytes); it was never written completely, re-create it")
        if head[:4] not in _ZIP_MAGICS:
            raise _not_npz(path, head)
        try:
            # The zip magic checked above is what makes np.load return an NpzFile.
            with np.load(fh, allow_pickle=False) as npz:
                return _read_npz(path, npz, size)
        except VjpsplitError:
            raise
        except _DECODE_ERRORS as e:
            raise VjpsplitError(
                f"{path}: cannot read it as an .npz archive ({_one_line(e)}); it is truncated or corrupt, re-create it"
            ) from e


def _member_header(path: Path, zf: zipfile.ZipFile, info: zipfile.ZipInfo, key: str, archive_size: int):
    """Shape and dtype of one member, checked against the archive's sizes before numpy allocates."""
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
    with zf.open(info) as member:
        if member.read(len(_NPY_MAGIC)) != _NPY_MAGIC:
            raise VjpsplitError(f"{path}: entry {info.filename!r} is not a .npy array; the file is not an array archive")
        member.seek(0)
        version = np.lib.format.read_magic(member)
        if version == (1, 0):
            shape, _fortran, dtype = np.lib.format.read_array_header_1_0(member)
        elif version == (2, 0):
            shape, _fortran, dtype = np.lib.format.read_array_header_2_0(member)
        else:
            raise VjpsplitError(
                f"{path}: array {key!r} uses .npy format version {version}, which vjpsplit does not read;"
                " re-save it with numpy's default format"
            )
        data_start = member.tell()
    if dtype.hasobject:
        raise VjpsplitError(
            f"{path}: array {key!r} holds pickled objects; vjpsplit never unpickles, so re-save it"
            " with a numeric or bool dtype"
        )
    if len(shape) > _MAX_NDIM:
        raise VjpsplitError(f"{corrupt} (it has {len(shape)} dimensions); re-create the file")
    if data_start + math.prod(shape) * dtype.itemsize != info.file_size:
        raise VjpsplitError(f"{corrupt} (its size does not match its shape {shape}); re-create the file")
    return shape, dtype


def _is_raw_void(dtype: np.dtype) -> bool:
    return dtype.kind == "V" and dtype.fields is None and dtype.subdtype is None and type(dtype) is np.dtypes.VoidDType


def _read_npz(path: Path, npz, archive_size: int) -> tuple[dict[str, np.ndarray], dict]:
    zf: zipfile.ZipFile = npz.zip
    members: dict[str, zipfile.ZipInfo] = {}
    for info in zf.infolist():
        if not info.filename.endswith(".npy"):
            raise VjpsplitError(
                f"{path}: entry {info.filename!r} is not a .npy array; the file is not an array archive"
            )
        key = info.filename[: -len(".npy")]
        if key in members:
            raise VjpsplitError(f"{path}: array {key!r} is stored twice; the file is corrupt, re-create it")
        members[key] = info

    # Check every member's header before reading any data.
    headers = {key: _member_header(path, zf, info, key, archive_size) for key, info in members.items()}

    names: dict[str, str] | None = None
    meta: dict = {}
    if META_KEY in members:
        shape, dtype = headers.pop(META_KEY)
        if dtype != np.uint8 or len(shape) != 1:
            raise VjpsplitError(f"{path}: entry {META_KEY!r} is not vjpsplit metadata; the file is corrupt")
        names, meta = _parse_npz_header(path, npz[members.pop(META_KEY).filename])
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
    for key, info in members.items():
        arr = npz[info.filename]
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
    for key, name, arr in prepared:
        head = packer.pack_array_header(3) + packer.pack(list(arr.shape)) + packer.pack(name) + _bin_header(arr.nbytes)
        f.write(packer.pack(key))
        f.write(_ext_header(_EXT_NDARRAY, len(head) + arr.nbytes))
        f.write(head)
        f.write(_byte_view(arr))


class _Ext:
    """An ext value decoded inside the unpacker, so its raw bytes are freed early; checked later, by key."""

    __slots__ = ("code", "payload", "problem")

    def __init__(self, code: int, payload: Any, problem: str | None):
        self.code, self.payload, self.problem = code, payload, problem


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


def _ext_array(path: Path, key: str, ext: Any) -> np.ndarray:
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
    if not isinstance(raw, bytes):
        raise VjpsplitError(f"{bad} has no raw byte string; {fix}")
    want = math.prod(shape) * dtype.itemsize
    if len(raw) != want:
        raise VjpsplitError(
            f"{bad} holds {len(raw)} bytes but shape {tuple(shape)} of {name} needs {want}; {fix}"
        )
    try:
        return _native(np.frombuffer(raw, dtype=dtype).reshape(shape))
    except ValueError as e:
        raise VjpsplitError(f"{bad} has unusable shape {tuple(shape)} ({_one_line(e)}); {fix}") from e


def _load_msgpack(path: Path) -> tuple[dict[str, np.ndarray], dict]:
    data = read_bytes(path, "arrays")
    if not data:
        raise VjpsplitError(f"{path}: file is empty (0 bytes); it was never written completely, re-create it")
    if data[:4] in _ZIP_MAGICS:
        raise VjpsplitError(f"{path}: is a zip (.npz) archive, not msgpack; rename it to .npz")
    n = len(data)
    try:
        # Length limits from the file size: a forged length can never exceed the bytes
        # actually present, so msgpack never pre-allocates more than the file holds.
        top = msgpack.unpackb(
            data, raw=False, strict_map_key=True, use_list=True, ext_hook=_unpack_ext, object_pairs_hook=_unique_map,
            max_str_len=n, max_bin_len=n, max_array_len=n, max_map_len=n // 2, max_ext_len=n,
        )
    except _DECODE_ERRORS as e:
        raise VjpsplitError(
            f"{path}: cannot read it as a msgpack arrays file ({_one_line(e)}); it is truncated or corrupt,"
            " re-create it"
        ) from e
    del data  # arrays keep only their own bytes alive

    if not isinstance(top, dict) or top.get("format") != FORMAT:
        raise VjpsplitError(
            f"{path}: is not a vjpsplit arrays file (no format {FORMAT!r} at the top level); re-create it with vjpsplit"
        )
    _check_version(path, top.get("version"))
    meta = _stored_meta(path, top.get("meta", {}))
    stored = top.get("arrays")
    if not isinstance(stored, dict):
        raise VjpsplitError(f"{path}: has no 'arrays' map; the file is corrupt, re-create it")
    arrays = {}
    for key, ext in stored.items():
        _check_stored_key(path, key)
        arrays[key] = _ext_array(path, key, ext)
    return arrays, meta
