"""On a GPU: T5 greedy output on CUDA (Triton attention with the position bias, cross-attention over the paged
cache, CUDA graphs on and off) equals the CPU path's in float32; in bf16 every token is a near-argmax of the
float32 model (HF, teacher-forced on our sequence). Tiny random T5 v1.0 and v1.1 checkpoints with transformers'
default initialisation: with the CPU tests' initializer_factor=4 the logits span hundreds of nats and HF's own bf16
greedy strays 30-90 nats from its float32 argmax, which makes any bf16 comparison noise."""

from __future__ import annotations

import gc

import pytest
import torch

from hayabusa import LLM, SamplingParams
from tests.helpers import assert_near_greedy, greedy_margins
from tests.models._t5 import T5_EN_PROMPTS, T5_JA_PROMPTS, hf_t5, save_tiny_t5

pytestmark = pytest.mark.cuda

LONG = "Receipt: " + " ".join(f"item{i} ¥{100 + i * 7}" for i in range(20)) + " 合計 ¥9,999"
PROMPTS = (T5_EN_PROMPTS + T5_JA_PROMPTS + [LONG, "a"]) * 3      # 21 requests: decode batches of several sizes
PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=5)


@pytest.fixture(scope="module", params=["v1.0", "v1.1"])
def t5_dir(request, tmp_path_factory) -> str:
    return save_tiny_t5(tmp_path_factory.mktemp("t5_" + request.param.replace(".", "")), request.param,
                        initializer_factor=1.0)


def _margins(model_dir: str, outs) -> list[torch.Tensor]:
    """Per request, each token's distance (nats) below the float32 HF model's best token on our sequence."""
    from transformers import AutoTokenizer

    tok, hf = AutoTokenizer.from_pretrained(model_dir), hf_t5(model_dir)
    res = []
    with torch.no_grad():
        for prompt, (ids, _) in zip(PROMPTS, outs):
            dec = torch.tensor([[hf.config.decoder_start_token_id] + list(ids[:-1])])
            lp = hf(input_ids=tok(prompt, return_tensors="pt").input_ids, decoder_input_ids=dec).logits[0]
            res.append(greedy_margins(lp.float().log_softmax(-1), list(ids)))
    return res


def _run(model_dir: str, device: str, dtype: str, **kw):
    llm = LLM(model_dir, device=device, dtype=dtype, max_num_seqs=8, max_model_len=256, **kw)
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    engine = llm.llm_engine
    assert engine.kv_cache_manager.num_free_blocks == engine.num_blocks
    if device == "cuda" and not kw.get("enforce_eager", False):
        assert engine.runner.graphs is not None and engine.runner.graphs.graphs
    res = [(o.outputs[0].token_ids, [set(d) for d in o.outputs[0].logprobs]) for o in outs]
    del llm, engine
    gc.collect()
    torch.cuda.empty_cache()
    return res


def _assert_close(ours, ref, min_equal: float) -> int:
    """STYLE.md's parity rule between devices or shapes (cuBLAS, SDPA and CPU matmuls round differently): where two
    sequences first differ, each side's token is in the other's top-5 (comparison stops there); and at least
    ``min_equal`` of the sequences are identical. Returns the number identical."""
    equal = 0
    for (a, a_top), (b, b_top) in zip(ours, ref):
        if a == b:
            equal += 1
            continue
        i = next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)
        assert a[i] in b_top[i] and b[i] in a_top[i], (i, a, b)
    assert equal >= min_equal * len(ref), f"only {equal} of {len(ref)} sequences identical"
    return equal


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("enforce_eager", [True, False])
def test_cuda_greedy_equals_cpu(t5_dir, dtype, enforce_eager):
    gpu = _run(t5_dir, "cuda", dtype, enforce_eager=enforce_eager)
    if dtype == "float32":
        _assert_close(gpu, _run(t5_dir, "cpu", dtype), min_equal=0.9)
    else:
        assert_near_greedy(_margins(t5_dir, gpu))


def test_cuda_graphs_equal_eager_bf16(t5_dir):
    eager = _run(t5_dir, "cuda", "bfloat16", enforce_eager=True)
    graphs = _run(t5_dir, "cuda", "bfloat16", enforce_eager=False)
    assert [t for t, _ in graphs] == [t for t, _ in eager]


def test_cuda_fp16_runs_with_the_clamp(t5_dir):
    """fp16 (transformers' clamp, wo in fp32): every request completes with finite logprobs."""
    llm = LLM(t5_dir, device="cuda", dtype="float16", max_num_seqs=8, max_model_len=256)
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 24 for o in outs)
    assert all(lp[t].logprob > float("-inf") for o in outs for t, lp in zip(o.outputs[0].token_ids,
                                                                           o.outputs[0].logprobs))


def test_cuda_fp16_equals_cpu_where_the_ffn_overflows(tmp_path):
    """fp16 on CUDA (graphs) with FFN outputs past fp16's range (wo x 30000: the residual stream goes fp32 as in
    transformers): the CPU fp16 path's ids (equal to HF fp16 there, tests/models/test_t5.py), by the parity rule."""
    from safetensors.torch import load_file, save_file

    model_dir = save_tiny_t5(tmp_path, "v1.1", num_decoder_layers=2, initializer_factor=1.0)
    path = tmp_path / "model.safetensors"
    sd = load_file(str(path))
    save_file({k: v * 30000 if "DenseReluDense.wo" in k else v for k, v in sd.items()}, str(path),
              metadata={"format": "pt"})
    gpu = _run(model_dir, "cuda", "float16")
    assert all(len(t) == 24 for t, _ in gpu)
    _assert_close(gpu, _run(model_dir, "cpu", "float16"), min_equal=0.8)
