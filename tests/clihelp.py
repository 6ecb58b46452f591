"""Command lines for the CLI tests: options from keywords instead of one line per word."""

from __future__ import annotations


def opts(**options) -> list[str]:
    """``opts(residuals=p, self_contained=True)`` -> ``["--residuals", str(p), "--self-contained"]``.

    In keyword order; ``True`` gives a bare flag, ``None`` and ``False`` nothing.
    """
    out: list[str] = []
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            out.append(flag)
        elif value is not None and value is not False:
            out += [flag, str(value)]
    return out
