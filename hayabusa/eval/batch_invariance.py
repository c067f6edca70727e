"""The batch-invariance experiment: one fixed request's greedy token ids and logprobs, run alone and in many
settings (other random requests beside it, max_num_seqs, prefill chunk size, a prefix-cache hit, CUDA graphs on or
off), compared with the alone run bit for bit. Used by ``tests/test_batch_invariant_cuda.py`` and
``benchmarks/batch_invariance.py`` (both modes, so the default mode's divergence is shown next to the mode's).

A setting's engine is built once; its requests are the target among ``num_others`` random requests (random prompt
lengths and output lengths, so the batch around the target changes from step to step), the target in the middle.
"""

from __future__ import annotations

import gc
import random
from dataclasses import asdict, dataclass, field
from typing import Any

from hayabusa.errors import HayabusaValidationError


@dataclass
class Setting:
    name: str
    num_others: int = 0                                  # random requests generated together with the target
    engine: dict[str, Any] = field(default_factory=dict)  # engine arguments over the experiment's base ones
    prefix_hit: bool = False                             # run the target once first: its blocks are then a hit


@dataclass
class Outcome:
    setting: str
    batch_invariant: bool
    identical: bool                  # token ids and the sampled tokens' logprobs equal to the alone run's, bitwise
    first_divergent_token: int | None   # first index whose token id differs (None: ids equal)
    first_logprob_mismatch: int | None  # first index whose logprob (of the sampled token) differs
    max_abs_logprob_diff: float      # over the common prefix of equal ids
    num_tokens: int


def default_settings(full: bool = False) -> list[Setting]:
    """The test's settings; ``full`` adds the issue's larger grid (255 others, max_num_seqs 14)."""
    s = [
        Setting("alone, max_num_seqs=16", 0, {"max_num_seqs": 16}),
        Setting("1 other, max_num_seqs=16", 1, {"max_num_seqs": 16}),
        Setting("15 others, max_num_seqs=16", 15, {"max_num_seqs": 16}),
        Setting("63 others, max_num_seqs=256", 63, {"max_num_seqs": 256}),
        Setting("15 others, chunk 64", 15, {"max_num_seqs": 64, "max_num_batched_tokens": 64}),
        Setting("15 others, chunk 512", 15, {"max_num_seqs": 256, "max_num_batched_tokens": 512}),
        Setting("15 others, chunk 8192", 15, {"max_num_seqs": 256, "max_num_batched_tokens": 8192}),
        Setting("prefix hit, 15 others", 15, {"max_num_seqs": 256, "enable_prefix_caching": True}, True),
        Setting("15 others, CUDA graphs off", 15, {"max_num_seqs": 256, "enforce_eager": True}),
    ]
    if full:
        s += [Setting("15 others, max_num_seqs=14", 15, {"max_num_seqs": 14}),
              Setting("63 others, max_num_seqs=16", 63, {"max_num_seqs": 16}),
              Setting("255 others, max_num_seqs=256", 255, {"max_num_seqs": 256})]
    return s


