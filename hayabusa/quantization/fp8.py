"""FP8 W8A8: e4m3 weights with per-output-channel scales, activations quantized per token at run time.

Format: float8 e4m3 (``torch.float8_e4m3fn``: 4 exponent bits, 3 mantissa bits, no infinities, largest finite
value 448; Micikevicius et al., "FP8 Formats for Deep Learning", arXiv:2209.05433). A tensor t is stored as
q = round_e4m3(t / s) with a float32 scale s = amax / 448, and read back as q * s.

  y [M, N] = (x_q [M, K] @ w_q^T [K, N]) * s_x [M, 1] * s_w [1, N]   (+ bias)

with s_x one scale per token (row of x), computed for every call from that row's amax ("dynamic"), or one
calibrated scalar from the checkpoint (``input_scale``, "static"); s_w one scale per output channel.

Where the matmul runs:
  * CUDA, compute capability >= 8.9 (Ada, Hopper): ``torch._scaled_mm`` with row-wise scales (scale_a [M, 1]
    fp32, scale_b [1, N] fp32, w_q^T column-major, K and N multiples of 16: other shapes are zero-padded once at
    load and per call for x's K; output bf16, cast to the model dtype: older torch builds accept only bf16 for
    row-wise scaling on their CUTLASS path). x_q, s_x (and x's zero padding) come from one Triton launch,
    ``per_token_quant_fp8`` (kernels/fp8_quant.py), bit-identical to the torch ``quantize_fp8_rows``.
  * CPU: an exact emulation of the same numerics (same quantized x_q, s_x; the e4m3 products summed in fp32,
    then both scales), so ``hayabusa eval --fidelity`` on CPU measures the real quantization error.
  * CUDA below 8.9: refused at engine creation (``registry.check_device``); int8 / int4 weight-only run there.

Checkpoints (their config.json ``quantization_config``):
  * ``{"quant_method": "fp8", "activation_scheme": "dynamic" | "static", "ignored_layers": [...]}`` (vLLM's
    Fp8Config, AutoFP8 / llm-compressor "fp8" exports): ``weight`` e4m3 [N, K], ``weight_scale`` one fp32 per
    tensor (so a merged q/k/v has three: they become a per-channel vector, exactly), ``input_scale`` per tensor
    when static (merged shards take the largest, as vLLM does). ``weight_block_size`` (block-wise fp8, e.g.
    DeepSeek-V3 / Qwen3-FP8) is refused.
  * compressed-tensors (``compressed_tensors.py``): per-channel ``weight_scale [N, 1]`` or per-tensor.
  * ``quantization="fp8"`` on a bf16 / fp16 / fp32 checkpoint: each weight is quantized per channel after
    loading and its high-precision copy freed.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hayabusa.envs import env_flag
from hayabusa.errors import HayabusaValidationError
from hayabusa.kernels import fp8_gemv
from hayabusa.kernels.fp8_gemv import fp8_small_m_linear
from hayabusa.kernels.fp8_quant import (  # noqa: F401  (FP8_MAX, MIN_SCALE: re-exported)
    FP8_DTYPE,
    FP8_MAX,
    MIN_SCALE,
    per_token_quant_fp8,
    per_token_quant_fp8_ref,
)
from hayabusa.quantization.act_quant import QuantizedActivation
from hayabusa.quantization.base import (LinearMethod, QuantizationConfig, create_w8a8_checkpoint_params, is_ignored,
                                        make_param, per_channel_weight_scale, replace_param)

# FP8_DTYPE (float8_e4m3fn), FP8_MAX (448.0) and MIN_SCALE (the dynamic scale's floor, 1 / (448 * 512), as vLLM)
# come from kernels/fp8_quant.py, where the activation quantizer lives.
FP8_MIN_CAPABILITY = (8, 9)
# Decode-sized inputs (M <= kernels/fp8_gemv.FP8_SMALL_M_MAX rows) on the _scaled_mm path run fp8_small_m_linear:
# the activation quantization fused into a split-K Triton GEMV / 16-row GEMM that streams the e4m3 weights at
# bandwidth, where _scaled_mm at M = 1-16 does not (issue #25). HAYABUSA_FP8_SMALL_M=0 in the environment (read
# at import) or USE_FP8_SMALL_M = False (read at call time) turns it off, for A/B runs.
USE_FP8_SMALL_M = env_flag("HAYABUSA_FP8_SMALL_M", True)
# The engine sends only M <= FP8_SMALL_M_ENGINE_MAX rows there (the kernels take up to FP8_SMALL_M_MAX = 16). From
# the H200 sweep of session 11 (bench_quant_linear.py --fp8 --sweep, best launch per case, µs, Qwen2.5-7B layers,
# benchmarks/results/2026-12-02_h200_fp8bw.fp8_sweep.json; fused / quantize + _scaled_mm): M = 1 qkv 9.6 / 15.0,
# o 8.2 / 15.0, gate_up 48.0 / 52.7, down 31.5 / 59.6; M = 4 qkv 23.9 / 15.1, o 17.0 / 15.2, gate_up 155 / 50.3,
# down 100 / 54.4; M = 16 gate_up 111 / 49.3, down 71.5 / 54.5. So only one row pays (M = 2-3 not measured).
FP8_SMALL_M_ENGINE_MAX = 1
# Rows up to which an activation already quantized (by its producer: a QuantizedActivation from rms_norm_quant /
# silu_and_mul_quant, quantization/act_quant.py; or, from 2 rows, by per_token_quant_fp8 here) takes
# fp8_small_m_linear's XQ launches (no amax prologue, no per-program quantization) instead of _scaled_mm: at 4 and 16
# rows 1.4-2.5x faster than _scaled_mm on every 7B layer (H200, 2026-12-03; FP8Q_TABLE's note). W3 (one row) on the
# 7b shape 3.64 -> 3.13 ms per token, W4 at max_num_seqs 14 1,603 -> 2,076 out tok/s (BENCHMARKS.md, session 18).
FP8_PREQUANT_ENGINE_MAX = 16
# HAYABUSA_FP8_PREQUANT=0 (read at import) or USE_FP8_PREQUANT = False (call time): no XQ launches, the path before
# them (one row quantized inside the kernel, more rows on _scaled_mm), for A/B runs.
USE_FP8_PREQUANT = env_flag("HAYABUSA_FP8_PREQUANT", True)
# Fast accumulation on Hopper (fewer promotions of the partial sums to fp32 inside the tensor-core pipeline):
# the inference default of torchao's float8 path. Set False to trade speed for bit-closer agreement with the
# emulation.
USE_FAST_ACCUM = True


# ---------------------------------------------------------------------------------------------- numerics
def quantize_fp8_rows(t: torch.Tensor, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize each row of t [M, K] to e4m3.

    Args:
        t: [M, K], any float dtype.
        scale: optional fp32 scalar (static per-tensor scale); default one scale per row, amax / 448 (>= MIN_SCALE).
    Returns:
        (q [M, K] float8_e4m3fn, s [M, 1] float32 contiguous), t ~= q * s. The same bits on every device, and
        the same as the CUDA path's Triton kernel (kernels/fp8_quant.py: per_token_quant_fp8_ref).
    """
    return per_token_quant_fp8_ref(t, scale)


