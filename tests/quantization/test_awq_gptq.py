"""AWQ and GPTQ checkpoints written by the tests' own packer (``_packers.py``: RTN quantization of a tiny random
Llama / Qwen2, packed as AutoAWQ / AutoGPTQ / GPTQModel store it), loaded with ``LLM(...)``:

  (a) every quantized layer's weight as the engine holds it equals the packer's dequantization exactly;
  (b) greedy output equals HF Transformers (float32, CPU) on a float checkpoint of those dequantized weights;
  (c) teacher-forced logits stay within a measured KL of the unquantized model.

The tiny models have hidden size 128 and MLP size 256 (so group sizes 32, 64, 128 and -1 all fit), 4 query heads
and 2 KV heads of 32: the merged q/k/v has shards of N = 128, 64, 64.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from hayabusa import LLM, SamplingParams
from hayabusa.errors import HayabusaValidationError
from hayabusa.model.layers.linear import Linear
from hayabusa.quantization import get_quantization_config
from tests.conftest import ASSETS, STORIES, require_asset
from tests.helpers import assert_greedy_close, hf_greedy
from tests.quantization import _packers as pk

PROMPTS = ["Once upon a time", "The little dog", "Tom and Lily went to the park"]
TEXT = ASSETS / "text" / "botchan.plain.txt"


def _tiny(arch: str, out: Path) -> str:
    """A 2-layer random-weight checkpoint (std 0.2 so greedy tokens are not near-ties) with stories260K's
    512-token tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    src = require_asset(STORIES)
    common = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2,
                  bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, rms_norm_eps=1e-5, tie_word_embeddings=False))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**common, rms_norm_eps=1e-6, tie_word_embeddings=True,
                                             use_sliding_window=False))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")):
                    p.normal_(0.0, 0.5)
    model.save_pretrained(str(out), safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(src / f, out / f)
    return str(out)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    made: dict[str, str] = {}

    def get(arch: str) -> str:
        if arch not in made:
            made[arch] = _tiny(arch, tmp_path_factory.mktemp(f"tiny_{arch}"))
        return made[arch]
    return get


def _text_ids(llm: LLM, n: int) -> list[int]:
    return llm.get_tokenizer()(require_asset(TEXT).read_text(encoding="utf-8")[:20000]).input_ids[:n]


def _kl_top1(llm: LLM, ref: LLM, tokens: int = 512) -> tuple[float, float]:
    """(mean KL(ref || llm) per token, top-1 agreement) teacher-forced over the text, through both engines."""
    from hayabusa.eval.fidelity import _engine_logits_fn, chunk_text, compare_chunks

    chunks, nxt = chunk_text(_text_ids(llm, tokens), 256)
    s = compare_chunks(chunks, nxt, _engine_logits_fn(llm), _engine_logits_fn(ref))
    return s["kl_sum"] / s["n"], s["top1"] / s["n"]


def _check_layers(llm: LLM, deq: dict[str, torch.Tensor], method_name: str) -> int:
    """(a): each quantized Linear's W equals the packer's dequantization of its shards, bit for bit."""
    n = 0
    for name, layer in llm.llm_engine.runner.model.named_modules():
        if not isinstance(layer, Linear) or name.endswith("lm_head"):
            continue
        assert type(layer.quant_method).__name__ == method_name, name
        ref = torch.cat([deq[p] for p in layer.checkpoint_prefixes], dim=0)
        assert torch.equal(layer.quant_method.dequantized_weight(layer), ref), name
        n += 1
    return n


def _check_against_hf(ckpt: str, deq_dir: str, llm: LLM) -> None:
    """(b): greedy ids equal HF float32 on the dequantized checkpoint (STYLE.md's near-tie rule)."""
    tok = llm.get_tokenizer()
    ids = [tok(p).input_ids for p in PROMPTS]
    outs = llm.generate([{"prompt_token_ids": i} for i in ids], SamplingParams(temperature=0.0, max_tokens=16,
                                                                              ignore_eos=True), use_tqdm=False)
    ref = hf_greedy(deq_dir, ids, 16)
    for i, o, r in zip(ids, outs, ref):
        assert_greedy_close(deq_dir, i, list(o.outputs[0].token_ids), r)


# name -> (format, arch, packer arguments, KL bound). The tiny models' random weights (std 0.2) make them far more
# sensitive than trained ones: measured KL(unquantized || quantized) over 512 tokens, top-1 agreement in brackets:
# awq g64 0.84 (0.32), awq g128 0.87 (0.27), gptq g128 sym 1.11 (0.21), g64 act-order 0.88 (0.31), one group
# act-order 0.99 (0.27), g32 0.67 (0.35); 8-bit one group 0.0069 (0.90), 8-bit g64 act-order 0.0049 (0.92).
# The trained stories260K below gives the meaningful number.
CASES = {
    "awq-g64-llama": ("awq", "llama", dict(group_size=64), 1.3),
    "awq-g128-qwen2": ("awq", "qwen2", dict(group_size=128), 1.3),
    "gptq-g128-sym-v1-llama": ("gptq", "llama", dict(group_size=128, sym=True), 1.6),
    "gptq-g64-asym-actorder-v1-llama": ("gptq", "llama", dict(group_size=64, desc_act=True), 1.3),
    "gptq-gall-sym-actorder-v2-qwen2": ("gptq", "qwen2", dict(group_size=-1, sym=True, desc_act=True,
                                                              gptq_version=2), 1.5),
    "gptq-g32-asym-v2-qwen2": ("gptq", "qwen2", dict(group_size=32, gptq_version=2), 1.0),
    "gptq8-gall-sym-llama": ("gptq", "llama", dict(group_size=-1, bits=8, sym=True), 0.015),
    "gptq8-g64-asym-actorder-llama": ("gptq", "llama", dict(group_size=64, bits=8, desc_act=True), 0.015),
}
METHOD = {("awq", 4): "AwqLinearMethod", ("gptq", 4): "Gptq4LinearMethod", ("gptq", 8): "Gptq8LinearMethod"}


@pytest.mark.parametrize("case", list(CASES))
def test_checkpoint_loads_exactly_and_matches_hf(case, tiny, tmp_path):
    fmt, arch, kw, kl_bound = CASES[case]
    src = tiny(arch)
    ckpt, deq_dir = tmp_path / "q", tmp_path / "deq"
    deq = pk.write_quantized(src, ckpt, fmt, dequantized_out=deq_dir, **kw)
    llm = LLM(str(ckpt), device="cpu", max_model_len=256)
    assert llm.llm_engine.config.model_config.quantization == fmt
    assert _check_layers(llm, deq, METHOD[fmt, kw.get("bits", 4)]) == 2 * 4           # qkv, o, gate_up, down
    layer0 = llm.llm_engine.runner.model.model.layers[0]
    if kw.get("desc_act") and kw.get("bits", 4) == 4 and kw["group_size"] != -1:
        assert layer0.self_attn.qkv_proj.perm is not None                             # rows were reordered
    if kw.get("bits") == 8:   # one symmetric group: the int8 kernel; groups: dequantized at load
        qkv = layer0.self_attn.qkv_proj
        assert (qkv.qweight.dtype == torch.int8) if kw["group_size"] == -1 else (qkv.weight.dtype == torch.float32)
    _check_against_hf(str(ckpt), str(deq_dir), llm)
    kl, top1 = _kl_top1(llm, LLM(src, device="cpu", max_model_len=256))
    print(f"{case}: KL {kl:.4g} top-1 {top1:.4f}")
    assert kl < kl_bound, (kl, top1)


# ---------------------------------------------------------------------------------------------- trained model
STORIES_MLP = ("gate_proj", "up_proj", "down_proj")


# measured KL / top-1 vs the fp32 model over 512 tokens (attention layers quantized, g32): awq 0.096 / 0.811,
# gptq act-order 0.076 / 0.834, gptq sym 0.099 / 0.826
@pytest.mark.parametrize("fmt, kw", [("awq", {}), ("gptq", dict(desc_act=True)), ("gptq", dict(sym=True))])
def test_stories260k_attention_layers(fmt, kw, stories_dir, tmp_path):
    """stories260K's MLP (N = 172 and K = 172) fits neither format's packing, so it stays float, listed in
    modules_to_not_convert; q/k/v/o (K = 64) are packed in groups of 32."""
    deq = pk.write_quantized(stories_dir, tmp_path / "q", fmt, group_size=32, skip=STORIES_MLP, **kw)
    llm = LLM(str(tmp_path / "q"), device="cpu", max_model_len=512)
    layer = llm.llm_engine.runner.model.model.layers[3]
    assert type(layer.mlp.gate_up_proj.quant_method).__name__ == "UnquantizedLinearMethod"
    qkv = layer.self_attn.qkv_proj
    ref = torch.cat([deq[p] for p in qkv.checkpoint_prefixes])
    assert torch.equal(qkv.quant_method.dequantized_weight(qkv), ref)
    kl, top1 = _kl_top1(llm, LLM(stories_dir, device="cpu", max_model_len=512))
    print(f"stories260K {fmt} {kw}: KL {kl:.4g} top-1 {top1:.4f}")
    assert kl < 0.14 and top1 > 0.75, (kl, top1)


def test_stories260k_mlp_shapes_are_refused_by_layer_name(stories_dir, tmp_path):
    pk.write_quantized(stories_dir, tmp_path / "q", "awq", group_size=32, skip=STORIES_MLP)
    cfg = json.loads((tmp_path / "q" / "config.json").read_text())
    cfg["quantization_config"]["modules_to_not_convert"] = ["down_proj"]
    (tmp_path / "q" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(HayabusaValidationError, match=r"awq: model\.layers\.0\.mlp\.gate_up_proj has out_features "
                                                      r"of a shard = 172, not a multiple of 8"):
        LLM(str(tmp_path / "q"), device="cpu")


# ---------------------------------------------------------------------------------------------- packing by hand
def test_awq_unpack_order_by_hand():
    """AutoAWQ puts column ORDER[i] in nibble i (ORDER = 0 2 4 6 1 3 5 7): the word 0x76543210 (nibble i = i)
    holds columns 0..7 = 0 4 1 5 2 6 3 7; the test packer writes the same word back."""
    from hayabusa.quantization.awq import unpack_awq

    word = torch.tensor([[0x76543210]], dtype=torch.int32)
    assert unpack_awq(word).tolist() == [[0, 4, 1, 5, 2, 6, 3, 7]]
    assert pk.pack_along_cols(torch.tensor([[0, 4, 1, 5, 2, 6, 3, 7]]), 4, pk.AWQ_ORDER).tolist() == [[0x76543210]]


def test_gptq_rows_are_the_int4_kernel_layout_and_v1_zeros_are_off_by_one():
    from hayabusa.kernels.quant_linear import pack_int4
    from hayabusa.quantization.packed import unpack_int32

    q = torch.randint(0, 16, (64, 24))
    assert torch.equal(pk.pack_along_rows(q, 4), pack_int4(q))                   # GPTQ qweight = kernel layout
    stored = pk.pack_along_cols(torch.full((1, 8), 7), 4)                        # sym v1: 8 - 1 in every nibble
    assert stored.tolist() == [[0x77777777]] and (unpack_int32(stored, 4, dim=1) + 1).tolist() == [[8] * 8]
    assert unpack_int32(torch.tensor([[-1]], dtype=torch.int32), 8, dim=0).flatten().tolist() == [255] * 4


# ---------------------------------------------------------------------------------------------- configs
@pytest.mark.parametrize("qc, message", [
    ({"quant_method": "awq", "bits": 3, "group_size": 128, "zero_point": True, "version": "gemm"},
     r"AWQ checkpoint with bits=3 is not supported; hayabusa runs AWQ with bits 4, zero_point true and version gemm"),
    ({"quant_method": "awq", "w_bit": 4, "q_group_size": 128, "zero_point": True, "version": "GEMV"},
     r"AWQ checkpoint with version='gemv' is not supported"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": False}, r"zero_point=False"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, r"GPTQ checkpoint with bits=3 is not supported; "
                                                             r"hayabusa runs GPTQ with bits 4 or 8"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"},
     r"checkpoint_format='marlin'"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 0}, r"group_size=0"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "lm_head": True}, r"lm_head=True"),
])
def test_unsupported_variants_name_the_field(qc, message):
    with pytest.raises(HayabusaValidationError, match=message) as e:
        get_quantization_config(None, {"quantization_config": qc})
    assert e.value.parameter == "quantization"


