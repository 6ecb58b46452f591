"""The samples run end to end, as a user would run them, and report success."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from clihelp import opts
from tracecheck import check_trace_file, flow_pairs, op_slices

ROOT = Path(__file__).resolve().parents[1]


def run(cmd: list[str], env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run ``cmd`` from the repository root; the output is shown if it fails."""
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd} exited {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc


def test_seed_demo(tmp_path):
    proc = run([sys.executable, "samples/seed_demo.py", "--out", str(tmp_path)])
    assert "961 grid points: value and gradients match jax.vjp" in proc.stdout
    assert (tmp_path / "seed_scalar.vjps").is_file() and (tmp_path / "seed_vector.vjps").is_file()


def test_pipeline_f1f2b2b1(tmp_path):
    proc = run([sys.executable, "samples/pipeline_f1f2b2b1.py", "--out", str(tmp_path)])
    assert "F1 F2 B2 B1 on 2 microbatches of 8:" in proc.stdout
    assert "match jax.value_and_grad on the full batch" in proc.stdout
    # Residuals went through both file formats.
    assert (tmp_path / "residuals_mb1.npz").is_file() and (tmp_path / "residuals_mb2.msgpack").is_file()


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_quickstart(tmp_path):
    # The script calls `python` and `vjpsplit` by name: put this interpreter's bin first.
    env = dict(os.environ, PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    proc = run(["bash", "samples/quickstart.sh", str(tmp_path)], env=env)
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("OK:"), proc.stdout
    assert "gradients match jax.grad" in last


def test_pipeline_sample_inprocess(tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            "samples/pipeline/run.py",
            *opts(runner="inprocess", steps="1", batch="64", microbatches="8", out=tmp_path),  # DualPipeV: m >= 2p
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "loss and gradients match jax.value_and_grad" in r.stdout
    # Progress on stderr for every long step, and no one else's warnings.
    assert "... exporting the 4 and 8 stage artifacts" in r.stderr and "... in-process, ZB-V:" in r.stderr
    assert "Warning" not in r.stderr and "WARNING" not in r.stderr, r.stderr
    assert sorted(p.name for p in tmp_path.glob("*.png")) == [
        "timeline_inprocess_1f1b.png",
        "timeline_inprocess_dualpipev.png",
        "timeline_inprocess_gpipe.png",
        "timeline_inprocess_interleaved1f1b.png",
        "timeline_inprocess_zbh1.png",
        "timeline_inprocess_zbv.png",
    ]


@pytest.mark.parametrize("name, library", [("flax_cnn", "flax"), ("equinox_mlp", "equinox"), ("haiku_mlp", "haiku")])
def test_model_library_samples(name, library, tmp_path):
    # A sample copies into a user's project as it is: run it exactly as its docstring says.
    env = dict(os.environ, PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    proc = run(["bash", "samples/models/run.sh", name, str(tmp_path)], env=env)
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("OK:") and "gradients vs jax.grad" in last, proc.stdout
    grads = np.load(tmp_path / "grads.npz")
    assert grads.files and all(k.startswith("params/") for k in grads.files)


def test_pipeline_gpt_sample_one_function(tmp_path):
    r = subprocess.run(
        [sys.executable, "samples/pipeline/gpt.py", *opts(schedule="zbh1", out=tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.splitlines()[-1].startswith("OK: loss"), r.stdout
    assert "stage 1: 6 parameter leaves, reads mask" in r.stdout
    assert (tmp_path / "gpt.stages" / "stages.json").is_file()


def test_train_gpt_sample_pipeline_equals_one_process(tmp_path):
    proc = run(
        [sys.executable, "samples/pipeline/train_gpt.py", *opts(steps=12, schedule="zbh1", out=tmp_path)], timeout=600
    )
    lines = proc.stdout.splitlines()
    line = next(ln for ln in lines if ln.startswith("largest relative difference"))
    assert float(line.rsplit(" ", 1)[1]) < 1e-6, proc.stdout  # the curves agree (the script also exits 1 if not)
    line = next(ln for ln in lines if ln.startswith("largest difference of the two accuracy curves"))
    assert float(line.rsplit(" ", 1)[1]) == 0, proc.stdout  # the same tokens right, step by step
    acc = next(ln for ln in lines if ln.startswith("next-token accuracy")).split("->")
    assert float(acc[1].split()[2]) > float(acc[0].split()[-1]), proc.stdout  # it learned
    first, last = proc.stdout.splitlines()[0].split("->")[:2]
    assert float(last.split()[2]) < float(first.split()[-1]), proc.stdout  # it trained
    uniform = float(proc.stdout.splitlines()[1].rsplit(" ", 1)[1])  # ln(vocab)
    assert abs(float(first.split()[-1]) - uniform) < 0.1, proc.stdout  # it starts at a uniform guess
    assert (tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG"
    # The last step's trace, event by event against the trace-event format, and drawn from the file.
    doc = check_trace_file(tmp_path / "step-12.trace.json")
    ops = op_slices(doc)
    assert sorted(ops) == sorted(f"{k} s{s} mb{m}" for k in "FIW" for s in range(4) for m in range(4))  # ZB-H1: I and W
    assert len(flow_pairs(doc)) == 2 * 3 * 4  # F and B sends between 4 workers, 4 microbatches
    assert (tmp_path / "timeline.png").read_bytes()[:4] == b"\x89PNG"


def test_train_gpt_sample_draws_dropout_and_brings_two_lengths():
    """What the sample compares to one process is training as models train: its dropout masks follow the key,
    and its steps bring microbatches of both lengths, weighted by their token counts."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_gpt", ROOT / "samples" / "pipeline" / "train_gpt.py")
    sample = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sample)
    ids, vocab = sample.corpus()
    steps = list(sample.batches(ids, 6))
    lengths = {tokens.shape for step in steps for tokens, _ in step}
    assert lengths == {(sample.ROWS, n) for n in sample.LENGTHS} and len(lengths) == 2
    assert sample.tokens_of(steps[0]) == [tokens.size for tokens, _ in steps[0]]
    params, (tokens, labels) = sample.init(vocab), steps[0][0]
    one, aux = sample.loss(params, jax.random.key(0), tokens, labels)
    again, _ = sample.loss(params, jax.random.key(0), tokens, labels)
    other, _ = sample.loss(params, jax.random.key(1), tokens, labels)
    assert one == again and one != other and 0 <= aux["accuracy"] <= 1
