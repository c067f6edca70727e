"""Outputs returned by ``LLM.generate`` and ``AsyncLLMEngine.generate`` (vLLM's shapes and field names)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """Log probability of one token.

    Attributes:
        logprob: natural-log probability under the model's raw (unprocessed) distribution.
        rank: 1-based rank of the token in that distribution.
        decoded_token: the token as text (None when detokenize=False).
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


LOGPROB_JSON_FLOOR = -9999.0   # JSON has no -inf: a masked token's logprob is written as this (vLLM clamps the same)


def logprobs_json(entries: "list[dict[int, Logprob] | None] | None") -> list | None:
    """Logprobs per position as JSON-safe data, vLLM's ``prompt_logprobs`` form: per position null or
    {str(token id): {"logprob" (floored at LOGPROB_JSON_FLOOR), "rank", "decoded_token"}}; None stays None."""
    if entries is None:
        return None
    return [None if e is None else {str(t): {"logprob": max(p.logprob, LOGPROB_JSON_FLOOR), "rank": p.rank,
                                             "decoded_token": p.decoded_token} for t, p in e.items()}
            for e in entries]


# One dict per generated token: token id -> Logprob (the sampled token plus the top-`logprobs` tokens).
SampleLogprobs = list[dict[int, Logprob]]


@dataclass
class CompletionOutput:
    """One completion of a request (``n`` of them per request).

    Attributes:
        index: 0-based index among the request's ``n`` completions.
        text: generated text (stop string removed unless include_stop_str_in_output).
        token_ids: generated token ids.
        cumulative_logprob: sum of the sampled tokens' logprobs; None unless logprobs were requested.
        logprobs: per-token logprobs when ``SamplingParams.logprobs`` is set, else None.
        finish_reason: "stop", "length" or "abort"; None while running.
        stop_reason: the stop string (str) or stop token id (int) that ended it; None for EOS or length.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """What a request has produced so far.

    Attributes:
        request_id: the request's id.
        prompt: prompt text (None when the prompt was given as token ids and not decoded).
        prompt_token_ids: prompt token ids.
        outputs: one CompletionOutput per sample (``n``).
        finished: True when every completion has finished.
        prompt_logprobs: with ``SamplingParams.prompt_logprobs``: one entry per prompt token, None for the first,
            then a dict token id -> Logprob (the actual token and the top ``prompt_logprobs``); else None.
        metrics: timing of the request (seconds since the epoch), see ``RequestMetrics``.
        encoder_prompt, encoder_prompt_token_ids: encoder-decoder models (T5): the encoder input's text (when
            given as text) and ids; ``prompt_token_ids`` is then the decoder prompt (vLLM's fields). None otherwise.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: "list[dict[int, Logprob] | None] | None" = None
    metrics: "RequestMetrics | None" = None
    encoder_prompt: str | None = None
    encoder_prompt_token_ids: list[int] | None = None

    def add(self, next_output: "RequestOutput", aggregate: bool = True) -> None:
        """Merge a later output of the same request into this one (vLLM's ``RequestOutput.add``).

        aggregate=True (DELTA outputs): a completion with the same ``index`` gets the next one's text, token ids
        and logprobs appended and its cumulative_logprob, finish_reason and stop_reason; False: it is replaced. A
        completion this output lacks is appended. ``finished`` is or-ed, metrics are the next output's, and the
        prompt logprobs are joined when aggregating (a DELTA output carries only those not sent yet), else the next
        output's are taken only when this one has none.
        """
        self.finished = self.finished or next_output.finished
        self.metrics = next_output.metrics
        if self.prompt_logprobs is None:
            self.prompt_logprobs = next_output.prompt_logprobs
        elif aggregate and next_output.prompt_logprobs:
            self.prompt_logprobs = list(self.prompt_logprobs) + list(next_output.prompt_logprobs)
        for nxt in next_output.outputs:
            for i, cur in enumerate(self.outputs):
                if cur.index != nxt.index:
                    continue
                if aggregate:
                    cur.text += nxt.text
                    cur.token_ids = list(cur.token_ids) + list(nxt.token_ids)
                    if nxt.logprobs:
                        cur.logprobs = list(cur.logprobs or []) + list(nxt.logprobs)
                    cur.cumulative_logprob = nxt.cumulative_logprob
                    cur.finish_reason, cur.stop_reason = nxt.finish_reason, nxt.stop_reason
                else:
                    self.outputs[i] = nxt
                break
            else:
                self.outputs.append(nxt)


@dataclass
class RequestMetrics:
    """Timestamps of one request, in seconds (``time.monotonic``)."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_generation_tokens: int = 0
    extra: dict = field(default_factory=dict)
    # speculative decoding (summed over the request's n samples): steps that verified proposals, tokens proposed,
    # proposals accepted
    spec_num_steps: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0

    @property
    def spec_acceptance_rate(self) -> float | None:
        """Accepted / proposed tokens; None when nothing was proposed."""
        return self.spec_num_accepted_tokens / self.spec_num_draft_tokens if self.spec_num_draft_tokens else None

    @property
    def spec_mean_accepted_length(self) -> float | None:
        """Tokens emitted per verify step (accepted proposals + the bonus token: vLLM's mean acceptance length);
        None without verify steps."""
        return 1 + self.spec_num_accepted_tokens / self.spec_num_steps if self.spec_num_steps else None