def test_configs_detected_with_their_keys():
    awq = get_quantization_config(None, {"quantization_config": {
        "quant_method": "awq", "w_bit": 4, "q_group_size": 64, "zero_point": True, "version": "GEMM",
        "modules_to_not_convert": ["visual"]}})
    assert (awq.name, awq.group_size, awq.modules_to_not_convert) == ("awq", 64, ["visual"])
    hf = get_quantization_config("awq", {"quantization_config": {   # transformers 5's AwqConfig().to_dict() keys
        "quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm",
        "format": "gemm", "sym": True, "desc_act": False, "backend": "auto", "modules_to_not_convert": None}})
    assert hf.group_size == 128
    v1 = get_quantization_config(None, {"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": -1,
                                                                "desc_act": True, "sym": False}})
    v2 = get_quantization_config("gptq_marlin", {"quantization_config": {"quant_method": "gptq", "bits": 8,
                                                                         "group_size": 128, "format": "gptq_v2"}})
    assert (v1.bits, v1.group_size, v1.zero_offset, v2.bits, v2.zero_offset) == (4, -1, 1, 8, 0)
    blocks = get_quantization_config(None, {"quantization_config": {
        "quant_method": "gptq", "bits": 4, "group_size": 128,
        "modules_in_block_to_quantize": [["self_attn.q_proj", "self_attn.k_proj"], ["mlp.down_proj"]]}})
    assert blocks.modules_in_block_to_quantize == ["self_attn.q_proj", "self_attn.k_proj", "mlp.down_proj"]


