"""The API reference (docs/api/index.md, built by mkdocstrings in CI) documents every public name, each once."""

from __future__ import annotations

import ast
import dataclasses
import enum
import inspect
import re
import textwrap
from pathlib import Path
from typing import Any

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


_HEADER = re.compile(r"^(Args|Attributes|Returns|Raises):\s*$")
_ENTRY = re.compile(r"^    (\*{0,2}\w+)\b[^:]*:")


def _sections(doc: str | None) -> dict[str, list[str]]:
    """A Google-style docstring's sections, each with the names its entries document (Returns: has none)."""
    sections: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in inspect.cleandoc(doc or "").splitlines():
        header = _HEADER.match(line)
        if header:
            current = sections.setdefault(header.group(1), [])
        elif line and not line.startswith(" "):
            current = None
        elif current is not None:
            entry = _ENTRY.match(line)
            if entry:
                current.append(entry.group(1).lstrip("*"))
    return sections


def _parameters(fn: Any) -> list[str]:
    return [n for n in inspect.signature(fn).parameters if n not in ("self", "cls")]


def _returns_value(fn: Any) -> bool:
    ret = inspect.signature(fn).return_annotation
    return ret not in (None, "None")


def _public_objects() -> list[tuple[str, Any]]:
    pairs = [(f"vjpsplit_cli.{n}", getattr(vs, n)) for n in vs.__all__ if n not in ("__version__", "pipeline")]
    pairs += [(f"vjpsplit_cli.pipeline.{n}", getattr(P, n)) for n in P.__all__]
    return [(name, obj) for name, obj in pairs if inspect.isclass(obj) or inspect.isfunction(obj)]


def _public_methods(cls: type) -> list[tuple[str, Any]]:
    """The methods a class defines itself, by name (properties are documented as attributes, in prose)."""
    out = []
    for name, value in vars(cls).items():
        if name.startswith("_"):
            continue
        fn = value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
        if inspect.isfunction(fn):
            out.append((name, fn))
    return out


def _function_problems(name: str, fn: Any) -> list[str]:
    sections = _sections(inspect.getdoc(fn))
    problems = []
    params = _parameters(fn)
    if params and "Args" not in sections:
        problems.append(f"{name}: takes {', '.join(params)} but its docstring has no Args: section")
    elif params:
        missing = [p for p in params if p not in sections["Args"]]
        if missing:
            problems.append(f"{name}: Args: does not document {', '.join(missing)}")
    if _returns_value(fn) and "Returns" not in sections:
        problems.append(f"{name}: returns a value but its docstring has no Returns: section")
    return problems


def _attribute_docstrings(cls: type) -> list[str]:
    """The fields of ``cls`` documented where they are declared: a string right after the annotation."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
    assert isinstance(body, ast.ClassDef)
    return [
        a.target.id
        for a, b in zip(body.body, body.body[1:])
        if isinstance(a, ast.AnnAssign)
        and isinstance(a.target, ast.Name)
        and isinstance(b, ast.Expr)
        and isinstance(b.value, ast.Constant)
        and isinstance(b.value.value, str)
    ]


def _class_problems(name: str, cls: type) -> list[str]:
    sections = _sections(cls.__doc__)
    if dataclasses.is_dataclass(cls):
        # A dataclass's fields are its constructor's arguments: documented under either heading, or each where it is
        # declared (an attribute docstring, which mkdocstrings reads too).
        documented = sections.get("Attributes", []) + sections.get("Args", []) + _attribute_docstrings(cls)
        missing = [f.name for f in dataclasses.fields(cls) if f.name not in documented]
        return (
            [f"{name}: no Attributes:, Args: or docstring of its own documents the fields {', '.join(missing)}"]
            if missing
            else []
        )
    if issubclass(cls, enum.Enum):
        missing = [m for m in cls.__members__ if m not in sections.get("Attributes", [])]
        return [f"{name}: Attributes: does not document the members {', '.join(missing)}"] if missing else []
    init = vars(cls).get("__init__")
    if init is None:
        return []  # the constructor of a base class (an exception's, a warning's)
    params = _parameters(init)
    # The constructor's arguments under the class's Args: or its __init__'s (Google style allows either).
    documented = sections.get("Args", []) + _sections(init.__doc__).get("Args", [])
    missing = [p for p in params if p not in documented]
    return [f"{name}: neither the class's nor __init__'s Args: documents {', '.join(missing)}"] if missing else []


def test_public_functions_and_methods_document_their_arguments_and_results():
    problems: list[str] = []
    for name, obj in _public_objects():
        if inspect.isfunction(obj):
            problems += _function_problems(name, obj)
            continue
        assert isinstance(obj, type)
        problems += _class_problems(name, obj)
        for method, fn in _public_methods(obj):
            problems += _function_problems(f"{name}.{method}", fn)
    assert problems == [], "\n".join(problems)


def test_the_docstring_check_reads_google_sections():
    def documented(a: int, *rest: int, flag: bool = False) -> int:
        """Sum.

        Args:
            a: The first.
                A continuation line, not an entry.
            *rest: The others.

        Returns:
            Their sum.
        """
        return a + sum(rest)

    assert _sections(documented.__doc__) == {"Args": ["a", "rest"], "Returns": []}
    assert _function_problems("documented", documented) == ["documented: Args: does not document flag"]
