"""What the quantization tests share to build checkpoints with static activation scales: the fixed text and the
per-layer input amax of the fp32 HF model over its first 1,024 tokens (a stand-in for a calibration run)."""

from __future__ import annotations

import torch

from tests.conftest import ASSETS, require_asset

TEXT = ASSETS / "text" / "botchan.plain.txt"
LINEAR_KEYS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def calibration_text() -> str:
    """The first 40,000 characters of Botchan (public domain); skips the test when the asset is missing."""
    return require_asset(TEXT).read_text(encoding="utf-8")[:40000]


def input_amax(src: str) -> dict[str, torch.Tensor]:
    """Largest |input| of each linear layer of the fp32 HF model over 1024 tokens of the text (calibration)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    ids = AutoTokenizer.from_pretrained(src)(calibration_text()).input_ids[:1024]
    amax: dict[str, torch.Tensor] = {}

    def hook(name):
        def fn(mod, args):
            a = args[0].detach().abs().max()
            amax[name] = torch.maximum(amax.get(name, a), a)
        return fn

    for name, mod in model.named_modules():
        if name.endswith(LINEAR_KEYS):
            mod.register_forward_pre_hook(hook(name))
    with torch.no_grad():
        for i in range(0, len(ids), 512):
            model(torch.tensor([ids[i:i + 512]]))
    return amax
