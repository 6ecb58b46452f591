"""Running one pipelined step: the stage worker, the model's one form, the one dispatcher, the runners.

Owns what a runner runs (``model``: a ``Stages`` or the per-stage form, cut into
microbatches, gradients gathered back), one stage's F, B and W (``worker``), its jitted calls (``stagecalls``),
what the runners call on a stage (``stageops``: ``RunsOps``, ``run_op``), the device bytes a stage holds
(``devicebytes``), residuals off the device (``offload``),
device groups of sharded stages (``devices``), the one dispatcher (``dispatch``,
on ``schedules.play``), the result every runner returns (``result``), the
in-process runner (``inprocess``) and its steps, untimed from one thread
(``untimed``) or timed on worker threads (``timed``), the threads kept across
steps (``workerthreads``), a step's timeout and stopped report (``stepwatch``),
and the Ray runner (``ray/``); ``training.runners.run`` picks one.
"""
