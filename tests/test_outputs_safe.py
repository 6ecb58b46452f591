"""Outputs are safe: checked before any work, never an input, all or none, no temp files, one-line errors.

Each CLI case asserts the exit code, exactly one stderr line that names the file
or option, no traceback, no file added to the directory (temp files included),
and every file there byte-identical to before (inputs and previous outputs).
docs/reliability.md quotes the number of cases collected here.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

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
from vjpsplit_cli.safeio import filesystem, signals
from vjpsplit_cli.safeio.outputs import StagedOutputs, UsageError, check_outputs
from vjpsplit_cli.safeio.reading import os_error_message
from vjpsplit_cli.terminal import printable

MODEL = textwrap.dedent(
    """
    import jax.numpy as jnp

    def loss(w, x):
        return jnp.sum(jnp.tanh(x @ w) ** 2)
    """
)
# An error line that only names an exception type: what this suite forbids.
GENERIC = re.compile(r"^error: (\w+\.)*\w*(Error|Exception|Interrupt|Exit)\b")


def _loss(w, x):
    return jnp.sum(jnp.tanh(x @ w) ** 2)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """One valid file for every role: artifact (with the split backward), inputs, residuals, intermediates."""
    d = tmp_path_factory.mktemp("outputs_base")
    (d / "model.py").write_text(MODEL)
    s = jax.ShapeDtypeStruct
    art = vs.export(
        _loss,
        s((4, 3), jnp.float32),
        s(jexport.symbolic_shape("b") + (4,), jnp.float32),
        arg_names=("w", "x"),
        weights=["w"],
        platforms="cpu",
    )
    art.save(d / "art.vjps")
    art = vs.load(d / "art.vjps")
    rng = np.random.default_rng(0)
    w, x = rng.normal(size=(4, 3)).astype(np.float32), rng.normal(size=(2, 4)).astype(np.float32)
    vs.save_arrays(d / "in.npz", {"w": w, "x": x})
    vs.save_arrays(d / "shapes.npz", {"w": w})
    vs.save_arrays(d / "ct.npz", {"out": np.float32(1)})
    _, res = art.fwd(w, x)
    vs.save_residuals(d / "res.npz", res)
    _, inter = art.bwd_input(res)
    vs.save_intermediates(d / "inter.npz", inter)
    # Previous outputs, so a test can tell "left as it was" from "replaced".
    for name in ("r.npz", "o.npz", "g.npz", "i.npz", "new.vjps"):
        (d / name).write_bytes(b"previous " + name.encode())
    return d


@pytest.fixture
def ws(base, tmp_path, monkeypatch):
    for p in base.iterdir():
        (tmp_path / p.name).write_bytes(p.read_bytes())
    monkeypatch.chdir(tmp_path)
    return tmp_path


def snapshot(d: Path) -> dict:
    """Every entry of ``d``: its kind, and a digest of its bytes for regular files."""
    out = {}
    for name in os.listdir(d):
        p = d / name
        st = os.lstat(p)
        if stat.S_ISREG(st.st_mode):
            out[name] = hashlib.sha256(p.read_bytes()).hexdigest()
        elif stat.S_ISLNK(st.st_mode):
            out[name] = "link -> " + os.readlink(p)
        else:
            out[name] = stat.filemode(st.st_mode)[0]
    return out


def invoke(args):
    return CliRunner().invoke(main, [str(a) for a in args])


def assert_one_line(r, code: int, *needles):
    err = r.stderr.strip()
    assert r.exit_code == code, (r.exit_code, r.output, r.stderr)
    assert "Traceback" not in r.output + r.stderr
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    assert not GENERIC.match(err), f"a generic exception line: {err}"
    for n in needles:
        assert str(n) in err, (n, err)
    return err


def assert_refused(ws: Path, args, code: int, *needles):
    """Run a command that must fail: one line, and nothing in ``ws`` added, removed or changed."""
    before = snapshot(ws)
    r = invoke(args)
    err = assert_one_line(r, code, *needles)
    assert snapshot(ws) == before, "a refused command changed, added or removed a file"
    return err


FWD = ["run-fwd", "art.vjps", "--inputs", "in.npz"]
BWD = ["run-bwd", "art.vjps", "--residuals", "res.npz", "--inputs", "in.npz"]
EXPORT = ["export", "model.py:loss", "--shapes", "w=f32[4,3]", "--shapes", "x=f32[b,4]", "--platforms", "cpu"]

# ---------------------------------------------------------------- an output that is an input (exit 2)

SAME_FILE = {
    "export -o the module file": (EXPORT + ["-o", "model.py"], "model.py"),
    "export -o the dotted module's file": (["export", "model:loss", *EXPORT[2:], "-o", "model.py"], "model.py"),
    "export -o the --shapes file": (
        [
            "export",
            "model.py:loss",
            "--shapes",
            "w=shapes.npz",
            "--shapes",
            "x=f32[b,4]",
            "--platforms",
            "cpu",
            "-o",
            "shapes.npz",
        ],
        "shapes.npz",
    ),
    "run-fwd --residuals = --inputs": (FWD + ["--residuals", "in.npz"], "in.npz"),
    "run-fwd --residuals = --inputs, other spelling": (FWD + ["--residuals", "./sub/../in.npz"], "in.npz"),
    "run-fwd --residuals = a symlink to --inputs": (FWD + ["--residuals", "link.npz"], "link.npz"),
    "run-fwd --residuals = a hard link to --inputs": (FWD + ["--residuals", "hard.npz"], "hard.npz"),
    "run-fwd --outputs = --inputs": (FWD + ["--residuals", "r.npz", "--outputs", "in.npz"], "in.npz"),
    "run-fwd --outputs = --residuals": (FWD + ["--residuals", "r.npz", "--outputs", "r.npz"], "r.npz"),
    "run-bwd --grads = --inputs": (BWD + ["--grads", "in.npz"], "in.npz"),
    "run-bwd --grads = --residuals": (BWD + ["--grads", "res.npz"], "res.npz"),
    "run-bwd --grads = --cotangents": (BWD + ["--cotangents", "ct.npz", "--grads", "ct.npz"], "ct.npz"),
    "run-bwd --part input --intermediates = --residuals": (
        BWD + ["--part", "input", "--grads", "g.npz", "--intermediates", "res.npz"],
        "res.npz",
    ),
    "run-bwd --part input --intermediates = --grads": (
        BWD + ["--part", "input", "--grads", "g.npz", "--intermediates", "g.npz"],
        "g.npz",
    ),
    "run-bwd --part weight --grads = --intermediates": (
        BWD + ["--part", "weight", "--intermediates", "inter.npz", "--grads", "inter.npz"],
        "inter.npz",
    ),
}


@pytest.mark.parametrize("case", list(SAME_FILE))
def test_an_output_that_is_an_input_is_a_usage_error(ws, case):
    args, named = SAME_FILE[case]
    (ws / "sub").mkdir()
    os.symlink("in.npz", ws / "link.npz")
    os.link(ws / "in.npz", ws / "hard.npz")
    assert_refused(ws, args, 2, named)


# ---------------------------------------------------------------- targets that are not regular files


def _fifo(ws):
    os.mkfifo(ws / "fifo.npz")


def _dir(ws):
    (ws / "dir.npz").mkdir()


def _link_to_dir(ws):
    (ws / "realdir").mkdir()
    os.symlink("realdir", ws / "linkdir.npz")


TARGETS = {
    "--residuals -": (FWD + ["--residuals", "-"], 2, "--residuals", None),
    "-o -": (EXPORT + ["-o", "-"], 2, "'-o'", None),
    "--grads -": (BWD + ["--grads", "-"], 2, "--grads", None),
    "--residuals empty name": (FWD + ["--residuals", ""], 2, "--residuals", None),
    "--residuals names a directory (trailing /)": (FWD + ["--residuals", "out.npz/"], 2, "out.npz/", None),
    "--residuals is a directory": (FWD + ["--residuals", "dir.npz"], 1, "dir.npz", _dir),
    "--residuals links to a directory": (FWD + ["--residuals", "linkdir.npz"], 1, "linkdir.npz", _link_to_dir),
    "--grads is a FIFO": (BWD + ["--grads", "fifo.npz"], 1, "fifo.npz", _fifo),
    "-o is a character device": (EXPORT + ["-o", "/dev/null"], 1, "/dev/null", None),
    "--residuals /dev/null (no array extension)": (FWD + ["--residuals", "/dev/null"], 2, "/dev/null", None),
    "--residuals in a missing directory": (FWD + ["--residuals", "nodir/r.npz"], 1, "nodir", None),
    "--outputs in a missing directory": (FWD + ["--residuals", "r.npz", "--outputs", "nodir/o.npz"], 1, "nodir", None),
    "--residuals under a file": (FWD + ["--residuals", "in.npz/r.npz"], 1, "in.npz", None),
    "--outputs with a bad extension": (FWD + ["--residuals", "r.npz", "--outputs", "o.txt"], 2, "o.txt", None),
    "--grads with no extension": (BWD + ["--grads", "grads"], 2, "grads", None),
    "--intermediates with a bad extension": (
        BWD + ["--part", "input", "--grads", "g.npz", "--intermediates", "i.bin"],
        2,
        "i.bin",
        None,
    ),
    "--grads in a missing directory with --part input": (
        BWD + ["--part", "input", "--grads", "nodir/g.npz", "--intermediates", "i.npz"],
        1,
        "nodir",
        None,
    ),
    "--intermediates with --part all": (
        BWD + ["--grads", "g.npz", "--intermediates", "i.npz"],
        2,
        "--intermediates",
        None,
    ),
}


@pytest.mark.parametrize("case", list(TARGETS))
def test_unusable_targets_are_refused_and_nothing_changes(ws, case):
    args, code, named, setup = TARGETS[case]
    if setup:
        setup(ws)
    assert_refused(ws, args, code, named)


@pytest.mark.parametrize("cmd", ["run-fwd", "export"])
def test_a_read_only_target_is_refused_exactly_when_open_wb_would_be(ws, cmd):
    target = ws / ("r.npz" if cmd == "run-fwd" else "new.vjps")
    target.chmod(0o444)
    try:
        with open(target, "ab"):  # what open(..., 'wb') would say, without truncating (root may write anyway)
            writable = True
    except PermissionError:
        writable = False
    args = (FWD + ["--residuals", target.name]) if cmd == "run-fwd" else (EXPORT + ["-o", target.name])
    if writable:
        r = invoke(args)
        assert r.exit_code == 0, r.stderr
        assert stat.S_IMODE(target.stat().st_mode) == 0o444, "the replaced file lost its mode"
    else:
        assert_refused(ws, args, 1, target.name, "read-only")


# ---------------------------------------------------------------- all or none


def _fail_second_write(monkeypatch, exc: BaseException) -> list:
    """Make the writer of a command's second output raise ``exc``; the first output is staged by then."""
    real = StagedOutputs.write
    labels: list = []

    def write(self, label, writer):
        labels.append(label)
        if len(labels) == 2:

            def writer(tmp):
                Path(tmp).write_bytes(b"half written")  # a partial temp file must go too
                raise exc

        return real(self, label, writer)

    monkeypatch.setattr(StagedOutputs, "write", write)
    return labels


