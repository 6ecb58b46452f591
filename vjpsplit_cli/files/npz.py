"""``.npz``: a zip of ``.npy`` members, one per array, as ``np.savez`` writes it.

The member list holds exactly the arrays. vjpsplit's metadata lives where numpy does
not list it: the archive comment holds ``{"format", "version", "meta"}`` as JSON, and
a member whose dtype ``.npy`` cannot spell (bfloat16, float8, int4: stored as raw
void ``|V2``/``|V1``) names its dtype in its member comment. Integrity is zip's own
CRC-32 per member, checked on load.

The archive is written here, not by ``zipfile``: zipfile computes its CRC-32s with
zlib (~4 GB/s), and :mod:`..checksum` is up to ten times faster, and a big archive
goes out in one ``writev`` while its CRC-32s are computed beside it. The bytes are
exactly those ``zipfile`` writes for the same members (``ZIP_STORED``,
``force_zip64``, a seekable file, as ``np.savez`` does) each given an extra field
that starts its array bytes on a 64-byte boundary (``_alignment_extra``); tests
compare the two.
"""

from __future__ import annotations

import io
import json
import math
import re
import struct
import zipfile
from pathlib import Path
from typing import BinaryIO

import numpy as np

from ..errors import VjpsplitError
from ..safeio import checksum
from ..safeio.system import host_memory
from .common import (
    CORRUPT,
    FORMAT,
    MAX_NDIM,
    OLD_META_KEY,
    VERSION,
    Source,
    byte_view,
    check_stored_key,
    check_version,
    crc32s,
    finish,
    one_line,
    storage_dtype,
    stored_meta,
    unique_map,
    write_all,
)
from .dtypes import dtype_name

_ZIP_DATE = (1980, 1, 1, 0, 0, 0)  # fixed, so the same arrays give the same bytes
_MAX_COMMENT = 0xFFFF  # zip's limit for the archive comment
_MAX_RATIO = 1100  # deflate cannot shrink data more than ~1032:1; a member claiming more is forged
_LOCAL_HEADER = struct.Struct("<4s22xHH")  # zip local header: magic ... name length, extra length
_NPY_MAX_HEADER = 10000  # numpy's own default limit
_DIM = rb"(?:0|[1-9][0-9]{0,18})"
_PLAIN_HEADER = re.compile(  # what np.lib.format.write_array_header_1_0 writes for a plain dtype
    rb"\{'descr': '([<>|][biufcV][0-9]{1,4})', 'fortran_order': (True|False), 'shape': "
    rb"\((|" + _DIM + rb",|" + _DIM + rb"(?:, " + _DIM + rb")+)\), \} *\n"
)
# What zipfile writes, field by field (its structFileHeader, structCentralDir, ...).
_LOCAL = struct.Struct("<4s2B4HL2L2H")
_CRC_AT = 14  # where the CRC-32 lies in a local header: after magic, versions, flags, method, time, date
_CENTRAL = struct.Struct("<4s4B4HL2L5HLL")
_END = struct.Struct("<4s4H2LH")
_END64 = struct.Struct("<4sQ2H2L4Q")
_END64_LOCATOR = struct.Struct("<4sLQL")
_ZIP64_VERSION = 45
_UNIX = 3  # create_system: the external attributes are Unix permissions
_UTF8_NAME = 0x800
_MODE = 0o644 << 16
_DOS_DATE = (_ZIP_DATE[0] - 1980) << 9 | _ZIP_DATE[1] << 5 | _ZIP_DATE[2]
_DOS_TIME = _ZIP_DATE[3] << 11 | _ZIP_DATE[4] << 5 | _ZIP_DATE[5] // 2
_DATA_ALIGN = 64  # where each array's bytes start in the file (see _alignment_extra)
_ALIGN_ID = 0xD935  # Android zipalign's extra field: uint16 alignment, then padding
_ALIGN_EXTRA = struct.Struct("<HHH")
ZIP64_LIMIT = (1 << 31) - 1  # zipfile's limits; module-level so tests can lower them
FILECOUNT_LIMIT = (1 << 16) - 1


