"""The API reference (docs/api/index.md, built by mkdocstrings in CI) documents every public name, each once."""

from __future__ import annotations

import re
from pathlib import Path

import vjpsplit_cli as vs
import vjpsplit_cli.pipeline as P

PAGE = Path(__file__).resolve().parents[1] / "docs" / "api" / "index.md"


def _documented() -> list[str]:
    return re.findall(r"^::: (\S+)$", PAGE.read_text(), flags=re.M)


def test_every_public_name_has_one_entry_in_the_api_reference():
    public = [f"vjpsplit_cli.{n}" for n in vs.__all__ if n not in ("__version__", "pipeline")]
    public += [f"vjpsplit_cli.pipeline.{n}" for n in P.__all__]
    documented = _documented()
    assert sorted(set(documented)) == sorted(documented), "a name is documented twice"
    assert set(public) - set(documented) == set(), "public names missing from docs/api/index.md"
    assert set(documented) - set(public) == set(), "docs/api/index.md documents names that are not public"
