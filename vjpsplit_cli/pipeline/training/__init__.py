"""Training over stages: the Trainer, the optimizer step where each stage's parameters live.

Owns ``Trainer`` (``trainer``), parameter ownership (``ownership``: which stage
holds which leaf, tied leaves, ``params`` back), the backends behind one
``Backend`` protocol (``backend``; ``inprocess`` threads, ``ray`` actors), each
stage's training state (``stage_trainer``), the optimizer as exported programs
(``optimizer``), the whole model's update cut by stage (``separable``), clipping
by the global norm (``clipping``), the whole model's
optax state joined from the stages' (``state``), checkpoints keyed by the model
(``checkpoint``) and what resumes from them (``resume``), ``fit``'s run of many
steps with background checkpoints and restarts after a lost Ray worker
(``fit``), the step history (``history``), measured costs from timed
steps (``measured``) and ``schedule="auto"`` (``autoplan``).

May import everything in ``pipeline`` before it (``schedules``, ``stages``,
``runtime``) and the layers below ``pipeline``.
"""
