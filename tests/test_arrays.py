"""Array files (vjpsplit_cli.files): exact round trips, on-disk layout, old layout, checksums, clean errors."""

from __future__ import annotations

import io
import json
import os
import zipfile
import zlib

import ml_dtypes
import msgpack
import numpy as np
import pytest

from vjpsplit_cli import load_arrays, save_arrays
from vjpsplit_cli.errors import VjpsplitError
from vjpsplit_cli.files import common
from vjpsplit_cli.files import msgpack as msgpack_codec
from vjpsplit_cli.files import npzwrite as npz_write

FORMATS = ["npz", "msgpack"]
DTYPES = [
    "float32",
    "bfloat16",
    "float16",
    "int32",
    "bool",
    "float64",
    "int8",
    "uint8",
    "complex64",
    "float8_e4m3fn",
    "int4",
]
SHAPES = [(), (0,), (0, 3), (3,), (2, 3, 4)]


def make(dtype: str, shape: tuple, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    dt = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64))
    if dtype == "bool":
        return rng.random(shape) > 0.5
    if dtype in ("int4",):
        return rng.integers(-8, 8, size=shape).astype(dt)
    if dt.kind in "iu":
        info = np.iinfo(dt)
        return rng.integers(info.min, info.max, size=shape, endpoint=True, dtype=dt)
    # Floats from random bytes: exercises every bit pattern, NaN payloads and -0 included.
    raw = rng.integers(0, 256, size=n * dt.itemsize, dtype=np.uint8)
    return raw.view(dt).reshape(shape)


def assert_same(got: np.ndarray, want: np.ndarray) -> None:
    want = np.asarray(want)
    assert isinstance(got, np.ndarray)
    assert got.dtype == want.dtype.newbyteorder("=")
    assert got.dtype.isnative
    assert got.shape == want.shape
    assert got.tobytes() == want.astype(got.dtype).tobytes()


def file(tmp_path, fmt: str, name: str = "a"):
    return tmp_path / f"{name}.{fmt}"


# ---------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_round_trip_dtype_shape(tmp_path, fmt, dtype, shape):
    a = make(dtype, shape)
    p = file(tmp_path, fmt)
    save_arrays(p, {"x": a})
    got, meta = load_arrays(p)
    assert list(got) == ["x"]
    assert meta == {}
    assert_same(got["x"], a)


@pytest.mark.parametrize("fmt", FORMATS)
def test_all_allowed_dtypes_round_trip(tmp_path, fmt):
    from vjpsplit_cli.files.dtypes import _ALLOWED

    arrays = {}
    for i, name in enumerate(sorted(_ALLOWED)):
        if name.startswith(("int", "uint", "bool")):
            # Valid values only: sub-byte ints do not define their unused bits.
            arrays[f"d/{name}"] = (np.arange(6) % 2).reshape(2, 3).astype(name)
        else:
            arrays[f"d/{name}"] = make(name, (2, 3), seed=i)
    p = file(tmp_path, fmt)
    save_arrays(p, arrays)
    got, _ = load_arrays(p)
    assert list(got) == list(arrays)
    for k, a in arrays.items():
        assert_same(got[k], a)


@pytest.mark.parametrize("fmt", FORMATS)
def test_meta_round_trip_and_key_order(tmp_path, fmt):
    meta = {
        "name": "résumé ✓",
        "step": 12,
        "lr": 1e-3,
        "big": 2**63 - 1,
        "neg": -(2**63),
        "ok": True,
        "none": None,
        "nested": {"list": [1, 2.5, "x", [], {}], "t": (1, 2)},
    }
    arrays = {"z": np.zeros(2), "a/b": np.ones(3), "m": np.int32(7)}
    p = file(tmp_path, fmt)
    save_arrays(p, arrays, meta)
    got, meta2 = load_arrays(p)
    assert list(got) == ["z", "a/b", "m"]
    expected = dict(meta, nested={"list": [1, 2.5, "x", [], {}], "t": [1, 2]})  # tuples come back as lists
    assert meta2 == expected
    assert type(meta2["step"]) is int and type(meta2["ok"]) is bool


@pytest.mark.parametrize("fmt", FORMATS)
def test_non_contiguous_and_big_endian(tmp_path, fmt):
    base = np.arange(24, dtype=np.float32).reshape(4, 6)
    arrays = {
        "strided": base[:, ::2],
        "transposed": base.T,
        "fortran": np.asfortranarray(base),
        "reversed": base[::-1],
        "be_f4": base.astype(">f4"),
        "be_i8": np.arange(5).astype(">i8"),
        "be_c8": (base + 1j).astype(">c8"),
        "be_scalar": np.array(3.5, dtype=">f8"),
        "be_strided": base.astype(">f4")[:, 1::3],
    }
    p = file(tmp_path, fmt)
    save_arrays(p, arrays)
    got, _ = load_arrays(p)
    for k, a in arrays.items():
        assert got[k].dtype == a.dtype.newbyteorder("="), k
        assert got[k].dtype.isnative, k
        assert got[k].shape == a.shape, k
        np.testing.assert_array_equal(got[k], a)


@pytest.mark.parametrize("fmt", FORMATS)
def test_python_scalars_and_lists(tmp_path, fmt):
    p = file(tmp_path, fmt)
    save_arrays(p, {"f": 1.5, "i": 3, "b": True, "c": 1 + 2j, "l": [[1, 2], [3, 4]]})
    got, _ = load_arrays(p)
    assert got["f"].shape == () and got["f"].dtype == np.float64 and got["f"] == 1.5
    assert got["i"].dtype == np.int64 and got["i"] == 3
    assert got["b"].dtype == np.bool_ and got["b"]
    assert got["c"].dtype == np.complex128
    assert got["l"].shape == (2, 2)


@pytest.mark.parametrize("fmt", FORMATS)
def test_jax_arrays(tmp_path, fmt):
    jnp = pytest.importorskip("jax.numpy")
    a = jnp.arange(6, dtype=jnp.bfloat16).reshape(2, 3)
    p = file(tmp_path, fmt)
    save_arrays(p, {"w": a, "s": jnp.float32(2.0)})
    got, _ = load_arrays(p)
    assert_same(got["w"], np.asarray(a))
    assert got["s"].shape == () and got["s"].dtype == np.float32


@pytest.mark.parametrize("fmt", FORMATS)
def test_keys_with_slashes_and_awkward_names(tmp_path, fmt):
    keys = ["params/layers/0/w", "params/layers/10/b", "a.npy", "a", "file", "allow_pickle", "ключ/ü", "x y"]
    arrays = {k: np.full((2,), i, dtype=np.int16) for i, k in enumerate(keys)}
    p = file(tmp_path, fmt)
    save_arrays(p, arrays)
    got, _ = load_arrays(p)
    assert list(got) == keys
    for k in keys:
        assert_same(got[k], arrays[k])


@pytest.mark.parametrize("fmt", FORMATS)
def test_overwrite_replaces_file(tmp_path, fmt):
    p = file(tmp_path, fmt)
    save_arrays(p, {"a": np.zeros(3)}, {"v": 1})
    save_arrays(p, {"b": np.ones(2)}, {"v": 2})
    got, meta = load_arrays(p)
    assert list(got) == ["b"] and meta == {"v": 2}
    assert sorted(os.listdir(tmp_path)) == [p.name]


