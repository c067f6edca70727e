"""What one request's stop strings cost every other request: the wall time of LLM.generate for one prompt with
n=128 sampled choices of 128 tokens (ignore_eos), with no stop strings and with 1,000 random 6-character ones
(the server's cap is 1,024 per request, MAX_STOP_STRINGS; none of them ever matches, so the outputs are the same
length). Every step checks each choice's new text against each stop string in Python
(``IncrementalDetokenizer._check_stop_strings``): 128 x 1,000 ``str.find`` per step, on the host, while the batch
-- other clients' requests too -- waits.

    python benchmarks/stop_strings.py                      # stories260K from $HAYABUSA_ASSETS, ~10-60 s
    python benchmarks/stop_strings.py --model DIR --n 64 --stops 1024

Prints, per setting (alternating, 3 repeats, the median): seconds and ms per decode step, and the ratio.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import string
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=os.path.join(os.environ.get("HAYABUSA_ASSETS", "assets"), "models",
                                                    "stories260K"))
    ap.add_argument("--n", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--stops", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    from hayabusa import LLM, SamplingParams

    llm = LLM(args.model, max_model_len=512)
    rng = random.Random(0)
    stops = ["".join(rng.choices(string.ascii_letters, k=6)) for _ in range(args.stops)]
    times: dict[str, list[float]] = {"none": [], "stops": []}
    llm.generate(["Once"], SamplingParams(n=args.n, max_tokens=8, seed=0), use_tqdm=False)   # warm-up
    for _ in range(args.repeats):
        for name, stop in (("none", None), ("stops", stops)):
            sp = SamplingParams(n=args.n, max_tokens=args.tokens, ignore_eos=True, seed=0, stop=stop)
            t = time.perf_counter()
            out = llm.generate(["Once"], sp, use_tqdm=False)[0]
            times[name].append(time.perf_counter() - t)
            assert all(len(c.token_ids) == args.tokens for c in out.outputs)   # no stop string matched
    med = {k: statistics.median(v) for k, v in times.items()}
    for k, v in med.items():
        print(f"stop strings {0 if k == 'none' else args.stops:5d}: {v:.3f} s  {1000 * v / args.tokens:.2f} ms/step "
              f"(n={args.n}, {args.tokens} tokens, median of {args.repeats})")
    print(f"ratio stops / none: {med['stops'] / med['none']:.2f}x")


if __name__ == "__main__":
    main()
