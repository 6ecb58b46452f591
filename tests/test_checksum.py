"""CRC-32 backends (vjpsplit_cli.safeio.checksum): every backend gives the same CRCs and the same file bytes."""

from __future__ import annotations

import hashlib
import io
import struct
import sys
import zipfile
import zlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import vjpsplit_cli as vs
from vjpsplit_cli.errors import VjpsplitError
from vjpsplit_cli.files import npzwrite as npz_write
from vjpsplit_cli.files.common import byte_view, prepare
from vjpsplit_cli.safeio import checksum

# zlib is always there; the fast ones where installed (zlib-ng is a dependency).
BACKENDS = sorted(set(checksum.BACKENDS) | {"zlib"})

# sha256 of the files that vjpsplit writes for sample(). npz: since 2026-12-01 each
# member's bytes start 64-byte aligned (an alignment extra field); before that the
# archive was zipfile's (ZIP_STORED, force_zip64) byte for byte, hash 780bd339...
GOLDEN = {
    "npz": "25e38b45775fc2e54b4d971b6925050a5a2e30e6f5f74ceeae4f6834d0cfa377",
    "msgpack": "9030b40f3ec46f3f3e3070383444986e9fb26995b9dc16b0baa069ae57f34517",
}


def sample() -> dict:
    r = np.random.default_rng(7)
    return {
        "params/w": r.standard_normal((3, 5)).astype(np.float32),
        "params/b": np.arange(5, dtype=np.int64),
        "x/h\u00e9": r.standard_normal(4).astype(ml_dtypes.bfloat16),  # member comment, UTF-8 name
        "s": np.float64(2.5),
        "empty": np.zeros((0, 3), np.int32),
        "m": np.array([True, False]),
    }


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    monkeypatch.setattr(checksum, "crc32", checksum.BACKENDS[request.param] if request.param != "zlib" else zlib.crc32)
    return request.param


def test_zlib_ng_is_installed():
    # A dependency (pyproject.toml): without it every CRC-32 runs at zlib's ~4 GB/s.
    assert "zlib-ng" in checksum.BACKENDS and checksum.BACKEND == "zlib-ng"


def test_backends_agree_with_zlib(backend):
    data = np.random.default_rng(1).integers(0, 256, 3 * 2**20 + 7, dtype=np.uint8)
    for chunk in (b"", b"a", memoryview(data), memoryview(data[5:]), memoryview(data[:4099])):
        assert checksum.crc32(chunk) == zlib.crc32(chunk)
        assert checksum.crc32(chunk, 0xDEADBEEF) == zlib.crc32(chunk, 0xDEADBEEF)  # a running CRC continues


def test_missing_fast_libraries_fall_back_to_zlib(monkeypatch):
    monkeypatch.setitem(sys.modules, "zlib_ng", None)  # import of a None entry raises ImportError
    monkeypatch.setitem(sys.modules, "isal", None)
    assert checksum.find_backends() == [("zlib", zlib.crc32)]


@pytest.mark.parametrize("fmt", ["npz", "msgpack"])
def test_same_bytes_as_before_with_every_backend(tmp_path, backend, fmt):
    p = tmp_path / f"a.{fmt}"
    vs.save_arrays(p, sample(), {"kind": "golden", "step": 3})
    assert hashlib.sha256(p.read_bytes()).hexdigest() == GOLDEN[fmt]
    got, meta = vs.load_arrays(p)
    assert meta == {"kind": "golden", "step": 3}
    for k, v in sample().items():
        assert got[k].dtype == np.asarray(v).dtype and np.array_equal(got[k], v)


