"""Batch-invariant kernels (``batch_invariant=True``): a row's result does not depend on the other rows.

Kernel + launcher + reference for each op the mode swaps in:

- ``matmul_bi``: y = x W^T + b on CUDA by ``kernels/bi_gemm.bi_gemm``: one K step (BLOCK_K) and one split of K into
  chunks per weight shape (N, K) and GPU (never a function of M; the tile shape, warps and stages are chosen per M,
  measured not to change a bit), the chunk partials summed in index order in fp32, the bias added before the one
  rounding; decode steps run the chunks as separate programs (parallelism for a handful of output tiles), prefill
  steps one program per tile, the same float operations either way (why: bi_gemm's docstring). cuBLAS, in
  contrast, picks its K split by M, so F.linear's bits depend on the batch.
  ``matmul_bi_unsplit`` is the mode's first GEMM (no split-K: every output one program's fp32 accumulator walking
  K from 0 in BLOCK_K steps), kept for the benchmark's comparison (benchmarks/kernels/bench_bi_gemm.py).
  Reference ``matmul_bi_ref`` (the CPU path): each output is ``sum(x_row * w_row)`` over the contiguous K dim in
  fp32 (an elementwise product, then torch's inner-dim sum whose order depends only on K), row by row in chunks.
- ``log_softmax_bi``: per-row log-softmax in fp32, one program per row walking V in fixed BLOCK_V chunks
  (elementwise max / sum accumulators, reduced once at the end): a row's bits depend only on that row and V.
  Reference ``log_softmax_bi_ref`` = torch.log_softmax on CPU (a per-row vectorised loop; tested invariant).
- attention: ``paged_attention(..., batch_invariant=True)`` (kernels/paged_attention.py) runs the same kernel for
  every step with one tile configuration and no split-KV; ``paged_attention_bi_ref`` here is the CPU path: per
  request, KV tiles of ``BI_TILE_N`` keys from position 0, the kernel's online-softmax update (log2 units) with
  every reduction an inner-dim sum of fixed length.

Why the rest of the model needs nothing new: RMSNorm (``kernels/fused_norm.py`` on CUDA: one program per row,
BLOCK = next_pow2(N); plain torch mean over the last dim on CPU), SiLU-and-mul, RoPE, the KV-cache write and the
embedding are per-row or elementwise; argmax / topk / gather select exact values (ties: lowest id).
"""

from __future__ import annotations

import torch

from hayabusa.kernels._triton import cdiv, tl, triton
from hayabusa.kernels.bi_gemm import bi_gemm, grouped_tile, linear_operands, num_sms

_LOG2E = 1.4426950408889634
BI_TILE_N = 16          # keys per online-softmax step of the CPU reference (any fixed value works)
_REF_CHUNK_ELEMS = 1 << 22   # rows x N x K products per chunk of matmul_bi_ref (bounds its memory)


