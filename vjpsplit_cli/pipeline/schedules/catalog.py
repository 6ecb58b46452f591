"""The built-in schedules by name: their labels, which split the backward, and what each needs of the stages.

``check_schedule`` refuses an unknown name, or stage and microbatch counts the
named schedule cannot run, before any list is built.
"""

from __future__ import annotations

from ...errors import VjpsplitError

SCHEDULES = ("gpipe", "1f1b", "zbh1", "zbv", "interleaved1f1b", "dualpipev")
SPLIT_BACKWARD = ("zbh1", "zbv", "dualpipev")  # schedules that split (some) backwards into I and W
LABELS = {
    "gpipe": "GPipe",
    "1f1b": "1F1B",
    "zbh1": "ZB-H1",
    "zbv": "ZB-V",
    "interleaved1f1b": "Interleaved 1F1B",
    "dualpipev": "DualPipeV",
    "custom": "Custom schedule",
}
V_SHAPED = ("zbv", "dualpipev")  # worker w holds stages w and 2p-1-w
CHUNKS = 2  # interleaved 1F1B's stages per worker when only a name is given (Megatron-LM's usual choice)


def describe(name: str) -> str:
    """A schedule's label for titles and messages."""
    return LABELS.get(name, name)


def check_schedule(name: str, num_stages: int, microbatches: int | None = None, chunks: int = CHUNKS) -> None:
    """Refuse an unknown schedule, an empty pipeline, or stages and microbatches the schedule cannot run.

    ``microbatches=None`` checks only what the stages decide.
    """
    S = num_stages
    if name not in SCHEDULES:
        raise VjpsplitError(f"unknown schedule {name!r}; use one of {', '.join(SCHEDULES)}")
    if S < 1 or (microbatches is not None and microbatches < 1):
        raise VjpsplitError("a pipeline needs at least one stage and one microbatch")
    if name in V_SHAPED and S % 2:
        raise VjpsplitError(
            f"{LABELS[name]} runs two stages per worker in a V: it needs an even number of stages, not {S}"
        )
    if name == "interleaved1f1b":
        if chunks < 1 or S % chunks:
            raise VjpsplitError(
                f"interleaved 1F1B with {chunks} stages per worker needs a multiple of {chunks} stages, not "
                f"{S}; for another count pass schedule=schedule('interleaved1f1b', S, m, chunks=v)"
            )
        p = S // chunks
        if microbatches is not None and microbatches % p:
            raise VjpsplitError(
                f"interleaved 1F1B on {p} workers needs a multiple of {p} microbatches, not {microbatches}"
            )
    if name == "dualpipev" and microbatches is not None and microbatches < S:
        raise VjpsplitError(
            f"DualPipeV on {S // 2} workers needs at least {S} microbatches (2 per worker), not {microbatches}"
        )