@pytest.mark.parametrize("fmt", FORMATS)
def test_empty_mapping(tmp_path, fmt):
    p = file(tmp_path, fmt)
    save_arrays(p, {})
    assert load_arrays(p) == ({}, {})


@pytest.mark.parametrize("fmt", FORMATS)
def test_saving_is_deterministic(tmp_path, fmt):
    arrays = {"w": make("bfloat16", (3, 4)), "b": np.arange(3)}
    save_arrays(file(tmp_path, fmt, "one"), arrays, {"k": 1})
    save_arrays(file(tmp_path, fmt, "two"), arrays, {"k": 1})
    assert file(tmp_path, fmt, "one").read_bytes() == file(tmp_path, fmt, "two").read_bytes()


def test_extension_is_case_insensitive(tmp_path):
    p = tmp_path / "A.NPZ"
    save_arrays(p, {"x": np.arange(3)})
    assert_same(load_arrays(p)[0]["x"], np.arange(3))


def test_accepts_str_paths(tmp_path):
    p = str(tmp_path / "a.msgpack")
    save_arrays(p, {"x": np.arange(3)})
    assert_same(load_arrays(p)[0]["x"], np.arange(3))


# ---------------------------------------------------------------------------- on-disk layout

ML_ARRAYS = {
    "params/w": make("bfloat16", (2, 3)),
    "f8": make("float8_e4m3fn", (4,)),
    "b": np.arange(3),
    "mask": np.array([True, False]),
    "s": np.float32(1.0),
}


@pytest.mark.parametrize("fmt", FORMATS)
def test_files_hold_exactly_the_arrays(tmp_path, fmt):
    # What users do with grads/outputs files: iterate np.load(f).files (or the msgpack map).
    p = file(tmp_path, fmt)
    save_arrays(p, ML_ARRAYS, {"kind": "vjpsplit-grads", "fingerprint": "f" * 64})
    if fmt == "npz":
        with np.load(p, allow_pickle=False) as z:
            assert z.files == list(ML_ARRAYS)
            assert z["params/w"].dtype == np.dtype("V2")  # numpy has no bfloat16: raw bytes, as np.savez writes
            np.testing.assert_array_equal(z["b"], np.arange(3))
    else:
        top = msgpack.unpackb(p.read_bytes())
        assert list(top["arrays"]) == list(ML_ARRAYS)


def test_npz_layout(tmp_path):
    p = file(tmp_path, "npz")
    save_arrays(p, {"params/w": make("bfloat16", (2, 3)), "b": np.arange(3)}, {"step": 3})
    with zipfile.ZipFile(p) as zf:
        assert zf.namelist() == ["params/w.npy", "b.npy"]
        assert zf.testzip() is None  # zip's own CRC-32 of every member is right
        assert all(i.compress_type == zipfile.ZIP_STORED for i in zf.infolist())
        assert [i.comment for i in zf.infolist()] == [b"bfloat16", b""]  # dtype names numpy lacks
        head = json.loads(zf.comment)
    assert head == {
        "format": "vjpsplit-arrays",
        "version": 2,
        "meta": {"step": 3},
        "meta_crc32": zlib.crc32(b'{"step":3}'),
    }


def test_msgpack_layout_matches_packb(tmp_path):
    arrays = {
        "params/w": make("bfloat16", (2, 3)),
        "s": np.float32(1.0),
        "e": np.zeros((0, 3), np.int8),
        "big": np.arange(70000, dtype=np.uint8),  # bin16 -> bin32 / ext32 headers
        "mid": np.arange(300, dtype=np.uint8),
        "tiny": np.array([True]),
    }
    meta = {"step": 3}
    p = file(tmp_path, "msgpack")
    save_arrays(p, arrays, meta)
    expected = msgpack.packb(
        {
            "format": "vjpsplit-arrays",
            "version": 2,
            "meta": meta,
            "arrays": {k: _ext_of(a) for k, a in arrays.items()},
            "crc32": {k: zlib.crc32(np.asarray(a).tobytes()) for k, a in arrays.items()},
            "meta_crc32": zlib.crc32(msgpack.packb(meta)),
        }
    )
    assert p.read_bytes() == expected


def _ext_of(a):
    a = np.asarray(a)
    return msgpack.ExtType(1, msgpack.packb((list(a.shape), a.dtype.name, a.tobytes())))


@pytest.mark.parametrize("size", range(0, 40))
def test_msgpack_ext_header_sizes(tmp_path, size):
    # Covers the fixext 1/2/4/8/16 encodings and the boundaries around them.
    a = np.zeros(size, np.uint8)
    p = file(tmp_path, "msgpack")
    save_arrays(p, {"x": a})
    assert_same(load_arrays(p)[0]["x"], a)
    top = msgpack.unpackb(p.read_bytes())
    assert msgpack.unpackb(top["arrays"]["x"].data) == [[size], "uint8", a.tobytes()]


@pytest.mark.parametrize("fmt", FORMATS)
def test_loaded_arrays_are_writable_aligned_and_outlive_the_file(tmp_path, fmt):
    arrays = {
        f"a{i}": make(dt, shape, seed=i)
        for i, (dt, shape) in enumerate(
            [
                ("float32", (3, 1000)),
                ("int8", (7,)),
                ("float64", (333,)),
                ("bfloat16", (65,)),
                ("complex64", ()),
                ("float32", (0,)),
                ("uint8", (5000,)),
            ]
        )
    }
    p = file(tmp_path, fmt)
    save_arrays(p, arrays)
    got, _ = load_arrays(p)
    p.unlink()  # nothing refers to the file any more
    save_arrays(p, {"other": np.zeros(10)})
    for k, a in arrays.items():
        assert_same(got[k], a)
        assert got[k].flags.aligned and got[k].flags.writeable
        assert not got[k].nbytes or got[k].__array_interface__["data"][0] % 64 == 0, k
    got["a0"][...] = 0  # each array has its own bytes
    assert_same(got["a1"], arrays["a1"])
    assert_same(got["a2"], arrays["a2"])


# ---------------------------------------------------------------------------- the old layout (version 1)

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "arrays_v1")


@pytest.mark.parametrize("fmt", FORMATS)
def test_old_layout_fixture_loads(fmt):
    # Written by vjpsplit 0.x (a __vjpsplit__ member in .npz; no CRC table in .msgpack).
    got, meta = load_arrays(os.path.join(FIXTURES, f"example.{fmt}"))
    assert list(got) == ["params/w", "params/b", "mask", "step", "empty", "f8"]
    assert_same(got["params/w"], np.arange(6, dtype=np.float32).reshape(2, 3).astype(ml_dtypes.bfloat16))
    assert_same(got["f8"], np.array([0.5, 1.0], ml_dtypes.float8_e4m3fn))
    assert_same(got["mask"], np.array([True, False, True]))
    assert_same(got["step"], np.int32(7))
    assert_same(got["empty"], np.zeros((0, 2), np.float16))
    assert meta["kind"] == "example" and set(meta["crc32"]) == set(got)


