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
from hayabusa.core.cpu_kv_tier import prefer_swap
from hayabusa.core.encoder_budget import EncoderBudget
from hayabusa.core.kv_cache_manager import KVCacheManager
from hayabusa.core.request import Request, RequestStatus
from hayabusa.core.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from hayabusa.spec_decode.scheduling import eligible, seeded
from hayabusa.structured_output import fill_bitmask


# new_token_ids of a request that was not preempted: one shared empty tuple (no per-request, per-step object for
# the garbage collector to track)
_NO_TOKENS: tuple[int, ...] = ()


@dataclass
class _StepPlan:
    """The requests of the step being scheduled, before they become a SchedulerOutput."""

    reqs: list[Request] = field(default_factory=list)          # running ones first, then those admitted
    block_ids: list[list[int]] = field(default_factory=list)   # new block ids (the whole table when admitted)
    num_running: int = 0                                       # reqs[:num_running] were running already
    encoder_tokens: int = 0                                    # encoder inputs run this step (encoder-decoder)
    cross_block_ids: dict[str, list[int]] = field(default_factory=dict)   # admitted with an encoder input
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    preempted: set[str] = field(default_factory=set)
    encoder: EncoderBudget | None = None                       # the step's vision-tower budget
    encoder_inputs: dict[str, list[int]] = field(default_factory=dict)   # request id -> images to encode
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)      # request id -> proposals to verify
    # the decode loop's requests (reqs[:num_advanced]) are counted as computed there already (_advance); their
    # num_computed_tokens before that, and the ones among them that sample
    num_advanced: int = 0
    computed_before: list[int] = field(default_factory=list)
    sampling: set[str] = field(default_factory=set)

    def add(self, req: Request, num_new: int, block_ids: list[int], admitted: bool) -> None:
        """Running requests are all added before the first admitted one."""
        self.reqs.append(req)
        self.block_ids.append(block_ids)
        if not admitted:
            self.num_running += 1
        self.num_scheduled_tokens[req.request_id] = num_new


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
        self._left_since_last_step: set[str] = set()       # finished / aborted since the last step that ran
        self._preempted_since_last_step: set[str] = set()
        self._in_flight: dict[int, list[Request]] = {}     # step_id -> the step's requests, until its update
        self._step_id = 0
        self.num_preemptions = 0
        self.num_swap_preemptions = 0                      # of those, preempted by swapping KV to the CPU tier
        self.num_structured = 0                            # unfinished requests under a structured-output constraint
        self.grammar_failures: dict[str, BaseException] = {}   # request id -> why its grammar failed to compile
        # speculative decoding (hayabusa/spec_decode): proposals for decoding requests, and engine-wide counters
        self.spec = None                                   # SpecDecodeScheduling, or None when off
        self.spec_num_drafts = 0                           # verified request-steps with >= 1 proposal
        self.spec_num_draft_tokens = 0
        self.spec_num_accepted_tokens = 0
        self.spec_num_accepted_tokens_per_pos: list[int] = []   # [i]: proposals at position i accepted (grows to k)
        # the measured turn-off rule (spec.payoff): this step's (running requests, speculative mode) while it is
        # scheduled, None when the rule does not decide it; then per decode-only step in flight
        # step_id -> [running requests, speculative mode, requests in the step, tokens emitted]
        self._step_mode: tuple[int, bool] | None = None
        self._payoff_steps: dict[int, list] = {}

    # ----------------------------------------------------------------- requests in and out
    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)
        if request.structured is not None:
            self.num_structured += 1

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
        if self.requests.pop(req.request_id, None) is not None and req.structured is not None:
            self.num_structured -= 1

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def in_flight_request_ids(self) -> list[str]:
        """Ids of the requests in steps scheduled but not yet updated (update_from_output)."""
        return [req.request_id for reqs in self._in_flight.values() for req in reqs]

    def forget_in_flight(self) -> None:
        """Forget the steps scheduled but not updated (the engine dropped them after an error). Their copies
        between the KV tiers may not have run: swapped-out requests will be recomputed, and the CPU tier's prefix
        index is dropped."""
        self._in_flight.clear()
        self._payoff_steps.clear()
        for rid in self.kv.drop_cpu_tier_state():
            req = self.requests.get(rid)
            if req is not None:
                req.num_computed_tokens = 0

    def grammars_pending(self) -> list:
        """Futures of the grammars that waiting requests wait for (they are not admitted before)."""
        if not self.num_structured:
            return []
        return [r.structured.grammar for r in self.waiting
                if r.structured is not None and r.structured.matcher is None and not r.structured.grammar.done()
                and r.request_id not in self.grammar_failures]

    def blocked_request_ids(self) -> list[str]:
        """When a step scheduled nothing though requests are unfinished: the ones that block. Running requests
        are scheduled first whenever they can be, so those are all of them; with none running, the first waiting
        request (its next chunk does not fit the KV cache, or it waits on a token no step will bring)."""
        if self.running:
            return [r.request_id for r in self.running]
        return [self.waiting[0].request_id] if self.waiting else []

    def wants_proposals(self) -> bool:
        """Whether the next step may carry proposals (speculative decoding), decided before scheduling it: some
        running request is eligible and out of its back-off, the batch is within ``disable_by_batch_size``, and
        the measured rule (``disable_by_payoff``) has speculation on for the batch's bucket or the request samples
        with a seed. With async scheduling the engine then collects the step in flight first (a proposal needs
        the request's last token); otherwise the step overlaps the previous one."""
        spec = self.spec
        if spec is None or not self.running or not spec.config.enabled_for_batch(len(self.running)):
            return False
        spec.set_step_mode(len(self.running))
        may_propose = spec.may_propose
        return any(may_propose(r) for r in self.running)

    # ----------------------------------------------------------------- schedule
    def schedule(self) -> SchedulerOutput:
        """Choose this step's requests and token counts, allocating their KV blocks."""
        budget = self.config.max_num_batched_tokens
        plan = _StepPlan(encoder=EncoderBudget(self.config.max_num_encoder_input_tokens or budget))
        self._step_mode = None
        budget = self._schedule_running(plan, budget)
        if not plan.preempted:
            self._schedule_waiting(plan, budget)
        return self._make_output(plan)

    def _make_output(self, plan: _StepPlan) -> SchedulerOutput:
        """The plan as plain data; counts the step's tokens as computed (see _advance)."""
        self._step_id += 1
        out = SchedulerOutput([], CachedRequestData(), plan.num_scheduled_tokens,
                              sum(plan.num_scheduled_tokens.values()), step_id=self._step_id)
        self._preempted_since_last_step |= plan.preempted
        if out.is_empty:
            # An empty step is not launched, so the runner would never see the ids that left: they go out with
            # the next step that runs.
            return out
        out.scheduled_encoder_inputs = plan.encoder_inputs
        out.scheduled_spec_decode_tokens = plan.spec_tokens
        if self.kv.has_pending_swaps or self.kv.has_write_through_candidates:
            # collected since the last step that ran (an empty step runs no copy), and this step's write-throughs
            swaps = self.kv.take_swaps(self._step_id)
            out.blocks_to_swap_out, out.blocks_to_swap_in = swaps.swap_out, swaps.swap_in
            out.blocks_to_write_through, out.write_through_fence = swaps.write_through, swaps.fence
        out.finished_req_ids, self._left_since_last_step = self._left_since_last_step, set()
        out.preempted_req_ids, self._preempted_since_last_step = self._preempted_since_last_step, set()
        # Running requests come first in the plan, all known to the runner: their changes in one pass per list.
        k = plan.num_running
        running, admitted = plan.reqs[:k], plan.reqs[k:]
        # (num_scheduled_tokens holds the plan's ids in plan order: its keys are the running ids first)
        rids = list(plan.num_scheduled_tokens)
        na = plan.num_advanced      # the decode loop's requests: their num_computed_tokens before it advanced them
        out.scheduled_cached_reqs = cached = CachedRequestData(
            rids[:k] if admitted else rids, [False] * k, [_NO_TOKENS] * k, plan.block_ids[:k],
            plan.computed_before + [r.num_computed_tokens for r in running[na:]] if na < k else plan.computed_before)
        now = time.monotonic()
        for req, block_ids in zip(admitted, plan.block_ids[k:]):
            rid = req.request_id
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
            if not req.num_preemptions:
                out.scheduled_new_reqs.append(NewRequestData(rid, req.prompt_token_ids, req.sampling_params,
                                                             block_ids, req.num_computed_tokens,
                                                             mm_inputs=req.mm_inputs))
                if req.encoder_prompt_token_ids is not None:
                    new = out.scheduled_new_reqs[-1]
                    new.encoder_prompt_token_ids = req.encoder_prompt_token_ids
                    new.cross_block_ids = plan.cross_block_ids[rid]
                    out.scheduled_encoder_prompt_req_ids.append(rid)
            else:  # resumed after preemption: the runner gave its row up
                if req.encoder_prompt_token_ids is not None:  # its encoder runs again, into new cross blocks
                    cached.cross_block_ids[rid] = plan.cross_block_ids[rid]
                    out.scheduled_encoder_prompt_req_ids.append(rid)
                cached.req_ids.append(rid)
                cached.resumed_from_preemption.append(True)
                cached.new_token_ids.append(list(req.output_token_ids))
                cached.new_block_ids.append(block_ids)
                cached.num_computed_tokens.append(req.num_computed_tokens)
        out.sampling_req_ids = sampling = plan.sampling
        num_scheduled = plan.num_scheduled_tokens
        spec = plan.spec_tokens
        if spec:   # (with proposals the decode loop does not run: num_advanced is 0)
            for req in plan.reqs:
                # proposals are computed too, but the step samples (verifies) once: see update_from_output
                k = len(spec[req.request_id]) if req.request_id in spec else 0
                if self._advance(req, num_scheduled[req.request_id] - k):
                    sampling.add(req.request_id)
                req.num_computed_tokens += k
        else:
            add = sampling.add
            for req in plan.reqs[na:] if na else plan.reqs:   # _advance, inlined (the decode loop's are done)
                rid = req.request_id
                computed = req.num_computed_tokens + num_scheduled[rid]
                req.num_computed_tokens = computed
                if computed == len(req.all_token_ids) + req.num_output_placeholders:
                    req.num_output_placeholders += 1
                    add(rid)
        self._in_flight[out.step_id] = plan.reqs
        if self._step_mode is not None:
            self._note_payoff_step(out, plan)
        if self._payoff_steps and out.step_id not in self._payoff_steps:
            # a step that is not a measured decode step (an admission, a prompt chunk) scheduled while measured
            # steps are in flight (async scheduling): their wall time, to their collection, would include its
            # launch (15-25 ms eagerly for SmolLM2 on an H200, ~15 decode steps), so they are not samples
            for entry in self._payoff_steps.values():
                entry[2] = 0
        if self.num_structured:
            out.structured_output_req_ids = [r.request_id for r in plan.reqs
                                             if r.structured is not None and r.request_id in sampling]
        return out

    def _note_payoff_step(self, out: SchedulerOutput, plan: _StepPlan) -> None:
        """The measured rule: count the step in its mode, and keep it for ``record_step_time`` when it only
        decodes (no admitted request, no prompt chunk: each request's last token plus its proposals)."""
        num_running, speculative = self._step_mode
        self.spec.payoff.scheduled(num_running, speculative)
        num_reqs = len(plan.reqs)
        if plan.num_running == num_reqs and out.total_num_scheduled_tokens == num_reqs + sum(
                map(len, plan.spec_tokens.values())):
            self._payoff_steps[out.step_id] = [num_running, speculative, num_reqs, 0]

    def record_step_time(self, step_id: int, seconds: float) -> None:
        """The engine's measurement of a collected step (after update_from_output): its wall seconds, from its
        schedule to its collected output (host clock). Fed to the measured turn-off rule when the rule decided
        the step and it only decoded; otherwise ignored.

        Args:
            step_id: the step's ``SchedulerOutput.step_id``.
            seconds: wall time (>= 0).
        """
        entry = self._payoff_steps.pop(step_id, None) if self._payoff_steps else None
        if entry is not None and entry[2]:
            self.spec.payoff.record(entry[0], entry[1], entry[3] / entry[2], seconds)

    def grammar_bitmask(self, out: SchedulerOutput, buffer=None):
        """The next-token bitmask of the step's constrained requests (``out.structured_output_req_ids``), as a
        numpy array (see structured_output.fill_bitmask), or None when there are none. The engine calls it after
        launching the step's model and collecting the step before it (whose tokens its grammars must accept
        first), so the host fills it while the device runs. A request that finished meanwhile gets a row that
        allows everything (its token is dropped). ``buffer``: a host tensor [R_c, ceil(V / 32)] int32 to fill in
        place (the runner's pinned staging buffer, ``grammar_bitmask_buffer``), or None."""
        if not out.structured_output_req_ids:
            return None
        reqs = [self.requests.get(rid) for rid in out.structured_output_req_ids]
        structured = [None if r is None or r.status.finished else r.structured for r in reqs]
        return fill_bitmask(structured, out=buffer) if any(s is not None for s in structured) else None

    @staticmethod
    def _advance(req: Request, num_new: int) -> bool:
        """Count this step's tokens as computed now. Returns True when the step completes the sequence, so it
        samples a token, which stays a placeholder until update_from_output brings its value."""
        req.num_computed_tokens += num_new
        if req.num_computed_tokens == req.num_tokens + req.num_output_placeholders:
            req.num_output_placeholders += 1
            return True
        return False

    def _num_new_tokens(self, req: Request, budget: int) -> int:
        """Tokens to compute for a running request now; 0 when its next token must not be sampled (a pending
        token already reaches max_tokens / max_model_len: the pending update finishes it)."""
        pending = req.num_output_placeholders
        num_new = min(req.num_tokens + pending - req.num_computed_tokens, budget)
        if pending and (req.num_output_tokens + pending >= req.max_tokens
                        or req.num_tokens + pending >= self.config.max_model_len):
            return 0
        return num_new

    def _schedule_running(self, plan: _StepPlan, budget: int) -> int:
        i = 0
        spec = self.spec if self.spec is not None and self.spec.config.enabled_for_batch(len(self.running)) \
            else None
        if spec is not None and self.running:
            speculate = spec.set_step_mode(len(self.running))
            if spec.payoff is not None and any(map(eligible, self.running)):
                # (a step whose requests speculation leaves alone, e.g. all with logprobs, is a plain step in
                # either mode: no evidence for the measured rule, so neither counted nor timed)
                self._step_mode = (len(self.running), speculate)
            if not speculate and not any(map(seeded, self.running)):
                spec = None   # the measured rule: no request may propose; the plain decode loop
        lookups = None
        if spec is None:
            i, budget = self._schedule_decodes(plan, budget)
        elif self.running:   # the n-gram lookups of every request that may decode one token now, batched
            lookups = spec.lookup_all([r for r in self.running if r.num_computed_tokens == r.num_tokens - 1
                                       and not r.num_output_placeholders])
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.num_output_placeholders and self.config.pipeline_depth > 1:
                i += 1   # pipeline stages: its next input is still in flight; other requests fill this micro-batch
                continue
            num_new = self._num_new_tokens(req, budget)
            drafts = None
            if spec is not None and num_new == 1 and req.num_computed_tokens == req.num_tokens - 1 \
                    and not req.num_output_placeholders:
                drafts = spec.propose(req, budget - 1, lookups)   # its last token + k proposals, verified in one step
                num_new += len(drafts)
            enc = None
            if num_new > 0 and req.mm_inputs:   # images: the chunk may stop before one the step cannot encode
                num_new, enc = plan.encoder.fit(req, req.num_computed_tokens, num_new)
            if num_new <= 0:
                i += 1
                continue
            while True:
                new_blocks = self.kv.allocate_slots(req, num_new)
                if new_blocks is not None:
                    break
                if drafts:   # no room for the proposals: the plain decode token first, before preempting
                    num_new, drafts = 1, None
                    continue
                victim = self.running.pop()
                self._preempt(victim, plan)
                if victim is req:
                    break
            if new_blocks is None:
                break
            plan.reqs.append(req)                         # plan.add, inlined: this runs for every request
            plan.block_ids.append(new_blocks)
            plan.num_scheduled_tokens[req.request_id] = num_new
            plan.num_running += 1
            if drafts:
                plan.spec_tokens[req.request_id] = drafts
            if enc:
                plan.encoder.charge(req, enc)
                plan.encoder_inputs[req.request_id] = enc
            budget -= num_new
            i += 1
        return budget

    def _schedule_decodes(self, plan: _StepPlan, budget: int) -> tuple[int, int]:
        """The running requests from the first one on, while each is a plain step (no images, no proposals) whose
        blocks the pool has (most often none: a decode step inside its last block, ``fits_in_blocks``): the
        same decisions as the general loop of _schedule_running, including its pipeline rule (with pipeline stages
        a request whose sampled token is still in flight is skipped). Stops at the first request that would need a
        preemption (the general loop goes on from there). Returns (requests done, budget left)."""
        running, kv = self.running, self.kv
        max_model_len = self.config.max_model_len
        pipelined = self.config.pipeline_depth > 1
        reqs, block_ids, num_scheduled = plan.reqs, plan.block_ids, plan.num_scheduled_tokens
        fits, allocate = kv.fits_in_blocks, kv.allocate_slots
        # fits_in_blocks inlined where it is a length check (no prefix caching, no CPU-tier hits pending)
        block_lists = kv.decode_block_lists()
        blocks_of, bs = (block_lists.get, kv.block_size) if block_lists is not None else (None, 0)
        # _make_output's _advance done here for these requests (one pass over them instead of two)
        computed_before, add_sampling = plan.computed_before, plan.sampling.add
        i, n, start = 0, len(running), len(reqs)
        assert start == 0 and not plan.num_advanced, "the decode loop schedules the step's first requests"
        while i < n and budget > 0:
            req = running[i]
            if req.mm_inputs:
                break
            # _num_new_tokens, inlined
            pending = req.num_output_placeholders
            if pending and pipelined:   # its next input is still in flight; other requests fill this micro-batch
                i += 1
                continue
            num_tokens = len(req.all_token_ids)
            num_new = num_tokens + pending - req.num_computed_tokens
            if pending and (len(req.output_token_ids) + pending >= req.max_tokens
                            or num_tokens + pending >= max_model_len):
                num_new = 0
            elif num_new > budget:
                num_new = budget
            if num_new <= 0:
                i += 1
                continue
            rid = req.request_id
            computed = req.num_computed_tokens
            if blocks_of is not None:
                blocks = blocks_of(rid)
                ok = blocks is not None and computed + num_new <= len(blocks) * bs
            else:
                ok = fits(req, num_new)
            if ok:
                new_blocks = []
            else:
                new_blocks = allocate(req, num_new)
                if new_blocks is None:   # the pool is short: the general loop preempts
                    break
            reqs.append(req)
            block_ids.append(new_blocks)
            num_scheduled[rid] = num_new
            budget -= num_new
            i += 1
            # _advance, inlined: the step's tokens counted as computed (see _make_output)
            computed_before.append(computed)
            computed += num_new
            req.num_computed_tokens = computed
            if computed == num_tokens + pending:
                req.num_output_placeholders = pending + 1
                add_sampling(rid)
        plan.num_running += len(reqs) - start
        plan.num_advanced = len(reqs)
        return i, budget

    def _preempt(self, req: Request, plan: _StepPlan) -> None:
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        plan.preempted.add(req.request_id)
        self.waiting.appendleft(req)
        # swap its KV to the CPU tier (keeping num_computed_tokens) when asked or cheaper; text-only requests. A
        # recompute pays only for the tokens after its prefix shared with other requests (a prefix hit on resume)
        own = req.num_computed_tokens - self.kv.num_shared_prefix_tokens(req)
        if prefer_swap(self.config.preemption_mode, own) and not req.mm_inputs \
                and req.sampling_params.prompt_logprobs is None and self.kv.swap_out(req):
            self.num_swap_preemptions += 1
            return
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.mm_encoded.clear()      # the runner drops a preempted request's image embeddings

    def _schedule_waiting(self, plan: _StepPlan, budget: int) -> None:
        skipped: list[Request] = []   # waiting for their grammar: they keep their place in the queue
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if req.num_output_placeholders:  # preempted with a token still in flight: wait for its value
                break
            if req.structured is not None:
                try:
                    ready = req.structured.ready()
                except Exception as e:  # noqa: BLE001 -- the compile failed: the engine aborts the request
                    self.grammar_failures[req.request_id] = e
                    ready = False
                if not ready:
                    skipped.append(self.waiting.popleft())
                    continue
            if self.kv.req_to_cpu_blocks and self.kv.is_swapped(req.request_id):
                if not self._resume_swapped(req, plan, budget):
                    break
                budget -= plan.num_scheduled_tokens[req.request_id]
                continue
            if req.encoder_prompt_token_ids is not None and not self._admit_encoder(req, plan):
                break
            # a cached block has no logits: a prompt_logprobs request recomputes its whole prompt (as vLLM does)
            hit_blocks, num_hit = self.kv.get_computed_blocks(req) \
                if req.sampling_params.prompt_logprobs is None else ([], 0)    # num_computed_tokens is 0 here
            num_new = min(req.num_tokens - num_hit, budget)
            enc = None
            if req.mm_inputs:
                num_new, enc = plan.encoder.fit(req, num_hit, num_new)
                if num_new <= 0:
                    break
            new_blocks = self.kv.allocate_slots(req, num_new, hit_blocks)
            if new_blocks is None:
                if req.encoder_prompt_token_ids is not None:
                    self._unadmit_encoder(req, plan)
                break
            req.num_computed_tokens = num_hit
            req.num_cached_tokens = num_hit
            self.kv.record_lookup(req.num_tokens, num_hit)
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            plan.add(req, num_new, list(self.kv.get_block_ids(req.request_id)), True)
            if enc:
                plan.encoder.charge(req, enc)
                plan.encoder_inputs[req.request_id] = enc
            budget -= num_new
        if skipped:
            self.waiting.extendleft(reversed(skipped))

    def _resume_swapped(self, req: Request, plan: _StepPlan, budget: int) -> bool:
        """Resume a swapped-out request: its KV comes back from the CPU tier (num_computed_tokens kept)."""
        num_new = min(req.num_tokens - req.num_computed_tokens, budget)
        block_ids = self.kv.swap_in(req, num_new)
        if block_ids is None:
            return False
        self.waiting.popleft()
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        plan.add(req, num_new, block_ids, True)
        return True

    def _admit_encoder(self, req: Request, plan: _StepPlan) -> bool:
        """Encoder-decoder: the request's encoder runs this step, within the step's encoder budget
        (max_num_batched_tokens encoder tokens; the first encoder input of a step always fits, since inputs are at
        most max_model_len tokens), into cross-attention blocks taken now. False: not this step."""
        n = len(req.encoder_prompt_token_ids)
        if plan.encoder_tokens and plan.encoder_tokens + n > self.config.max_num_batched_tokens:
            return False
        cross = self.kv.allocate_cross_blocks(req, n)
        if cross is None:
            return False
        plan.encoder_tokens += n
        plan.cross_block_ids[req.request_id] = cross
        return True

    def _unadmit_encoder(self, req: Request, plan: _StepPlan) -> None:
        """Undo _admit_encoder (its decoder blocks did not fit)."""
        self.kv.free(req)
        plan.encoder_tokens -= len(req.encoder_prompt_token_ids)
        del plan.cross_block_ids[req.request_id]

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
        reqs = self._in_flight.pop(out.step_id, [])
        if self._in_flight:  # steps never collected (dropped after an error): forget them
            for step_id in [s for s in self._in_flight if s < out.step_id]:
                del self._in_flight[step_id]
        spec = out.scheduled_spec_decode_tokens
        max_model_len = self.config.max_model_len
        get = sampled.get
        append = results.append
        for req in reqs:
            if req.status.finished:  # aborted / stopped between schedule and update: drop its token
                continue
            new_ids = get(req.request_id)
            if not new_ids:
                continue
            drafts = spec.get(req.request_id) if spec else None
            if drafts is not None:
                new_ids, status = self._accept_verified(req, drafts, new_ids)
            else:
                req.num_output_placeholders -= len(new_ids)
                out_ids = req.output_token_ids
                out_ids.extend(new_ids)
                req.all_token_ids.extend(new_ids)
                if req.structured is not None:
                    req.structured.accept(new_ids)
                    status = self._check_stop(req)
                else:
                    # _check_stop's common case, inlined: one token, nothing that can stop on it, not at a limit
                    params = req.sampling_params
                    last = out_ids[-1]
                    if len(out_ids) < req.max_tokens and len(req.all_token_ids) < max_model_len and (
                            len(out_ids) < params.min_tokens
                            or ((params.ignore_eos or last not in req.eos_token_ids)
                                and last not in params.all_stop_token_ids)):
                        append((req, new_ids))
                        continue
                    status = self._check_stop(req)
            if status is not None:
                (self.running if req.status == RequestStatus.RUNNING else self.waiting).remove(req)
                req.status = status
                self._free(req)
            append((req, new_ids))
        if self._payoff_steps:
            entry = self._payoff_steps.get(out.step_id)
            if entry is not None:   # the measured rule: the tokens the step emitted
                entry[3] = sum(len(ids) for _, ids in results)
        return results

    def _accept_verified(self, req: Request, drafts: list[int], new_ids: list[int]
                         ) -> tuple[list[int], RequestStatus | None]:
        """A step that verified ``drafts``: ``new_ids`` are the accepted proposals plus one bonus (or recovered)
        token. The rejected proposals' KV is rolled back (num_computed_tokens; their slots stay in the request's
        blocks and are overwritten by the next step, which computes those positions again). Tokens after a stop
        (EOS, a stop token, max_tokens) are dropped. Returns (the tokens kept, the finish status or None)."""
        #  before: |<-- num_computed = N - 1 -->| last | d_1 .. d_k |   scheduled 1 + k, num_computed += 1 + k
        #  after:  accepted a, so N + a tokens have KV: num_computed = N + a = num_tokens - 1 (the new last one
        #          is computed next step)
        num_accepted = len(new_ids) - 1
        req.num_output_placeholders -= 1
        req.num_computed_tokens -= len(drafts) - num_accepted
        req.spec_num_steps += 1
        req.spec_num_draft_tokens += len(drafts)
        req.spec_num_accepted_tokens += num_accepted
        self.spec_num_drafts += 1 if drafts else 0
        self.spec_num_draft_tokens += len(drafts)
        self.spec_num_accepted_tokens += num_accepted
        per_pos = self.spec_num_accepted_tokens_per_pos   # the accepted proposals are the first num_accepted
        if num_accepted > len(per_pos):
            per_pos.extend([0] * (num_accepted - len(per_pos)))
        for i in range(num_accepted):
            per_pos[i] += 1
        self.spec.record(req, len(drafts), num_accepted)      # the low-acceptance turn-off rule
        for i, token in enumerate(new_ids):
            req.output_token_ids.append(token)
            req.all_token_ids.append(token)
            status = self._check_stop(req)
            if status is not None:
                return new_ids[:i + 1], status
        return new_ids, None

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
        if req.structured is not None and req.structured.is_terminated:
            return RequestStatus.FINISHED_STOPPED
        if num_out >= req.max_tokens or len(req.all_token_ids) >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None
