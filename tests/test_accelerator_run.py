"""The one-shot accelerator command (benchmarks/accelerator.sh, python -m benchmarks --accelerator):
its wiring, budget and report. Its measurements run in `python -m benchmarks --quick`, not here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import accelerator  # noqa: E402


def _strict_json(path: Path) -> dict:
    def refuse(name):
        raise ValueError(f"{path} holds {name}, which is not JSON")

    return json.loads(path.read_text(), parse_constant=refuse)


def test_script_on_a_cpu_machine_writes_the_report_within_its_budget(tmp_path):
    # 40 s leaves too little for any step: every one is skipped, the report still says why.
    env = dict(os.environ, BUDGET_S="40", PYTHON=sys.executable, PYTHONPATH=str(ROOT))
    got = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "accelerator.sh"), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert got.returncode == 1, got.stderr  # correctness did not run: not a pass
    assert "no GPU or TPU found" in got.stderr
    report = _strict_json(tmp_path / "out" / "accelerator.json")
    assert report["environment"]["backend"] == "cpu" and report["environment"]["crc32"]
    assert [s["name"] for s in report["steps"]] == list(accelerator.STEPS)
    assert all(s["status"] == "skipped" for s in report["steps"]) and report["passed"] is False
    assert report["budget_s"] < 40
    md = (tmp_path / "out" / "accelerator.md").read_text()
    assert "Skipped:" in md and "correctness FAILED" in md
    assert (tmp_path / "out" / "install.log").exists()


def test_a_failed_step_is_reported_and_the_next_still_runs(tmp_path, monkeypatch):
    def broken(quick):
        raise ValueError("no such kernel")

    def fine(quick):
        return "| a |\n|---|\n| 1 |", [{"x": float("nan"), "ok": True}]

    monkeypatch.setattr(
        accelerator, "STEPS", {"correctness": ("C", fine), "overhead": ("O", broken), "io": ("I", fine)}
    )
    monkeypatch.setattr(accelerator, "ESTIMATE", {"correctness": (0, 0), "overhead": (0, 0), "io": (0, 0)})
    report = accelerator.run_all(True, 60, tmp_path, "test")
    by = {s["name"]: s for s in report["steps"]}
    assert by["overhead"]["status"] == "failed" and "no such kernel" in by["overhead"]["error"]
    assert by["io"]["status"] == "ok"
    saved = _strict_json(tmp_path / "accelerator.json")  # NaN became null
    assert saved["steps"][2]["rows"] == [{"x": None, "ok": True}] and saved["passed"] is True
    assert "**Failed**" in (tmp_path / "accelerator.md").read_text()
    with pytest.raises(RuntimeError, match="steps not ok"):  # the suite's section fails with it
        accelerator.run(True)