def writer(path: Path, prepared: list, meta: dict):
    """Check what will be written, then return ``write(f)`` that writes the archive."""
    # The comment has no CRC of its own in zip: it carries one of the meta.
    head = {"format": FORMAT, "version": VERSION, "meta": meta, "meta_crc32": checksum.crc32(_json(meta))}
    comment_bytes = _json(head)
    if len(comment_bytes) > _MAX_COMMENT:
        raise VjpsplitError(
            f"{path}: the metadata is {len(comment_bytes)} bytes, over the {_MAX_COMMENT} an .npz "
            "archive comment holds; use a .msgpack file"
        )

    def write(f: BinaryIO) -> None:
        pos, members = f.tell(), []
        for key, name, arr in prepared:
            comment = b""
            if arr.dtype.isbuiltin == 2:  # ml_dtypes: no .npy spelling numpy can read back
                comment = name.encode("ascii")
                arr = arr.view(np.dtype((np.void, arr.dtype.itemsize)))
            head, data = _npy_header(arr), byte_view(arr)  # from the array's own buffer: no tobytes copy
            filename, flags = _encoded(key + ".npy")
            pad = _alignment_extra(pos + _LOCAL.size + len(filename) + 20 + len(head))
            members.append((pos, filename, flags, comment, pad, head, data))
            pos += _LOCAL.size + len(filename) + len(pad) + 20 + len(head) + len(data)
        # A CRC-32 goes in each local header, before the bytes it covers. On a big archive
        # the headers go out with zeros there, the CRCs are computed on an I/O thread while
        # the bytes are written, then filled in; on a small one they come first.
        crcs = crc32s([(head, data) for *_, head, data in members])
        ready = crcs.done()
        known = crcs.result() if ready else [0] * len(members)
        parts = []
        for (_, filename, flags, _, pad, head, data), crc in zip(members, known):
            size = len(head) + len(data)
            # force_zip64, as np.savez: the sizes live in the zip64 extra field
            parts.append(
                _LOCAL.pack(
                    b"PK\x03\x04",
                    _ZIP64_VERSION,
                    0,
                    flags,
                    zipfile.ZIP_STORED,
                    _DOS_TIME,
                    _DOS_DATE,
                    crc,
                    0xFFFFFFFF,
                    0xFFFFFFFF,
                    len(filename),
                    len(pad) + 20,
                )
                + filename
                + pad
                + struct.pack("<HHQQ", 1, 16, size, size)
                + head
            )
            parts.append(data)
        write_all(f, parts)  # one writev where f is a file: ~1.5 ms less than 74 writes on 41.5 MiB
        if not ready:
            for (at, *_), crc in zip(members, crcs.result()):
                f.seek(at + _CRC_AT)
                f.write(struct.pack("<L", crc))
            f.seek(pos)
        central = [
            _central_entry(filename, flags, crc, len(head) + len(data), at, comment, pad)
            for (at, filename, flags, comment, pad, head, data), crc in zip(members, crcs.result())
        ]
        f.write(b"".join(central))
        f.write(_end_records(len(central), sum(map(len, central)), pos, comment_bytes))

    return write


def _encoded(filename: str) -> tuple[bytes, int]:
    try:
        return filename.encode("ascii"), 0
    except UnicodeEncodeError:
        return filename.encode("utf-8"), _UTF8_NAME


def _alignment_extra(data_start: int) -> bytes:
    """The extra field that moves an array's bytes, now at ``data_start``, to the next 64-byte boundary.

    Why: copying between the page cache and memory runs at full speed only when file
    offset and buffer address agree modulo 32-64 bytes (x86 ``rep movsb``); loaded
    arrays sit 64-byte aligned (jax uses them without a copy), so their bytes in the
    file are aligned too. Measured on 16 MiB reads: misaligned 1.4-5x slower. The
    record is Android zipalign's (id 0xD935: the alignment, then zeros); zip readers,
    numpy's included, skip extra fields they do not know.
    """
    gap = -data_start % _DATA_ALIGN
    if gap == 0:
        return b""
    if gap < _ALIGN_EXTRA.size:  # a record cannot be that short: go to the boundary after
        gap += _DATA_ALIGN
    return _ALIGN_EXTRA.pack(_ALIGN_ID, gap - 4, _DATA_ALIGN) + bytes(gap - _ALIGN_EXTRA.size)


def _central_entry(
    filename: bytes, flags: int, crc: int, size: int, offset: int, comment: bytes, pad: bytes = b""
) -> bytes:
    """One central directory record, as zipfile's ``_write_end_record`` writes it (``pad``: the member's extra)."""
    extra = [size, size] if size > ZIP64_LIMIT else []
    if offset > ZIP64_LIMIT:
        extra.append(offset)
    extra_data = struct.pack("<HH" + "Q" * len(extra), 1, 8 * len(extra), *extra) if extra else b""
    extra_data += pad
    sizes = 0xFFFFFFFF if size > ZIP64_LIMIT else size
    return (
        _CENTRAL.pack(
            b"PK\x01\x02",
            _ZIP64_VERSION,
            _UNIX,
            _ZIP64_VERSION,
            0,
            flags,
            zipfile.ZIP_STORED,
            _DOS_TIME,
            _DOS_DATE,
            crc,
            sizes,
            sizes,
            len(filename),
            len(extra_data),
            len(comment),
            0,
            0,
            _MODE,
            0xFFFFFFFF if offset > ZIP64_LIMIT else offset,
        )
        + filename
        + extra_data
        + comment
    )


