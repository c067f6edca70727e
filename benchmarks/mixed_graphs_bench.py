"""Admission steps with and without mixed-step CUDA graphs (worker/cuda_graph.py), on a token-id checkpoint.

    python benchmarks/mixed_graphs_bench.py --model DIR [--prompt-len 1300] [--num-requests 32] [--json out.json]

W11's shape without its text: ``--num-requests`` prompts of ``--prompt-len`` random token ids, 128 greedy tokens
each (EOS ignored), through ``LLM.generate`` at max_num_seqs 1, 4 and 16, each with mixed-step graphs off
(``cuda_graph.USE_MIXED_GRAPHS = False``: admission steps eager, unpadded) and on; then, at 4 and 16, n-gram
speculation (k = 4, lookup 2..4, the payoff rule) with them off and on. Prints per run: output tok/s, engine
steps, mixed-graph replays, capture seconds, and whether the greedy ids equal the first run of the same
max_num_seqs and speculation setting.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.append(str(REPO))


def run(model: str, max_num_seqs: int, mixed: bool, spec: dict | None, prompts: list[list[int]],
        max_tokens: int) -> dict:
    import torch

    from hayabusa import LLM, SamplingParams
    from hayabusa.worker import cuda_graph

    old = cuda_graph.USE_MIXED_GRAPHS
    cuda_graph.USE_MIXED_GRAPHS = mixed
    try:
        llm = LLM(model, max_num_seqs=max_num_seqs, max_model_len=min(2048, len(prompts[0]) + max_tokens + 16), skip_tokenizer_init=True,
                  speculative_config=spec)
    finally:
        cuda_graph.USE_MIXED_GRAPHS = old
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], params, use_tqdm=False)   # warm-up
    graphs = llm.llm_engine.runner.decode_runner
    replays0 = getattr(graphs, "num_mixed_replays", 0)
    steps0 = llm.llm_engine.stats.get("num_steps", 0)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    res = {"max_num_seqs": max_num_seqs, "mixed_graphs": mixed, "speculative": spec is not None,
           "seconds": round(elapsed, 4), "out_tok_s": round(sum(len(o.outputs[0].token_ids) for o in outs) / elapsed, 1),
           "num_steps": llm.llm_engine.stats.get("num_steps", 0) - steps0,
           "mixed_replays": getattr(graphs, "num_mixed_replays", 0) - replays0,
           "mixed_graphs_captured": len(getattr(graphs, "mixed_graphs", {}) or {}),
           "capture_s": round(getattr(graphs, "capture_seconds", 0.0), 3),
           "token_ids": [list(o.outputs[0].token_ids) for o in outs]}
    del llm, outs
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompt-len", type=int, default=1300)
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-num-seqs", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--spec-seqs", type=int, nargs="*", default=[4, 16], help="max_num_seqs runs with n-gram too")
    ap.add_argument("--json")
    args = ap.parse_args()
    import numpy as np

    rng = np.random.default_rng(0)
    cfg = json.loads((Path(args.model) / "config.json").read_text())
    vocab = cfg.get("vocab_size") or cfg.get("text_config", {}).get("vocab_size", 32000)
    prompts = [rng.integers(min(100, vocab // 4), min(30000, vocab), size=args.prompt_len).tolist()
               for _ in range(args.num_requests)]
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    plan = [(m, None) for m in args.max_num_seqs] + [(m, ngram) for m in args.spec_seqs]
    results = []
    for m, spec in plan:
        n = args.num_requests if m > 1 else max(4, args.num_requests // 4)   # batch 1 is slow: fewer requests
        pair = [run(args.model, m, mixed, spec, prompts[:n], args.max_tokens) for mixed in (False, True)]
        same = sum(a == b for a, b in zip(pair[0]["token_ids"], pair[1]["token_ids"]))
        for r in pair:
            r["greedy_same_as_off"] = f"{same}/{len(pair[0]['token_ids'])}"
            print({k: v for k, v in r.items() if k != "token_ids"}, flush=True)
        print(f"max_num_seqs={m} spec={spec is not None}: mixed graphs on / off = "
              f"{pair[1]['out_tok_s'] / pair[0]['out_tok_s']:.2f}x", flush=True)
        results += pair
    if args.json:
        for r in results:
            r.pop("token_ids")
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
