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

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

from hayabusa.errors import HayabusaValidationError
from hayabusa.outputs import Logprob
from hayabusa.sampling_params import BeamSearchParams, SamplingParams

if TYPE_CHECKING:
    from hayabusa.entrypoints.llm import LLM


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


def beam_search(llm: "LLM", prompts: Sequence[Any], params: BeamSearchParams) -> list[BeamSearchOutput]:
    """Run beam search for every prompt (str, ``{"prompt": ...}`` or ``{"prompt_token_ids": [...]}``).

    Raises:
        HayabusaValidationError: bad params or prompt; 2 x beam_width above the engine's max_logprobs.
    """
    if not isinstance(params, BeamSearchParams):
        raise HayabusaValidationError("params must be a BeamSearchParams.", parameter="params",
                                      value=type(params).__name__)
    engine = llm.llm_engine
    mc = engine.config.model_config
    k = params.beam_width
    if 2 * k > mc.max_logprobs:
        raise HayabusaValidationError(
            f"beam_width={k} needs the top {2 * k} logprobs per step, more than max_logprobs={mc.max_logprobs}; "
            "raise the engine argument max_logprobs.", parameter="beam_width", value=k)
    if isinstance(prompts, (str, dict)):
        prompts = [prompts]
    probe = SamplingParams(max_tokens=1)
    states = []
    for p in prompts:
        _, ids = engine.input_processor.process(p, probe)
        states.append(_PromptBeams(len(ids), [BeamSearchSequence(list(ids))]))
    eos = set() if params.ignore_eos else set(mc.eos_token_ids)
    step_params = SamplingParams(max_tokens=1, logprobs=2 * k, temperature=0.0, ignore_eos=True,
                                 detokenize=False)
    for step in range(params.max_tokens):
        live = [s for s in states if not s.done]
        if not live:
            break
        beams = [b for s in live for b in s.running]
        outs = llm.generate([{"prompt_token_ids": b.tokens} for b in beams], step_params, use_tqdm=False)
        it = iter(outs)
        for s in live:
            last = step + 1 == params.max_tokens or s.prompt_len + step + 1 >= mc.max_model_len
            _advance(s, [next(it).outputs[0].logprobs[0] for _ in s.running], k, eos, last,
                     params.length_penalty, step + 1)
    return [_finish(llm, s, k) for s in states]


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
            new.score = score / (num_generated ** length_penalty)
            ended.append(new)
    s.finished = sorted(s.finished + ended, key=lambda b: -b.score)[:k]
    s.running = running
    if s.open and len(s.finished) == k and running:
        best_possible = running[0].cum_logprob / (num_generated ** length_penalty)
        s.open = best_possible > s.finished[-1].score
    s.done = last or not s.open or not running


def _finish(llm: "LLM", s: _PromptBeams, k: int) -> BeamSearchOutput:
    tok = llm.get_tokenizer()
    best = s.finished if s.finished else s.running
    for b in best:
        if tok is not None:
            b.text = tok.decode(b.tokens, skip_special_tokens=True)
    return BeamSearchOutput(best[:k])
