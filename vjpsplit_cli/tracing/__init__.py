"""Tracing: the split itself, on public JAX APIs only.

Owns one ``jax.vjp`` trace cut into residuals and a backward (``vjp``), the trace-and-run that
``split``, the policy candidates and ``export`` share (``traced``), ``split`` (``split``),
save-versus-recompute policies and their choice (``policies``, ``choice``), specs at concrete
sizes (``specs``), the zero-bubble B/W cut of the backward's jaxpr (``zerobubble``, ``fission``)
and walking jaxprs (``jaxprs``).

May import: ``errors``, ``config``, ``files`` (dtypes, shapes, PRNG keys). Not ``artifact``,
``trust``, ``cli`` or ``pipeline``.
"""