def _zipfile_npz(path, arrays: dict, comment: bytes) -> None:
    """The archive as zipfile writes it, each member given an extra field that puts its array
    bytes on a 64-byte boundary: the reference the .npz writer must match byte for byte."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
        for key, name, arr in prepare(path, arrays):
            info = zipfile.ZipInfo(key + ".npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.external_attr = 0o644 << 16
            if arr.dtype.isbuiltin == 2:
                info.comment = name.encode("ascii")
                arr = arr.view(np.dtype((np.void, arr.dtype.itemsize)))
            head = io.BytesIO()
            np.lib.format.write_array_header_1_0(head, np.lib.format.header_data_from_array_1_0(arr))
            # local header, name, this extra, zip64's 20-byte extra, .npy header, then the bytes
            start = zf.fp.tell() + 30 + len(info.filename.encode()) + 20 + len(head.getvalue())
            gap = -start % 64
            if 0 < gap < 6:  # the shortest record (id, length, alignment) is 6 bytes
                gap += 64
            info.extra = struct.pack("<HHH", 0xD935, gap - 4, 64) + bytes(gap - 6) if gap else b""
            with zf.open(info, "w", force_zip64=True) as member:
                member.write(head.getvalue())
                member.write(byte_view(arr))
        zf.comment = comment


def test_npz_array_bytes_are_64_byte_aligned(tmp_path):
    # Copies between the page cache and 64-byte aligned arrays run at full speed only
    # when the file offset agrees: every .npz member's bytes start on a boundary,
    # whatever the key lengths; zip readers (numpy's included) still read the archive.
    arrays = {"k" * n: np.arange(n + 1, dtype=np.float32) for n in range(1, 70)}
    arrays["bf"] = np.ones(5, ml_dtypes.bfloat16)
    p = tmp_path / "a.npz"
    vs.save_arrays(p, arrays, {"k": 1})
    raw = p.read_bytes()
    with zipfile.ZipFile(p) as zf:
        assert zf.testzip() is None
        for info in zf.infolist():
            at = info.header_offset
            name_len, extra_len = struct.unpack("<HH", raw[at + 26 : at + 30])
            npy = at + 30 + name_len + extra_len
            assert raw[npy : npy + 8] == b"\x93NUMPY\x01\x00"
            data = npy + 10 + int.from_bytes(raw[npy + 8 : npy + 10], "little")
            assert data % 64 == 0, info.filename
    with np.load(p) as z:
        assert all(np.array_equal(z[k], v) for k, v in arrays.items() if k != "bf")
    got, meta = vs.load_arrays(p)
    assert meta == {"k": 1} and all(np.array_equal(got[k], v) for k, v in arrays.items())
    assert all(a.ctypes.data % 64 == 0 for a in got.values())


@pytest.mark.parametrize("limits", [None, "zip64-sizes", "zip64-count"])
def test_npz_writer_matches_zipfile(tmp_path, monkeypatch, backend, limits):
    arrays = dict(sample(), big=np.arange(300, dtype=np.float64))
    if limits == "zip64-sizes":  # members and offsets past the limit: zip64 extras and end records
        for mod, name in ((npz_write, "ZIP64_LIMIT"), (zipfile, "ZIP64_LIMIT")):
            monkeypatch.setattr(mod, name, 1000)
    elif limits == "zip64-count":  # more members than the plain end record counts
        for mod, name in ((npz_write, "FILECOUNT_LIMIT"), (zipfile, "ZIP_FILECOUNT_LIMIT")):
            monkeypatch.setattr(mod, name, 3)
    ours, ref = tmp_path / "ours.npz", tmp_path / "ref.npz"
    vs.save_arrays(ours, arrays, {"k": 1})
    with zipfile.ZipFile(ours) as zf:
        comment = zf.comment
        assert zf.testzip() is None  # zip's CRC-32 of every member is right
    _zipfile_npz(ref, arrays, comment)
    assert ours.read_bytes() == ref.read_bytes()
    with np.load(ours) as z:
        assert np.array_equal(z["big"], arrays["big"])
    assert np.array_equal(vs.load_arrays(ours)[0]["big"], arrays["big"])


@pytest.mark.parametrize("fmt", ["npz", "msgpack"])
def test_files_cross_backends_and_corruption_is_caught(tmp_path, monkeypatch, backend, fmt):
    p = tmp_path / f"a.{fmt}"
    w = np.arange(4096, dtype=np.float32)
    with monkeypatch.context() as m:  # written with zlib, read with the backend under test
        m.setattr(checksum, "crc32", zlib.crc32)
        vs.save_arrays(p, {"w": w})
    assert np.array_equal(vs.load_arrays(p)[0]["w"], w)
    data = bytearray(p.read_bytes())
    data[data.index(w[100:120].tobytes())] ^= 4
    p.write_bytes(bytes(data))
    with pytest.raises(VjpsplitError, match="'w' fails its CRC-32 check"):
        vs.load_arrays(p)


def test_input_bindings_cross_backends(tmp_path, monkeypatch, backend):
    def loss(w, x):
        return jnp.sum(jnp.tanh(x @ w))

    w = jnp.arange(12.0, dtype=jnp.float32).reshape(3, 4) / 10
    x = jnp.ones((2, 3), jnp.float32)
    art = vs.export(
        loss, jax.ShapeDtypeStruct(w.shape, w.dtype), jax.ShapeDtypeStruct(x.shape, x.dtype), platforms=["cpu"]
    )
    _, res = art.fwd(w, x)
    p = tmp_path / "r.npz"
    with monkeypatch.context() as m:  # the binding CRCs written by zlib, checked by the backend under test
        m.setattr(checksum, "crc32", zlib.crc32)
        vs.save_residuals(p, res)
    gw, gx = art.bwd(vs.load_residuals(p, inputs=(w, x)))
    want = jax.grad(loss, argnums=(0, 1))(w, x)
    assert np.allclose(gw, want[0], rtol=1e-6) and np.allclose(gx, want[1], rtol=1e-6)
    with pytest.raises(VjpsplitError, match="differ"):
        vs.load_residuals(p, inputs=(w + 1, x))
