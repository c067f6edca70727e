"""Weight-only quantization without kernels: plain-torch references of hayabusa.kernels.quant_linear (also its CPU
path), and the quantizers and int4 packers that produce its layouts (see that module's docstring: int8 per output
channel; int4 grouped along K in GPTQ's packing, eight consecutive input rows per int32, low nibble first)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Activation / weight dtypes the weight-only linears take (the kernels in quant_linear.py check the same set).
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def dequantize_int8(qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """qweight [N, K] int8, scales [N] -> W [N, K] float32."""
    return qweight.float() * scales.float()[:, None]


def dequantize_int4(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                    group_size: int) -> torch.Tensor:
    """qweight [K // 8, N] int32, scales/zeros [K // G, N] -> W [N, K] float32 (nn.Linear's orientation)."""
    q = unpack_int4(qweight).float()                                   # [K, N]
    s = scales.float().repeat_interleave(group_size, dim=0)            # [K, N]
    z = zeros.float().repeat_interleave(group_size, dim=0)
    return ((q - z) * s).t()


def dequantize_int8_to_ref(qweight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """dequantize_int8_to in plain torch: q * s in fp32, rounded once to dtype -> [N, K]."""
    return dequantize_int8(qweight, scales).to(dtype)


def dequantize_int4_to_ref(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                           dtype: torch.dtype) -> torch.Tensor:
    """dequantize_int4_to in plain torch: (q - z) * s in fp32, rounded once to dtype -> [N, K]."""
    return dequantize_int4(qweight, scales, zeros, group_size).to(dtype)


def int8_weight_only_linear_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                                bias: torch.Tensor | None = None) -> torch.Tensor:
    """Plain-torch int8_weight_only_linear: dequantize, F.linear in fp32, cast back (also the CPU path)."""
    b = bias.float() if bias is not None else None
    return F.linear(x.float(), dequantize_int8(qweight, scales), b).to(x.dtype)


def int4_weight_only_linear_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                                group_size: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Plain-torch int4_weight_only_linear: dequantize, F.linear in fp32, cast back (also the CPU path)."""
    b = bias.float() if bias is not None else None
    return F.linear(x.float(), dequantize_int4(qweight, scales, zeros, group_size), b).to(x.dtype)


# ------------------------------------------------------------------------------------------ quantize and pack
def _round_up_to(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 scale (> 0) -> dtype, rounded up, so that |w| / stored scale never exceeds the integer range."""
    s = scale.to(dtype)
    if dtype == torch.float32:
        return s
    bumped = (s.view(torch.int16) + 1).view(dtype)  # next representable value (positive, finite)
    return torch.where(s.float() < scale, bumped, s)


def quantize_int8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: w [N, K] float -> (qweight [N, K] int8, scales [N] w.dtype).

    scale = absmax / 127 (rounded up to w.dtype, at least its smallest normal: an all-zero row gets q = 0 and a
    tiny scale), q = round(w / scale) in [-127, 127]; |w - q * scale| <= scale / 2.
    Raises:
        ValueError: w is not a 2-D float tensor.
    """
    if w.dim() != 2 or w.dtype not in FLOAT_DTYPES:
        raise ValueError(f"w must be [N, K] float16/bfloat16/float32, got {tuple(w.shape)} {w.dtype}")
    wf = w.float()
    absmax = wf.abs().amax(dim=1).clamp_min(torch.finfo(w.dtype).tiny * 127)
    scales = _round_up_to(absmax / 127.0, w.dtype)
    q = torch.round(wf / scales.float()[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scales


def quantize_int4_grouped(w: torch.Tensor, group_size: int = 128) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric round-to-nearest int4 over groups of G consecutive k (GPTQ's min/max grid without GPTQ's error
    feedback): w [N, K] float -> (qweight [K // 8, N] int32, scales [K // G, N], zeros [K // G, N]), w.dtype.

    Per group and output channel: lo = min(w, 0), hi = max(w, 0) (zero stays representable), scale =
    (hi - lo) / 15 rounded up to w.dtype, zero = round(-lo / scale) in 0..15, q = clamp(round(w / scale) + zero,
    0, 15); |w - (q - zero) * scale| <= scale / 2.
    Raises:
        ValueError: w is not a 2-D float tensor, or G is not a multiple of 8 dividing K (names K and G).
    """
    if w.dim() != 2 or w.dtype not in FLOAT_DTYPES:
        raise ValueError(f"w must be [N, K] float16/bfloat16/float32, got {tuple(w.shape)} {w.dtype}")
    N, K = w.shape
    check_group_size(K, group_size)
    wg = w.float().t().reshape(K // group_size, group_size, N)          # [groups, G, N]
    lo = wg.amin(dim=1).clamp_max(0.0)
    hi = wg.amax(dim=1).clamp_min(0.0)
    scales = _round_up_to(((hi - lo) / 15.0).clamp_min(torch.finfo(w.dtype).tiny), w.dtype)   # [groups, N]
    sf = scales.float()
    zeros = torch.round(-lo / sf).clamp_(0, 15)
    q = (torch.round(wg / sf[:, None, :]) + zeros[:, None, :]).clamp_(0, 15)
    return pack_int4(q.reshape(K, N).to(torch.uint8)), scales, zeros.to(w.dtype)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q [K, N] integers 0..15 (uint8 or any int dtype) -> int32 [K // 8, N], k = 8i + j in bits 4j..4j+3.

    Raises:
        ValueError: q is not 2-D integer, K is not a multiple of 8, or a value is outside 0..15.
    """
    if q.dim() != 2 or q.dtype.is_floating_point or q.dtype == torch.bool or q.shape[0] % 8 != 0:
        raise ValueError(f"q must be [K, N] integers with K a multiple of 8, got {tuple(q.shape)} {q.dtype}")
    if q.numel() and (int(q.min()) < 0 or int(q.max()) > 15):
        raise ValueError(f"q values must be in 0..15, got min {int(q.min())} max {int(q.max())}")
    K, N = q.shape
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=q.device)
    packed = (q.to(torch.int64).view(K // 8, 8, N) << shifts[None, :, None]).sum(dim=1)  # [K // 8, N], < 2**32
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """int32 [K // 8, N] (pack_int4's layout) -> uint8 [K, N] values 0..15.

    Raises:
        ValueError: packed is not a 2-D int32 tensor.
    """
    if packed.dim() != 2 or packed.dtype != torch.int32:
        raise ValueError(f"packed must be [K // 8, N] int32, got {tuple(packed.shape)} {packed.dtype}")
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    q = (packed[:, None, :] >> shifts[None, :, None]) & 0xF                   # [K // 8, 8, N]
    return q.reshape(-1, packed.shape[1]).to(torch.uint8)


def check_group_size(K: int, group_size: int) -> None:
    """Raises ValueError unless group_size is a positive multiple of 8 that divides K."""
    if not isinstance(group_size, int) or group_size <= 0 or group_size % 8 != 0 or K % group_size != 0:
        raise ValueError(f"group_size must be a positive multiple of 8 that divides K; got group_size (G) = "
                         f"{group_size}, K = {K}")
