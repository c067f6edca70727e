"""Batch invariance of one request, both modes, on a model folder (the lead runs it on the 0.5b and 7b shapes).

    hayabusa bench --make-model qwen2.5-0.5b-shape /tmp/q05
    python benchmarks/batch_invariance.py /tmp/q05 --json bi_q05.json                 # the test's grid, 64 tokens
    python benchmarks/batch_invariance.py /tmp/q7b --full --num-tokens 256 --json bi_7b.json   # the issue's grid

One fixed random prompt (200 tokens; the engine's max_model_len, 2048 + --num-tokens, and the prompts are capped by
the model's context, e.g. 512 tokens for the tests' tiny models) is generated greedily with logprobs, first alone (max_num_seqs=1, no chunking,
no prefix cache), then under every setting of ``hayabusa/eval/batch_invariance.py`` (1 / 15 / 63 (/ 255) other
random requests, max_num_seqs 14 / 16 / 256, prefill chunks 64 / 512 / 8192, a prefix-cache hit, CUDA graphs off),
in batch-invariant mode and in the default mode. Prints, per (mode, setting): identical to the alone run (token ids
and the sampled tokens' logprobs, bitwise)?, the first token index whose id differs, the first whose logprob
differs, and the largest logprob difference before the ids part; ``--json`` writes the same as records, rewritten
after every setting ("complete": false until the last). On CPU each setting builds an engine and runs up to 256
requests: `--mode batch_invariant` halves the time, `--num-tokens 16` shortens each run. The prompts are token ids:
on a vision model (Qwen2-VL / Qwen2.5-VL) they carry no images (tests/engine/test_batch_invariant_encoders.py has
the image cases), and on T5 they are encoder inputs, whose "prefix-cache hit" row runs without a hit (prefix caching
is off for encoder-decoder models).
Exit status 1 when a batch-invariant setting differs.
"""

from __future__ import annotations

import argparse
import json
import sys

from hayabusa.eval.batch_invariance import as_records, default_settings, format_table, run_experiment


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="model folder (e.g. from hayabusa bench --make-model)")
    p.add_argument("--full", action="store_true", help="also 255 others and max_num_seqs 14 (the issue's grid)")
    p.add_argument("--num-tokens", type=int, default=64, help="greedy tokens of the fixed request")
    p.add_argument("--mode", choices=("both", "batch_invariant", "default"), default="both")
    p.add_argument("--kv-cache-memory-bytes", type=int, default=8 << 30)
    p.add_argument("--json", default=None, help="write the records here")
    ns = p.parse_args(argv)
    modes = {"both": (True, False), "batch_invariant": (True,), "default": (False,)}[ns.mode]
    base = {"kv_cache_memory_bytes": ns.kv_cache_memory_bytes, "max_model_len": 2048 + ns.num_tokens}
    def write(outcomes, complete: bool = False) -> None:   # after every setting: a run cut short keeps its records
        if ns.json:
            with open(ns.json, "w", encoding="utf-8") as f:
                json.dump({"model": ns.model, "num_tokens": ns.num_tokens, "complete": complete,
                           "records": as_records(outcomes)}, f, indent=1)

    outcomes = run_experiment(ns.model, default_settings(ns.full), modes=modes, num_tokens=ns.num_tokens,
                              base=base, log=lambda line: print(line, file=sys.stderr, flush=True), progress=write)
    print(format_table(outcomes))
    write(outcomes, complete=True)
    return 1 if any(o.batch_invariant and not o.identical for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
