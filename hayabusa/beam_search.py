"""Beam search on the engine (vLLM's ``LLM.beam_search``; results as HF ``generate(num_beams=k,
do_sample=False)``).

Each step every running beam becomes one engine request: its tokens as the prompt, ``max_tokens=1`` and
``logprobs=2k``. Beams of a prompt share their prefix, so with prefix caching a step recomputes only each beam's
last, partly filled block; the cache manager shares the full blocks between the beams.

The ranking follows HF's beam search (transformers >= 4.50's vectorized one, ``early_stopping=False``):

- each step the 2k best continuations of all running beams (summed raw logprobs) are candidates; the k best of
  those that do not end (EOS, or max_tokens reached) run on;
- a candidate among the k best that ends is a finished hypothesis with score
  ``sum logprob / (generated tokens, EOS included) ** length_penalty``; the k best hypotheses are kept;
- once k hypotheses exist and the best running beam, normalised by its current length, cannot beat the worst of
  them, nothing more is added and the search stops.

vLLM's own scoring differs in details (it divides by the length of prompt + output without the EOS and keeps every
beam running until max_tokens); the outputs here equal HF's, which is what the fidelity tests compare against.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

from hayabusa.errors import HayabusaValidationError
from hayabusa.outputs import Logprob
from hayabusa.sampling_params import BeamSearchParams, SamplingParams


@dataclass
class BeamSearchSequence:
    """One beam (vLLM's ``BeamSearchSequence``).

    Attributes:
        tokens: prompt token ids followed by the generated ones (vLLM's layout).
        logprobs: per generated token, its step's top-2k logprobs.
        cum_logprob: summed logprob of the generated tokens.
        text: the decoded tokens (prompt included), set on the final sequences.
        finish_reason: "stop" (EOS) or "length".
        score: the ranking score: cum_logprob / (generated tokens ** length_penalty).
    """

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    lora_request: Any = None
    score: float = 0.0


@dataclass
class BeamSearchOutput:
    """The beams of one prompt, best first (vLLM's ``BeamSearchOutput``)."""

    sequences: list[BeamSearchSequence]


@dataclass
class _PromptBeams:
    """The search state of one prompt."""

    prompt_len: int
    running: list[BeamSearchSequence]
    finished: list[BeamSearchSequence] = field(default_factory=list)
    open: bool = True                 # HF's early-stop heuristic not yet met: hypotheses may still be added
    done: bool = False


class BeamSearcher:
    """The search state of a batch of prompts, independent of how a step's requests are run (``LLM`` or the
    async engine): ``pending()`` gives the beams to expand, ``advance()`` takes their top-2k logprobs.

    Args:
        prompt_ids: each prompt's token ids.
        params: the search settings.
        eos_token_ids: the ids that end a beam (ignored with ``ignore_eos``).
        max_model_len: a beam also ends when it fills the context.
    """

    def __init__(self, prompt_ids: list[list[int]], params: BeamSearchParams, eos_token_ids: Sequence[int],
                 max_model_len: int) -> None:
        self.params = params
        self.k = params.beam_width
        self.eos = set() if params.ignore_eos else set(eos_token_ids)
        self.max_model_len = max_model_len
        self.states = [_PromptBeams(len(ids), [BeamSearchSequence(list(ids))]) for ids in prompt_ids]
        self.step = 0
        # one engine request per beam: its tokens as the prompt, one token, the top 2k logprobs
        self.step_params = SamplingParams(max_tokens=1, logprobs=2 * self.k, temperature=0.0, ignore_eos=True,
                                          detokenize=False)

    def pending(self) -> list[list[int]]:
        """Token ids of every beam to expand this step (empty when the search is over)."""
        if self.step >= self.params.max_tokens:
            return []
        return [b.tokens for s in self.states if not s.done for b in s.running]

    def advance(self, dists: list[dict[int, Logprob]]) -> None:
        """Take the next-token logprobs of the ``pending()`` beams, in that order."""
        it = iter(dists)
        for s in self.states:
            if s.done:
                continue
            last = self.step + 1 == self.params.max_tokens or s.prompt_len + self.step + 1 >= self.max_model_len
            _advance(s, [next(it) for _ in s.running], self.k, self.eos, last, self.params.length_penalty,
                     self.step + 1)
        self.step += 1

    def outputs(self, tokenizer: Any) -> list[BeamSearchOutput]:
        return [_finish(tokenizer, s, self.k) for s in self.states]


def check_beam_search(params: Any, max_logprobs: int) -> None:
    """Raises HayabusaValidationError: not a BeamSearchParams, or 2 x beam_width above max_logprobs."""
    if not isinstance(params, BeamSearchParams):
        raise HayabusaValidationError("params must be a BeamSearchParams.", parameter="params",
                                      value=type(params).__name__)
    k = params.beam_width
    if 2 * k > max_logprobs:
        raise HayabusaValidationError(
            f"beam_width={k} needs the top {2 * k} logprobs per step, more than max_logprobs={max_logprobs}; "
            "raise the engine argument max_logprobs.", parameter="beam_width", value=k)


def beam_search(llm: Any, prompts: Sequence[Any], params: BeamSearchParams) -> list[BeamSearchOutput]:
    """Run beam search with ``llm`` (an ``LLM``) for every prompt (str, ``{"prompt": ...}`` or
    ``{"prompt_token_ids": [...]}``).

    Raises:
        HayabusaValidationError: bad params or prompt; 2 x beam_width above the engine's max_logprobs.
    """
    engine = llm.llm_engine
    mc = engine.config.model_config
    check_beam_search(params, mc.max_logprobs)
    if isinstance(prompts, (str, dict)):
        prompts = [prompts]
    probe = SamplingParams(max_tokens=1)
    ids = [engine.input_processor.process(p, probe)[1] for p in prompts]
    search = BeamSearcher(ids, params, mc.eos_token_ids, mc.max_model_len)
    while True:
        beams = search.pending()
        if not beams:
            break
        outs = llm.generate([{"prompt_token_ids": b} for b in beams], search.step_params, use_tqdm=False)
        search.advance([o.outputs[0].logprobs[0] for o in outs])
    return search.outputs(llm.get_tokenizer())


async def beam_search_async(engine: Any, prompt_ids: list[list[int]], params: BeamSearchParams,
                            request_id: str) -> list[BeamSearchOutput]:
    """Beam search on an ``AsyncLLMEngine`` (the server's ``use_beam_search``): each step's beams run as
    concurrent requests ``{request_id}-beam-{step}-{i}``."""
    import asyncio

    mc = engine.engine.config.model_config
    check_beam_search(params, mc.max_logprobs)
    search = BeamSearcher(prompt_ids, params, mc.eos_token_ids, mc.max_model_len)

    async def one(tokens: list[int], rid: str) -> dict[int, Logprob]:
        out = None
        async for out in engine.generate({"prompt_token_ids": tokens}, search.step_params, rid):
            pass
        return out.outputs[0].logprobs[0]

    while True:
        beams = search.pending()
        if not beams:
            break
        step = search.step
        search.advance(await asyncio.gather(*[one(b, f"{request_id}-beam-{step}-{i}")
                                              for i, b in enumerate(beams)]))
    return search.outputs(engine.engine.tokenizer)


def _length_normalized(score: float, num_generated: int, length_penalty: float) -> float:
    """``score / num_generated ** length_penalty``, also for an extreme finite length_penalty (1e308, -1e308),
    where the power overflows (OverflowError) or underflows to 0.0: the limits, -0.0 and -inf, instead."""
    try:
        return score / (num_generated ** length_penalty)
    except OverflowError:
        return score * 0.0
    except ZeroDivisionError:
        return -math.inf if score < 0 else 0.0


def _advance(s: _PromptBeams, dists: list[dict[int, Logprob]], k: int, eos: set[int], last: bool,
             length_penalty: float, num_generated: int) -> None:
    """One step of one prompt: the 2k best continuations, the k running on, the finished ones scored."""
    cands = []
    for beam, dist in zip(s.running, dists):
        top = sorted(dist.items(), key=lambda kv: -kv[1].logprob)[:2 * k]
        for tid, lp in top:
            cands.append((beam.cum_logprob + lp.logprob, beam, tid, top))
    cands.sort(key=lambda c: -c[0])
    cands = cands[:2 * k]
    running, ended = [], []
    for i, (score, beam, tid, top) in enumerate(cands):
        hits = last or tid in eos
        new = BeamSearchSequence(beam.tokens + [tid], beam.logprobs + [dict(top)], score)
        if not hits:
            if len(running) < k:
                running.append(new)
        elif i < k and s.open:
            new.finish_reason = "stop" if tid in eos else "length"
            new.score = _length_normalized(score, num_generated, length_penalty)
            ended.append(new)
    s.finished = sorted(s.finished + ended, key=lambda b: -b.score)[:k]
    s.running = running
    if s.open and len(s.finished) == k and running:
        best_possible = _length_normalized(running[0].cum_logprob, num_generated, length_penalty)
        s.open = best_possible > s.finished[-1].score
    s.done = last or not s.open or not running


def _finish(tok: Any, s: _PromptBeams, k: int) -> BeamSearchOutput:
    best = s.finished if s.finished else s.running
    for b in best:
        if tok is not None:
            b.text = tok.decode(b.tokens, skip_special_tokens=True)
    return BeamSearchOutput(best[:k])
