"""OutputProcessor: new token ids -> text (incremental detokenization, stop strings), logprobs, n > 1 fan-in,
-> RequestOutput."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from hayabusa.core.request import Request, RequestStatus
from hayabusa.engine.detokenizer import IncrementalDetokenizer, finish_all
from hayabusa.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from hayabusa.sampling_params import SamplingParams


@dataclass
class SampleState:
    """One completion (one child request) of a parent request."""

    index: int
    request: Request
    detok: IncrementalDetokenizer
    logprobs: list[dict[int, Logprob]] | None
    cumulative_logprob: float | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # Ids not yet given to the detokenizer (only when text is needed at the end alone, see RequestState.lazy; a
    # quiet sample keeps none: its ids are its request's output_token_ids).
    pending_ids: list[int] = field(default_factory=list)
    # Nothing to do before the sample finishes but keep its ids (RequestState.lazy and no logprobs); fixed when
    # the request is added.
    quiet: bool = False
    # "delta" requests: how many output tokens / logprob entries went out already, and whether its end did
    num_sent_tokens: int = 0
    num_sent_logprobs: int = 0
    sent_finish: bool = False
    # A stop string completed by an id before the last of a step's ids (speculative decoding accepts several at
    # once): the output keeps this many of the request's output ids, as with speculation off.
    num_kept_tokens: int | None = None

    def output_ids(self) -> list[int]:
        """The request's output ids the output shows (not a copy unless cut)."""
        ids = self.request.output_token_ids
        return ids if self.num_kept_tokens is None else ids[: self.num_kept_tokens]


_SP_SPACE = "\u2581"   # SentencePiece's word-boundary marker: a space in the decoded text


