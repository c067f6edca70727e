"""Scheduler: picks the requests and token counts of each step (continuous batching, chunked prefill,
preemption by recompute). Plain Python; no tensors.

There are no phases: every scheduled request gets ``num_tokens - num_computed_tokens`` new tokens (capped by the
step's token budget), so a fresh prompt, a chunk of a long prompt, a decode step and the recompute of a preempted
request are all the same rule.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from hayabusa.config import SchedulerConfig
from hayabusa.core.kv_cache_manager import KVCacheManager
from hayabusa.core.request import Request, RequestStatus


@dataclass
class SchedulerOutput:
    """What to run in one step.

    Attributes:
        scheduled_reqs: requests in this step, in batch order (running ones first, then newly admitted).
        scheduled_new_reqs: ids of requests that need fresh per-request state in the runner (first schedule, or
            resumed after preemption).
        num_scheduled_tokens: request id -> tokens computed this step (>= 1).
        num_computed_tokens: request id -> its num_computed_tokens before this step (the scheduler advances the
            request's own counter when it schedules, so the next step can be scheduled before this one's
            results are back).
        new_block_ids: request id -> block ids appended to its block table this step (all blocks when new).
        total_num_scheduled_tokens: sum of num_scheduled_tokens.
        finished_req_ids: requests that left since the previous step (finished, aborted or preempted); the runner
            drops their state.
    """

    scheduled_reqs: list[Request]
    scheduled_new_reqs: set[str]
    num_scheduled_tokens: dict[str, int]
    new_block_ids: dict[str, list[int]]
    total_num_scheduled_tokens: int
    finished_req_ids: set[str] = field(default_factory=set)
    num_computed_tokens: dict[str, int] = field(default_factory=dict)
    sampling_req_ids: set[str] = field(default_factory=set)  # requests whose step ends their sequence: sample

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


class Scheduler:
    """Continuous batching under ``max_num_seqs`` and ``max_num_batched_tokens``.

    Running requests are served first, in arrival order; then waiting requests are admitted while there are free
    rows, token budget and KV blocks. When a running request needs a block and none is free, the most recently
    admitted running request is preempted: its blocks are freed and it goes back to the front of the waiting
    queue with ``num_computed_tokens = 0``; its prompt and outputs so far are recomputed when it is rescheduled.

    Args:
        config: limits of a step.
        kv_cache_manager: the block owner.
    """

    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager) -> None:
        self.config = config
        self.kv = kv_cache_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._left_since_last_step: set[str] = set()
        self.num_preemptions = 0

    # ----------------------------------------------------------------- requests in and out
    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> None:
        """End requests from outside (abort, or a stop string found by the output processor)."""
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.is_finished():
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            req.status = status
            self._free(req)

    def _free(self, req: Request) -> None:
        self.kv.free(req)
        self._left_since_last_step.add(req.request_id)
        self.requests.pop(req.request_id, None)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    # ----------------------------------------------------------------- schedule
    def schedule(self) -> SchedulerOutput:
        """Choose this step's requests and token counts, allocating their KV blocks."""
        budget = self.config.max_num_batched_tokens
        out = SchedulerOutput([], set(), {}, {}, 0, self._left_since_last_step)
        self._left_since_last_step = set()
        budget, preempted = self._schedule_running(out, budget)
        if not preempted:
            self._schedule_waiting(out, budget)
        out.total_num_scheduled_tokens = sum(out.num_scheduled_tokens.values())
        if out.is_empty:
            # An empty step is not launched, so the runner would never see these ids and would keep their rows:
            # hand them out with the next step that runs.
            self._left_since_last_step |= out.finished_req_ids
            out.finished_req_ids = set()
        now = time.monotonic()
        for req in out.scheduled_reqs:
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
            self._advance(req, out)
        return out

    @staticmethod
    def _advance(req: Request, out: SchedulerOutput) -> None:
        """Count this step's tokens as computed now; a step that completes the sequence will sample a token,
        which stays a placeholder until update_from_output brings its value."""
        rid = req.request_id
        n = out.num_scheduled_tokens[rid]
        out.num_computed_tokens[rid] = req.num_computed_tokens
        req.num_computed_tokens += n
        if req.num_computed_tokens == req.num_tokens + req.num_output_placeholders:
            req.num_output_placeholders += 1
            out.sampling_req_ids.add(rid)

    def _num_new_tokens(self, req: Request, budget: int) -> int:
        """Tokens to compute for a running request now; 0 when its next token must not be sampled (a pending
        token already reaches max_tokens / max_model_len: the pending update finishes it)."""
        pending = req.num_output_placeholders
        num_new = min(req.num_tokens + pending - req.num_computed_tokens, budget)
        if pending and (req.num_output_tokens + pending >= req.max_tokens
                        or req.num_tokens + pending >= self.config.max_model_len):
            return 0
        return num_new

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> tuple[int, bool]:
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = self._num_new_tokens(req, budget)
            if num_new <= 0:
                i += 1
                continue
            while True:
                new_blocks = self.kv.allocate_slots(req, num_new)
                if new_blocks is not None:
                    break
                victim = self.running.pop()
                self._preempt(victim, out)
                preempted = True
                if victim is req:
                    break
            if new_blocks is None:
                break
            out.scheduled_reqs.append(req)
            out.num_scheduled_tokens[req.request_id] = num_new
            out.new_block_ids[req.request_id] = new_blocks
            budget -= num_new
            i += 1
        return budget, preempted

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        out.finished_req_ids.add(req.request_id)
        self.waiting.appendleft(req)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if req.num_output_placeholders:  # preempted with a token still in flight: wait for its value
                break
            hit_blocks, num_hit = self.kv.get_computed_blocks(req)    # num_computed_tokens is 0 here
            num_new = min(req.num_tokens - num_hit, budget)
            new_blocks = self.kv.allocate_slots(req, num_new, hit_blocks)
            if new_blocks is None:
                break
            req.num_computed_tokens = num_hit
            req.num_cached_tokens = num_hit
            self.kv.record_lookup(req.num_tokens, num_hit)
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled_reqs.append(req)
            out.scheduled_new_reqs.add(req.request_id)
            out.num_scheduled_tokens[req.request_id] = num_new
            out.new_block_ids[req.request_id] = list(self.kv.get_block_ids(req.request_id))
            budget -= num_new

    # ----------------------------------------------------------------- results
    def update_from_output(self, out: SchedulerOutput,
                           sampled: dict[str, list[int]]) -> list[tuple[Request, list[int]]]:
        """Append sampled tokens (resolving placeholders), and finish requests that hit EOS, a stop token,
        max_tokens or max_model_len.

        Args:
            out: the step's SchedulerOutput.
            sampled: request id -> sampled token ids (empty for a request still in a partial prefill).

        Returns:
            (request, its new token ids) for every request that produced tokens this step, finished or not (what
            OutputProcessor.process takes).
        """
        results: list[tuple[Request, list[int]]] = []
        for req in out.scheduled_reqs:
            if req.status.finished:  # aborted / stopped between schedule and update: drop its token
                continue
            new_ids = sampled.get(req.request_id)
            if not new_ids:
                continue
            req.num_output_placeholders -= len(new_ids)
            req.output_token_ids.extend(new_ids)
            req.all_token_ids.extend(new_ids)
            status = self._check_stop(req)
            if status is not None:
                (self.running if req.status == RequestStatus.RUNNING else self.waiting).remove(req)
                req.status = status
                self._free(req)
            results.append((req, new_ids))
        return results

    def _check_stop(self, req: Request) -> RequestStatus | None:
        params = req.sampling_params
        num_out = len(req.output_token_ids)
        last = req.output_token_ids[-1]
        if num_out >= params.min_tokens:
            if not params.ignore_eos and last in req.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if last in params.all_stop_token_ids:
                req.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
        if num_out >= req.max_tokens or len(req.all_token_ids) >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None
