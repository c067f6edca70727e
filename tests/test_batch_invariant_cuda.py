"""On a GPU: batch-invariant mode gives one fixed request bit-identical greedy token ids and logprobs alone and
among 1 / 15 / 63 other random requests, at max_num_seqs 1 / 16 / 256, with prefill chunks of 64 / 512 / 8192
tokens, after a prefix-cache hit, and with CUDA graphs on or off (hayabusa/eval/batch_invariance.py). The default
mode's divergence on the same settings is printed next to it (not asserted: it depends on the GPU and shapes).

Models: a small random bf16 Qwen2 (hidden 512, head_dim 64, GQA group 4, made here in seconds), and the
qwen2.5-0.5b shape when HAYABUSA_Q05_DIR holds one. Run: pytest -s -q tests/test_batch_invariant_cuda.py
"""

from __future__ import annotations

import os

import pytest
import torch

from hayabusa.eval.batch_invariance import default_settings, format_table, run_experiment

pytestmark = pytest.mark.cuda

BASE = {"kv_cache_memory_bytes": 1 << 30, "dtype": "bfloat16"}


@pytest.fixture(scope="module")
def small_qwen2(tmp_path_factory) -> str:
    from hayabusa.bench.models import make_model

    out = str(tmp_path_factory.mktemp("small_qwen2"))
    make_model("small-qwen2", out)
    return out


def _check(model: str, settings, num_tokens: int = 64) -> None:
    outcomes = run_experiment(model, settings, modes=(True, False), num_tokens=num_tokens, base=BASE)
    print("\n" + format_table(outcomes))
    bi = [o for o in outcomes if o.batch_invariant]
    assert all(o.num_tokens == num_tokens for o in bi)
    bad = [o.setting for o in bi if not o.identical]
    assert not bad, f"batch_invariant=True differs from the alone run in: {bad}"


def test_batch_invariant_small_qwen2(small_qwen2):
    _check(small_qwen2, default_settings())


@pytest.mark.skipif(not os.path.exists(os.path.join(os.environ.get("HAYABUSA_Q05_DIR", "/nonexistent"),
                                                    "config.json")), reason="HAYABUSA_Q05_DIR not set")
def test_batch_invariant_q05_shape():
    settings = [s for s in default_settings() if s.num_others in (1, 15)][:4]
    _check(os.environ["HAYABUSA_Q05_DIR"], settings)


def test_matmul_bi_rows_do_not_depend_on_m():
    """The GEMM alone on the GPU: one row's bits inside M = 1 .. 300 (every M-tile position), real shapes."""
    from hayabusa.kernels.batch_invariant import matmul_bi

    gen = torch.Generator(device="cuda").manual_seed(0)
    for N, K in ((1152, 896), (896, 4864), (151936, 896)):
        w = torch.randn(N, K, device="cuda", generator=gen, dtype=torch.bfloat16) / K ** 0.5
        row = torch.randn(K, device="cuda", generator=gen, dtype=torch.bfloat16)
        ref = matmul_bi(row[None], w)[0]
        for M in (2, 15, 64, 65, 129, 300):
            x = torch.randn(M, K, device="cuda", generator=gen, dtype=torch.bfloat16)
            at = M // 2
            x[at] = row
            assert torch.equal(matmul_bi(x, w)[at], ref), (N, K, M)
        torch.testing.assert_close(ref.float(), torch.nn.functional.linear(row[None], w)[0].float(),
                                   rtol=2e-2, atol=2e-2)


def test_log_softmax_bi_rows_do_not_depend_on_r():
    from hayabusa.kernels.batch_invariant import log_softmax_bi

    gen = torch.Generator(device="cuda").manual_seed(0)
    row = 5 * torch.randn(151936, device="cuda", generator=gen)
    ref = log_softmax_bi(row[None])[0]
    for R in (2, 7, 64):
        x = torch.randn(R, 151936, device="cuda", generator=gen)
        x[R - 1] = row
        assert torch.equal(log_softmax_bi(x)[R - 1], ref)
    torch.testing.assert_close(ref, torch.log_softmax(row, -1), rtol=1e-5, atol=1e-5)
