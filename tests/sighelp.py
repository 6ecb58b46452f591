"""SIGINT as a terminal's foreground job gets it, whatever disposition the test run inherited.

A shell starts a background job with SIGINT ignored, and Python then installs no
handler of its own (nor do the children it starts): tests that send or raise
SIGINT set the disposition they test, in this process (the ``sigint_default``
fixture in conftest) and in the children they start (``python_with_sigint``).
"""

from __future__ import annotations

import signal
import sys

SET_SIGINT = "import signal; signal.signal(signal.SIGINT, signal.default_int_handler)"


def python_with_sigint(*args: str) -> list[str]:
    """``python -m MODULE ARGS`` or ``python -c CODE ARGS`` whose child handles SIGINT as Python does by default.

    No ``preexec_fn``: it forks this multithreaded (JAX) process. The child sets the
    handler itself, first thing, then runs the module or the code as ``python`` would.
    """
    flag, what, *rest = args
    if flag == "-m":
        code = (
            f"{SET_SIGINT}; import runpy, sys; sys.argv[0] = {what!r}; "
            f"runpy.run_module({what!r}, run_name='__main__', alter_sys=True)"
        )
    elif flag == "-c":
        code = f"{SET_SIGINT}\n{what}"
    else:
        raise ValueError(f"python_with_sigint takes -m MODULE or -c CODE, not {flag!r}")
    return [sys.executable, "-c", code, *rest]


def set_default_sigint():
    """Give this process Python's default SIGINT handler; returns the previous one, to restore."""
    return signal.signal(signal.SIGINT, signal.default_int_handler)
