"""The vision tower's varlen attention path (model/vision_attention.py ``flash_varlen``, ``use_flash_varlen``,
``build_segments``; model/qwen2_vl.py's tower) on CPU: the adapter passes "bidirectional" the way each torch signature spells it, the path is
chosen only for CUDA fp16 / bf16, the cumulative lengths reach the kernel as int32 with a host max, and a tower whose
varlen kernel is a per-segment reference gives the grouped SDPA path's output. The real kernel: test_qwen2_vl_cuda.py.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.attention.varlen as torch_varlen

import hayabusa.model.qwen2_vl as qvl
import hayabusa.model.vision_attention as va
from hayabusa.model.qwen2_vl import VisionTransformer, full_segments, window_order
from hayabusa.model.vision_attention import (build_segments, flash_varlen, segment_groups, use_flash_varlen,
                                             varlen_attention_packed)


def tiny_tower(v25: bool, dtype=torch.float32, device="cpu", seed=0) -> VisionTransformer:
    """A 2-block vision tower (hidden 32, 2 heads of 16, 56-pixel windows, block 1 full attention), random weights."""
    vc = SimpleNamespace(depth=2, hidden_size=32, embed_dim=32, intermediate_size=64, mlp_ratio=2, num_heads=2,
                         patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                         fullatt_block_indexes=[1], hidden_act="silu" if v25 else "quick_gelu", in_channels=3)
    tower = VisionTransformer(vc, 48, v25, dtype, torch.device(device))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in tower.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return tower


GRIDS = [(1, 2, 2), (1, 6, 10), (1, 16, 12), (2, 4, 6)]     # one-unit image, edge windows, two frames


def _pixels(grids, dtype=torch.float32, device="cpu"):
    n = sum(t * h * w for t, h, w in grids)
    return torch.randn(n, 3 * 2 * 14 * 14, generator=torch.Generator().manual_seed(1)).to(device, dtype)


def reference_varlen(calls):
    """A stand-in for torch's varlen kernel: SDPA per segment read from cu (records what it was given)."""
    def attend(q, k, v, cu, max_len, scale):
        calls.append((cu.dtype, cu.tolist(), max_len))
        out = torch.empty_like(q)
        bounds = cu.tolist()
        for a, b in zip(bounds[:-1], bounds[1:]):
            out[a:b] = torch.nn.functional.scaled_dot_product_attention(
                q[a:b].transpose(0, 1), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1), scale=scale).transpose(0, 1)
        return out
    return attend


@pytest.mark.parametrize("v25", [True, False], ids=["qwen2_5_vl", "qwen2_vl"])
def test_tower_varlen_plumbing_equals_grouped_path(monkeypatch, v25):
    tower = tiny_tower(v25)
    pixels = _pixels(GRIDS)
    with torch.no_grad():
        grouped = tower(pixels, GRIDS)
        calls = []
        monkeypatch.setattr(qvl, "use_flash_varlen", lambda device, dtype: True)
        monkeypatch.setattr(va, "flash_varlen", lambda: reference_varlen(calls))
        varlen = tower(pixels, GRIDS)
    torch.testing.assert_close(varlen, grouped, rtol=1e-5, atol=1e-5)
    full = full_segments(GRIDS)
    window = window_order(GRIDS, 2, 2)[1] if v25 else full
    assert calls == [(torch.int32, window, int(np.diff(window).max())), (torch.int32, full, 192)]   # block 0, 1
    assert full == [0, 4, 64, 256, 280, 304] and (not v25 or len(window) - 1 == 1 + 6 + 12 + 2 * 2)


