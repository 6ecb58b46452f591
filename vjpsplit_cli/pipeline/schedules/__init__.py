"""Schedules, pure data: which worker runs which F, B, I and W operations, in what order, and how that plays.

Owns the operation and its one dependency rule (``ops``), the built-in schedules
by name (``catalog``, ``builtins``), layouts (``layout``: which worker runs which
stage), the op costs (``costs``), the plans' execution order (``play``: the order the dispatcher submits in,
the deadlock check, the simulator with per-stage costs and send delays, ZB-H1's
W placement), the checks and resolution of a step's plans (``plans``), plans as
torch's CSV (``csvformat``), timelines (``timeline``), plots (``plots``), and
automatic schedules (``auto``, on the list scheduler of ``listscheduler``) under a cost model of memory peaks and bounds (``modeled``).

Nothing here runs a model.
"""
