"""T5 in fp16: residual add + transformers' fp16 clamp + T5LayerNorm in one launch (kernel + launcher + reference).

The fp16 branch of ``model/t5.py``'s ``_add_norm`` (transformers' numerics, see that module's docstring):

    x = delta if residual is None else residual + delta     # the sum rounded to the promoted dtype
    if x is fp16: x = clamp(x, -L, L), L = (fp16 max - 1000 if ANY element of x is inf else fp16 max)
    normed = weight * (x.float() * rsqrt(mean(x.float() ** 2) + eps)).to(fp16)   # the product rounded to fp16

In torch that is 8-10 small kernels (add, isinf, any, where, clamp, cast, pow, mean, rsqrt, mul, cast, mul).

The clamp's condition is global: one inf anywhere in the [T, d] sum lowers the limit of every row (a row-local
decision would differ from transformers on the other rows' values in (fp16 max - 1000, fp16 max]). Without an inf
the clamp is the identity (fp16 has no finite value past its max), so the kernel computes every row unclamped, one
program per row, and a row that holds an inf sets a device flag. Every program then takes a ticket from a device
counter; the last one to arrive (acquire: every other program's flag write and stores are visible) resets the flag
and the counter, and when the flag was set recomputes all T rows with the lowered limit (``FP16_CLAMP_INF``:
fp16 max - 1000 rounded to fp16, 64512, as torch.clamp casts the limit to the tensor's dtype), overwriting them. So
the common case is one launch and no host sync; the overflow case (rare: only the first block's attention sums are
fp16) costs one serial pass in that launch. The flag and counter (``_sync_buffer``, one int32 pair per device, zero
between launches) make the launch capturable in a CUDA graph. A sum in fp32 (an fp32 delta or residual) is not
clamped: no flag, no counter.

``fused_norm.add_rms_norm_row`` is not reused: its add rounds to the input dtype and stores the sum before any clamp.
"""

from __future__ import annotations

import torch

from hayabusa.errors import HayabusaValidationError
from hayabusa.kernels._triton import next_power_of_2, tl, triton

FP16_MAX = torch.finfo(torch.float16).max
# transformers' limit once an inf appeared, as torch.clamp applies it to an fp16 tensor (cast to fp16: 64512.0)
FP16_CLAMP_INF = float(torch.tensor(FP16_MAX - 1000).to(torch.float16))
_FLOAT_TYPES = (torch.float16, torch.float32)


@triton.jit
def _t5_fp16_row(d_ptr, r_ptr, w_ptr, out_ptr, ro_ptr, row, stride_d, stride_r, stride_o, stride_ro, N, eps,
                 offs, mask, limit, HAS_RES: tl.constexpr, CLAMP: tl.constexpr, STORE_RES: tl.constexpr,
                 FP16_SUM: tl.constexpr):
    """One row: the sum rounded to fp16 (FP16_SUM) or fp32, clamped to [-limit, limit] when CLAMP (NaN kept, as
    torch.clamp), stored to res_out when STORE_RES; T5LayerNorm of it stored to out (fp16). Returns whether the
    unclamped sum holds an inf (int32 0 / 1)."""
    x = tl.load(d_ptr + row * stride_d + offs, mask=mask, other=0.0)
    sf = x.to(tl.float32)
    if HAS_RES:
        sf = tl.load(r_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32) + sf
    if FP16_SUM:
        sf = sf.to(tl.float16).to(tl.float32)                             # the sum rounded to fp16 (no-op: x fp16)
    has_inf = tl.max((tl.abs(sf) > 65504.0).to(tl.int32), axis=0)   # past fp16's max: an inf (NaN compares false)
    if CLAMP:
        sf = tl.where(sf > limit, limit, tl.where(sf < -limit, -limit, sf))
    if STORE_RES:
        tl.store(ro_ptr + row * stride_ro + offs, sf.to(ro_ptr.dtype.element_ty), mask=mask)
    var = tl.sum(sf * sf, axis=0) / N
    normed = (sf * tl.math.rsqrt(var + eps)).to(tl.float16)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    y = (normed.to(tl.float32) * w.to(tl.float32)).to(tl.float16)         # fp16 * fp16 rounded to fp16
    tl.store(out_ptr + row * stride_o + offs, y, mask=mask)
    return has_inf


