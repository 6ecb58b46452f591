"""Every how-to page (docs/howto/) has code a test runs.

The pages listed in ``PAGES`` run here as written: their ```python blocks in order, in one namespace, in a fresh
process with 4 host CPU devices (as a reader starts Python with
``XLA_FLAGS=--xla_force_host_platform_device_count=4``; ``DEVICES`` names the pages that ask for more), in an
empty folder. The other pages' code is run by the
test ``ELSEWHERE`` names.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HOWTO = ROOT / "docs" / "howto"

PAGES = [
    "accelerator.md",
    "data-parallel.md",
    "devices.md",
    "evaluation.md",
    "offload.md",
    "schedules.md",
    "stages.md",
    "traces-and-hangs.md",
]
# Pages that ask for more host CPU devices than 4 (data-parallel.md's replicas of sharded stages take 8).
DEVICES = {"data-parallel.md": 8}
# Pages whose ```bash block is marked RUN_MARK: tests/test_docs.py runs it as pasted.
RUN_MARK = "<!-- run as pasted by tests/test_docs.py -->"
ELSEWHERE = {
    "checkpoints.md": "tests/test_training_state.py::test_docs_orbax_snippet_runs",
    "cli.md": "tests/test_docs.py::test_readme_shell_blocks_run_as_pasted",
    "metrics.md": "tests/test_step_aux.py::test_docs_metrics_block_runs",
    "multi-host.md": "tests/test_distributed.py::test_the_multi_host_page_runs_on_two_processes_as_written",
    "ray.md": "tests/ray_suite/test_docs_ray.py::test_the_ray_page_runs",
    "sharding.md": "tests/test_docs.py::test_readme_shell_blocks_run_as_pasted",
    "training.md": "tests/test_rng.py::test_docs_dropout_block_runs",
    "variable-lengths.md": "tests/test_variable_lengths.py::test_the_docs_block_runs_and_equals_one_process",
}

RUNNER = r"""
import re, sys
text = open(sys.argv[1]).read()
scope = {"__name__": "__main__"}
blocks = re.findall(r"^```python\n(.*?)^```$", text, flags=re.M | re.S)
for n, code in enumerate(blocks):
    exec(compile(code, f"{sys.argv[1]}, block {n}", "exec"), scope)
print(f"{len(blocks)} blocks ran")
"""


def python_blocks(page: Path) -> list[str]:
    """The page's ```python blocks, in order."""
    return re.findall(r"^```python\n(.*?)^```$", page.read_text(), flags=re.M | re.S)


@pytest.mark.parametrize("page", PAGES)
def test_the_page_runs_as_written(page, tmp_path):
    path = HOWTO / page
    assert python_blocks(path), f"{page} has no python block"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(
        XLA_FLAGS=f"--xla_force_host_platform_device_count={DEVICES.get(page, 4)}",
        PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]),
        PATH=os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")]),
    )
    r = subprocess.run(
        [sys.executable, "-c", RUNNER, str(path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, f"{page}:\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    assert f"{len(python_blocks(path))} blocks ran" in r.stdout
    assert "Warning" not in r.stderr, r.stderr[-3000:]


def test_every_howto_page_has_code_a_test_runs():
    pages = {p.name for p in HOWTO.glob("*.md")}
    assert pages == set(PAGES) | set(ELSEWHERE), "a how-to page neither runs here nor names its test"
    for page, test in ELSEWHERE.items():
        path, _, name = test.partition("::")
        source = (ROOT / path).read_text()
        assert f"def {name}(" in source, f"{test} does not exist"
        if path == "tests/test_docs.py":
            assert RUN_MARK + "\n```bash\n" in (HOWTO / page).read_text(), f"{page} has no block marked {RUN_MARK}"
        else:
            assert page in source, f"{path} does not read {page}"
