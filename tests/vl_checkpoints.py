"""Tiny random-weight Qwen2-VL / Qwen2.5-VL checkpoints (transformers' own config and model classes) with the real
Qwen tokenizer, saved as safetensors in transformers 5.x (``model.visual.*``, ``model.language_model.*``) or 4.x
(``visual.*``, ``model.*``) key layout; and the HF float32 greedy reference over images."""

from __future__ import annotations

import copy
import functools
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


# Qwen2-VL's chat format for image parts (the tiny checkpoint's tokenizer template: transformers 5 loads the
# checkpoint's AutoProcessor only with torchvision, so the seed script falls back to the tokenizer's template)
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def make_vl_checkpoint(out: str | Path, arch: str = "qwen2_5_vl", layout: str = "5.x", seed: int = 0) -> str:
    """Save a random-weight ``arch`` ("qwen2_5_vl" | "qwen2_vl") checkpoint to ``out``: 2 text layers (hidden
    64), 2 vision layers (the second full attention for Qwen2.5, window 56 px = 2 x 2 merge units). ``layout``:
    "5.x", "4.x" (4.x key names) or "4.x-flat" (also a 4.x-style config.json, text keys at the top level)."""
    from transformers import AutoTokenizer

    out = Path(out)
    tok = AutoTokenizer.from_pretrained(str(QWEN_TOKENIZER))
    ids = {n: tok.convert_tokens_to_ids(n) for n in ("<|image_pad|>", "<|vision_start|>", "<|vision_end|>",
                                                     "<|video_pad|>")}
    text = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192, rms_norm_eps=1e-6,
                rope_theta=10000.0, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
                tie_word_embeddings=False, initializer_range=0.2, bos_token_id=tok.bos_token_id,
                eos_token_id=tok.eos_token_id)
    tokens = dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                  vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    torch.manual_seed(seed)
    if arch == "qwen2_5_vl":
        from transformers import Qwen2_5_VLConfig as Config, Qwen2_5_VLForConditionalGeneration as Model

        vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                      patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                      fullatt_block_indexes=[1], hidden_act="silu", in_channels=3, initializer_range=0.2)
    else:
        from transformers import Qwen2VLConfig as Config, Qwen2VLForConditionalGeneration as Model

        vision = dict(depth=2, embed_dim=32, mlp_ratio=2, num_heads=2, hidden_size=64, patch_size=14,
                      spatial_merge_size=2, temporal_patch_size=2, hidden_act="quick_gelu", in_channels=3,
                      initializer_range=0.2)
    cfg = Config(text_config=dict(text), vision_config=vision, **tokens, **text)
    cfg.architectures = [Model.__name__]
    model = Model(cfg).float().eval()
    with torch.no_grad():   # HF zero-initialises biases and norms to one: make them matter
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name or "ln_q" in name:
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(str(out), safe_serialization=True)
    if layout.startswith("4.x"):
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
    if layout == "4.x-flat":   # config.json as the released checkpoints have it: text keys at the top level
        _flatten_config(out / "config.json")
    tok.save_pretrained(str(out))
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    with open(out / "preprocessor_config.json", "w") as f:
        json.dump({**PROCESSOR, "image_processor_type": "Qwen2VLImageProcessor"}, f)
    return str(out)


def _flatten_config(path: Path) -> None:
    cfg = json.loads(path.read_text())
    text = cfg.pop("text_config")
    cfg.pop("rope_parameters", None)
    for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "max_position_embeddings", "rms_norm_eps", "vocab_size", "max_window_layers", "use_sliding_window",
              "sliding_window", "hidden_act"):
        cfg[k] = text[k]
    cfg["rope_theta"] = 10000.0
    cfg["rope_scaling"] = {"type": "mrope", "mrope_section": text["rope_parameters"]["mrope_section"]}
    vision = cfg["vision_config"]
    vision.pop("rope_parameters", None)
    if "in_channels" in vision:
        vision["in_chans"] = vision.pop("in_channels")
    cfg["torch_dtype"] = cfg.pop("dtype", "float32")
    path.write_text(json.dumps(cfg, indent=1))


def random_image(w: int, h: int, seed: int):
    """A PIL RGB image of w x h pixels with random content."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


def vl_prompt_ids(tok, text: str, num_images: int) -> list[int]:
    """Chat-style prompt ids with one ``<|vision_start|><|image_pad|><|vision_end|>`` per image (unexpanded)."""
    vis = "<|vision_start|><|image_pad|><|vision_end|>" * num_images
    return tok(f"<|im_start|>user\n{vis}{text}<|im_end|>\n<|im_start|>assistant\n").input_ids


@functools.lru_cache(maxsize=4)
def hf_vl_model(model_dir: str):
    """The checkpoint as an HF float32 model (cached per folder)."""
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_vl_greedy(model_dir: str, expanded_ids: list[int], images: list, max_new_tokens: int) -> list[int]:
    """HF float32 greedy continuation (``generate``, batch 1) of an already-expanded prompt (placeholders
    repeated) with its images, preprocessed by the checkpoint's own image processor."""
    model = hf_vl_model(model_dir)
    pixel_values = grid_thw = None
    if images:
        from hayabusa.multimodal.processor import load_image_processor

        x = load_image_processor(model_dir)(images=images, return_tensors="pt")
        pixel_values, grid_thw = x["pixel_values"], x["image_grid_thw"]
    ids = torch.tensor([expanded_ids])
    kw = {}
    if pixel_values is not None:
        kw = dict(pixel_values=pixel_values, image_grid_thw=grid_thw)
    if "mm_token_type_ids" in inspect.signature(model.forward).parameters:
        kw["mm_token_type_ids"] = (ids == model.config.image_token_id).int()
    gen = copy.deepcopy(model.generation_config)   # no EOS: like ignore_eos=True, and no logits processor
    gen.eos_token_id, gen.pad_token_id, gen.do_sample = None, 0, False
    gen.max_new_tokens, gen.temperature, gen.top_p, gen.top_k = max_new_tokens, None, None, None
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=gen, **kw)
    return out[0, len(expanded_ids):].tolist()
