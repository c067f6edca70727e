"""Qwen2-VL / Qwen2.5-VL on CUDA (run on the device): bf16 greedy ids are near-argmaxes of the float32 HF model
(teacher-forced on our sequence, tests.helpers.BF16_MARGIN_NATS) with CUDA graphs on and off, with async scheduling,
chunked prefill and preemption; the vision tower's segment attention equals a per-segment reference in bf16; its
varlen FlashAttention path (one launch per layer) equals the grouped SDPA path, in the tower and in greedy output,
and the tower makes the host wait for nothing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hayabusa import LLM, SamplingParams
import hayabusa.model.qwen2_vl as qvl
import hayabusa.model.vision_attention as va
from hayabusa.model.vision_attention import (build_segments, flash_varlen, segment_groups, use_flash_varlen,
                                             varlen_attention, varlen_attention_packed)
from tests.helpers import assert_near_greedy, greedy_margins
from tests.vl_checkpoints import hf_vl_model, make_vl_checkpoint, random_image, vl_prompt_ids

pytestmark = pytest.mark.cuda

ARCHS = ["qwen2_5_vl", "qwen2_vl"]
PARAMS = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=5)
IMAGE_SIZES = [[], [(56, 28)], [(112, 84), (28, 56)], [(56, 56), (84, 28), (28, 84), (112, 56), (70, 98)],
               [(98, 70), (28, 28)]]


@pytest.fixture(scope="module", params=ARCHS)
def vl_dir(request, tmp_path_factory) -> str:
    return make_vl_checkpoint(tmp_path_factory.mktemp(request.param), request.param)


def _prompts(model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    out = []
    for k, sizes in enumerate(IMAGE_SIZES):
        images = [random_image(w, h, 10 * k + j) for j, (w, h) in enumerate(sizes)]
        out.append({"prompt_token_ids": vl_prompt_ids(tok, f"Picture {k}: what is it?", len(images)),
                    "multi_modal_data": {"image": images}})
    return out


def _generate(model_dir, max_model_len=512, **kwargs):
    llm = LLM(model_dir, dtype="bfloat16", max_num_seqs=4, max_model_len=max_model_len, **kwargs)
    outs = llm.generate(_prompts(model_dir), PARAMS, use_tqdm=False)
    runner = llm.llm_engine.runner
    graphs = runner.graphs is not None
    del llm
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return outs, graphs


def _margins(model_dir, outs):
    """Per request, each token's distance (nats) below the float32 HF model's best token on our sequence."""
    from tests.models.test_qwen2_vl import _hf_inputs

    hf, res = hf_vl_model(model_dir), []
    with torch.no_grad():
        for p, o in zip(_prompts(model_dir), outs):
            full = list(o.prompt_token_ids) + list(o.outputs[0].token_ids[:-1])
            images = p["multi_modal_data"]["image"]
            ids, kw = _hf_inputs(model_dir, images, full) if images else (torch.tensor([full]), {})
            lp = hf(input_ids=ids, **kw).logits[0, len(o.prompt_token_ids) - 1:].float().log_softmax(-1)
            res.append(greedy_margins(lp, list(o.outputs[0].token_ids)))
    return res


@pytest.fixture(scope="module")
def cpu_ref(vl_dir):
    return _generate(vl_dir, device="cpu")[0]


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["cuda_graphs", "eager"])
def test_cuda_bf16_greedy_near_argmax(vl_dir, cpu_ref, enforce_eager):
    outs, graphs = _generate(vl_dir, device="cuda", enforce_eager=enforce_eager, num_gpu_blocks_override=256)
    assert graphs == (not enforce_eager)
    assert_near_greedy(_margins(vl_dir, outs))
    exact = sum(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(outs, cpu_ref))
    print(f"{exact} of {len(outs)} sequences equal the CPU bf16 path's")


def test_cuda_chunked_prefill_and_preemption_near_argmax(vl_dir):
    outs, _ = _generate(vl_dir, device="cuda", max_num_batched_tokens=16, block_size=16,
                        num_gpu_blocks_override=8, max_model_len=128)   # 4 requests in 128 KV slots: preemption
    assert_near_greedy(_margins(vl_dir, outs))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_varlen_attention_equals_per_segment_reference(dtype):
    torch.manual_seed(0)
    cu = [0, 64, 128, 144, 208, 209, 300]           # windows of equal and unequal lengths, one of length 1
    q, k, v = (torch.randn(cu[-1], 4, 32, device="cuda", dtype=dtype) for _ in range(3))
    out = varlen_attention(q, k, v, segment_groups(cu, q.device), 32 ** -0.5)
    for a, b in zip(cu[:-1], cu[1:]):
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[a:b].transpose(0, 1), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1), scale=32 ** -0.5).transpose(0, 1)
        torch.testing.assert_close(out[a:b], ref, rtol=2e-2 if dtype == torch.bfloat16 else 1e-5,
                                   atol=2e-2 if dtype == torch.bfloat16 else 1e-5)


def test_varlen_path_is_used_on_cuda_bf16():
    assert flash_varlen() is not None, f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn"
    assert use_flash_varlen(torch.device("cuda"), torch.bfloat16)
    assert not use_flash_varlen(torch.device("cuda"), torch.float32)


@pytest.mark.parametrize("heads, head_dim", [(16, 80), (2, 16)])         # Qwen2.5-VL-7B's tower; the tiny one's
def test_varlen_flash_equals_grouped_sdpa(heads, head_dim):
    torch.manual_seed(0)
    lens = [1, 64, 64, 32, 4000, 1, 16, 64, 48, 8, 1, 2, 3, 64, 128, 999, 1, 56, 40, 64]   # many lengths, 1s, 4000
    cu = np.concatenate([[0], np.cumsum(lens)]).tolist()
    qkv = torch.randn(cu[-1], 3, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    scale = head_dim ** -0.5
    seg, = build_segments([cu], qkv.device, varlen=True)
    assert seg.cu.dtype == torch.int32 and seg.max_len == 4000
    out = seg.attend(qkv, scale)                                                  # [N, H, D]
    grouped = varlen_attention_packed(qkv, segment_groups(cu, qkv.device), scale)
    assert out.shape == grouped.shape == (cu[-1], heads, head_dim) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out, grouped, rtol=2e-2, atol=2e-2)
    q, k, v = qkv.float().unbind(1)
    for a, b in zip(cu[:-1], cu[1:]):                                            # both against fp32 per segment
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[a:b].transpose(0, 1), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1), scale=scale).transpose(0, 1)
        torch.testing.assert_close(out[a:b].float(), ref, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out[:1].float(), qkv[:1, 2].float(), rtol=0, atol=0)   # a 1-row segment: its v


def test_tower_varlen_equals_grouped(monkeypatch):
    from tests.models.test_qwen2_vl_varlen import GRIDS, _pixels, tiny_tower

    tower = tiny_tower(True, torch.bfloat16, "cuda")
    grids = GRIDS + [(1, 74, 54)]                                    # plus a 1036 x 756 page: 3996 patches
    pixels = _pixels(grids, torch.bfloat16, "cuda")
    with torch.no_grad():
        varlen = tower(pixels, grids)
        monkeypatch.setattr(va, "VISION_VARLEN", False)
        grouped = tower(pixels, grids)
    torch.testing.assert_close(varlen.float(), grouped.float(), rtol=3e-2, atol=3e-2)


def test_tower_triton_rope_equals_torch_rope(monkeypatch):
    """bf16: the tower with q and k rotated by kernels/rotary.py (the CUDA default) against the torch ops (the CPU
    path), both fp32 math rounded once; Triton may fuse a multiply-add, so bf16 tolerance, not bits."""
    from tests.models.test_qwen2_vl_varlen import GRIDS, _pixels, tiny_tower

    tower = tiny_tower(True, torch.bfloat16, "cuda")
    pixels = _pixels(GRIDS, torch.bfloat16, "cuda")
    with torch.no_grad():
        fused = tower(pixels, GRIDS)
        monkeypatch.setattr(qvl, "fused_vision_rope", lambda device: False)
        plain = tower(pixels, GRIDS)
    torch.testing.assert_close(fused.float(), plain.float(), rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("varlen", [True, False], ids=["varlen", "grouped"])
def test_tower_does_not_sync(monkeypatch, varlen):
    """The tower call (pixels already on the device) never makes the host wait for the device: under sync debug
    mode "error" any synchronizing CUDA call inside it (.item(), .cpu(), nonzero, a pageable copy) raises."""
    from tests.models.test_qwen2_vl_varlen import GRIDS, _pixels, tiny_tower

    monkeypatch.setattr(va, "VISION_VARLEN", varlen)
    tower = tiny_tower(True, torch.bfloat16, "cuda")
    pixels = _pixels(GRIDS, torch.bfloat16, "cuda")
    with torch.no_grad():
        want = tower(pixels, GRIDS)                                   # warm-up: lazy inits (cuBLAS, pinned pool)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = tower(pixels, GRIDS)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_greedy_varlen_on_equals_off(vl_dir, monkeypatch):
    """bf16 greedy output with the varlen tower equals the grouped-SDPA tower's; where bf16 summation order flips a
    near-tie, each side's token at the first divergence is in the other's top-5 (reported), and nothing after it
    is compared."""
    on, _ = _generate(vl_dir, device="cuda", num_gpu_blocks_override=256)
    monkeypatch.setattr(va, "VISION_VARLEN", False)
    off, _ = _generate(vl_dir, device="cuda", num_gpu_blocks_override=256)
    exact = 0
    for a, b in zip(on, off):
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        if ta == tb:
            exact += 1
            continue
        i = next(j for j, (x, y) in enumerate(zip(ta, tb)) if x != y)
        print(f"first divergence at output token {i}: varlen {ta[i]}, grouped {tb[i]}")
        assert tb[i] in a.outputs[0].logprobs[i] and ta[i] in b.outputs[0].logprobs[i]     # top-5 each way
    print(f"{exact} of {len(on)} sequences equal with varlen on and off")
