"""Quantized models end to end on CPU: online fp8 / int8 / int4 against the unquantized model (teacher-forced
top-1 agreement and mean KL over a fixed text, bounds from measured values), FP8 checkpoints written here in the
"fp8" and compressed-tensors formats, the lm_head left unquantized, GPT-2 (Conv1D weights) with int8, and
``hayabusa eval --fidelity`` per scheme.

The fixed text is the first 1024 (stories260K) or 512 (random fixtures) tokens of botchan.plain.txt. stories260K
is trained (TinyStories); the tiny fixtures have random weights and nearly flat next-token distributions over
100k+ tokens, so their top-1 agreement mostly measures near-ties: for them the bounds are on KL and on the
ordering int8 < fp8 < int4.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from hayabusa import LLM, SamplingParams
from hayabusa.errors import HayabusaValidationError
from hayabusa.eval.fidelity import engine_hidden_fn, run_fidelity
from hayabusa.quantization.fp8 import FP8_DTYPE, FP8_MAX, quantize_fp8_rows
from tests.quantization._calibration import LINEAR_KEYS, calibration_text, input_amax

def _fidelity(model: str, tokens: int, **engine_args):
    """hayabusa with engine_args vs the same checkpoint unquantized in float32, teacher-forced on the text."""
    return run_fidelity(model, calibration_text(), {"device": "cpu", **engine_args}, reference="hayabusa-bf16",
                        reference_dtype="float32", max_text_tokens=tokens)


def _agreement(llm: LLM, ref: LLM, tokens: int) -> tuple[float, float]:
    """(top-1 agreement, mean KL(ref || llm)) of two engines' next-token distributions over the text (chunks of
    512 tokens through each engine's paged KV cache): for checkpoints whose reference is another folder."""
    from hayabusa.eval.fidelity import _engine_logits_fn, chunk_text, compare_chunks

    ids = llm.get_tokenizer()(calibration_text()).input_ids[:tokens]
    chunks, nxt = chunk_text(ids, 512)
    s = compare_chunks(chunks, nxt, _engine_logits_fn(llm), _engine_logits_fn(ref))
    return s["top1"] / s["n"], s["kl_sum"] / s["n"]


# ---------------------------------------------------------------------------------------------- online schemes
# measured on CPU (torch 2.13): fp8 top-1 0.898, KL 0.028; int8 0.983, 0.0011; int4 0.653, 0.27
STORIES_BOUNDS = {"fp8": (0.86, 0.045), "int8": (0.96, 0.003), "int4": (0.58, 0.40)}


@pytest.mark.parametrize("scheme", ["fp8", "int8", "int4"])
def test_online_schemes_on_stories260k(stories_dir, scheme):
    top1, kl = STORIES_BOUNDS[scheme]
    r = _fidelity(stories_dir, 1024, quantization=scheme)
    assert r.num_tokens == 1024 and r.dtype == "float32" and r.reference_dtype == "float32"
    assert r.top1_agreement >= top1 and r.mean_kl <= kl, (r.top1_agreement, r.mean_kl)


def test_int8_greedy_continuations_equal_the_unquantized_model(stories_dir):
    """W8A16 moves stories260K's logits by ~1e-3 nats: 32 greedy tokens of each prompt are unchanged."""
    prompts = ["Once upon a time", "The little dog", "Tom and Lily went to the park"]
    params = SamplingParams(temperature=0.0, max_tokens=32)
    base = LLM(stories_dir, device="cpu").generate(prompts, params, use_tqdm=False)
    q = LLM(stories_dir, device="cpu", quantization="int8").generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in q] == [o.outputs[0].token_ids for o in base]


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2"])
def test_online_schemes_on_random_fixtures(fixture, request):
    """measured KL (llama / qwen2): int8 1.8e-3 / 1.4e-3, fp8 6.1e-2 / 4.5e-2, int4 0.36 / 0.32."""
    model = request.getfixturevalue(fixture)
    kl = {s: _fidelity(model, 512, quantization=s).mean_kl for s in ("int8", "fp8", "int4")}
    assert kl["int8"] < 4e-3 and kl["fp8"] < 0.1 and kl["int4"] < 0.6, kl
    assert kl["int8"] < kl["fp8"] < kl["int4"], kl


