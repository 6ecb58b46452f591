"""Crash safety: a writer killed mid-write leaves no partial file; concurrent writers never clash."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from clihelp import opts
from sighelp import python_with_sigint

import vjpsplit_cli as vs

N = 24 * 2**20  # elements: two f32 residuals of 96 MiB each, so the write takes a while


def _digest(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _kill_mid_write(cmd, directory: Path, target: Path) -> None:
    """Start ``cmd``, wait until its temp file for ``target`` has data, SIGKILL it."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline:
            temps = [p for p in directory.glob(f".{target.name}.*") if _size(p) > 0]
            if temps:
                os.kill(proc.pid, signal.SIGKILL)
                break
            if proc.poll() is not None:
                pytest.fail(f"the writer finished before it could be killed: {proc.stderr.read()[-500:]}")
            time.sleep(0.001)
        else:
            pytest.fail("no temp file appeared")
    finally:
        proc.wait()
    assert proc.returncode == -signal.SIGKILL


def _size(p: Path) -> int:
    try:
        return p.stat().st_size
    except FileNotFoundError:  # renamed or removed between listing and stat
        return 0


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    d = tmp_path_factory.mktemp("big")
    vs.export(
        lambda x: jnp.sum(jnp.sin(x) * jnp.cos(x)), jax.ShapeDtypeStruct((N,), jnp.float32), platforms="cpu"
    ).save(d / "art.vjps")
    x = np.linspace(0, 1, N, dtype=np.float32)
    vs.save_arrays(d / "in1.npz", {"x": x})
    vs.save_arrays(d / "in2.npz", {"x": x[::-1].copy()})
    vs.export(
        lambda x: jnp.sum(jnp.sin(x) * jnp.cos(x)), jax.ShapeDtypeStruct((8,), jnp.float32), platforms="cpu"
    ).save(d / "small.vjps")
    vs.save_arrays(d / "small.npz", {"x": np.linspace(0, 1, 8, dtype=np.float32)})
    return d