FAILURES = {
    "clean error": vs.VjpsplitError("disk says no"),
    "full disk": OSError(errno.ENOSPC, "No space left on device"),
    "file-size limit": OSError(errno.EFBIG, "File too large"),
    "read-only file system": OSError(errno.EROFS, "Read-only file system"),
    "permission denied": OSError(errno.EACCES, "Permission denied"),
    "out of memory": MemoryError(),
}


@pytest.mark.parametrize("failure", list(FAILURES))
def test_run_fwd_replaces_both_outputs_or_neither(ws, monkeypatch, failure):
    labels = _fail_second_write(monkeypatch, FAILURES[failure])
    assert_refused(ws, FWD + ["--residuals", "r.npz", "--outputs", "o.npz"], 1, "o.npz")
    assert labels == ["--residuals", "--outputs"]


@pytest.mark.parametrize("failure", list(FAILURES))
def test_run_bwd_part_input_replaces_grads_and_intermediates_or_neither(ws, monkeypatch, failure):
    labels = _fail_second_write(monkeypatch, FAILURES[failure])
    assert_refused(ws, BWD + ["--part", "input", "--grads", "g.npz", "--intermediates", "i.npz"], 1, "g.npz")
    assert labels == ["--intermediates", "--grads"]


def test_a_successful_command_replaces_every_output(ws):
    before = snapshot(ws)
    r = invoke(BWD + ["--part", "input", "--grads", "g.npz", "--intermediates", "i.npz"])
    assert r.exit_code == 0, r.stderr
    after = snapshot(ws)
    assert after["g.npz"] != before["g.npz"] and after["i.npz"] != before["i.npz"]
    assert set(after) == set(before), "a temp file was left"
    assert vs.load_arrays(ws / "g.npz")[0] and vs.load_arrays(ws / "i.npz")[0]


