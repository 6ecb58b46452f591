"""The bad-input matrix: every command x every file it reads x every way that file can be wrong.

Each case must give exit 1 (2 for usage mistakes), exactly one stderr line
``error: ...`` that names the file and is not a bare exception type, no traceback,
no new file (temp files included), and previous outputs byte-identical.
docs/reliability.md quotes the number of cases collected here.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import stat
import textwrap
import zipfile
from pathlib import Path

import jax
import jax.numpy as jnp
import msgpack
import numpy as np
import pytest
from click.testing import CliRunner
from jax import export as jexport

import vjpsplit_cli as vs
import vjpsplit_cli.safeio.reading as reading_mod
from vjpsplit_cli.artifact.manifest import MAGIC
from vjpsplit_cli.artifact.manifest import fingerprint as _fingerprint
from vjpsplit_cli.cli import main

MODEL = textwrap.dedent(
    """
    import jax.numpy as jnp

    def stage(w, x):
        return jnp.tanh(x @ w)

    def other(x):
        return jnp.sin(x)
    """
)
FMTS = ("npz", "msgpack")
# An error line that only names an exception type (``error: OSError: ...``): never acceptable.
GENERIC = re.compile(r"^error: (\w+\.)*\w*(Error|Exception|Interrupt|Exit)\b")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """Valid files for every role; each case copies one and breaks it."""
    d = tmp_path_factory.mktemp("base")
    (d / "model.py").write_text(MODEL)
    s = jax.ShapeDtypeStruct
    vs.export(
        _stage,
        s((4, 3), jnp.float32),
        s(jexport.symbolic_shape("b") + (4,), jnp.float32),
        arg_names=("w", "x"),
        platforms="cpu",
    ).save(d / "art.vjps")
    vs.export(jnp.sin, s((3,), jnp.float32), arg_names=("x",), platforms="cpu").save(d / "other.vjps")
    art, other = vs.load(d / "art.vjps"), vs.load(d / "other.vjps")
    rng = np.random.default_rng(0)
    w, x = rng.normal(size=(4, 3)).astype(np.float32), rng.normal(size=(2, 4)).astype(np.float32)
    for fmt in FMTS:
        vs.save_arrays(d / f"inputs.{fmt}", {"w": w, "x": x})
        _, res = art.fwd(w, x)
        vs.save_residuals(d / f"residuals.{fmt}", res)
        vs.save_arrays(d / f"cotangents.{fmt}", {"out": np.ones((2, 3), np.float32)})
        vs.save_arrays(d / f"shapes.{fmt}", {"w": w})
        _, ores = other.fwd(np.ones(3, np.float32))
        vs.save_residuals(d / f"foreign.{fmt}", ores)
    return d


def _stage(w, x):
    return jnp.tanh(x @ w)


# ---------------------------------------------------------------- ways to break a file


def _truncate(frac):
    def f(p: Path):
        data = p.read_bytes()
        p.write_bytes(data[: max(1, int(len(data) * frac))] if frac < 1 else data[:-1])

    return f


def _other_format(p: Path):
    arrays, meta = vs.load_arrays(p)
    other = p.with_name("other." + ("msgpack" if p.suffix == ".npz" else "npz"))
    vs.save_arrays(other, arrays, meta)
    p.write_bytes(other.read_bytes())


def _unknown_version(p: Path):
    arrays, meta = vs.load_arrays(p)
    if p.suffix == ".msgpack":
        top = msgpack.unpackb(p.read_bytes(), raw=False, strict_map_key=False)
        top["version"] = 99
        p.write_bytes(msgpack.packb(top, use_bin_type=True))
    else:  # vjpsplit's header is the zip archive comment
        with zipfile.ZipFile(p, "a") as z:
            doc = json.loads(z.comment)
            doc["version"] = 99
            z.comment = json.dumps(doc).encode()


def _pickled(p: Path):
    if p.suffix == ".npz":
        with open(p, "wb") as f:
            np.savez(f, x=np.array([{"evil": 1}], dtype=object))
    else:  # msgpack cannot pickle; the nearest thing is an object dtype name
        top = {
            "format": "vjpsplit-arrays",
            "version": 1,
            "meta": {},
            "arrays": {"x": msgpack.ExtType(1, msgpack.packb(([1], "object", b"\0" * 8)))},
        }
        p.write_bytes(msgpack.packb(top, use_bin_type=True))


def _absurd_size(p: Path):
    if p.suffix == ".msgpack":
        top = {
            "format": "vjpsplit-arrays",
            "version": 1,
            "meta": {},
            "arrays": {"x": msgpack.ExtType(1, msgpack.packb(([2**40, 2**20], "float32", b"\0" * 16)))},
        }
        p.write_bytes(msgpack.packb(top, use_bin_type=True))
    else:
        buf = io.BytesIO()
        np.lib.format.write_array_header_1_0(buf, {"descr": "<f4", "fortran_order": False, "shape": (2**40, 2**20)})
        with zipfile.ZipFile(p, "w") as z:
            z.writestr("x.npy", buf.getvalue() + b"\0" * 16)


def _directory(p: Path):
    p.unlink()
    p.mkdir()


def _empty(p: Path):
    p.write_bytes(b"")


def _random(p: Path):
    p.write_bytes(np.random.default_rng(7).bytes(513))


def _missing(p: Path):
    p.unlink()


FILE_BREAKS = {
    "missing": _missing,
    "empty": _empty,
    "directory": _directory,
    "unreadable": None,
    "truncated-1/4": _truncate(0.25),
    "truncated-1/2": _truncate(0.5),
    "truncated-last-byte": _truncate(1),
    "random-bytes": _random,
    "other-format": _other_format,
    "unknown-version": _unknown_version,
    "pickled-object": _pickled,
    "absurd-size": _absurd_size,
}


def _edit_arrays(edit):
    def f(p: Path):
        arrays, meta = vs.load_arrays(p)
        vs.save_arrays(p, edit(dict(arrays)), meta)

    return f


def _first_key(arrays, prefer=None):
    return prefer if prefer in arrays else sorted(arrays)[0]


CONTENT_BREAKS = {
    "wrong-dtype": _edit_arrays(lambda a: {**a, _first_key(a, "x"): a[_first_key(a, "x")].astype(np.float16)}),
    "wrong-shape": _edit_arrays(lambda a: {**a, _first_key(a, "w"): np.zeros((5, 5), a[_first_key(a, "w")].dtype)}),
    "missing-key": _edit_arrays(lambda a: {k: v for k, v in a.items() if k != _first_key(a, "w")}),
    "extra-key": _edit_arrays(lambda a: {**a, "zz_extra": np.zeros(2, np.float32)}),
}


# ---------------------------------------------------------------- the commands and their files


def commands(d: Path, fmt: str, out: Path):
    """{(command, role): (argv, path of the role's file)} with fresh copies in ``out``."""

    def copy(name):
        src = d / name
        dst = out / name
        dst.write_bytes(src.read_bytes())
        return dst

    art = copy("art.vjps")
    inputs, res, cts = copy(f"inputs.{fmt}"), copy(f"residuals.{fmt}"), copy(f"cotangents.{fmt}")
    shapes, module = copy(f"shapes.{fmt}"), copy("model.py")
    o = lambda n: str(out / f"new_{n}.{fmt}")  # noqa: E731
    for previous in (o("res"), o("out"), o("grads"), str(out / "new.vjps")):
        Path(previous).write_bytes(b"previous output")  # a failed command must leave these as they are
    fwd = ["run-fwd", art, "--inputs", inputs, "--residuals", o("res"), "--outputs", o("out")]
    bwd = ["run-bwd", art, "--residuals", res, "--inputs", inputs, "--cotangents", cts, "--grads", o("grads")]
    exp = [
        "export",
        f"{module}:stage",
        "--shapes",
        f"w={shapes}",
        "--shapes",
        "x=f32[b,4]",
        "--platforms",
        "cpu",
        "-o",
        str(out / "new.vjps"),
    ]
    return {
        ("run-fwd", "artifact"): (fwd, art),
        ("run-fwd", "inputs"): (fwd, inputs),
        ("run-bwd", "artifact"): (bwd, art),
        ("run-bwd", "residuals"): (bwd, res),
        ("run-bwd", "inputs"): (bwd, inputs),
        ("run-bwd", "cotangents"): (bwd, cts),
        ("inspect", "artifact"): (["inspect", art], art),
        ("export", "shapes-file"): (exp, shapes),
        ("export", "module"): (exp, module),
    }


ARRAY_ROLES = [
    ("run-fwd", "inputs"),
    ("run-bwd", "residuals"),
    ("run-bwd", "inputs"),
    ("run-bwd", "cotangents"),
    ("export", "shapes-file"),
]
ARTIFACT_ROLES = [("run-fwd", "artifact"), ("run-bwd", "artifact"), ("inspect", "artifact")]


def _artifact_break(kind):
    def tamper(p: Path, mutate_top):
        top = msgpack.unpackb(p.read_bytes()[len(MAGIC) :], raw=False)
        mutate_top(top)
        p.write_bytes(MAGIC + msgpack.packb(top, use_bin_type=True))

    def flip_module(top):
        b = bytearray(top["fwd"])
        b[len(b) // 3] ^= 0x55
        top["fwd"] = bytes(b)

    def newer_format(top):
        top["manifest"]["format_version"] = 99

    def future_convention(top):
        # A consistent artifact (fingerprint recomputed) from a jax whose calling
        # convention this jax cannot run.
        m = vs.Manifest.from_json({**top["manifest"], "calling_convention_version": 10**6}, "x")
        top["manifest"]["calling_convention_version"] = 10**6
        top["manifest"]["fingerprint"] = _fingerprint(m, top)

    def not_an_artifact(p):
        vs.save_arrays(p.with_suffix(".npz"), {"x": np.zeros(3)})
        p.write_bytes(p.with_suffix(".npz").read_bytes())

    return {
        "tampered-module": lambda p: tamper(p, flip_module),
        "newer-format-version": lambda p: tamper(p, newer_format),
        "future-calling-convention": lambda p: tamper(p, future_convention),
        "an-npz-named-.vjps": not_an_artifact,
    }[kind]


CASES = []
for fmt in FMTS:
    for role in ARRAY_ROLES:
        for brk in FILE_BREAKS:
            CASES.append((fmt, role, brk))
        if role != ("export", "shapes-file"):
            CASES += [(fmt, role, brk) for brk in CONTENT_BREAKS]
    CASES.append((fmt, ("run-bwd", "residuals"), "from-another-artifact"))
for role in ARTIFACT_ROLES:
    for brk in [
        "missing",
        "empty",
        "directory",
        "unreadable",
        "truncated-1/4",
        "truncated-1/2",
        "truncated-last-byte",
        "random-bytes",
        "tampered-module",
        "newer-format-version",
        "future-calling-convention",
        "an-npz-named-.vjps",
    ]:
        CASES.append(("npz", role, brk))
for brk in ["missing", "empty", "directory", "unreadable", "random-bytes", "syntax-error"]:
    CASES.append(("npz", ("export", "module"), brk))


def _id(case):
    fmt, (cmd, role), brk = case
    return f"{cmd}-{role}-{brk}" + (f"-{fmt}" if role not in ("artifact", "module") else "")


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_bad_input(base, tmp_path, monkeypatch, case):
    fmt, role, brk = case
    argv, target = commands(base, fmt, tmp_path)[role]
    if brk == "unreadable":
        # chmod 0 does not stop root (CI runs as root): make the OS refuse instead.
        real_open = open

        def denied(path, *a, **k):
            if Path(path) == target:
                raise PermissionError(13, "Permission denied", str(path))
            return real_open(path, *a, **k)

        monkeypatch.setattr(reading_mod, "open", denied, raising=False)
        monkeypatch.setattr("builtins.open", denied)
    elif brk == "syntax-error":
        target.write_text("def stage(w, x:\n    return w\n")
    elif brk == "from-another-artifact":
        target.write_bytes((base / f"foreign.{fmt}").read_bytes())
    elif brk in FILE_BREAKS:
        FILE_BREAKS[brk](target)
    elif brk in CONTENT_BREAKS:
        CONTENT_BREAKS[brk](target)
    else:
        _artifact_break(brk)(target)
    before = _snapshot(tmp_path)
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(main, [str(a) for a in argv])
    err = r.stderr.strip()
    # A --shapes file that is not there (or cannot be opened) is a mistake in the command line.
    usage = role == ("export", "shapes-file") and brk in ("missing", "directory", "unreadable")
    assert r.exit_code == (2 if usage else 1), (r.exit_code, r.output, err)
    assert "Traceback" not in r.output + r.stderr
    assert err.startswith("error: ") and len(err.splitlines()) == 1, err
    assert not GENERIC.match(err), f"a bare exception type, not a message: {err}"
    assert target.name in err, f"the message does not name {target.name}: {err}"
    assert _snapshot(tmp_path) == before, "a failed command left a file behind or changed one"


def _snapshot(d: Path) -> dict:
    """Each entry's kind and, for files, a digest read with os calls (tests may patch open())."""
    out = {}
    for name in os.listdir(d):
        st = os.lstat(d / name)
        if not stat.S_ISREG(st.st_mode):
            out[name] = stat.filemode(st.st_mode)
            continue
        fd = os.open(d / name, os.O_RDONLY)
        try:
            h = hashlib.sha256()
            while chunk := os.read(fd, 1 << 20):
                h.update(chunk)
        finally:
            os.close(fd)
        out[name] = h.hexdigest()
    return out


def test_matrix_size():
    """docs/reliability.md quotes this count; keep them in step."""
    assert len(CASES) == 196
