"""docs/tutorial.md runs as written: its code blocks in order, in a process of their own.

The Python blocks share one namespace (a block starting ``# model.py`` is written to that file
instead, for the later blocks and the command line to import); the shell blocks run with
``bash -e`` in the same folder. The process is fresh, so the tutorial's first block sets
``XLA_FLAGS`` before JAX starts, as a reader's script would. The last Python block then runs
again on its own, as a script in that folder (its own imports and names: a reader copies it alone).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TUTORIAL = ROOT / "docs" / "tutorial.md"

RUNNER = r"""
import os, re, subprocess, sys
text = open(sys.argv[1]).read()
namespace = {"__name__": "__tutorial__"}
sys.path.insert(0, os.getcwd())
for n, (lang, code) in enumerate(re.findall(r"^```(python|shell)\n(.*?)^```$", text, flags=re.M | re.S)):
    if lang == "python" and code.startswith("# model.py\n"):
        open("model.py", "w").write(code)
    elif lang == "python":
        exec(compile(code, f"tutorial block {n}", "exec"), namespace)
    else:
        r = subprocess.run(["bash", "-e", "-c", code], capture_output=True, text=True)
        if r.returncode:
            sys.exit(f"tutorial block {n} (shell) failed:\n{code}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    print(f"block {n} ({lang}) ran", flush=True)
print("tutorial ran")
"""


def _last_python_block(text: str) -> str:
    return re.findall(r"^```python\n(.*?)^```$", text, flags=re.M | re.S)[-1]


def test_every_block_of_the_tutorial_runs_in_order_and_the_last_one_alone(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the tutorial sets it itself
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])  # `vjpsplit`
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    r = subprocess.run(
        [sys.executable, "-c", RUNNER, str(TUTORIAL)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, f"{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    assert "tutorial ran" in r.stdout
    blocks = r.stdout.count(" ran\n") - 1
    assert blocks >= 12, r.stdout  # every block ran, not an empty match
    assert (tmp_path / "ck" / "checkpoint.json").is_file() and (tmp_path / "grads.npz").is_file()
    # The last block alone, in a fresh process: the files and model.py the tutorial left are all it may use.
    (tmp_path / "last_block.py").write_text(_last_python_block(TUTORIAL.read_text()))
    alone = subprocess.run(
        [sys.executable, "last_block.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert alone.returncode == 0, f"the tutorial's last block does not run on its own:\n{alone.stderr[-3000:]}"
