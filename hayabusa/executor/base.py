"""ExecutorBase: what the executors over worker processes (MultiprocExecutor, RayExecutor) share of
ModelRunner's interface. A subclass reaches its ranks (``_send_init_kv``, ``launch``, ``sample_tokens``, ``finish``,
``_send_forget``); the rules that do not depend on how are here."""

from __future__ import annotations

import os
from typing import Any

from hayabusa.core.scheduler_output import SchedulerOutput


def step_timeout() -> float | None:
    """Seconds a step may take before its workers are given up (``HAYABUSA_STEP_TIMEOUT``; unset: no limit)."""
    value = os.environ.get("HAYABUSA_STEP_TIMEOUT")
    return float(value) if value else None


def waits_for_bitmask(out: SchedulerOutput) -> bool:
    """The step has constrained requests and no grammar bitmask yet: it is sent once ``sample_tokens`` brings it."""
    return bool(out.structured_output_req_ids) and out.grammar_bitmask is None


class ExecutorBase:
    """ModelRunner's interface over worker processes: the shared part.

    Subclasses set ``num_blocks_per_rank`` and ``num_cpu_blocks`` (each rank's KV capacity; the CPU tier's minimum
    over the ranks) and ``_dead`` (None, or why no step can run), and give ``_send_init_kv``, ``launch``,
    ``sample_tokens``, ``finish`` and ``_send_forget``. A handle from ``launch`` has ``sched`` set while its step
    waits for its grammar bitmask.
    """

    num_blocks_per_rank: list[int]
    num_cpu_blocks: int
    _dead: str | None

    def initialize_kv_cache(self) -> int:
        """Every rank allocates the smallest capacity any rank has room for (and the CPU tier's). Returns
        num_blocks."""
        num_blocks = min(self.num_blocks_per_rank)
        self._send_init_kv(num_blocks, self.num_cpu_blocks)
        return num_blocks

    def execute_model(self, out: SchedulerOutput) -> Any:
        """Run one step and wait for rank 0's ModelRunnerOutput (a constrained step samples under
        ``out.grammar_bitmask``, as given)."""
        handle = self.launch(out)
        if handle.sched is not None:
            handle = self.sample_tokens(handle, None)
        return self.finish(handle)

    def forget_previous_step(self) -> None:
        """Every rank drops its link to the previous step's sampled tokens (nothing to do once the workers are
        gone)."""
        if self._dead is None:
            self._send_forget()

    def grammar_bitmask_buffer(self, n: int) -> None:
        """No staging buffer here: the engine's bitmask is pickled to the workers."""
        return None

    # ------------------------------------------------------------------ given by the subclass
    def _send_init_kv(self, num_blocks: int, num_cpu_blocks: int) -> None:
        raise NotImplementedError

    def launch(self, out: SchedulerOutput) -> Any:
        raise NotImplementedError

    def sample_tokens(self, handle: Any, bitmask: Any) -> Any:
        raise NotImplementedError

    def finish(self, handle: Any) -> Any:
        raise NotImplementedError

    def _send_forget(self) -> None:
        raise NotImplementedError
