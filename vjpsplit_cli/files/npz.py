"""``.npz``: a zip of ``.npy`` members, one per array, as ``np.savez`` writes it; this module reads one.

The member list holds exactly the arrays. vjpsplit's metadata lives where numpy does
not list it: the archive comment holds ``{"format", "version", "meta"}`` as JSON, and
a member whose dtype ``.npy`` cannot spell (bfloat16, float8, int4: stored as raw
void ``|V2``/``|V1``) names its dtype in its member comment. Integrity is zip's own
CRC-32 per member, checked on load. Writing is :mod:`.npzwrite`'s.
"""

from __future__ import annotations

import json
import math
import re
import struct
import zipfile
from pathlib import Path
from typing import IO, Any, NamedTuple

import numpy as np

from ..errors import VjpsplitError
from ..safeio import checksum
from ..safeio.system import host_memory
from .common import (
    CORRUPT,
    FORMAT,
    MAX_NDIM,
    OLD_META_KEY,
    Source,
    check_stored_key,
    check_version,
    finish,
    one_line,
    storage_dtype,
    stored_meta,
    unique_map,
)
from .dtypes import dtype_name
from .npzwrite import meta_json

_MAX_RATIO = 1100  # deflate cannot shrink data more than ~1032:1; a member claiming more is forged
_LOCAL_HEADER = struct.Struct("<4s22xHH")  # zip local header: magic ... name length, extra length
_NPY_MAX_HEADER = 10000  # numpy's own default limit
_DIM = rb"(?:0|[1-9][0-9]{0,18})"
_PLAIN_HEADER = re.compile(  # what np.lib.format.write_array_header_1_0 writes for a plain dtype
    rb"\{'descr': '([<>|][biufcV][0-9]{1,4})', 'fortran_order': (True|False), 'shape': "
    rb"\((|" + _DIM + rb",|" + _DIM + rb"(?:, " + _DIM + rb")+)\), \} *\n"
)


def _header(src: Source, zf: zipfile.ZipFile) -> tuple[int, dict[str, Any], dict[str, str] | None]:
    """Version, meta and recorded dtype names (None: none recorded) of a vjpsplit archive."""
    path = src.path
    # zipfile accepts an archive comment cut short; a cut comment is a cut file.
    end = src.read(src.size - len(zf.comment) - 22, 22) if src.size >= len(zf.comment) + 22 else b""
    if end[:4] != b"PK\x05\x06" or int.from_bytes(end[20:22], "little") != len(zf.comment):
        raise VjpsplitError(f"{path}: the archive ends early or has data after its end; {CORRUPT}")
    if zf.comment:
        try:
            head = json.loads(zf.comment.decode("utf-8"), object_pairs_hook=unique_map)
        except (ValueError, RecursionError):
            head = None
        if isinstance(head, dict) and head.get("format") == FORMAT:
            check_version(path, head.get("version"))
            if head["version"] >= 2:
                meta = stored_meta(path, head.get("meta"))
                if src.verify and head.get("meta_crc32") != checksum.crc32(meta_json(meta)):
                    raise VjpsplitError(f"{path}: the metadata fails its CRC-32 check; {CORRUPT}")
                return head["version"], meta, None
        if zf.comment.startswith(b'{"format":') and (
            not isinstance(head, dict) or "vjpsplit" in str(head.get("format"))
        ):
            # Our header, damaged: its metadata cannot be trusted, and dropping it would
            # make the file look like a plain archive.
            raise VjpsplitError(f"{path}: the archive's metadata is damaged; {CORRUPT}")
    names = zf.namelist()
    if OLD_META_KEY + ".npy" not in names:
        return 0, {}, None  # plain numpy (or another tool): the arrays as they are
    return _old_header(src, zf)


def _old_header(src: Source, zf: zipfile.ZipFile) -> tuple[int, dict[str, Any], dict[str, str]]:
    """Version 1: a uint8 member ``__vjpsplit__`` holding ``{"format", "version", "dtypes", "meta"}``."""
    path = src.path
    info = zf.getinfo(OLD_META_KEY + ".npy")
    if info.file_size > 2**26:
        raise VjpsplitError(f"{path}: entry {OLD_META_KEY!r} is implausibly large; {CORRUPT}")
    with zf.open(info) as m:  # zipfile checks its CRC-32 at the end
        shape, _, dtype, _ = _npy_header_of(src, m, OLD_META_KEY)
        blob = m.read()
    if dtype != np.uint8 or len(shape) != 1 or len(blob) != shape[0]:
        raise VjpsplitError(f"{path}: entry {OLD_META_KEY!r} is not vjpsplit metadata; {CORRUPT}")
    try:
        head = json.loads(blob.decode("utf-8"), object_pairs_hook=unique_map)
    except (ValueError, RecursionError) as e:
        raise VjpsplitError(f"{path}: entry {OLD_META_KEY!r} is not valid JSON ({one_line(e)}); {CORRUPT}") from e
    if not isinstance(head, dict) or head.get("format") != FORMAT:
        raise VjpsplitError(f"{path}: entry {OLD_META_KEY!r} is not vjpsplit metadata; {CORRUPT}")
    check_version(path, head.get("version"))
    names = head.get("dtypes")
    if not isinstance(names, dict) or not all(isinstance(v, str) for v in names.values()):
        raise VjpsplitError(f"{path}: the metadata's dtype table is malformed; {CORRUPT}")
    return 1, stored_meta(path, head.get("meta", {})), names


