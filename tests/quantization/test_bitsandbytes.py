"""bitsandbytes checkpoints written by the tests: 8-bit (int8 weight + SCB, the LLM.int8() row format) runs on
hayabusa's int8 kernel without the bitsandbytes package; 4-bit NF4 / FP4 (with and without double quantization)
needs it and skips, saying so, where it is not installed. Each checks the engine's weights against the test's own
dequantization and greedy output against HF Transformers on a float checkpoint of those weights."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from hayabusa import LLM
from hayabusa.errors import HayabusaValidationError
from hayabusa.quantization import get_quantization_config
from tests.quantization import _packers as pk
from tests.quantization.test_awq_gptq import _check_against_hf, _check_layers, tiny  # noqa: F401  (fixture)

NEEDS_BNB = "bitsandbytes is not installed (pip install bitsandbytes): the 4-bit format runs through it"


def _bnb():
    try:
        import bitsandbytes
    except Exception:   # ImportError, or a native library that fails to load
        pytest.skip(NEEDS_BNB)
    return bitsandbytes


def test_8bit_checkpoint_runs_on_the_int8_kernel(tiny, tmp_path):
    deq = pk.write_bnb_8bit(tiny("qwen2"), tmp_path / "q", dequantized_out=tmp_path / "deq")
    llm = LLM(str(tmp_path / "q"), device="cpu", max_model_len=256)
    assert llm.llm_engine.config.model_config.quantization == "bitsandbytes"
    assert _check_layers(llm, deq, "Bnb8bitLinearMethod") == 8
    qkv = llm.llm_engine.runner.model.model.layers[0].self_attn.qkv_proj
    assert qkv.qweight.dtype == torch.int8 and qkv.qweight.shape == (128 + 64 + 64, 128)
    _check_against_hf(str(tmp_path / "q"), str(tmp_path / "deq"), llm)


def test_8bit_column_formats_are_refused(tiny, tmp_path):
    from safetensors.torch import load_file, save_file

    pk.write_bnb_8bit(tiny("llama"), tmp_path / "q")
    state = load_file(str(tmp_path / "q" / "model.safetensors"))
    state["model.layers.0.mlp.down_proj.weight_format"] = torch.tensor(2, dtype=torch.uint8)
    save_file(state, str(tmp_path / "q" / "model.safetensors"))
    with pytest.raises(HayabusaValidationError, match="weight_format='col_turing' is not supported"):
        LLM(str(tmp_path / "q"), device="cpu", max_model_len=64)


def _write_4bit(src: str, out: Path, quant_type: str, double_quant: bool, own_packer: bool) -> dict:
    """A 4-bit checkpoint: NF4 by the test's packer (``own_packer``), or bitsandbytes' quantize_4bit (FP4, double
    quantization). Returns {module: W [N, K] fp32} decoded by the test's ``bnb4_dequant``, not by bitsandbytes."""
    from safetensors.torch import load_file

    state = load_file(str(Path(src) / "model.safetensors"))
    tensors, deq_state, deq = dict(state), dict(state), {}
    for key in pk._linear_keys(state, ()):
        module, w = key[: -len(".weight")], state[key].float()
        if own_packer:
            pieces = pk.nf4_quantize(w)
        else:
            import bitsandbytes.functional as bf

            packed, qs = bf.quantize_4bit(w, blocksize=64, compress_statistics=double_quant, quant_type=quant_type)
            pieces = {"weight": packed, **qs.as_dict(packed=True)}
        del tensors[key]
        for name, t in pieces.items():
            tensors[key if name == "weight" else f"{key}.{name}"] = t
        plain = {("quant_state" if n.startswith("quant_state.") else n): t for n, t in pieces.items()}
        deq[module] = deq_state[key] = pk.bnb4_dequant(plain, tuple(w.shape))
    qc = {"quant_method": "bitsandbytes", "load_in_4bit": True, "load_in_8bit": False,
          "bnb_4bit_quant_type": quant_type, "bnb_4bit_use_double_quant": double_quant,
          "bnb_4bit_compute_dtype": "float32", "bnb_4bit_quant_storage": "uint8"}
    pk._save(src, out, tensors, qc)
    pk._save(src, out.parent / (out.name + "_deq"), deq_state, None)
    return deq