def test_build_segments_one_copy_shared_lists():
    cu_a, cu_b = [0, 1, 65, 129, 4129], [0, 7]
    a, b, a2 = build_segments([cu_a, cu_b, cu_a], torch.device("cpu"), varlen=True)
    assert a is a2 and a.groups == [] and b.groups == []
    assert a.cu.dtype == torch.int32 and a.cu.tolist() == cu_a and a.max_len == 4000
    assert b.cu.tolist() == cu_b and b.max_len == 7
    assert a.cu.untyped_storage().data_ptr() == b.cu.untyped_storage().data_ptr()    # one host -> device copy
    g, = build_segments([cu_a], torch.device("cpu"), varlen=False)
    assert g.cu is None and [t.shape for t in g.groups] == [(1, 1), (2, 64), (1, 4000)]
    qkv = torch.randn(4129, 3, 2, 8, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(g.attend(qkv, 0.3), varlen_attention_packed(qkv, segment_groups(cu_a, "cpu"), 0.3),
                               rtol=0, atol=0)


def _fake(params: str):
    """A function with the given keyword-only parameters (after varlen_attn's seven positional ones) that
    records its keyword arguments."""
    got = {}
    ns: dict = {}
    exec(f"def f(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, {params}):\n"
         f"    got.update({{k: v for k, v in locals().items() if k not in ('query', 'key', 'value')}})\n"
         f"    return query", {"got": got}, ns)
    return ns["f"], got


@pytest.mark.parametrize("params, want", [
    ("is_causal=False, return_aux=None", {"is_causal": False}),                                    # torch 2.10
    ("return_aux=None, scale=None, window_size=(-1, -1), enable_gqa=False", {"window_size": (-1, -1)}),  # 2.11+
    ("is_causal=True, scale=None, window_size=(-1, 0)", {"is_causal": False, "window_size": (-1, -1)}),
])
def test_flash_varlen_adapter_passes_bidirectional(monkeypatch, params, want):
    fake, got = _fake(params)
    monkeypatch.setattr(torch_varlen, "varlen_attn", fake)
    flash_varlen.cache_clear()
    try:
        attend = flash_varlen()
        q = torch.zeros(5, 2, 16)
        cu = torch.tensor([0, 2, 5], dtype=torch.int32)
        assert attend(q, q, q, cu, 3, 0.25) is q
    finally:
        flash_varlen.cache_clear()
    assert got["cu_seq_q"] is cu and got["cu_seq_k"] is cu and got["max_q"] == got["max_k"] == 3
    assert {k: got[k] for k in want} == want
    assert got.get("scale", 0.25) == 0.25                 # 2.10 has no scale: the default 1/sqrt(16) is meant


def test_flash_varlen_unknown_signature_is_not_used(monkeypatch):
    fake, _ = _fake("scale=None")                          # no way to say bidirectional
    monkeypatch.setattr(torch_varlen, "varlen_attn", fake)
    flash_varlen.cache_clear()
    try:
        assert flash_varlen() is None
        assert not use_flash_varlen(torch.device("cuda"), torch.bfloat16)
    finally:
        flash_varlen.cache_clear()


def test_use_flash_varlen_only_cuda_half(monkeypatch, caplog):
    assert flash_varlen() is not None                     # this torch (2.13) has varlen_attn
    monkeypatch.setattr(va, "_paths_logged", set())
    with caplog.at_level(logging.INFO, logger="hayabusa.model.vision_attention"):
        assert use_flash_varlen(torch.device("cuda"), torch.bfloat16)
        assert use_flash_varlen(torch.device("cuda", 0), torch.float16)
        assert not use_flash_varlen(torch.device("cuda"), torch.float32)
        assert not use_flash_varlen(torch.device("cpu"), torch.bfloat16)
        monkeypatch.setattr(va, "VISION_VARLEN", False)
        assert not use_flash_varlen(torch.device("cuda"), torch.bfloat16)
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == 2, logged                       # each path once (it is named per device / dtype seen first)
    assert "varlen FlashAttention" in logged[0] and "grouped SDPA" in logged[1]


def test_tower_triton_rope_equals_torch_rope(monkeypatch):
    """The CUDA path's RoPE (kernels/rotary.py, here in Triton's interpreter: one launch for q and k per layer)
    gives the torch path's numbers in fp32 (x1 c - x2 s is x1 c + x2 (-s) exactly). The interpreter does not
    round bf16 as the GPU does (tests/kernels run bf16 on CUDA only): bf16 is test_qwen2_vl_cuda.py's."""
    tower = tiny_tower(True)
    grids = GRIDS[:2]
    pixels = _pixels(grids)
    with torch.no_grad():
        plain = tower(pixels, grids)
        monkeypatch.setattr(qvl, "fused_vision_rope", lambda device: True)
        fused = tower(pixels, grids)
    torch.testing.assert_close(fused, plain, rtol=0, atol=0)
