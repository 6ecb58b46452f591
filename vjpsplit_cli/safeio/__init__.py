"""Safe I/O: outputs that are written whole or not at all, and reads that fail in one line.

Owns crash-safe writes and outputs committed together (``outputs``), CRC-32 at memory speed
(``checksum``), temporary files and the
sweep of stale ones (``temps``), termination signals while writing (``signals``), the Linux calls
Python lacks (``filesystem``), the few I/O threads (``workers``), one-line read errors
(``reading``), and host facts (``system``).

Nothing here knows JAX, arrays or artifacts.
"""