def _plain_npy_header(f: IO[bytes]) -> tuple[tuple[int, ...], bool, np.dtype] | None:
    """Shape, order and dtype of a version 1.0 header exactly as numpy writes one for a plain dtype; else None.

    numpy parses every header with ``ast.literal_eval`` (safe, but ~20 us each: 0.7 ms
    of loading the 36-array benchmark set); numpy's own spelling of a plain dtype's
    header is matched here by one expression, and anything else (other versions,
    structured dtypes, odd spacing) goes to numpy's parser.
    """
    pre = f.read(10)
    if pre[:8] != b"\x93NUMPY\x01\x00":
        return None
    m = _PLAIN_HEADER.fullmatch(f.read(int.from_bytes(pre[8:10], "little")))
    if m is None:
        return None
    descr, fortran, dims = m.groups()
    shape = tuple(int(d) for d in dims.rstrip(b",").split(b", ") if d)
    return shape, fortran == b"True", np.dtype(descr.decode("ascii"))


def _npy_header_of(src: Source, f: IO[bytes], key: str) -> tuple[tuple[int, ...], bool, np.dtype, int]:
    """Shape, order, dtype and header length of the ``.npy`` data ``f`` is positioned at."""
    start = f.tell()
    plain = _plain_npy_header(f)
    if plain is not None:
        shape, fortran, dtype = plain
    else:
        f.seek(start)
        major, minor = np.lib.format.read_magic(f)
        if (major, minor) not in ((1, 0), (2, 0), (3, 0)):
            raise VjpsplitError(
                f"{src.path}: array {key!r} uses .npy format version {major}.{minor}, which "
                "vjpsplit does not read; re-save it with numpy's default format"
            )
        read = {1: np.lib.format.read_array_header_1_0}.get(major, np.lib.format.read_array_header_2_0)
        shape, fortran, dtype = read(f, max_header_size=_NPY_MAX_HEADER)
    if dtype.hasobject:
        raise VjpsplitError(
            f"{src.path}: array {key!r} holds pickled objects; vjpsplit never unpickles, so "
            "re-save it with a numeric or bool dtype"
        )
    if len(shape) > MAX_NDIM:
        raise VjpsplitError(f"{src.path}: array {key!r} has {len(shape)} dimensions; {CORRUPT}")
    return shape, fortran, dtype, f.tell() - start


def _dtype(src: Source, key: str, stored: np.dtype, name: str | None) -> np.dtype:
    """The dtype to load a member as: ``name`` (recorded) over raw void, else what .npy says."""
    raw_void = stored.kind == "V" and stored.fields is None and stored.subdtype is None
    if name is not None:
        try:
            want = storage_dtype(name)
        except VjpsplitError as e:
            raise VjpsplitError(f"{src.path}: array {key!r} has unknown dtype {name!r} recorded; {e}") from e
        if stored != want and not (raw_void and stored.itemsize == want.itemsize):
            raise VjpsplitError(
                f"{src.path}: array {key!r} is stored as {stored} but the metadata says {name}; {CORRUPT}"
            )
        return want
    if not raw_void:  # raw void stays void: files numpy wrote hold bfloat16 so
        try:
            dtype_name(stored)
        except VjpsplitError as e:
            raise VjpsplitError(
                f"{src.path}: array {key!r} has dtype {stored}, which vjpsplit cannot use; "
                "re-save it with a numeric or bool dtype"
            ) from e
    return stored


def read(src: Source) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Every array and the meta of an ``.npz`` archive; all sizes checked before anything is allocated."""
    path = src.path
    zf = zipfile.ZipFile(src.f)  # reads the central directory only
    version, meta, names = _header(src, zf)
    members = _members(src, zf, version, names)
    plan, ends = [], []  # first check every member, then read
    for key, info in members.items():
        entry = _plan_member(src, zf, key, info, version, names)
        if entry[2] is not None:  # stored: its bytes lie in the file
            ends.append((info.header_offset, entry[2] + info.compress_size, key))
        plan.append(entry)
    _check_no_overlap(path, ends, src.size)
    src.start([p[5] for p in plan])
    arrays, reads = {}, []
    for key, info, start, member, head_len, nbytes, shape, fortran, dtype, seed in plan:
        buf = next(src.slots)
        if start is not None:
            reads.append((key, buf, start + head_len, seed, info.CRC))
        else:  # deflated (np.savez_compressed): through zipfile, which checks the CRC-32 at the end
            if member.readinto(buf) != nbytes or member.read(1):  # type: ignore[attr-defined]
                raise EOFError(f"array {key!r} is shorter or longer than its header says")
            member.close()
        arrays[key] = (buf, shape, dtype, fortran)
    src.fill(reads)
    return {k: finish(path, k, *v) for k, v in arrays.items()}, meta


def _members(
    src: Source, zf: zipfile.ZipFile, version: int, names: dict[str, str] | None
) -> dict[str, zipfile.ZipInfo]:
    """The archive's arrays by key: every entry a ``.npy``, none twice, as the metadata lists them."""
    path = src.path
    members: dict[str, zipfile.ZipInfo] = {}
    for info in zf.infolist():
        if not info.filename.endswith(".npy"):
            raise VjpsplitError(
                f"{path}: entry {info.filename!r} is not a .npy array; the file is not an array archive"
            )
        key = info.filename[:-4]
        if key in members:
            raise VjpsplitError(f"{path}: array {key!r} is stored twice; {CORRUPT}")
        if not (version == 1 and key == OLD_META_KEY):
            check_stored_key(path, key)
            members[key] = info
    if names is not None and set(names) != set(members):
        odd = sorted(set(names) ^ set(members))[0]
        which = f"lists {odd!r}, which the archive lacks" if odd in names else f"does not list {odd!r}"
        raise VjpsplitError(f"{path}: the metadata {which}; the file is corrupt or was edited, re-create it")
    return members


