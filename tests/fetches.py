"""What an untimed step reads back from its devices, and when: the updates and fetches in the order they happen."""

from __future__ import annotations

import jax


def step_noting_fetches(tr, batch, monkeypatch):
    """``tr.step(batch)`` with every implicit device-to-host transfer refused (in the step's own thread too), noting
    each optimizer update and each ``jax.device_get`` (the one jax function every fetch goes through) in order.

    Returns:
        ``(what the step returned, ["update" | "fetch", ...])``.
    """
    from vjpsplit_cli.pipeline.training import optimizer_program

    seen: list[str] = []
    update, get = optimizer_program.OptimizerProgram.update, jax.device_get

    def noted_update(self, *a, **k):
        seen.append("update")
        return update(self, *a, **k)

    def noted_get(x):
        seen.append("fetch")
        return get(x)

    monkeypatch.setattr(optimizer_program.OptimizerProgram, "update", noted_update)
    monkeypatch.setattr(jax, "device_get", noted_get)
    with jax.transfer_guard_device_to_host("disallow"):  # np.asarray / float of a device array raise
        jax.config.update("jax_transfer_guard_device_to_host", "disallow")  # the step's own thread too
        try:
            got = tr.step(batch)
        finally:
            jax.config.update("jax_transfer_guard_device_to_host", "allow")
    return got, seen