def fp8_matmul_emulated(xq: torch.Tensor, sx: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor,
                        out_dtype: torch.dtype) -> torch.Tensor:
    """What ``torch._scaled_mm`` computes, in plain torch: (xq [M, K] @ wq [N, K]^T) in fp32 (each e4m3 product is
    exact in fp32) times sx [M, 1] and sw [N] fp32, cast to ``out_dtype``. Any device."""
    acc = xq.float() @ wq.float().t()                  # [M, N] fp32
    return (acc * sx * sw.view(1, -1)).to(out_dtype)


def fp8_matmul_cuda(xq: torch.Tensor, sx: torch.Tensor, wq_t: torch.Tensor, sw_row: torch.Tensor,
                    out_dtype: torch.dtype) -> torch.Tensor:
    """``torch._scaled_mm`` with row-wise scales (CUDA, compute capability >= 8.9).

    Args:
        xq: [M, K] e4m3, row-major; K % 16 == 0.
        sx: [M, 1] fp32 contiguous.
        wq_t: [K, N] e4m3, column-major (the transpose of a contiguous [N, K]); N % 16 == 0.
        sw_row: [1, N] fp32 contiguous.
        out_dtype: bfloat16 (float16 / float32 only on newer torch or the cuBLAS path: the caller passes bf16).
    Returns:
        [M, N] out_dtype.
    """
    return torch._scaled_mm(xq, wq_t, scale_a=sx, scale_b=sw_row, out_dtype=out_dtype,
                            use_fast_accum=USE_FAST_ACCUM)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def use_small_m_kernel(M: int, prequantized: bool = False) -> bool:
    """Whether the _scaled_mm path runs M rows through fp8_small_m_linear (USE_FP8_SMALL_M; FP8_SMALL_M_ENGINE_MAX,
    or, for rows already quantized, USE_FP8_PREQUANT and FP8_PREQUANT_ENGINE_MAX, capped at the kernels'
    FP8_SMALL_M_MAX)."""
    if prequantized and not USE_FP8_PREQUANT:
        return False
    limit = FP8_PREQUANT_ENGINE_MAX if prequantized else FP8_SMALL_M_ENGINE_MAX
    return USE_FP8_SMALL_M and 0 < M <= min(limit, fp8_gemv.FP8_SMALL_M_MAX)


