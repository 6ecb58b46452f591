"""Terminal-safe text: names that come from files or the command line, printed as one safe line."""

from __future__ import annotations

_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def printable(text: object) -> str:
    """``text`` with control, format and separator characters escaped, so it prints as one safe line.

    A newline becomes ``\\n``, an escape code ``\\x1b``, a bidi override ``\\u202e``,
    and a byte of a file name that was not UTF-8 (a surrogate escape) ``\\xNN``.
    """
    text = str(text)
    if text.isprintable():
        return text
    out: list[str] = []
    for ch in text:
        if ch.isprintable() or ch == " ":
            out.append(ch)
        elif ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif 0xDC80 <= ord(ch) <= 0xDCFF:  # os.fsdecode's stand-in for an undecodable byte
            out.append(f"\\x{ord(ch) - 0xDC00:02x}")
        elif ord(ch) < 0x100:
            out.append(f"\\x{ord(ch):02x}")
        elif ord(ch) < 0x10000:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(f"\\U{ord(ch):08x}")
    return "".join(out)
