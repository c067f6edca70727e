"""Cost of logit_bias / allowed_token_ids / bad_words in the offline engine (stories260K; GPU or CPU).

    python benchmarks/logit_edits_overhead.py                 # B=64, 16 -> 128 tokens, 3 repeats (~20 s, H200)
    python benchmarks/logit_edits_overhead.py --batch 256 --repeats 5

Greedy, ignore_eos. Cases: none (the greedy fast path), one request of B with logit_bias (the whole batch goes
through the Sampler), every request with logit_bias (10 ids), allowed_token_ids (64 ids), bad_words (3 words, one
of several tokens). Prints output tok/s (median of the repeats) per case and its ratio to "none"; "none" is the
number that must not move against main (zero cost when no request uses them).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from hayabusa import LLM, SamplingParams
from hayabusa.assets import demo_model_dir


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model directory (default: the bundled stories260K)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    llm = LLM(args.model or demo_model_dir(), skip_tokenizer_init=False)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 500) for _ in range(args.prompt_len)]}
               for _ in range(args.batch)]

    def p(**kw):
        return SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True, **kw)

    bias = {t: 0.5 for t in range(100, 110)}
    cases = {
        "none": [p()] * args.batch,
        "one_logit_bias": [p(logit_bias=bias)] + [p()] * (args.batch - 1),
        "all_logit_bias": [p(logit_bias=bias)] * args.batch,
        "all_allowed_64": [p(allowed_token_ids=list(range(200, 264)))] * args.batch,
        "all_bad_words": [p(bad_words=["girl", "Lily", "play with"])] * args.batch,
    }
    for warm in (p(), p(logit_bias=bias, bad_words=["girl"])):      # warm-up: the fast path and the Sampler
        llm.generate(prompts, warm, use_tqdm=False)
    results = {}
    for name, params in cases.items():
        rates = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            dt = time.perf_counter() - t0
            rates.append(sum(len(o.outputs[0].token_ids) for o in outs) / dt)
        results[name] = statistics.median(rates)
    base = results["none"]
    print(f"batch={args.batch} prompt={args.prompt_len} output={args.output_len} repeats={args.repeats}")
    for name, rate in results.items():
        print(f"{name:16s} {rate:12.0f} tok/s  x{rate / base:.3f}")


if __name__ == "__main__":
    main()
