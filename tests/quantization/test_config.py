"""Choosing the quantization: the registry, automatic detection from config.json, conflicts, refused variants and
devices. No model weights are needed."""

from __future__ import annotations

import pytest
import torch

from hayabusa.config import EngineArgs
from hayabusa.errors import HayabusaValidationError
from hayabusa.quantization import QUANTIZATION_METHODS, check_device, get_quantization_config, methods_supported_on
from hayabusa.quantization.compressed_tensors import CompressedTensorsConfig
from hayabusa.quantization.fp8 import Fp8Config
from hayabusa.quantization.weight_only import Int4Config, Int8Config

CT_FP8_DYNAMIC = {  # RedHatAI ...-FP8-dynamic (llm-compressor), trimmed to what hayabusa reads
    "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
    "kv_cache_scheme": None, "quantization_status": "compressed",
    "config_groups": {"group_0": {
        "targets": ["Linear"], "output_activations": None,
        "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False},
        "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True,
                              "dynamic": True}}},
}

INT8_WEIGHTS = {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True, "dynamic": False}
INT8_TOKEN = {"num_bits": 8, "type": "int", "strategy": "token", "symmetric": True, "dynamic": True}
CT_INT8_DYNAMIC = {  # RedHatAI ...-quantized.w8a8 (llm-compressor SmoothQuant + GPTQ), trimmed
    "quant_method": "compressed-tensors", "format": "int-quantized", "ignore": ["lm_head"], "kv_cache_scheme": None,
    "quantization_status": "compressed",
    "config_groups": {"group_0": {"targets": ["Linear"], "output_activations": None, "weights": INT8_WEIGHTS,
                                  "input_activations": INT8_TOKEN}},
}


def test_registry_names_are_vllms():
    assert list(QUANTIZATION_METHODS) == ["fp8", "compressed-tensors", "int8", "int4", "w8a8_int8", "awq", "gptq",
                                          "bitsandbytes"]
    assert all(cls.name == name for name, cls in QUANTIZATION_METHODS.items())


def test_argument_alone_gives_the_online_schemes():
    assert get_quantization_config(None, {}) is None
    fp8 = get_quantization_config("FP8", {})
    assert isinstance(fp8, Fp8Config) and not fp8.checkpoint_fp8 and fp8.activation_scheme == "dynamic"
    assert isinstance(get_quantization_config("int8", {}), Int8Config)
    assert get_quantization_config("int4", {}).group_size == 128 and isinstance(get_quantization_config("int4", {}),
                                                                                Int4Config)


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(HayabusaValidationError, match="quantization='fp4' is not a known method; known: fp8, "
                                                      "compressed-tensors, int8, int4, w8a8_int8, awq, gptq, "
                                                      "bitsandbytes"):
        get_quantization_config("fp4", {})
    with pytest.raises(HayabusaValidationError) as e:
        EngineArgs(model="m", quantization="squeezellm").create_engine_config()
    assert e.value.parameter == "quantization" and "known: fp8" in str(e.value)


def test_checkpoint_formats_need_a_checkpoint_in_that_format():
    """awq / gptq / bitsandbytes name a checkpoint format: asked for on an unquantized checkpoint they say so."""
    for name in ("awq", "gptq", "bitsandbytes"):
        with pytest.raises(HayabusaValidationError, match=f"quantization='{name}' needs a checkpoint saved in that "
                                                          "format"):
            get_quantization_config(name, {})
    for alias, name in (("awq_marlin", "awq"), ("GPTQ_Marlin", "gptq")):       # vLLM's names: the user's spelling first
        with pytest.raises(HayabusaValidationError, match=f"quantization='{alias}' \\(the '{name}' format\\): "
                                                          f"quantization='{name}' needs a checkpoint") as e:
            get_quantization_config(alias, {})
        assert e.value.parameter == "quantization" and e.value.value == alias


def test_detected_from_the_checkpoint():
    fp8 = get_quantization_config(None, {"quantization_config": {"quant_method": "fp8",
                                                                 "activation_scheme": "static",
                                                                 "ignored_layers": ["model.layers.0.mlp.down_proj"]}})
    assert isinstance(fp8, Fp8Config) and fp8.checkpoint_fp8 and fp8.activation_scheme == "static"
    assert fp8.ignored_layers == ["model.layers.0.mlp.down_proj"]
    ct = get_quantization_config(None, {"quantization_config": CT_FP8_DYNAMIC})
    assert isinstance(ct, CompressedTensorsConfig) and ct.groups == [(["Linear"], "float", "channel", False)]
    assert ct.ignore == ["lm_head"]
    # the argument may repeat the checkpoint's method
    assert isinstance(get_quantization_config("compressed-tensors", {"quantization_config": CT_FP8_DYNAMIC}),
                      CompressedTensorsConfig)


