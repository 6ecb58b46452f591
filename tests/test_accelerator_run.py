"""The one-shot accelerator command (benchmarks/accelerator.sh, python -m benchmarks --accelerator):
its wiring, budget and report. Its measurements run in `python -m benchmarks --quick`, not here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
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
    assert "Skipped:" in md and "**passed: false**: correctness did NOT pass" in md
    assert (tmp_path / "out" / "install.log").exists()


def _fine(opts, log):
    log.add({"x": float("nan"), "ok": True})
    return "| a |\n|---|\n| 1 |"


def test_a_failed_step_is_reported_and_the_next_still_runs(tmp_path, monkeypatch):
    def broken(opts, log):
        log.add({"kernel": "matmul", "ok": True})
        raise ValueError("no such kernel")

    monkeypatch.setattr(
        accelerator, "STEPS", {"correctness": ("C", _fine), "overhead": ("O", broken), "io": ("I", _fine)}
    )
    monkeypatch.setattr(accelerator, "ESTIMATE", {"correctness": (0, 0), "overhead": (0, 0), "io": (0, 0)})
    report = accelerator.run_all(accelerator.Options(quick=True), 60, tmp_path, "test")
    by = {s["name"]: s for s in report["steps"]}
    assert by["overhead"]["status"] == "failed" and "ValueError: no such kernel" in by["overhead"]["error"]
    assert by["io"]["status"] == "ok"
    saved = _strict_json(tmp_path / "accelerator.json")  # NaN became null
    failed = saved["steps"][1]
    assert failed["error"] == "ValueError: no such kernel" and "raise ValueError" in failed["traceback"]
    assert failed["rows"] == [{"kernel": "matmul", "ok": True}]  # what it measured before failing is kept
    assert saved["steps"][2]["rows"] == [{"x": None, "ok": True}] and saved["correctness_passed"] is True
    assert saved["passed"] is False and saved["met"] == []  # no target measured: no pass
    md = (tmp_path / "accelerator.md").read_text()
    assert "**Failed**" in md and "no such kernel" in md and "| matmul |" in md
    with pytest.raises(RuntimeError, match="steps not ok"):  # the suite's section fails with it
        accelerator.run(True)


def test_rows_are_in_the_report_as_measured_and_a_step_past_its_share_is_cut(tmp_path, monkeypatch):
    seen = []

    def slow(opts, log):  # two rows, each in the report at once, then more than its share of the budget
        for i in range(2):
            log.doing(f"row {i}")
            log.add({"row": i, "ok": True})
            seen.append(
                (
                    [r["row"] for r in _strict_json(tmp_path / "accelerator.json")["steps"][0]["rows"]],
                    (tmp_path / "accelerator.md").read_text(),
                )
            )
        time.sleep(30)
        return "never"

    monkeypatch.setattr(accelerator, "STEPS", {"correctness": ("C", slow), "io": ("I", _fine)})
    monkeypatch.setattr(accelerator, "ESTIMATE", {"correctness": (0, 0), "io": (0, 0)})
    t0 = time.monotonic()
    report = accelerator.run_all(accelerator.Options(), 3, tmp_path, "test")  # correctness: 1 s, a third
    assert time.monotonic() - t0 < 25  # cut, not slept out
    assert [rows for rows, _ in seen] == [[0], [0, 1]]
    assert "**Running**" in seen[1][1] and "row 1; 2 rows so far" in seen[1][1]
    saved = _strict_json(tmp_path / "accelerator.json")
    cut = saved["steps"][0]
    assert cut["status"] == "cut" and cut["why"].startswith("cut at the budget after 2 rows")
    assert [r["row"] for r in cut["rows"]] == [0, 1] and cut["doing"] == "row 1"
    assert saved["correctness_passed"] is False and report["passed"] is False  # a cut correctness is no pass
    assert saved["steps"][1]["status"] == "ok"  # the next step still runs
    assert "**Cut**: cut at the budget after 2 rows" in (tmp_path / "accelerator.md").read_text()


def test_correctness_runs_each_policy_once_by_default_and_every_case_with_full(monkeypatch):
    default = accelerator.correctness_cases(accelerator.Options())
    full = accelerator.correctness_cases(accelerator.Options(full=True))
    names = lambda cases: [m.__name__ for m, _ in cases]  # noqa: E731
    assert sorted(p for _, p in default) == sorted(accelerator.POLICIES)  # every policy, once
    assert len(set(names(default))) == len(default)  # each on another workload
    assert set(names(full)) == {"mlp", "transformer", "block", "convnet"}
    assert sorted((m.__name__, p) for m, p in full) == sorted(
        (n, p) for n in set(names(full)) for p in accelerator.POLICIES
    )
    assert {(m.__name__, p) for m, p in default} < {(m.__name__, p) for m, p in full}
    got = []
    monkeypatch.setattr(
        accelerator,
        "run_all",
        lambda opts, budget, out, command: (
            got.append((opts, command))
            or {
                "passed": True,
                "correctness_passed": True,
                "steps": [],
                "environment": {},
                "command": command,
                "budget_s": budget,
                "seconds": 0.0,
            }
        ),
    )
    from benchmarks import run as bench_run

    assert bench_run.main(["--accelerator", "--full", "--budget", "5", "--out", "unused"]) == 0
    assert bench_run.main(["--accelerator", "--quick", "--budget", "5", "--out", "unused"]) == 0
    assert [o for o, _ in got] == [accelerator.Options(full=True), accelerator.Options(quick=True)]
    assert got[0][1].endswith("--full")


def test_a_run_that_cannot_open_the_device_says_why(tmp_path, monkeypatch):
    def refuse():
        raise RuntimeError("Unable to initialize backend 'tpu': libtpu lockfile held")

    monkeypatch.setattr(accelerator, "environment", refuse)
    report = accelerator.run_all(accelerator.Options(), 60, tmp_path, "test")
    saved = _strict_json(tmp_path / "accelerator.json")
    assert "libtpu lockfile held" in saved["error"] and saved["steps"] == [] and report["passed"] is False
    assert "could not start" in (tmp_path / "accelerator.md").read_text()


def test_the_device_is_asked_for_again_when_it_refuses_at_first(monkeypatch):
    calls = []

    def devices():
        calls.append(1)
        if len(calls) < 3:
            raise RuntimeError("Unable to initialize backend 'tpu'")
        return ["dev"]

    monkeypatch.setattr(accelerator.jax, "devices", devices)
    assert accelerator.open_devices(tries=3, wait=0) == ["dev"] and len(calls) == 3
    calls.clear()
    with pytest.raises(RuntimeError, match="initialize backend"):
        accelerator.open_devices(tries=2, wait=0)


def test_the_train_step_keeps_each_width_and_its_targets_when_a_later_width_fails(tmp_path, monkeypatch):
    from benchmarks import train_accel

    def measure_width(width, blocks, rounds, platform, seq, trial_rounds, everything):
        if width == 1024:
            raise MemoryError("RESOURCE_EXHAUSTED: out of memory on the device")
        ms = {
            "full": 4.5,
            "accumulated": 5.0,
            "1f1b": 9.0,
            "zbh1": 11.0,
            "auto": 9.5,
            "1f1b_device": 8.9,
            "1f1b_timed": 12.0,
        }
        return [
            {
                "width": width,
                "blocks": blocks,
                "key": k,
                "candidate": train_accel.CANDIDATES[k],
                "ms": v,
                "ratio": v / ms["accumulated"],
            }
            for k, v in ms.items()
        ]

    monkeypatch.setattr(train_accel, "measure_width", measure_width)
    monkeypatch.setattr(accelerator, "STEPS", {"correctness": ("C", _fine), "train": accelerator.STEPS["train"]})
    monkeypatch.setattr(accelerator, "ESTIMATE", {"correctness": (0, 0), "train": (0, 0)})
    report = accelerator.run_all(accelerator.Options(full=True), 60, tmp_path, "test")
    saved = _strict_json(tmp_path / "accelerator.json")
    train = saved["steps"][1]
    assert train["status"] == "failed" and "out of memory" in train["error"]
    assert {r["width"] for r in train["rows"]} == {512} and len(train["rows"]) == 7
    met = {(t["width"], t["target"].split(",")[0]): t["met"] for t in saved["targets"]}
    assert met[(512, "Trainer 1F1B")] is True and met[(512, "Trainer ZB-H1")] is False  # 1.8x, 2.2x: limit 2x
    assert met[(1024, "Trainer 1F1B")] is None  # not measured
    assert met[(512, "a batch on the device no slower than one on the host (1F1B)")] is True
    assert met[(512, "a timed step at most 1.2× an untimed one (1F1B)")] is False  # 12 / 9
    assert saved["correctness_passed"] is True and report["targets"] == saved["targets"]
    assert saved["passed"] is False  # targets missed, and width 1024's not measured
    assert (
        "Trainer 1F1B, untimed, at width 1024: at most 1.15× the one-process step over the same microbatches"
        in (saved["not_measured"])
    )


def test_script_says_where_a_run_that_died_was_and_passes_its_arguments_on(tmp_path):
    # A python that dies of SIGABRT in the middle of correctness (as a crash inside XLA would), after writing
    # its report; every other call (the script's probes) is the real interpreter.
    fake = tmp_path / "python"
    fake.write_text(
        "#!/usr/bin/env bash\n"
        'if [ "$1 $2" = "-m benchmarks" ]; then\n'
        '  echo "args: $*" >&2\n'
        "  out=${@: -1}\n"
        '  echo \'{"passed": false, "steps": [{"name": "correctness", "status": "running", "rows": []}]}\' > "$out/accelerator.json"\n'
        '  echo "# report" > "$out/accelerator.md"\n'
        '  echo "F0101 tpu_client.cc:42] Check failed: buffer" >&2\n'
        "  kill -ABRT $$\n"
        "fi\n"
        f'exec {sys.executable} "$@"\n'
    )
    fake.chmod(0o755)
    env = dict(os.environ, BUDGET_S="100", PYTHON=str(fake), PYTHONPATH=str(ROOT))
    got = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "accelerator.sh"), str(tmp_path / "out"), "--full"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert got.returncode == 1, got.stderr
    report = _strict_json(tmp_path / "out" / "accelerator.json")
    assert report["exit_status"] == 134 and report["passed"] is False
    assert report["steps"][0]["status"] == "running"
    assert any("Check failed: buffer" in line for line in report["log_tail"])
    assert any("--full" in line and "--budget" in line for line in report["log_tail"])
    md = (tmp_path / "out" / "accelerator.md").read_text()
    assert "exit status 134" in md and "Check failed: buffer" in md


def _all_met(missing: str | None = None, missed: str | None = None) -> list[dict]:
    """Every target the report needs, met, but ``missing`` (left out) and ``missed`` (measured over its limit)."""
    return [
        {"target": n, "value": 2.0 if n == missed else 0.5, "limit": 1.0, "met": n != missed}
        for n in accelerator.required_targets()
        if n != missing
    ]


def test_passed_needs_correctness_and_every_target_of_the_issue_measured_and_met(tmp_path, monkeypatch):
    required = accelerator.required_targets()
    assert accelerator.OFFLOAD_TARGET in required
    assert sum("width 1024" in n for n in required) == 4 and sum("width 512" in n for n in required) == 4

    def step_with(targets):
        def step(opts, log):
            log.add({"ok": True})
            log.note(targets=targets)
            return "| a |\n|---|\n| 1 |"

        return step

    def run(targets, correctness_ok=True):
        def correctness(opts, log):
            log.add({"ok": correctness_ok})
            return "table"

        monkeypatch.setattr(
            accelerator, "STEPS", {"correctness": ("C", correctness), "train": ("T", step_with(targets))}
        )
        monkeypatch.setattr(accelerator, "ESTIMATE", {"correctness": (0, 0), "train": (0, 0)})
        accelerator.run_all(accelerator.Options(), 60, tmp_path, "test")
        return _strict_json(tmp_path / "accelerator.json"), (tmp_path / "accelerator.md").read_text()

    saved, md = run(_all_met())
    assert saved["passed"] is True and saved["missed"] == saved["not_measured"] == []
    assert "**passed: true**: correctness passed; issue 68's targets: 9 met, 0 missed, 0 not measured." in md
    saved, md = run(_all_met(missing=accelerator.OFFLOAD_TARGET))  # the offload row never measured
    assert saved["passed"] is False and saved["not_measured"] == [accelerator.OFFLOAD_TARGET]
    assert "**passed: false**" in md and f"Not measured:\n\n- {accelerator.OFFLOAD_TARGET}" in md
    saved, md = run(_all_met(missed=required[0]))
    assert saved["passed"] is False and saved["missed"] == [required[0]] and f"Missed:\n\n- {required[0]}" in md
    extra = {"target": "the host's time per operation", "value": None, "limit": 1.5, "met": None}
    saved, _ = run([*_all_met(), extra])  # a target a step adds counts too
    assert saved["passed"] is False and saved["not_measured"] == ["the host's time per operation"]
    saved, md = run(_all_met(), correctness_ok=False)
    assert saved["passed"] is False and saved["correctness_passed"] is False and "did NOT pass" in md


def test_the_offload_target_is_the_untimed_first_stage_peak_with_offload_against_without():
    def row(schedule, none, host):
        return {"schedule": schedule, "none": {"peaks_untimed": [none, 9]}, "host": {"peaks_untimed": [host, 9]}}

    got = accelerator.offload_target([row("gpipe", 100, 90), row("1f1b", 100, 40)])
    assert got["target"] == accelerator.OFFLOAD_TARGET and got["value"] == 0.4 and got["met"] is True
    assert accelerator.offload_target([row("1f1b", 100, 51)])["met"] is False
    assert accelerator.offload_target([row("gpipe", 100, 40)])["met"] is None  # no 1F1B row: not measured
    assert "| 40% | 50% | met |" in accelerator.targets_table([got])


def test_a_row_past_its_share_is_cut_inside_the_step_and_the_step_still_ends_at_its_own():
    got = []
    with accelerator.cut_after(1.5) as outer:
        try:
            with accelerator.cut_after(0.2, accelerator.RowCut) as inner:
                time.sleep(5)
        except accelerator.RowCut:
            got.append("row cut")
        assert inner["fired"] and not outer["fired"]
        try:
            time.sleep(5)
        except accelerator.StepCut:
            got.append("step cut")
    assert got == ["row cut", "step cut"] and outer["fired"]
    with pytest.raises(accelerator.StepCut):  # both due: the step's cut wins, the row's handler lets it through
        with accelerator.cut_after(0.1):
            with accelerator.cut_after(5, accelerator.RowCut):
                time.sleep(5)


def test_a_correctness_row_compiles_its_backward_once_and_says_where_its_time_went(tmp_path, monkeypatch):
    monkeypatch.setattr(accelerator, "DEFAULT_CASES", (("mlp", "dots"),))
    monkeypatch.setattr(accelerator, "STEPS", {"correctness": accelerator.STEPS["correctness"]})
    report = accelerator.run_all(accelerator.Options(), 120, tmp_path, "test")
    rows = report["steps"][0]["rows"]
    assert [r["workload"] for r in rows] == ["mlp", "mlp, batch b"] and all(r["ok"] for r in rows)
    # The reference, fwd and bwd; the backward from the residuals file runs bwd's program again.
    assert rows[0]["compiles"] == 3 and rows[0]["parts"]["bwd from the file's residuals"] >= 0
    assert rows[1]["compiles"] == 5  # fwd and bwd at two sizes, the reference at the second (the MLP row's first)
    assert report["correctness_passed"] is True
    assert "| 3 (" in (tmp_path / "accelerator.md").read_text()


def test_replace_costs_leave_out_an_exchange_the_file_system_refuses(monkeypatch):
    """The TPU machine's file system has renameat2 but refuses RENAME_EXCHANGE: the I/O step measures the other ways."""
    from benchmarks import io as io_bench

    monkeypatch.setattr(io_bench.filesystem, "renameat2", lambda: lambda old, new: False)
    rows = io_bench.replace_costs(1 << 16, 1)
    assert [r["what"] for r in rows] == ["write + os.replace over the old file", "np.save over the old file"]