def _zipfile_npz(path, arrays, meta=None):
    """An .npz of the old layout (a __vjpsplit__ member), written through zipfile."""
    from vjpsplit_cli.files.dtypes import dtype_name

    names = {k: dtype_name(np.asarray(a).dtype) for k, a in arrays.items()}
    blob = json.dumps(
        {"format": "vjpsplit-arrays", "version": 1, "dtypes": names, "meta": meta or {}},
        ensure_ascii=False,
        separators=(",", ":"),
    ).encode()
    with open(path, "wb") as f, zipfile.ZipFile(f, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
        for key, arr in [("__vjpsplit__", np.frombuffer(blob, np.uint8))] + list(arrays.items()):
            arr = np.asarray(arr)
            if arr.dtype.isbuiltin == 2:
                arr = arr.view(np.dtype((np.void, arr.dtype.itemsize)))
            with zf.open(key + ".npy", "w", force_zip64=True) as out:
                np.lib.format.write_array(out, arr, allow_pickle=False)


LAYOUT_ARRAYS = {
    "params/w": make("bfloat16", (2, 3)),
    "s": np.float32(1.0),
    "e": np.zeros((0, 3), np.int8),
    "ключ/ü": np.arange(5, dtype=np.int16),
    "big": make("float32", (300, 1000)),
    "b": np.array([True, False]),
}


def test_old_layout_npz_loads(tmp_path):
    p = file(tmp_path, "npz")
    _zipfile_npz(p, LAYOUT_ARRAYS, {"step": 3})
    got, meta = load_arrays(p)
    assert meta == {"step": 3} and list(got) == list(LAYOUT_ARRAYS)
    for k, a in LAYOUT_ARRAYS.items():
        assert_same(got[k], a)


def _rewrite_npz(src, dst, edit, comment=None):
    with zipfile.ZipFile(src) as zin:
        members = {n: zin.read(n) for n in zin.namelist()}
        comments = {i.filename: i.comment for i in zin.infolist()}
        comment = zin.comment if comment is None else comment
    members = edit(members)
    with zipfile.ZipFile(dst, "w") as zout:
        for n, data in members.items():
            info = zipfile.ZipInfo(n)
            info.comment = comments.get(n, b"")
            zout.writestr(info, data)
        zout.comment = comment


def _npy_bytes(a):
    buf = io.BytesIO()
    np.lib.format.write_array(buf, a, allow_pickle=False)
    return buf.getvalue()


def _header_bytes(header):
    return _npy_bytes(np.frombuffer(json.dumps(header).encode(), np.uint8))


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda m: {k: v for k, v in m.items() if k != "w.npy"}, "lacks"),
        (lambda m: {**m, "extra.npy": _npy_bytes(np.arange(2))}, "does not list 'extra'"),
        (lambda m: {**m, "__vjpsplit__.npy": _npy_bytes(np.frombuffer(b"{nope", np.uint8))}, "not valid JSON"),
        (lambda m: {**m, "__vjpsplit__.npy": _npy_bytes(np.arange(3.0))}, "not vjpsplit metadata"),
        (lambda m: {**m, "__vjpsplit__.npy": _header_bytes({"format": "other"})}, "not vjpsplit metadata"),
        (
            lambda m: {
                **m,
                "__vjpsplit__.npy": _header_bytes(
                    {"format": "vjpsplit-arrays", "version": 7, "dtypes": {"w": "bfloat16"}, "meta": {}}
                ),
            },
            r"version 7 is not supported \(this vjpsplit reads versions 1 to 2\); upgrade vjpsplit",
        ),
        (
            lambda m: {
                **m,
                "__vjpsplit__.npy": _header_bytes(
                    {"format": "vjpsplit-arrays", "version": 1, "dtypes": {"w": "object"}, "meta": {}}
                ),
            },
            "unknown dtype",
        ),
        (
            lambda m: {
                **m,
                "__vjpsplit__.npy": _header_bytes(
                    {"format": "vjpsplit-arrays", "version": 1, "dtypes": {"w": "float32"}, "meta": {}}
                ),
            },
            "stored as .* but the metadata says float32",
        ),
        (
            lambda m: {
                **m,
                "__vjpsplit__.npy": _header_bytes(
                    {"format": "vjpsplit-arrays", "version": 1, "dtypes": {"w": "bfloat16"}, "meta": [1]}
                ),
            },
            "not a map",
        ),
        (
            lambda m: {
                **m,
                "__vjpsplit__.npy": _npy_bytes(
                    np.frombuffer(
                        b'{"format":"vjpsplit-arrays","version":1,"dtypes":{"w":"float64","w":"int8"},"meta":{}}',
                        np.uint8,
                    )
                ),
            },
            "appears twice",
        ),
        (lambda m: {**m, "w.npy": m["w.npy"][:-2]}, "size does not match"),
    ],
)
def test_tampered_old_layout_npz(tmp_path, edit, match):
    src, dst = file(tmp_path, "npz", "src"), file(tmp_path, "npz", "dst")
    _zipfile_npz(src, {"w": make("bfloat16", (2, 3))})
    _rewrite_npz(src, dst, edit)
    with pytest.raises(VjpsplitError, match=match) as ei:
        load_arrays(dst)
    _check_error(ei, dst)


def _comment(**head):
    return json.dumps({"format": "vjpsplit-arrays", "version": 2, **head}).encode()


@pytest.mark.parametrize(
    "comment, member_comment, match",
    [
        (_comment(version=9, meta={}), b"bfloat16", r"version 9 is not supported.*upgrade vjpsplit"),
        (_comment(version="2", meta={}), b"bfloat16", "invalid format version"),
        (_comment(meta=[1]), b"bfloat16", "stored metadata is a list, not a map"),
        (_comment(meta={"a": 1}, meta_crc32=0), b"bfloat16", "metadata fails its CRC-32 check"),
        (None, b"object", "'w' has unknown dtype 'object' recorded"),
        (None, b"float32", "'w' is stored as |V2 but the metadata says float32"),
        (None, b"\xff", "'w' has unknown dtype"),
    ],
)
def test_tampered_npz_comments(tmp_path, comment, member_comment, match):
    src, dst = file(tmp_path, "npz", "src"), file(tmp_path, "npz", "dst")
    save_arrays(src, {"w": make("bfloat16", (2, 3))}, {"a": 1})
    with zipfile.ZipFile(src) as zin:
        data, head = zin.read("w.npy"), zin.comment
    with zipfile.ZipFile(dst, "w") as zout:
        info = zipfile.ZipInfo("w.npy")
        info.comment = member_comment
        zout.writestr(info, data)
        zout.comment = head if comment is None else comment
    with pytest.raises(VjpsplitError, match=match) as ei:
        load_arrays(dst)
    _check_error(ei, dst)


def test_npz_comment_of_another_tool_is_ignored(tmp_path):
    p = file(tmp_path, "npz")
    with zipfile.ZipFile(p, "w") as zf:
        zf.writestr("x.npy", _npy_bytes(np.arange(3)))
        zf.comment = b"made by some tool"
    got, meta = load_arrays(p)
    assert meta == {} and list(got) == ["x"]


def test_npz_meta_over_the_comment_limit(tmp_path):
    meta = {"notes": "x" * 70_000}
    with pytest.raises(VjpsplitError, match=r"over the 65535 an \.npz archive comment holds; use a \.msgpack") as ei:
        save_arrays(file(tmp_path, "npz"), {"x": np.zeros(1)}, meta)
    _check_error(ei, file(tmp_path, "npz"))
    assert os.listdir(tmp_path) == []
    save_arrays(file(tmp_path, "msgpack"), {"x": np.zeros(1)}, meta)
    assert load_arrays(file(tmp_path, "msgpack"))[1] == meta


# ---------------------------------------------------------------------------- foreign npz files


