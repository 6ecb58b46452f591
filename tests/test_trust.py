"""Trusted artifacts (issue 19): signatures, module checks before compiling, caches, signals, messages.

Every forged artifact is made with public JAX APIs (``jax.export``, ``jax.ffi.ffi_call``)
and re-fingerprinted with ``vjpsplit_cli.artifact.manifest.fingerprint``, as an attacker would.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import msgpack
import numpy as np
import pytest
from click.testing import CliRunner
from clihelp import opts
from jax import export as jexport
from sighelp import python_with_sigint

import vjpsplit_cli as vs
from vjpsplit_cli.artifact.manifest import MAGIC, fingerprint
from vjpsplit_cli.cli import main
from vjpsplit_cli.trust.checks import lapack_shapes_ok
from vjpsplit_cli.trust.signing import generate_key, key_id, load_public_key

X = jax.ShapeDtypeStruct((4,), np.float32)
XV = np.array([0.5, -1.0, 2.0, 0.25], np.float32)


def f(x):
    return jnp.sum(jnp.sin(x) * x)


def with_lu(x):
    a = jnp.outer(x, x) + 3.0 * jnp.eye(4)
    return jnp.linalg.det(a) + jnp.sum(jax.scipy.linalg.lu_factor(a)[0])


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    d = tmp_path_factory.mktemp("trust")
    art = vs.export(f, X, platforms=["cpu"])
    art.save(d / "f.vjps")
    vs.save_arrays(d / "in.npz", {"x": XV})
    generate_key(d / "key")
    generate_key(d / "other")
    return d, art


def run_cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def cli(*args, env=None, timeout=300):
    cmd = [sys.executable, "-m", "vjpsplit_cli.cli", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})


def one_error_line(stderr: str, *needles) -> str:
    err = stderr.strip()
    assert err.startswith("error: ") and len(err.splitlines()) == 1, err
    assert "Traceback" not in err and "loc(" not in err
    for n in needles:
        assert n in err, (n, err)
    return err


# ----------------------------------------------------------------------------- forging helpers


def replaced(art, module: str, exp) -> bytes:
    """``art``'s file with ``module`` replaced by ``exp`` (serialized) and the fingerprint recomputed."""
    modules = dict(art.modules)
    modules[module] = bytes(exp.serialize())
    m = dataclasses.replace(art.manifest, fingerprint="")
    m = dataclasses.replace(m, fingerprint=fingerprint(m, modules))
    return MAGIC + msgpack.packb({"manifest": m.to_json(), **modules}, use_bin_type=True)


def forge_fwd(art, body, *, allow=(), avals=None) -> bytes:
    """A forward module with ``art``'s signature whose outputs all depend on ``body(x)`` (a scalar)."""
    outs = avals or art._exps["fwd"].out_avals

    def fwd(x):
        s = body(x)
        return tuple(jnp.full(a.shape, s, a.dtype) for a in outs)

    checks = [jexport.DisabledSafetyCheck.custom_call(t) for t in allow]
    return replaced(art, "fwd", jexport.export(jax.jit(fwd), platforms=["cpu"], disabled_checks=checks)(X))


def unchecked(data: bytes):
    """An Artifact object from forged bytes, skipping every load check (to sign it, as its forger would)."""
    top = msgpack.unpackb(data[len(MAGIC) :])
    m = vs.Manifest.from_json(top.pop("manifest"), "forged")
    return vs.Artifact(m, top)


def write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


# ----------------------------------------------------------------------------- signatures


def test_keygen_writes_a_private_0600_key_and_a_public_key(tmp_path):
    r = run_cli("keygen", "-o", tmp_path / "k")
    assert r.exit_code == 0, r.output
    assert stat.S_IMODE(os.stat(tmp_path / "k").st_mode) == 0o600
    assert b"PRIVATE KEY" in (tmp_path / "k").read_bytes()
    pub = load_public_key(tmp_path / "k.pub")
    assert key_id(pub) in r.stderr
    # An existing key is never replaced.
    before = (tmp_path / "k").read_bytes()
    r = run_cli("keygen", "-o", tmp_path / "k")
    assert r.exit_code == 1 and "already exists" in r.stderr
    assert (tmp_path / "k").read_bytes() == before