def _end_records(count: int, size: int, offset: int, comment: bytes) -> bytes:
    """What follows the central directory: zip64's end records where zipfile writes them, then zip's own."""
    out = b""
    if count > FILECOUNT_LIMIT or offset > ZIP64_LIMIT or size > ZIP64_LIMIT:
        out = _END64.pack(
            b"PK\x06\x06", 44, _ZIP64_VERSION, _ZIP64_VERSION, 0, 0, count, count, size, offset
        ) + _END64_LOCATOR.pack(b"PK\x06\x07", 0, offset + size, 1)
        count, size, offset = min(count, 0xFFFF), min(size, 0xFFFFFFFF), min(offset, 0xFFFFFFFF)
    return out + _END.pack(b"PK\x05\x06", 0, 0, count, count, size, offset, len(comment)) + comment


def _json(value) -> bytes:
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")


def _npy_header(arr: np.ndarray) -> bytes:
    out = io.BytesIO()
    d = np.lib.format.header_data_from_array_1_0(arr)
    try:
        np.lib.format.write_array_header_1_0(out, d)
    except ValueError:  # header over 64 KiB, as np.save would handle it
        out = io.BytesIO()
        np.lib.format.write_array_header_2_0(out, d)
    return out.getvalue()


def _header(src: Source, zf: zipfile.ZipFile) -> tuple[int, dict, dict[str, str] | None]:
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
                if src.verify and head.get("meta_crc32") != checksum.crc32(_json(meta)):
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


def _old_header(src: Source, zf: zipfile.ZipFile) -> tuple[int, dict, dict[str, str]]:
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


def _plain_npy_header(f: BinaryIO) -> tuple[tuple, bool, np.dtype] | None:
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


def _npy_header_of(src: Source, f: BinaryIO, key: str) -> tuple[tuple, bool, np.dtype, int]:
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


def read(src: Source) -> tuple[dict[str, np.ndarray], dict]:
    """Every array and the meta of an ``.npz`` archive; all sizes checked before anything is allocated."""
    path = src.path
    zf = zipfile.ZipFile(src.f)  # reads the central directory only
    version, meta, names = _header(src, zf)
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

    plan, ends = [], []  # first check every member, then read
    for key, info in members.items():
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
                raise VjpsplitError(
                    f"{path}: array {key!r} has no zip local header where the directory says; {CORRUPT}"
                )
            # As zipfile (and so np.load) does: the local header must name the same member.
            local = src.read(info.header_offset + _LOCAL_HEADER.size, name_len)
            if local != info.orig_filename.encode("utf-8" if info.flag_bits & 0x800 else "cp437", "replace"):
                raise VjpsplitError(f"{path}: array {key!r} is named {local[:40]!r} in its zip local header; {CORRUPT}")
            start = info.header_offset + _LOCAL_HEADER.size + name_len + extra_len
            ends.append((info.header_offset, start + info.compress_size, key))
            src.f.seek(start)
            member = src.f
        else:
            start, member = None, zf.open(info)
        shape, fortran, dtype, head_len = _npy_header_of(src, member, key)
        dtype_ = _dtype(
            src,
            key,
            dtype,
            (names or {}).get(key)
            or (info.comment.decode("ascii", "replace") if version >= 2 and info.comment else None),
        )
        nbytes = math.prod(shape) * dtype.itemsize
        if head_len + nbytes != info.file_size:
            raise VjpsplitError(
                f"{path}: array {key!r} is corrupt (its size does not match its shape {shape}); re-create the file"
            )
        seed = checksum.crc32(src.read(start, head_len)) if start is not None and src.verify else None
        plan.append((key, info, start, member, head_len, nbytes, shape, fortran, dtype_, seed))
    # Stored members must lie one after the other inside the file: one stretch read as
    # many arrays would let a small file claim far more memory than it holds.
    ends.sort()
    for (_, end, a), (begin, _, b) in zip(ends, ends[1:] + [(src.size, 0, None)]):
        if end > begin:
            where = f"arrays {a!r} and {b!r} overlap in the archive" if b else f"array {a!r} runs past the end"
            raise VjpsplitError(f"{path}: {where}; {CORRUPT}")

    src.start([p[5] for p in plan])
    arrays, reads = {}, []
    for key, info, start, member, head_len, nbytes, shape, fortran, dtype, seed in plan:
        buf = next(src.slots)
        if start is not None:
            reads.append((key, buf, start + head_len, seed, info.CRC))
        else:  # deflated (np.savez_compressed): through zipfile, which checks the CRC-32 at the end
            if member.readinto(buf) != nbytes or member.read(1):
                raise EOFError(f"array {key!r} is shorter or longer than its header says")
            member.close()
        arrays[key] = (buf, shape, dtype, fortran)
    src.fill(reads)
    return {k: finish(path, k, *v) for k, v in arrays.items()}, meta