def test_lm_head_and_embeddings_stay_unquantized(tiny_llama):
    """tiny_llama has an untied lm_head: it keeps its float weight while every decoder Linear is int8."""
    from hayabusa.model.layers.linear import Linear
    from hayabusa.quantization import UnquantizedLinearMethod
    from hayabusa.quantization.weight_only import Int8WeightOnlyLinearMethod

    llm = LLM(tiny_llama, device="cpu", quantization="int8", max_model_len=64)
    model = llm.llm_engine.runner.model
    assert llm.llm_engine.config.model_config.quantization == "int8"
    linears = {n: m for n, m in model.named_modules() if isinstance(m, Linear)}
    assert isinstance(linears.pop("lm_head").quant_method, UnquantizedLinearMethod)
    assert model.lm_head.weight.dtype == torch.float32 and model.model.embed_tokens.weight.dtype == torch.float32
    assert len(linears) == 2 * 4                                # qkv, o, gate_up, down per layer
    for m in linears.values():
        assert isinstance(m.quant_method, Int8WeightOnlyLinearMethod) and m.qweight.dtype == torch.int8
        assert m.weight is None                                  # the float copy is gone
    assert model.model.layers[0].self_attn.qkv_proj.checkpoint_prefixes == [
        "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj"]


@pytest.fixture(scope="module")
def tiny_gpt2(tmp_path_factory) -> str:
    from tests.models.test_architectures import _build

    return _build("gpt2", tmp_path_factory.mktemp("gpt2"))


def test_gpt2_conv1d_weights_with_int8(tiny_gpt2):
    """GPT-2 stores c_attn / c_fc / c_proj as Conv1D [in, out]; they are transposed at load, then quantized: each
    dequantized weight is within half an int8 step of HF's transposed weight."""
    from safetensors.torch import load_file

    path = tiny_gpt2
    llm = LLM(path, device="cpu", quantization="int8", max_model_len=64)
    block = llm.llm_engine.runner.model.transformer.h[0]
    hf = load_file(str(Path(path) / "model.safetensors"))
    for name, layer in (("attn.c_attn", block.attn.c_attn), ("mlp.c_fc", block.mlp.c_fc)):
        w = hf[f"transformer.h.0.{name}.weight"].t()                 # [out, in]
        deq = layer.qweight.float() * layer.scales[:, None]
        assert deq.shape == w.shape
        assert torch.all((deq - w).abs() <= layer.scales[:, None] / 2 + 1e-6)


# measured top-1 / KL over 512 tokens: int8 1.000 / 8.5e-6, fp8 0.986 / 2.7e-4, int4 0.994 / 1.5e-3
GPT2_BOUNDS = {"int8": (0.98, 1e-4), "fp8": (0.95, 1e-3), "int4": (0.95, 5e-3)}


@pytest.mark.parametrize("scheme", ["int8", "fp8", "int4"])
def test_gpt2_online_schemes(tiny_gpt2, scheme):
    top1, kl = GPT2_BOUNDS[scheme]
    r = _fidelity(tiny_gpt2, 512, quantization=scheme, max_model_len=256)
    assert r.top1_agreement >= top1 and r.mean_kl <= kl, (r.top1_agreement, r.mean_kl)


# ---------------------------------------------------------------------------------------------- FP8 checkpoints
def _write_fp8_checkpoint(src: str, out: Path, qc: dict, per_channel: bool, static: bool,
                          keep_float: tuple[str, ...] = ()) -> str:
    """stories260K re-saved with e4m3 linear weights: per channel ([N, 1] scales) or per checkpoint tensor
    (scalar), plus static input scales calibrated as amax / 448 of each layer's input over the text."""
    from safetensors.torch import load_file, save_file

    out.mkdir()
    for f in Path(src).iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, out / f.name)
    amax = input_amax(src) if static else {}
    tensors = {}
    for key, t in load_file(str(Path(src) / "model.safetensors")).items():
        module = key[: -len(".weight")]
        if not key.endswith(tuple(f"{k}.weight" for k in LINEAR_KEYS)) or module in keep_float:
            tensors[key] = t
            continue
        if per_channel:
            q, s = quantize_fp8_rows(t)                                   # [N, K], [N, 1]
        else:
            s = (t.abs().max() / FP8_MAX).reshape(())
            q = (t / s).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        tensors[key], tensors[module + ".weight_scale"] = q, s
        if static:
            tensors[module + ".input_scale"] = (amax[module] / FP8_MAX).reshape(())
    save_file(tensors, str(out / "model.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = qc
    (out / "config.json").write_text(json.dumps(cfg))
    return str(out)


def _ct_config(strategy: str, dynamic: bool, ignore: list[str]) -> dict:
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head", *ignore],
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True,
                            "dynamic": False},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token" if dynamic else "tensor",
                                      "symmetric": True, "dynamic": dynamic}}}}


def test_compressed_tensors_per_channel_equals_online_fp8(stories_dir, tmp_path):
    """A per-channel dynamic compressed-tensors checkpoint made with the same rounding as online quantization is
    bit-for-bit the online fp8 model: detected from config.json, same weights, same hidden states."""
    ckpt = _write_fp8_checkpoint(stories_dir, tmp_path / "ct", _ct_config("channel", True, []), True, False)
    loaded = LLM(ckpt, device="cpu", max_model_len=128)
    online = LLM(stories_dir, device="cpu", quantization="fp8", max_model_len=128)
    assert loaded.llm_engine.config.model_config.quantization == "compressed-tensors"
    a, b = loaded.llm_engine.runner.model, online.llm_engine.runner.model
    qa, qb = a.model.layers[2].mlp.gate_up_proj, b.model.layers[2].mlp.gate_up_proj
    assert torch.equal(qa.weight.view(torch.uint8), qb.weight.view(torch.uint8))
    assert torch.equal(qa.weight_scale, qb.weight_scale) and qa.weight_scale.shape == (2 * 172,)
    ids = loaded.get_tokenizer()(calibration_text()).input_ids[:100]
    assert torch.equal(engine_hidden_fn(loaded)(ids), engine_hidden_fn(online)(ids))


