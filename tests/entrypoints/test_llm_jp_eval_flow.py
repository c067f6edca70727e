"""llm-jp-eval's vLLM offline-inference flow with ``import hayabusa as vllm`` (its calls, on a tiny model):
``LLM(**model_cfg)`` with the config's vLLM-only arguments, ``set_tokenizer``, ``SamplingParams(**dump)`` then
``max_tokens`` set on the object, ``generate(prompts=[{"prompt_token_ids": ...}])`` and the old
``generate(prompt_token_ids=...)``; plus the other LLM methods such scripts call."""

from __future__ import annotations

import logging

import pytest

import hayabusa as vllm
from hayabusa.errors import HayabusaValidationError
from tests.helpers import hf_greedy

PROMPTS = ["以下は、タスクを説明する指示です。\n\n### 指示:\n日本の首都は？\n\n### 応答:\n", "吾輩は猫である。"]


def test_llm_jp_eval_offline_flow(tiny_llama, caplog):
    from transformers import AutoTokenizer

    model_cfg = {"model": tiny_llama, "dtype": "float32", "trust_remote_code": False,
                 "gpu_memory_utilization": 0.9, "tensor_parallel_size": 1, "pipeline_parallel_size": 1,
                 "max_model_len": 256, "enable_prefix_caching": True, "reasoning_parser": None,
                 "num_scheduler_steps": 8, "disable_log_requests": True, "enable_lora": False,
                 "num_gpu_blocks_override": 128}   # (not llm-jp's: a fixed KV size, so GPU tests share the device)
    tokenizer = AutoTokenizer.from_pretrained(pretrained_model_name_or_path=tiny_llama, trust_remote_code=False,
                                              use_fast=True, padding_side="left")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token_id = tokenizer.eos_token_id
    with caplog.at_level(logging.WARNING):
        model = vllm.LLM(**model_cfg)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert sum("num_scheduler_steps" in m for m in warned) == 1
    assert sum("disable_log_requests" in m for m in warned) == 1
    model.set_tokenizer(tokenizer)
    assert model.get_tokenizer() is tokenizer and model.llm_engine.tokenizer is tokenizer

    dump = {"n": 1, "best_of": None, "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
            "temperature": 0.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "seed": None, "stop": None,
            "stop_token_ids": None, "ignore_eos": False, "max_tokens": None, "min_tokens": 0, "logprobs": None,
            "prompt_logprobs": None}
    sampling_params = vllm.sampling_params.SamplingParams(**dump)
    sampling_params.max_tokens = 8                        # the script sets it after construction
    prompt_tokens = [tokenizer(p, add_special_tokens=True).input_ids for p in PROMPTS]
    outputs = model.generate(sampling_params=sampling_params,
                             prompts=[{"prompt_token_ids": t} for t in prompt_tokens])
    want = hf_greedy(tiny_llama, prompt_tokens, 8, {tokenizer.eos_token_id})
    assert [o.outputs[0].token_ids for o in outputs] == want
    assert [o.outputs[0].text for o in outputs] == [tokenizer.decode(w, skip_special_tokens=True) for w in want]
    old = model.generate(prompt_token_ids=prompt_tokens, sampling_params=sampling_params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in old] == want
    assert model.reset_prefix_cache() is True


def test_unsupported_feature_args_say_so(stories_dir):
    with pytest.raises(HayabusaValidationError, match="not supported yet") as e:
        vllm.LLM(stories_dir, enable_lora=True)
    assert e.value.parameter == "enable_lora"
    with pytest.raises(HayabusaValidationError, match="unknown engine argument") as e:
        vllm.LLM(stories_dir, no_such_arg=1)
    assert e.value.parameter == "no_such_arg"


def test_default_sampling_params(stories_dir, tmp_path):
    import json
    import shutil

    llm = vllm.LLM(stories_dir, num_gpu_blocks_override=64)
    assert llm.get_default_sampling_params() == vllm.SamplingParams()
    model = tmp_path / "m"
    shutil.copytree(stories_dir, model)
    (model / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": 0.6,
                                                              "top_p": 0.9, "max_new_tokens": 32}))
    p = vllm.LLM(str(model), num_gpu_blocks_override=64).get_default_sampling_params()
    assert (p.temperature, p.top_p, p.max_tokens) == (0.6, 0.9, 32)
