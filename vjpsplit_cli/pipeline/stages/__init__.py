"""Stages from one function: the mark, the cut, the cost model, the balanced cut, the export, the directory.

Owns ``stage_boundary`` (``boundary``), tracing and cutting the jaxpr (``cut``),
the FLOP and byte estimates (``costmodel``), the cut without marks (``balance``),
``export_stages`` (``exporting``), ``Stages`` and its directory (``directory``)
with its typed, versioned index (``index``: ``stages.json``), what ``vjpsplit
inspect DIR`` prints (``report``), and a step's microbatches given one by one with
their loss weights (``microbatches``: ``Microbatches``).
"""
