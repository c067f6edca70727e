"""Tiny random EAGLE-1 / EAGLE-3 heads written in the public checkpoint formats (SafeAILab/EAGLE's tensor names and
config keys; see hayabusa/model/eagle.py), for a tiny target checkpoint."""

from __future__ import annotations

import json
import os

import torch


def _target_config(target_dir: str) -> dict:
    with open(os.path.join(target_dir, "config.json")) as f:
        return json.load(f)


def write_eagle_head(target_dir: str, out: str, eagle3: bool, seed: int = 0, aux_ids: list[int] | None = None,
                     draft_vocab_size: int | None = None, own_embed: bool = False) -> dict[str, torch.Tensor]:
    """Write ``out``/config.json and ``out``/model.safetensors; returns the tensors (public names)."""
    from safetensors.torch import save_file

    t = _target_config(target_dir)
    H, V = t["hidden_size"], t["vocab_size"]
    heads, kv_heads, inter = t["num_attention_heads"], t["num_key_value_heads"], t["intermediate_size"]
    D = H // heads
    qwen2 = t["model_type"] == "qwen2"
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, std=0.2):
        return (torch.randn(*shape, generator=g) * std).contiguous()

    prefix = "midlayer." if eagle3 else "layers.0."
    attn_in = 2 * H if eagle3 else H
    w = {
        prefix + "self_attn.q_proj.weight": rnd(heads * D, attn_in),
        prefix + "self_attn.k_proj.weight": rnd(kv_heads * D, attn_in),
        prefix + "self_attn.v_proj.weight": rnd(kv_heads * D, attn_in),
        prefix + "self_attn.o_proj.weight": rnd(H, heads * D),
        prefix + "mlp.gate_proj.weight": rnd(inter, H),
        prefix + "mlp.up_proj.weight": rnd(inter, H),
        prefix + "mlp.down_proj.weight": rnd(H, inter),
        prefix + "post_attention_layernorm.weight": 1 + rnd(H, std=0.1),
    }
    if qwen2:
        for n, size in (("q", heads * D), ("k", kv_heads * D), ("v", kv_heads * D)):
            w[prefix + f"self_attn.{n}_proj.bias"] = rnd(size, std=0.5)
    cfg = {k: v for k, v in t.items() if k != "layer_types"}
    cfg.update(num_hidden_layers=1, tie_word_embeddings=False)
    if eagle3:
        Vd = draft_vocab_size or V
        target_ids = torch.sort(torch.randperm(V, generator=g)[:Vd]).values
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[target_ids] = True
        w.update({prefix + "input_layernorm.weight": 1 + rnd(H, std=0.1),
                  prefix + "hidden_norm.weight": 1 + rnd(H, std=0.1),
                  "fc.weight": rnd(H, 3 * H, std=0.1), "norm.weight": 1 + rnd(H, std=0.1),
                  "lm_head.weight": rnd(Vd, H), "d2t": target_ids - torch.arange(Vd), "t2d": t2d})
        if own_embed:
            w["embed_tokens.weight"] = rnd(V, H, std=1.0)
        cfg.update(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=Vd)
        if aux_ids is not None:
            cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_ids, "use_aux_hidden_state": True}
    else:
        # EAGLE-1 heads ship fc with a bias and a frozen copy of the target's embedding (not used)
        w.update({"fc.weight": rnd(H, 2 * H, std=0.1), "fc.bias": rnd(H, std=0.1),
                  "embed_tokens.weight": rnd(V, H, std=1.0)})
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f)
    save_file(w, os.path.join(out, "model.safetensors"))
    return w
