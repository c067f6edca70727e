"""KV-cache sizing (memory profiling on CUDA, a budget on CPU) and allocation."""

from __future__ import annotations

import logging

import torch

from hayabusa.config import CPU_KV_CACHE_DEFAULT_BYTES, EngineConfig, kv_bytes_per_token
from hayabusa.errors import KVCacheCapacityError

logger = logging.getLogger(__name__)


def kv_cache_dtype(cfg: EngineConfig) -> torch.dtype:
    """dtype of the cache tensors: the model dtype ("auto") or fp8 (kv_cache_dtype fp8 / fp8_e4m3 / fp8_e5m2)."""
    return cfg.cache_config.kv_dtype or cfg.model_config.dtype


def bytes_per_token(cfg: EngineConfig) -> int:
    """K + V bytes of one token over all layers, in the cache dtype (an fp8 cache halves bf16's); with a draft
    model (speculative decoding) its cache's bytes too (it has as many blocks as the target's)."""
    draft = getattr(cfg, "draft_model_config", None)   # a draft's ModelConfig, or an EAGLE head's config
    extra = 0
    if draft is not None:
        elem = torch.empty((), dtype=kv_cache_dtype(cfg)).element_size()
        extra = kv_bytes_per_token(draft.num_layers, draft.num_kv_heads, draft.head_dim, elem)
    return cfg.model_config.kv_bytes_per_token(kv_cache_dtype(cfg)) + extra


def bytes_per_block(cfg: EngineConfig) -> int:
    """K + V bytes of one block over all layers."""
    return bytes_per_token(cfg) * cfg.cache_config.block_size


def determine_num_blocks(cfg: EngineConfig, profiled_peak_bytes: int | None, non_torch_bytes: int = 0) -> int:
    """Number of KV blocks.

    Order: num_gpu_blocks_override; else kv_cache_memory_bytes; else on CUDA
    ``total x gpu_memory_utilization - profiled peak (weights + activations) - non-torch memory`` (with
    cpu_offload_gb the profiled weights are the resident ones plus the offload ring: worker/cpu_offload.py); on CPU
    ``CPU_KV_CACHE_DEFAULT_BYTES`` capped at what max_num_seqs sequences of max_model_len tokens can use.
    Encoder-decoder models: a sequence also holds cross-attention K/V for up to ``ModelConfig.max_encoder_len``
    encoder tokens (the model's encoder limit), in blocks of the same pool.

    Raises:
        KVCacheCapacityError: not even one max_model_len sequence fits; the message says which knob to turn.
    """
    cc, sc = cfg.cache_config, cfg.scheduler_config
    per_block = bytes_per_block(cfg)
    blocks_per_seq = -(-sc.max_model_len // cc.block_size)
    if cfg.model_config.is_encoder_decoder:  # a request also holds its encoder input's cross-attention K/V
        blocks_per_seq += -(-cfg.model_config.max_encoder_len // cc.block_size)
    device = cfg.device_config.device
    if cc.num_gpu_blocks_override is not None:
        num_blocks, source = cc.num_gpu_blocks_override, "num_gpu_blocks_override"
    elif cc.kv_cache_memory_bytes is not None:
        num_blocks, source = cc.kv_cache_memory_bytes // per_block, "kv_cache_memory_bytes"
    elif device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        budget = int(total * cc.gpu_memory_utilization) - (profiled_peak_bytes or 0) - non_torch_bytes
        num_blocks, source = max(budget, 0) // per_block, "gpu_memory_utilization"
    else:
        num_blocks = CPU_KV_CACHE_DEFAULT_BYTES // per_block
        num_blocks = min(num_blocks, blocks_per_seq * sc.max_num_seqs + 1)
        source = "the CPU default budget (kv_cache_memory_bytes)"
    if num_blocks < blocks_per_seq:
        need = blocks_per_seq * per_block
        cross, note, advice = "", "", "Lower max_model_len, or " + _more_kv_advice(source)
        if cfg.model_config.is_encoder_decoder:
            enc = cfg.model_config.max_encoder_len
            cross = f" and the cross-attention K/V of an encoder input of max_encoder_len={enc}"
            note = (" The encoder part is the model's encoder limit (config.json's n_positions, else 512), whatever "
                    "max_model_len.")
            # max_model_len does not lower the encoder part: lowering it helps only while the cross blocks fit
            fits_cross = num_blocks > -(-enc // cc.block_size)
            advice = ("Lower max_model_len (it bounds the decoder only), or " + _more_kv_advice(source)
                      if fits_cross else _more_kv_advice(source).capitalize())
        raise KVCacheCapacityError(
            f"the KV cache ({num_blocks} blocks of {cc.block_size} tokens, from {source}) cannot hold one sequence "
            f"of max_model_len={sc.max_model_len} tokens{cross} ({blocks_per_seq} blocks, {need / 2**20:.1f} MiB "
            f"for {bytes_per_token(cfg)} bytes/token).{note} {advice}.",
            parameter="max_model_len", value=sc.max_model_len)
    return int(num_blocks)


def _more_kv_advice(source: str) -> str:
    """How to give the KV cache more blocks, for the setting that sized it (the capacity error's advice)."""
    if source == "num_gpu_blocks_override":
        return "raise num_gpu_blocks_override"
    if source == "gpu_memory_utilization":
        return "raise gpu_memory_utilization, or set kv_cache_memory_bytes / num_gpu_blocks_override"
    return "raise kv_cache_memory_bytes (or set num_gpu_blocks_override)"


def allocate_kv_buffer(cfg: EngineConfig, num_blocks: int) -> torch.Tensor:
    """The model's (a pipeline stage's: its own ``num_layers``) whole KV cache, one zeroed buffer
    [L, 2, num_blocks, block_size, H_kv, D] in the cache dtype (the model dtype, or float8_e4m3fn / float8_e5m2);
    ``[i, 0]`` / ``[i, 1]`` are layer i's K / V (``kv_cache_views``). The CPU tier copies a run of blocks of all
    layers at once from it (worker/kv_swap.py)."""
    mc = cfg.model_config
    shape = (mc.num_layers, 2, num_blocks, cfg.cache_config.block_size, mc.num_kv_heads, mc.head_dim)
    return torch.zeros(shape, dtype=kv_cache_dtype(cfg), device=cfg.device_config.device)


def kv_cache_views(buf: torch.Tensor, first_layer: int = 0) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
    """Per layer (k_cache, v_cache), each [num_blocks, block_size, H_kv, D], views of ``buf`` (allocate_kv_buffer).
    A pipeline stage's layers start at decoder layer ``first_layer``: the list is indexed by the global layer
    index, None before them."""
    return [None] * first_layer + [(buf[i, 0], buf[i, 1]) for i in range(buf.shape[0])]
