"""docs/howto/ray.md runs as written: its Python blocks in order, in one namespace (they start and stop Ray)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

PAGE = Path(__file__).resolve().parents[2] / "docs" / "howto" / "ray.md"


def test_the_ray_page_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    blocks = re.findall(r"^```python\n(.*?)^```$", PAGE.read_text(), flags=re.M | re.S)
    assert blocks
    scope: dict[str, object] = {"__name__": "__main__"}
    for n, block in enumerate(blocks):
        exec(compile(block, f"ray.md, block {n}", "exec"), scope)
    assert len(scope["losses"]) == 2 and np.all(np.isfinite(scope["losses"]))