# ---------------------------------------------------------------- symlinks and modes


def test_a_symlinked_output_is_written_through_and_the_link_stays(ws):
    (ws / "real").mkdir()
    (ws / "real" / "r.npz").write_bytes(b"previous")
    os.symlink("real/r.npz", ws / "link.npz")
    os.symlink("real/new.npz", ws / "dangling.npz")
    r = invoke(FWD + ["--residuals", "link.npz", "--outputs", "dangling.npz"])
    assert r.exit_code == 0, r.stderr
    assert os.readlink(ws / "link.npz") == "real/r.npz" and os.readlink(ws / "dangling.npz") == "real/new.npz"
    assert vs.load_arrays(ws / "real" / "r.npz")[1]["kind"] == "vjpsplit-residuals"
    assert "out" in vs.load_arrays(ws / "real" / "new.npz")[0]
    assert sorted(os.listdir(ws / "real")) == ["new.npz", "r.npz"], "a temp file was left beside the target"


def test_a_replaced_file_keeps_its_mode(ws):
    (ws / "g.npz").chmod(0o640)
    r = invoke(BWD + ["--grads", "g.npz"])
    assert r.exit_code == 0, r.stderr
    assert stat.S_IMODE((ws / "g.npz").stat().st_mode) == 0o640


# ---------------------------------------------------------------- bad and huge dims (exit 2)