@dataclass
class RequestState:
    """A user request: its prompt and its n samples."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[SampleState]
    metrics: RequestMetrics
    child_index: dict[str, int] = field(default_factory=dict)
    # "final": only the finished output is wanted (LLM.generate); "cumulative" / "delta": every step's output.
    output_kind: str = "cumulative"
    # prompt_logprobs requests: [None, then a dict per prompt token whose logprobs came back so far]
    prompt_logprobs: list | None = None
    # "delta": how many prompt_logprobs entries went out already
    num_sent_prompt_logprobs: int = 0
    # encoder-decoder (T5): the encoder input's text, when given as text
    encoder_prompt: str | None = None

    @property
    def lazy(self) -> bool:
        """Detokenize once at the end: nothing reads the text before then and no stop string needs it."""
        return self.output_kind == "final" and not self.params.stop

    @property
    def finished(self) -> bool:
        for s in self.samples:
            if s.finish_reason is None:
                return False
        return True


class OutputProcessor:
    """Keeps per-request output state and builds RequestOutputs.

    Args:
        tokenizer: transformers tokenizer, or None (no text).
    """

    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}
        self.child_to_parent: dict[str, str] = {}
        # child request id -> (its parent's state, its sample): one lookup per token in process()
        self._child_state: dict[str, tuple[RequestState, SampleState]] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, children: list[Request], output_kind: str = "cumulative",
                    encoder_prompt: str | None = None) -> None:
        """Track a request's n samples (``children``). ``encoder_prompt``: an encoder-decoder request's encoder
        text (RequestOutput.encoder_prompt; ``prompt`` / ``prompt_token_ids`` are then the decoder's)."""
        samples = []
        for i, child in enumerate(children):
            detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, child.sampling_params)
            want_lp = params.logprobs is not None
            samples.append(SampleState(i, child, detok, [] if want_lp else None, 0.0 if want_lp else None))
            self.child_to_parent[child.request_id] = request_id
        state = RequestState(request_id, prompt, prompt_token_ids, params, samples,
                             RequestMetrics(arrival_time=children[0].arrival_time), output_kind=output_kind)
        state.child_index = {c.request_id: i for i, c in enumerate(children)}
        state.encoder_prompt = encoder_prompt
        if params.prompt_logprobs is not None:
            state.prompt_logprobs = [None]
        self.states[request_id] = state
        lazy = state.lazy
        for child, sample in zip(children, samples):
            sample.quiet = lazy and sample.logprobs is None
            self._child_state[child.request_id] = (state, sample)

    def process(self, updates: list[tuple[Request, list[int]]],
                logprobs: dict[str, tuple[list[int], list[float], int]],
                prompt_logprobs: dict | None = None) -> tuple[list[RequestOutput], list[str]]:
        """Apply one step's new tokens.

        Args:
            updates: (child request, its new token ids) for every request that produced tokens.
            logprobs: child request id -> (ids, logprobs, rank of the sampled token) for this step's token.
            prompt_logprobs: child request id -> (ids [n][k+1], logprobs [n][k+1], ranks [n]) of its next n
                prompt tokens (ModelRunnerOutput.prompt_logprobs); the first sample's are kept.

        Returns:
            (RequestOutputs of the parents that changed, child ids that hit a stop string and must be finished
            in the scheduler).
        """
        changed: dict[str, RequestState] = {}
        stop_hits: list[str] = []
        ending: list[tuple[IncrementalDetokenizer, list[int], bool]] = []   # quiet samples that finish now
        now = time.monotonic()
        child_state = self._child_state
        if prompt_logprobs:
            self._add_prompt_logprobs(prompt_logprobs)
        for req, new_ids in updates:
            rid = req.request_id
            entry = child_state.get(rid)
            if entry is None:
                continue
            state, sample = entry
            metrics = state.metrics
            if metrics.first_token_time is None:
                metrics.first_token_time = now
                # the earliest of its samples' first scheduling (Request.first_scheduled_time, set by the scheduler)
                metrics.first_scheduled_time = min((s.request.first_scheduled_time for s in state.samples
                                                    if s.request.first_scheduled_time is not None), default=None)
            metrics.last_token_time = now
            metrics.num_generation_tokens += len(new_ids)
            if req.spec_num_steps:   # speculative decoding: the counters of all samples of the request
                metrics.spec_num_steps = sum(s.request.spec_num_steps for s in state.samples)
                metrics.spec_num_draft_tokens = sum(s.request.spec_num_draft_tokens for s in state.samples)
                metrics.spec_num_accepted_tokens = sum(s.request.spec_num_accepted_tokens for s in state.samples)
            finished = req.status.finished
            if sample.quiet:
                # nothing reads the text before the end: detokenize once when finished, all its ids (the request's
                # output ids: every step's new ids, appended by the scheduler; no stop strings, so no stop string
                # can end it: its reasons are the scheduler's)
                if finished:
                    ending.append((sample.detok, list(req.output_token_ids),
                                   req.status == RequestStatus.FINISHED_STOPPED))
                    sample.finish_reason, sample.stop_reason = req.status.finish_reason, req.stop_reason
                    changed[state.request_id] = state
                continue
            parent = state.request_id
            lazy = state.lazy
            if sample.logprobs is not None and rid in logprobs:
                self._add_logprobs(sample, logprobs[rid])
            if lazy and not finished:
                sample.pending_ids.extend(new_ids)
                continue
            if sample.pending_ids:
                new_ids, sample.pending_ids = sample.pending_ids + new_ids, []
            stop_str = sample.detok.update(new_ids, req.status == RequestStatus.FINISHED_STOPPED, finished=finished)
            if stop_str is not None and len(sample.detok.token_ids) < len(req.output_token_ids):
                self._cut_after_stop(sample, len(req.output_token_ids) - len(sample.detok.token_ids))
            if stop_str is not None and not finished:
                sample.finish_reason, sample.stop_reason = "stop", stop_str
                stop_hits.append(rid)
            elif finished:
                sample.finish_reason = req.status.finish_reason
                sample.stop_reason = stop_str if stop_str is not None else req.stop_reason
                if stop_str is not None:
                    sample.finish_reason = "stop"
            changed[parent] = state
        if ending:
            finish_all(ending)     # their whole texts, one batched decode per tokenizer
        outputs = []
        for state in changed.values():
            finished = state.finished
            if finished or state.output_kind != "final":
                out = self._make_output(state, finished)
                if out.outputs or finished:     # a delta with nothing new is not sent
                    outputs.append(out)
            if finished:
                self._drop(state)
        return outputs, stop_hits

    def _cut_after_stop(self, sample: SampleState, num_dropped: int) -> None:
        """The detokenizer stopped ``num_dropped`` ids before the end of the step's ids: the output ends at the id
        that completed the stop string (its logprobs and generation-token count too)."""
        sample.num_kept_tokens = len(sample.detok.token_ids)
        metrics = self._child_state[sample.request.request_id][0].metrics
        metrics.num_generation_tokens -= num_dropped
        if sample.logprobs is not None and len(sample.logprobs) > sample.num_kept_tokens:
            ids = sample.request.output_token_ids
            for i in range(sample.num_kept_tokens, len(sample.logprobs)):
                sample.cumulative_logprob -= sample.logprobs[i][ids[i]].logprob
            del sample.logprobs[sample.num_kept_tokens:]

    def abort(self, request_id: str) -> RequestOutput | None:
        """Mark a parent request aborted; returns its final output (finish_reason 'abort')."""
        state = self.states.get(request_id)
        if state is None:
            return None
        for s in state.samples:
            if s.finish_reason is None:
                s.finish_reason = "abort"
        out = self._make_output(state)
        self._drop(state)
        return out

    def _drop(self, state: RequestState) -> None:
        state.metrics.finished_time = time.monotonic()
        self.states.pop(state.request_id, None)
        for s in state.samples:
            self.child_to_parent.pop(s.request.request_id, None)
            self._child_state.pop(s.request.request_id, None)

    def _add_logprobs(self, sample: SampleState, entry: tuple[list[int], list[float], int]) -> None:
        ids, vals, rank = entry
        sample.logprobs.append(self._logprob_dict(ids, vals, rank, sample.request.sampling_params))
        sample.cumulative_logprob += vals[0]

    def _logprob_dict(self, ids: list[int], vals: list[float], rank: int,
                      params: SamplingParams) -> dict[int, Logprob]:
        """ids / vals [k+1] (column 0: the chosen or actual token, then the top k) -> vLLM's dict: that token
        with its rank first, then the top k with ranks 1..k (a token already in it is not repeated)."""
        d: dict[int, Logprob] = {}
        for j, (tid, lp) in enumerate(zip(ids, vals)):
            if tid in d:
                continue
            d[tid] = Logprob(lp, rank if j == 0 else j, self._decode_one(tid, params))
        return d

    def _add_prompt_logprobs(self, prompt_logprobs: dict) -> None:
        """Append a step's prompt logprobs to their parent requests (from the first sample only: the others
        compute the same numbers)."""
        for rid, (ids, vals, ranks) in prompt_logprobs.items():
            parent = self.child_to_parent.get(rid)
            if parent is None:
                continue
            state = self.states[parent]
            if state.child_index[rid] != 0 or state.prompt_logprobs is None:
                continue
            state.prompt_logprobs.extend(self._logprob_dict(i, v, r, state.params)
                                         for i, v, r in zip(ids, vals, ranks))

    def _decode_one(self, token_id: int, params: SamplingParams) -> str | None:
        """A logprob's token text: the id decoded alone, with the leading spaces that SentencePiece's decode
        strips from a lone piece ("\u2581there" -> "there") put back from the raw piece, as current vLLM does
        (detokenizer_utils.convert_ids_list_to_tokens); so the tokens of a completion join to its text."""
        if self.tokenizer is None or not params.detokenize:
            return None
        text = self.tokenizer.decode([token_id])
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str) and piece.startswith(_SP_SPACE):
            missing = (len(piece) - len(piece.lstrip(_SP_SPACE))) - (len(text) - len(text.lstrip(" ")))
            if missing > 0:
                text = " " * missing + text
        return text

    def _make_output(self, state: RequestState, finished: bool | None = None) -> RequestOutput:
        if finished is None:
            finished = state.finished
        if state.output_kind == "delta":
            return self._make_delta_output(state, finished)
        completions = []
        for s in state.samples:
            done = s.finish_reason is not None
            completions.append(CompletionOutput(
                index=s.index, text=s.detok.get_next_output_text(done, delta=False),
                token_ids=list(s.output_ids()), cumulative_logprob=s.cumulative_logprob,
                logprobs=list(s.logprobs) if s.logprobs is not None else None, finish_reason=s.finish_reason,
                stop_reason=s.stop_reason))
        out = RequestOutput(request_id=state.request_id, prompt=state.prompt,
                            prompt_token_ids=state.prompt_token_ids, outputs=completions, finished=finished,
                            prompt_logprobs=None if state.prompt_logprobs is None else list(state.prompt_logprobs),
                            metrics=state.metrics)
        encoder_ids = state.samples[0].request.encoder_prompt_token_ids
        if encoder_ids is not None:   # encoder-decoder (T5)
            out.encoder_prompt, out.encoder_prompt_token_ids = state.encoder_prompt, encoder_ids
        return out

    def _make_delta_output(self, state: RequestState, finished: bool) -> RequestOutput:
        """RequestOutputKind.DELTA: the completions with something new since the last output (new text, token
        ids, logprobs; or their end), and the prompt logprobs not sent yet (None when there are none)."""
        completions = []
        for s in state.samples:
            done = s.finish_reason is not None
            ids = s.output_ids()
            if len(ids) == s.num_sent_tokens and (s.sent_finish or not done):
                continue
            new_ids = list(ids[s.num_sent_tokens:])
            logprobs = None
            if s.logprobs is not None:
                logprobs = list(s.logprobs[s.num_sent_logprobs:])
                s.num_sent_logprobs = len(s.logprobs)
            s.num_sent_tokens, s.sent_finish = len(ids), done
            completions.append(CompletionOutput(
                index=s.index, text=s.detok.get_next_output_text(done, delta=True), token_ids=new_ids,
                cumulative_logprob=s.cumulative_logprob, logprobs=logprobs, finish_reason=s.finish_reason,
                stop_reason=s.stop_reason))
        prompt_logprobs = None
        if state.prompt_logprobs is not None and len(state.prompt_logprobs) > state.num_sent_prompt_logprobs:
            prompt_logprobs = list(state.prompt_logprobs[state.num_sent_prompt_logprobs:])
            state.num_sent_prompt_logprobs = len(state.prompt_logprobs)
        out = RequestOutput(request_id=state.request_id, prompt=state.prompt,
                            prompt_token_ids=state.prompt_token_ids, outputs=completions, finished=finished,
                            prompt_logprobs=prompt_logprobs, metrics=state.metrics)
        encoder_ids = state.samples[0].request.encoder_prompt_token_ids
        if encoder_ids is not None:   # encoder-decoder (T5)
            out.encoder_prompt, out.encoder_prompt_token_ids = state.encoder_prompt, encoder_ids
        return out
