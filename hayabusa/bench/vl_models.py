"""Random-weight Qwen2.5-VL / Qwen2-VL checkpoints of real shapes, with what the processor needs to load offline.

``make_vl_model("qwen2.5-vl-7b-shape", DIR)`` writes ``config.json`` + bf16 safetensors (transformers' own
``save_pretrained`` of ``Qwen2_5_VLForConditionalGeneration``, so the key layout is the installed version's), the
Qwen tokenizer (``$HAYABUSA_ASSETS/tokenizers/qwen3``, which holds ``<|image_pad|>`` and the vision tokens),
Qwen2-VL's chat template (``{"type": "image"}`` parts -> ``<|vision_start|><|image_pad|><|vision_end|>``), and
the real checkpoints' ``preprocessor_config.json`` (14-pixel patches, 2 x 2 merge, min / max pixels), so that
``AutoProcessor.from_pretrained(DIR)`` works without network.

Shapes (the public config.json files of Qwen/Qwen2.5-VL-7B-Instruct and -3B-Instruct; tiny ones for tests):
text hidden / intermediate / layers / heads / kv heads / vocab, vision depth / hidden / intermediate / heads.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from typing import Any

import torch

# name -> (architecture, text: hidden, intermediate, layers, heads, kv heads, vocab, tied,
#          vision: depth, hidden, intermediate, heads, fullatt_block_indexes, mrope_section)
VL_SHAPES: dict[str, tuple] = {
    "qwen2.5-vl-7b-shape": ("Qwen2_5_VLForConditionalGeneration", 3584, 18944, 28, 28, 4, 152064, False,
                            32, 1280, 3420, 16, [7, 15, 23, 31], [16, 24, 24]),
    "qwen2.5-vl-3b-shape": ("Qwen2_5_VLForConditionalGeneration", 2048, 11008, 36, 16, 2, 151936, True,
                            32, 1280, 3420, 16, [7, 15, 23, 31], [16, 24, 24]),
    # tiny shapes for tests: the real vocabulary (the Qwen tokenizer's ids), 2 text layers, a 2-block vision tower
    "qwen2.5-vl-tiny": ("Qwen2_5_VLForConditionalGeneration", 64, 128, 2, 4, 2, 151936, True,
                        2, 32, 64, 2, [1], [2, 3, 3]),
    "qwen2-vl-tiny": ("Qwen2VLForConditionalGeneration", 64, 128, 2, 4, 2, 151936, True,
                      2, 32, 64, 2, None, [2, 3, 3]),
}
# The image processor of the real checkpoints (Qwen2.5-VL's preprocessor_config.json).
PREPROCESSOR_CONFIG = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
    "do_convert_rgb": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
    "min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
}
IMAGE_TOKEN_ID, VIDEO_TOKEN_ID, VISION_START_ID, VISION_END_ID = 151655, 151656, 151652, 151653


def vl_shape_config(name: str) -> Any:
    """The transformers config of VL shape `name` (bf16, max_position_embeddings 128000)."""
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig

    (arch, hidden, inter, layers, heads, kv, vocab, tied,
     depth, v_hidden, v_inter, v_heads, fullatt, mrope) = VL_SHAPES[name]
    rope = {"rope_type": "default", "mrope_section": list(mrope), "rope_theta": 1e6}
    text = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv, hidden_act="silu", max_position_embeddings=128000,
                rms_norm_eps=1e-6, use_sliding_window=False, max_window_layers=layers, rope_parameters=rope,
                rope_scaling=rope, rope_theta=1e6, bos_token_id=151643, eos_token_id=151645,
                tie_word_embeddings=tied, dtype="bfloat16")
    common = dict(image_token_id=IMAGE_TOKEN_ID, video_token_id=VIDEO_TOKEN_ID,
                  vision_start_token_id=VISION_START_ID, vision_end_token_id=VISION_END_ID, tie_word_embeddings=tied)
    if arch == "Qwen2_5_VLForConditionalGeneration":
        vision = dict(depth=depth, hidden_size=v_hidden, intermediate_size=v_inter, num_heads=v_heads,
                      hidden_act="silu", out_hidden_size=hidden, patch_size=14, spatial_merge_size=2,
                      temporal_patch_size=2, window_size=112, fullatt_block_indexes=list(fullatt),
                      tokens_per_second=2, in_channels=3)
        cfg = Qwen2_5_VLConfig(text_config=text, vision_config=vision, **common)
    else:   # Qwen2-VL: LayerNorm / QuickGELU vision blocks, mlp_ratio 4, no window attention
        vision = dict(depth=depth, embed_dim=v_hidden, hidden_size=hidden, mlp_ratio=v_inter // v_hidden,
                      num_heads=v_heads, hidden_act="quick_gelu", patch_size=14, spatial_merge_size=2,
                      temporal_patch_size=2, in_channels=3)
        cfg = Qwen2VLConfig(text_config=text, vision_config=vision, **common)
    cfg.architectures = [arch]
    cfg.dtype = "bfloat16"
    return cfg


def _model_class(arch: str) -> Any:
    import transformers

    return getattr(transformers, arch)


def write_processor_files(out_dir: str, arch: str = "Qwen2_5_VLForConditionalGeneration",
                          tokenizer_dir: str | None = None) -> None:
    """The Qwen tokenizer, Qwen2-VL's chat template and the image processor's config, into `out_dir`."""
    from hayabusa.assets import qwen2_vl_chat_template

    src = tokenizer_dir or os.path.join(os.environ.get("HAYABUSA_ASSETS", "../shared/assets"), "tokenizers", "qwen3")
    if not os.path.isfile(os.path.join(src, "tokenizer.json")):
        raise ValueError(f"the Qwen tokenizer is not at {src}; set HAYABUSA_ASSETS to the shared assets folder "
                         "(it holds tokenizers/qwen3).")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(os.path.join(src, name), os.path.join(out_dir, name))
    template = qwen2_vl_chat_template()
    path = os.path.join(out_dir, "tokenizer_config.json")
    with open(path, encoding="utf-8") as f:
        tok_cfg = json.load(f)
    tok_cfg["chat_template"] = template          # the tokenizer's template is the VL one too (LLM.chat uses it)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(tok_cfg, f, ensure_ascii=False, indent=1)
    with open(os.path.join(out_dir, "chat_template.jinja"), "w", encoding="utf-8") as f:
        f.write(template)
    processor = "Qwen2VLProcessor" if arch == "Qwen2VLForConditionalGeneration" else "Qwen2_5_VLProcessor"
    with open(os.path.join(out_dir, "preprocessor_config.json"), "w") as f:
        json.dump({**PREPROCESSOR_CONFIG, "processor_class": processor}, f, indent=1)


def make_vl_model(name: str, out_dir: str, device: str | None = None, seed: int = 0) -> dict[str, Any]:
    """Write a random-weight bf16 VL checkpoint of shape `name` (a key of VL_SHAPES) with its processor files.

    Returns:
        {"shape", "dir", "params", "vision_params", "bytes", "seconds", "device", "seed"}.
    """
    from hayabusa.bench.models import SHAPE_FILE, fill_random

    t0 = time.perf_counter()
    cfg = vl_shape_config(name)
    os.makedirs(out_dir, exist_ok=True)
    write_processor_files(out_dir, cfg.architectures[0])    # first: a missing tokenizer fails before the weights
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = _model_class(cfg.architectures[0])._from_config(cfg, dtype=torch.bfloat16)
    model = model.to_empty(device=device)
    model.tie_weights()
    fill_random(model, seed)
    model = model.to("cpu")
    model.save_pretrained(out_dir, max_shard_size="100GB")
    n_params = sum(p.numel() for p in model.parameters())
    n_vision = sum(p.numel() for n, p in model.named_parameters() if "visual" in n)
    info = {"shape": name, "dir": out_dir, "params": n_params, "vision_params": n_vision, "bytes": 2 * n_params,
            "seconds": round(time.perf_counter() - t0, 2), "device": device, "seed": seed}
    with open(os.path.join(out_dir, SHAPE_FILE), "w") as f:
        json.dump({"shape": name, "seed": seed, "params": n_params, "vision_params": n_vision}, f, indent=1)
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return info