DIMS = {
    "superscript digit": ["--shapes", "x=f32[²,4]"],
    "dim named mod": ["--shapes", "x=f32[mod,4]"],
    "dim named max": ["--shapes", "x=f32[max,4]"],
    "dim named floordiv": ["--shapes", "x=f32[floordiv,4]"],
    "dim named _": ["--shapes", "x=f32[_,4]"],
    "huge dim": ["--shapes", "x=f32[99999999999999999999999,4]"],
    "huge element count": ["--shapes", "x=f32[4294967296,4294967296]"],
    "negative dim": ["--shapes", "x=f32[-1,4]"],
    "unknown dtype": ["--shapes", "x=f33[b,4]"],
    "not NAME=SPEC": ["--shapes", "f32[b,4]"],
}
AT = {
    "export --at superscript": ["export", *EXPORT[1:], "--memory-budget", "1MiB", "--at", "b=²", "-o", "new.vjps"],
    "inspect --at superscript": ["inspect", "art.vjps", "--at", "b=²"],
    "inspect --at huge": ["inspect", "art.vjps", "--at", "b=99999999999999999999999"],
    "inspect --at zero": ["inspect", "art.vjps", "--at", "b=0"],
    "inspect --at no name": ["inspect", "art.vjps", "--at", "=3"],
    "plan --at superscript": [
        "plan",
        "model.py:loss",
        "--shapes",
        "w=f32[4,3]",
        "--shapes",
        "x=f32[b,4]",
        "--at",
        "b=²",
    ],
}


@pytest.mark.parametrize("case", list(DIMS))
def test_bad_dims_in_shapes_are_usage_errors(ws, case):
    args = ["export", "model.py:loss", "--shapes", "w=f32[4,3]", *DIMS[case], "-o", "new.vjps"]
    assert_refused(ws, args, 2, "--shapes")


@pytest.mark.parametrize("case", list(AT))
def test_bad_sizes_in_at_are_usage_errors(ws, case):
    assert_refused(ws, AT[case], 2, "--at")


# ---------------------------------------------------------------- every error path: one specific line

INJECTED = {
    "KeyError": KeyError("zzz"),
    "TypeError": TypeError("sequence item 0: expected str instance, int found"),
    "ValueError": ValueError("bad value\nsecond line"),
    "AttributeError": AttributeError("'NoneType' object has no attribute 'shape'"),
    "IndexError": IndexError("list index out of range"),
    "RecursionError": RecursionError("maximum recursion depth exceeded"),
    "RuntimeError": RuntimeError("XLA said no"),
    "ENOSPC": OSError(errno.ENOSPC, "No space left on device"),
    "EFBIG": OSError(errno.EFBIG, "File too large"),
    "EACCES": PermissionError(errno.EACCES, "Permission denied", "data.bin"),
    "EROFS": OSError(errno.EROFS, "Read-only file system"),
    "EIO": OSError(errno.EIO, "Input/output error"),
    "MemoryError": MemoryError(),
}
# (command line, module attribute the command calls first, what the line must name)
ENTRY = {
    "run-fwd": (FWD + ["--residuals", "r.npz"], "artifact.loading.load", "art.vjps"),
    "run-bwd": (BWD + ["--grads", "g.npz"], "artifact.loading.load", "art.vjps"),
    "inspect": (["inspect", "art.vjps"], "artifact.loading.load", "art.vjps"),
    "export": (EXPORT + ["-o", "new.vjps"], "cli.specs.load_object", "model.py"),
    "plan": (["plan", *EXPORT[1:6]], "cli.specs.load_object", "model.py"),
}


@pytest.mark.parametrize("exc", list(INJECTED))
@pytest.mark.parametrize("cmd", list(ENTRY))
def test_no_error_is_a_bare_exception_type(ws, monkeypatch, cmd, exc):
    """Whatever goes wrong inside a command, the line names a file and says what to do."""
    args, where, named = ENTRY[cmd]
    module, attr = where.rsplit(".", 1)
    import importlib

    def boom(*a, **k):
        raise INJECTED[exc]

    monkeypatch.setattr(importlib.import_module(f"vjpsplit_cli.{module}"), attr, boom)
    err = assert_refused(ws, args, 1, "data.bin" if exc == "EACCES" else named)  # an OS error names its own file
    assert ";" in err, f"the line does not say what to do: {err}"


def _forge(path: Path, edit):
    """Edit an artifact's manifest and recompute its fingerprint: consistent bytes, nonsense content."""
    top = msgpack.unpackb(path.read_bytes()[len(MAGIC) :], raw=False)
    edit(top["manifest"])
    top["manifest"]["fingerprint"] = fingerprint_json(top["manifest"], top)
    path.write_bytes(MAGIC + msgpack.packb(top, use_bin_type=True))


# forgery -> commands that may live with it (and must then print it safely); the rest must refuse it.
FORGERIES = {
    "arg name not a string": (lambda m: m.update(arg_names=[1, 2]), ()),
    "unknown dtype": (lambda m: m["inputs"][0].update(dtype="zzz"), ()),
    "shape not a list": (lambda m: m["inputs"][0].update(shape=5), ()),
    "inputs missing": (lambda m: m.pop("inputs"), ()),
    "platforms not a list": (lambda m: m.update(platforms=7), ()),
    # The manifest no longer agrees with itself: its input-backed residual names no input.
    "key with a newline and escape code": (lambda m: m["inputs"][0].update(key="w\n\x1b[31mred"), ()),
    # Only a label: every command lives with it, and inspect shows it escaped.
    "function name with an escape code": (lambda m: m.update(function="m:f\x1b[31mred"), ("inspect", "run-fwd")),
}


