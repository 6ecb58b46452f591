"""Artifacts: both halves of a split as portable ``jax.export`` modules, and what they run on.

Owns the manifest and its format versions (``manifest``), ``export`` (``lowering``), reading an
artifact back with every check (``loading``), running one (``artifact``), residuals and
intermediates and their files (``residuals``, ``residual_files``), shardings (``sharding``),
templates (``templates``), what ``inspect``/``plan`` print (``report``) and the cache of
compiled executables (``execcache``).

May import: ``errors``, ``config``, ``safeio``, ``files``, ``tracing``, ``trust``. Not ``cli``
or ``pipeline``.
"""
