"""Hostile files numpy reads one way and a careless loader another: each refused by name, or read as numpy reads it."""

from __future__ import annotations

import io
import zipfile

import jax
import jax.numpy as jnp
import msgpack
import numpy as np
import pytest
from click.testing import CliRunner
from jax import export as jexport

import vjpsplit_cli as vs
from vjpsplit_cli.artifact.manifest import MAGIC, fingerprint_json
from vjpsplit_cli.cli import main


def _zip(path, members: dict, compression=zipfile.ZIP_STORED):
    with zipfile.ZipFile(path, "w", compression=compression) as z:
        for key, a in members.items():
            buf = io.BytesIO()
            np.save(buf, a)
            z.writestr(key + ".npy", buf.getvalue())


def test_zip_whose_local_and_central_names_differ_is_refused(tmp_path):
    p = tmp_path / "a.npz"
    _zip(p, {"xx": np.arange(3.0)})
    data = bytearray(p.read_bytes())
    local = data.index(b"xx.npy")  # the local header's name comes first, the directory's later
    data[local : local + 2] = b"yy"
    p.write_bytes(bytes(data))
    with pytest.raises(zipfile.BadZipFile):
        np.load(p)["xx"]  # numpy refuses it too
    with pytest.raises(
        vs.VjpsplitError,
        match=r"a\.npz: array 'xx' is named b'yy\.npy' in its zip local header; "
        r"the file is corrupt",
    ):
        vs.load_arrays(p)


@pytest.mark.parametrize("compression", [zipfile.ZIP_BZIP2, zipfile.ZIP_LZMA, zipfile.ZIP_DEFLATED])
def test_highly_compressed_members_numpy_reads_are_read(tmp_path, compression):
    p = tmp_path / "z.npz"
    want = {"zeros": np.zeros(1_000_000, np.float32), "x": np.arange(12.0).reshape(3, 4)}
    _zip(p, want, compression)
    assert (
        max(i.file_size / i.compress_size for i in zipfile.ZipFile(p).infolist()) > 1000
        or compression == zipfile.ZIP_DEFLATED
    )
    arrays, meta = vs.load_arrays(p)
    assert meta == {} and sorted(arrays) == sorted(want)
    for k, v in want.items():
        np.testing.assert_array_equal(arrays[k], v)


def test_member_claiming_more_than_host_memory_is_refused(tmp_path, monkeypatch):
    import vjpsplit_cli.files.npz as npz

    p = tmp_path / "z.npz"
    _zip(p, {"zeros": np.zeros(100_000, np.float32)}, zipfile.ZIP_BZIP2)
    monkeypatch.setattr(npz, "host_memory", lambda: 1000)
    with pytest.raises(vs.VjpsplitError, match=r"z\.npz: array 'zeros' would take .* more than this host's memory"):
        vs.load_arrays(p)


@pytest.fixture()
def ws(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m.py").write_text("import jax.numpy as jnp\ndef f(w, x):\n    return jnp.sum(jnp.tanh(x @ w))\n")
    s = jax.ShapeDtypeStruct
    vs.export(
        lambda w, x: jnp.sum(jnp.tanh(x @ w)),
        s((4, 3), jnp.float32),
        s(jexport.symbolic_shape("b") + (4,), jnp.float32),
        arg_names=("w", "x"),
        platforms="cpu",
    ).save(tmp_path / "a.vjps")
    rng = np.random.default_rng(0)
    np.savez(
        tmp_path / "in.npz", w=rng.normal(size=(4, 3)).astype(np.float32), x=rng.normal(size=(5, 4)).astype(np.float32)
    )
    return tmp_path


def _one_line(r, code=1):
    lines = r.stderr.strip().splitlines()
    assert r.exit_code == code and len(lines) == 1 and lines[0].startswith("error: "), (r.exit_code, r.stderr)
    return lines[0]


def test_shapes_from_an_upper_case_npz_are_read_as_a_file(ws):
    np.savez(ws / "shapes.npz", w=np.zeros((4, 3), np.float32))
    (ws / "SHAPES.NPZ").write_bytes((ws / "shapes.npz").read_bytes())
    r = CliRunner().invoke(
        main,
        [
            "export",
            "m.py:f",
            "--shapes",
            "w=SHAPES.NPZ",
            "--shapes",
            "x=f32[b,4]",
            "--platforms",
            "cpu",
            "-o",
            "b.vjps",
        ],
    )
    assert r.exit_code == 0, r.stderr
    assert [leaf.describe() for leaf in vs.load(ws / "b.vjps").manifest.inputs][0] == "f32[4,3]"


def test_forged_input_backed_residual_naming_no_input_is_one_line(ws):
    top = msgpack.unpackb((ws / "a.vjps").read_bytes()[len(MAGIC) :], raw=False)
    backed = next(r for r in top["manifest"]["residuals"] if r["input_backed"])
    backed["key"] = "in/zzz"
    top["manifest"]["fingerprint"] = fingerprint_json(top["manifest"], top)
    (ws / "a.vjps").write_bytes(MAGIC + msgpack.packb(top, use_bin_type=True))
    r = CliRunner().invoke(main, ["run-fwd", "a.vjps", "--inputs", "in.npz", "--residuals", "r.npz"])
    err = _one_line(r)
    assert "a.vjps" in err and "'in/zzz' names no input" in err and "KeyError" not in err
    assert not (ws / "r.npz").exists()


def test_out_of_memory_in_the_backward_names_the_residuals_file(ws, monkeypatch):
    """A residuals file whose recorded dims fit the host's memory check but not XLA's allocator."""
    runner = CliRunner()
    assert runner.invoke(main, ["run-fwd", "a.vjps", "--inputs", "in.npz", "--residuals", "r.npz"]).exit_code == 0
    real = jexport.Exported.call

    def call(self, *args, **kwargs):
        if self.fun_name == "bwd_flat":  # what XLA raises when an allocation fails
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 21474836480 bytes.")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(jexport.Exported, "call", call)
    r = runner.invoke(
        main, ["--no-cache", "run-bwd", "a.vjps", "--inputs", "in.npz", "--residuals", "r.npz", "--grads", "g.npz"]
    )
    err = _one_line(r)
    assert err.startswith("error: r.npz: ") and "ran out of memory" in err and "RESOURCE_EXHAUSTED" in err, err
    assert not (ws / "g.npz").exists()
