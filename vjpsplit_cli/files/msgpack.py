"""``.msgpack``: one map, arrays as flax.serialization stores them.

``{"format": "vjpsplit-arrays", "version": 2, "meta": {...}, "arrays": {key:
ExtType(1, packb([shape, dtype name, raw bytes]))}, "crc32": {key: CRC-32 of the raw
bytes}, "meta_crc32": CRC-32 of packb(meta)}``. Version 1 (no CRCs) still loads.
Object dtypes cannot be written (only numeric and bool dtypes can), a single array
must be under 2 GiB (msgpack's bin and ext lengths are 32-bit and many readers treat
them as signed), and the reader bounds every length by the file's size.
"""

from __future__ import annotations

import math
import struct
from pathlib import Path
from typing import Any, BinaryIO

import msgpack
import numpy as np

from ..errors import VjpsplitError
from ..safeio import checksum
from .common import (
    CORRUPT,
    DECODE_ERRORS,
    FORMAT,
    MAX_NDIM,
    VERSION,
    Prepared,
    Source,
    Write,
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

EXT_NDARRAY = 1  # flax's ext code for ndarrays: the files stay readable by flax tooling
MAX_BYTES = 2**31 - 1  # module-level so tests can lower it
_FIXEXT = {1: 0xD4, 2: 0xD5, 4: 0xD6, 8: 0xD7, 16: 0xD8}
_EXT_CODE = {1: 0xC7, 2: 0xC8, 4: 0xC9}  # ext 8/16/32, by the width of their length field
_BIN_CODE = {1: 0xC4, 2: 0xC5, 4: 0xC6}  # bin 8/16/32, the same
_EXT_LEN = {code: width for width, code in _EXT_CODE.items()}
_BIN_LEN = {code: width for width, code in _BIN_CODE.items()}


def is_map(first_byte: int) -> bool:
    """Whether a msgpack value starting with this byte is a map (fixmap, map 16, map 32)."""
    return 0x80 <= first_byte <= 0x8F or first_byte in (0xDE, 0xDF)


# msgpack's Packer cannot write an ext or bin header without the payload in one bytes
# object (packb of the flax tuple copies each array three times: tobytes, the inner
# packb, the outer packb), so the two headers are spelled out here and each array goes
# from its own buffer to the file. The bytes are exactly packb's. Encoding the 1 GiB
# benchmark set (benchmarks/io.py) into /dev/null: 0.9-1.3 s this way, CRC-32s
# included, against 8-12 s the packb way.
def _sized(codes: dict[int, int], size: int) -> bytes:
    """Type code and length of a bin or ext value of ``size`` bytes, in the smallest width."""
    width = 1 if size < 2**8 else 2 if size < 2**16 else 4
    return bytes([codes[width]]) + size.to_bytes(width, "big")


def _ext_header(size: int) -> bytes:
    head = bytes([_FIXEXT[size]]) if size in _FIXEXT else _sized(_EXT_CODE, size)
    return head + struct.pack(">b", EXT_NDARRAY)


def writer(path: Path, prepared: Prepared, meta: dict[str, Any]) -> Write:
    """Return ``write(f)`` that writes the map, computing each array's CRC-32 as it goes."""

    def write(f: BinaryIO) -> None:
        p = msgpack.Packer(use_bin_type=True)
        parts: list[bytes | memoryview] = [
            p.pack_map_header(6)
            + p.pack("format")
            + p.pack(FORMAT)
            + p.pack("version")
            + p.pack(VERSION)
            + p.pack("meta")
            + p.pack(meta)
            + p.pack("arrays")
            + p.pack_map_header(len(prepared))
        ]
        # The CRC-32s go after the arrays: on a big file an I/O thread computes them
        # while the arrays are written.
        crcs = crc32s([(byte_view(arr),) for _, _, arr in prepared])
        for key, name, arr in prepared:
            head = p.pack_array_header(3) + p.pack(list(arr.shape)) + p.pack(name) + _sized(_BIN_CODE, arr.nbytes)
            parts += [p.pack(key) + _ext_header(len(head) + arr.nbytes) + head, byte_view(arr)]
        write_all(f, parts)  # one writev where f is a file: ~1.5 ms less than 74 writes on 41.5 MiB
        table = dict(zip((key for key, _, _ in prepared), crcs.result()))
        f.write(p.pack("crc32") + p.pack(table) + p.pack("meta_crc32") + p.pack(checksum.crc32(p.pack(meta))))

    return write


class _Walk:
    """Reads the map's structure with msgpack, leaving each array's bytes in the file to be read once."""

    def __init__(self, src: Source):
        self.src, n = src, src.size
        self.opts = dict(
            raw=False,
            strict_map_key=True,
            use_list=True,
            object_pairs_hook=unique_map,
            max_buffer_size=max(min(n, 2**31 - 1), 4096),
            max_str_len=n,
            max_bin_len=n,
            max_array_len=n,
            max_map_len=n // 2,
            max_ext_len=n,
        )
        self.base, self.u = 0, self._at(0)

    def _at(self, pos: int) -> msgpack.Unpacker:
        self.base = pos
        self.src.f.seek(pos)
        return msgpack.Unpacker(self.src.f, read_size=4096, **self.opts)

    def pos(self) -> int:
        return self.base + self.u.tell()

    def map_header(self) -> int:
        count = self.u.read_map_header()
        if count * 2 > self.src.size - self.pos():
            raise ValueError(f"a map claims {count} entries, more than the file can hold")
        return count

    def top(self) -> dict[str, Any]:
        """The top-level map with "arrays" as ``{key: (shape, dtype, offset, nbytes)}``."""
        kind = self.src.read(0, 1)[0]
        if not is_map(kind):
            raise VjpsplitError(
                f"{self.src.path}: is not a vjpsplit arrays file (its top level is not a map); "
                "re-create it with vjpsplit"
            )
        self.u = self._at(0)  # reads move the file position under the unpacker: start it afresh
        pairs = []
        for _ in range(self.map_header()):
            key = self.u.unpack()
            pairs.append((key, self._arrays() if key == "arrays" else self.u.unpack()))
        if self.pos() != self.src.size:
            raise ValueError(f"{self.src.size - self.pos()} bytes of extra data after the msgpack map")
        return unique_map(pairs)

    def _arrays(self) -> Any:
        pos = self.pos()
        kind = self.src.read(pos, 1)[0]
        self.u = self._at(pos)
        if not is_map(kind):
            return self.u.unpack()  # not a map: refused by the caller
        count = self.map_header()
        pairs = []
        for _ in range(count):
            key = self.u.unpack()
            check_stored_key(self.src.path, key)
            try:
                spec, end = self._array(key, self.pos())
            except DECODE_ERRORS as e:
                if isinstance(e, VjpsplitError):
                    raise
                raise VjpsplitError(
                    f"{self.src.path}: array {key!r} cannot be decoded ({one_line(e)}); {CORRUPT}"
                ) from e
            pairs.append((key, spec))
            self.u = self._at(end)
        return unique_map(pairs)

    def _array(self, key: str, pos: int) -> tuple[tuple[tuple[int, ...], np.dtype, int, int], int]:
        """``((shape, dtype, where its bytes start, their length), where the value ends)`` of the array at ``pos``."""
        path, src = self.src.path, self.src
        bad = f"{path}: array {key!r}"
        kind = src.read(pos, 1)[0]
        if kind in (0xD4, 0xD5, 0xD6, 0xD7, 0xD8):
            length, code_at = 1 << (kind - 0xD4), pos + 1
        elif kind in _EXT_LEN:
            width = _EXT_LEN[kind]
            length, code_at = int.from_bytes(src.read(pos + 1, width), "big"), pos + 1 + width
        else:
            raise VjpsplitError(f"{bad} is not an encoded array (msgpack ext type {EXT_NDARRAY}); {CORRUPT}")
        code = struct.unpack(">b", src.read(code_at, 1))[0]
        if code != EXT_NDARRAY:
            raise VjpsplitError(f"{bad} has msgpack ext code {code}, expected {EXT_NDARRAY}; {CORRUPT}")
        start, end = code_at + 1, code_at + 1 + length
        if end > src.size:
            raise EOFError(f"array {key!r} runs past the end of the file")
        self.u = self._at(start)
        if self.u.read_array_header() != 3:
            raise VjpsplitError(f"{bad} is not a [shape, dtype, bytes] triple; {CORRUPT}")
        shape, name = self.u.unpack(), self.u.unpack()
        at = self.pos()
        bin_width = _BIN_LEN.get(src.read(at, 1)[0]) if at < end else None
        if bin_width is None:
            raise VjpsplitError(f"{bad} has no raw byte string; {CORRUPT}")
        nbytes, data = int.from_bytes(src.read(at + 1, bin_width), "big"), at + 1 + bin_width
        if data + nbytes != end:
            raise VjpsplitError(f"{bad} has data that does not fill its ext value; {CORRUPT}")
        if (
            not isinstance(shape, list)
            or len(shape) > MAX_NDIM
            or not all(type(d) is int and 0 <= d < 2**63 for d in shape)
        ):
            raise VjpsplitError(f"{bad} has invalid shape {shape!r}; {CORRUPT}")
        if not isinstance(name, str):
            raise VjpsplitError(f"{bad} has invalid dtype name {name!r}; {CORRUPT}")
        try:
            dtype = storage_dtype(name)
        except VjpsplitError as e:
            raise VjpsplitError(f"{bad} has dtype {name!r}, which vjpsplit cannot use; {CORRUPT}") from e
        want = math.prod(shape) * dtype.itemsize
        if nbytes != want:
            raise VjpsplitError(
                f"{bad} holds {nbytes} bytes but shape {tuple(shape)} of {name} needs {want}; {CORRUPT}"
            )
        return (tuple(shape), dtype, data, nbytes), end


def read(src: Source) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Every array and the meta of a ``.msgpack`` arrays file; CRC-32s checked where recorded."""
    path = src.path
    top = _Walk(src).top()
    if top.get("format") != FORMAT:
        raise VjpsplitError(
            f"{path}: is not a vjpsplit arrays file (no format {FORMAT!r} at the top level); re-create it with vjpsplit"
        )
    check_version(path, top.get("version"))
    meta = stored_meta(path, top.get("meta", {}))
    specs = top.get("arrays")
    if not isinstance(specs, dict):
        raise VjpsplitError(f"{path}: has no 'arrays' map; {CORRUPT}")
    crcs: Any = top.get("crc32")
    if top["version"] >= 2 and src.verify and top.get("meta_crc32") != checksum.crc32(msgpack.packb(meta)):
        raise VjpsplitError(f"{path}: the metadata fails its CRC-32 check; {CORRUPT}")
    if top["version"] >= 2 and (
        not isinstance(crcs, dict)
        or set(crcs) != set(specs)
        or not all(type(c) is int and 0 <= c < 2**32 for c in crcs.values())
    ):
        raise VjpsplitError(f"{path}: the CRC-32 table does not match the file's arrays; {CORRUPT}")
    src.start([s[3] for s in specs.values()])
    check = src.verify and bool(crcs)
    bufs = {key: next(src.slots) for key in specs}
    src.fill(
        [
            (key, bufs[key], pos, 0 if check else None, crcs[key] if check else 0)
            for key, (_, _, pos, _) in specs.items()
        ]
    )
    return {key: finish(path, key, bufs[key], shape, dtype) for key, (shape, dtype, _, _) in specs.items()}, meta
