"""EagleHeadConfig: an EAGLE / EAGLE-3 head checkpoint's config (speculative methods "eagle" / "eagle3"), checked
against the target at the edge. The head's layout is described in ``hayabusa/model/eagle.py``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hayabusa.errors import HayabusaValidationError

# Targets whose hidden states the heads read (Llama-shaped decoders with the aux-state hook of model/llama.py).
EAGLE_TARGET_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM")


def default_aux_layer_ids(num_target_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's default target layers (vLLM's and the EAGLE repo's): (2, L // 2, L - 3); the hidden state taken at
    id i is the residual stream entering layer i."""
    L = num_target_layers
    return 2, L // 2, L - 3


def _bad(name: str, value: Any, why: str) -> HayabusaValidationError:
    return HayabusaValidationError(f"speculative_config {name}={value!r}: {why}", parameter=f"speculative_config.{name}",
                                   value=value)


@dataclass
class EagleHeadConfig:
    """What the runner needs of a head (duck-types the ModelConfig fields the KV cache reads: its KV bytes per token
    come from config.py's formula on num_layers / num_kv_heads / head_dim, worker/kv_cache.py).

    Attributes:
        method: "eagle" or "eagle3".
        model: the head's folder (resolved).
        hf_config: its config.json (a transformers config).
        dtype: the target's dtype (the head runs in it).
        max_model_len: the target's.
        aux_layer_ids: EAGLE-3: the target layers whose entering residual stream feeds ``fc`` (low, mid, high);
            EAGLE-1: ().
        num_layers / num_kv_heads / head_dim: the head's KV cache shape (one layer).
        load_format: the target's ("pt" allows pickle checkpoints).
    """

    method: str
    model: str
    hf_config: Any
    dtype: torch.dtype
    max_model_len: int
    aux_layer_ids: tuple[int, ...]
    num_kv_heads: int
    head_dim: int
    load_format: str = "auto"
    num_layers: int = 1
    is_encoder_decoder: bool = False

    def tensor_names(self) -> list[str]:
        """The checkpoint's tensor names (safetensors: read from the headers, no tensor loaded)."""
        from hayabusa.model.loader import checkpoint_files

        kind, files = checkpoint_files(self.model, self.load_format == "pt")
        if kind == "safetensors":
            from safetensors import safe_open

            names: list[str] = []
            for path in files:
                with safe_open(path, framework="pt", device="cpu") as f:
                    names.extend(f.keys())
            return names
        names = []
        for path in files:
            names.extend(torch.load(path, map_location="cpu", weights_only=True).keys())
        return names

    @classmethod
    def from_target(cls, method: str, model: str, target_config: Any, trust_remote_code: bool = False,
                    load_format: str = "auto") -> "EagleHeadConfig":
        """Read the head's config.json and check it against the target's ModelConfig.

        Raises:
            HayabusaValidationError: the target is not a Llama / Qwen2 decoder, or the head's hidden size,
                vocabulary or aux layer ids do not fit it (named).
        """
        from transformers import AutoConfig

        from hayabusa.model.loader import resolve_model_dir

        if target_config.architecture not in EAGLE_TARGET_ARCHITECTURES:
            raise _bad("method", method, f"needs a {' / '.join(EAGLE_TARGET_ARCHITECTURES)} target; this one is "
                                         f"{target_config.architecture}.")
        model_dir = resolve_model_dir(model, allow_pt=load_format == "pt")
        hf = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
        hf = hf.get_text_config() if hasattr(hf, "get_text_config") else hf
        target_hf = target_config.hf_config
        H = hf.hidden_size
        target_H = getattr(hf, "target_hidden_size", None) or H
        if target_H != target_hf.hidden_size or (method == "eagle" and H != target_hf.hidden_size):
            raise _bad("model", model, f"the head's hidden size ({target_H}) is not the target's "
                                       f"({target_hf.hidden_size}).")
        if hf.vocab_size != target_config.vocab_size:
            raise _bad("model", model, f"the head's vocabulary ({hf.vocab_size}) is not the target's "
                                       f"({target_config.vocab_size}).")
        aux: tuple[int, ...] = ()
        if method == "eagle3":
            L = target_hf.num_hidden_layers
            eagle_cfg = getattr(hf, "eagle_config", None) or {}
            ids = eagle_cfg.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle_cfg, dict) else None
            aux = tuple(int(i) for i in ids) if ids else default_aux_layer_ids(L)
            if len(aux) != 3 or not all(0 <= i < L for i in aux):
                raise _bad("model", model, f"EAGLE-3 needs three target layer ids in [0, {L}); the head gives "
                                           f"{list(aux)} (eagle_config.eagle_aux_hidden_state_layer_ids, or the "
                                           f"default (2, L // 2, L - 3) for a {L}-layer target).")
        heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or H // heads
        kv_heads = getattr(hf, "num_key_value_heads", None) or heads
        return cls(method, model_dir, hf, target_config.dtype, target_config.max_model_len, aux, kv_heads, head_dim,
                   load_format=load_format)
