"""Tiny random-weight OPT checkpoints with the real GPT-2 BPE tokenizer (OPT's tokenizer is GPT-2's), for
tests/models/test_opt.py and test_opt_cuda.py.

Variants (each a real OPT's layout at a tiny width):
- "125m": facebook/opt-125m's: pre-LayerNorm, ReLU, final LayerNorm, word_embed_proj_dim == hidden_size, tied.
- "350m": facebook/opt-350m's: post-LayerNorm (do_layer_norm_before=false, no final LayerNorm), word embeddings of
  width 32 < hidden 64 through project_in / project_out.
- "plain": no biases (enable_bias=false), LayerNorms without weight and bias, its own lm_head, final LayerNorm
  removed (_remove_final_layer_norm).
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.conftest import TOKENIZERS, require_asset

OPT_VARIANTS = ("125m", "350m", "plain")


def save_tiny_opt(out: Path, variant: str, max_position_embeddings: int = 256) -> str:
    """A random 2-layer OPT of `variant` (see the module docstring) in `out`, with the GPT-2 tokenizer; returns the
    folder. Weights drawn with std 0.2 and LayerNorm weights / biases / linear biases drawn too (HF initialises them
    to 1 / 0), so that every parameter, the position offset included, changes the greedy tokens."""
    import transformers as tf

    tok = tf.AutoTokenizer.from_pretrained(str(require_asset(TOKENIZERS / "gpt2")))
    kw = dict(vocab_size=len(tok), hidden_size=64, num_hidden_layers=2, ffn_dim=128, num_attention_heads=4,
              max_position_embeddings=max_position_embeddings, init_std=0.2, bos_token_id=tok.bos_token_id,
              eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id, dropout=0.0)
    if variant == "350m":
        kw.update(do_layer_norm_before=False, word_embed_proj_dim=32)
    elif variant == "plain":
        kw.update(enable_bias=False, layer_norm_elementwise_affine=False, tie_word_embeddings=False,
                  _remove_final_layer_norm=True)
    elif variant != "125m":
        raise ValueError(f"variant must be one of {OPT_VARIANTS}, got {variant!r}")
    torch.manual_seed(0)
    cfg = tf.OPTConfig(**kw)
    model = tf.OPTForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("layer_norm.weight"):
                p.normal_(1.0, 0.3)
            elif name.endswith(("bias",)):
                p.normal_(0.0, 0.3)
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    return str(out)
