"""README and docs/ cannot drift from the code: format version, every CLI flag, the API table, and README's examples
(with the blocks that moved from it into docs/) run as pasted."""

from __future__ import annotations

import inspect
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import click
import pytest

import vjpsplit_cli as vs
from vjpsplit_cli.artifact.manifest import FORMAT_VERSION
from vjpsplit_cli.cli import main

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "docs" / "howto").glob("*.md"))]
API_PAGE = ROOT / "docs" / "api" / "index.md"
# Put on the line before a ```bash block of a docs page: this file runs the block as pasted, as README's own.
RUN_MARK = "<!-- run as pasted by tests/test_docs.py -->"


def _text() -> str:
    return "\n".join(p.read_text() for p in DOCS)


def _commands(group: click.Group = main, prefix: str = "") -> dict[str, click.Command]:
    """Every command under ``group``, by its path (``run-fwd``, or ``group sub`` for nested groups)."""
    out = {}
    for name, cmd in group.commands.items():
        out[prefix + name] = cmd
        if isinstance(cmd, click.Group):
            out.update(_commands(cmd, prefix + name + " "))
    return out


def _options(cmd: click.Command) -> list[list[str]]:
    """Each option's long spellings (``--output``) and short ones (``-o``); --help left out."""
    return [p.opts + p.secondary_opts for p in cmd.params if isinstance(p, click.Option) and "--help" not in p.opts]


def _mentions(text: str, flag: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text) is not None


def test_docs_state_the_format_version_the_code_writes():
    stated = [int(n) for n in re.findall(r"\bformat(?: version)? (\d+)\b", _text())]
    assert stated, "README and docs/ never state the artifact format version"
    assert set(stated) == {FORMAT_VERSION}, (
        f"docs state format versions {sorted(set(stated))}, the code writes {FORMAT_VERSION}"
    )


def test_every_command_and_flag_is_documented():
    text = _text()
    missing = [f"vjpsplit {name}" for name in _commands() if f"vjpsplit {name}" not in text]
    for cmd in [main, *_commands().values()]:
        for spellings in _options(cmd):
            if not any(_mentions(text, s) for s in spellings):
                missing.append(f"{cmd.name} {'/'.join(spellings)}")
    assert not missing, f"README.md and docs/ do not mention: {', '.join(missing)}"


def _documented_command_lines():
    """``(file, command names, flags)`` for each ``vjpsplit ...`` line inside a fenced code block."""
    for path in DOCS:
        for block in re.findall(r"```[a-z]*\n(.*?)```", path.read_text(), flags=re.S):
            for line in block.replace("\\\n", " ").splitlines():
                words = line.split("#")[0].split()
                if len(words) >= 2 and words[0] == "vjpsplit" and not words[1].startswith("-"):
                    flags = [w.lstrip("[").split("=")[0].rstrip("]") for w in words[2:]]
                    yield path.name, words[1].split("|"), [f for f in flags if f.startswith("-")]


def test_documented_commands_use_only_flags_that_exist():
    commands = _commands()
    wrong = []
    for where, names, flags in _documented_command_lines():
        for name in names:
            cmd = commands.get(name)
            if cmd is None:
                wrong.append(f"{where}: vjpsplit {name}: no such command")
                continue
            known = {s for spellings in _options(cmd) + _options(main) for s in spellings}
            wrong += [f"{where}: vjpsplit {name} {f}" for f in flags if f not in known | {"--help", "-h"}]
    assert not wrong, "documented flags that do not exist: " + "; ".join(wrong)


def test_the_drift_tests_can_fail():
    assert not _mentions("use --no-verify-x here", "--no-verify")
    assert _mentions("run-bwd --no-verify.", "--no-verify")
    extra = click.Command("extra", params=[click.Option(["--surely-undocumented-flag"])])
    assert not any(_mentions(_text(), s) for spellings in _options(extra) for s in spellings)


def _glance_rows() -> list[str]:
    """The rows of the API reference's table of everything public ("At a glance", README's until it became a front page)."""
    text = API_PAGE.read_text().split("## At a glance\n", 1)[1].split("\n## ", 1)[0]
    return [line for line in text.splitlines() if line.startswith("| `")]


