"""Checkpoint tensors the model has no parameter for: an all-zero ``bias`` of a bias-less linear layer (AutoGPTQ
writes one for every quantized layer) is skipped, as vLLM skips it; any other extra tensor is an error naming it."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from hayabusa import LLM, SamplingParams
from hayabusa.errors import HayabusaValidationError

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _with_bias(src: str, dst: str, value: float) -> str:
    shutil.copytree(src, dst)
    path = os.path.join(dst, "model.safetensors")
    state = load_file(path)
    n = state["model.layers.0.self_attn.q_proj.weight"].shape[0]
    state["model.layers.0.self_attn.q_proj.bias"] = torch.full((n,), value)
    save_file(state, path)
    return dst


def test_zero_bias_of_biasless_layer_is_skipped(tiny_llama, tmp_path):
    ids = [{"prompt_token_ids": [5, 6, 7, 8, 9]}]
    ref = LLM(tiny_llama).generate(ids, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    model = _with_bias(tiny_llama, str(tmp_path / "zero_bias"), 0.0)
    assert LLM(model).generate(ids, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == ref


def test_nonzero_extra_bias_is_refused(tiny_llama, tmp_path):
    model = _with_bias(tiny_llama, str(tmp_path / "bias"), 0.5)
    with pytest.raises(HayabusaValidationError, match=r"unused checkpoint tensors.*q_proj\.bias"):
        LLM(model)
