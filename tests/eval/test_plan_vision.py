"""hayabusa plan for Qwen2-VL / Qwen2.5-VL: the vision tower's parameters equal transformers' modules, its activation
peak follows the documented formula, and the KV budget takes the larger of the LM step and the vision pass."""

from __future__ import annotations

import json

import pytest
import torch

from hayabusa.bench.vl_models import VL_SHAPES, vl_shape_config
from hayabusa.eval.plan import PlanInputs, count_params, make_plan
from hayabusa.eval.plan_vision import vision_activation, vision_params


@pytest.mark.parametrize("shape", list(VL_SHAPES))
def test_vision_and_total_params_equal_transformers_modules(shape):
    import transformers

    cfg = vl_shape_config(shape)
    with torch.device("meta"):
        model = getattr(transformers, cfg.architectures[0])._from_config(cfg)
    vision = sum(p.numel() for n, p in model.named_parameters() if "visual" in n)
    assert vision_params(cfg) == vision
    assert count_params(cfg)["total"] == sum(p.numel() for p in model.parameters())
    assert vision == {"qwen2.5-vl-7b-shape": 676_550_144, "qwen2.5-vl-3b-shape": 668_684_288,
                      "qwen2.5-vl-tiny": 83_616, "qwen2-vl-tiny": 79_552}[shape]


def test_vision_activation_by_hand():
    cfg = vl_shape_config("qwen2.5-vl-tiny")       # vision h 32, i 64, 2 heads, out 64
    a = vision_activation(cfg, 2, max_images=2, max_pixels=56 * 56)
    # 16 patches per image, 32 in all: pixels 32 x 1176 x 2, rotary 32 x 16 x 2 x 4, block 32 x (6 x 32 + 3 x 64) x 2
    assert a == {"patches": 32, "max_images": 2, "max_pixels": 3136,
                 "peak_bytes": 75_264 + 4_096 + 24_576, "encoder_output_bytes": 8 * 64 * 2}
    capped = vision_activation(cfg, 2, max_images=5, max_pixels=12_845_056, max_model_len=100)
    assert capped["patches"] == 400                  # 4 x max_model_len, not 5 x 65,536
    assert vision_activation(vl_shape_config("qwen2.5-vl-7b-shape").get_text_config(), 2, 1, 3136) is None


def test_plan_budget_takes_the_larger_of_lm_and_vision():
    cfg = vl_shape_config("qwen2.5-vl-7b-shape")
    small = make_plan(cfg, PlanInputs(max_model_len=8192, max_num_seqs=14, max_images=1, max_pixels=3136), "H200")
    assert small["activation_bytes"] == small["lm_activation_bytes"] + small["vision"]["encoder_output_bytes"]
    big = make_plan(cfg, PlanInputs(max_model_len=32768, max_num_seqs=14, max_images=5), "H200")
    assert big["vision"]["patches"] == 4 * 32768      # 5 x 65,536 patches capped by 4 x max_model_len
    assert big["activation_bytes"] == big["vision"]["peak_bytes"] > big["lm_activation_bytes"]
    assert big["max_num_tokens"] < small["max_num_tokens"]
    assert any("vision tower: 676,550,144 parameters" in n for n in big["notes"])


def test_plan_cli_reads_max_pixels_from_the_checkpoint(tmp_path, capsys):
    from hayabusa.bench.vl_models import make_vl_model
    from hayabusa.eval.cli import main

    make_vl_model("qwen2.5-vl-tiny", str(tmp_path / "m"), device="cpu")
    pp = json.loads((tmp_path / "m" / "preprocessor_config.json").read_text())
    pp["max_pixels"] = 28 * 28 * 10
    (tmp_path / "m" / "preprocessor_config.json").write_text(json.dumps(pp))
    assert main(["plan", "--model", str(tmp_path / "m"), "--gpu", "L4", "--max-images", "3", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["vision"]["max_pixels"] == 7840 and plan["vision"]["patches"] == 3 * 40
    assert plan["param_breakdown"]["vision"] == 83_616


def test_image_limits_come_from_the_flags_or_limit_mm_per_prompt():
    import argparse

    from hayabusa.errors import HayabusaValidationError
    from hayabusa.eval.cli import _image_limits

    ns = argparse.Namespace(max_images=None, max_pixels=None, model="qwen2.5-vl-7b-shape")
    limit = type("Args", (), {"limit_mm_per_prompt": {"image": 4}})()
    assert _image_limits(ns, limit) == {"max_images": 4, "max_pixels": 12_845_056}
    assert _image_limits(ns, type("Args", (), {})()) == {"max_images": 1, "max_pixels": 12_845_056}
    ns.max_images, ns.max_pixels = 2, 3136
    assert _image_limits(ns, limit) == {"max_images": 2, "max_pixels": 3136}      # the flags win
    with pytest.raises(HayabusaValidationError) as e:
        _image_limits(ns, type("Args", (), {"limit_mm_per_prompt": "{image: 5"})())
    assert e.value.parameter == "limit_mm_per_prompt"