# ------------------------------------------------------------------------------------------------------- matmul
# M is not specialized: M == 1 or M % 16 == 0 must not compile a variant of its own (one program text for all M)
@triton.jit(do_not_specialize=["M"])
def _matmul_bi_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                      HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, DOT_FP32: tl.constexpr):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = grouped_tile(pid, num_m, num_n, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    w_cols = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):   # the one K order of every output element
        k_mask = (k0 + offs_k) < K
        x = tl.load(x_rows + (k0 + offs_k)[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_cols + (k0 + offs_k)[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if DOT_FP32:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(x, w, acc, input_precision="ieee")
    if HAS_BIAS:
        acc = acc + tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def matmul_bi_unsplit_config(N: int, K: int, num_sms: int = 132) -> dict:
    """The one tile configuration of a weight [N, K] on a GPU of ``num_sms`` SMs: from N, K and the device only,
    never from M (so every step, whatever its batch, runs the same program on the weight).

    BLOCK_M 64 (a decode step uses one M tile; prefill many); BLOCK_N the largest of 128 / 64 / 32 that still
    gives one program per SM at a single M tile (decode is bound by reading W: spread it over the SMs), 32 for
    narrow weights; BLOCK_K 64; 4 warps, 3 stages.
    """
    block_n = next((b for b in (128, 64) if cdiv(N, b) >= num_sms), 32)
    return dict(BLOCK_M=64, BLOCK_N=block_n, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=3)


def matmul_bi_unsplit(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The mode's first GEMM, y = x W^T + b without split-K (kept for the benchmark; see the module docstring).

    Args:
        x: [M, K] (or [..., K]; flattened) fp32/fp16/bf16, unit last stride.
        weight: [N, K], x's dtype, unit last stride (HF layout).
        bias: [N] or None.
    Returns:
        y [M, N] (x's leading shape) in x's dtype; row m depends only on x[m], W and b.
    Raises:
        ValueError: shape, dtype or stride mismatch.
    """
    lead, x2, y = linear_operands(x, weight, bias)
    (M, K), N = x2.shape, weight.shape[0]
    if M == 0:
        return y.view(*lead, N)
    cfg = matmul_bi_unsplit_config(N, K, num_sms(x.device) if x.is_cuda else 132)
    grid = (cdiv(M, cfg["BLOCK_M"]) * cdiv(N, cfg["BLOCK_N"]),)
    _matmul_bi_kernel[grid](x2, weight, bias if bias is not None else weight, y, M, N, K, x2.stride(0),
                            weight.stride(0), y.stride(0), HAS_BIAS=bias is not None,
                            # the CPU interpreter computes bf16 tl.dot on raw bits: fp32 operands there
                            DOT_FP32=x.device.type == "cpu", **cfg)
    return y.view(*lead, N)


def matmul_bi(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Batch-invariant y = x W^T + b: ``bi_gemm`` (x [M, K] or [..., K], weight [N, K] of x's dtype, bias [N] or
    None -> [..., N] in x's dtype; row m depends only on x[m], W and b). Raises ValueError on mismatched inputs."""
    return bi_gemm(x, weight, bias)


def matmul_bi_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Plain-torch matmul_bi (the CPU path): y[m, n] = sum_k x[m, k] w[n, k] in fp32 (+ b[n]), one rounding.

    Each output is an inner-dim sum of K fp32 products, whose order depends only on K; rows and outputs go in
    chunks that bound the [rows, cols, K] product tensor (about 16 MB). Slow (no GEMM): meant for tiny CPU
    models and tests."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).float()
    w = weight.float()
    N, K = w.shape
    cols = max(1, min(N, _REF_CHUNK_ELEMS // max(1, K)))        # outputs per chunk
    rows = max(1, _REF_CHUNK_ELEMS // max(1, cols * K))
    out = torch.empty((x2.shape[0], N), dtype=torch.float32, device=x.device)
    for s in range(0, x2.shape[0], rows):
        for c in range(0, N, cols):
            out[s:s + rows, c:c + cols] = (x2[s:s + rows, None, :] * w[None, c:c + cols]).sum(-1)
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).view(*lead, N)


def linear_bi(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear's batch-invariant replacement: the Triton GEMM on CUDA, the reference elsewhere."""
    if x.is_cuda:
        return matmul_bi(x, weight, bias)
    return matmul_bi_ref(x, weight, bias)


# -------------------------------------------------------------------------------------------------- log_softmax
@triton.jit(do_not_specialize=["V"])
def _log_softmax_bi_kernel(x_ptr, y_ptr, V, stride_x, stride_y, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_V)
    m_vec = tl.full([BLOCK_V], float("-inf"), tl.float32)
    for v0 in range(0, V, BLOCK_V):
        x = tl.load(x_ptr + row * stride_x + v0 + offs, mask=v0 + offs < V, other=float("-inf")).to(tl.float32)
        m_vec = tl.maximum(m_vec, x)
    m = tl.max(m_vec, axis=0)
    m_safe = tl.where(m > float("-inf"), m, 0.0)
    s_vec = tl.zeros([BLOCK_V], tl.float32)
    for v0 in range(0, V, BLOCK_V):
        x = tl.load(x_ptr + row * stride_x + v0 + offs, mask=v0 + offs < V, other=float("-inf")).to(tl.float32)
        s_vec += tl.exp(x - m_safe)
    lse = m_safe + tl.log(tl.sum(s_vec, axis=0))
    for v0 in range(0, V, BLOCK_V):
        x = tl.load(x_ptr + row * stride_x + v0 + offs, mask=v0 + offs < V, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * stride_y + v0 + offs, x - lse, mask=v0 + offs < V)


def log_softmax_bi(x: torch.Tensor) -> torch.Tensor:
    """Batch-invariant log_softmax over the last dim: x [R, V] any float dtype -> [R, V] fp32.
    CUDA: the Triton kernel (one program per row, fixed BLOCK_V); elsewhere ``log_softmax_bi_ref``."""
    if not x.is_cuda:
        return log_softmax_bi_ref(x)
    if x.dim() != 2:
        raise ValueError(f"x must be [R, V], got {tuple(x.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    R, V = x.shape
    y = torch.empty((R, V), dtype=torch.float32, device=x.device)
    if R:
        _log_softmax_bi_kernel[(R,)](x, y, V, x.stride(0), y.stride(0), BLOCK_V=1024, num_warps=4)
    return y


def log_softmax_bi_ref(x: torch.Tensor) -> torch.Tensor:
    """torch.log_softmax in fp32 (CPU: a per-row loop whose order depends only on V)."""
    return torch.log_softmax(x.float(), dim=-1)


# ---------------------------------------------------------------------------------------------------- attention
def _bi_attend_one(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_row: torch.Tensor,
                   seq_len: int, scale: float, window: int, softcap: float, k_scale, v_scale,
                   position_bias: torch.Tensor | None = None) -> torch.Tensor:
    """One request's queries q [n, H, D] -> [n, H, D] fp32, KV walked in BI_TILE_N-key tiles from position 0;
    ``position_bias`` [H, L] fp32 (T5): bias[h, query_pos - key_pos] (clamped to the table) added to the scores,
    as the Triton kernel adds it (after the scale, in log2 units)."""
    from hayabusa.kernels.paged_attention import gather_kv

    n, H, D = q.shape
    H_kv = k_cache.shape[2]
    G = H // H_kv
    pos = torch.arange(seq_len - n, seq_len, device=q.device)                    # [n] query positions
    qf = q.float().view(n, H_kv, G, 1, D)
    m = torch.full((n, H_kv, G), float("-inf"), device=q.device)
    l_ = torch.zeros((n, H_kv, G), device=q.device)
    acc = torch.zeros((n, H_kv, G, D), device=q.device)
    hi = -(-seq_len // BI_TILE_N) * BI_TILE_N
    k_all = gather_kv(k_cache, block_row, 0, seq_len, k_scale)                    # [S, H_kv, D] fp32
    v_all = gather_kv(v_cache, block_row, 0, seq_len, v_scale)
    pad = hi - seq_len
    if pad:
        k_all = torch.cat([k_all, k_all.new_zeros(pad, H_kv, D)])
        v_all = torch.cat([v_all, v_all.new_zeros(pad, H_kv, D)])
    for t0 in range(0, hi, BI_TILE_N):
        keys = torch.arange(t0, t0 + BI_TILE_N, device=q.device)
        k = k_all[t0:t0 + BI_TILE_N].permute(1, 0, 2)[None, :, None]              # [1, H_kv, 1, N, D]
        vt = v_all[t0:t0 + BI_TILE_N].permute(1, 2, 0)[None, :, None]             # [1, H_kv, 1, D, N]
        s = (qf * k).sum(-1)                                                      # [n, H_kv, G, N]
        if softcap > 0:
            s = softcap * torch.tanh(s * (scale / softcap)) * _LOG2E
        else:
            s = s * (scale * _LOG2E)
        if position_bias is not None:
            dist = (pos[:, None] - keys[None, :]).clamp(0, position_bias.shape[1] - 1)      # [n, N]
            s = s + position_bias[:, dist].permute(1, 0, 2).reshape(n, H_kv, G, BI_TILE_N) * _LOG2E
        visible = (keys[None, :] <= pos[:, None]) & (keys[None, :] < seq_len)     # [n, N]
        if window > 0:
            visible &= keys[None, :] > pos[:, None] - window
        s = torch.where(visible[:, None, None, :], s, float("-inf"))
        m_new = torch.maximum(m, s.amax(-1))
        m_safe = torch.where(m_new > float("-inf"), m_new, 0.0)
        p = torch.exp2(s - m_safe[..., None])                                     # [n, H_kv, G, N]
        alpha = torch.exp2(m - m_safe)
        l_ = l_ * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + (p[..., None, :] * vt).sum(-1)             # [n, H_kv, G, D]
        m = m_new
    out = acc / torch.where(l_ > 0, l_, 1.0)[..., None]
    return out.reshape(n, H, D)


def paged_attention_bi_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                           query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                           scale: float, max_query_len: int, num_seqs: int | None = None,
                           sliding_window: int | None = None, softcap: float | None = None,
                           *, num_kv_splits: int | None = None, k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None, position_bias: torch.Tensor | None = None) -> None:
    """paged_attention_ref's batch-invariant twin (same arguments; the CPU attention of the mode).

    A query row at position p gets the same bits whatever else is in the step and however its prompt was chunked:
    its keys are walked in BI_TILE_N tiles from position 0 with the Triton kernel's online-softmax update, every
    reduction an inner-dim sum of fixed length (D or BI_TILE_N); keys a row cannot see add exact zeros. T5's
    ``position_bias`` [H, L] fp32 is added by distance (query position - key position), which depends on the
    row's position alone."""
    from hayabusa.kernels.paged_attention import ref_requests, ref_window_softcap

    window, cap = ref_window_softcap(sliding_window, softcap)
    for r, q_start, q_end, seq_len in ref_requests(query_start_loc, seq_lens, num_seqs):
        # One query row at a time, seeing keys 0..its position: every torch op then has a shape that depends on
        # the row's position alone. (Computed n rows at once, torch's CPU kernels split a tensor's elements into
        # SIMD vectors and a scalar tail by the tensor's size, and the two paths round exp2 / sums differently in
        # the last bit: a row's bits then depended on how many rows its chunk had.)
        first = seq_len - (q_end - q_start)
        for i in range(q_end - q_start):
            o = _bi_attend_one(q[q_start + i:q_start + i + 1], k_cache, v_cache, block_table[r], first + i + 1,
                               scale, window, cap, k_scale, v_scale, position_bias)
            out[q_start + i] = o[0].to(out.dtype)


__all__ = ["matmul_bi", "matmul_bi_ref", "matmul_bi_unsplit", "matmul_bi_unsplit_config", "linear_bi",
           "log_softmax_bi", "log_softmax_bi_ref", "paged_attention_bi_ref", "BI_TILE_N"]
