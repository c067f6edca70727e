"""What the per-token activation quantizers (``int8_quant.py``, ``fp8_quant.py``) share outside their kernels: the
launchers' input checks and the torch references' row scales. Plain torch; the kernels themselves stay apart."""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_per_token_quant_inputs(x: torch.Tensor, static_scale: torch.Tensor | None,
                                 scale_name: str = "static_scale") -> None:
    """A quantizer launcher's arguments: x [M, K] float32/float16/bfloat16 with K > 0 and a unit last stride;
    static_scale None or a one-element float32 tensor on x's device.

    Raises:
        ValueError: naming the argument (x, or static_scale under the caller's name for it, ``scale_name``).
    """
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype not in FLOAT_DTYPES:
        got = (tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x must be [M, K] float32/float16/bfloat16, got {got}")
    if x.shape[1] == 0:
        raise ValueError("x has K = 0 columns")
    if x.stride(1) != 1 and x.shape[0] > 0:
        raise ValueError(f"x needs a unit stride on the last dim, got strides {x.stride()}")
    if static_scale is not None and not (
            isinstance(static_scale, torch.Tensor) and static_scale.numel() == 1
            and static_scale.dtype == torch.float32 and static_scale.device == x.device):
        got = ((tuple(static_scale.shape), static_scale.dtype, str(static_scale.device))
               if isinstance(static_scale, torch.Tensor) else static_scale)
        raise ValueError(f"{scale_name} must be None or a one-element float32 tensor on {x.device}, got {got!r}")


def per_token_scales_ref(tf: torch.Tensor, static_scale: torch.Tensor | None, qmax: float,
                         min_scale: float) -> torch.Tensor:
    """The references' scales: [M, 1] fp32, max(amax(|row|) / qmax, min_scale) per row of ``tf`` ([M, K] fp32),
    or ``static_scale`` (any one-element float tensor) for every row. The amax is divided by a tensor holding
    qmax, not by the Python float: on CUDA torch computes ``t / 127.0`` as t * fl(1 / 127), an ulp off IEEE
    division for about half of all values; a tensor divisor is IEEE division on every device, as the kernels'
    ``div_rn``."""
    M = tf.shape[0]
    if static_scale is None:
        amax = tf.abs().amax(dim=-1, keepdim=True)                                         # [M, 1]
        return (amax / torch.full((1, 1), qmax, device=tf.device)).clamp_min(min_scale)
    return static_scale.float().reshape(1, 1).expand(M, 1).contiguous()
