"""SchedulerOutput: what one step runs, as plain data (vLLM v1's shape).

New requests come in full, requests the runner already knows come as changes. Nothing here refers to a scheduler
``Request``: the whole object pickles, so a worker in another process (or a test with no scheduler) can run it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from hayabusa.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the runner sees for the first time: everything it needs to keep its own state.

    Attributes:
        req_id: the request's (child) id.
        prompt_token_ids: prompt ids.
        sampling_params: the sample's params (``n`` already split off; ``all_stop_token_ids`` resolved).
        block_ids: the request's whole block table so far (prefix hits first).
        num_computed_tokens: tokens whose KV is already in the cache before this step (prefix hit).
        mm_inputs: the request's images (``hayabusa.multimodal.ImageInput``: pixel values as numpy, grid_thw,
            placeholder offset / length in the prompt, content hash), in prompt order; [] for text.
        encoder_input_ids: ids of encoder inputs (images, an encoder prompt) of the request; none yet.
        encoder_prompt_token_ids: encoder-decoder models (T5): the encoder input's token ids (None otherwise).
        cross_block_ids: encoder-decoder models: the request's cross-attention block table (its encoder output's
            K/V, ``cdiv(len(encoder_prompt_token_ids), block_size)`` blocks of the same pool as ``block_ids``).
    """

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    mm_inputs: list = field(default_factory=list)
    encoder_input_ids: list[int] = field(default_factory=list)
    encoder_prompt_token_ids: list[int] | None = None
    cross_block_ids: list[int] = field(default_factory=list)


@dataclass
class CachedRequestData:
    """Requests the runner already knows, as changes; one entry per request in each list, in batch order.

    Attributes:
        req_ids: their ids.
        resumed_from_preemption: True for a request resumed after preemption: the runner gave its row up when it
            was preempted, so its block table is ``new_block_ids`` in full and its outputs are ``new_token_ids``.
        new_token_ids: for a resumed request, every output token so far (the runner may not know the last ones:
            they came back after it dropped the row); empty otherwise (the runner knows what it sampled).
        new_block_ids: block ids appended to the request's block table this step (all of them when resumed).
        num_computed_tokens: the request's num_computed_tokens before this step.
        cross_block_ids: encoder-decoder models: request id -> its new cross-attention block table, for requests
            resumed after preemption (their encoder runs again this step); empty otherwise.
    """

    req_ids: list[str] = field(default_factory=list)
    resumed_from_preemption: list[bool] = field(default_factory=list)
    new_token_ids: list[Sequence[int]] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    cross_block_ids: dict[str, list[int]] = field(default_factory=dict)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


@dataclass
class SchedulerOutput:
    """What to run in one step (plain data; it pickles).

    The step's batch order is ``scheduled_cached_reqs.req_ids`` then the new requests (``scheduled_req_ids``).

    Attributes:
        scheduled_new_reqs: requests scheduled for the first time, in full.
        scheduled_cached_reqs: running (or resumed) requests, as changes.
        num_scheduled_tokens: request id -> tokens computed this step (>= 1).
        total_num_scheduled_tokens: sum of num_scheduled_tokens.
        sampling_req_ids: requests whose step completes their sequence, so they sample a token.
        finished_req_ids: requests that finished or were aborted since the previous step; the runner drops all
            of their state.
        preempted_req_ids: requests preempted since the previous step; the runner gives their row up but keeps
            what it needs to resume them (their generator).
        scheduled_spec_decode_tokens: request id -> speculative tokens (proposals) to verify this step. Such a
            request's num_scheduled_tokens is 1 + len(proposals): its last token, then the proposals; it samples
            once (in sampling_req_ids), and the runner returns the accepted proposals plus one token.
        scheduled_encoder_inputs: vision models: request id -> indices into its ``mm_inputs`` (images) whose
            vision-tower run this step does (vLLM's shape; the runner keeps their embeddings until the prefill
            consumed them; see core/encoder_budget.py). Empty for other models.
        scheduled_encoder_prompt_req_ids: encoder-decoder models (T5): the requests whose encoder runs this step
            over their ``encoder_prompt_token_ids``, writing the cross-attention K/V into their cross blocks (each
            request admitted, or resumed after preemption, this step), in that order. Empty for other models.
        step_id: the step's number (the scheduler matches the step's results to it).
        structured_output_req_ids: the sampling requests under a structured-output constraint, in bitmask order.
        grammar_bitmask: their next-token bitmask ([len(structured_output_req_ids), ceil(V / 32)] int32; bit j of
            word w allows token 32 w + j). The engine leaves it None and fills it (``Scheduler.grammar_bitmask``)
            after the runner queued the model, so the host works while the device runs; the runner's
            ``sample_tokens`` then takes it. A worker that needs it up front may find it set here.
        blocks_to_swap_out: (GPU block, CPU block) pairs to copy GPU -> CPU before the step's forward (KV of
            preempted requests, prefix-cache blocks evicted from the GPU); the runner runs them first.
        blocks_to_swap_in: (CPU block, GPU block) pairs to copy CPU -> GPU after the swap-outs, before the forward
            (resumed requests, prefix hits in the CPU tier).
        blocks_to_write_through: (GPU block, CPU block) pairs to copy GPU -> CPU that the forward does not wait
            for: shared prefix-cache blocks, copied ahead of their eviction (core/cpu_kv_tier.py). This step's
            forward may read those blocks but never writes them.
        write_through_fence: this step gives new content to blocks written through by steps up to this step id:
            the forward waits for those steps' write-through copies first (0 = no wait).
    """

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    sampling_req_ids: set[str] = field(default_factory=set)
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    scheduled_encoder_inputs: dict[str, list[int]] = field(default_factory=dict)
    scheduled_encoder_prompt_req_ids: list[str] = field(default_factory=list)
    step_id: int = 0
    structured_output_req_ids: list[str] = field(default_factory=list)
    grammar_bitmask: np.ndarray | None = None
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_write_through: list[tuple[int, int]] = field(default_factory=list)
    write_through_fence: int = 0

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0

    @property
    def num_reqs(self) -> int:
        return self.scheduled_cached_reqs.num_reqs + len(self.scheduled_new_reqs)

    @property
    def scheduled_req_ids(self) -> list[str]:
        """Every scheduled request id, in batch order."""
        if not self.scheduled_new_reqs:
            return self.scheduled_cached_reqs.req_ids
        return self.scheduled_cached_reqs.req_ids + [r.req_id for r in self.scheduled_new_reqs]

    @property
    def num_computed_tokens(self) -> dict[str, int]:
        """Request id -> its num_computed_tokens before this step."""
        return dict(zip(self.scheduled_req_ids, self.batch_num_computed_tokens))

    @property
    def batch_num_computed_tokens(self) -> list[int]:
        """Each scheduled request's num_computed_tokens before this step, in batch order."""
        if not self.scheduled_new_reqs:
            return self.scheduled_cached_reqs.num_computed_tokens
        return self.scheduled_cached_reqs.num_computed_tokens + [
            r.num_computed_tokens for r in self.scheduled_new_reqs]

    @property
    def new_block_ids(self) -> dict[str, list[int]]:
        """Request id -> block ids appended to its block table this step (the whole table when new or resumed)."""
        c = self.scheduled_cached_reqs
        return dict(zip(c.req_ids, c.new_block_ids)) | {r.req_id: r.block_ids for r in self.scheduled_new_reqs}