def test_plain_numpy_npz_loads_void_without_meta(tmp_path):
    p = file(tmp_path, "npz")
    bf = make("bfloat16", (2, 3))
    np.savez(p, w=bf, b=np.arange(3, dtype=">i4"), s=np.float32(2))
    got, meta = load_arrays(p)
    assert meta == {}
    assert got["w"].dtype == np.dtype("V2")
    assert got["w"].view(np.dtype("bfloat16")).tobytes() == bf.tobytes()
    assert got["b"].dtype == np.int32 and got["b"].dtype.isnative
    np.testing.assert_array_equal(got["b"], np.arange(3))
    assert got["s"].shape == ()


def test_compressed_npz_loads(tmp_path):
    p = file(tmp_path, "npz")
    np.savez_compressed(p, a=np.zeros((100, 100)), b=np.arange(10))
    got, meta = load_arrays(p)
    assert meta == {}
    assert_same(got["a"], np.zeros((100, 100)))
    assert_same(got["b"], np.arange(10))


def test_compressed_vjpsplit_npz_loads(tmp_path):
    # A vjpsplit npz recompressed by some tool (comments kept) must still load, typed.
    src, dst = file(tmp_path, "npz", "src"), file(tmp_path, "npz", "dst")
    bf = make("bfloat16", (5, 7))
    save_arrays(src, {"w": bf}, {"m": 1})
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            zout.writestr(info, zin.read(info), compress_type=zipfile.ZIP_DEFLATED)
        zout.comment = zin.comment
    got, meta = load_arrays(dst)
    assert meta == {"m": 1}
    assert_same(got["w"], bf)