class _Member(NamedTuple):
    """How to read one member, from checks made before anything is allocated."""

    key: str
    info: zipfile.ZipInfo
    start: int | None  # where its .npy header lies in the file (stored); None: deflated, read through zipfile
    member: IO[bytes]
    head_len: int
    nbytes: int
    shape: tuple[int, ...]
    fortran: bool
    dtype: np.dtype
    seed: int | None  # the CRC-32 of its .npy header, where the data's CRC-32 is checked


def _plan_member(
    src: Source, zf: zipfile.ZipFile, key: str, info: zipfile.ZipInfo, version: int, names: dict[str, str] | None
) -> _Member:
    """One member checked against the file before anything is allocated: how to read it."""
    path = src.path
    if info.flag_bits & 0x1:
        raise VjpsplitError(f"{path}: array {key!r} is encrypted; save it without a password")
    stored = info.compress_type == zipfile.ZIP_STORED
    # Deflate cannot shrink more than ~1032:1, so a bigger claim is forged; bzip2 and lzma
    # can (zeros), so there the bound is what this host could hold at all.
    deflated = info.compress_type == zipfile.ZIP_DEFLATED
    if (
        info.compress_size > src.size
        or (stored and info.file_size != info.compress_size)
        or (deflated and info.file_size > info.compress_size * _MAX_RATIO + 1024)
    ):
        raise VjpsplitError(f"{path}: array {key!r} has impossible sizes in its zip entry; {CORRUPT}")
    if info.file_size > host_memory():
        raise VjpsplitError(
            f"{path}: array {key!r} would take {info.file_size / 2**30:.1f} GiB, more than this "
            f"host's memory; {CORRUPT}"
        )
    if stored:  # its data lies in the file as is: read it straight into the array
        magic, name_len, extra_len = _LOCAL_HEADER.unpack(src.read(info.header_offset, _LOCAL_HEADER.size))
        if magic != b"PK\x03\x04":
            raise VjpsplitError(f"{path}: array {key!r} has no zip local header where the directory says; {CORRUPT}")
        # As zipfile (and so np.load) does: the local header must name the same member.
        local = src.read(info.header_offset + _LOCAL_HEADER.size, name_len)
        if local != info.orig_filename.encode("utf-8" if info.flag_bits & 0x800 else "cp437", "replace"):
            raise VjpsplitError(f"{path}: array {key!r} is named {local[:40]!r} in its zip local header; {CORRUPT}")
        start = info.header_offset + _LOCAL_HEADER.size + name_len + extra_len
        src.f.seek(start)
        member: IO[bytes] = src.f
    else:
        start, member = None, zf.open(info)
    shape, fortran, dtype, head_len = _npy_header_of(src, member, key)
    dtype_ = _dtype(
        src,
        key,
        dtype,
        (names or {}).get(key) or (info.comment.decode("ascii", "replace") if version >= 2 and info.comment else None),
    )
    nbytes = math.prod(shape) * dtype.itemsize
    if head_len + nbytes != info.file_size:
        raise VjpsplitError(
            f"{path}: array {key!r} is corrupt (its size does not match its shape {shape}); re-create the file"
        )
    seed = checksum.crc32(src.read(start, head_len)) if start is not None and src.verify else None
    return _Member(key, info, start, member, head_len, nbytes, shape, fortran, dtype_, seed)


def _check_no_overlap(path: Path, ends: list[tuple[int, int, str]], size: int) -> None:
    """Stored members must lie one after the other inside the file.

    One stretch read as many arrays would let a small file claim far more memory than it holds.
    """
    ends.sort()
    for (_, end, a), (begin, _, b) in zip(ends, ends[1:] + [(size, 0, None)]):
        if end > begin:
            where = f"arrays {a!r} and {b!r} overlap in the archive" if b else f"array {a!r} runs past the end"
            raise VjpsplitError(f"{path}: {where}; {CORRUPT}")
