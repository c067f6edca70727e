"""Host cost of T5's admission steps' encoder work (``EncoderDecoderRunner.run_encoders``), per path (issue #17, W9):

    python benchmarks/t5_encoder_host.py                                   # tiny random T5, CPU (~30 s)
    python benchmarks/t5_encoder_host.py --device cuda --model DIR         # your checkpoint on the GPU (~30 s)
    python benchmarks/t5_encoder_host.py --requests 128 --enc-len 256 --batch 32

``LLM.generate`` of ``--requests`` prompts of ``--enc-len`` random encoder ids -> ``--max-tokens`` tokens, greedy,
``ignore_eos``, max_num_seqs ``--batch`` (W9's shape, shorter), once per path:

    graphs    padded (B, L) buckets replayed from CUDA graphs (CUDA only: the default engine)
    padded    the same padded shapes run eagerly (CPU's default; on CUDA with enforce_eager)
    packed    the varlen packed path (``padded_encoder`` off), eagerly: the path before the encoder graphs

Each admission step's run_encoders is timed on the host (perf_counter; on CUDA that is launch time: nothing in it
waits for the device), then one more generate per path counts its aten ops (a TorchDispatchMode): all of them, and
those of the device forward (``run_padded_forward`` / ``model.encode`` + ``store_cross_kv``), which a graph replay
replaces by one launch. Prints per path: admission steps, µs per step (median, mean), aten ops per step (mean; in
the forward), the generate's wall s, and whether the token ids equal the first path's (they must on CPU; on CUDA
graphs == padded exactly, packed may differ by a near-tie). Without ``--model`` a random T5 (d_model 64, 2 + 2
layers, stories260K's tokenizer) is built in a temp dir.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))


def run(llm, prompts, params, padded: bool, count_ops: bool) -> dict:
    """One generate on one path; each admission step's run_encoders timed (or its aten ops counted)."""
    import torch

    from hayabusa.bench.common import AtenOpCounter   # marked: the ops inside the device forward

    encdec = llm.llm_engine.runner.encdec
    encdec.padded_encoder = padded
    times, ops, fwd_ops = [], [], []
    mode: list[AtenOpCounter | None] = [None]
    original = encdec.run_encoders

    def forward_part(obj, name):
        fn = getattr(obj, name)

        def marked(*a, **kw):
            m = mode[0]
            if m is None:
                return fn(*a, **kw)
            m.marking = True
            try:
                return fn(*a, **kw)
            finally:
                m.marking = False
        setattr(obj, name, marked)
        return name

    patched = [(encdec, forward_part(encdec, "run_padded_forward")),
               (llm.llm_engine.runner.model, forward_part(llm.llm_engine.runner.model, "encode")),
               (llm.llm_engine.runner.model, forward_part(llm.llm_engine.runner.model, "store_cross_kv"))]

    def timed(out, *a, **kw):
        if not out.scheduled_encoder_prompt_req_ids:
            return original(out, *a, **kw)
        if count_ops:
            with AtenOpCounter() as m:
                mode[0] = m
                try:
                    r = original(out, *a, **kw)
                finally:
                    mode[0] = None
            ops.append(m.n)
            fwd_ops.append(m.marked)
            return r
        t0 = time.perf_counter()
        r = original(out, *a, **kw)
        times.append(time.perf_counter() - t0)
        return r

    encdec.run_encoders = timed
    try:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        wall = time.perf_counter() - t0
    finally:
        encdec.run_encoders = original
        for obj, name in patched:
            delattr(obj, name)
    return {"ids": [o.outputs[0].token_ids for o in outs], "times": times, "ops": ops, "fwd_ops": fwd_ops,
            "wall_s": wall, "replays": encdec.num_encoder_replays}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a T5 checkpoint folder (default: a tiny random one)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--enc-len", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--batch", type=int, default=16, help="max_num_seqs")
    ns = p.parse_args()

    import random

    from hayabusa import LLM, SamplingParams

    model = ns.model
    if model is None:
        from host_overhead import build_tiny

        model = build_tiny("t5", Path(tempfile.mkdtemp(prefix="t5enc_")))
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(ns.enc_len)] for _ in range(ns.requests)]
    params = SamplingParams(temperature=0.0, max_tokens=ns.max_tokens, ignore_eos=True)
    kw = dict(device=ns.device, dtype=ns.dtype, max_num_seqs=ns.batch, skip_tokenizer_init=True)
    cuda = ns.device.startswith("cuda")
    paths = [("graphs", False, True), ("padded", True, True), ("packed", False, False)] if cuda else \
        [("padded", False, True), ("packed", False, False)]
    first = None
    print(f"{ns.requests} x {ns.enc_len} encoder tokens -> {ns.max_tokens}, max_num_seqs {ns.batch}, {ns.device}")
    print(f"{'path':8} {'steps':>5} {'us/step med':>11} {'us/step mean':>12} {'ops/step':>9} {'in fwd':>7} "
          f"{'replays':>7} {'wall s':>7}  same ids")
    for name, eager, padded in paths:
        llm = LLM(model, enforce_eager=eager, **kw)
        run(llm, prompts[:ns.batch], params, padded, False)                 # warm-up (Triton, allocator)
        t = run(llm, prompts, params, padded, False)
        c = run(llm, prompts, params, padded, True)
        first = first or t["ids"]
        us = [1e6 * x for x in t["times"]]
        print(f"{name:8} {len(us):5d} {statistics.median(us):11.0f} {statistics.mean(us):12.0f} "
              f"{statistics.mean(c['ops']):9.1f} {statistics.mean(c['fwd_ops']):7.1f} {t['replays']:7d} "
              f"{t['wall_s']:7.2f}  {t['ids'] == first}")
        del llm


if __name__ == "__main__":
    main()