def test_compressed_member_crc_is_checked(tmp_path):
    p = file(tmp_path, "npz")
    np.savez_compressed(p, a=np.arange(1000))
    with zipfile.ZipFile(p) as zf:
        info = zf.getinfo("a.npy")
    data = bytearray(p.read_bytes())
    local = data[info.header_offset : info.header_offset + 30]
    start = info.header_offset + 30 + int.from_bytes(local[26:28], "little") + int.from_bytes(local[28:30], "little")
    data[start + info.compress_size // 2] ^= 0x01  # inside the deflated data
    p.write_bytes(bytes(data))
    with pytest.raises(VjpsplitError) as ei:
        load_arrays(p)
    _check_error(ei, p)


def test_object_array_npz_is_refused(tmp_path):
    p = file(tmp_path, "npz")
    np.savez(p, ok=np.arange(3), obj=np.array([{"a": 1}, None], dtype=object))
    with pytest.raises(VjpsplitError, match="'obj' holds pickled objects; vjpsplit never unpickles") as ei:
        load_arrays(p)
    _check_error(ei, p)


def test_npz_with_string_array_is_refused(tmp_path):
    p = file(tmp_path, "npz")
    np.savez(p, s=np.array(["a", "bc"]))
    with pytest.raises(VjpsplitError, match="'s'.*cannot use"):
        load_arrays(p)


def test_npz_with_non_npy_member_is_refused(tmp_path):
    p = file(tmp_path, "npz")
    with zipfile.ZipFile(p, "w") as zf:
        zf.writestr("readme.txt", "hello")
    with pytest.raises(VjpsplitError, match="not a .npy array"):
        load_arrays(p)


@pytest.mark.parametrize("name", ["../../etc/passwd.npy", "/abs/x.npy", "a/../b.npy", "..\\win.npy"])
def test_npz_member_names_are_keys_never_paths(tmp_path, name):
    # Nothing is extracted to disk: a traversal-looking name is only a key (or refused as one).
    p = file(tmp_path, "npz")
    with zipfile.ZipFile(p, "w") as zf:
        zf.writestr(name, _npy_bytes(np.arange(3)))
    try:
        got, _ = load_arrays(p)
    except VjpsplitError as e:
        assert "empty path segment" in str(e)
    else:
        assert list(got) == [name[:-4]]
    assert sorted(os.listdir(tmp_path)) == [p.name]


def test_npz_member_with_absurd_shape_is_refused_before_allocating(tmp_path):
    p = file(tmp_path, "npz")
    header = _npy_bytes(np.zeros(0, np.float32)).replace(b"(0,)", b"(1099511627776,)")
    with zipfile.ZipFile(p, "w") as zf:
        zf.writestr("x.npy", header + b"\0" * 16)
    with pytest.raises(VjpsplitError, match="'x' is corrupt .*size does not match"):
        load_arrays(p)


def test_zip_bomb_member_is_refused(tmp_path):
    # 1 GiB of zeros deflates to ~1 MiB; claim 1 TiB uncompressed instead: refused before inflating.
    p = file(tmp_path, "npz")
    with zipfile.ZipFile(p, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("x.npy", _npy_bytes(np.zeros(100_000, np.uint8)))
    data = bytearray(p.read_bytes())
    with zipfile.ZipFile(p) as zf:
        info = zf.getinfo("x.npy")
    cd = data.rindex(b"PK\x01\x02")
    data[cd + 24 : cd + 28] = (2**32 - 2).to_bytes(4, "little")  # uncompressed size in the central directory
    p.write_bytes(bytes(data))
    assert info.compress_size < 2000
    with pytest.raises(VjpsplitError, match="'x' has impossible sizes") as ei:
        load_arrays(p)
    _check_error(ei, p)


# ---------------------------------------------------------------------------- bad files


def _check_error(ei, path):
    msg = str(ei.value)
    assert msg.startswith(f"{path}: "), msg
    assert "\n" not in msg


@pytest.mark.parametrize("fmt", FORMATS)
def test_missing_file(tmp_path, fmt):
    p = file(tmp_path, fmt)
    with pytest.raises(VjpsplitError, match="no such") as ei:
        load_arrays(p)
    _check_error(ei, p)
    assert isinstance(ei.value.__cause__, FileNotFoundError)


@pytest.mark.parametrize("fmt", FORMATS)
def test_directory(tmp_path, fmt):
    p = file(tmp_path, fmt)
    p.mkdir()
    with pytest.raises(VjpsplitError, match="directory") as ei:
        load_arrays(p)
    _check_error(ei, p)


@pytest.mark.parametrize("fmt", FORMATS)
def test_unreadable(tmp_path, fmt, monkeypatch):
    # chmod 0 does not stop root (CI runs as root), so make open() fail as the OS would.
    import vjpsplit_cli.safeio.reading as reading_mod

    p = file(tmp_path, fmt)
    save_arrays(p, {"x": np.arange(3)})

    def denied(path, mode="r", *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(reading_mod, "open", denied, raising=False)
    with pytest.raises(VjpsplitError, match="permission") as ei:
        load_arrays(p)
    _check_error(ei, p)


@pytest.mark.parametrize("fmt", FORMATS)
def test_empty_file(tmp_path, fmt):
    p = file(tmp_path, fmt)
    p.write_bytes(b"")
    with pytest.raises(VjpsplitError, match="empty") as ei:
        load_arrays(p)
    _check_error(ei, p)


@pytest.mark.parametrize("fmt", FORMATS)
def test_truncated_at_every_offset(tmp_path, fmt):
    src = file(tmp_path, fmt, "full")
    save_arrays(src, {"w": make("bfloat16", (4, 5)), "b": np.arange(7, dtype=np.int32), "s": 1.0}, {"m": [1, 2]})
    data = src.read_bytes()
    p = file(tmp_path, fmt, "cut")
    for n in range(0, len(data)):
        p.write_bytes(data[:n])
        with pytest.raises(VjpsplitError) as ei:
            load_arrays(p)
        _check_error(ei, p)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("seed", range(20))
def test_random_bytes(tmp_path, fmt, seed):
    rng = np.random.default_rng(seed)
    p = file(tmp_path, fmt)
    p.write_bytes(rng.integers(0, 256, size=int(rng.integers(1, 2000)), dtype=np.uint8).tobytes())
    with pytest.raises(VjpsplitError) as ei:
        load_arrays(p)
    _check_error(ei, p)


@pytest.mark.parametrize("fmt", FORMATS)
def test_corrupted_bytes_never_crash(tmp_path, fmt):
    # Flip single bytes of a valid file: the result is a clean error, or exactly what was written
    # (a flipped byte the format does not read, like a zip timestamp). Never other data.
    src = file(tmp_path, fmt, "full")
    written = {"w": make("float32", (3, 3)), "i": np.arange(4, dtype=np.int8)}
    save_arrays(src, written, {"m": "x"})
    data = bytearray(src.read_bytes())
    p = file(tmp_path, fmt, "bad")
    rng = np.random.default_rng(1)
    survived = []
    for i in range(len(data)):
        bad = bytearray(data)
        bad[i] ^= int(rng.integers(1, 256))
        p.write_bytes(bytes(bad))
        try:
            arrays, meta = load_arrays(p)
        except VjpsplitError as e:
            assert str(e).startswith(f"{p}: ") and "\n" not in str(e)
            continue
        survived.append(i)
        # A flip in the metadata's own field names can make the file read as a plain archive
        # (no metadata: a residuals file is then refused as one); metadata is never altered.
        assert meta in ({"m": "x"}, {}), (i, meta)
        assert sorted(arrays) == sorted(written), (i, sorted(arrays))
        for k, v in written.items():
            assert arrays[k].dtype == v.dtype and arrays[k].shape == v.shape, (i, k)
            np.testing.assert_array_equal(arrays[k], v)
    assert len(survived) < len(data) // 2  # most flips are caught, not just tolerated


def test_npz_content_named_msgpack(tmp_path):
    src = file(tmp_path, "npz")
    save_arrays(src, {"x": np.arange(3)})
    p = tmp_path / "x.msgpack"
    p.write_bytes(src.read_bytes())
    with pytest.raises(VjpsplitError, match=r"\.npz.*rename it to \.npz") as ei:
        load_arrays(p)
    _check_error(ei, p)


def test_msgpack_content_named_npz(tmp_path):
    src = file(tmp_path, "msgpack")
    save_arrays(src, {"x": np.arange(3)})
    p = tmp_path / "x.npz"
    p.write_bytes(src.read_bytes())
    with pytest.raises(VjpsplitError, match=r"msgpack.*rename it to \.msgpack") as ei:
        load_arrays(p)
    _check_error(ei, p)


def test_npy_named_npz(tmp_path):
    p = tmp_path / "x.npz"
    np.save(tmp_path / "x.npy", np.arange(3))
    (tmp_path / "x.npy").rename(p)
    with pytest.raises(VjpsplitError, match=r"\.npy file") as ei:
        load_arrays(p)
    _check_error(ei, p)


@pytest.mark.parametrize("name", ["a.json", "a.npy", "a", "a.pkl", "a.safetensors"])
def test_unknown_extension(tmp_path, name):
    p = tmp_path / name
    for call in (lambda: save_arrays(p, {"x": np.zeros(1)}), lambda: load_arrays(p)):
        with pytest.raises(VjpsplitError, match=r"use a \.npz or \.msgpack") as ei:
            call()
        _check_error(ei, p)
    assert not p.exists()


def _msgpack_file(tmp_path, top, name="m"):
    p = tmp_path / f"{name}.msgpack"
    p.write_bytes(msgpack.packb(top))
    return p


def _ext(shape, dtype, raw, code=1):
    return msgpack.ExtType(code, msgpack.packb((shape, dtype, raw)))


def test_msgpack_unsupported_version(tmp_path):
    p = _msgpack_file(tmp_path, {"format": "vjpsplit-arrays", "version": 3, "meta": {}, "arrays": {}})
    with pytest.raises(VjpsplitError, match=r"version 3.*versions 1 to 2.*upgrade vjpsplit") as ei:
        load_arrays(p)
    _check_error(ei, p)


@pytest.mark.parametrize(
    "top, match",
    [
        ([1, 2, 3], "not a vjpsplit arrays file"),
        ({"format": "other", "version": 1, "arrays": {}}, "not a vjpsplit arrays file"),
        ({"version": 1, "arrays": {}}, "not a vjpsplit arrays file"),
        ({"format": "vjpsplit-arrays", "arrays": {}}, "invalid format version None"),
        ({"format": "vjpsplit-arrays", "version": "1", "arrays": {}}, "invalid format version"),
        ({"format": "vjpsplit-arrays", "version": True, "arrays": {}}, "invalid format version"),
        ({"format": "vjpsplit-arrays", "version": 1}, "no 'arrays' map"),
        ({"format": "vjpsplit-arrays", "version": 1, "arrays": [1]}, "no 'arrays' map"),
        ({"format": "vjpsplit-arrays", "version": 1, "meta": [1], "arrays": {}}, "not a map"),
        ({"format": "vjpsplit-arrays", "version": 1, "meta": {"b": b"x"}, "arrays": {}}, "bytes"),
        (
            {"format": "vjpsplit-arrays", "version": 1, "meta": {"e": _ext([1], "uint8", b"x")}, "arrays": {}},
            "not JSON-able",
        ),
        ({"format": "vjpsplit-arrays", "version": 1, "arrays": {"": _ext([1], "uint8", b"x")}}, "empty"),
        ({"format": "vjpsplit-arrays", "version": 1, "arrays": {"a//b": _ext([1], "uint8", b"x")}}, "empty path"),
        ({"format": "vjpsplit-arrays", "version": 1, "arrays": {"k": b"raw"}}, "'k' is not an encoded array"),
        (
            {"format": "vjpsplit-arrays", "version": 1, "arrays": {"k": _ext([1], "uint8", b"x", code=2)}},
            "'k' has msgpack ext code 2",
        ),
        (
            {"format": "vjpsplit-arrays", "version": 1, "arrays": {"k": msgpack.ExtType(1, b"\xc1")}},
            "'k' cannot be decoded",
        ),
        (
            {"format": "vjpsplit-arrays", "version": 1, "arrays": {"k": msgpack.ExtType(1, msgpack.packb([1, 2]))}},
            "'k' is not a \\[shape, dtype, bytes\\] triple",
        ),
        (
            {"format": "vjpsplit-arrays", "version": 1, "arrays": {"k": _ext([-1], "uint8", b"")}},
            "'k' has invalid shape",
        ),
        ({"format": "vjpsplit-arrays", "version": 1, "arrays": {"k": _ext([1.0], "uint8", b"x")}}, "invalid shape"),
        ({"format": "vjpsplit-arrays", "version": 1, "arrays": {"k": _ext([True], "uint8", b"x")}}, "invalid shape"),
        ({"format": "vjpsplit-arrays", "version": 1, "arrays": {"k": _ext(3, "uint8", b"xxx")}}, "invalid shape"),
        ({"format": "vjpsplit-arrays", "version": 1, "arrays": {"k": _ext([1] * 65, "uint8", b"x")}}, "invalid shape"),
        (
            {"format": "vjpsplit-arrays", "version": 1, "arrays": {"k": _ext([1], "object", b"x")}},
            "'k' has dtype 'object'",
        ),
        ({"format": "vjpsplit-arrays", "version": 1, "arrays": {"k": _ext([1], 5, b"x")}}, "invalid dtype name"),
        ({"format": "vjpsplit-arrays", "version": 1, "arrays": {"k": _ext([1], "uint8", "x")}}, "no raw byte string"),
        (
            {"format": "vjpsplit-arrays", "version": 1, "arrays": {"k": _ext([2], "float32", b"\0" * 7)}},
            "holds 7 bytes but shape \\(2,\\) of float32 needs 8",
        ),
        (
            {"format": "vjpsplit-arrays", "version": 1, "arrays": {"k": _ext([2**40], "float32", b"\0" * 4)}},
            "'k' holds 4 bytes",
        ),
        (
            {"format": "vjpsplit-arrays", "version": 1, "arrays": {"k": _ext([0, 2**62, 2**62], "float32", b"")}},
            "'k' has unusable shape",
        ),
    ],
)
def test_malformed_msgpack(tmp_path, top, match):
    p = _msgpack_file(tmp_path, top)
    with pytest.raises(VjpsplitError, match=match) as ei:
        load_arrays(p)
    _check_error(ei, p)


def test_msgpack_forged_lengths_do_not_allocate(tmp_path):
    # A bin32 header claiming 4 GiB followed by three bytes: rejected, no MemoryError.
    p = tmp_path / "m.msgpack"
    p.write_bytes(b"\x81\xa1a\xc6\xff\xff\xff\xff" + b"abc")
    with pytest.raises(VjpsplitError) as ei:
        load_arrays(p)
    _check_error(ei, p)
    # A map claiming 2**32 - 1 entries.
    p.write_bytes(b"\xdf\xff\xff\xff\xff\xa1a")
    with pytest.raises(VjpsplitError) as ei:
        load_arrays(p)
    _check_error(ei, p)


def test_msgpack_duplicate_keys(tmp_path):
    # A map with the key "k" twice, built by hand (packb cannot produce it).
    ext = msgpack.packb(_ext([1], "uint8", b"x"))
    body = msgpack.packb({"format": "vjpsplit-arrays", "version": 1})[1:]
    p = tmp_path / "m.msgpack"
    p.write_bytes(b"\x83" + body + msgpack.packb("arrays") + b"\x82" + (msgpack.packb("k") + ext) * 2)
    with pytest.raises(VjpsplitError, match="appears twice") as ei:
        load_arrays(p)
    _check_error(ei, p)


def test_msgpack_trailing_garbage(tmp_path):
    p = file(tmp_path, "msgpack")
    save_arrays(p, {"x": np.arange(3)})
    p.write_bytes(p.read_bytes() + b"\x00")
    with pytest.raises(VjpsplitError, match="cannot read it as a msgpack") as ei:
        load_arrays(p)
    _check_error(ei, p)


def test_msgpack_extra_top_level_keys_are_ignored(tmp_path):
    p = _msgpack_file(
        tmp_path,
        {"format": "vjpsplit-arrays", "version": 1, "created_by": "x", "arrays": {"k": _ext([2], "int8", b"\x01\xff")}},
    )
    got, meta = load_arrays(p)
    assert meta == {}
    assert_same(got["k"], np.array([1, -1], np.int8))


# ---------------------------------------------------------------------------- bad input on save


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(
    "key, match",
    [
        ("", "empty"),
        ("/a", "empty path segment"),
        ("a/", "empty path segment"),
        ("a//b", "empty path segment"),
        ("__vjpsplit__", "reserved"),
        ("a\x00b", "NUL"),
        ("a\udcff", "not valid Unicode"),
        (3, "not a string"),
        (("a",), "not a string"),
    ],
)
def test_bad_keys(tmp_path, fmt, key, match):
    p = file(tmp_path, fmt)
    with pytest.raises(VjpsplitError, match=match) as ei:
        save_arrays(p, {"ok": np.zeros(1), key: np.zeros(1)})
    _check_error(ei, p)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(
    "value",
    [
        np.array([{"a": 1}, None], dtype=object),
        np.array(["a", "bc"]),
        np.array([b"a"]),
        np.zeros(2, dtype=[("a", "f4"), ("b", "i4")]),
        np.zeros(2, dtype="V4"),
        np.array(["2020-01-01"], dtype="datetime64[D]"),
        {"not": "an array"},
        2**80,
    ],
    ids=["object", "str", "bytes", "structured", "void", "datetime", "dict", "bigint"],
)
def test_unstorable_dtypes(tmp_path, fmt, value):
    p = file(tmp_path, fmt)
    with pytest.raises(VjpsplitError, match="'bad'") as ei:
        save_arrays(p, {"good": np.zeros(2), "bad": value})
    _check_error(ei, p)
    assert os.listdir(tmp_path) == []


def test_ragged_list(tmp_path):
    p = file(tmp_path, "npz")
    with pytest.raises(VjpsplitError, match="'r' cannot be converted") as ei:
        save_arrays(p, {"r": [[1, 2], [3]]})
    _check_error(ei, p)


@pytest.mark.parametrize("fmt", FORMATS)
def test_failed_save_keeps_previous_file(tmp_path, fmt):
    p = file(tmp_path, fmt)
    save_arrays(p, {"x": np.arange(3)}, {"v": 1})
    before = p.read_bytes()
    with pytest.raises(VjpsplitError):
        save_arrays(p, {"x": np.array([None], dtype=object)})
    assert p.read_bytes() == before
    assert os.listdir(tmp_path) == [p.name]


@pytest.mark.parametrize("fmt", FORMATS)
def test_crash_mid_write_leaves_no_partial_file(tmp_path, fmt, monkeypatch):
    p = file(tmp_path, fmt)

    def boom(*a, **k):
        raise OSError("disk full")

    # Fail after the file has started being written.
    monkeypatch.setattr(npz_write, "byte_view", boom)
    monkeypatch.setattr(msgpack_codec, "byte_view", boom)
    with pytest.raises((OSError, VjpsplitError), match="disk full"):
        save_arrays(p, {"x": np.arange(3)})
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    "meta, match",
    [
        ([1, 2], "meta must be a dict"),
        ({"a": np.float32(1)}, r"meta\['a'\] is a float32"),
        ({"a": {1: 2}}, "non-string key 1"),
        ({"a": float("nan")}, "nan"),
        ({"a": [float("inf")]}, "inf"),
        ({"a": 2**64}, "64-bit"),
        ({"a": b"x"}, "bytes"),
        ({"a": {1, 2}}, "set"),
        ({"a": "\udcff"}, "not valid Unicode"),
    ],
)
@pytest.mark.parametrize("fmt", FORMATS)
def test_bad_meta(tmp_path, fmt, meta, match):
    p = file(tmp_path, fmt)
    with pytest.raises(VjpsplitError, match=match) as ei:
        save_arrays(p, {"x": np.zeros(1)}, meta)
    _check_error(ei, p)
    assert os.listdir(tmp_path) == []


def test_cyclic_meta(tmp_path):
    meta: dict = {}
    meta["self"] = meta
    p = file(tmp_path, "msgpack")
    with pytest.raises(VjpsplitError, match="nested more than"):
        save_arrays(p, {}, meta)


def test_arrays_must_be_a_mapping(tmp_path):
    p = file(tmp_path, "npz")
    with pytest.raises(VjpsplitError, match="must be a dict") as ei:
        save_arrays(p, [np.zeros(1)])
    _check_error(ei, p)


def test_missing_directory_on_save(tmp_path):
    p = tmp_path / "nope" / "a.npz"
    with pytest.raises(VjpsplitError, match="does not exist"):
        save_arrays(p, {"x": np.zeros(1)})


def test_msgpack_size_guard(tmp_path, monkeypatch):
    monkeypatch.setattr(msgpack_codec, "MAX_BYTES", 100)
    p = file(tmp_path, "msgpack")
    save_arrays(p, {"ok": np.zeros(100, np.uint8)})  # exactly at the limit
    with pytest.raises(VjpsplitError, match=r"'big' is 101 bytes.*use a \.npz file for arrays of 2 GiB or more") as ei:
        save_arrays(p, {"big": np.zeros(101, np.uint8)})
    _check_error(ei, p)
    assert os.listdir(tmp_path) == [p.name]
    # npz has no such limit.
    save_arrays(file(tmp_path, "npz"), {"big": np.zeros(101, np.uint8)})


# ---------------------------------------------------------------------------- checksums, fsync, threads


def _member_data_offset(path, name):
    with zipfile.ZipFile(path) as zf:
        info = zf.getinfo(name)
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        local = f.read(30)
        name_len, extra_len = int.from_bytes(local[26:28], "little"), int.from_bytes(local[28:30], "little")
        start = info.header_offset + 30 + name_len + extra_len
        f.seek(start)
        assert np.lib.format.read_magic(f) == (1, 0)
        np.lib.format.read_array_header_1_0(f)
        return f.tell()


def _flip_in_array(p, fmt, w):
    data = bytearray(p.read_bytes())
    at = _member_data_offset(p, "w.npy") if fmt == "npz" else data.index(w.tobytes()[:64])
    data[at + 40] ^= 0xFF
    p.write_bytes(bytes(data))


@pytest.mark.parametrize("fmt", FORMATS)
def test_crc_checked_on_load(tmp_path, fmt):
    p = file(tmp_path, fmt)
    w = np.arange(1000, dtype=np.float32)
    save_arrays(p, {"w": w})
    _flip_in_array(p, fmt, w)
    if fmt == "npz":
        with pytest.raises(zipfile.BadZipFile, match="CRC"), np.load(p) as z:
            z["w"]  # the CRC written is zip's real one: numpy's reader sees the change too
    with pytest.raises(VjpsplitError, match="'w' fails its CRC-32 check") as ei:
        load_arrays(p)
    _check_error(ei, p)
    got, _ = load_arrays(p, verify=False)  # documented: verify=False skips the CRCs
    assert (got["w"] != w).sum() == 1


@pytest.mark.parametrize("fmt", FORMATS)
def test_meta_crc_checked_on_load(tmp_path, fmt):
    p = file(tmp_path, fmt)
    save_arrays(p, {"w": np.zeros(3)}, {"note": "abc"})
    data = p.read_bytes()
    assert data.count(b"abc") == 1
    p.write_bytes(data.replace(b"abc", b"abd"))  # still well-formed
    with pytest.raises(VjpsplitError, match="metadata fails its CRC-32 check") as ei:
        load_arrays(p)
    _check_error(ei, p)


@pytest.mark.parametrize("fmt", FORMATS)
def test_crc_mismatch_found_in_any_array(tmp_path, fmt):
    p = file(tmp_path, fmt)
    w = np.arange(1000, dtype=np.float32)
    save_arrays(p, {"a": np.ones(10), "w": w, "z": np.zeros(5)})
    data = bytearray(p.read_bytes())
    at = _member_data_offset(p, "w.npy") if fmt == "npz" else data.index(w.tobytes()[:64])
    data[at + 3999] ^= 1  # the last byte of the second array
    p.write_bytes(bytes(data))
    with pytest.raises(VjpsplitError, match="'w' fails its CRC-32 check"):
        load_arrays(p)


@pytest.mark.parametrize("fmt", FORMATS)
def test_no_fsync_unless_asked(tmp_path, fmt, monkeypatch):
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(fd) or real(fd))
    monkeypatch.delenv("VJPSPLIT_FSYNC", raising=False)
    p = file(tmp_path, fmt)
    save_arrays(p, {"x": np.arange(3)})
    assert synced == []  # residuals, outputs, grads: the rename is atomic, the CRCs catch a torn file
    save_arrays(p, {"x": np.arange(3)}, fsync=True)
    assert synced
    synced.clear()
    monkeypatch.setenv("VJPSPLIT_FSYNC", "1")
    save_arrays(p, {"x": np.arange(3)})
    assert synced
    assert_same(load_arrays(p)[0]["x"], np.arange(3))


# ---------------------------------------------------------------------------- values and sizes are checked


@pytest.mark.parametrize("fmt", FORMATS)
def test_bool_bytes_other_than_0_or_1_are_refused(tmp_path, fmt):
    p = file(tmp_path, fmt)
    bad = np.array([1, 0, 2], np.uint8)
    if fmt == "npz":
        np.savez(p, ok=np.array([True]), flags=bad.view(np.bool_))  # as numpy writes whatever bytes it holds
    else:
        p.write_bytes(
            msgpack.packb(
                {
                    "format": "vjpsplit-arrays",
                    "version": 1,
                    "arrays": {"ok": _ext([1], "bool", b"\x01"), "flags": _ext([3], "bool", bad.tobytes())},
                }
            )
        )
    with pytest.raises(VjpsplitError, match="'flags' is bool but holds bytes other than 0 and 1") as ei:
        load_arrays(p)
    _check_error(ei, p)


@pytest.mark.parametrize("dims", [[2**40], [2**31, 2**31], [0, 2**62, 2**62], [2**63 - 1]])
def test_msgpack_forged_shape_is_refused_before_allocating(tmp_path, dims):
    p = _msgpack_file(
        tmp_path, {"format": "vjpsplit-arrays", "version": 1, "arrays": {"k": _ext(dims, "float32", b"")}}
    )
    with pytest.raises(VjpsplitError, match="'k'") as ei:
        load_arrays(p)
    _check_error(ei, p)


def test_msgpack_forged_ext_length_is_refused(tmp_path):
    good = msgpack.packb({"format": "vjpsplit-arrays", "version": 1, "arrays": {"k": _ext([4], "uint8", b"abcd")}})
    at = good.index(b"\xc7")  # ext 8 header: its length byte follows
    p = tmp_path / "m.msgpack"
    p.write_bytes(good[: at + 1] + b"\xff" + good[at + 2 :])
    with pytest.raises(VjpsplitError) as ei:
        load_arrays(p)
    _check_error(ei, p)


def test_msgpack_crc_table_must_match(tmp_path):
    p = file(tmp_path, "msgpack")
    save_arrays(p, {"x": np.arange(3)})
    top = msgpack.unpackb(p.read_bytes())
    for table in ({}, {"x": -1}, {"x": "0"}, {"x": 0, "y": 0}, [0]):
        p.write_bytes(msgpack.packb({**top, "crc32": table}))
        with pytest.raises(VjpsplitError, match="CRC-32 table does not match") as ei:
            load_arrays(p)
        _check_error(ei, p)


@pytest.mark.parametrize("fmt", FORMATS)
def test_load_from_a_pipe(tmp_path, fmt):
    import threading

    src = file(tmp_path, fmt, "src")
    arrays = {"x": np.arange(10), "w": make("bfloat16", (3, 4))}
    save_arrays(src, arrays, {"m": 1})
    fifo = tmp_path / f"pipe.{fmt}"
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: fifo.write_bytes(src.read_bytes()))
    writer.start()
    try:
        got, meta = load_arrays(fifo)
    finally:
        writer.join()
    assert meta == {"m": 1}
    for k, a in arrays.items():
        assert_same(got[k], a)


