"""Diagnose a CUDA-only divergence: run one prefill of a tiny architecture on CPU and on CUDA (float32, eager and
CUDA graphs) and print, module by module in execution order, the largest |difference| of their outputs.

    python benchmarks/diag_cuda_vs_cpu.py gemma2 [mistral ...]

Builds the tiny random checkpoints of tests/models/test_architectures.py (needs HAYABUSA_ASSETS tokenizers).
"""

from __future__ import annotations

import sys
import tempfile

import torch


def capture(model_dir: str, device: str, prompt: list[int]) -> list[tuple[str, torch.Tensor]]:
    from hayabusa import LLM, SamplingParams

    llm = LLM(model_dir, device=device, dtype="float32", enforce_eager=True, kv_cache_memory_bytes=1 << 26,
              skip_tokenizer_init=True)
    model = llm.llm_engine.runner.model
    seen: list[tuple[str, torch.Tensor]] = []

    def hook(name):
        def f(mod, args, out):
            t = out[0] if isinstance(out, tuple) else out
            if isinstance(t, torch.Tensor) and t.shape[0] == len(prompt):
                seen.append((name, t.detach().float().cpu().clone()))
        return f

    handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules() if n]
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=4, logprobs=3),
                       use_tqdm=False)[0].outputs[0]
    for h in handles:
        h.remove()
    print(f"  {device}: tokens {out.token_ids} top-3 at 0: {sorted(out.logprobs[0].items(), key=lambda kv: -kv[1].logprob)[:3]}")
    return seen


def main() -> None:
    sys.path.insert(0, "tests")
    sys.path.insert(0, "tests/models")
    from test_architectures import _build

    for arch in sys.argv[1:] or ["gemma2"]:
        d = tempfile.mkdtemp()
        _build(arch, d)
        prompt = list(range(5, 40))  # longer than the tiny window (8)
        print(f"=== {arch}")
        a = capture(d, "cpu", prompt)
        b = capture(d, "cuda", prompt)
        shown = 0
        for (na, ta), (nb, tb) in zip(a, b):
            diff = (ta - tb).abs().max().item() if ta.shape == tb.shape else float("nan")
            scale = ta.abs().max().item()
            if shown < 40:
                print(f"  {na:<50} max|cpu-cuda| {diff:.3e} (max|x| {scale:.3e})")
                shown += 1


if __name__ == "__main__":
    main()