@triton.jit
def _t5_fp16_add_norm_kernel(d_ptr, r_ptr, w_ptr, out_ptr, ro_ptr, sync_ptr, T, stride_d, stride_r, stride_o,
                             stride_ro, N, eps, limit_inf, HAS_RES: tl.constexpr, FP16_SUM: tl.constexpr,
                             STORE_RES: tl.constexpr, BLOCK: tl.constexpr):
    """One program per row (grid (T,)); see the module docstring."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    # no inf: the clamp is the identity, so the unclamped row is already the answer
    has_inf = _t5_fp16_row(d_ptr, r_ptr, w_ptr, out_ptr, ro_ptr, row, stride_d, stride_r, stride_o, stride_ro, N,
                           eps, offs, mask, limit_inf, HAS_RES, False, STORE_RES, FP16_SUM)
    if FP16_SUM:   # sync_ptr[0]: "an inf somewhere" flag, sync_ptr[1]: arrival counter; both zero between launches
        if has_inf != 0:
            tl.atomic_or(sync_ptr, 1, sem="relaxed", scope="gpu")
        tl.debug_barrier()                     # every thread's stores and the flag before the release below
        arrived = tl.atomic_add(sync_ptr + 1, 1, sem="acq_rel", scope="gpu")
        if arrived == T - 1:                   # the last program: every other program's flag and rows visible
            tl.debug_barrier()
            any_inf = tl.atomic_xchg(sync_ptr, 0, sem="acq_rel", scope="gpu")
            tl.atomic_xchg(sync_ptr + 1, 0, sem="relaxed", scope="gpu")
            if any_inf != 0:                   # transformers' lowered limit on every row
                for r in range(0, T):
                    _t5_fp16_row(d_ptr, r_ptr, w_ptr, out_ptr, ro_ptr, tl.cast(r, tl.int64), stride_d, stride_r,
                                 stride_o, stride_ro, N, eps, offs, mask, limit_inf, HAS_RES, True, True, FP16_SUM)


_SYNC: dict[torch.device, torch.Tensor] = {}


def reserve_t5_fp16_norm_sync(device: torch.device | str) -> torch.Tensor:
    """Allocate (once per device) the kernel's int32 [2] flag + counter, zero between launches (each launch leaves
    them at zero). Call it before CUDA-graph capture (``model/t5.py`` does when it builds an fp16 model on CUDA).
    Launches that use it must not overlap (the engine's forward runs on one stream)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    buf = _SYNC.get(device)
    if buf is None:
        buf = torch.zeros(2, dtype=torch.int32, device=device)
        _SYNC[device] = buf
    return buf


def _sync_buffer(device: torch.device) -> torch.Tensor | None:
    """The device's flag + counter; None while a CUDA graph is being captured and it is missing (allocating there
    would tie it to the graph's pool): that call runs the torch reference instead."""
    if device in _SYNC:
        return _SYNC[device]
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    return reserve_t5_fp16_norm_sync(device)


def _check(delta: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor) -> None:
    if not isinstance(delta, torch.Tensor) or delta.dim() != 2 or delta.dtype not in _FLOAT_TYPES or \
            (delta.numel() and delta.stride(-1) != 1):
        raise HayabusaValidationError(
            f"delta must be a [T, d] float16 / float32 tensor with a unit last stride, got "
            f"{getattr(delta, 'shape', type(delta))} {getattr(delta, 'dtype', '')}", parameter="delta",
            value=tuple(getattr(delta, "shape", ())))
    if residual is not None and (not isinstance(residual, torch.Tensor) or residual.shape != delta.shape or
                                 residual.dtype not in _FLOAT_TYPES or
                                 (residual.numel() and residual.stride(-1) != 1) or
                                 residual.device != delta.device):
        raise HayabusaValidationError(
            f"residual must be None or a float16 / float32 tensor of delta's shape {tuple(delta.shape)} on its "
            f"device with a unit last stride, got {getattr(residual, 'shape', type(residual))} "
            f"{getattr(residual, 'dtype', '')}", parameter="residual", value=tuple(getattr(residual, "shape", ())))
    if not isinstance(weight, torch.Tensor) or weight.dtype != torch.float16 or \
            tuple(weight.shape) != (delta.shape[1],) or weight.device != delta.device or \
            (weight.numel() and weight.stride(0) != 1):
        raise HayabusaValidationError(
            f"weight must be a contiguous float16 [{delta.shape[1]}] tensor on delta's device, got "
            f"{getattr(weight, 'shape', type(weight))} {getattr(weight, 'dtype', '')}", parameter="weight",
            value=tuple(getattr(weight, "shape", ())))


def t5_fp16_add_norm(delta: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' fp16 T5 sub-layer boundary in one launch: (normed, new residual).

    delta [T, d] fp16 or fp32 (a sub-layer's output), residual None or [T, d] fp16 or fp32 (the stream before it),
    weight [d] fp16 (the T5LayerNorm's), eps: its epsilon. Returns normed [T, d] fp16 and the new residual [T, d]
    in the promoted dtype (fp32 if delta or residual is fp32, else fp16: then clamped as transformers does, the
    limit lowered on every row when any element of the sum is inf; see the module docstring). With residual None
    and an fp32 delta the new residual is delta itself. Same bits as ``t5_fp16_add_norm_ref`` on the residual;
    normed within one fp16 ulp (the fp32 sum of squares is reduced in another order). No host sync; capturable in
    a CUDA graph.

    Raises:
        HayabusaValidationError (a ValueError): delta, residual or weight of the wrong shape, dtype, device or
            stride (``parameter`` names it).
    """
    _check(delta, residual, weight)
    T, N = delta.shape
    fp32_sum = delta.dtype == torch.float32 or (residual is not None and residual.dtype == torch.float32)
    if residual is None and fp32_sum:
        res_out = None                                             # the stream is delta itself (nothing to clamp)
    else:
        res_out = torch.empty(T, N, dtype=torch.float32 if fp32_sum else torch.float16, device=delta.device)
    out = torch.empty(T, N, dtype=torch.float16, device=delta.device)
    if T == 0:
        return out, (delta if res_out is None else res_out)
    sync = None
    if not fp32_sum:
        sync = _sync_buffer(delta.device)
        if sync is None:
            return t5_fp16_add_norm_ref(delta, residual, weight, eps)
    BLOCK = next_power_of_2(N)
    ro = res_out if res_out is not None else delta                   # (not stored: the stream stays delta)
    r = residual if residual is not None else delta
    _t5_fp16_add_norm_kernel[(T,)](
        delta, r, weight, out, ro, sync if sync is not None else out, T, delta.stride(0), r.stride(0), out.stride(0),
        ro.stride(0), N, float(eps), FP16_CLAMP_INF, HAS_RES=residual is not None, FP16_SUM=not fp32_sum,
        STORE_RES=res_out is not None, BLOCK=BLOCK, num_warps=4 if BLOCK <= 4096 else 8)
    return out, (delta if res_out is None else res_out)


def t5_fp16_add_norm_ref(delta: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch, transformers' ops (the CPU path of ``model/t5.py``'s ``_add_norm``): same arguments and
    results as ``t5_fp16_add_norm``."""
    x = delta if residual is None else residual + delta            # fp16 + fp32 -> fp32, as in transformers
    if x.dtype == torch.float16:
        limit = torch.where(torch.isinf(x).any(), FP16_MAX - 1000, FP16_MAX)
        x = torch.clamp(x, min=-limit, max=limit)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(torch.float16), x


__all__ = ["FP16_CLAMP_INF", "reserve_t5_fp16_norm_sync", "t5_fp16_add_norm", "t5_fp16_add_norm_ref"]
