"""Tracing: the split itself, on public JAX APIs only.

Owns reading a function's arguments (``signatures``: ``wrt``, positional names), one ``jax.vjp``
trace cut into residuals and a backward (``vjp``), the trace-and-run that ``split``, the policy
candidates and ``export`` share (``traced``), ``split`` (``split``), the residual types and the
read-only containers under them (``residuals``, ``frozen``), save-versus-recompute policies, the
candidates' timing and the choice (``policies``, ``timing``, ``choice``), specs at concrete
sizes (``specs``), the zero-bubble B/W cut of the backward's jaxpr (``zerobubble``, ``fission``)
and walking jaxprs (``jaxprs``).
"""
