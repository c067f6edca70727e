"""Qwen2-VL / Qwen2.5-VL on CUDA (run on the device): bf16 greedy ids are near-argmaxes of the float32 HF model
(teacher-forced on our sequence, tests.helpers.BF16_MARGIN_NATS) with CUDA graphs on and off, with async scheduling,
chunked prefill and preemption; the vision tower's segment attention equals a per-segment reference in bf16."""

from __future__ import annotations

import pytest
import torch

from hayabusa import LLM, SamplingParams
from hayabusa.model.qwen2_vl import segment_groups, varlen_attention
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
