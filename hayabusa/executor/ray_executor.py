"""RayExecutor: the workers of MultiprocExecutor placed by Ray (``distributed_executor_backend="ray"``), so an
engine spans several machines of an existing Ray cluster: a placement group with one bundle per rank (one GPU
each on CUDA, one CPU on CPU), packed onto as few nodes as possible. Rank 0's node hosts the torch.distributed
rendezvous. Each step is one actor call per worker (Ray serializes the SchedulerOutput once and shares it through
its object store); only rank 0's call returns the tokens. A dead actor or a failed step is a WorkerError.

Ray is an optional extra (``pip install hayabusa[ray]``); it is imported only here.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from typing import Any

from hayabusa.core.scheduler_output import SchedulerOutput
from hayabusa.errors import HayabusaValidationError
from hayabusa.executor.base import ExecutorBase, step_timeout, waits_for_bitmask
from hayabusa.executor.mp_executor import WorkerError


class RayWorker:
    """One rank inside a Ray actor: the same steps as a spawned worker (hayabusa/executor/worker.py)."""

    def __init__(self, config: Any, rank: int) -> None:
        self.config, self.rank, self.runner = config, rank, None

    def address(self) -> tuple[str, int]:
        """(this node's IP, a free port): the rendezvous, asked of rank 0."""
        import socket

        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            return ray.util.get_node_ip_address(), s.getsockname()[1]

    def start(self, init_method: str) -> tuple[int, int]:
        """Join the process group, load this rank's shard; returns its KV capacity in blocks and its CPU tier's."""
        import torch

        from hayabusa.distributed.parallel_state import init_distributed
        from hayabusa.executor.worker import rank_config
        from hayabusa.worker.model_runner import ModelRunner

        pc = self.config.parallel_config
        cfg = rank_config(self.config, self.rank)
        init_distributed(self.rank, pc.world_size, init_method, pc.dist_backend)
        torch.manual_seed(self.config.seed)
        self.runner = ModelRunner(cfg)
        return self.runner.profile_num_blocks(), self.runner.profile_num_cpu_blocks()

    def init_kv(self, num_blocks: int, num_cpu_blocks: int) -> None:
        self.runner.initialize_kv_cache(num_blocks, num_cpu_blocks)

    def execute_model(self, out: SchedulerOutput) -> Any:
        result = self.runner.execute_model(out)
        return result if self.rank == 0 else None

    def forget_previous_step(self) -> None:
        self.runner.forget_previous_step()


@dataclass
class RayStep:
    refs: list            # one ObjectRef per rank, rank 0 first
    sched: SchedulerOutput | None = None


class RayExecutor(ExecutorBase):
    """ModelRunner's interface over Ray actors (see MultiprocExecutor).

    Args:
        config: the engine config; joins the running Ray cluster (``ray.init()``; ``RAY_ADDRESS``) or starts a
            local one.
    """

    def __init__(self, config: Any) -> None:
        try:
            import ray
            from ray.util.placement_group import placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        except ImportError:
            raise HayabusaValidationError(
                "distributed_executor_backend='ray' needs Ray: pip install 'hayabusa[ray]'.",
                parameter="distributed_executor_backend", value="ray") from None
        self._ray = ray
        pc = config.parallel_config
        self.world_size = pc.world_size
        self.device = config.device_config.device
        self._dead: str | None = None
        if not ray.is_initialized():
            ray.init(ignore_reinit_error=True, include_dashboard=False, log_to_driver=False)
        cuda = self.device.type == "cuda"
        bundle = {"GPU": 1, "CPU": 1} if cuda else {"CPU": 1}
        self.pg = placement_group([dict(bundle) for _ in range(self.world_size)], strategy="PACK")
        start_timeout = float(os.environ.get("HAYABUSA_WORKER_START_TIMEOUT", "600"))
        ready, _ = ray.wait([self.pg.ready()], timeout=start_timeout)
        if not ready:
            raise self._fail(f"Ray could not place {self.world_size} workers ({bundle} each) within "
                             f"{start_timeout:.0f} s")
        env = {"PYTHONPATH": os.environ.get("PYTHONPATH", ""), "TOKENIZERS_PARALLELISM": "false"}
        actor_cls = ray.remote(RayWorker)
        self.actors = [actor_cls.options(
            num_cpus=1, num_gpus=1 if cuda else 0, runtime_env={"env_vars": env},
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i),
        ).remote(config, i) for i in range(self.world_size)]
        ip, port = self._get([self.actors[0].address.remote()], start_timeout)[0]
        init = f"tcp://{ip}:{port}"
        capacities = self._get([a.start.remote(init) for a in self.actors], start_timeout)
        self.num_blocks_per_rank = [c[0] for c in capacities]
        self.num_cpu_blocks = min(c[1] for c in capacities)   # every rank's CPU tier, of its own KV heads

    def _fail(self, why: str) -> WorkerError:
        if self._dead is None:
            self._dead = why
            self.shutdown()
            self._dead = why
        return WorkerError(why)

    def _get(self, refs: list, timeout: float | None) -> list:
        """Every ref's value; the first error (an actor died, a step raised) or a timeout is a WorkerError."""
        if self._dead is not None:
            raise WorkerError(self._dead)
        ray = self._ray
        deadline = None if timeout is None else time.monotonic() + timeout
        pending = list(refs)
        while pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, pending = ray.wait(pending, num_returns=1, timeout=left)
            if not ready:
                raise self._fail(f"a Ray worker did not answer within {timeout:.0f} s")
            try:
                ray.get(ready)
            except Exception as e:   # RayActorError, RayTaskError: the worker's traceback is in the message
                raise self._fail(f"a Ray worker failed: {type(e).__name__}: {e}") from None
        return ray.get(list(refs))

    def _send_init_kv(self, num_blocks: int, num_cpu_blocks: int) -> None:
        self._get([a.init_kv.remote(num_blocks, num_cpu_blocks) for a in self.actors], None)

    def launch(self, out: SchedulerOutput) -> RayStep:
        if self._dead is not None:
            raise WorkerError(self._dead)
        if waits_for_bitmask(out):
            return RayStep([], out)
        ref = self._ray.put(out)
        return RayStep([a.execute_model.remote(ref) for a in self.actors])

    def sample_tokens(self, handle: RayStep, bitmask: Any) -> RayStep:
        return self.launch(dataclasses.replace(handle.sched, grammar_bitmask=bitmask))

    def finish(self, handle: RayStep) -> Any:
        return self._get(handle.refs, step_timeout())[0]

    def _send_forget(self) -> None:
        self._get([a.forget_previous_step.remote() for a in self.actors], None)

    def shutdown(self) -> None:
        """Kill the actors and remove the placement group; idempotent."""
        if getattr(self, "_shut", False):
            return
        self._shut = True
        self._dead = self._dead or "the engine was shut down"
        ray = self._ray
        for a in getattr(self, "actors", []):
            try:
                ray.kill(a)
            except Exception:
                pass
        try:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.pg)
        except Exception:
            pass
