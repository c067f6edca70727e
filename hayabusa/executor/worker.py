"""The body of one worker process: join the process group, load this rank's shard, size the KV cache with the
others (the minimum of every rank's capacity), then run each step it is sent.

Messages on the pipe from the engine (pickled tuples): ("init_kv", num_blocks, num_cpu_blocks),
("step", seq, SchedulerOutput), ("forget",), ("shutdown",). Replies: ("ready", num_blocks, num_cpu_blocks) from
every rank (its KV capacity and its CPU tier's, of its own KV heads and its stage's layers), ("kv_ready",) from
every rank, and per step ("out", seq, ModelRunnerOutput) from the driver rank only (``ParallelConfig.driver_rank``:
the last pipeline stage's tp rank 0; rank 0 without pipeline stages). Any exception is sent as ("error", rank, text) and ends the
process; so does the engine's end of the pipe closing (the engine process is gone).
"""

from __future__ import annotations

import collections
import dataclasses
import os
import pickle
import signal
import threading
import time
import traceback
from typing import Any

import torch


def _watch_parent(parent_pid: int) -> None:
    """End this process when the engine process is gone (no orphan workers, even after a SIGKILL)."""
    while True:
        time.sleep(0.5)
        if os.getppid() != parent_pid:
            os._exit(1)


def rank_config(config: Any, rank: int) -> Any:
    """The engine config as rank ``rank`` sees it: its GPU, its share of the KV heads, its pipeline stage's
    decoder layers (``num_layers``: the KV cache's, its capacity and its CPU tier's)."""
    from hayabusa.distributed.config import get_pp_indices, kv_heads_per_rank

    pc = config.parallel_config
    start, end = get_pp_indices(config.model_config.num_layers, rank // pc.tensor_parallel_size,
                                pc.pipeline_parallel_size)
    mc = dataclasses.replace(config.model_config,
                             num_kv_heads=kv_heads_per_rank(config.model_config.num_kv_heads,
                                                            pc.tensor_parallel_size),
                             num_layers=end - start)
    device = config.device_config.device
    if device.type == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    return dataclasses.replace(config, model_config=mc,
                               device_config=dataclasses.replace(config.device_config, device=device))


def worker_main(config: Any, rank: int, init_method: str, conn: Any, parent_pid: int) -> None:
    """Entry point of a spawned worker (see the module docstring)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C is the engine's to handle; it ends us
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    try:
        _serve(config, rank, init_method, conn)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        os._exit(0)                                # the engine is gone
    except BaseException:
        try:
            conn.send_bytes(pickle.dumps(("error", rank, traceback.format_exc())))
        except Exception:
            pass
        os._exit(1)
    os._exit(0)


def _serve(config: Any, rank: int, init_method: str, conn: Any) -> None:
    from hayabusa.distributed.parallel_state import destroy_distributed, init_distributed, tp_all_reduce
    from hayabusa.worker.model_runner import ModelRunner

    pc = config.parallel_config
    cfg = rank_config(config, rank)
    if cfg.device_config.device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // pc.world_size))
    init_distributed(rank, pc.world_size, init_method, pc.dist_backend,
                     tensor_parallel_size=pc.tensor_parallel_size)
    # one collective now: NCCL sets its communicator up lazily, and that must not happen inside a CUDA graph
    # capture (with num_gpu_blocks_override there is no profiling forward before the capture)
    tp_all_reduce(torch.zeros(1, device=cfg.device_config.device))
    torch.manual_seed(config.seed)   # every rank draws unseeded samples from the same default generator
    runner = ModelRunner(cfg)
    conn.send_bytes(pickle.dumps(("ready", runner.profile_num_blocks(), runner.profile_num_cpu_blocks())))
    kind, num_blocks, num_cpu_blocks = pickle.loads(conn.recv_bytes())
    assert kind == "init_kv", kind
    runner.initialize_kv_cache(num_blocks, num_cpu_blocks)    # the minimum over the ranks of each
    conn.send_bytes(pickle.dumps(("kv_ready",)))
    # a pipeline stage before the last finishes its steps lazily (EarlierStage): it runs step N + 1 meanwhile
    earlier = EarlierStage(runner, pc.pipeline_parallel_size) \
        if rank // pc.tensor_parallel_size < pc.pipeline_parallel_size - 1 else None
    while True:
        msg = pickle.loads(conn.recv_bytes())
        if msg[0] == "step" and earlier is not None:
            earlier.launch(msg[2])
        elif msg[0] == "step":
            out = runner.execute_model(msg[2])
            if rank == pc.driver_rank:
                conn.send_bytes(pickle.dumps(("out", msg[1], out)))
        elif msg[0] == "forget":
            if earlier is not None:
                earlier.pending.clear()
            runner.forget_previous_step()
        elif msg[0] == "shutdown":
            break
    destroy_distributed()


class EarlierStage:
    """A pipeline stage before the last: it launches each step (its layers, the hidden states sent on) and
    finishes it (waits for the last stage's sampled ids, written into its rows) only when a later step touches
    one of its requests or more than ``depth`` steps are pending. So while the later stages run step N it already
    runs step N + 1 (the engine keeps up to pipeline_parallel_size micro-batches of disjoint requests in flight).

    Args:
        runner: this rank's ModelRunner.
        depth: pipeline_parallel_size.
    """

    def __init__(self, runner: Any, depth: int) -> None:
        self.runner, self.depth = runner, depth
        self.pending: collections.deque = collections.deque()   # StepHandles launched, oldest first

    def launch(self, out: Any) -> None:
        from hayabusa.worker.model_runner import PendingSample

        touched = set(out.scheduled_req_ids) | set(out.finished_req_ids) | set(out.preempted_req_ids)
        # only sampled rows get tokens written: a prompt chunk in flight needs no wait before its next chunk
        last = max((i for i, h in enumerate(self.pending) if touched.intersection(h.sampled_req_ids)), default=-1)
        for _ in range(max(last + 1, len(self.pending) - self.depth + 1)):
            self.runner.finish(self.pending.popleft())   # oldest first: their tokens into the rows
        handle = self.runner.launch(out)
        if isinstance(handle, PendingSample):   # constrained rows: no logits here, nothing to mask
            handle = self.runner.sample_tokens(handle, out.grammar_bitmask)
        self.pending.append(handle)