def test_endless_pipe_is_read_with_a_bound(tmp_path, monkeypatch):
    import threading

    monkeypatch.setattr(common, "MAX_STREAM_BYTES", 1 << 16)
    fifo = tmp_path / "pipe.npz"
    os.mkfifo(fifo)

    def endless():
        try:
            with open(fifo, "wb") as f:
                while True:
                    f.write(b"\0" * 4096)
        except BrokenPipeError:
            pass

    writer = threading.Thread(target=endless)
    writer.start()
    try:
        with pytest.raises(VjpsplitError, match=r"is a pipe that gave more than 65536 bytes") as ei:
            load_arrays(fifo)
    finally:
        writer.join()
    _check_error(ei, fifo)


@pytest.mark.parametrize("fmt", FORMATS)
def test_devices_are_refused(tmp_path, fmt):
    dev = tmp_path / f"zero.{fmt}"
    os.symlink("/dev/zero", dev)
    with pytest.raises(VjpsplitError, match="not a regular file") as ei:
        load_arrays(dev)
    _check_error(ei, dev)


# ---------------------------------------------------------------------------- odd but valid files


def test_foreign_fortran_order_npz(tmp_path):
    p = file(tmp_path, "npz")
    f = np.asfortranarray(np.arange(24, dtype=np.int32).reshape(2, 3, 4))
    np.savez(p, f=f, c=np.arange(6.0).reshape(2, 3))
    got, _ = load_arrays(p)
    np.testing.assert_array_equal(got["f"], f)
    np.testing.assert_array_equal(got["c"], np.arange(6.0).reshape(2, 3))