@pytest.mark.parametrize("cmd", ["run-fwd", "inspect"])
@pytest.mark.parametrize("forgery", list(FORGERIES))
def test_forged_manifests_give_one_specific_line(ws, cmd, forgery):
    edit, tolerated_by = FORGERIES[forgery]
    _forge(ws / "art.vjps", edit)
    args = FWD + ["--residuals", "r.npz"] if cmd == "run-fwd" else ["inspect", "art.vjps"]
    before = snapshot(ws)
    r = invoke(args)
    if cmd in tolerated_by:
        assert r.exit_code == 0, r.output + r.stderr
        assert "\x1b" not in r.output + r.stderr
        assert cmd != "inspect" or "m:f\\x1b[31mred" in r.output
        return
    assert snapshot(ws) == before
    err = assert_one_line(r, 1)
    assert "art.vjps" in err or "in.npz" in err, err  # the artifact, or the inputs it no longer matches
    assert "\x1b" not in err


# ---------------------------------------------------------------- printing names from files


def test_paths_with_newlines_and_escape_codes_print_escaped(ws):
    name = "evil\n\x1b[2Jname.npz"
    assert_refused(ws, FWD + ["--residuals", f"nodir/{name}"], 1, "evil\\n\\x1b[2Jname.npz")
    r = invoke(BWD + ["--grads", f"{name}/g.npz"])
    assert r.exit_code != 0 and "\x1b" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_inspect_table_escapes_keys_from_the_file(ws):
    for name, key in (("evil", "a\nb\x1b[31m"), ("plain", "ab")):
        spec = {key: jax.ShapeDtypeStruct((2,), jnp.float32)}
        vs.export(lambda p, key=key: jnp.sum(p[key] ** 2), spec, platforms="cpu").save(ws / f"{name}.vjps")
    r, plain = invoke(["inspect", "evil.vjps"]), invoke(["inspect", "plain.vjps"])
    assert r.exit_code == 0 and plain.exit_code == 0, r.stderr
    assert "\x1b" not in r.output and "a\\nb\\x1b[31m" in r.output
    assert len(r.output.splitlines()) == len(plain.output.splitlines()), "a key's newline started a new line"


def test_printable():
    assert printable("plain ü ✓") == "plain ü ✓"
    assert printable("a\nb\r\t\x1b[0m\x7f\u202e\u2028") == "a\\nb\\r\\t\\x1b[0m\\x7f\\u202e\\u2028"
    assert printable(os.fsdecode(b"bad\xffname")) == "bad\\xffname"


@pytest.mark.parametrize(
    "code,needle",
    [
        (errno.ENOSPC, "no space left"),
        (errno.EFBIG, "ulimit -f"),
        (errno.EACCES, "permission denied"),
        (errno.EROFS, "read-only"),
        (errno.ENOENT, "no such file"),
        (errno.EDQUOT, "quota"),
        (errno.EIO, "input/output error"),
        (errno.EXDEV, "check the path"),
    ],
)
def test_os_errors_become_specific_lines(code, needle):
    text = os_error_message("out/g\n.npz", OSError(code, os.strerror(code)), "writing it")
    assert text.startswith("out/g\\n.npz: ") and needle in text and ";" in text and "\n" not in text


# ---------------------------------------------------------------- the compilation cache