def test_int8_w8a8_detected_from_compressed_tensors_and_online():
    from hayabusa.quantization.w8a8_int8 import Int8W8A8LinearMethod, W8A8Int8Config

    ct = get_quantization_config(None, {"quantization_config": CT_INT8_DYNAMIC})
    assert isinstance(ct, CompressedTensorsConfig) and ct.groups == [(["Linear"], "int", "channel", False)]
    assert ct.min_capability == (8, 0) and CompressedTensorsConfig.min_capability == (8, 0)
    static = {**CT_INT8_DYNAMIC, "config_groups": {"g": {**CT_INT8_DYNAMIC["config_groups"]["group_0"],
                                                         "weights": {**INT8_WEIGHTS, "strategy": "tensor"},
                                                         "input_activations": {**INT8_TOKEN, "strategy": "tensor",
                                                                               "dynamic": False}}}}
    assert get_quantization_config(None, {"quantization_config": static}).groups == [
        (["Linear"], "int", "tensor", True)]
    online = get_quantization_config("w8a8_int8", {})
    assert isinstance(online, W8A8Int8Config)
    method = online.get_linear_method("model.layers.0.mlp.down_proj", None)
    assert isinstance(method, Int8W8A8LinearMethod) and not method.checkpoint_int8
    with pytest.raises(HayabusaValidationError, match="reads INT8 W8A8 checkpoints in the compressed-tensors format"):
        get_quantization_config(None, {"quantization_config": {"quant_method": "w8a8_int8"}})


def test_argument_that_disagrees_with_the_checkpoint_names_both():
    with pytest.raises(HayabusaValidationError, match=r"quantization='int8' does not match the checkpoint, which "
                                                      r"is quantized with 'compressed-tensors'"):
        get_quantization_config("int8", {"quantization_config": CT_FP8_DYNAMIC})


@pytest.mark.parametrize("qc, message", [
    ({"quant_method": "fp8", "weight_block_size": [128, 128]}, r"block-wise FP8 checkpoints \(weight_block_size="
                                                                 r"\[128, 128\]\) are not supported"),
    ({"quant_method": "fp8", "activation_scheme": "per-group"}, "activation_scheme 'per-group' is not supported"),
    ({**CT_FP8_DYNAMIC, "format": "pack-quantized"}, "format 'pack-quantized'"),
    ({**CT_FP8_DYNAMIC, "kv_cache_scheme": {"num_bits": 8, "type": "int"}}, "kv_cache_scheme"),
    ({**CT_FP8_DYNAMIC, "config_groups": {"g": {**CT_FP8_DYNAMIC["config_groups"]["group_0"],
                                                "weights": {"num_bits": 4, "type": "int", "strategy": "group",
                                                            "group_size": 128}}}},
     "weights of 4 bits of type 'int'"),
    ({**CT_INT8_DYNAMIC, "config_groups": {"g": {**CT_INT8_DYNAMIC["config_groups"]["group_0"],
                                                 "weights": {**INT8_WEIGHTS, "strategy": "group", "group_size": 128}}}},
     "weight strategy 'group'"),
    ({**CT_INT8_DYNAMIC, "config_groups": {"g": {**CT_INT8_DYNAMIC["config_groups"]["group_0"],
                                                 "input_activations": {**INT8_TOKEN, "symmetric": False}}}},
     r"asymmetric input activations \(zero points, symmetric=false\)"),
    ({**CT_INT8_DYNAMIC, "config_groups": {"g": {**CT_INT8_DYNAMIC["config_groups"]["group_0"],
                                                 "weights": {**INT8_WEIGHTS, "symmetric": False}}}},
     "symmetric=False"),
    ({**CT_INT8_DYNAMIC, "config_groups": {"g": {**CT_INT8_DYNAMIC["config_groups"]["group_0"],
                                                 "input_activations": None}}}, r"weight-only int8"),
    ({**CT_INT8_DYNAMIC, "config_groups": {"g": {**CT_INT8_DYNAMIC["config_groups"]["group_0"],
                                                 "input_activations": {**INT8_TOKEN, "type": "float"}}}},
     "input activations of 8 bits of type 'float' with int weights"),
    ({**CT_INT8_DYNAMIC, "format": "float-quantized"}, "format 'float-quantized' for int weights"),
    ({**CT_INT8_DYNAMIC, "config_groups": {"g": {**CT_INT8_DYNAMIC["config_groups"]["group_0"],
                                                 "input_activations": {**INT8_TOKEN, "dynamic": False}}}},
     "input activation strategy 'token' with dynamic=False"),
    ({**CT_FP8_DYNAMIC, "config_groups": {"g": {**CT_FP8_DYNAMIC["config_groups"]["group_0"],
                                                "input_activations": None}}}, "weight-only fp8"),
    ({**CT_FP8_DYNAMIC, "config_groups": {"g": {**CT_FP8_DYNAMIC["config_groups"]["group_0"],
                                                "weights": {"num_bits": 8, "type": "float", "strategy": "block",
                                                            "block_structure": [128, 128]}}}},
     "weight strategy 'block'"),
])
def test_unsupported_checkpoint_variants_are_refused_by_name(qc, message):
    with pytest.raises(HayabusaValidationError, match=message) as e:
        get_quantization_config(None, {"quantization_config": qc})
    assert e.value.parameter == "quantization"