def has_fp8_matmul(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= FP8_MIN_CAPABILITY


# ---------------------------------------------------------------------------------------------- linear method
class Fp8LinearMethod(LinearMethod):
    """FP8 W8A8 on one Linear (module docstring).

    Args:
        checkpoint_fp8: the checkpoint holds e4m3 weights and scales (else: a high-precision weight quantized
            after loading).
        weight_strategy: "tensor" (one ``weight_scale`` per checkpoint tensor) or "channel" (``weight_scale``
            [N, 1]); only read when ``checkpoint_fp8``.
        static_input: the checkpoint has calibrated ``input_scale`` scalars (else per-token dynamic scales).

    After loading the layer holds ``weight`` [N', K'] e4m3 (N', K' = N, K rounded up to 16 on the _scaled_mm
    path, zero-padded), ``weight_scale`` [N'] fp32 and ``input_scale`` (fp32 scalar) or None.
    """

    def __init__(self, checkpoint_fp8: bool, weight_strategy: str = "channel", static_input: bool = False) -> None:
        assert weight_strategy in ("tensor", "channel")
        self.checkpoint_fp8 = checkpoint_fp8
        self.weight_strategy = weight_strategy
        self.static_input = static_input

    def create_weights(self, layer, in_features, output_sizes, dtype, device):
        if not self.checkpoint_fp8:
            make_param(layer, "weight", torch.empty(sum(output_sizes), in_features, dtype=dtype, device=device))
            return
        create_w8a8_checkpoint_params(layer, in_features, output_sizes, device, FP8_DTYPE, self.weight_strategy,
                                      self.static_input)

    def process_weights_after_loading(self, layer):
        w = layer.weight.data
        if not self.checkpoint_fp8:
            wq, sw = quantize_fp8_rows(w)                       # [N, K] e4m3, [N, 1] fp32
            sw = sw.view(-1)
        else:
            wq = w
            sw = per_channel_weight_scale(layer, self.weight_strategy)
        si = layer.input_scale.data.float().max() if self.static_input else None
        layer.fp8_scaled_mm = has_fp8_matmul(w.device)
        N, K = wq.shape
        if layer.fp8_scaled_mm and (N % 16 or K % 16):          # _scaled_mm needs K, N multiples of 16
            Np, Kp = _round_up(N, 16), _round_up(K, 16)
            wq = F.pad(wq.view(torch.uint8), (0, Kp - K, 0, Np - N)).view(FP8_DTYPE)   # zero bytes = +0.0
            sw = F.pad(sw, (0, Np - N), value=1.0)
        replace_param(layer, "weight", wq.contiguous())
        replace_param(layer, "weight_scale", sw.contiguous())
        replace_param(layer, "input_scale", si)

    def input_quant(self, layer, M):
        """"fp8" for per-token dynamic activations, except where ``apply`` would not quantize x separately: a
        static input scale, a weight zero-padded in K (x's padding columns), and the decode-sized rows of
        ``fp8_small_m_linear`` when it may not take them pre-quantized (it then quantizes inside its GEMV)."""
        if self.static_input:
            return None
        if layer.fp8_scaled_mm and layer.weight.shape[1] != layer.in_features:
            return None
        if layer.fp8_scaled_mm and use_small_m_kernel(M) and not use_small_m_kernel(M, prequantized=True):
            return None
        return "fp8"

    @staticmethod
    def _takes_xq_launch(layer, M: int, dtype: torch.dtype) -> bool:
        """Whether M already-quantized rows of a ``dtype`` activation go to fp8_small_m_linear's XQ launch: the
        _scaled_mm path (sm89+), bf16 (the kernel's fp16 cases were not measured), 1..FP8_PREQUANT_ENGINE_MAX
        rows."""
        return (bool(getattr(layer, "fp8_scaled_mm", False)) and dtype == torch.bfloat16
                and use_small_m_kernel(M, prequantized=True)
                and (layer.bias is None or layer.bias.dtype == dtype))

    def prefers_quantized_input(self, layer, M, dtype):
        """Where the rows then take the small-M kernel's XQ launch (no quantization step, the weights stream at
        once; H200, 2026-12-03: BENCHMARKS.md, eighteenth session)."""
        return self._takes_xq_launch(layer, M, dtype)

    def apply(self, layer, x):
        if isinstance(x, QuantizedActivation):  # quantized by the kernel that made x (input_quant): [M, K] e4m3
            if self._takes_xq_launch(layer, x.xq.shape[0], x.dtype):
                # decode-sized M: the weights stream at once (no quantization step in the kernel)
                return fp8_small_m_linear(x.xq, layer.weight, layer.weight_scale, layer.bias, None,
                                          layer.out_features, x_scale=x.scale, out_dtype=x.dtype)
            return self._matmul(layer, x.xq, x.scale, x.dtype)
        lead, K = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, K)
        N = layer.out_features
        w = layer.weight
        if layer.fp8_scaled_mm:
            if x2.stride(-1) != 1:
                x2 = x2.contiguous()
            # bf16 only: in run AF (H200, 2026-12-02) the kernel's fp16 cases of tests/kernels/test_fp8_gemv_cuda.py
            # (M = 16 on every 7b layer, M = 1 / 3 on gate_up and down) failed their bound; every bf16 case passed
            if (use_small_m_kernel(x2.shape[0]) and x2.dtype == torch.bfloat16
                    and (layer.bias is None or layer.bias.dtype == x.dtype)):
                # decode-sized M: one Triton kernel quantizes x and multiplies (bias included), at weight bandwidth
                y = fp8_small_m_linear(x2, w, layer.weight_scale, layer.bias, layer.input_scale, N)
                return y.reshape(*lead, N)
            # one Triton launch (not ~7 torch ops): per-token scales and e4m3 rows, zero columns up to the padded
            # K' of the weight; the same bits as quantize_fp8_rows
            xq, sx = per_token_quant_fp8(x2, layer.input_scale, out_cols=w.shape[1])
            if layer.input_scale is None and self._takes_xq_launch(layer, x2.shape[0], x2.dtype):
                # 2..FP8_PREQUANT_ENGINE_MAX rows (o_proj's, and any linear whose producer did not quantize): the
                # XQ launch on the quantized rows (x's zero columns meet the weight's zero padding)
                y = fp8_small_m_linear(xq, w, layer.weight_scale, layer.bias, None, N, x_scale=sx,
                                       out_dtype=x.dtype)
                return y.reshape(*lead, N)
        else:
            xq, sx = quantize_fp8_rows(x2, layer.input_scale)
        return self._matmul(layer, xq, sx, x.dtype).reshape(*lead, N)

    @staticmethod
    def _matmul(layer, xq: torch.Tensor, sx: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """xq [M, K'] e4m3, sx [M, 1] fp32 -> y [M, N] out_dtype (+ bias): _scaled_mm or its CPU emulation."""
        N = layer.out_features
        if layer.fp8_scaled_mm:
            # bf16 out whatever the model dtype: the one row-wise output type every torch version (CUTLASS or
            # cuBLAS path) accepts; its rounding (2^-9) is far below the e4m3 error (2^-4).
            y = fp8_matmul_cuda(xq, sx, layer.weight.t(), layer.weight_scale.view(1, -1), torch.bfloat16)
            if y.shape[1] != N:
                y = y[:, :N]
            y = y.to(out_dtype).contiguous()
        else:
            y = fp8_matmul_emulated(xq, sx, layer.weight, layer.weight_scale, out_dtype)
        if layer.bias is not None:
            y = y + layer.bias
        return y


# ---------------------------------------------------------------------------------------------- config
class Fp8Config(QuantizationConfig):
    """vLLM's "fp8": an FP8 checkpoint (``{"quant_method": "fp8", ...}``) or online quantization.

    Args:
        checkpoint_fp8: weights are stored in e4m3 (else quantized after loading).
        activation_scheme: "dynamic" (per-token scales at run time) or "static" (checkpoint ``input_scale``).
        ignored_layers: checkpoint module names (or ``re:`` patterns) left unquantized.
    """

    name = "fp8"
    cpu_supported = True
    min_capability = FP8_MIN_CAPABILITY
    capability_note = "(Ada, Hopper: FP8 tensor cores)"

    def __init__(self, checkpoint_fp8: bool, activation_scheme: str = "dynamic",
                 ignored_layers: list[str] | tuple[str, ...] = ()) -> None:
        self.checkpoint_fp8 = checkpoint_fp8
        self.activation_scheme = activation_scheme
        self.ignored_layers = list(ignored_layers)

    @classmethod
    def from_hf_config(cls, qc: dict[str, Any]) -> "Fp8Config":
        block = qc.get("weight_block_size")
        if block:
            raise HayabusaValidationError(
                f"block-wise FP8 checkpoints (weight_block_size={block}) are not supported yet; hayabusa runs FP8 "
                "checkpoints with per-tensor or per-channel weight scales.", parameter="quantization", value="fp8")
        scheme = qc.get("activation_scheme", "dynamic")
        if scheme not in ("dynamic", "static"):
            raise HayabusaValidationError(f"fp8 activation_scheme {scheme!r} is not supported (dynamic or static).",
                                          parameter="quantization", value="fp8")
        fmt = qc.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise HayabusaValidationError(f"fp8 checkpoints in format {fmt!r} are not supported (only e4m3).",
                                          parameter="quantization", value="fp8")
        ignored = list(qc.get("ignored_layers") or []) + list(qc.get("modules_to_not_convert") or [])
        return cls(True, scheme, ignored)

    @classmethod
    def online(cls) -> "Fp8Config":
        return cls(False, "dynamic")

    def get_linear_method(self, layer_prefix: str, layer: nn.Module) -> LinearMethod | None:
        if is_ignored(layer_prefix, layer, self.ignored_layers):
            return None
        return Fp8LinearMethod(self.checkpoint_fp8, "tensor" if self.checkpoint_fp8 else "channel",
                               static_input=self.activation_scheme == "static")