def test_an_unusable_cache_directory_is_quietly_turned_off(ws, tmp_path):
    not_a_dir = tmp_path / "cache-file"
    not_a_dir.write_bytes(b"")
    env = {**os.environ, "VJPSPLIT_CACHE_DIR": str(not_a_dir / "sub")}
    base = [sys.executable, "-m", "vjpsplit_cli"]
    r = subprocess.run(
        base + FWD + ["--residuals", "r.npz"], capture_output=True, text=True, env=env, cwd=ws, timeout=300
    )
    assert r.returncode == 0 and r.stderr.strip().splitlines() == [r.stderr.strip()], r.stderr
    assert r.stderr.startswith("wrote r.npz")
    r = subprocess.run(
        base + ["--debug"] + FWD + ["--residuals", "r.npz"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ws,
        timeout=300,
    )
    assert r.returncode == 0
    assert [line for line in r.stderr.splitlines() if "compilation cache" in line] == [
        f"debug: compilation cache {not_a_dir / 'sub'} unusable (Not a directory); running without it"
    ]


# ---------------------------------------------------------------- a real file-size limit

LIMITED = """
import resource, runpy, sys
resource.setrlimit(resource.RLIMIT_FSIZE, (300, 300))  # the residuals file is larger
sys.argv = ["vjpsplit", *sys.argv[1:]]
runpy.run_module("vjpsplit_cli", run_name="__main__")
"""


def test_a_file_size_limit_is_one_line_and_keeps_the_previous_files(ws):
    before = snapshot(ws)
    # The limit is set in the child itself: no preexec_fn, which forks this multithreaded (JAX) process.
    r = subprocess.run(
        [sys.executable, "-c", LIMITED, "--no-cache"] + FWD + ["--residuals", "r.npz", "--outputs", "o.npz"],
        capture_output=True,
        text=True,
        cwd=ws,
        timeout=300,
    )
    err = r.stderr.strip()
    assert r.returncode == 1 and len(err.splitlines()) == 1, err
    assert "r.npz" in err and "ulimit -f" in err and not GENERIC.match(err)
    assert snapshot(ws) == before


# ---------------------------------------------------------------- the Python API


def test_staged_outputs_commit_all_or_none(tmp_path):
    a, b = tmp_path / "a.npz", tmp_path / "b.msgpack"
    a.write_bytes(b"old a")
    b.write_bytes(b"old b")
    with pytest.raises(vs.VjpsplitError, match="b.msgpack"):
        with StagedOutputs({"a": a, "b": b}) as out:
            out.write("a", lambda p: vs.save_arrays(p, {"x": np.ones(2)}))
            out.write("b", lambda p: vs.save_arrays(p, {"x": np.array(["strings"])}))  # refused by save_arrays
    assert a.read_bytes() == b"old a" and b.read_bytes() == b"old b"
    assert sorted(os.listdir(tmp_path)) == ["a.npz", "b.msgpack"]
    with StagedOutputs({"a": a, "b": b}) as out:
        out.write("a", lambda p: vs.save_arrays(p, {"x": np.ones(2)}))
        out.write("b", lambda p: vs.save_arrays(p, {"x": np.zeros(3)}))
        assert a.read_bytes() == b"old a", "committed before the block ended"
    assert vs.load_arrays(a)[0]["x"].tolist() == [1, 1] and vs.load_arrays(b)[0]["x"].tolist() == [0, 0, 0]
    assert sorted(os.listdir(tmp_path)) == ["a.npz", "b.msgpack"]


def test_check_outputs_from_python(tmp_path):
    inp = tmp_path / "in.npz"
    inp.write_bytes(b"x")
    os.link(inp, tmp_path / "hard.npz")
    with pytest.raises(UsageError, match="same file as inputs"):
        check_outputs({"grads": tmp_path / "hard.npz"}, {"inputs": inp})
    with pytest.raises(UsageError, match="both name"):
        check_outputs({"a": tmp_path / "o.npz", "b": str(tmp_path / "sub" / ".." / "o.npz")})
    (tmp_path / "sub").mkdir()
    assert check_outputs({"a": tmp_path / "o.npz", "b": None}) == {"a": str(tmp_path / "o.npz")}


def test_save_arrays_refuses_devices_and_writes_through_symlinks(tmp_path):
    if os.path.exists("/dev/null"):
        os.symlink("/dev/null", tmp_path / "null.npz")
        with pytest.raises(vs.VjpsplitError, match="character device"):
            vs.save_arrays(tmp_path / "null.npz", {"x": np.ones(1)})
    (tmp_path / "t.npz").write_bytes(b"old")
    os.symlink("t.npz", tmp_path / "l.npz")
    vs.save_arrays(tmp_path / "l.npz", {"x": np.ones(1)})
    assert os.path.islink(tmp_path / "l.npz") and vs.load_arrays(tmp_path / "t.npz")[0]["x"].tolist() == [1]


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        ({"platforms": None}, "platforms=None"),
        ({"platforms": 5}, "platforms=5"),
        ({"wrt": 1.5}, "wrt entry 1.5"),
        ({"wrt": [0, "nope"]}, "'nope'"),
        ({"platforms": "cpu,gpu9"}, "gpu9"),
    ],
)
def test_api_bad_arguments_raise_vjpsplit_error(kwargs, needle):
    with pytest.raises(vs.VjpsplitError) as ei:
        vs.export(
            _loss,
            jax.ShapeDtypeStruct((4, 3), jnp.float32),
            jax.ShapeDtypeStruct((2, 4), jnp.float32),
            **{"platforms": "cpu", **kwargs},
        )
    assert needle in str(ei.value) and "\n" not in str(ei.value)


def test_cli_and_api_give_the_same_message(ws):
    r = invoke(EXPORT[:-1] + ["cpu,gpu9", "-o", "new.vjps"])
    err = assert_one_line(r, 1)
    with pytest.raises(vs.VjpsplitError) as ei:
        vs.export(
            _loss,
            jax.ShapeDtypeStruct((4, 3), jnp.float32),
            jax.ShapeDtypeStruct((2, 4), jnp.float32),
            platforms="cpu,gpu9",
        )
    assert err == f"error: {ei.value}"


def test_case_count():
    """docs/reliability.md quotes this count; keep them in step."""
    assert len(CASES) == 142


CASES = (
    [("same-file", c) for c in SAME_FILE]
    + [("target", c) for c in TARGETS]
    + [("read-only", c) for c in range(2)]
    + [("all-or-none", f, c) for f in FAILURES for c in range(2)]
    + [("dims", c) for c in DIMS]
    + [("at", c) for c in AT]
    + [("injected", e, c) for e in INJECTED for c in ENTRY]
    + [("forged", f, c) for f in FORGERIES for c in range(2)]
)


