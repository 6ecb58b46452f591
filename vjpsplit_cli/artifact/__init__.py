"""Artifacts: both halves of a split as portable ``jax.export`` modules, and what they run on.

Owns the manifest and its format versions (``manifest``, one array's entry ``leaf``); ``export`` as named steps
(``lowering``, with ``jaxexport``, ``flatforward`` and ``weightsplit``); the artifact and its
file (``artifact``: one class, its pytree calls, its calls on flat keys and its split backward;
``artifact_file``); reading one back with every check (``loading``); the
caller's arrays against a manifest (``arguments``, ``binding``, the split backward's ``weight_binding``), each signature's
plan (``callplan``), placed (``placement``) and run
(``runner``); residual and intermediates files (``residual_files``, ``split_residual_files``, ``residual_meta``);
shardings (``sharding``); templates (``templates``); what ``inspect``/``plan`` print
(``report``); and the cache of compiled executables (``execcache``).
"""
