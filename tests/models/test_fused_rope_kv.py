"""Every RoPE architecture (Llama, Qwen2, Qwen3 with QK-norm, Mistral and Gemma 2 with sliding windows) runs RoPE
fused into the KV-cache write on the Triton backend, once per layer per forward, with the same hidden states and
caches as RoPE then store_kv: a prefill of two requests, then a decode step with a CUDA-graph padding row.

Without a GPU the Triton kernels run under the interpreter and the unfused path's RoPE is RotaryEmbedding's torch
path, whose fp32 math equals the kernel's (a product, a product, one sum; no FMA on the CPU), so fp32 only there;
on CUDA both paths use the kernels and bf16 is compared too."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.kernels.conftest import DEVICE, SKIP_REASON

DTYPES = [torch.float32, torch.bfloat16] if DEVICE == "cuda" else [torch.float32]
WINDOW = 8


def _config(arch: str):
    import transformers as tf

    base = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64)
    if arch == "llama":
        return tf.LlamaConfig(**base, architectures=["LlamaForCausalLM"])
    if arch == "qwen2":
        return tf.Qwen2Config(**base, architectures=["Qwen2ForCausalLM"])
    if arch == "qwen3":
        return tf.Qwen3Config(**base, head_dim=32, use_sliding_window=True, sliding_window=WINDOW,
                              max_window_layers=1, architectures=["Qwen3ForCausalLM"])
    if arch == "mistral":
        return tf.MistralConfig(**base, sliding_window=WINDOW, architectures=["MistralForCausalLM"])
    return tf.Gemma2Config(**base, head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW,
                           attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
                           architectures=["Gemma2ForCausalLM"])


def _model(arch: str, dtype: torch.dtype):
    from hayabusa.model.registry import get_model_class

    cfg = _config(arch)
    torch.manual_seed(0)
    with torch.device(DEVICE):  # as the loader builds it: buffers (the KV scales) on the device too
        model = get_model_class(cfg.architectures[0])(cfg, dtype, torch.device(DEVICE), 64)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    return model.eval(), cfg


def _steps(device: str):
    """(input_ids, positions, metadata) of a prefill (request 0: 6 tokens, request 1: 11 tokens, past the window)
    and a decode step (one token each, then a padding row), block_size 4, request r in blocks 4r .. 4r + 3."""
    from hayabusa.attention.metadata import AttentionMetadata

    def meta(qsl, seq_lens, slots):
        t = lambda x, dt=torch.int32: torch.tensor(x, dtype=dt, device=device)  # noqa: E731
        return AttentionMetadata(query_start_loc=t(qsl), seq_lens=t(seq_lens),
                                 block_table=t([[0, 1, 2, 3], [4, 5, 6, 7]]), slot_mapping=t(slots, torch.int64),
                                 num_reqs=2, max_query_len=max(b - a for a, b in zip(qsl, qsl[1:])),
                                 max_seq_len=max(seq_lens))

    gen = torch.Generator().manual_seed(1)
    prefill_pos = list(range(6)) + list(range(11))
    prefill = (torch.randint(0, 96, (17,), generator=gen), prefill_pos,
               meta([0, 6, 17], [6, 11], list(range(6)) + [16 + i for i in range(11)]))
    decode = (torch.randint(0, 96, (3,), generator=gen), [6, 11, 0], meta([0, 1, 2], [7, 12], [6, 16 + 11, -1]))
    return [(ids.to(device), torch.tensor(pos, device=device), m) for ids, pos, m in (prefill, decode)]


def _run(model, cfg, dtype, backend):
    from hayabusa.attention.metadata import ForwardContext

    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    shape = (cfg.num_hidden_layers, 2, 8, 4, cfg.num_key_value_heads, head_dim)
    buf = torch.zeros(shape, dtype=dtype, device=DEVICE)
    caches = [(buf[i, 0], buf[i, 1]) for i in range(cfg.num_hidden_layers)]
    hidden = []
    with torch.inference_mode():
        for ids, pos, meta in _steps(DEVICE):
            h = model(ids, pos, ForwardContext(meta, caches, backend))
            hidden.append(h[: int(meta.query_start_loc[-1])])                   # padding rows are left unwritten
    return hidden, buf


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral", "gemma2"])
def test_fused_rope_kv_cache_write_changes_nothing(arch, dtype):
    if SKIP_REASON is not None:
        pytest.skip(SKIP_REASON)
    from hayabusa.attention.backends import AttentionBackend
    from hayabusa.kernels.paged_attention import paged_attention
    from hayabusa.kernels.rope_store_kv import rope_and_store_kv
    from hayabusa.kernels.store_kv import store_kv

    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        rope_and_store_kv(*args, **kwargs)

    model, cfg = _model(arch, dtype)
    fused = AttentionBackend("triton", store_kv, paged_attention, counted)
    got_hidden, got_cache = _run(model, cfg, dtype, fused)
    assert len(calls) == 2 * cfg.num_hidden_layers                               # every layer, both steps
    want_hidden, want_cache = _run(model, cfg, dtype, dataclasses.replace(fused, rope_and_store_kv=None))
    assert len(calls) == 2 * cfg.num_hidden_layers
    assert torch.equal(got_cache, want_cache)
    assert all(torch.equal(a, b) for a, b in zip(got_hidden, want_hidden))
    assert got_cache.abs().sum() > 0