def random_prompts(n: int, seed: int, vocab: int, lo: int = 8, hi: int = 300) -> list[list[int]]:
    rng = random.Random(seed)
    top = min(vocab, 10000)
    return [[rng.randrange(min(100, top // 2), top) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def run_setting(model: str, setting: Setting, target: list[int], num_tokens: int, batch_invariant: bool,
                base: dict[str, Any] | None = None, seed: int = 1) -> tuple[list[int], list[float]]:
    """The target's greedy token ids and the logprob of each under ``setting``; the engine is freed after. The
    other requests' prompts are at most ``max_model_len - 2 * num_tokens`` tokens (their outputs < 2 * num_tokens),
    so each fits the engine's context."""
    from hayabusa import LLM, SamplingParams

    args = {"skip_tokenizer_init": True, "enable_prefix_caching": False, "max_model_len": 2048,
            **(base or {}), **setting.engine, "batch_invariant": batch_invariant}
    llm = LLM(model, **args)
    try:
        mc = llm.llm_engine.config.model_config
        params = SamplingParams(temperature=0.0, max_tokens=num_tokens, logprobs=1, ignore_eos=True)
        if setting.prefix_hit:
            llm.generate([{"prompt_token_ids": target}], params, use_tqdm=False)
        hi = min(300, mc.max_model_len - 2 * num_tokens + 1)
        others = random_prompts(setting.num_others, seed, mc.vocab_size, min(8, hi - 1), hi)
        rng = random.Random(seed + 1)
        other_params = [SamplingParams(temperature=0.0, max_tokens=rng.randrange(min(8, num_tokens), 2 * num_tokens),
                                       ignore_eos=True) for _ in others]
        half = len(others) // 2
        prompts = [{"prompt_token_ids": p} for p in others[:half] + [target] + others[half:]]
        outs = llm.generate(prompts, other_params[:half] + [params] + other_params[half:], use_tqdm=False)
        c = outs[half].outputs[0]
        ids = list(c.token_ids)
        return ids, [d[t].logprob for t, d in zip(ids, c.logprobs)]
    finally:
        del llm
        gc.collect()
        try:
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except ImportError:
            pass


def compare(ref: tuple[list[int], list[float]], got: tuple[list[int], list[float]], setting: str,
            batch_invariant: bool) -> Outcome:
    """Bitwise comparison of (ids, logprobs) with the alone run's."""
    (rid, rlp), (gid, glp) = ref, got
    div = next((i for i, (a, b) in enumerate(zip(rid, gid)) if a != b), None)
    if div is None and len(rid) != len(gid):
        div = min(len(rid), len(gid))
    common = len(rid) if div is None else div
    lp_mis = next((i for i in range(common) if rlp[i] != glp[i]), None)
    max_diff = max((abs(rlp[i] - glp[i]) for i in range(common)), default=0.0)
    return Outcome(setting, batch_invariant, div is None and lp_mis is None, div, lp_mis, max_diff, len(gid))


def run_experiment(model: str, settings: list[Setting], modes: tuple[bool, ...] = (True, False),
                   num_tokens: int = 64, target_len: int = 200, base: dict[str, Any] | None = None,
                   log: Any = None, progress: Any = None) -> list[Outcome]:
    """For each mode: the alone run (max_num_seqs=1, no chunking, no prefix cache) and every setting compared
    with it. Returns one Outcome per (mode, setting), the alone run itself included as the first.
    ``log(line)`` gets each setting's line as it finishes, ``progress(outcomes)`` the outcomes so far (a caller
    writes its file there, so a run cut short keeps what it measured).

    ``base["max_model_len"]`` (default 2048) is capped by the model's own context length, and the target's prompt
    by ``max_model_len - num_tokens``. Raises ValueError (naming num_tokens) when the context has no room for a
    prompt and 2 * num_tokens output tokens (the other requests' longest)."""
    max_len = min(int((base or {}).get("max_model_len", 2048)), _model_max_len(model))
    if not isinstance(num_tokens, int) or num_tokens < 1:
        raise HayabusaValidationError(f"num_tokens must be a positive int, got {num_tokens!r}",
                                      parameter="num_tokens", value=num_tokens)
    if max_len - 2 * num_tokens < 2:
        raise HayabusaValidationError(
            f"num_tokens={num_tokens} leaves no room for prompts in the model's context of {max_len} tokens "
            f"(the other requests generate up to 2 * num_tokens).", parameter="num_tokens", value=num_tokens)
    base = {**(base or {}), "max_model_len": max_len}
    target_len = min(target_len, max_len - num_tokens)
    target = random_prompts(1, 12345, _vocab_size(model), target_len, target_len + 1)[0]
    results = []
    for mode in modes:
        alone_setting = Setting("alone, max_num_seqs=1", 0, {"max_num_seqs": 1})
        ref = run_setting(model, alone_setting, target, num_tokens, mode, base)
        results.append(compare(ref, ref, alone_setting.name, mode))
        for s in settings:
            out = compare(ref, run_setting(model, s, target, num_tokens, mode, base), s.name, mode)
            results.append(out)
            if log is not None:
                log(format_outcome(out))
            if progress is not None:
                progress(list(results))
    return results


def _model_max_len(model: str) -> int:
    """The model's context length from its config.json (config.py's rule, as the engine derives it)."""
    from hayabusa.config import derive_max_model_len, load_hf_config

    cfg = load_hf_config(model, False)
    return derive_max_model_len(cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg)


def _vocab_size(model: str) -> int:
    import json
    import os

    with open(os.path.join(model, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    return int(cfg.get("vocab_size") or cfg.get("text_config", {}).get("vocab_size"))


def format_outcome(o: Outcome) -> str:
    mode = "batch_invariant" if o.batch_invariant else "default"
    return (f"{mode:15s}  {o.setting:32s}  {'identical' if o.identical else 'DIFFERS':9s}  "
            f"first token diff {o.first_divergent_token!s:>4}  first logprob diff {o.first_logprob_mismatch!s:>4}"
            f"  max |dlogprob| {o.max_abs_logprob_diff:.3g}")


def format_table(outcomes: list[Outcome]) -> str:
    return "\n".join(format_outcome(o) for o in outcomes)


def as_records(outcomes: list[Outcome]) -> list[dict[str, Any]]:
    return [asdict(o) for o in outcomes]