def test_online_only_schemes_refuse_checkpoints_and_checkpoint_schemes_need_one():
    with pytest.raises(HayabusaValidationError, match="quantizes an unquantized checkpoint while loading"):
        get_quantization_config(None, {"quantization_config": {"quant_method": "int4"}})
    with pytest.raises(HayabusaValidationError, match="needs a checkpoint saved in that format"):
        get_quantization_config("compressed-tensors", {})


def test_every_implemented_scheme_runs_on_cpu():
    assert methods_supported_on(torch.device("cpu")) == ["fp8", "compressed-tensors", "int8", "int4", "w8a8_int8",
                                                         "awq", "gptq", "bitsandbytes"]
    for name in ("fp8", "int8", "int4", "w8a8_int8"):
        check_device(get_quantization_config(name, {}), torch.device("cpu"))


def test_fp8_on_a_gpu_without_fp8_names_the_gpu_and_what_runs_there(monkeypatch):
    """An A100 (8.0) has no FP8 tensor cores: fp8 is refused, naming the capability and the schemes that run."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    dev = torch.device("cuda", 0)
    with pytest.raises(HayabusaValidationError) as e:
        check_device(get_quantization_config("fp8", {}), dev)
    msg = str(e.value)
    assert "quantization='fp8' runs on CPU, and CUDA GPUs with compute capability >= 8.9 (Ada, Hopper" in msg
    assert "not on cuda:0 (NVIDIA A100-SXM4-80GB, compute capability 8.0)" in msg
    assert msg.endswith("On this device hayabusa runs: compressed-tensors, int8, int4, w8a8_int8, awq, gptq, "
                        "bitsandbytes.")
    check_device(get_quantization_config("int4", {}), dev)                           # weight-only runs there
    check_device(get_quantization_config("w8a8_int8", {}), dev)                      # int8 tensor cores: 8.0
    check_device(get_quantization_config(None, {"quantization_config": CT_INT8_DYNAMIC}), dev)
    with pytest.raises(HayabusaValidationError, match=r"quantization='compressed-tensors' runs on CPU, and CUDA "
                                                      r"GPUs with compute capability >= 8.9 \(Ada, Hopper"):
        check_device(get_quantization_config(None, {"quantization_config": CT_FP8_DYNAMIC}), dev)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    with pytest.raises(HayabusaValidationError, match=r"compute capability >= 8.0 \(Ampere"):
        check_device(get_quantization_config("w8a8_int8", {}), dev)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_device(get_quantization_config("fp8", {}), dev)


def test_plan_notes_say_what_runs():
    from hayabusa.eval.plan import PlanInputs, load_config, make_plan

    cfg = load_config("qwen2.5-7b-shape")
    int4 = make_plan(cfg, PlanInputs(quantization="int4"), gpu_memory_gib=80)
    assert int4["weight_bits"] == 4.25 and "quantization=int4 is planned at 4.25 bits per linear weight (hayabusa " \
                                           "runs it)." in int4["notes"]
    awq = make_plan(cfg, PlanInputs(quantization="awq"), gpu_memory_gib=80)
    assert any("quantization=awq is planned at 4.25 bits per linear weight (hayabusa runs it)." in n
               for n in awq["notes"])
    sq = make_plan(cfg, PlanInputs(quantization="smoothquant"), gpu_memory_gib=80)
    assert any("hayabusa does not run it yet (it runs fp8, compressed-tensors, int8, int4, w8a8_int8, awq, gptq, "
               "bitsandbytes)" in n for n in sq["notes"])
    w8a8 = make_plan(cfg, PlanInputs(quantization="w8a8_int8"), gpu_memory_gib=80)
    assert w8a8["weight_bits"] == 8 and any("quantization=w8a8_int8 is planned at 8.00 bits per linear weight "
                                            "(hayabusa runs it)." in n for n in w8a8["notes"])


def test_fp8_kv_cache_scheme_is_accepted():
    """An fp8 kv_cache_scheme carries per-layer k/v scales, which the loader puts into the Attention layers."""
    qc = get_quantization_config(None, {"quantization_config": {**CT_FP8_DYNAMIC, "kv_cache_scheme": {
        "num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}}})
    assert qc is not None and qc.name == "compressed-tensors"


def test_modules_to_not_convert_match_by_substring_as_autoawq_and_vllm():
    """AutoAWQ / GPTQ / bitsandbytes list modules by any part of their name ("mlp", "visual"); compressed-tensors'
    ``ignore`` keeps whole-name matching (so "mlp" there does not silently cover every MLP projection)."""
    from torch import nn

    from hayabusa.quantization.base import is_ignored

    layer = nn.Module()
    layer.checkpoint_prefixes = ["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"]
    assert is_ignored("model.layers.0.mlp.gate_up_proj", layer, ["mlp"], substring=True)
    assert not is_ignored("model.layers.0.mlp.gate_up_proj", layer, ["mlp"])
    assert not is_ignored("model.layers.0.mlp.gate_up_proj", layer, ["self_attn"], substring=True)
    with pytest.raises(HayabusaValidationError, match="merged matrix"):
        is_ignored("model.layers.0.mlp.gate_up_proj", layer, ["gate_proj"], substring=True)