def test_npz_with_data_descriptors_loads(tmp_path):
    # zipfile writing to an unseekable stream puts sizes and CRC after the data (flag bit 3).
    class Stream(io.RawIOBase):
        def __init__(self):
            self.buf = bytearray()

        def writable(self):
            return True

        def write(self, b):
            self.buf += b
            return len(b)

    out = Stream()
    with zipfile.ZipFile(out, "w") as zf:
        for k, a in {"x": np.arange(5), "y": np.ones((2, 2), np.float32)}.items():
            with zf.open(k + ".npy", "w") as m:
                np.lib.format.write_array(m, a)
    p = file(tmp_path, "npz")
    p.write_bytes(bytes(out.buf))
    got, _ = load_arrays(p)
    assert_same(got["x"], np.arange(5))
    assert_same(got["y"], np.ones((2, 2), np.float32))


def test_npz_long_npy_header(tmp_path):
    body = "{'descr': '<f4', 'fortran_order': False, 'shape': (3,), }" + " " * 6000
    body += " " * (-(len(body) + 11) % 64) + "\n"
    npy = b"\x93NUMPY\x01\x00" + len(body).to_bytes(2, "little") + body.encode() + np.arange(3, dtype="<f4").tobytes()
    p = file(tmp_path, "npz")
    with zipfile.ZipFile(p, "w") as zf:
        zf.writestr("x.npy", npy)
    assert_same(load_arrays(p)[0]["x"], np.arange(3, dtype=np.float32))


