"""Tiny random-weight T5 checkpoints with a real SentencePiece tokenizer (llm-jp v2.2: Japanese and English), and
HF's greedy reference for encoder-decoder models.

Why random weights (issue #17 asks for a trained T5 if a package ships one): no package on the Python package
registry was found that ships trained T5 weights under a permissive licence (looked 2026-12-02: the package
list's T5 entries are training / wrapper libraries that fetch weights from a model hub at run time; the two
that looked like bundles, grass-sample-chatbot 0.1 and flan-t5-hf 0.7, are 1.5 kB and 1.9 kB: no weights), and
nothing can be fetched from a hub here."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.conftest import TOKENIZERS, require_asset

T5_EN_PROMPTS = [
    "translate English to German: The house is wonderful.",
    "summarize: Receipt. Store: Lawson Shibuya. Total 1,280 yen. Paid by card on 2024-05-01 at 12:31.",
    "Hi",
]
T5_JA_PROMPTS = [
    "吾輩は猫である。名前はまだ無い。",
    "領収書 セブンイレブン 新宿店 合計 ¥540 (税込) 2024年5月1日",
]


def save_tiny_t5(out: Path, version: str, num_decoder_layers: int = 3, initializer_factor: float = 4.0,
                 n_positions: int = 512, d_kv: int = 8) -> str:
    """A random 2-layer T5 in `out`: version "v1.0" (ReLU FFN, head tied to the embedding, decoder output scaled
    by d_model ** -0.5) or "v1.1" (gated-GELU FFN, its own lm_head, no scaling). vocab_size = the tokenizer's.
    2 encoder layers and 3 decoder layers by default (transformers' generate needs use_cache=False then: its cache
    is sized by num_layers); num_decoder_layers=2 for code that runs generate with its cache. n_positions: the
    model's length limit in config.json (transformers ignores it; hayabusa's encoder limit and default
    max_model_len). d_kv: the head size (64 in the released checkpoints)."""
    from transformers import AutoTokenizer, T5Config, T5ForConditionalGeneration
    from safetensors.torch import load_file, save_file

    tok = AutoTokenizer.from_pretrained(str(require_asset(TOKENIZERS / "llm-jp-v2.2")))
    v11 = version == "v1.1"
    cfg = T5Config(vocab_size=len(tok), d_model=32, d_kv=d_kv, d_ff=64, num_layers=2,
                   num_decoder_layers=num_decoder_layers, num_heads=4,
                   relative_attention_num_buckets=8, relative_attention_max_distance=16,
                   feed_forward_proj="gated-gelu" if v11 else "relu", tie_word_embeddings=not v11,
                   eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                   decoder_start_token_id=tok.pad_token_id, initializer_factor=initializer_factor,
                   n_positions=n_positions)
    torch.manual_seed(1 if v11 else 0)
    model = T5ForConditionalGeneration(cfg)
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    if v11:
        # transformers 5.2x ties the head whatever the config says and saves no lm_head; a real v1.1 checkpoint
        # has its own lm_head.weight and tie_word_embeddings: false (transformers then loads the two apart).
        path = out / "model.safetensors"
        sd = load_file(str(path))
        sd["lm_head.weight"] = torch.randn(len(tok), cfg.d_model) * 0.5
        save_file(sd, str(path), metadata={"format": "pt"})
        raw = json.loads((out / "config.json").read_text())
        raw["tie_word_embeddings"] = False
        raw.pop("scale_decoder_outputs", None)
        (out / "config.json").write_text(json.dumps(raw))
    return str(out)


def hf_t5(model_dir: str):
    from transformers import AutoModelForSeq2SeqLM

    return AutoModelForSeq2SeqLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()


def hf_t5_greedy(model_dir: str, encoder_ids: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """HF generate, greedy, float32, batch 1, ignoring EOS (min_new_tokens would mask EOS: instead run to length
    with eos_token_id unset)."""
    model = hf_t5(model_dir)
    outs = []
    with torch.no_grad():
        for ids in encoder_ids:
            g = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, min_new_tokens=None,
                               do_sample=False, num_beams=1, eos_token_id=None, pad_token_id=model.config.pad_token_id,
                               use_cache=False)  # transformers sizes its cache by num_layers, not num_decoder_layers
            outs.append(g[0, 1:].tolist())   # drop decoder_start_token_id
    return outs
