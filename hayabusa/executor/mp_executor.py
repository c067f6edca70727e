"""MultiprocExecutor: tensor_parallel_size x pipeline_parallel_size worker processes on this machine, driven like a
ModelRunner.

The scheduler stays in the engine process. Every worker (rank 0 included) is a spawned process that owns its
model shard and KV-cache shard: the engine process then holds no device memory and no process group, and one
rule covers every rank's failure (a dead or failing rank 0 is found like any other). Each step's SchedulerOutput
is pickled once and the same bytes written to every worker's pipe; only the driver rank (the last pipeline stage's
tp rank 0; rank 0 without stages) answers with the sampled tokens (the last stage's ranks sample the same tokens
from the same all-gathered logits and seeded generators; the earlier stages get them by a broadcast within the
step, so every rank's state agrees without a reply).

Failures surface as WorkerError in the caller: a worker that exits (killed, crashed) is seen through its process
sentinel at once, one that raises sends its traceback, one that does not answer the start within
``HAYABUSA_WORKER_START_TIMEOUT`` seconds (default 600) or a step within ``HAYABUSA_STEP_TIMEOUT`` (default: no
limit) is given up; then every worker is ended. Workers also end themselves when the engine process disappears.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import os
import pickle
import socket
import time
import weakref
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Any

from hayabusa.core.scheduler_output import SchedulerOutput
from hayabusa.executor.base import ExecutorBase, step_timeout, waits_for_bitmask

logger = logging.getLogger(__name__)


class WorkerError(RuntimeError):
    """A worker process died, failed a step or did not answer; the engine's workers are ended, so no step can
    run again (``engine_dead``: AsyncLLMEngine stops its thread on it)."""

    engine_dead = True


@dataclass
class RemoteStep:
    """A step sent to the workers (``seq`` matches rank 0's answer), or one waiting for its grammar bitmask."""

    seq: int
    sched: SchedulerOutput | None = None   # set while the step waits for sample_tokens (not yet sent)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _end_workers(procs: list, conns: list, graceful: bool) -> None:
    """Ask the workers to stop (graceful), then terminate and finally kill those still alive; close the pipes."""
    if graceful:
        for c in conns:
            try:
                c.send_bytes(pickle.dumps(("shutdown",)))
            except Exception:
                pass
        deadline = time.monotonic() + 5.0
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(2.0)
        if p.is_alive():
            p.kill()
            p.join(1.0)
    for c in conns:
        c.close()


class MultiprocExecutor(ExecutorBase):
    """ModelRunner's interface (initialize_kv_cache, launch, sample_tokens, finish, forget_previous_step) over
    worker processes, plus ``shutdown``.

    Args:
        config: the engine config; ``config.parallel_config.world_size`` workers are started.
    """

    def __init__(self, config: Any) -> None:
        from hayabusa.executor.worker import worker_main

        self.config = config
        self.world_size = config.parallel_config.world_size
        self.driver_rank = config.parallel_config.driver_rank   # the last pipeline stage's tp rank 0
        self.device = config.device_config.device
        self._seq = 0
        self._dead: str | None = None
        self.step_timeout = step_timeout()
        ctx = mp.get_context("spawn")
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        self.procs, self.conns = [], []
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=worker_main, args=(config, rank, init_method, child, os.getpid()),
                            name=f"hayabusa-worker-{rank}", daemon=True)
            p.start()
            child.close()
            self.procs.append(p)
            self.conns.append(parent)
        self._finalizer = weakref.finalize(self, _end_workers, self.procs, self.conns, True)
        start_timeout = float(os.environ.get("HAYABUSA_WORKER_START_TIMEOUT", "600"))
        replies = self._gather("ready", start_timeout)
        self.num_blocks_per_rank = [r[1] for r in replies]
        # every rank keeps a CPU tier of its own KV heads (swap_space each); they share the CPU block ids
        self.num_cpu_blocks = min(r[2] for r in replies)
        self.pids = [p.pid for p in self.procs]

    # ------------------------------------------------------------------ failure handling
    def _fail(self, why: str) -> WorkerError:
        """End every worker and remember why; returns the error to raise."""
        if self._dead is None:
            self._dead = why
            logger.error("%s; ending the workers", why)
            self._finalizer.detach()
            _end_workers(self.procs, self.conns, graceful=False)
        return WorkerError(self._dead)

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise WorkerError(self._dead)

    def _recv(self, want_rank: int | None, timeout: float | None) -> list[tuple[int, tuple]]:
        """Wait until ``want_rank`` (None: any) has a message; a message from another rank is an error, so is a
        worker's exit. Returns [(rank, message)] of what arrived."""
        deadline = None if timeout is None else time.monotonic() + timeout
        by_obj = {c: i for i, c in enumerate(self.conns)} | {p.sentinel: i for i, p in enumerate(self.procs)}
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise self._fail(f"a worker did not answer within {timeout:.0f} s")
            ready = wait(list(by_obj), left)
            got = []
            for obj in ready:
                rank = by_obj[obj]
                if obj in self.conns:
                    try:
                        msg = pickle.loads(obj.recv_bytes())
                    except (EOFError, OSError):
                        p = self.procs[rank]
                        p.join(0.5)
                        raise self._fail(f"worker {rank} (pid {p.pid}) died (exit code {p.exitcode})") from None
                    if msg[0] == "error":
                        raise self._fail(f"worker {rank} failed:\n{msg[2]}")
                    got.append((rank, msg))
            if not got:
                for obj in ready:   # a sentinel: the process ended
                    rank = by_obj[obj]
                    p = self.procs[rank]
                    p.join(0.1)
                    raise self._fail(f"worker {rank} (pid {p.pid}) died (exit code {p.exitcode})")
                continue
            return got

    def _gather(self, kind: str, timeout: float) -> list[tuple]:
        """One ``kind`` message from every rank, in rank order."""
        replies: dict[int, tuple] = {}
        deadline = time.monotonic() + timeout
        while len(replies) < self.world_size:
            for rank, msg in self._recv(None, max(0.0, deadline - time.monotonic())):
                assert msg[0] == kind, (kind, msg[0])
                replies[rank] = msg
        return [replies[r] for r in range(self.world_size)]

    def _broadcast(self, msg: tuple) -> None:
        self._check_alive()
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        for rank, c in enumerate(self.conns):
            try:
                c.send_bytes(data)
            except (BrokenPipeError, OSError):
                raise self._fail(f"worker {rank} (pid {self.procs[rank].pid}) is gone") from None

    # ------------------------------------------------------------------ ModelRunner's interface
    def _send_init_kv(self, num_blocks: int, num_cpu_blocks: int) -> None:
        self._broadcast(("init_kv", num_blocks, num_cpu_blocks))
        self._gather("kv_ready", float(os.environ.get("HAYABUSA_WORKER_START_TIMEOUT", "600")))

    def launch(self, out: SchedulerOutput) -> RemoteStep:
        """Send the step to every worker (a step with constrained requests waits for its bitmask first)."""
        self._seq += 1
        if waits_for_bitmask(out):
            return RemoteStep(self._seq, out)
        self._broadcast(("step", self._seq, out))
        return RemoteStep(self._seq)

    def sample_tokens(self, handle: RemoteStep, bitmask: Any) -> RemoteStep:
        self._broadcast(("step", handle.seq, dataclasses.replace(handle.sched, grammar_bitmask=bitmask)))
        return RemoteStep(handle.seq)

    def finish(self, handle: RemoteStep) -> Any:
        """The driver rank's ModelRunnerOutput of the step (answers of earlier, forgotten steps are skipped)."""
        self._check_alive()
        while True:
            for _, msg in self._recv(self.driver_rank, self.step_timeout):
                if msg[1] == handle.seq:
                    return msg[2]

    def _send_forget(self) -> None:
        self._broadcast(("forget",))

    def shutdown(self) -> None:
        """Stop the workers (gracefully, then by force); idempotent."""
        if self._dead is None:
            self._dead = "the engine was shut down"
        self._finalizer()