@pytest.mark.usefixtures("sigint_default")
def test_sigint_inside_staged_outputs_removes_temps_then_raises_keyboard_interrupt(tmp_path):
    import signal

    (tmp_path / "a.npz").write_bytes(b"old")
    with pytest.raises(KeyboardInterrupt):
        with StagedOutputs({"a": tmp_path / "a.npz"}) as out:
            out.write("a", lambda p: vs.save_arrays(p, {"x": np.ones(2)}))
            signal.raise_signal(signal.SIGINT)
    assert os.listdir(tmp_path) == ["a.npz"] and (tmp_path / "a.npz").read_bytes() == b"old"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert not signals.live_temps() and not signals.staged_temps()


@pytest.mark.usefixtures("sigint_default")
@pytest.mark.parametrize("where", ["gc callback", "__del__"])
def test_a_signal_handled_where_python_drops_exceptions_still_stops_the_write(tmp_path, capfd, where):
    # Python runs the handler between any two bytecodes, also inside a garbage-collector
    # callback (jax registers one) or a __del__, where its exception is printed and
    # dropped: the write went on to its end (seen in CI as a flaky crash-safety test).
    # The guard sends the signal again, and the write stops as anywhere else.
    import gc
    import signal
    import time

    (tmp_path / "a.npz").write_bytes(b"old")
    fired, slept = [], []

    def in_gc(phase, info):
        if phase == "start" and not fired:
            fired.append(phase)
            signal.raise_signal(signal.SIGINT)  # the handler runs here, inside the callback

    class Dropped:
        def __del__(self):
            fired.append("del")
            signal.raise_signal(signal.SIGINT)

    def writer(p):
        vs.save_arrays(p, {"x": np.ones(2)})
        gc.callbacks.append(in_gc)
        try:
            if where == "gc callback":
                gc.collect()
            else:
                Dropped()  # dropped at once: __del__ runs here
            for _ in range(500):  # the signal sent again lands here
                time.sleep(0.01)
                slept.append(1)
        finally:
            gc.callbacks.remove(in_gc)

    hook = sys.unraisablehook
    with pytest.raises(KeyboardInterrupt):
        with StagedOutputs({"a": tmp_path / "a.npz"}) as out:
            out.write("a", writer)
    assert fired and len(slept) < 500  # stopped mid-write, not held until the end
    assert os.listdir(tmp_path) == ["a.npz"] and (tmp_path / "a.npz").read_bytes() == b"old"
    assert "Exception ignored" not in capfd.readouterr().err
    assert sys.unraisablehook is hook and signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_signal_goes_on_to_the_previous_handler_after_cleanup(tmp_path):
    import signal

    seen = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    try:
        with pytest.raises(signals.Interrupted):
            with StagedOutputs({"a": tmp_path / "a.npz", "b": tmp_path / "b.npz"}) as out:
                out.write("a", lambda p: vs.save_arrays(p, {"x": np.ones(2)}))
                signal.raise_signal(signal.SIGTERM)
                pytest.fail("the signal did not interrupt the block")
        assert seen == [signal.SIGTERM] and os.listdir(tmp_path) == []
        with StagedOutputs({"a": tmp_path / "a.npz"}) as out:  # and the next block works as usual
            out.write("a", lambda p: vs.save_arrays(p, {"x": np.ones(2)}))
        assert os.listdir(tmp_path) == ["a.npz"]
    finally:
        signal.signal(signal.SIGTERM, previous)


# ---------------------------------------------------------------- fsync: only when asked, then every output


@pytest.fixture
def fsynced(monkeypatch):
    """The inodes that os.fsync was called on (a temp file keeps its inode when it is renamed into place)."""
    seen = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: seen.append(os.fstat(fd).st_ino) or real(fd))
    monkeypatch.delenv("VJPSPLIT_FSYNC", raising=False)
    return seen


FSYNC_RUNS = {
    "run-fwd": (FWD + ["--residuals", "r.npz", "--outputs", "o.npz"], ["r.npz", "o.npz"]),
    "run-bwd": (BWD + ["--grads", "g.npz"], ["g.npz"]),
    "run-bwd --part input": (
        BWD + ["--part", "input", "--grads", "g.npz", "--intermediates", "i.npz"],
        ["g.npz", "i.npz"],
    ),
}


@pytest.mark.parametrize("how", ["default", "--fsync", "VJPSPLIT_FSYNC=1"])
@pytest.mark.parametrize("run", list(FSYNC_RUNS))
def test_outputs_are_fsynced_exactly_when_asked(ws, fsynced, monkeypatch, run, how):
    args, outputs = FSYNC_RUNS[run]
    if how == "--fsync":
        args = args + ["--fsync"]
    elif how != "default":
        monkeypatch.setenv("VJPSPLIT_FSYNC", "1")
    r = invoke(["--no-cache"] + args)
    assert r.exit_code == 0, r.stderr
    if how == "default":
        assert fsynced == [], "a default run must not fsync: residuals, outputs and grads are transient"
    else:
        for name in outputs:
            assert (ws / name).stat().st_ino in fsynced, f"{name} was not fsynced"
        assert ws.stat().st_ino in fsynced, "the renames into the directory were not fsynced"


