"""Pipeline stages over a loaded model: each stage keeps only its decoder layers (vLLM's ``get_pp_indices``
split); stage 0 keeps the token (and GPT-2's position) embedding, the last stage the final norm and lm_head (and
the token embedding too when the lm_head is tied to it). The model files know nothing of ranks: their forward runs
layers ``[start_layer, end_layer)`` of their decoder stack, starts from ``intermediate`` (the previous stage's
hidden states and residual) when given one, and returns an IntermediateTensors instead of the final norm's output
when ``last_stage`` is False; ``stage_model`` sets those three attributes after loading.

    stage 0: embed -> layers [0, e0)      --(hidden, residual)--> stage 1: layers [e0, e1) -> ... -> last stage:
             layers [e_{M-2}, L) -> final norm -> logits -> sampler
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class IntermediateTensors:
    """What one stage hands the next within a step."""

    hidden: torch.Tensor     # [T, hidden] model dtype, the last local layer's output
    residual: torch.Tensor   # [T, hidden] model dtype, the residual stream beside it


class PPMissingLayer(nn.Module):
    """Stands where another stage's decoder layer (or embedding, final norm) was: holds no weights; the stage's
    forward never calls it."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("a pipeline stage ran a layer that another stage holds")


def decoder_stack(model: nn.Module) -> tuple[nn.Module, str]:
    """(the module holding the decoder layers and the stage attributes, the layer list's name)."""
    for inner in (getattr(model, "model", None), getattr(model, "transformer", None)):
        if inner is None:
            continue
        for name in ("layers", "h"):
            if isinstance(getattr(inner, name, None), nn.ModuleList):
                return inner, name
    raise ValueError(f"{type(model).__name__} has no decoder layer stack to split into pipeline stages")


def stage_model(model: nn.Module, start: int, end: int, first: bool, last: bool) -> nn.Module:
    """Keep layers [start, end) of a loaded model and what its stage needs around them; returns the model.

    Args:
        start, end: this stage's decoder layers (``get_pp_indices``).
        first: stage 0 (keeps the embeddings).
        last: the last stage (keeps the final norm and the lm_head; the token embedding too when tied).
    """
    inner, name = decoder_stack(model)
    layers = getattr(inner, name)
    for i in range(len(layers)):
        if not start <= i < end:
            layers[i] = PPMissingLayer()
    inner.start_layer, inner.end_layer, inner.last_stage = start, end, last
    tied = getattr(model, "lm_head", None) is None
    if not first:
        for emb in ("embed_tokens", "wte"):
            if hasattr(inner, emb) and not (last and tied):
                setattr(inner, emb, PPMissingLayer())
        if hasattr(inner, "wpe"):
            inner.wpe = PPMissingLayer()
    if not last:
        for norm in ("norm", "ln_f"):
            if hasattr(inner, norm):
                setattr(inner, norm, PPMissingLayer())
        if getattr(model, "lm_head", None) is not None:
            model.lm_head = PPMissingLayer()
    return model


def run_stage(model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor, ctx, hidden_size: int,
              dtype: torch.dtype) -> torch.Tensor | None:
    """This rank's share of one step's forward: after stage 0 receive the previous stage's hidden states and
    residual ([T, hidden_size] each, ``dtype``), run the stage's layers, and before the last stage send them on.

    Returns:
        hidden [T, hidden] after the final norm on the last stage; None on the others.
    """
    from hayabusa.distributed.parallel_state import pp_rank, pp_recv, pp_send, pp_size

    intermediate = None
    if pp_rank() > 0:
        T = input_ids.shape[0]
        hidden, residual = pp_recv([torch.empty(T, hidden_size, dtype=dtype, device=input_ids.device)
                                    for _ in range(2)])
        intermediate = IntermediateTensors(hidden, residual)
    out = model(input_ids, positions, ctx, intermediate=intermediate)
    if pp_rank() < pp_size() - 1:
        pp_send([out.hidden, out.residual])
        return None
    return out
