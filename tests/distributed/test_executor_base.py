"""ExecutorBase: the part of ModelRunner's interface that MultiprocExecutor and RayExecutor share (no process is
started here: a recording subclass stands in for the ranks)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hayabusa.core.scheduler_output import CachedRequestData, SchedulerOutput
from hayabusa.executor.base import ExecutorBase, step_timeout, waits_for_bitmask
from hayabusa.executor.mp_executor import MultiprocExecutor
from hayabusa.executor.ray_executor import RayExecutor


@dataclass
class Handle:
    out: SchedulerOutput
    sched: SchedulerOutput | None = None


class Recorder(ExecutorBase):
    def __init__(self) -> None:
        self.num_blocks_per_rank, self.num_cpu_blocks, self._dead, self.calls = [12, 9], 5, None, []

    def _send_init_kv(self, num_blocks, num_cpu_blocks):
        self.calls.append(("init_kv", num_blocks, num_cpu_blocks))

    def launch(self, out):
        self.calls.append(("launch", out.grammar_bitmask))
        return Handle(out, out if waits_for_bitmask(out) else None)

    def sample_tokens(self, handle, bitmask):
        self.calls.append(("sample_tokens", bitmask))
        return Handle(handle.out)

    def finish(self, handle):
        self.calls.append(("finish",))
        return "tokens"

    def _send_forget(self):
        self.calls.append(("forget",))


def _step(structured: bool, bitmask=None) -> SchedulerOutput:
    ids = ["a"] if structured else []
    return SchedulerOutput([], CachedRequestData(["a"], [False], [()], [[]], [3]), {"a": 1}, 1,
                           sampling_req_ids={"a"}, structured_output_req_ids=ids, grammar_bitmask=bitmask)


def test_shared_interface_over_a_recording_executor(monkeypatch):
    ex = Recorder()
    assert ex.initialize_kv_cache() == 9 and ex.calls == [("init_kv", 9, 5)]   # the minimum over the ranks
    ex.calls.clear()
    assert ex.execute_model(_step(False)) == "tokens"
    assert ex.calls == [("launch", None), ("finish",)]
    ex.calls.clear()   # a constrained step without its bitmask waits for sample_tokens (no mask given)
    assert ex.execute_model(_step(True)) == "tokens"
    assert ex.calls == [("launch", None), ("sample_tokens", None), ("finish",)]
    mask = np.full((1, 2), -1, dtype=np.int32)
    assert not waits_for_bitmask(_step(True, mask)) and waits_for_bitmask(_step(True))
    assert ex.grammar_bitmask_buffer(1) is None   # the mask is pickled to the workers
    ex.calls.clear()
    ex.forget_previous_step()
    ex._dead = "worker 1 died"
    ex.forget_previous_step()                      # nothing to tell once the workers are gone
    assert ex.calls == [("forget",)]
    monkeypatch.setenv("HAYABUSA_STEP_TIMEOUT", "2.5")
    assert step_timeout() == 2.5
    monkeypatch.delenv("HAYABUSA_STEP_TIMEOUT")
    assert step_timeout() is None
    for cls in (MultiprocExecutor, RayExecutor):   # both executors take these from the base
        for name in ("initialize_kv_cache", "execute_model", "forget_previous_step", "grammar_bitmask_buffer"):
            assert getattr(cls, name) is getattr(ExecutorBase, name)