def test_api_table_says_what_a_tuple_returning_function_returns():
    """A public function whose docstring returns a tuple (``load_arrays``: ``(arrays, meta)``) says so in the table."""
    rows = _glance_rows()
    checked = []
    for name in vs.__all__:
        summary = (inspect.getdoc(getattr(vs, name)) or "").split("\n\n")[0]
        returned = re.search(r"[Rr]eturns? ``(\([^`]*\))``", summary)
        row = [r for r in rows if f"`{name}(" in r.split("|")[1]]
        if returned and row:
            assert any(returned.group(1) in r for r in row), (
                f"the API table's row for {name} does not say it returns {returned.group(1)}"
            )
            checked.append(name)
    assert "load_arrays" in checked


def _readme_shell_blocks() -> list[str]:
    """README's ```bash blocks, except the setup ones (installing, and the test command itself)."""
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S)
    return [b for b in blocks if "pip install" not in b and "pytest" not in b]


def _marked_shell_blocks() -> list[tuple[str, str]]:
    """``(page, block)`` for each docs page's ```bash block marked RUN_MARK (README's blocks that moved there)."""
    pattern = re.escape(RUN_MARK) + r"\n```bash\n(.*?)```"
    return [(p.name, b) for p in DOCS[1:] for b in re.findall(pattern, p.read_text(), flags=re.S)]


def _shell_blocks() -> list[str]:
    return _readme_shell_blocks() + [b for _, b in _marked_shell_blocks()]


def test_readme_has_runnable_blocks():
    assert any("vjpsplit run-bwd" in b for b in _readme_shell_blocks())
    # The blocks README had before it became a front page: each library's sample, `plan`, the sharded CLI run.
    marked = {page for page, _ in _marked_shell_blocks()}
    assert {"compat.md", "performance.md", "sharding.md"} <= marked
    assert len(_shell_blocks()) >= 4


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_readme_shell_blocks_run_as_pasted(tmp_path):
    # In a copy of the repository, as a newcomer would after the setup command: `vjpsplit`
    # and `python` on PATH (this interpreter's), this checkout's package importable.
    ignore = shutil.ignore_patterns(
        ".git", ".venv", ".compat", "out", "__pycache__", ".pytest_cache", "*.vjps", "*.png"
    )
    clone = tmp_path / "clone"
    shutil.copytree(ROOT, clone, ignore=ignore)
    env = dict(
        os.environ,
        PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
        PYTHONPATH=str(ROOT),
        VJPSPLIT_CACHE_DIR=str(tmp_path / "cache"),
    )
    for block in _shell_blocks():
        proc = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", block], cwd=clone, env=env, capture_output=True, text=True, timeout=600
        )
        assert proc.returncode == 0, f"README block failed:\n{block}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
        assert "Traceback" not in proc.stderr and "Warning" not in proc.stderr, proc.stderr


def test_readme_python_examples_run_as_pasted(tmp_path):
    """README's ```python examples, each in a fresh process (one sets XLA_FLAGS before JAX starts), as pasted."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) >= 2 and any("vs.split(" in b for b in blocks) and any("P.Trainer(" in b for b in blocks)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(PYTHONPATH=str(ROOT), VJPSPLIT_CACHE_DIR=str(tmp_path / "cache"))
    for n, block in enumerate(blocks):
        proc = subprocess.run(
            [sys.executable, "-c", block], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
        )
        assert proc.returncode == 0, f"README example {n} failed:\n{block}\nstderr:\n{proc.stderr[-3000:]}"
        assert "Traceback" not in proc.stderr and "Warning" not in proc.stderr, proc.stderr


def _anchor(heading: str) -> str:
    """A markdown heading's anchor as GitHub makes it: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_readme_opening_says_why_not_jaxs_own_vjp():
    """README's opening paragraph (the first after its setup commands) says why not ``jax.vjp``,
    ``jax.fwd_and_bwd`` or ``jax.export``'s own VJP, linking to the contract page's comparison."""
    opening = README.read_text().split("\n---\n", 1)[1].strip().split("\n\n", 1)[0]
    for name in ("`jax.vjp`", "`jax.fwd_and_bwd`", "`jax.export`'s own VJP"):
        assert name in opening, f"README's opening paragraph does not name {name}"
    link = re.search(r"\(docs/contract\.md#([\w-]+)\)", opening)
    assert link, "README's opening paragraph does not link to docs/contract.md's comparison"
    headings = re.findall(r"^#+ (.+)$", (ROOT / "docs" / "contract.md").read_text(), flags=re.M)
    assert link.group(1) in {_anchor(h) for h in headings}, link.group(1)
