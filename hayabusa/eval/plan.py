"""``hayabusa plan``: what fits on a GPU before anything is loaded (reads config.json only, never weights).

The numbers follow the engine's own KV sizing (worker/kv_cache.py):
  KV budget = total GPU memory x gpu_memory_utilization - weights - peak activations - non-torch memory
  max_num_tokens = floor(KV budget / (kv_bytes_per_token x block_size)) x block_size
  max_num_seqs_at_max_model_len = floor(max_num_tokens / max_model_len)
with
  weights             = parameters counted from the config x bytes per parameter (linear-layer weights at the
                        quantization's bits; embeddings, lm_head, norms and biases in the model dtype);
  kv_bytes_per_token  = 2 (K and V) x layers x kv_heads x head_dim x bytes of the KV-cache dtype;
  peak activations    = the engine's profiling step, estimated: the larger of one decoder layer's live tensors for
                        max_num_batched_tokens tokens (T x (2 hidden + q + 2 kv + 3 intermediate) elements) and the
                        sampler's logits for min(max_num_seqs, T) rows (model dtype + fp32 + fp32 sort values +
                        int64 sort indices = dtype + 16 bytes per vocab entry) plus the final hidden states;
  non-torch memory    = NON_TORCH_BYTES (1 GiB): the CUDA context, cuBLAS/cuDNN handles and loaded kernel images,
                        which PyTorch's caching allocator does not track (PyTorch "CUDA semantics" notes: the
                        context takes a few hundred MiB depending on GPU, driver and CUDA version); the engine
                        measures it at startup as (total - free) - torch reserved. 1 GiB is a round allowance on
                        the safe side; tests/eval/test_plan.py checks plan against the engine's profiled KV
                        capacity on a GPU (within 10 %).
Encoder-decoder models (T5): the KV cache belongs to the decoder layers (layers = num_decoder_layers, head_dim =
d_kv), and a request holds K/V for its decoder tokens and, in cross-attention blocks of the same pool, for each of
its encoder tokens (every decoder layer's cross-attention K and V):
  kv bytes per request = (decoder tokens + encoder tokens) x kv_bytes_per_token
  max_num_seqs_at_max_model_len = floor(max_num_tokens / (max_model_len + max_encoder_len))
  (encoder inputs of the model's encoder limit, max_encoder_len = config.json's n_positions, else 512, whatever
  max_model_len, which limits the decoder alone)
CUDA graphs are captured after the KV cache is allocated and take memory beyond gpu_memory_utilization (some
hundred MiB; enforce_eager avoids it); they are not in the budget, as in the engine.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from hayabusa.config import DTYPES, default_max_num_batched_tokens, kv_bytes_per_token
from hayabusa.errors import HayabusaValidationError
from hayabusa.eval.plan_vision import DEFAULT_MAX_PIXELS, vision_activation, vision_params

GiB = 2**30
NON_TORCH_BYTES = 1 * GiB

# name -> (memory as CUDA reports it in GiB (torch total_memory, typical), datasheet capacity, memory type,
#          bandwidth GB/s, bf16 support, fp8 support, datasheet URL)
# CUDA-reported totals are what PyTorch's out-of-memory messages print ("GPU 0 has a total capacity of ...")
# on these GPUs; they vary by ~0.3 GiB with driver and ECC settings: give --gpu-memory for an exact figure.
GPUS: dict[str, tuple[float, str, str, int, bool, bool, str]] = {
    "T4": (14.56, "16 GB", "GDDR6", 320, False, False, "https://www.nvidia.com/en-us/data-center/tesla-t4/"),
    "L4": (22.03, "24 GB", "GDDR6", 300, True, True, "https://www.nvidia.com/en-us/data-center/l4/"),
    "A10G": (22.19, "24 GB", "GDDR6", 600, True, False, "https://aws.amazon.com/ec2/instance-types/g5/"),
    "RTX3090": (23.70, "24 GB", "GDDR6X", 936, True, False,
                "https://www.nvidia.com/en-us/geforce/graphics-cards/30-series/rtx-3090-3090ti/"),
    "A100-80G": (79.25, "80 GB", "HBM2e", 2039, True, False, "https://www.nvidia.com/en-us/data-center/a100/"),
    "H100": (79.18, "80 GB", "HBM3", 3350, True, True, "https://www.nvidia.com/en-us/data-center/h100/"),
    "H200": (139.80, "141 GB", "HBM3e", 4800, True, True, "https://www.nvidia.com/en-us/data-center/h200/"),
}

# quantization -> bits per linear-layer weight in hayabusa's memory, scales included. 4-bit group-128 formats (AWQ,
# GPTQ) store an fp16 scale and a 4-bit zero point per 128 weights (4 + 20/128 bits on disk); hayabusa repacks them
# for its int4 kernel with the zero point in 16 bits: 4 + 32/128 in memory. bitsandbytes nf4 keeps an fp32 absmax per 64
# weights: 4 + 32/64. GGUF blocks of 32: Q4_0 18 bytes, Q4_1 20 bytes, Q8_0 34 bytes. FP8 / INT8 per-channel
# scales are negligible (an fp32 scale per output channel of K >= 64 weights: < 0.5 bit). hayabusa's int4 keeps a
# 16-bit scale and zero per 128 weights: 4 + 32/128; compressed-tensors counts as its W8A8 schemes (FP8 or INT8,
# both 8 bits: the ones hayabusa runs). w8a8_int8 = INT8 W8A8 (online); "w8a8" / "smoothquant" are other
# engines' names for the same storage.
QUANT_BITS: dict[str, float] = {
    "fp8": 8.0, "int8": 8.0, "w8a8_int8": 8.0, "w8a8": 8.0, "smoothquant": 8.0, "bitsandbytes-8bit": 8.0,
    "int4": 4 + 32 / 128, "compressed-tensors": 8.0,
    "awq": 4 + 32 / 128, "gptq": 4 + 32 / 128, "awq_marlin": 4 + 32 / 128, "gptq_marlin": 4 + 32 / 128,
    "bitsandbytes": 4.5, "bitsandbytes-4bit": 4.5, "nf4": 4.5,
    "gguf-q4_0": 4.5, "gguf-q4_1": 5.0, "gguf-q8_0": 8.5,
}
KV_DTYPE_BYTES = {"fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "int8": 1, "float16": 2, "half": 2, "bfloat16": 2,
                  "float32": 4}
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
_NON_GATED_MLP = ("gpt2", "gpt_neox", "gptj", "opt", "falcon", "phi", "bloom", "starcoder2")


# ------------------------------------------------------------------------------------------------ config
def load_config(model: str, trust_remote_code: bool = False) -> Any:
    """The config of `model`: a bench shape name, a local folder, or a Hub id (config.json only)."""
    from hayabusa.bench.models import ARCH_SHAPE_NAMES, SHAPES, shape_config
    from hayabusa.bench.vl_models import VL_SHAPES, vl_shape_config

    if model in SHAPES or model in ARCH_SHAPE_NAMES:
        return shape_config(model)
    if model in VL_SHAPES:
        return vl_shape_config(model)
    from transformers import AutoConfig

    if not os.path.isdir(model) and (os.path.exists(model) or model.startswith((".", "/")) or model.count("/") > 1):
        raise HayabusaValidationError(f"model {model!r} is neither a folder, a Hub id nor a bench shape "
                                      f"({', '.join(list(SHAPES) + list(ARCH_SHAPE_NAMES))}).", parameter="model",
                                      value=model)
    try:
        cfg = AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise HayabusaValidationError(f"cannot read config.json of {model!r}: {e}", parameter="model",
                                      value=model) from None
    return cfg


def _text(cfg: Any) -> Any:
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def _attr(cfg: Any, *names: str, default: Any = None) -> Any:
    for n in names:
        v = getattr(cfg, n, None)
        if v is not None:
            return v
    return default


@dataclass
class Shape:
    architecture: str
    model_type: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    max_position: int
    dtype: str                         # the checkpoint's dtype name
    encoder_layers: int = 0            # encoder-decoder (T5): encoder layers; 0 = decoder-only
    gated: bool = True                 # encoder-decoder: gated FFN (T5 v1.1) or not (original T5's ReLU)


def model_shape(cfg: Any) -> Shape:
    from hayabusa.config import derive_max_model_len

    t = _text(cfg)
    if getattr(t, "is_encoder_decoder", False) and getattr(t, "d_kv", None):   # T5: the decoder holds the KV cache
        from hayabusa.config import derive_encoder_decoder_max_len

        dtype = _attr(t, "dtype", "torch_dtype") or "float32"
        raw_tied = getattr(t, "scale_decoder_outputs", getattr(t, "tie_word_embeddings", True))
        return Shape((getattr(cfg, "architectures", None) or ["T5ForConditionalGeneration"])[0], t.model_type,
                     t.d_model, getattr(t, "num_decoder_layers", None) or t.num_layers, t.num_heads, t.num_heads,
                     t.d_kv, t.d_ff, t.vocab_size, bool(raw_tied), derive_encoder_decoder_max_len(t),
                     str(dtype).replace("torch.", ""), encoder_layers=t.num_layers,
                     gated=str(t.feed_forward_proj).startswith("gated"))
    h = _attr(t, "hidden_size", "n_embd", "d_model")
    heads = _attr(t, "num_attention_heads", "n_head")
    kv = _attr(t, "num_key_value_heads", default=1 if getattr(t, "multi_query", False) else heads)
    d = _attr(t, "head_dim") or h // heads
    inter = _attr(t, "intermediate_size", "n_inner", "ffn_dim") or 4 * h
    dtype = _attr(t, "dtype", "torch_dtype") or _attr(cfg, "dtype", "torch_dtype") or "float32"
    arch = (getattr(cfg, "architectures", None) or [type(cfg).__name__])[0]
    return Shape(arch, getattr(t, "model_type", ""), h, _attr(t, "num_hidden_layers", "n_layer"), heads, kv, d,
                 inter, t.vocab_size, bool(getattr(t, "tie_word_embeddings", False)), derive_max_model_len(t),
                 str(dtype).replace("torch.", ""))


def count_params(cfg: Any) -> dict[str, int]:
    """Parameters from the config: {"linear": quantizable matrices, "embedding": input embedding (+ untied lm_head),
    "other": norms, biases, routers, "vision": vision tower estimate (0 without one), "total"}."""
    s, t = model_shape(cfg), _text(cfg)
    h, L, q, kv = s.hidden, s.layers, s.heads * s.head_dim, s.kv_heads * s.head_dim
    if s.encoder_layers:   # T5: encoder (self-attn + FF), decoder (self + cross attn + FF); two position-bias tables
        ff = (3 if s.gated else 2) * h * s.intermediate
        linear = s.encoder_layers * (4 * h * q + ff) + L * (8 * h * q + ff)
        emb = s.vocab * h * (1 if s.tied else 2)
        other = (2 * s.encoder_layers + 3 * L + 2) * h + 2 * t.relative_attention_num_buckets * s.heads
        return {"linear": linear, "embedding": emb, "other": other, "vision": 0, "total": linear + emb + other}
    attn_bias = bool(getattr(t, "attention_bias", False))
    qkv_bias = s.model_type.startswith("qwen2") or attn_bias            # Qwen2 / 2.5 / -VL / -MoE: q, k, v biases
    attn = 2 * h * q + 2 * h * kv
    other = L * (2 * h + (q + 2 * kv if qkv_bias else 0) + (h if attn_bias else 0)) + h   # norms, biases, final
    if s.model_type in ("qwen3", "qwen3_moe"):
        other += L * 2 * s.head_dim                                                        # q_norm, k_norm
    if s.model_type in ("gemma2", "gemma3_text"):
        other += L * 2 * h                                                                 # pre/post FF norms
    if s.model_type == "gpt2":          # biases everywhere, LayerNorm weight + bias, learned positions
        other += L * (3 * h + h + s.intermediate + h + 2 * h) + h + s.max_position * h
    emb, extra_linear = s.vocab * h * (1 if s.tied else 2), 0
    if s.model_type == "opt":           # biases (enable_bias), LayerNorms, learned positions (+2 rows), project_in/out
        proj = getattr(t, "word_embed_proj_dim", None) or h
        bias, affine = bool(getattr(t, "enable_bias", True)), bool(getattr(t, "layer_norm_elementwise_affine", True))
        final = bool(getattr(t, "do_layer_norm_before", True)) and not getattr(t, "_remove_final_layer_norm", False)
        other = (L * ((4 * h if affine else 0) + (5 * h + s.intermediate if bias else 0))
                 + (2 * h if final and affine else 0) + (s.max_position + 2) * h)
        emb = s.vocab * proj * (1 if s.tied else 2)
        extra_linear = 0 if proj == h else 2 * h * proj                                 # project_in, project_out
    mlp_mats = 2 if s.model_type in _NON_GATED_MLP else 3
    experts = _attr(t, "num_local_experts", "num_experts", "n_routed_experts", default=0)
    if experts:
        mi = _attr(t, "moe_intermediate_size") or s.intermediate
        shared = _attr(t, "shared_expert_intermediate_size") or (_attr(t, "n_shared_experts", default=0) * mi)
        dense = _attr(t, "first_k_dense_replace") or len(getattr(t, "mlp_only_layers", None) or [])
        mlp = (L - dense) * (experts * 3 * h * mi + 3 * h * shared) + dense * 3 * h * s.intermediate
        other += (L - dense) * (h * experts + (h if shared else 0))                         # routers, shared gate
    else:
        mlp = L * mlp_mats * h * s.intermediate
    vision = vision_params(cfg)
    linear = L * attn + mlp + extra_linear
    return {"linear": linear, "embedding": emb, "other": other, "vision": vision,
            "total": linear + emb + other + vision}


# ------------------------------------------------------------------------------------------------ sizing
def resolve_dtype(dtype: str | None, shape: Shape) -> str:
    """The engine's rule on a GPU: "auto" keeps the checkpoint's dtype, float32 checkpoints run in bfloat16."""
    if dtype in (None, "auto"):
        return "bfloat16" if shape.dtype in ("float32", "None", "") else shape.dtype
    if dtype not in DTYPES:
        raise HayabusaValidationError(f"dtype must be auto, float32, float16 or bfloat16, got {dtype!r}.",
                                      parameter="dtype", value=dtype)
    return str(DTYPES[dtype]).replace("torch.", "")


def quant_bits(quantization: str | None, cfg: Any) -> tuple[str | None, float | None]:
    """(method, bits per linear weight) from --quantization or the checkpoint's quantization_config."""
    qc = getattr(cfg, "quantization_config", None)
    qc = qc if isinstance(qc, dict) else (qc.to_dict() if hasattr(qc, "to_dict") else None)
    method = quantization or (qc or {}).get("quant_method")
    if method is None:
        return None, None
    method = str(method).lower()
    if qc and not quantization and qc.get("bits") and qc.get("group_size"):
        b, g = qc["bits"], qc["group_size"]
        return method, b + (32 / g if g and g > 0 else 0)   # 16-bit scale + 16-bit zero per group in memory
    if method not in QUANT_BITS:
        raise HayabusaValidationError(f"unknown quantization {method!r}; known: {', '.join(QUANT_BITS)}.",
                                      parameter="quantization", value=method)
    return method, QUANT_BITS[method]


