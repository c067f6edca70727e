"""Tiny random-weight Qwen2-VL / Qwen2.5-VL checkpoints (transformers' own config and model classes) with the real
Qwen tokenizer, saved as safetensors in transformers 5.x (``model.visual.*``, ``model.language_model.*``) or 4.x
(``visual.*``, ``model.*``) key layout; and the HF float32 greedy reference over images."""

from __future__ import annotations

import inspect
import json
import os
from pathlib import Path

import numpy as np
import torch

ASSETS = Path(os.environ.get("HAYABUSA_ASSETS", Path(__file__).resolve().parent.parent.parent / "shared" / "assets"))
QWEN_TOKENIZER = ASSETS / "tokenizers" / "qwen3"

# the image processor's settings of a tiny checkpoint: small images stay small (28 x 28 px is one token)
PROCESSOR = {"min_pixels": 28 * 28, "max_pixels": 112 * 112, "patch_size": 14, "temporal_patch_size": 2,
             "merge_size": 2, "image_mean": [0.48145466, 0.4578275, 0.40821073],
             "image_std": [0.26862954, 0.26130258, 0.27577711], "do_resize": True, "do_rescale": True,
             "do_normalize": True, "resample": 3, "rescale_factor": 1 / 255, "do_convert_rgb": True}


def make_vl_checkpoint(out: str | Path, arch: str = "qwen2_5_vl", layout: str = "5.x", seed: int = 0) -> str:
    """Save a random-weight ``arch`` ("qwen2_5_vl" | "qwen2_vl") checkpoint to ``out``: 2 text layers (hidden
    64), 2 vision layers (the second full attention for Qwen2.5, window 56 px = 2 x 2 merge units)."""
    from transformers import AutoTokenizer

    out = Path(out)
    tok = AutoTokenizer.from_pretrained(str(QWEN_TOKENIZER))
    ids = {n: tok.convert_tokens_to_ids(n) for n in ("<|image_pad|>", "<|vision_start|>", "<|vision_end|>",
                                                     "<|video_pad|>")}
    text = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6,
                rope_theta=10000.0, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
                tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    tokens = dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                  vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    torch.manual_seed(seed)
    if arch == "qwen2_5_vl":
        from transformers import Qwen2_5_VLConfig as Config, Qwen2_5_VLForConditionalGeneration as Model

        vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                      patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                      fullatt_block_indexes=[1], hidden_act="silu", in_channels=3)
    else:
        from transformers import Qwen2VLConfig as Config, Qwen2VLForConditionalGeneration as Model

        vision = dict(depth=2, embed_dim=32, mlp_ratio=2, num_heads=2, hidden_size=64, patch_size=14,
                      spatial_merge_size=2, temporal_patch_size=2, hidden_act="quick_gelu", in_channels=3)
    cfg = Config(text_config=dict(text), vision_config=vision, **tokens, **text)
    cfg.architectures = [Model.__name__]
    model = Model(cfg).float().eval()
    with torch.no_grad():   # HF zero-initialises biases and norms to one: make them matter
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name or "ln_q" in name:
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(str(out), safe_serialization=True)
    if layout == "4.x":
        from safetensors.torch import load_file, save_file

        for f in out.glob("*.safetensors"):
            sd = load_file(str(f))
            ren = {}
            for k, v in sd.items():
                if k.startswith("model.visual."):
                    k = k[len("model."):]
                elif k.startswith("model.language_model."):
                    k = "model." + k[len("model.language_model."):]
                ren[k] = v.contiguous()
            save_file(ren, str(f), metadata={"format": "pt"})
        idx = out / "model.safetensors.index.json"
        assert not idx.exists()
    tok.save_pretrained(str(out))
    with open(out / "preprocessor_config.json", "w") as f:
        json.dump({**PROCESSOR, "image_processor_type": "Qwen2VLImageProcessor"}, f)
    return str(out)


def random_image(w: int, h: int, seed: int):
    """A PIL RGB image of w x h pixels with random content."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


def vl_prompt_ids(tok, text: str, num_images: int) -> list[int]:
    """Chat-style prompt ids with one ``<|vision_start|><|image_pad|><|vision_end|>`` per image (unexpanded)."""
    vis = "<|vision_start|><|image_pad|><|vision_end|>" * num_images
    return tok(f"<|im_start|>user\n{vis}{text}<|im_end|>\n<|im_start|>assistant\n").input_ids


def hf_vl_greedy(model_dir: str, expanded_ids: list[int], pixel_values, grid_thw, max_new_tokens: int
                 ) -> list[int]:
    """HF float32 greedy continuation of an already-expanded prompt (placeholders repeated) with its images."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([expanded_ids])
    kw = {}
    if pixel_values is not None:
        kw = dict(pixel_values=pixel_values, image_grid_thw=grid_thw)
    if "mm_token_type_ids" in inspect.signature(model.forward).parameters:
        kw["mm_token_type_ids"] = (ids == model.config.image_token_id).int()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, min_new_tokens=max_new_tokens, **kw)
    return out[0, len(expanded_ids):].tolist()