def test_the_python_api_fsyncs_when_asked(ws, fsynced):
    art = vs.load("art.vjps")
    arrays, _ = vs.load_arrays("in.npz")
    _, res = art.fwd(arrays["w"], arrays["x"])
    _, inter = art.bwd_input(res)
    vs.save_residuals("r.npz", res)
    vs.save_intermediates("i.npz", inter)
    vs.save_arrays("o.npz", {"x": np.ones(2)})
    assert fsynced == []
    vs.save_residuals("r.npz", res, fsync=True)
    vs.save_intermediates("i.npz", inter, fsync=True)
    vs.save_arrays("o.npz", {"x": np.ones(2)}, fsync=True)
    assert {(ws / n).stat().st_ino for n in ("r.npz", "i.npz", "o.npz")} <= set(fsynced)


def test_staged_outputs_fsync_whatever_the_writer_does(tmp_path, fsynced):
    def raw(p):
        with open(p, "wb") as f:  # a writer that never fsyncs on its own
            f.write(b"data")

    with StagedOutputs({"a": tmp_path / "a.bin"}) as out:
        out.write("a", raw)
    assert fsynced == []
    with StagedOutputs({"a": tmp_path / "a.bin"}, fsync=True) as out:
        out.write("a", raw)
    assert (tmp_path / "a.bin").stat().st_ino in fsynced and tmp_path.stat().st_ino in fsynced
    assert os.listdir(tmp_path) == ["a.bin"]


# ---------------------------------------------------------------- the swap into place (renameat2) and its fallback


def test_renameat2_exchange_swaps_two_files_where_the_system_has_it(tmp_path):
    exchange = filesystem.renameat2()
    if sys.platform.startswith("linux") and os.confstr("CS_GNU_LIBC_VERSION"):
        major, minor = map(int, os.confstr("CS_GNU_LIBC_VERSION").split()[1].split(".")[:2])
        assert (exchange is not None) == ((major, minor) >= (2, 28))
    if exchange is None:
        return
    (tmp_path / "a").write_bytes(b"A")
    (tmp_path / "b").write_bytes(b"B")
    if exchange(str(tmp_path / "a"), str(tmp_path / "b")):  # False: this file system cannot swap (EINVAL)
        assert (tmp_path / "a").read_bytes() == b"B" and (tmp_path / "b").read_bytes() == b"A"
    assert exchange(str(tmp_path / "a"), str(tmp_path / "missing")) is False  # failed, changed nothing
    assert sorted(os.listdir(tmp_path)) == ["a", "b"]


def _write_twice(tmp_path):
    target = tmp_path / "t.npz"
    target.write_bytes(b"old")
    target.chmod(0o640)
    vs.save_arrays(target, {"x": np.arange(3)})
    assert vs.load_arrays(target)[0]["x"].tolist() == [0, 1, 2]
    assert stat.S_IMODE(target.stat().st_mode) == 0o640
    with StagedOutputs({"t": target}) as out:
        out.write("t", lambda p: vs.save_arrays(p, {"x": np.arange(4)}))
    assert vs.load_arrays(target)[0]["x"].tolist() == [0, 1, 2, 3]
    assert os.listdir(tmp_path) == ["t.npz"]


@pytest.mark.parametrize("why", ["no renameat2", "the file system refuses it"])
def test_replacing_falls_back_to_os_replace(tmp_path, monkeypatch, why):
    calls = []
    exchange = None if why == "no renameat2" else (lambda a, b: calls.append(a) or False)
    monkeypatch.setattr(filesystem, "renameat2", lambda: exchange)
    _write_twice(tmp_path)
    assert len(calls) == (0 if why == "no renameat2" else 2)


def _fake_exchange(a, b, swapped=None):
    """What renameat2(RENAME_EXCHANGE) does, minus atomicity: for systems without it."""
    if not os.path.exists(b):
        return False  # ENOENT: nothing done
    if swapped is not None:
        swapped.append(b)
    os.rename(b, b + ".x")
    os.rename(a, b)
    os.rename(b + ".x", a)
    return True


def test_replacing_swaps_when_it_can(tmp_path, monkeypatch):
    swapped = []
    monkeypatch.setattr(filesystem, "renameat2", lambda: lambda a, b: _fake_exchange(a, b, swapped))
    _write_twice(tmp_path)
    assert swapped == [str(tmp_path / "t.npz")] * 2


def test_a_failed_unlink_after_the_swap_still_leaves_the_new_file(tmp_path, monkeypatch):
    if filesystem.renameat2() is None:
        monkeypatch.setattr(filesystem, "renameat2", lambda: _fake_exchange)
    target = tmp_path / "t.npz"
    vs.save_arrays(target, {"x": np.zeros(2)})
    real = os.unlink

    def unlink(p, *a, **k):
        if ".tmp" in os.fspath(p):
            raise PermissionError(errno.EPERM, "refused", p)
        return real(p, *a, **k)

    monkeypatch.setattr(os, "unlink", unlink)
    vs.save_arrays(target, {"x": np.ones(2)})  # no error: the new file is in place
    assert vs.load_arrays(target)[0]["x"].tolist() == [1, 1]