def kv_dtype_bytes(kv_cache_dtype: str | None, dtype: str) -> int:
    if kv_cache_dtype in (None, "auto"):
        return DTYPE_BYTES[dtype]
    if kv_cache_dtype not in KV_DTYPE_BYTES:
        raise HayabusaValidationError(f"kv_cache_dtype must be auto or one of {', '.join(KV_DTYPE_BYTES)}, got "
                                      f"{kv_cache_dtype!r}.", parameter="kv_cache_dtype", value=kv_cache_dtype)
    return KV_DTYPE_BYTES[kv_cache_dtype]


def gpu_memory_bytes(gpu: str | None, gpu_memory_gib: float | None) -> tuple[str | None, int | None]:
    """(name, total bytes) from --gpu-memory, --gpu, or the local CUDA device; (None, None) when none."""
    if gpu_memory_gib is not None:
        if gpu_memory_gib <= 0:
            raise HayabusaValidationError("--gpu-memory must be positive (GiB).", parameter="gpu_memory",
                                          value=gpu_memory_gib)
        return (gpu or f"{gpu_memory_gib:g} GiB"), int(gpu_memory_gib * GiB)
    if gpu is not None:
        key = next((k for k in GPUS if k.lower().replace("-", "") == gpu.lower().replace("-", "")), None)
        if key is None:
            raise HayabusaValidationError(f"unknown GPU {gpu!r}; known: {', '.join(GPUS)} (or give --gpu-memory "
                                          "GiB).", parameter="gpu", value=gpu)
        return key, int(GPUS[key][0] * GiB)
    import torch

    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        return f"{p.name} (this machine)", int(p.total_memory)
    return None, None


