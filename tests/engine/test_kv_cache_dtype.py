"""kv_cache_dtype = auto | fp8 | fp8_e4m3 | fp8_e5m2 through the engine (on CPU: the torch references).

What is checked: bad names fail by name; an fp8 cache has 2x the blocks of a bf16 one (4x fp32) for the same
kv_cache_memory_bytes; checkpoint KV scales load into the attention layers; the scheduling features leave fp8
output unchanged; hayabusa's fp8 path gives the same distributions as HF Transformers with its K/V rounded to
fp8 the same way (an independent implementation); and measured bounds on how far fp8 moves the model's output.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch

from hayabusa import LLM, SamplingParams
from hayabusa.config import EngineArgs
from hayabusa.errors import HayabusaValidationError
from hayabusa.model.layers.attention import Attention, load_kv_scale
from tests.conftest import ASSETS, EN_PROMPTS, JA_PROMPTS

FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
BOTCHAN = ASSETS / "text" / "botchan.plain.txt"


def _attentions(llm: LLM) -> list[Attention]:
    return [m for m in llm.llm_engine.runner.model.modules() if isinstance(m, Attention)]


# ------------------------------------------------------------------------------------------------ arguments, sizing
@pytest.mark.parametrize("bad", ["fp16", "FP8", "int8", "fp8_e4m3fn", "bfloat16", torch.float8_e4m3fn, None])
def test_bad_kv_cache_dtype_names_the_parameter_and_the_valid_ones(stories_dir, bad):
    with pytest.raises(HayabusaValidationError) as e:
        EngineArgs(model=stories_dir, kv_cache_dtype=bad).create_engine_config()
    assert e.value.parameter == "kv_cache_dtype" and e.value.value is bad
    assert "kv_cache_dtype" in str(e.value)
    assert all(f"'{n}'" in str(e.value) for n in ("auto", "fp8", "fp8_e4m3", "fp8_e5m2"))


@pytest.mark.parametrize("name", list(FP8))
def test_fp8_cache_has_twice_the_blocks_of_bf16(tiny_llama, name):
    """Same kv_cache_memory_bytes: fp8 holds 2x the blocks of bf16 (and 4x fp32, the CPU "auto" dtype)."""
    budget = 1 << 20                                   # tiny_llama: 4 KiB per bf16 block (2 layers, 2 kv heads, D 16)
    bf16 = LLM(tiny_llama, dtype="bfloat16", kv_cache_memory_bytes=budget)
    fp8 = LLM(tiny_llama, dtype="bfloat16", kv_cache_dtype=name, kv_cache_memory_bytes=budget)
    assert fp8.llm_engine.num_blocks == 2 * bf16.llm_engine.num_blocks
    assert fp8.llm_engine.kv_cache_capacity_tokens == 2 * bf16.llm_engine.kv_cache_capacity_tokens
    k_cache, v_cache = fp8.llm_engine.runner.kv_caches[0]
    assert k_cache.dtype == v_cache.dtype == FP8[name] and k_cache.shape[0] == fp8.llm_engine.num_blocks
    fp32_cfg = EngineArgs(model=tiny_llama, dtype="float32", kv_cache_memory_bytes=budget).create_engine_config()
    from hayabusa.worker.kv_cache import determine_num_blocks

    assert fp8.llm_engine.num_blocks == 4 * determine_num_blocks(fp32_cfg, None)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    out = fp8.generate(EN_PROMPTS, params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 8 for o in out)
    assert fp8.llm_engine.kv_cache_manager.num_free_blocks == fp8.llm_engine.num_blocks


# ------------------------------------------------------------------------------------------------ scales
def test_load_kv_scale_maps_checkpoint_names(stories_dir):
    """vLLM's kv-scale names (and compressed-tensors' k_proj/v_proj output_scale) fill the layer's buffers."""
    llm = LLM(stories_dir, kv_cache_dtype="fp8")
    model = llm.llm_engine.runner.model
    a0, a1, a2, a3, a4 = _attentions(llm)
    assert float(a0.k_scale) == float(a0.v_scale) == 1.0                   # the checkpoint has none
    t = torch.tensor
    assert load_kv_scale(model, "model.layers.0.self_attn.k_scale", t(0.5))
    assert load_kv_scale(model, "model.layers.0.self_attn.v_scale", t([0.25], dtype=torch.bfloat16))
    assert load_kv_scale(model, "model.layers.1.self_attn.k_proj.output_scale", t([2.0]))
    assert load_kv_scale(model, "model.layers.1.self_attn.v_proj.output_scale", t(3.0))
    assert load_kv_scale(model, "model.layers.2.self_attn.attn.k_scale", t(4.0))
    assert load_kv_scale(model, "model.layers.3.self_attn.k_proj.k_scale", t(5.0))     # ModelOpt
    assert load_kv_scale(model, "model.layers.4.self_attn.kv_scale", t(6.0))           # deprecated: both
    assert load_kv_scale(model, "model.layers.4.self_attn.q_scale", t(9.0))            # accepted, unused
    assert (float(a0.k_scale), float(a0.v_scale), float(a1.k_scale), float(a1.v_scale)) == (0.5, 0.25, 2.0, 3.0)
    assert (float(a2.k_scale), float(a3.k_scale), float(a4.k_scale), float(a4.v_scale)) == (4.0, 5.0, 6.0, 6.0)
    assert not load_kv_scale(model, "model.layers.0.self_attn.q_proj.weight", t(1.0))
    assert not load_kv_scale(model, "model.layers.9.self_attn.k_scale", t(1.0))          # no such layer
    with pytest.raises(HayabusaValidationError, match="per-tensor"):
        load_kv_scale(model, "model.layers.0.self_attn.k_scale", t([1.0, 2.0]))
    with pytest.raises(HayabusaValidationError, match="positive"):
        load_kv_scale(model, "model.layers.0.self_attn.v_scale", t(-1.0))