def _act_order_gptq_with_g_idx(tiny, tmp_path, key: str, edit) -> Path:
    """A GPTQ act-order (g=64) checkpoint of the tiny Llama whose tensor ``key`` (a g_idx) is replaced by
    ``edit(g_idx)``."""
    from safetensors.torch import load_file, save_file

    ckpt = tmp_path / "q"
    pk.write_quantized(tiny("llama"), ckpt, "gptq", group_size=64, desc_act=True)
    state = load_file(str(ckpt / "model.safetensors"))
    state[key] = edit(state[key])
    save_file(state, str(ckpt / "model.safetensors"))
    return ckpt


def test_merged_shards_with_different_g_idx_are_refused(tiny, tmp_path):
    """q/k/v share their input, so GPTQ gives them one act order; a checkpoint where they differ cannot run as
    one merged matrix."""
    ckpt = _act_order_gptq_with_g_idx(tiny, tmp_path, "model.layers.1.self_attn.k_proj.g_idx",
                                      lambda g: g.flip(0).contiguous())
    with pytest.raises(HayabusaValidationError, match=r"shards of model\.layers\.1\.self_attn\.q_proj \(merged "
                                                      r"layer\) have different g_idx"):
        LLM(str(ckpt), device="cpu", max_model_len=64)


def test_uneven_groups_in_g_idx_are_refused(tiny, tmp_path):
    def uneven(g):
        g = (torch.arange(128, dtype=torch.int32) * 2 // 128).roll(5)   # groups of 64 ... then shifted
        g[:3] = 0
        return g

    ckpt = _act_order_gptq_with_g_idx(tiny, tmp_path, "model.layers.0.self_attn.o_proj.g_idx", uneven)
    with pytest.raises(HayabusaValidationError, match=r"o_proj\.g_idx puts \[6\d, 6\d\] rows in its groups; "
                                                      r"hayabusa needs exactly group_size=64"):
        LLM(str(ckpt), device="cpu", max_model_len=64)


def test_modules_in_block_to_quantize_leaves_the_others_float(tiny, tmp_path):
    """GPTQModel's list of quantized modules: the MLP is not in it, so its float weights load as they are."""
    ckpt = tmp_path / "q"
    pk.write_quantized(tiny("llama"), ckpt, "gptq", group_size=128, skip=STORIES_MLP)
    cfg = json.loads((ckpt / "config.json").read_text())
    qc = cfg["quantization_config"]
    del qc["modules_to_not_convert"]
    qc["modules_in_block_to_quantize"] = [["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
                                          ["self_attn.o_proj"]]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    model = LLM(str(ckpt), device="cpu", max_model_len=64).llm_engine.runner.model
    assert type(model.model.layers[0].self_attn.o_proj.quant_method).__name__ == "Gptq4LinearMethod"
    assert model.model.layers[0].mlp.down_proj.weight.dtype == torch.float32


@pytest.mark.cuda
@pytest.mark.parametrize("fmt, kw", [("awq", dict(group_size=64)), ("gptq", dict(group_size=64, desc_act=True)),
                                     ("gptq", dict(group_size=-1, bits=8, sym=True))])
def test_cuda_kernels_run_the_checkpoint(fmt, kw, tiny, tmp_path):
    """On the GPU (Triton int4 / int8 kernels, fp16 activations, CUDA graphs for decode): the layers hold the
    checkpoint's dequantized weights (its fp16 scales kept as they are), and 16 greedy tokens per prompt agree
    with the same checkpoint on CPU in fp32 up to near-ties (each side's token in the other's top-5)."""
    import gc

    ckpt = tmp_path / "q"
    deq = pk.write_quantized(tiny("llama"), ckpt, fmt, **kw)
    gpu = LLM(str(ckpt), device="cuda", dtype="float16", max_model_len=256, kv_cache_memory_bytes=1 << 28)
    layer = gpu.llm_engine.runner.model.model.layers[1].self_attn.qkv_proj
    ref = torch.cat([deq[p] for p in layer.checkpoint_prefixes]).cuda()
    assert torch.allclose(layer.quant_method.dequantized_weight(layer), ref, rtol=1e-6, atol=0)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=5)
    outs = gpu.generate(PROMPTS, params, use_tqdm=False)
    del gpu, layer
    gc.collect()
    torch.cuda.empty_cache()
    cpu = LLM(str(ckpt), device="cpu", max_model_len=256).generate(PROMPTS, params, use_tqdm=False)
    for o, c in zip(outs, cpu):
        a, b = list(o.outputs[0].token_ids), list(c.outputs[0].token_ids)
        if a != b:
            i = next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)
            assert a[i] in c.outputs[0].logprobs[i] and b[i] in o.outputs[0].logprobs[i], (i, a, b)


def test_eval_fidelity_of_a_packed_checkpoint_against_its_original(stories_dir, tmp_path, capsys):
    """``--reference-model``: the reference runs the unquantized original (HF cannot load the packed folder
    without AutoAWQ / GPTQModel, and the hayabusa-bf16 reference on it would be quantized too)."""
    from hayabusa.entrypoints.cli import main

    pk.write_quantized(stories_dir, tmp_path / "q", "gptq", group_size=32, desc_act=True, skip=STORIES_MLP)
    text = tmp_path / "t.txt"
    text.write_text(require_asset(TEXT).read_text(encoding="utf-8")[:3000], encoding="utf-8")
    rc = main(["eval", "--fidelity", "--model", str(tmp_path / "q"), "--reference-model", stories_dir,
               "--text", str(text), "--device", "cpu", "--fidelity-tokens", "256", "--json", str(tmp_path / "r.json")])
    assert rc == 0 and "top-1 agreement" in capsys.readouterr().out
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["num_tokens"] == 256 and 0 < r["mean_kl"] < 0.2 and r["top1_agreement"] > 0.7, r