def test_sign_verify_round_trip_and_signer_shown(base, tmp_path):
    d, art = base
    signed = vs.loads(art.to_bytes())
    kid = signed.sign(d / "key")
    signed.save(tmp_path / "s.vjps")
    loaded = vs.load(tmp_path / "s.vjps", trust=[d / "other.pub", d / "key.pub"])
    assert loaded.signer == kid == key_id(load_public_key(d / "key.pub"))
    out, res = loaded.fwd(XV)
    np.testing.assert_allclose(loaded.bwd(res)[0], jax.grad(f)(XV), rtol=1e-6)
    # Without trust keys a signed artifact loads too, and says who signed it.
    assert vs.load(tmp_path / "s.vjps").signer == kid
    r = run_cli("inspect", tmp_path / "s.vjps", "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["signer"] == kid
    r = run_cli("inspect", tmp_path / "s.vjps")
    assert f"signed by    {kid}" in r.stdout
    assert json.loads(run_cli("inspect", d / "f.vjps", "--json").stdout)["signer"] is None


def test_raw_trust_keys_of_the_wrong_length_are_one_clear_error(base):
    """Raw key bytes are 32 long; other lengths were handed to the file reader as a path (a TypeError)."""
    d, _ = base
    raw = load_public_key(d / "key.pub")
    assert vs.load(d / "f.vjps").signer is None
    for bad in (raw[:31], bytearray(raw + b"\0")):
        with pytest.raises(vs.VjpsplitError, match=rf"trust key: {len(bad)} raw bytes, not an Ed25519 public key's 32"):
            vs.load(d / "f.vjps", trust=[bad])
    with pytest.raises(vs.VjpsplitError, match="unsigned, and trust keys were given"):
        vs.load(d / "f.vjps", trust=[bytearray(raw)])  # 32 raw bytes are a key, as documented


def test_unsigned_and_other_signers_are_refused_before_any_module_is_read(base, tmp_path, monkeypatch):
    d, art = base
    import vjpsplit_cli.artifact.artifact_file as artifact_mod

    from vjpsplit_cli.trust import probes as trust

    def no_module_reads(*a, **k):
        raise AssertionError("a module was read before the signature was checked")

    monkeypatch.setattr(artifact_mod, "deserialize_module", no_module_reads)
    monkeypatch.setattr(trust, "probe_modules", no_module_reads)
    with pytest.raises(vs.VjpsplitError, match="unsigned, and trust keys were given"):
        vs.load(d / "f.vjps", trust=d / "key.pub")
    monkeypatch.undo()
    a = vs.load(d / "f.vjps")
    a.sign(d / "other")
    a.save(tmp_path / "o.vjps")
    monkeypatch.setattr(artifact_mod, "deserialize_module", no_module_reads)
    monkeypatch.setattr(trust, "probe_modules", no_module_reads)
    with pytest.raises(vs.VjpsplitError, match="not among the trusted keys"):
        vs.load(tmp_path / "o.vjps", trust=d / "key.pub")
    monkeypatch.setenv("VJPSPLIT_TRUST_KEYS", os.pathsep.join([str(d / "key.pub")]))
    with pytest.raises(vs.VjpsplitError, match="not among the trusted keys"):
        vs.load(tmp_path / "o.vjps")


def test_one_flipped_byte_anywhere_in_a_signed_file_is_refused(base, tmp_path):
    d, art = base
    a = vs.load(d / "f.vjps")
    a.sign(d / "key")
    data = a.to_bytes()
    trusted = load_public_key(d / "key.pub")
    assert vs.loads(data, trust=trusted).signer
    positions = sorted(set(list(range(0, len(data), max(1, len(data) // 150))) + [len(data) - 1, len(data) - 70]))
    for i in positions:
        bad = bytearray(data)
        bad[i] ^= 0x01
        with pytest.raises(vs.VjpsplitError):
            vs.loads(bytes(bad), trust=trusted)


def test_cli_sign_and_trust(base, tmp_path):
    d, _ = base
    (tmp_path / "m.py").write_text("import jax.numpy as jnp\ndef g(x):\n    return jnp.sum(jnp.sin(x) * x)\n")
    r = cli(
        "export",
        f"{tmp_path / 'm.py'}:g",
        *opts(shapes="x=f32[4]", platforms="cpu", sign_key=d / "key"),
        "-o",
        tmp_path / "s.vjps",
    )
    assert r.returncode == 0, r.stderr
    assert "signed by ed25519:" in r.stderr
    r = cli(
        "run-fwd",
        tmp_path / "s.vjps",
        "--inputs",
        d / "in.npz",
        "--residuals",
        tmp_path / "r.npz",
        "--trust-key",
        d / "other.pub",
        "--trust-key",
        d / "key.pub",
    )
    assert r.returncode == 0, r.stderr
    r = cli(
        "run-bwd",
        tmp_path / "s.vjps",
        *opts(residuals=tmp_path / "r.npz", inputs=d / "in.npz", grads=tmp_path / "g.npz"),
        env={"VJPSPLIT_TRUST_KEYS": str(d / "key.pub")},
    )
    assert r.returncode == 0, r.stderr
    np.testing.assert_allclose(vs.load_arrays(tmp_path / "g.npz")[0]["x"], jax.grad(f)(XV), rtol=1e-6)
    r = cli(
        "run-fwd",
        d / "f.vjps",
        *opts(inputs=d / "in.npz", residuals=tmp_path / "r2.npz", trust_key=d / "key.pub"),
    )
    assert r.returncode == 1
    one_error_line(r.stderr, "unsigned")
    assert not (tmp_path / "r2.npz").exists()
    r = cli(
        "run-fwd",
        tmp_path / "s.vjps",
        *opts(inputs=d / "in.npz", residuals=tmp_path / "r2.npz"),
        env={"VJPSPLIT_TRUST_KEYS": str(d / "other.pub")},
    )
    assert r.returncode == 1
    one_error_line(r.stderr, "not among the trusted keys")
    r = cli(
        "export",
        f"{tmp_path / 'm.py'}:g",
        *opts(shapes="x=f32[4]", sign_key=d / "key.pub"),
        "-o",
        tmp_path / "t.vjps",
    )
    assert r.returncode == 1 and not (tmp_path / "t.vjps").exists()
    one_error_line(r.stderr, "not an unencrypted Ed25519 private key")


def test_a_signed_artifact_with_a_lapack_call_runs(base, tmp_path):
    d, _ = base
    art = vs.export(with_lu, X, platforms=["cpu"])
    assert b"lapack" in art.modules["fwd"]
    art.sign(d / "key")
    art.save(tmp_path / "lu.vjps")
    a = vs.load(tmp_path / "lu.vjps", trust=d / "key.pub")
    out, res = a.fwd(XV)
    np.testing.assert_allclose(out, with_lu(XV), rtol=1e-5)
    np.testing.assert_allclose(a.bwd(res)[0], jax.grad(with_lu)(XV), rtol=1e-4)
    # Unsigned, JAX's own LAPACK calls pass the shape check and run too.
    out, _ = vs.loads(art.to_bytes()).fwd(XV)
    np.testing.assert_allclose(out, with_lu(XV), rtol=1e-5)


# ----------------------------------------------------------------------------- custom calls


def _callback(x):
    return jax.ffi.ffi_call("xla_ffi_python_cpu_callback", jax.ShapeDtypeStruct((), np.float32))(
        jnp.sum(x), index=np.uint64(123456)
    )


def _buffer_callback(x):
    return jax.ffi.ffi_call("xla_buffer_python_cpu_callback", jax.ShapeDtypeStruct((), np.float32))(jnp.sum(x))


def _lapack(target, results):
    def body(x):
        a = jnp.ones((512, 512), np.float32) * jnp.sum(x)
        r = jax.ffi.ffi_call(target, results)(a)
        return jnp.sum(r[0])

    return body


TINY_GETRF = (
    jax.ShapeDtypeStruct((2, 2), np.float32),
    jax.ShapeDtypeStruct((1,), np.int32),
    jax.ShapeDtypeStruct((), np.int32),
)
TINY_POTRF = (jax.ShapeDtypeStruct((2, 2), np.float32), jax.ShapeDtypeStruct((), np.int32))
BAD_PIVOTS = (
    jax.ShapeDtypeStruct((512, 512), np.float32),
    jax.ShapeDtypeStruct((1,), np.int32),
    jax.ShapeDtypeStruct((), np.int32),
)

FORGED = {
    "ffi-callback": (_callback, "xla_ffi_python_cpu_callback", "host callback"),
    "buffer-callback": (_buffer_callback, "xla_buffer_python_cpu_callback", "host callback"),
    "getrf-tiny": (_lapack("lapack_sgetrf_ffi", TINY_GETRF), "lapack_sgetrf_ffi", "cannot vouch for"),
    "getrf-pivots": (_lapack("lapack_sgetrf_ffi", BAD_PIVOTS), "lapack_sgetrf_ffi", "cannot vouch for"),
    "potrf-tiny": (_lapack("lapack_spotrf_ffi", TINY_POTRF), "lapack_spotrf_ffi", "cannot vouch for"),
    "unknown": (
        lambda x: jax.ffi.ffi_call("my_kernel_of_doom", jax.ShapeDtypeStruct((), np.float32))(jnp.sum(x)),
        "my_kernel_of_doom",
        "cannot vouch for",
    ),
}


@pytest.mark.parametrize("case", sorted(FORGED))
def test_forged_custom_calls_are_refused_with_one_line(base, tmp_path, case):
    d, art = base
    body, target, message = FORGED[case]
    path = write(tmp_path / "forged.vjps", forge_fwd(art, body, allow=[target]))
    with pytest.raises(vs.VjpsplitError, match=message):
        vs.load(path)
    r = cli("run-fwd", path, "--inputs", d / "in.npz", "--residuals", tmp_path / "r.npz", env={"MALLOC_CHECK_": "3"})
    assert r.returncode == 1, (r.returncode, r.stderr)
    one_error_line(r.stderr, message, target)
    assert not (tmp_path / "r.npz").exists()


def test_host_callbacks_are_refused_even_when_signed_and_trusted(base, tmp_path):
    d, art = base
    a = unchecked(forge_fwd(art, _callback, allow=["xla_ffi_python_cpu_callback"]))
    a.sign(d / "key")
    with pytest.raises(vs.VjpsplitError, match="host callback"):
        vs.loads(a.to_bytes(), trust=d / "key.pub", allow_kernels=True)


def test_unknown_kernels_load_when_signed_and_trusted_or_allowed(base, tmp_path):
    d, art = base
    body, target, _ = FORGED["unknown"]
    data = forge_fwd(art, body, allow=[target])
    assert vs.loads(data, allow_kernels=True).signer is None
    a = vs.loads(data, allow_kernels=True)
    a.sign(d / "key")
    assert vs.loads(a.to_bytes(), trust=d / "key.pub").signer
    r = cli("inspect", write(tmp_path / "u.vjps", data), "--allow-kernels")
    assert r.returncode == 0, r.stderr


def test_lapack_shape_rule_accepts_what_jax_emits_and_refuses_smaller_results():
    ok = {
        "target": "lapack_sgetrf_ffi",
        "operands": [["f32", [5, 3, 4]]],
        "results": [["f32", [5, 3, 4]], ["i32", [5, 3]], ["i32", [5]]],
        "attrs": {},
    }
    assert lapack_shapes_ok(ok)
    for bad in (
        [["f32", [5, 3, 4]], ["i32", [5, 2]], ["i32", [5]]],
        [["f32", [1, 1]], ["i32", [5, 3]], ["i32", [5]]],
        [["f32", [5, 3, 4]], ["i32", [5, None]], ["i32", [5]]],
    ):
        assert not lapack_shapes_ok({**ok, "results": bad})
    svd = {
        "target": "lapack_sgesdd_ffi",
        "operands": [["f32", [3, 4]]],
        "attrs": {"mhlo.backend_config": "{mode = 65 : ui8}"},
        "results": [["f32", [3, 4]], ["f32", [3]], ["f32", [3, 3]], ["f32", [4, 4]], ["i32", []]],
    }
    assert lapack_shapes_ok(svd)
    # Mode 'A' writes full u and vt: reduced ones declared for it are too small.
    reduced = {
        **svd,
        "operands": [["f32", [5, 3]]],
        "results": [["f32", [5, 3]], ["f32", [3]], ["f32", [5, 3]], ["f32", [3, 3]], ["i32", []]],
    }
    assert not lapack_shapes_ok(reduced)
    assert lapack_shapes_ok({**reduced, "attrs": {"mhlo.backend_config": "{mode = 83 : ui8}"}})
    assert not lapack_shapes_ok({**svd, "results": svd["results"][:2] + [["f32", [3, 1]]] + svd["results"][3:]})


def test_jax_own_linear_algebra_for_every_platform_passes_unsigned():
    def linalg(a):
        sq = a[..., :4, :4] @ jnp.swapaxes(a[..., :4, :4], -1, -2) + 4.0 * jnp.eye(4)
        return (
            jnp.sum(jax.scipy.linalg.lu_factor(a)[0])
            + jnp.sum(jnp.linalg.qr(a)[0])
            + jnp.sum(jnp.linalg.svd(a, full_matrices=False)[1])
            + jnp.sum(jnp.linalg.eigh(sq)[0])
            + jnp.sum(jnp.linalg.cholesky(sq))
            + jnp.sum(jnp.linalg.solve(sq, a[..., :4, :1]))
        )

    a = np.linspace(-1, 1, 60, dtype=np.float32).reshape(3, 5, 4)
    art = vs.export(linalg, jax.ShapeDtypeStruct(a.shape, np.float32))  # cpu, cuda and tpu: LAPACK, cuSOLVER, XLA's
    fwd = art.modules["fwd"]
    assert b"lapack_" in fwd and b"cusolver_" in fwd and b"LuDecomposition" in fwd
    loaded = vs.loads(art.to_bytes(), cache_dir=None)
    out, res = loaded.fwd(a)
    np.testing.assert_allclose(out, linalg(a), rtol=1e-4)
    np.testing.assert_allclose(loaded.bwd(res)[0], jax.grad(linalg)(a), rtol=1e-3, atol=1e-4)


# ----------------------------------------------------------------------------- avals


def test_module_avals_differing_from_the_manifest_are_refused(base, tmp_path):
    d, art = base
    outs = list(art._exps["fwd"].out_avals)
    # A residual of another dtype and shape than the manifest says (f32[4] -> i32[2]).
    wrong = [outs[0]] + [jax.core.ShapedArray((2,), np.int32) for _ in outs[1:]]
    path = write(tmp_path / "w.vjps", forge_fwd(art, jnp.sum, avals=wrong))
    with pytest.raises(vs.VjpsplitError, match="fwd module's outputs do not match the manifest"):
        vs.load(path)
    r = cli("run-fwd", path, "--inputs", d / "in.npz", "--residuals", tmp_path / "r.npz")
    assert r.returncode == 1
    one_error_line(r.stderr, "do not match the manifest")
    # An 8 GiB residual where the manifest says f32[4]: refused before anything is allocated.
    huge = [outs[0]] + [jax.core.ShapedArray((2**31,), np.float32) for _ in outs[1:]]
    with pytest.raises(vs.VjpsplitError, match="do not match the manifest"):
        vs.loads(forge_fwd(art, jnp.sum, avals=huge))


def test_a_module_whose_stablehlo_disagrees_with_its_declared_avals_is_refused(base):
    _, art = base
    exp = art._exps["fwd"]
    other = jexport.export(jax.jit(lambda x: tuple(x[:3].astype(np.int32) for _ in exp.out_avals)), platforms=["cpu"])(
        X
    )
    # The flatbuffer says the original avals; the StableHLO inside returns i32[3]s.
    forged = dataclasses.replace(exp, mlir_module_serialized=other.mlir_module_serialized)
    with pytest.raises(vs.VjpsplitError, match="StableHLO outputs do not match"):
        vs.loads(replaced(art, "fwd", forged))


# ----------------------------------------------------------------------------- corrupt bytecode

FLIPPER = r"""
import dataclasses, sys
from jax import export as jexport
import vjpsplit_cli as vs
from vjpsplit_cli.artifact.manifest import MAGIC, fingerprint
import msgpack
art = vs.load(sys.argv[1], cache_dir=None)
exp = art._exps["fwd"]
code = exp.mlir_module_serialized
refused = ran = 0
for i in range(8, len(code), max(1, len(code) // 40)):
    bad = bytearray(code); bad[i] ^= 0xFF
    modules = dict(art.modules)
    modules["fwd"] = bytes(dataclasses.replace(exp, mlir_module_serialized=bytes(bad)).serialize())
    m = dataclasses.replace(art.manifest, fingerprint="")
    m = dataclasses.replace(m, fingerprint=fingerprint(m, modules))
    data = MAGIC + msgpack.packb({"manifest": m.to_json(), **modules}, use_bin_type=True)
    try:
        a = vs.loads(data, cache_dir=None)
        a.fwd(__import__("numpy").ones(4, "float32"))
        ran += 1
    except vs.VjpsplitError as e:
        assert "\n" not in str(e), e
        refused += 1
print(refused, ran)
if refused == 0:
    sys.exit(3)
open(sys.argv[2], "wb").write(data)
"""


def test_flipped_bytecode_bytes_give_one_clean_line_under_malloc_check(base, tmp_path):
    d, art = base
    env = {**os.environ, "MALLOC_CHECK_": "3"}
    r = subprocess.run(
        [sys.executable, "-c", FLIPPER, str(d / "f.vjps"), str(tmp_path / "last.vjps")],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    # No signal death, no heap error: the parser only ever crashed in its child process.
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    refused, ran = map(int, r.stdout.split())
    assert refused >= 1
    assert "double free" not in r.stderr and "corrupt" not in r.stderr.lower().replace("corrupt or", "")


def test_a_corrupt_module_is_one_error_line_on_the_cli_without_mlir_diagnostics(base, tmp_path):
    d, art = base
    exp = art._exps["fwd"]
    code = exp.mlir_module_serialized
    forged = dataclasses.replace(exp, mlir_module_serialized=code[: len(code) // 2])  # truncated
    path = write(tmp_path / "c.vjps", replaced(art, "fwd", forged))
    with pytest.raises(vs.VjpsplitError):
        vs.load(path, cache_dir=None)
    r = cli(
        "run-fwd",
        path,
        *opts(inputs=d / "in.npz", residuals=tmp_path / "r.npz"),
        env={"MALLOC_CHECK_": "3", "VJPSPLIT_CACHE_DIR": "off"},
    )
    assert r.returncode == 1
    one_error_line(r.stderr, str(path), "StableHLO is corrupt")


def test_a_corrupt_module_signed_by_a_trusted_key_is_one_error_without_diagnostics(base, capfd):
    d, art = base
    exp = art._exps["fwd"]
    code = exp.mlir_module_serialized
    forged = unchecked(replaced(art, "fwd", dataclasses.replace(exp, mlir_module_serialized=code[: len(code) // 2])))
    forged.sign(d / "key")
    capfd.readouterr()
    with pytest.raises(vs.VjpsplitError, match="StableHLO is corrupt"):
        vs.loads(forged.to_bytes(), trust=d / "key.pub", cache_dir=None)  # parsed in this process: trusted
    err = capfd.readouterr().err
    assert "error:" not in err and "loc(" not in err, err


# ----------------------------------------------------------------------------- deep nesting


def test_a_deeply_nested_manifest_is_a_clean_error(base, tmp_path):
    d, art = base
    deep: dict = {}
    cur = deep
    for _ in range(1000):
        cur["n"] = {}
        cur = cur["n"]
    man = art.manifest.to_json()
    man["structure"] = {"args": {"x": deep}, "out": deep}
    data = MAGIC + msgpack.packb({"manifest": man, **art.modules}, use_bin_type=True)
    with pytest.raises(vs.VjpsplitError):
        vs.loads(data)
    r = cli("inspect", write(tmp_path / "deep.vjps", data))
    assert r.returncode == 1
    one_error_line(r.stderr)


# ----------------------------------------------------------------------------- signals


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_never_ending_module_ends_on_a_termination_signal(base, tmp_path, sig):
    d, art = base
    # Forged: the forward's outputs depend on a while loop that never ends.
    path = write(
        tmp_path / "loop.vjps",
        forge_fwd(
            art,
            lambda x: jax.lax.while_loop(
                lambda c: c[1] > -1.0, lambda c: (c[0] + 1.0, c[1] + 1.0), (jnp.sum(x), jnp.abs(jnp.sum(x)))
            )[0],
        ),
    )
    (tmp_path / "r.npz").write_bytes(b"previous")
    cache = tmp_path / "cache"
    cmd = python_with_sigint(
        "-m",
        "vjpsplit_cli.cli",
        "run-fwd",
        str(path),
        *opts(inputs=d / "in.npz", residuals=tmp_path / "r.npz"),
    )
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "VJPSPLIT_CACHE_DIR": str(cache)},
    )
    # Wait until the module checks are done (their verdicts are written), then for the module to run.
    deadline = time.time() + 120
    while time.time() < deadline and not (cache / "checked").is_dir() or not any((cache / "checked").iterdir()):
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    time.sleep(3)
    assert proc.poll() is None  # still looping
    sent = time.time()
    proc.send_signal(sig)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"{sig!r} did not end a run-fwd that was running a module")
    assert time.time() - sent < 10
    assert proc.returncode in (-sig, 128 + sig), proc.returncode
    assert (tmp_path / "r.npz").read_bytes() == b"previous"
    assert [p.name for p in tmp_path.iterdir() if ".tmp" in p.name] == []


def test_timeout_ends_a_never_ending_module_with_one_line(base, tmp_path):
    d, art = base
    path = write(
        tmp_path / "loop.vjps",
        forge_fwd(
            art,
            lambda x: jax.lax.while_loop(
                lambda c: c[1] > -1.0, lambda c: (c[0] + 1.0, c[1] + 1.0), (jnp.sum(x), jnp.abs(jnp.sum(x)))
            )[0],
        ),
    )
    (tmp_path / "r.npz").write_bytes(b"previous")
    t0 = time.time()
    r = cli(
        "run-fwd", path, "--inputs", d / "in.npz", "--residuals", tmp_path / "r.npz", "--timeout", "15", timeout=120
    )
    assert r.returncode == 1, (r.returncode, r.stderr)
    one_error_line(r.stderr, str(path), "did not finish within 15 s (--timeout)")
    assert time.time() - t0 < 90
    assert (tmp_path / "r.npz").read_bytes() == b"previous"
    assert [p.name for p in tmp_path.iterdir() if ".tmp" in p.name] == []
    assert (
        run_cli(
            "run-fwd", path, "--inputs", d / "in.npz", "--residuals", tmp_path / "r.npz", "--timeout", "0"
        ).exit_code
        == 2
    )


# ----------------------------------------------------------------------------- caches and temp sweep


def _run_fwd(d, path, out, cache, debug=False):
    return cli(
        *(["--debug"] if debug else []),
        "run-fwd",
        path,
        *opts(inputs=d / "in.npz", residuals=out, outputs=out.with_name("o_" + out.name)),
        env={"VJPSPLIT_CACHE_DIR": str(cache)},
    )


def _det(x):
    return jnp.linalg.det(jnp.outer(x, x) + 3.0 * jnp.eye(4))


@pytest.mark.parametrize("how", ["writable-by-others", "other-owner"])
def test_a_shared_cache_directory_is_never_read(base, tmp_path, how):
    d, _ = base
    if how == "other-owner" and os.getuid() != 0:
        pytest.skip("making a directory owned by another uid needs root")
    cache = tmp_path / "cache"
    # LAPACK modules go through JAX's own persistent cache (not vjpsplit's executable cache).
    vs.export(_det, X, platforms=["cpu"]).save(tmp_path / "legit.vjps")
    vs.export(lambda x: _det(x) + 1000.0, X, platforms=["cpu"]).save(tmp_path / "evil.vjps")
    r = _run_fwd(d, tmp_path / "legit.vjps", tmp_path / "r0.npz", cache)
    assert r.returncode == 0, r.stderr
    legit = {p.name for p in cache.iterdir() if p.name.endswith("-cache")}
    r = _run_fwd(d, tmp_path / "evil.vjps", tmp_path / "r1.npz", cache)
    assert r.returncode == 0, r.stderr
    evil = [p for p in cache.iterdir() if p.name.endswith("-cache") and p.name not in legit]
    assert len(legit) == 1 and len(evil) == 1
    (cache / legit.pop()).write_bytes(evil[0].read_bytes())  # planted under the legitimate program's key
    want = float(_det(XV))
    # Control: in the user's own private directory, such an entry is taken (JAX checks nothing).
    r = _run_fwd(d, tmp_path / "legit.vjps", tmp_path / "r2.npz", cache)
    assert r.returncode == 0, r.stderr
    assert abs(float(vs.load_arrays(tmp_path / "o_r2.npz")[0]["out"]) - want) > 999
    if how == "writable-by-others":
        os.chmod(cache, 0o777)
    else:
        os.chown(cache, 12345, 12345)
    before = sorted(str(p) for p in cache.rglob("*"))
    r = _run_fwd(d, tmp_path / "legit.vjps", tmp_path / "r3.npz", cache, debug=True)
    assert r.returncode == 0, r.stderr
    assert "compilation cache" in r.stderr and "unusable" in r.stderr
    np.testing.assert_allclose(vs.load_arrays(tmp_path / "o_r3.npz")[0]["out"], want, rtol=1e-5)
    assert sorted(str(p) for p in cache.rglob("*")) == before  # nothing written there either


def test_the_temp_sweep_ignores_names_it_cannot_parse(tmp_path):
    odd = tmp_path / ".r.npz.0123abcd.vjps99999999999999999999-0-0123abcd.tmp"
    odd.write_bytes(b"x")
    vs.save_arrays(tmp_path / "r.npz", {"a": np.ones(2)})
    assert odd.exists()
    assert vs.load_arrays(tmp_path / "r.npz")[0]["a"].tolist() == [1.0, 1.0]