@pytest.mark.parametrize("quant_type, double_quant, own_packer", [("nf4", False, True), ("nf4", True, False),
                                                                  ("fp4", False, False)])
def test_4bit_checkpoint_through_bitsandbytes(quant_type, double_quant, own_packer, tiny, tmp_path):
    _bnb()
    deq = _write_4bit(tiny("llama"), tmp_path / "q", quant_type, double_quant, own_packer)
    llm = LLM(str(tmp_path / "q"), device="cpu", max_model_len=256)
    assert _check_layers(llm, deq, "Bnb4bitLinearMethod") == 8
    qkv = llm.llm_engine.runner.model.model.layers[1].self_attn.qkv_proj
    assert [r[1] - r[0] for r in qkv.bnb_ranges] == [128 * 128 // 2, 64 * 128 // 2, 64 * 128 // 2]   # q, k, v
    _check_against_hf(str(tmp_path / "q"), str(tmp_path / "q_deq"), llm)


def test_4bit_without_bitsandbytes_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)            # import bitsandbytes -> ImportError
    qc = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}
    with pytest.raises(HayabusaValidationError, match="pip install bitsandbytes"):
        get_quantization_config(None, {"quantization_config": qc})
    eight = get_quantization_config(None, {"quantization_config": {"quant_method": "bitsandbytes",
                                                                   "load_in_8bit": True}})
    assert not eight.load_in_4bit                                      # 8-bit needs no bitsandbytes


@pytest.mark.parametrize("qc, message", [
    ({"load_in_4bit": False, "load_in_8bit": False}, r"load_in_4bit / load_in_8bit=\(False, False\)"),
    ({"load_in_4bit": True, "bnb_4bit_quant_type": "int4"}, "bnb_4bit_quant_type='int4'"),
    ({"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_quant_storage": "bfloat16"},
     "bnb_4bit_quant_storage='bfloat16'"),
    ({"load_in_8bit": True, "llm_int8_has_fp16_weight": True}, "llm_int8_has_fp16_weight=True"),
])
def test_unsupported_variants_name_the_field(qc, message):
    with pytest.raises(HayabusaValidationError, match=message):
        get_quantization_config(None, {"quantization_config": {"quant_method": "bitsandbytes", **qc}})


def test_checkpoint_keys_become_parameter_names():
    cfg = get_quantization_config(None, {"quantization_config": {"quant_method": "bitsandbytes",
                                                                 "load_in_8bit": True}})
    pre = "model.layers.0.self_attn.q_proj."
    assert cfg.checkpoint_key(pre + "weight.absmax") == pre + "weight_absmax"
    assert cfg.checkpoint_key(pre + "weight.nested_quant_map") == pre + "weight_nested_quant_map"
    assert cfg.checkpoint_key(pre + "weight.quant_state.bitsandbytes__nf4") == pre + "weight_quant_state"
    for unchanged in (pre + "weight", pre + "SCB", pre + "weight_format", "model.embed_tokens.weight"):
        assert cfg.checkpoint_key(unchanged) == unchanged


def test_nf4_table_is_qlora_and_the_stored_map():
    """The packer's NF4 table (QLoRA appendix E) is the one bitsandbytes stores in every NF4 checkpoint."""
    bnb = _bnb()
    from bitsandbytes.functional import get_4bit_type

    assert torch.equal(get_4bit_type("nf4", device="cpu"), torch.tensor(pk.NF4))
    assert json.loads(bytes(pk.nf4_quantize(torch.randn(4, 64))["quant_state.bitsandbytes__nf4"].tolist()))[
        "blocksize"] == 64 and bnb is not None
