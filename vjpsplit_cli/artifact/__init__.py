"""Artifacts: both halves of a split as portable ``jax.export`` modules, and what they run on.

Owns the manifest and its format versions (``manifest``, one array's entry ``leaf``); ``export`` as named steps
(``lowering``, with ``jaxexport``, ``flatforward`` and ``weightsplit``); the artifact and its
file (``artifact``, ``artifact_file``); reading one back with every check (``loading``); the
caller's arrays against a manifest (``arguments``, ``binding``), placed (``placement``) and run
(``runner``); residual and intermediates files (``residual_files``, ``split_residual_files``, ``residual_meta``);
shardings (``sharding``); templates (``templates``); what ``inspect``/``plan`` print
(``report``); and the cache of compiled executables (``execcache``).

May import: ``errors``, ``config``, ``terminal``, ``safeio``, ``files``, ``tracing``, ``trust``.
Not ``cli`` or ``pipeline``.
"""
