"""Report 002 (llm-jp-eval with HF Transformers vs vLLM vs TensorRT-LLM on A100 / L4: batching, quantization,
TP / PP, prefix caching for llm-jp-eval's shared few-shot prefixes). The report is slides and shows no code; this
module holds the vLLM offline-inference script an llm-jp-eval user writes (written here, not copied): bf16,
prefix caching on, greedy decoding over few-shot prompts that share their instruction, run on a tiny random Llama
(llm-jp's architecture) with the real llm-jp v3.1 tokenizer. Checks: one output per prompt in input order; greedy
within a bf16 near-tie of HF float32's argmax; prefix caching on and off give the same ids, and it does hit."""

from __future__ import annotations

import torch

from tests.helpers import _hf_model, assert_near_greedy, greedy_margins

INSTRUCTION = ("以下は、タスクを説明する指示です。要求を適切に満たす応答を書きなさい。\n\n### 指示:\n"
               "質問に対する答えを出力してください。\n\n### 入力:\n質問：日本の首都は？\n### 応答:\n東京\n\n")
QUESTIONS = ["富士山の高さは？", "日本で一番長い川は？", "1 + 1 は？", "吾輩は猫である の作者は？",
             "Capital of France?", "大阪の名物は？"]


def run_user_script(model_path, enable_prefix_caching=True):
    from hayabusa import LLM, SamplingParams   # a vLLM user writes ``from vllm import LLM, SamplingParams``

    llm = LLM(model=model_path, dtype="bfloat16", gpu_memory_utilization=0.9, tensor_parallel_size=1,
              enable_prefix_caching=enable_prefix_caching, max_model_len=512, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=10)
    prompts = [f"{INSTRUCTION}### 入力:\n質問：{q}\n### 応答:\n" for q in QUESTIONS]
    outputs = []
    for start in range(0, len(prompts), 3):   # one generate per llm-jp-eval dataset (here 3 questions each)
        outputs += llm.generate(prompts[start:start + 3], params)
    return prompts, outputs, llm


def test_seed002_llm_jp_eval_offline_inference(tiny_llama):
    prompts, outs, llm = run_user_script(tiny_llama)
    assert len(outs) == len(prompts) == 6
    eos = llm.get_tokenizer().eos_token_id
    for p, o in zip(prompts, outs):
        c = o.outputs[0]
        assert o.prompt == p and o.finished and c.token_ids
        assert (len(c.token_ids), c.finish_reason) == (10, "length") or (
            c.finish_reason == "stop" and c.token_ids[-1] == eos)
    hit_rate = llm.llm_engine.kv_cache_manager.prefix_hit_rate
    hf, margins = _hf_model(tiny_llama), []
    with torch.no_grad():
        for o in outs:
            ids = list(o.outputs[0].token_ids)
            lp = hf(torch.tensor([list(o.prompt_token_ids) + ids[:-1]])).logits[0, len(o.prompt_token_ids) - 1:]
            margins.append(greedy_margins(lp.float().log_softmax(-1), ids))
    assert_near_greedy(margins)
    del llm
    _, plain, _ = run_user_script(tiny_llama, enable_prefix_caching=False)
    assert [o.outputs[0].token_ids for o in plain] == [o.outputs[0].token_ids for o in outs]
    assert hit_rate > 0.3, hit_rate   # the second dataset's prompts reuse the shared instruction's blocks
