"""Where a structured-output W1 step's host time goes: W1 (scaled) with the bundled receipt schema on every request,
under cProfile; prints the engine's step-time breakdown and the top functions by own time.

    python benchmarks/profile_structured.py MODEL_DIR [--max-tokens 64] [--top 30]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

from hayabusa import LLM, SamplingParams
from hayabusa.bench.workloads import get_workload
from hayabusa.sampling_params import StructuredOutputsParams
from hayabusa.structured_output.schemas import load_schema


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--max-tokens", type=int, default=64, help="per request (W1's 256 requests, shorter outputs)")
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    reqs = get_workload("W1").requests
    llm = LLM(args.model, skip_tokenizer_init=False)
    constraint = StructuredOutputsParams(json=load_schema("receipt"))
    params = [SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, detokenize=False, temperature=r.temperature,
                             structured_outputs=constraint) for r in reqs]
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in reqs]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)
    s0 = dict(llm.llm_engine.stats)
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    outs = llm.generate(prompts, params, use_tqdm=False)
    prof.disable()
    elapsed = time.perf_counter() - t0
    s1 = llm.llm_engine.stats
    steps = s1["num_steps"] - s0.get("num_steps", 0)
    ntok = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"{len(outs)} requests, {ntok} tokens, {elapsed:.2f} s (profiled), {steps} steps")
    for k in ("schedule_s", "launch_s", "wait_s", "collect_s"):
        print(f"  {k}: {(s1[k] - s0.get(k, 0)) / max(steps, 1) * 1e3:.2f} ms/step")
    pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
