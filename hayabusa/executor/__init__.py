"""How the engine reaches its model: in-process (one device: the ModelRunner itself, no executor in between),
worker processes on this machine (mp_executor.py), or Ray workers (ray_executor.py)."""

from __future__ import annotations

from typing import Any


def make_executor(config: Any) -> Any:
    """The ModelRunner itself for one rank; else an executor with its interface over worker processes."""
    pc = config.parallel_config
    if pc is None or (pc.world_size == 1 and pc.backend != "ray"):
        from hayabusa.worker.model_runner import ModelRunner

        return ModelRunner(config)
    if pc.backend == "ray":
        from hayabusa.executor.ray_executor import RayExecutor

        return RayExecutor(config)
    from hayabusa.executor.mp_executor import MultiprocExecutor

    return MultiprocExecutor(config)