def activation_bytes(shape: Shape, dtype_bytes: int, max_num_seqs: int, max_num_batched_tokens: int,
                     tp: int = 1, intermediate: int | None = None) -> int:
    """Peak activations of the engine's profiling step (see the module docstring), per GPU."""
    T, R = max_num_batched_tokens, min(max_num_seqs, max_num_batched_tokens)
    h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    inter = intermediate or shape.intermediate
    layer = T * (2 * h + (q + 2 * kv + 3 * inter) // tp) * dtype_bytes
    logits = T * h * dtype_bytes + R * shape.vocab * (dtype_bytes + 16)
    return max(layer, logits)


@dataclass
class PlanInputs:
    dtype: str | None = None
    quantization: str | None = None
    kv_cache_dtype: str | None = None
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    tp: int = 1
    pp: int = 1                         # pipeline stages: a GPU holds the largest stage's layers
    max_images: int = 1                 # images one prompt may hold (limit_mm_per_prompt["image"])
    max_pixels: int = DEFAULT_MAX_PIXELS   # the image processor's max_pixels
    cpu_offload_gb: float = 0           # GiB of weights per GPU in CPU memory (worker/cpu_offload.py)


def _sizes(cfg: Any, inp: PlanInputs) -> dict[str, Any]:
    """Everything that does not depend on the GPU."""
    shape = model_shape(cfg)
    params = count_params(cfg)
    dtype = resolve_dtype(inp.dtype, shape)
    b = DTYPE_BYTES[dtype]
    method, bits = quant_bits(inp.quantization, cfg)
    linear_bytes = params["linear"] * (bits / 8 if bits else b)
    weight_bytes = int(linear_bytes + (params["total"] - params["linear"]) * b)
    kv_b = kv_dtype_bytes(inp.kv_cache_dtype, dtype)
    kv_heads_per_gpu = max(1, shape.kv_heads // inp.tp)
    kv_per_token = kv_bytes_per_token(shape.layers, shape.kv_heads, shape.head_dim, kv_b)
    max_len = inp.max_model_len or shape.max_position
    batched = inp.max_num_batched_tokens or default_max_num_batched_tokens(inp.max_num_seqs)
    experts_inter = None
    t = _text(cfg)
    if _attr(t, "num_local_experts", "num_experts", "n_routed_experts", default=0):
        experts_inter = max(shape.intermediate, (_attr(t, "moe_intermediate_size") or shape.intermediate)
                            * (_attr(t, "num_experts_per_tok", default=2)))
    out = {
        "model_type": shape.model_type, "architecture": shape.architecture, "params": params["total"],
        "param_breakdown": params, "dtype": dtype, "quantization": method,
        "weight_bits": round(bits, 4) if bits else 8 * b, "weight_bytes": weight_bytes,
        "weight_bytes_per_gpu": weight_bytes // inp.tp, "kv_cache_dtype": inp.kv_cache_dtype or "auto",
        "kv_bytes_per_token": kv_per_token,
        "kv_bytes_per_token_per_gpu": kv_bytes_per_token(shape.layers, kv_heads_per_gpu, shape.head_dim, kv_b),
        "kv_formula": f"2 x {shape.layers} layers x {shape.kv_heads} kv heads x {shape.head_dim} head dim x "
                      f"{kv_b} bytes",
        "max_model_len": max_len, "max_num_seqs": inp.max_num_seqs, "max_num_batched_tokens": batched,
        "block_size": inp.block_size, "tp": inp.tp, "gpu_memory_utilization": inp.gpu_memory_utilization,
        "activation_bytes": activation_bytes(shape, b, inp.max_num_seqs, batched, inp.tp, experts_inter),
        "overhead_bytes": NON_TORCH_BYTES,
        "tokens_per_request": max_len,
    }
    if shape.encoder_layers:   # cross-attention K/V of an encoder input of the model's limit, per request
        enc_len = shape.max_position                    # derive_encoder_decoder_max_len: the engine's max_encoder_len
        out["encoder_decoder"] = True
        out["max_encoder_len"] = enc_len
        out["cross_kv_bytes_per_request"] = kv_per_token * enc_len
        out["tokens_per_request"] = max_len + enc_len
        out["kv_formula"] += (f"; per request (decoder tokens + encoder tokens) x kv_bytes_per_token: cross-attention "
                              f"K/V of {enc_len} encoder tokens = {kv_per_token * enc_len} bytes")
    out.update(_offload(shape, params, linear_bytes, b, inp))
    out["pp"] = inp.pp
    if inp.pp > 1:   # per GPU: the largest stage's layers (and their KV) and one vocabulary-sized matrix
        out.update(_pipeline_stage(shape, kv_heads_per_gpu, kv_b, out["decoder_layer_bytes"] * inp.tp, b, inp))
    vision = vision_activation(cfg, b, inp.max_images, inp.max_pixels, max_len)
    if vision is not None:   # the LM's step holds the encoder outputs; the vision pass peaks on its own
        out["lm_activation_bytes"] = out["activation_bytes"]
        out["vision"] = vision
        out["activation_bytes"] = max(out["activation_bytes"] + vision["encoder_output_bytes"], vision["peak_bytes"])
    return out


def _pipeline_stage(shape: Shape, kv_heads_per_gpu: int, kv_b: int, layer_bytes: int, b: int, inp: PlanInputs
                    ) -> dict[str, Any]:
    """pipeline_parallel_size as the engine runs it (vLLM's layer split, distributed/config.get_pp_indices): a GPU
    holds its stage's decoder layers (``layer_bytes`` each, over tp) and their KV, stage 0 the embedding and the
    last stage the lm_head (a tied one as a copy): the largest stage with one vocab x hidden matrix bounds them all
    (the engine takes the smallest KV capacity over its GPUs)."""
    from hayabusa.distributed.config import get_pp_indices

    stage_layers = max(e - s for s, e in (get_pp_indices(shape.layers, r, inp.pp) for r in range(inp.pp)))
    weights = (stage_layers * layer_bytes + shape.vocab * shape.hidden * b) // inp.tp
    return {"stage_layers": stage_layers, "weight_bytes_per_gpu": weights, "gpu_weight_bytes": weights,
            "kv_bytes_per_token_per_gpu": kv_bytes_per_token(stage_layers, kv_heads_per_gpu, shape.head_dim, kv_b)}


def _offload(shape: Shape, params: dict[str, int], linear_bytes: float, b: int, inp: PlanInputs) -> dict[str, Any]:
    """cpu_offload_gb as the engine runs it: the fewest whole decoder layers (evenly spread) whose weights reach
    it leave the GPU, and a ring of min(2, n) layer-sized buffers joins it. A decoder layer is counted as
    (linear weights + norms and biases but the final norm) / layers, per GPU."""
    from hayabusa.worker.cpu_offload import NUM_SLOTS, choose_offload_layers

    L = max(shape.layers, 1)
    layer = int((linear_bytes + max(params["other"] - shape.hidden, 0) * b) / L) // inp.tp
    n = len(choose_offload_layers([layer] * L, int(inp.cpu_offload_gb * GiB)))
    offloaded, ring = n * layer, min(NUM_SLOTS, n) * layer
    return {"cpu_offload_gb": inp.cpu_offload_gb, "layers": shape.layers, "offloaded_layers": n, "decoder_layer_bytes": layer,
            "offloaded_bytes": offloaded, "offload_ring_bytes": ring,
            "gpu_weight_bytes": (int(linear_bytes + (params["total"] - params["linear"]) * b) // inp.tp
                                 - offloaded + ring)}


FIT_FIELDS = ("gpu_memory_bytes", "budget_bytes", "kv_cache_bytes", "max_num_tokens", "max_num_seqs_at_max_model_len",
              "weights_fit", "fits")
NO_GPU_NOTE = ("no GPU given (--gpu NAME or --gpu-memory GiB) and no CUDA device here, so the fit fields ("
               + ", ".join(FIT_FIELDS) + ') are given per GPU in "gpus"; "fits_on" names the GPUs where the model '
               "fits as configured.")


def _fit(sizes: dict[str, Any], total_bytes: int) -> dict[str, Any]:
    """KV budget, tokens and sequences on one GPU of `total_bytes`."""
    budget = int(total_bytes * sizes["gpu_memory_utilization"])
    kv_bytes = budget - sizes["gpu_weight_bytes"] - sizes["activation_bytes"] - sizes["overhead_bytes"]
    per_block = sizes["kv_bytes_per_token_per_gpu"] * sizes["block_size"]
    tokens = max(kv_bytes, 0) // per_block * sizes["block_size"]
    return {"gpu_memory_bytes": total_bytes, "budget_bytes": budget, "kv_cache_bytes": max(kv_bytes, 0),
            "max_num_tokens": tokens, "max_num_seqs_at_max_model_len": tokens // sizes["tokens_per_request"],
            "weights_fit": kv_bytes > 0 and _loads(sizes, total_bytes),
            "fits": tokens >= sizes["tokens_per_request"] and _loads(sizes, total_bytes)}


def make_plan(cfg: Any, inp: PlanInputs, gpu: str | None = None, gpu_memory_gib: float | None = None,
              model: str = "") -> dict[str, Any]:
    """The plan as one JSON-able dict: sizes, the chosen GPU's fit and advice, the fit on every GPU of the table
    ("gpus") and the names of those where it fits ("fits_on"). "fit_scope" is "gpu" when the fit fields
    (FIT_FIELDS) are at the top level for the chosen GPU, "per_gpu" when no GPU is known and they are only in
    "gpus" ("fit_note" says so)."""
    if not 0 < inp.gpu_memory_utilization <= 1:
        raise HayabusaValidationError("gpu_memory_utilization must be in (0, 1].",
                                      parameter="gpu_memory_utilization", value=inp.gpu_memory_utilization)
    if not 0 <= inp.cpu_offload_gb < float("inf"):
        raise HayabusaValidationError("cpu_offload_gb must be a non-negative number of GiB.",
                                      parameter="cpu_offload_gb", value=inp.cpu_offload_gb)
    if inp.tp < 1 or inp.block_size < 1 or inp.max_num_seqs < 1:
        raise HayabusaValidationError("tp, block_size and max_num_seqs must be positive.", parameter="tp",
                                      value=inp.tp)
    _check_pipeline(cfg, inp)
    sizes = _sizes(cfg, inp)
    name, total = gpu_memory_bytes(gpu, gpu_memory_gib)
    plan: dict[str, Any] = {"model": model, **sizes, "gpu": name}
    if total:
        plan.update(_fit(sizes, total), fit_scope="gpu")
    else:  # no top-level fit fields: a null "fits" would read as "does not fit"
        plan.update(fit_scope="per_gpu", fit_note=NO_GPU_NOTE)
    plan["gpus"] = [{"gpu": k, "cuda_total_gib": v[0], "spec": f"{v[1]} {v[2]}", "bf16": v[4], "fp8": v[5],
                     "source": v[6], **_fit(sizes, int(v[0] * GiB))} for k, v in GPUS.items()]
    plan["fits_on"] = [g["gpu"] for g in plan["gpus"] if g["fits"]]
    plan["advice"] = advice(cfg, inp, plan) if total else []
    plan["notes"] = _notes(plan)
    return plan


def _check_pipeline(cfg: Any, inp: PlanInputs) -> None:
    """What the engine refuses of pipeline_parallel_size, tensor_parallel_size and cpu_offload_gb, the plan refuses
    too, by name (the same rules)."""
    from hayabusa.distributed.config import pp_refusal

    if not isinstance(inp.pp, int) or inp.pp < 1:
        raise HayabusaValidationError("pipeline_parallel_size must be a positive integer.",
                                      parameter="pipeline_parallel_size", value=inp.pp)
    shape = model_shape(cfg)
    why = pp_refusal(shape.architecture, shape.layers, inp.pp)
    if inp.cpu_offload_gb:   # the engine's own rule (EngineArgs), refused by name here as there
        from hayabusa.config import cpu_offload_refusal

        offload_why = cpu_offload_refusal(shape.architecture, bool(shape.encoder_layers))
        if offload_why is not None:
            raise HayabusaValidationError(f"cpu_offload_gb={inp.cpu_offload_gb!r}: {offload_why}",
                                          parameter="cpu_offload_gb", value=inp.cpu_offload_gb)
    if why is None and inp.pp > 1 and inp.cpu_offload_gb:
        why = "cpu_offload_gb with pipeline stages is not supported (each stage holds only its layers already)."
    if why is not None:
        raise HayabusaValidationError(f"pipeline_parallel_size={inp.pp}: {why}", parameter="pipeline_parallel_size",
                                      value=inp.pp)
    if isinstance(inp.tp, int) and inp.tp > 1 and not _engine_can_split(cfg, inp, inp.tp):
        from hayabusa.distributed.config import tp_refusal

        quantized = quant_bits(inp.quantization, cfg)[0] is not None
        parameter, why = tp_refusal(shape.architecture, shape.heads, shape.kv_heads, shape.intermediate, quantized,
                                    inp.tp)
        raise HayabusaValidationError(f"tensor_parallel_size={inp.tp}: {why}", parameter=parameter, value=inp.tp)


def _notes(plan: dict[str, Any]) -> list[str]:
    notes = []
    if plan["quantization"]:
        from hayabusa.quantization import implemented_methods

        runs = implemented_methods()
        notes.append(f"quantization={plan['quantization']} is planned at {plan['weight_bits']:.2f} bits per linear "
                     "weight" + (" (hayabusa runs it)." if plan["quantization"] in runs else
                                 f"; hayabusa does not run it yet (it runs {', '.join(runs)})."))
    if plan["kv_cache_dtype"] != "auto":
        from hayabusa.config import KV_CACHE_DTYPES

        runs = plan["kv_cache_dtype"] in KV_CACHE_DTYPES
        notes.append(f"kv_cache_dtype={plan['kv_cache_dtype']}: {plan['kv_bytes_per_token']:,} KV bytes per token"
                     + (" (hayabusa runs it)." if runs else f"; hayabusa does not run it (it runs "
                                                            f"{', '.join(KV_CACHE_DTYPES)})."))
    if plan["tp"] > 1:
        notes.append("tensor parallelism is planned per GPU (weights / tp, KV heads / tp, at least one KV head "
                     "per GPU), as hayabusa's tensor_parallel_size runs it.")
    if plan["pp"] > 1:
        notes.append(f"pipeline parallelism is planned per GPU for the largest of {plan['pp']} stages "
                     f"({plan['stage_layers']} of {plan['layers']} decoder layers and their KV, plus one vocab x "
                     "hidden matrix: the embedding on stage 0, the lm_head on the last), as hayabusa's "
                     "pipeline_parallel_size runs it; the engine takes the smallest KV capacity over the GPUs.")
    if plan["cpu_offload_gb"]:
        notes.append(f"cpu_offload_gb={plan['cpu_offload_gb']}: {plan['offloaded_layers']} of {plan['layers']} "
                     f"decoder layers ({_gib(plan['offloaded_bytes'])}) live in pinned CPU memory and stream to the "
                     f"GPU each forward through a ring of {_gib(plan['offload_ring_bytes'])}; every forward copies "
                     f"{_gib(plan['offloaded_bytes'])} over PCIe (about {plan['offloaded_bytes'] / 50e9 * 1e3:.0f} ms "
                     "at 50 GB/s), so decode steps slow down; batch more per step to amortize it."
                     + (" The engine does not run it with tensor_parallel_size > 1 yet." if plan["tp"] > 1 else ""))
    if plan["cpu_offload_gb"] and plan.get("gpu_memory_bytes") and not _loads(plan, plan["gpu_memory_bytes"]):
        notes.append(f"cpu_offload_gb: the engine loads the whole model onto the GPU before it moves the chosen "
                     f"layers to CPU memory, and {_gib(plan['weight_bytes_per_gpu'])} of weights do not fit in "
                     f"{_gib(plan['gpu_memory_bytes'])} beside the CUDA context: loading would fail on this GPU.")
    if plan.get("vision"):
        v = plan["vision"]
        notes.append(f"vision tower: {plan['param_breakdown']['vision']:,} parameters; its activation peak "
                     f"{_gib(v['peak_bytes'])} for {v['max_images']} image(s) of {v['max_pixels']:,} pixels "
                     f"({v['patches']:,} patches; encoder output {_gib(v['encoder_output_bytes'])}); activations = "
                     "max(LM step + encoder output, vision peak) (hayabusa/eval/plan_vision.py).")
    return notes


def _with(cfg: Any, inp: PlanInputs, total: int, **changes: Any) -> dict[str, Any]:
    new = PlanInputs(**{**inp.__dict__, **changes})
    return _fit(_sizes(cfg, new), total)


def _engine_can_split(cfg: Any, inp: PlanInputs, tp: int) -> bool:
    """Whether the engine would accept tensor_parallel_size=tp for this model (the engine's own rule)."""
    from hayabusa.distributed.config import tp_refusal

    shape = model_shape(cfg)
    quantized = quant_bits(inp.quantization, cfg)[0] is not None
    return tp_refusal(shape.architecture, shape.heads, shape.kv_heads, shape.intermediate, quantized, tp) is None


def _loads(sizes: dict[str, Any], total: int) -> bool:
    """The engine loads every weight onto the GPU before it moves the offloaded layers to CPU memory: the whole
    model (per GPU) must fit in the GPU's memory once, beside the CUDA context."""
    return sizes["weight_bytes_per_gpu"] + sizes["overhead_bytes"] < total


def _offload_that_fits(cfg: Any, inp: PlanInputs, total: int) -> int | None:
    """The smallest whole number of GiB of cpu_offload_gb with which one max_model_len sequence fits, if any (and
    if the whole model fits on the GPU while it loads: the engine offloads after loading)."""
    if inp.cpu_offload_gb or inp.tp > 1 or inp.pp > 1 or model_shape(cfg).encoder_layers or not _loads(_sizes(cfg, inp), total):
        return None
    for gb in range(1, int(_sizes(cfg, inp)["weight_bytes"] // GiB) + 2):
        if _with(cfg, inp, total, cpu_offload_gb=gb)["fits"]:
            return gb
    return None


def advice(cfg: Any, inp: PlanInputs, plan: dict[str, Any]) -> list[str]:
    """What to change: when the weights do not fit, when one max_model_len sequence does not, or how many
    max_model_len sequences can run at once."""
    total, L = plan["gpu_memory_bytes"], plan["max_model_len"]
    out: list[str] = []
    if not plan["weights_fit"]:
        if plan["kv_cache_bytes"] > 0:   # only the loading does not fit (cpu_offload_gb offloads after loading)
            out.append(f"the whole model ({plan['weight_bytes_per_gpu'] / GiB:.1f} GiB) must fit on the GPU while it "
                       f"loads (cpu_offload_gb moves layers to CPU memory after loading); it does not in "
                       f"{total / GiB:.1f} GiB.")
        else:
            out.append(f"the weights ({plan['gpu_weight_bytes'] / GiB:.1f} GiB on the GPU) plus activations and "
                       f"overhead do not fit in {plan['budget_bytes'] / GiB:.1f} GiB.")
        if not plan["quantization"]:
            for q in ("fp8", "awq"):
                f = _with(cfg, inp, total, quantization=q)
                if f["fits"]:
                    out.append(f"quantization={q}: {f['max_num_tokens']:,} KV tokens "
                               f"({f['max_num_seqs_at_max_model_len']} sequences of {L}).")
                    break
        for tp in (2, 4, 8):
            if tp > inp.tp and _engine_can_split(cfg, inp, tp) and _with(cfg, inp, total, tp=tp)["fits"]:
                out.append(f"tensor_parallel_size={tp}: the model fits on {tp} of these GPUs.")
                break
        gb = _offload_that_fits(cfg, inp, total)
        if gb is not None:
            sizes = _sizes(cfg, PlanInputs(**{**inp.__dict__, "cpu_offload_gb": gb}))
            f = _fit(sizes, total)
            out.append(f"cpu_offload_gb={gb}: {f['max_num_tokens']:,} KV tokens ({f['max_num_seqs_at_max_model_len']} "
                       f"sequences of {L}), every forward copying {_gib(sizes['offloaded_bytes'])} from CPU memory "
                       "(decode slows down).")
    elif not plan["fits"]:
        fit_len = plan["max_num_tokens"] // inp.block_size * inp.block_size
        out.append(f"one sequence of max_model_len={L} needs {L:,} KV tokens; only {plan['max_num_tokens']:,} fit.")
        if fit_len > 0:
            out.append(f"max_model_len={fit_len} fits one sequence (lower it to what your requests need).")
        if plan["kv_cache_dtype"] == "auto" and DTYPE_BYTES[plan["dtype"]] > 1:
            f = _with(cfg, inp, total, kv_cache_dtype="fp8")
            out.append(f"kv_cache_dtype=fp8: {f['max_num_tokens']:,} tokens.")
    else:
        seqs, n = plan["max_num_seqs_at_max_model_len"], inp.max_num_seqs
        if seqs < n:
            out.append(f"{seqs} sequences of max_model_len={L} fit at once; with max_num_seqs={n} all running, each "
                       f"can average {plan['max_num_tokens'] // n:,} tokens before the scheduler preempts. Lower "
                       "max_model_len to what requests need, or max_num_seqs to "
                       f"{max(seqs, 1)} to never preempt at full length.")
        else:
            out.append(f"max_num_seqs={n} sequences of max_model_len={L} fit at once.")
    spec = GPUS.get(str(plan["gpu"]))
    if spec and not spec[4] and plan["dtype"] == "bfloat16":
        out.append(f"{plan['gpu']} has no bfloat16 support: run with dtype=float16.")
    if spec and not spec[5]:  # below compute capability 8.9: what the engine refuses there (config.py, fp8.py)
        if plan["quantization"] in ("fp8", "compressed-tensors"):
            out.append(f"{plan['gpu']} has no FP8 tensor cores: hayabusa refuses quantization=fp8 (and FP8 "
                       "compressed-tensors checkpoints) there; use int8 or int4 (weight-only) or, on compute "
                       "capability 8.0+, w8a8_int8 (INT8 W8A8), which run on it.")
        if plan["kv_cache_dtype"] in ("fp8", "fp8_e4m3"):
            out.append(f"{plan['gpu']} cannot convert e4m3: hayabusa refuses kv_cache_dtype={plan['kv_cache_dtype']}"
                       " there; kv_cache_dtype=fp8_e5m2 gives the same memory and runs on it.")
    bigger = [g["gpu"] for g in plan["gpus"] if g["fits"] and g["gpu_memory_bytes"] > total]
    if not plan["fits"] and bigger:
        out.append(f"GPUs where it fits as configured: {', '.join(bigger)}.")
    return out


# ------------------------------------------------------------------------------------------------ text
def _gib(b: int | None) -> str:
    if b is None:
        return "-"
    return f"{b / GiB:,.2f} GiB" if b >= GiB // 10 or b == 0 else f"{b / 2**20:,.2f} MiB"


def _count(n: int) -> str:
    return f"{n / 1e9:.3f} B" if n >= 1e9 else (f"{n / 1e6:.2f} M" if n >= 1e6 else f"{n:,}")


def format_plan(plan: dict[str, Any]) -> str:
    """The plan as text: sizes with their formulas, the chosen GPU's budget, advice, and the GPU table."""
    p, pb = plan, plan["param_breakdown"]
    lines = [f"hayabusa plan: {p['model']} ({p['architecture']})",
             f"  parameters      {_count(p['params'])}  (linear {_count(pb['linear'])}, embeddings "
             f"{_count(pb['embedding'])}, norms/biases/routers {_count(pb['other'])}"
             + (f", vision ~{_count(pb['vision'])}" if pb["vision"] else "") + ")",
             f"  weights         {_gib(p['weight_bytes'])}  ({p['dtype']}"
             + (f"; linear weights at {p['weight_bits']:.2f} bits ({p['quantization']})" if p["quantization"] else "")
             + (f"; {_gib(p['weight_bytes_per_gpu'])} per GPU at tp={p['tp']}, pp={p['pp']}"
                if p["tp"] > 1 or p["pp"] > 1 else "") + ")",
             f"  KV per token    {p['kv_bytes_per_token']:,} bytes  ({p['kv_formula']})",
             f"  max_model_len   {p['max_model_len']:,}   max_num_seqs {p['max_num_seqs']}   "
             f"max_num_batched_tokens {p['max_num_batched_tokens']}"]
    if p["gpu"] is None:
        lines.append("  GPU             none given and no CUDA device here: pick one with --gpu NAME or "
                     "--gpu-memory GiB (the table below covers the common ones).")
    else:
        lines += [f"  GPU             {p['gpu']}: {_gib(p['gpu_memory_bytes'])} x gpu_memory_utilization "
                  f"{p['gpu_memory_utilization']} = {_gib(p['budget_bytes'])}",
                  f"    - weights     {_gib(p['gpu_weight_bytes'])}"
                  + (f"  ({_gib(p['weight_bytes_per_gpu'])} - {_gib(p['offloaded_bytes'])} in CPU memory "
                     f"({p['offloaded_layers']} layers, cpu_offload_gb) + ring {_gib(p['offload_ring_bytes'])})"
                     if p["cpu_offload_gb"] else ""),
                  f"    - activations {_gib(p['activation_bytes'])}  (estimated peak of one "
                  f"{p['max_num_batched_tokens']}-token step and its logits"
                  + (f"; vision tower {_gib(p['vision']['peak_bytes'])}" if p.get("vision") else "") + ")",
                  f"    - overhead    {_gib(p['overhead_bytes'])}  (CUDA context and kernels, not tracked by torch)",
                  f"    = KV cache    {_gib(p['kv_cache_bytes'])} -> {p['max_num_tokens']:,} tokens = "
                  f"{p['max_num_seqs_at_max_model_len']} sequences of max_model_len",
                  "  fits            " + ("yes" if p["fits"] else "NO")]
        lines += [f"  * {a}" for a in p["advice"]]
    lines += [f"  note: {n}" for n in p["notes"]]
    lines.append("")
    lines.append(f"  {'GPU':9s} {'CUDA total':>11s} {'spec':>13s} {'bf16':>4s} {'fp8':>4s} {'KV tokens':>12s} "
                 f"{'seqs@len':>8s}  fits")
    for g in p["gpus"]:
        yes = {k: "yes" if g[k] else "no" for k in ("bf16", "fp8", "fits")}
        lines.append(f"  {g['gpu']:9s} {g['cuda_total_gib']:>7.2f} GiB {g['spec']:>13s} {yes['bf16']:>4s} "
                     f"{yes['fp8']:>4s} {g['max_num_tokens']:>12,} "
                     f"{g['max_num_seqs_at_max_model_len']:>8}  {yes['fits']}")
    lines.append("  CUDA total = what torch reports on that GPU (typical; varies by ~0.3 GiB with driver/ECC); spec "
                 "and bf16/fp8 support from the vendor datasheets:")
    lines += [f"    {g['gpu']}: {g['source']}" for g in p["gpus"]]
    return "\n".join(lines)


def plan_json(plan: dict[str, Any]) -> str:
    return json.dumps(plan, indent=1, default=str)
