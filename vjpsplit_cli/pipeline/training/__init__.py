"""Training over stages: the Trainer, the optimizer step where each stage's parameters live.

Owns ``Trainer`` (``trainer``: one class, opened, stepped, evaluated, saved and measured), parameter ownership
(``ownership``: which stage holds which leaf, tied leaves, ``params`` back), the
backends behind one ``Backend`` protocol (``backend``; ``inprocess`` threads,
``ray`` actors: ``ray_backend`` drives ``train_actor``s), each stage's training
state (``stage_trainer``), the optimizer as exported programs (``optimizer``
exports, ``optimizer_program`` loads and runs), the whole model's update cut by
stage (``separable``, over ``leaf_labels`` and ``jaxpr_graph``), clipping by the
global norm (``clipping``), the whole model's optax state joined from the
stages' (``state``), checkpoints keyed by the model (``checkpoint``, its layout
``checkpoint_layout`` and its place ``checkpoint_directory``) and what resumes
from them (``resume``), ``fit``'s run of many steps with background checkpoints
and restarts after a lost Ray worker (``fit``), the step history (``history``),
measured costs from timed steps (``measured``), ``schedule="auto"``
(``autoplan``) and the Trainer's options (``option_values``, ``options``).
"""