def test_checkpoint_kv_scales_are_loaded(stories_dir, tmp_path):
    """A checkpoint carrying self_attn.k_scale / v_scale (vLLM / llm-compressor naming) loads them."""
    from safetensors.torch import load_file, save_file

    d = tmp_path / "stories_kv_scales"
    shutil.copytree(stories_dir, d)
    state = load_file(str(d / "model.safetensors"))
    for i in range(5):
        state[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(0.125 * (i + 1))
        state[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(0.5)
    save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})
    llm = LLM(str(d), kv_cache_dtype="fp8")
    assert [float(a.k_scale) for a in _attentions(llm)] == [0.125, 0.25, 0.375, 0.5, 0.625]
    assert all(float(a.v_scale) == 0.5 for a in _attentions(llm))


# ------------------------------------------------------------------------------------------------ equivalences
@pytest.fixture(scope="module")
def fp8_base(tiny_qwen2, example_prompts):
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    llm = LLM(tiny_qwen2, kv_cache_dtype="fp8")
    return [o.outputs[0].token_ids for o in llm.generate(example_prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("kwargs", [dict(enable_prefix_caching=False), dict(max_num_batched_tokens=5, max_num_seqs=4),
                                    dict(block_size=4, num_gpu_blocks_override=20, max_model_len=64)],
                         ids=["no_prefix_caching", "small_chunk", "force_preempt"])
def test_features_do_not_change_fp8_output(tiny_qwen2, example_prompts, fp8_base, kwargs):
    """Prefix caching, chunked prefill and preemption (recompute) read and write the fp8 cache like any other:
    the greedy tokens are identical to the plain fp8 run."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    llm = LLM(tiny_qwen2, kv_cache_dtype="fp8", **kwargs)
    assert [o.outputs[0].token_ids for o in llm.generate(example_prompts, params, use_tqdm=False)] == fp8_base
    if "num_gpu_blocks_override" in kwargs:
        assert llm.llm_engine.scheduler.num_preemptions > 0


def _hf_fp8_kv(model_dir: str, cache_dtype: torch.dtype, k_scale: float, v_scale: float):
    """HF Transformers (fp32, sdpa) whose attention sees K and V (after RoPE) stored and read as fp8 with the given
    scales: fp8(clamp(x / s)) * s. Written against transformers' AttentionInterface, not hayabusa's code."""
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    fmax = torch.finfo(cache_dtype).max

    def round_trip(x: torch.Tensor, s: float) -> torch.Tensor:
        return (x.float() / s).clamp(-fmax, fmax).to(cache_dtype).float() * s

    def attention(module, q, k, v, attention_mask, **kwargs):
        return sdpa_attention_forward(module, q, round_trip(k, k_scale), round_trip(v, v_scale), attention_mask,
                                      **kwargs)

    name = f"hayabusa_test_fp8_kv_{str(cache_dtype)[6:]}_{k_scale}_{v_scale}"
    AttentionInterface.register(name, attention)
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=name).eval()


def _text_ids(llm: LLM, n: int) -> list[int]:
    if not BOTCHAN.exists():
        pytest.skip(f"text asset not found at {BOTCHAN}; set HAYABUSA_ASSETS")
    return llm.get_tokenizer()(BOTCHAN.read_text(encoding="utf-8")[:20000]).input_ids[:n]


@pytest.mark.parametrize("name,k_scale,v_scale", [("fp8_e4m3", 1.0, 1.0), ("fp8_e5m2", 1.0, 1.0),
                                                  ("fp8_e4m3", 0.25, 0.5)])
def test_fp8_matches_hf_with_fp8_rounded_kv(stories_dir, name, k_scale, v_scale):
    """The trained stories260K, 512 tokens of Botchan in two 256-token chunks (each prefilled in 64-token pieces
    through the paged cache): hayabusa's fp8 cache against HF with K/V rounded to fp8 by torch. Where both round
    the same fp32 values the distributions are equal; hayabusa's fp32 K differs from HF's by ~1e-7, which moves a
    few values across an fp8 rounding boundary. Measured: mean KL 3.1e-5 (e4m3), 7.8e-5 (e5m2), 4.1e-8 (e4m3 with
    scales 0.25 / 0.5), top-1 agreement 1.0 (fp8 against full precision is KL 0.07 / 0.28, top-1 0.87 / 0.72);
    asserted: KL < 5e-4, top-1 >= 0.99."""
    from hayabusa.eval.fidelity import _engine_logits_fn, _hf_logits_fn, chunk_text, compare_chunks

    llm = LLM(stories_dir, kv_cache_dtype=name, enforce_eager=True, max_num_batched_tokens=64, max_num_seqs=4,
              num_gpu_blocks_override=40)
    for attn in _attentions(llm):
        attn.k_scale.fill_(k_scale)
        attn.v_scale.fill_(v_scale)
    chunks, nxt = chunk_text(_text_ids(llm, 512), 256)
    hf = _hf_fp8_kv(stories_dir, FP8[name], k_scale, v_scale)
    sums = compare_chunks(chunks, nxt, _engine_logits_fn(llm), _hf_logits_fn(hf, torch.device("cpu")))
    mean_kl, top1 = sums["kl_sum"] / sums["n"], sums["top1"] / sums["n"]
    assert mean_kl < 5e-4 and top1 >= 0.99, (mean_kl, top1)


# ------------------------------------------------------------------------------------------------ measured quality
@pytest.mark.parametrize("name,max_kl,min_top1", [("fp8_e4m3", 0.10, 0.83), ("fp8_e5m2", 0.40, 0.66)])
def test_fp8_fidelity_on_trained_model(stories_dir, name, max_kl, min_top1):
    """`hayabusa eval --fidelity` on the trained stories260K (1024 tokens of Botchan, chunks of 256) against the
    same engine with the fp32 ("auto") cache. Measured: e4m3 KL 0.066 nats/token, top-1 0.874; e5m2 KL 0.277,
    top-1 0.717 (this model is unusually sensitive: head_dim 8 and |K| up to ~25 make its attention peaked).
    Asserted with ~1.5x / 5-point margins."""
    from hayabusa.eval.fidelity import run_fidelity

    if not BOTCHAN.exists():
        pytest.skip(f"text asset not found at {BOTCHAN}; set HAYABUSA_ASSETS")
    r = run_fidelity(stories_dir, BOTCHAN.read_text(encoding="utf-8")[:20000], {"kv_cache_dtype": name},
                     reference="hayabusa-bf16", reference_dtype="float32", chunk_len=256, max_text_tokens=1024)
    assert r.num_tokens == 1024 and r.dtype == "float32"
    assert r.mean_kl < max_kl and r.top1_agreement >= min_top1, (r.mean_kl, r.top1_agreement)
    assert abs(math.log(r.ppl / r.ppl_reference)) < 0.1                     # perplexity within 10%


def _prefix_fraction(base: list[list[int]], other: list[list[int]]) -> float:
    """Share of generated tokens that come before each sequence's first disagreement with `base`."""
    same = 0
    for a, b in zip(base, other):
        same += next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
    return same / sum(len(a) for a in base)


@pytest.mark.parametrize("model,bounds", [("stories_dir", {"fp8_e4m3": 0.30, "fp8_e5m2": 0.15}),
                                          ("tiny_llama", {"fp8_e4m3": 0.08, "fp8_e5m2": 0.03}),
                                          ("tiny_qwen2", {"fp8_e4m3": 0.06, "fp8_e5m2": 0.015})])
def test_fp8_greedy_agrees_with_auto(request, model, bounds):
    """Greedy generation (7 English and Japanese prompts x 32 tokens): the share of tokens generated before the
    first disagreement with the "auto" (fp32 on CPU) cache. Measured: stories260K 0.41 (e4m3) / 0.23 (e5m2);
    random tiny Llama 0.16 / 0.07, tiny Qwen2 0.12 / 0.04: their next-token distributions are nearly flat over a
    100k+ vocabulary (perplexity ~3e5 on text), so near-ties flip early (their teacher-forced KL is 0.02 / 0.07
    nats). Asserted at about half the measured values; each fp8 run must also generate every token."""
    model_dir = request.getfixturevalue(model)
    prompts = EN_PROMPTS + JA_PROMPTS
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    base = [o.outputs[0].token_ids for o in LLM(model_dir).generate(prompts, params, use_tqdm=False)]
    for name, bound in bounds.items():
        got = [o.outputs[0].token_ids for o in LLM(model_dir, kv_cache_dtype=name).generate(prompts, params,
                                                                                             use_tqdm=False)]
        assert all(len(g) == 32 for g in got)
        frac = _prefix_fraction(base, got)
        assert frac >= bound, (name, frac)


# ------------------------------------------------------------------------------------------------ GPU
@pytest.mark.cuda
@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_on_cuda_close_to_auto(stories_dir, name):
    """On a GPU (Triton kernels): the trained model's fp8 fidelity against bf16 is in the range measured on CPU."""
    from hayabusa.eval.fidelity import run_fidelity

    if not BOTCHAN.exists():
        pytest.skip(f"text asset not found at {BOTCHAN}; set HAYABUSA_ASSETS")
    r = run_fidelity(stories_dir, BOTCHAN.read_text(encoding="utf-8")[:20000],
                     {"kv_cache_dtype": name, "device": "cuda", "dtype": "float32"}, reference="hayabusa-bf16",
                     reference_dtype="float32", chunk_len=256, max_text_tokens=1024)
    assert r.mean_kl < {"fp8_e4m3": 0.10, "fp8_e5m2": 0.40}[name], r.mean_kl