# measured top-1 / KL vs the fp32 stories260K over 1024 tokens (layer 0's down_proj kept in fp32): per-tensor
# weights with dynamic activations 0.898 / 0.029, with static input scales 0.891 / 0.032 (both formats)
@pytest.mark.parametrize("fmt, static", [("fp8", False), ("fp8", True), ("compressed-tensors", True)])
def test_fp8_checkpoints_per_tensor(stories_dir, tmp_path, fmt, static):
    keep = ("model.layers.0.mlp.down_proj",)
    if fmt == "fp8":
        qc = {"quant_method": "fp8", "activation_scheme": "static" if static else "dynamic",
              "ignored_layers": list(keep)}
    else:
        qc = _ct_config("tensor", not static, list(keep))
    ckpt = _write_fp8_checkpoint(stories_dir, tmp_path / "ckpt", qc, per_channel=False, static=static,
                                 keep_float=keep)
    llm = LLM(ckpt, device="cpu", max_model_len=512)
    assert llm.llm_engine.config.model_config.quantization == fmt
    model = llm.llm_engine.runner.model
    layer0 = model.model.layers[0]
    assert layer0.mlp.down_proj.weight.dtype == torch.float32               # the ignored layer
    qkv = layer0.self_attn.qkv_proj
    assert qkv.weight.dtype == FP8_DTYPE and qkv.weight_scale.shape == (64 + 32 + 32,)
    assert len(set(qkv.weight_scale.tolist())) == 3                          # q, k, v each keep their own scale
    assert (qkv.input_scale is not None) == static
    top1, kl = _agreement(llm, LLM(stories_dir, device="cpu", max_model_len=512), 1024)
    assert top1 >= 0.85 and kl <= 0.05, (top1, kl)


def test_argument_conflicting_with_an_fp8_checkpoint(stories_dir, tmp_path):
    ckpt = _write_fp8_checkpoint(stories_dir, tmp_path / "fp8", {"quant_method": "fp8"}, False, False)
    with pytest.raises(HayabusaValidationError, match="quantization='int4' does not match the checkpoint, which is "
                                                      "quantized with 'fp8'"):
        LLM(ckpt, device="cpu", quantization="int4")
    assert LLM(ckpt, device="cpu", quantization="fp8", max_model_len=64).llm_engine.config.model_config \
        .quant_config.checkpoint_fp8


def test_fidelity_refuses_a_quantized_reference(stories_dir, tmp_path):
    """On an FP8 checkpoint the hayabusa-bf16 reference would be the same quantized model (KL 0 by construction)."""
    ckpt = _write_fp8_checkpoint(stories_dir, tmp_path / "fp8", {"quant_method": "fp8"}, False, False)
    with pytest.raises(HayabusaValidationError, match=r"is quantized \(fp8\), so the hayabusa-bf16 reference would run "
                                                      "quantized too"):
        _fidelity(ckpt, 64)


def test_fp8_checkpoint_without_its_config_is_refused(stories_dir, tmp_path):
    """The same e4m3 tensors without quantization_config in config.json: the loader says what is wrong instead of
    casting fp8 into float weights or ignoring the scales."""
    ckpt = _write_fp8_checkpoint(stories_dir, tmp_path / "fp8", {"quant_method": "fp8"}, False, False)
    cfg = json.loads((Path(ckpt) / "config.json").read_text())
    del cfg["quantization_config"]
    (Path(ckpt) / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(HayabusaValidationError, match="is float8_e4m3fn; the model parameter is float32"):
        LLM(ckpt, device="cpu", max_model_len=64)


# ---------------------------------------------------------------------------------------------- the CLI
@pytest.mark.parametrize("scheme", ["fp8", "int8", "int4"])
def test_eval_fidelity_cli_per_scheme(stories_dir, scheme, tmp_path, capsys):
    from hayabusa.entrypoints.cli import main

    text = tmp_path / "t.txt"
    text.write_text(calibration_text()[:3000], encoding="utf-8")
    rc = main(["eval", "--fidelity", "--model", stories_dir, "--text", str(text), "--device", "cpu",
               "--quantization", scheme, "--fidelity-tokens", "256"])
    out = capsys.readouterr().out
    assert rc == 0 and "top-1 agreement" in out and "mean KL" in out
