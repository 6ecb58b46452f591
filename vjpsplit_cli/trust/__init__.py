"""Trust: whether an artifact's modules may be compiled here.

Owns Ed25519 keys and signatures (``signing``), the checks every module passes before it
compiles and their verdict cache (``checks``), and the child process that parses StableHLO
first (``mlirprobe``).

May import: ``errors``, ``config``, ``safeio``, ``files``. Not ``tracing``, ``artifact``,
``cli`` or ``pipeline``: it judges bytes, it does not make them.
"""
