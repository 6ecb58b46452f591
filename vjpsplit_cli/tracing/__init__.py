"""Tracing: the split itself, on public JAX APIs only.

Owns one ``jax.vjp`` trace cut into residuals and a backward (``vjp``), ``split`` (``split``),
save-versus-recompute policies and their choice (``policies``, ``choice``), the zero-bubble B/W
cut of the backward's jaxpr (``zerobubble``, ``fission``) and walking jaxprs (``jaxprs``).

May import: ``errors``, ``config``, ``files`` (dtypes, shapes, PRNG keys). Not ``artifact``,
``trust``, ``cli`` or ``pipeline``.
"""
