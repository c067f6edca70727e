"""Request: one sequence being generated, as the scheduler sees it (plain Python)."""

from __future__ import annotations

import enum
import time

from hayabusa.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Everything from here on is finished.
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5

    def __init__(self, value: int) -> None:
        # A plain attribute, not a property: it is read for every request of every step.
        self.finished: bool = self.name.startswith("FINISHED_")

    @property
    def finish_reason(self) -> str | None:
        return {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH_CAPPED: "length",
                RequestStatus.FINISHED_ABORTED: "abort"}.get(self)


class Request:
    """One sequence: its prompt, the tokens generated so far, and how far its KV cache has been computed.

    ``n > 1`` prompts become n Requests (one per sample) that share the prompt; the engine fans them back in.

    Args:
        request_id: unique id (the engine makes child ids for n > 1).
        prompt_token_ids: prompt ids.
        sampling_params: the sample's params (``n`` already split off).
        eos_token_ids: ids that end the sequence unless ``ignore_eos``.
        max_tokens: resolved output limit (SamplingParams.max_tokens, or what max_model_len leaves).
        arrival_time: seconds (``time.monotonic``).
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 eos_token_ids: tuple[int, ...], max_tokens: int, arrival_time: float | None = None) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.max_tokens = max_tokens
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_output_placeholders = 0      # tokens sampled on the device whose values are not back yet
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        self.first_scheduled_time: float | None = None
        self.block_hashes: list[int] = []      # chained hashes of full blocks (KVCacheManager.block_hashes)
        self.num_cached_tokens = 0             # prompt tokens served from the prefix cache at admission
        self.structured = None                 # StructuredOutputRequest when the output is constrained
        # encoder-decoder models: the encoder input (run when the request is admitted, again after preemption);
        # prompt_token_ids is then the decoder prompt (decoder_start_token_id first)
        self.encoder_prompt_token_ids: list[int] | None = None
        self.mm_inputs: list = []              # ImageInputs (hayabusa.multimodal), in prompt order
        self.mm_encoded: set[int] = set()      # indices of mm_inputs whose encoder output the runner holds
        # speculative decoding: steps that verified proposals, tokens proposed, proposals accepted
        self.spec_num_steps = 0
        self.spec_num_draft_tokens = 0
        self.spec_num_accepted_tokens = 0
        # the low-acceptance turn-off rule (spec_decode/scheduling.py): proposals and acceptances of the current
        # window, and the output count before which the request gets no proposals
        self.spec_window_drafts = 0
        self.spec_window_accepted = 0
        self.spec_backoff_until = 0
        self.spec_history = None   # n-gram: all_token_ids as a growing numpy array (spec_decode/ngram.TokenHistory)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt + generated tokens."""
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)

    def is_finished(self) -> bool:
        return self.status.finished

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, prompt={self.num_prompt_tokens}, out={self.num_output_tokens}, "
                f"computed={self.num_computed_tokens}, {self.status.name})")
