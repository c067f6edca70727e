"""hayabusa plan: the numbers for qwen2.5-7b-shape worked out by hand, parameter counts against the real HF
modules (built on the meta device), quantization / KV dtype / TP arithmetic, advice when nothing fits, the CLI,
and (on a GPU) agreement with the engine's profiled KV capacity."""

from __future__ import annotations

import json

import pytest
import torch

from hayabusa.eval.plan import GPUS, NON_TORCH_BYTES, PlanInputs, count_params, load_config, make_plan

GiB = 2**30


def test_qwen25_7b_shape_by_hand():
    # qwen2.5-7b-shape: hidden 3584, intermediate 18944, 28 layers, 28 heads, 4 kv heads (head dim 3584/28 = 128),
    # vocab 152064, untied, q/k/v biases, bf16, max_position_embeddings 32768.
    h, i, L, d, kv, V = 3584, 18944, 28, 128, 4, 152064
    attn = h * h + 2 * h * (kv * d) + h * h            # q, k, v, o = 12,845,056 + 3,670,016 + 12,845,056
    assert attn == 29_360_128
    bias = h + 2 * kv * d                              # q, k, v biases = 4,608
    mlp = 3 * h * i                                    # gate, up, down = 203,685,888
    norms = 2 * h                                      # two RMSNorms = 7,168
    per_layer = attn + bias + mlp + norms
    assert per_layer == 233_057_792
    embeddings = 2 * V * h                             # embed_tokens + lm_head (untied) = 1,089,994,752
    params = L * per_layer + h + embeddings            # + final norm
    assert params == 7_615_616_512
    weight_bytes = 2 * params                          # bf16
    assert weight_bytes == 15_231_233_024
    kv_per_token = 2 * L * kv * d * 2                  # K and V x layers x kv heads x head dim x 2 bytes
    assert kv_per_token == 57_344

    # 80 GiB GPU, gpu_memory_utilization 0.9, defaults max_num_seqs 256, max_num_batched_tokens 8192, block 16
    T, R = 8192, 256
    act_layer = T * (2 * h + h + 2 * kv * d + 3 * i) * 2          # one layer's live tensors for 8192 tokens
    act_logits = T * h * 2 + R * V * (2 + 4 + 4 + 8)                 # hidden + logits bf16/fp32 + sort values/ids
    activations = max(act_layer, act_logits)
    assert (act_layer, act_logits, activations) == (1_124_073_472, 759_431_168, 1_124_073_472)
    budget = int(80 * GiB * 0.9)                                     # 77,309,411,328
    kv_bytes = budget - weight_bytes - activations - 1 * GiB         # 59,880,363,008
    assert kv_bytes == 59_880_363_008
    blocks = kv_bytes // (kv_per_token * 16)                         # 917,504 bytes per block
    tokens = blocks * 16
    assert (blocks, tokens, tokens // 32768) == (65_264, 1_044_224, 31)

    plan = make_plan(load_config("qwen2.5-7b-shape"), PlanInputs(), gpu_memory_gib=80)
    assert plan["params"] == params and plan["weight_bytes"] == weight_bytes
    assert plan["kv_bytes_per_token"] == kv_per_token and plan["activation_bytes"] == activations
    assert plan["overhead_bytes"] == NON_TORCH_BYTES == GiB
    assert plan["max_model_len"] == 32768 and plan["kv_cache_bytes"] == kv_bytes
    assert plan["max_num_tokens"] == 1_044_224 and plan["max_num_seqs_at_max_model_len"] == 31
    assert plan["fits"] and "31 sequences" in plan["advice"][0]


def test_quantization_kv_dtype_and_tp_arithmetic():
    cfg = load_config("qwen2.5-7b-shape")
    p = count_params(cfg)
    base = make_plan(cfg, PlanInputs(), gpu_memory_gib=80)
    awq = make_plan(cfg, PlanInputs(quantization="awq"), gpu_memory_gib=80)
    # AWQ in hayabusa's memory: linear weights at 4 bits + a 16-bit scale and a 16-bit zero per 128 weights (the
    # int4 kernel's layout); the rest stays bf16
    assert awq["weight_bytes"] == int(p["linear"] * (4 + 32 / 128) / 8 + (p["total"] - p["linear"]) * 2)
    assert awq["max_num_tokens"] > base["max_num_tokens"] and any("quantization" in n for n in awq["notes"])
    fp8kv = make_plan(cfg, PlanInputs(kv_cache_dtype="fp8"), gpu_memory_gib=80)
    assert fp8kv["kv_bytes_per_token"] == base["kv_bytes_per_token"] // 2
    assert any("kv_cache_dtype=fp8" in n and "hayabusa runs it" in n for n in fp8kv["notes"])
    int8kv = make_plan(cfg, PlanInputs(kv_cache_dtype="int8"), gpu_memory_gib=80)
    assert any("does not run it" in n for n in int8kv["notes"])
    tp2 = make_plan(cfg, PlanInputs(tp=2), gpu_memory_gib=80)
    assert tp2["weight_bytes_per_gpu"] == base["weight_bytes"] // 2
    assert tp2["kv_bytes_per_token_per_gpu"] == base["kv_bytes_per_token"] // 2      # 4 kv heads -> 2 per GPU


def test_does_not_fit_gives_advice():
    cfg = load_config("qwen2.5-7b-shape")
    t4 = make_plan(cfg, PlanInputs(max_model_len=8192), gpu="T4")
    assert not t4["weights_fit"] and not t4["fits"] and t4["max_num_tokens"] == 0
    text = " ".join(t4["advice"])
    assert "quantization=fp8" in text and "tensor_parallel_size=2" in text and "float16" in text
    l4 = make_plan(load_config("llama-3-8b-shape"), PlanInputs(), gpu="l4")          # 32768 tokens do not fit
    assert l4["weights_fit"] and not l4["fits"] and l4["gpu"] == "L4"
    text = " ".join(l4["advice"])
    assert f"max_model_len={l4['max_num_tokens'] // 16 * 16}" in text and "kv_cache_dtype=fp8" in text
    assert {g["gpu"] for g in l4["gpus"]} == set(GPUS)


@pytest.mark.parametrize("name", ["qwen2.5-0.5b-shape", "llama-3-8b-shape", "opt-125m-shape"])
def test_param_count_matches_hf_modules(name):
    from transformers import AutoModelForCausalLM

    cfg = load_config(name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    assert count_params(cfg)["total"] == sum(p.numel() for p in model.parameters())   # tied weights once


@pytest.mark.parametrize("variant", ["350m", "plain"])
def test_param_count_of_opt_layouts(variant, tmp_path):
    """OPT's post-LN layout with project_in / project_out (opt-350m) and one without biases, LayerNorm affines or
    final LayerNorm, with its own lm_head."""
    from transformers import AutoModelForCausalLM

    from tests.models._opt import save_tiny_opt

    cfg = load_config(save_tiny_opt(tmp_path, variant))
    with torch.device("meta"):
        n = sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters())
    assert count_params(cfg)["total"] == n


def test_plan_reads_folders_and_the_cli_json(stories_dir, tiny_qwen2, capsys):
    from transformers import AutoModelForCausalLM

    from hayabusa.entrypoints.cli import main

    for model in (stories_dir, tiny_qwen2):
        cfg = load_config(model)
        with torch.device("meta"):
            n = sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters())
        assert count_params(cfg)["total"] == n
    assert main(["plan", "--model", stories_dir, "--gpu", "H200", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    for key in ("weight_bytes", "kv_bytes_per_token", "max_num_tokens", "max_num_seqs_at_max_model_len"):
        assert isinstance(plan[key], int)
    assert plan["dtype"] == "bfloat16" and plan["kv_bytes_per_token"] == 2 * 5 * 4 * 8 * 2   # fp32 ckpt -> bf16
    assert main(["plan", "--model", stories_dir, "--gpu", "V100"]) == 2
    assert "unknown GPU" in capsys.readouterr().err


FIT_FIELDS = ("gpu_memory_bytes", "budget_bytes", "kv_cache_bytes", "max_num_tokens", "max_num_seqs_at_max_model_len",
              "weights_fit", "fits")


def test_plan_json_without_a_gpu_says_fits_are_per_gpu(monkeypatch, capsys):
    """No --gpu and no CUDA device: no null fit fields at the top level (null reads as "does not fit"); a field
    says the fits are per GPU in "gpus", and "fits_on" names the GPUs where the model fits as configured."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    from hayabusa.entrypoints.cli import main

    assert main(["plan", "--model", "llama-3-8b-shape", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["gpu"] is None and not any(k in plan for k in FIT_FIELDS)
    assert plan["fit_scope"] == "per_gpu" and '"gpus"' in plan["fit_note"] and "--gpu" in plan["fit_note"]
    assert {k for g in plan["gpus"] for k in FIT_FIELDS} == set(FIT_FIELDS)
    fits_on = [g["gpu"] for g in plan["gpus"] if g["fits"]]
    assert plan["fits_on"] == fits_on == ["RTX3090", "A100-80G", "H100", "H200"]
    assert plan["advice"] == []
    assert main(["plan", "--model", "llama-3-8b-shape"]) == 0                     # the text names the choice too
    assert "pick one with --gpu NAME" in capsys.readouterr().out
    assert main(["plan", "--model", "llama-3-8b-shape", "--gpu", "L4", "--json"]) == 0   # one GPU: fields on top
    plan = json.loads(capsys.readouterr().out)
    assert plan["fit_scope"] == "gpu" and "fit_note" not in plan and all(k in plan for k in FIT_FIELDS)
    assert plan["fits"] is False and plan["fits_on"] == ["RTX3090", "A100-80G", "H100", "H200"]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8", "fp8_e5m2"])
def test_plan_kv_bytes_match_the_engine(tiny_qwen2, kv_cache_dtype):
    """plan's KV bytes per token and the engine's KV sizing agree for every kv_cache_dtype the engine runs."""
    from hayabusa.config import EngineArgs
    from hayabusa.worker.kv_cache import bytes_per_token

    plan = make_plan(load_config(tiny_qwen2), PlanInputs(dtype="bfloat16", kv_cache_dtype=kv_cache_dtype),
                     gpu_memory_gib=16)
    cfg = EngineArgs(model=tiny_qwen2, dtype="bfloat16", kv_cache_dtype=kv_cache_dtype).create_engine_config()
    assert plan["kv_bytes_per_token"] == bytes_per_token(cfg) == 2 * 2 * 2 * 16 * (2 if kv_cache_dtype == "auto" else 1)


@pytest.mark.cuda
@pytest.mark.parametrize("which", ["tiny_qwen2", "qwen2.5-0.5b-shape"])
def test_plan_matches_profiled_kv_capacity(which, tiny_qwen2, tmp_path):
    import gc

    from hayabusa import LLM

    gc.collect()  # an engine of an earlier test may still hold GPU memory until its cycles are collected
    torch.cuda.empty_cache()
    if which == "tiny_qwen2":
        model = tiny_qwen2
    else:
        from hayabusa.bench.models import make_model

        model = str(tmp_path / which)
        make_model(which, model)
    max_len = 512 if which == "tiny_qwen2" else 4096   # the tiny checkpoint's max_position_embeddings is 512
    total = torch.cuda.get_device_properties(0).total_memory
    plan = make_plan(load_config(model), PlanInputs(max_model_len=max_len), gpu_memory_gib=total / GiB)
    llm = LLM(model, max_model_len=max_len, gpu_memory_utilization=0.9, skip_tokenizer_init=which != "tiny_qwen2")
    got = llm.llm_engine.kv_cache_capacity_tokens
    print(f"{which}: plan {plan['max_num_tokens']} tokens (activations {plan['activation_bytes'] / GiB:.2f} GiB + "
          f"overhead {plan['overhead_bytes'] / GiB:.2f} GiB), engine {got} tokens")
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    assert abs(plan["max_num_tokens"] - got) <= 0.1 * got


def test_plan_says_what_the_engine_refuses_below_sm89():
    """A100 / A10G / T4 / RTX 3090 have no FP8: the plan must not promise quantization=fp8 or an e4m3 KV cache
    there (the engine refuses both), and names what runs instead."""
    cfg = load_config("qwen2.5-7b-shape")
    plan = make_plan(cfg, PlanInputs(quantization="fp8", kv_cache_dtype="fp8"), gpu="A100-80G")
    text = " ".join(plan["advice"] if "advice" in plan else plan["notes"])
    assert "refuses quantization=fp8" in text and "int8 or int4" in text
    assert "refuses kv_cache_dtype=fp8" in text and "fp8_e5m2" in text
    h200 = make_plan(cfg, PlanInputs(quantization="fp8", kv_cache_dtype="fp8"), gpu="H200")
    assert "refuses" not in " ".join(h200.get("advice", []) + h200["notes"])


def test_cpu_offload_gb_by_hand(capsys):
    # qwen2.5-7b-shape (see test_qwen25_7b_shape_by_hand): 233,057,792 parameters per decoder layer, bf16
    layer = 2 * 233_057_792                                   # 466,115,584 bytes
    weight_bytes = 15_231_233_024
    n = -(-7 * GiB // layer)                                  # 7 GiB / layer = 16.1 -> the fewest whole layers: 17
    assert n == 17
    cfg = load_config("qwen2.5-7b-shape")
    base = make_plan(cfg, PlanInputs(gpu_memory_utilization=0.1), gpu="H200")
    plan = make_plan(cfg, PlanInputs(gpu_memory_utilization=0.1, cpu_offload_gb=7), gpu="H200")
    assert plan["decoder_layer_bytes"] == layer and plan["offloaded_layers"] == n
    assert plan["offloaded_bytes"] == n * layer and plan["offload_ring_bytes"] == 2 * layer
    assert plan["gpu_weight_bytes"] == weight_bytes - (n - 2) * layer == base["gpu_weight_bytes"] - 15 * layer
    assert not base["weights_fit"] and plan["fits"]           # 13.98 GiB budget: only with half the weights off
    assert plan["kv_cache_bytes"] == int(139.80 * GiB * 0.1) - plan["gpu_weight_bytes"] \
        - plan["activation_bytes"] - GiB
    assert any("cpu_offload_gb=7" in n and "17 of 28 decoder layers" in n for n in plan["notes"])
    # advice without it: the smallest whole GiB with which one 32768-token sequence (1.75 GiB of KV) fits: at 5 GiB
    # 12 layers go (5.21 GiB, ring 0.87): 9.85 GiB resident + 1.05 activations + 1 overhead leave 2.08 of 13.98
    assert any(a.startswith("cpu_offload_gb=5:") for a in base["advice"])
    assert not any(a.startswith("cpu_offload_gb=") for a in make_plan(cfg, PlanInputs(max_model_len=4096),
                                                                      gpu="T4")["advice"])
    # the engine loads the whole model before offloading: 14.19 GiB + the context do not load on a T4's 14.56 GiB
    t4 = make_plan(cfg, PlanInputs(max_model_len=4096, dtype="float16", cpu_offload_gb=8), gpu="T4")
    assert t4["kv_cache_bytes"] > 0 and not t4["weights_fit"] and not t4["fits"]
    assert any("loading would fail" in n for n in t4["notes"]) and "while it loads" in t4["advice"][0]
    everything = make_plan(cfg, PlanInputs(cpu_offload_gb=100), gpu="H200")
    assert everything["offloaded_layers"] == 28
    from hayabusa.entrypoints.cli import main

    assert main(["plan", "--model", "qwen2.5-7b-shape", "--gpu", "H200", "--cpu-offload-gb", "7", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["offloaded_layers"] == 17
    assert main(["plan", "--model", "qwen2.5-7b-shape", "--cpu-offload-gb", "-1"]) == 2
    assert "cpu_offload_gb" in capsys.readouterr().err


def test_pipeline_parallel_plans_the_largest_stage_and_refuses_as_the_engine(capsys):
    """qwen2.5-7b-shape over 2 stages: 14 of 28 decoder layers per GPU (466,115,584 bytes each in bf16, see
    test_cpu_offload_gb_by_hand) and one 152064 x 3584 bf16 matrix (embedding / lm_head), half the KV per token;
    more stages than layers and cpu_offload_gb refused by name, by the engine's own rule."""
    from hayabusa.distributed.config import get_pp_indices, pp_refusal
    from hayabusa.entrypoints.cli import main
    from hayabusa.errors import HayabusaValidationError

    cfg = load_config("qwen2.5-7b-shape")
    base = make_plan(cfg, PlanInputs(), gpu="H200")
    pp2 = make_plan(cfg, PlanInputs(pp=2), gpu="H200")
    assert [get_pp_indices(28, r, 2) for r in range(2)] == [(0, 14), (14, 28)]
    assert pp2["weight_bytes_per_gpu"] == pp2["gpu_weight_bytes"] == 14 * 466_115_584 + 152064 * 3584 * 2
    assert pp2["kv_bytes_per_token_per_gpu"] == base["kv_bytes_per_token"] // 2
    assert pp2["max_num_tokens"] > 2 * base["max_num_tokens"] and any("largest of 2 stages" in n for n in pp2["notes"])
    pp3 = make_plan(cfg, PlanInputs(pp=3, tp=2), gpu="H200")   # 28 = 9 + 10 + 9: the middle stage, over 2 GPUs
    assert pp3["stage_layers"] == 10 and pp3["weight_bytes_per_gpu"] == (10 * 466_115_584 + 152064 * 3584 * 2) // 2
    assert pp_refusal("Qwen2ForCausalLM", 28, 29) is not None
    for inputs in (PlanInputs(pp=29), PlanInputs(pp=2, cpu_offload_gb=1)):
        with pytest.raises(HayabusaValidationError) as e:
            make_plan(cfg, inputs, gpu="H200")
        assert e.value.parameter == "pipeline_parallel_size"
    assert main(["plan", "--model", "qwen2.5-7b-shape", "--gpu", "H200", "-pp", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["stage_layers"] == 14
    assert main(["plan", "--model", "qwen2.5-7b-shape", "--pipeline-parallel-size", "29"]) == 2
    assert "pipeline_parallel_size" in capsys.readouterr().err
    # a tensor_parallel_size the engine refuses (28 heads over 3) is refused here too, by the engine's rule
    with pytest.raises(HayabusaValidationError) as e:
        make_plan(cfg, PlanInputs(tp=3), gpu="H200")
    assert e.value.parameter == "tensor_parallel_size" and "28" in str(e.value)


def test_w8a8_int8_is_planned_at_eight_bits_and_said_to_run():
    """Issue #24's INT8 W8A8 (online `w8a8_int8`): linear weights at one byte each (the per-channel fp32 scales are
    below the plan's rounding), the rest bf16; the note says hayabusa runs it."""
    cfg = load_config("qwen2.5-7b-shape")
    p = count_params(cfg)
    plan = make_plan(cfg, PlanInputs(quantization="w8a8_int8"), gpu_memory_gib=80)
    assert plan["quantization"] == "w8a8_int8" and plan["weight_bits"] == 8.0
    assert plan["weight_bytes"] == int(p["linear"] * 8 / 8 + (p["total"] - p["linear"]) * 2)
    assert any("quantization=w8a8_int8" in n and "hayabusa runs it" in n for n in plan["notes"])
    assert plan["max_num_tokens"] > make_plan(cfg, PlanInputs(), gpu_memory_gib=80)["max_num_tokens"]


def test_cpu_offload_gb_on_an_encoder_decoder_model_is_refused_as_the_engine_does(tmp_path, capsys):
    """The engine refuses cpu_offload_gb for T5 by name (even on CPU); the plan used to plan "3 of 3 decoder layers
    in pinned CPU memory" for it instead. Both now give the same refusal, naming cpu_offload_gb."""
    from hayabusa import LLM
    from hayabusa.entrypoints.cli import main
    from hayabusa.errors import HayabusaValidationError
    from tests.models._t5 import save_tiny_t5

    cfg = load_config("t5-small-shape")
    assert make_plan(cfg, PlanInputs(), gpu="H200")["encoder_decoder"]
    with pytest.raises(HayabusaValidationError) as planned:
        make_plan(cfg, PlanInputs(cpu_offload_gb=1), gpu="H200")
    assert planned.value.parameter == "cpu_offload_gb" and "encoder-decoder" in str(planned.value)
    save_tiny_t5(tmp_path / "t5", "v1.1")
    with pytest.raises(HayabusaValidationError) as engine:
        LLM(model=str(tmp_path / "t5"), cpu_offload_gb=1)
    assert str(engine.value) == str(planned.value)   # one rule, one message
    assert main(["plan", "--model", "t5-small-shape", "--cpu-offload-gb", "1"]) == 2
    assert "cpu_offload_gb" in capsys.readouterr().err