def _local_header(name: str, payload: bytes) -> bytes:
    n = name.encode()
    return (
        b"PK\x03\x04"
        + (20).to_bytes(2, "little")
        + bytes(8)
        + zlib.crc32(payload).to_bytes(4, "little")
        + len(payload).to_bytes(4, "little") * 2
        + len(n).to_bytes(2, "little")
        + bytes(2)
        + n
    )


def _stored_zip(body: bytes, central: list[tuple[str, int, bytes]]) -> bytes:
    """``body`` (local headers and data), then a central directory of (name, offset, payload) entries."""
    out = bytearray(body)
    for name, offset, payload in central:
        n = name.encode()
        out += (
            b"PK\x01\x02"
            + bytes([20, 3, 20, 0])
            + bytes(8)
            + zlib.crc32(payload).to_bytes(4, "little")
            + len(payload).to_bytes(4, "little") * 2
            + len(n).to_bytes(2, "little")
            + bytes(12)
            + offset.to_bytes(4, "little")
            + n
        )
    out += (
        b"PK\x05\x06"
        + bytes(4)
        + len(central).to_bytes(2, "little") * 2
        + (len(out) - len(body)).to_bytes(4, "little")
        + len(body).to_bytes(4, "little")
        + bytes(2)
    )
    return bytes(out)


def test_overlapping_npz_members_are_refused(tmp_path):
    # 'outer' is a valid uint8 array whose last bytes are the whole 'inner' entry: two arrays
    # from one stretch of the file would let a small file claim more memory than it holds.
    inner = _npy_bytes(np.arange(100, dtype=np.uint8))
    inner_entry = _local_header("inner.npy", inner) + inner
    outer = _npy_bytes(np.zeros(16 + len(inner_entry), np.uint8))[: -len(inner_entry)] + inner_entry
    outer_entry = _local_header("outer.npy", outer) + outer
    inner_at = len(outer_entry) - len(inner_entry)
    p = file(tmp_path, "npz")
    p.write_bytes(_stored_zip(outer_entry, [("outer.npy", 0, outer), ("inner.npy", inner_at, inner)]))
    with pytest.raises(VjpsplitError, match="'outer' and 'inner' overlap") as ei:
        load_arrays(p)
    _check_error(ei, p)


def test_msgpack_non_canonical_encodings_load(tmp_path):
    # Valid msgpack that packb would encode more compactly: array16 triple, bin32 data,
    # ext32 header, map16 maps. Readers must not depend on packb's exact choices.
    payload = b"\xdc\x00\x03" + b"\xdc\x00\x01\x02" + msgpack.packb("int8") + b"\xc6\x00\x00\x00\x02\x01\xff"
    ext = b"\xc9" + len(payload).to_bytes(4, "big") + b"\x01" + payload
    top = (
        b"\xde\x00\x03"
        + msgpack.packb("format")
        + msgpack.packb("vjpsplit-arrays")
        + msgpack.packb("version")
        + msgpack.packb(1)
        + msgpack.packb("arrays")
        + b"\xde\x00\x02"
        + msgpack.packb("k")
        + ext
        + msgpack.packb("j")
        + msgpack.packb(_ext([3], "uint8", b"abc"))
    )
    p = tmp_path / "m.msgpack"
    p.write_bytes(top)
    got, meta = load_arrays(p)
    assert meta == {} and list(got) == ["k", "j"]
    assert_same(got["k"], np.array([1, -1], np.int8))
    assert_same(got["j"], np.frombuffer(b"abc", np.uint8))


@pytest.mark.parametrize("fmt", FORMATS)
def test_many_arrays_and_big_meta(tmp_path, fmt):
    arrays = {f"a/{i}": np.full((i % 5,), i, np.int32) for i in range(3000)}
    meta = {"notes": "x" * (200_000 if fmt == "msgpack" else 50_000), "list": list(range(2_000))}
    p = file(tmp_path, fmt)
    save_arrays(p, arrays, meta)
    got, meta2 = load_arrays(p)
    assert meta2 == meta and list(got) == list(arrays)
    for k, a in arrays.items():
        assert_same(got[k], a)