@pytest.mark.parametrize("ext", ["npz", "msgpack"])
def test_sigkill_during_run_fwd_keeps_the_previous_file(big, tmp_path, ext):
    target = tmp_path / f"res.{ext}"
    cli = [
        sys.executable,
        "-m",
        "vjpsplit_cli",
        "--no-cache",
        "run-fwd",
        str(big / "art.vjps"),
        "--residuals",
        str(target),
    ]
    done = subprocess.run(cli + ["--inputs", str(big / "in1.npz")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    before = _digest(target)
    _kill_mid_write(cli + ["--inputs", str(big / "in2.npz")], tmp_path, target)
    assert _digest(target) == before, "the killed writer changed the previous complete file"
    arrays, meta = vs.load_arrays(target)  # and it still loads
    assert meta["kind"] == "vjpsplit-residuals" and arrays


def test_sigkill_without_previous_file_leaves_none(big, tmp_path):
    target = tmp_path / "res.npz"
    cli = [
        sys.executable,
        "-m",
        "vjpsplit_cli",
        "--no-cache",
        "run-fwd",
        str(big / "art.vjps"),
        *opts(inputs=big / "in1.npz", residuals=target),
    ]
    _kill_mid_write(cli, tmp_path, target)
    assert not target.exists()


WRITER = """
import sys, numpy as np
from vjpsplit_cli import save_arrays
seed, target = int(sys.argv[1]), sys.argv[2]
a = np.full(2**21, seed, np.float32)
for _ in range(5):
    save_arrays(target, {"x": a, "seed": np.int32(seed)}, {"writer": seed})
"""


def test_concurrent_writers_never_clobber_each_other(tmp_path):
    target = tmp_path / "shared.npz"
    procs = [
        subprocess.Popen([sys.executable, "-c", WRITER, str(i), str(target)], stderr=subprocess.PIPE) for i in range(4)
    ]
    for p in procs:
        assert p.wait() == 0, p.stderr.read()
    arrays, meta = vs.load_arrays(target)
    seed = int(arrays["seed"])
    assert meta == {"writer": seed} and 0 <= seed < 4
    assert np.all(arrays["x"] == seed)  # one writer's complete file, not a mix
    assert not list(tmp_path.glob(".*.tmp")), "a temp file was left behind"


def _snapshot(d: Path) -> dict:
    return {p.name: _digest(p) for p in d.iterdir()}


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP", "SIGINT"])
def test_a_signal_during_a_write_removes_temp_files_and_keeps_every_previous_output(big, tmp_path, sig):
    res, out = tmp_path / "res.npz", tmp_path / "out.npz"
    res.write_bytes(b"previous residuals")
    out.write_bytes(b"previous outputs")
    before = _snapshot(tmp_path)
    cmd = python_with_sigint(
        "-m",
        "vjpsplit_cli",
        "--no-cache",
        "run-fwd",
        str(big / "art.vjps"),
        *opts(inputs=big / "in1.npz", residuals=res, outputs=out),
    )
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    signum = getattr(signal, sig)
    try:
        while True:
            if [p for p in tmp_path.glob(f".{res.name}.*") if _size(p) > 0]:
                proc.send_signal(signum)
                break
            if proc.poll() is not None:
                pytest.fail(f"the writer finished before the signal: {proc.stderr.read()[-500:]}")
            time.sleep(0.001)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    # The conventional outcome: SIGTERM and SIGHUP end the process by that signal, Ctrl-C exits 130.
    assert proc.returncode == (130 if sig == "SIGINT" else -signum), (proc.returncode, err)
    assert "Traceback" not in err
    if sig == "SIGINT":
        assert err.strip().splitlines() == ["error: run-fwd: interrupted; every previous output is left as it was"]
    assert _snapshot(tmp_path) == before, "a temp file was left or a previous output changed"


# ---------------------------------------------------------------- temp files left by SIGKILL


def test_the_next_command_removes_the_temp_file_a_sigkilled_writer_left(big, tmp_path):
    target = tmp_path / "res.npz"
    cli = [sys.executable, "-m", "vjpsplit_cli", "--no-cache", "run-fwd"]
    done = subprocess.run(
        cli + [str(big / "small.vjps"), "--inputs", str(big / "small.npz"), "--residuals", str(target)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    before = _digest(target)
    _kill_mid_write(
        cli + [str(big / "art.vjps"), "--inputs", str(big / "in2.npz"), "--residuals", str(target)], tmp_path, target
    )
    left = [p.name for p in tmp_path.iterdir() if p.name != target.name]
    assert left, "SIGKILL cannot be caught: its writer's temp file is expected to stay until the next write"
    # Another command writing into the directory sweeps it: the killed writer's pid is gone.
    done = subprocess.run(
        cli + [str(big / "small.vjps"), "--inputs", str(big / "small.npz"), "--residuals", str(tmp_path / "other.npz")],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.npz", "res.npz"]
    assert _digest(target) == before, "the previous complete output changed"


def _temp_name(target: str, pid: int, start: int, host: str, suffix: str = ".tmp") -> str:
    return f".{target}.0123abcd.vjps{pid}-{start}-{host}{suffix}"


def test_only_stale_vjpsplit_temps_are_swept(tmp_path):
    from vjpsplit_cli.safeio import temps

    _, start, host = temps.writer_tag()[4:].split("-")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    other_host = "ffffffff" if host != "ffffffff" else "00000000"
    names = {
        _temp_name("a.npz", dead.pid, 0, host): "gone",  # its writer has exited
        _temp_name("b.npz", dead.pid, 123, host, ".tmp.npz"): "gone",  # staged output of an exited writer
        _temp_name("c.npz", os.getpid(), int(start) + 1, host): "gone",  # the pid was reused by this process
        _temp_name("d.npz", os.getpid(), int(start), host): "kept",  # this process: alive
        _temp_name("e.npz", os.getppid(), 0, host): "kept",  # alive (start time not recorded)
        _temp_name("f.npz", dead.pid, 0, other_host): "kept",  # another host or boot, recent
        _temp_name("g.npz", dead.pid, 0, other_host, ".tmp.msgpack"): "gone",  # ... untouched for two days
        ".h.npz.0123abcd.tmp": "kept",  # not vjpsplit's current pattern
        "i.vjps99-0-00000000.tmp": "kept",  # not a hidden temp name
        "user.npz": "kept",
    }
    for name in names:
        (tmp_path / name).write_bytes(b"x")
    old = time.time() - 2 * 24 * 3600
    os.utime(tmp_path / _temp_name("g.npz", dead.pid, 0, other_host, ".tmp.msgpack"), (old, old))
    (tmp_path / _temp_name("j.npz", dead.pid, 0, host)).mkdir()  # a directory is never removed
    removed = temps.remove_stale_temps(tmp_path)
    assert sorted(os.path.basename(p) for p in removed) == sorted(n for n, v in names.items() if v == "gone")
    assert sorted(os.listdir(tmp_path)) == sorted(
        [n for n, v in names.items() if v == "kept"] + [_temp_name("j.npz", dead.pid, 0, host)]
    )


def test_a_write_sweeps_its_directory_once_per_process(tmp_path):
    from vjpsplit_cli.safeio import temps

    code = "import sys, numpy as np, vjpsplit_cli as vs\nvs.save_arrays(sys.argv[1], {'x': np.ones(2)})\n"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / _temp_name("r.npz", dead.pid, 0, temps.writer_tag().rsplit("-", 1)[1])
    stale.write_bytes(b"half a file")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "r.npz")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert sorted(os.listdir(tmp_path)) == ["r.npz"]


@pytest.mark.usefixtures("sigint_default")
def test_an_interrupt_held_during_the_commit_says_the_outputs_were_written(tmp_path, monkeypatch):
    """SIGINT during the renames is held until they finish; the message must not claim nothing was written."""
    import signal

    from click.testing import CliRunner

    import vjpsplit_cli.safeio.outputs as outputs
    from vjpsplit_cli.cli import main

    real_replace = outputs.replace_file
    fired = []

    def replace_then_interrupt(tmp, target):
        real_replace(tmp, target)
        if not fired:
            fired.append(target)
            signal.raise_signal(signal.SIGINT)  # arrives while the commit holds signals

    import numpy as np

    import vjpsplit_cli as vs

    art = vs.export(lambda x: (x**2).sum(), np.ones(3, np.float32), platforms="cpu")
    art.save(tmp_path / "a.vjps")
    vs.save_arrays(tmp_path / "in.npz", {"x": np.arange(3, dtype=np.float32)})
    monkeypatch.setattr(outputs, "replace_file", replace_then_interrupt)
    r = CliRunner().invoke(
        main,
        [
            "run-fwd",
            str(tmp_path / "a.vjps"),
            *opts(inputs=tmp_path / "in.npz", residuals=tmp_path / "r.npz", outputs=tmp_path / "o.npz"),
        ],
    )
    assert fired and r.exit_code == 130
    assert "interrupted just after writing its outputs" in r.output
    assert (tmp_path / "r.npz").is_file() and (tmp_path / "o.npz").is_file()
    outs, _ = vs.load_arrays(tmp_path / "o.npz")
    np.testing.assert_allclose(outs["out"], 5.0)
