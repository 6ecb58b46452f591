"""Trust: whether an artifact's modules may be compiled here.

Owns Ed25519 keys and signatures (``signing``); the table of each module's inputs and
outputs (``module_io``); the checks every module passes before it compiles (``checks``:
avals, with the custom-call policy in ``custom_calls`` and the kernel check at a call's
shapes in ``kernelcheck``); parsing StableHLO safely, in a child process first
(``probes``, ``mlirprobe``); and the cache of clean verdicts (``verdicts``).

It judges bytes; it does not make them.
"""
