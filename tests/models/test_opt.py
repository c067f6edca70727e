"""OPT (facebook/opt-*, vLLM's quickstart model): greedy token ids equal HF Transformers' (float32, CPU) on tiny
random checkpoints of three layouts (tests/models/_opt.py: opt-125m's pre-LN, opt-350m's post-LN with
project_in / project_out, and one without biases, LayerNorm affines or final LayerNorm, with its own lm_head), for
a batch of prompts of different lengths, one request at a time, with preemption and chunked prefill, and with
prefix-cache hits; first-token logprobs equal HF's; a context that reaches max_position_embeddings (the last
position-embedding row); the original facebook/opt-* key layout (``decoder.*``, a stored tied lm_head)."""

from __future__ import annotations

import os

import pytest

from hayabusa import LLM, SamplingParams
from tests.conftest import EN_PROMPTS, JA_PROMPTS, LONG_PROMPT
from tests.helpers import assert_first_token_logprobs_match_hf, assert_greedy_close, hf_greedy
from tests.models._opt import OPT_VARIANTS, save_tiny_opt

PROMPTS = EN_PROMPTS + JA_PROMPTS + [LONG_PROMPT, "a"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=5)

CONFIGS = {
    "max_num_seqs=1": dict(max_num_seqs=1),
    "max_num_seqs=8": dict(max_num_seqs=8),
    # block_size 4, 24 blocks for 8 rows of up to ~50 tokens, 16-token steps: preemption and chunked prefill
    "preempt+chunk": dict(max_num_seqs=8, block_size=4, num_gpu_blocks_override=24, max_model_len=64,
                          max_num_batched_tokens=16),
}


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """variant -> {"dir", "prompt_ids", "ref"}, each built (and HF's greedy reference computed) once."""
    built: dict[str, dict] = {}

    def get(variant: str) -> dict:
        if variant not in built:
            d = save_tiny_opt(tmp_path_factory.mktemp(f"tiny_opt_{variant}"), variant)
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(d)
            prompt_ids = [tok(p).input_ids for p in PROMPTS]
            built[variant] = {"dir": d, "prompt_ids": prompt_ids,
                              "ref": hf_greedy(d, prompt_ids, GREEDY.max_tokens)}
        return built[variant]

    return get


def _check(case, outs) -> None:
    for ids, out, ref in zip(case["prompt_ids"], outs, case["ref"], strict=True):
        assert out.prompt_token_ids == ids
        c = out.outputs[0]
        assert_greedy_close(case["dir"], ids, c.token_ids, ref, [set(d) for d in c.logprobs])


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("variant", OPT_VARIANTS)
def test_greedy_matches_hf(variant, config, cases):
    case = cases(variant)
    llm = LLM(case["dir"], **CONFIGS[config])
    model = llm.llm_engine.runner.model
    assert type(model).__name__ == "OPTForCausalLM"
    assert (model.model.decoder.project_in is not None) == (variant == "350m")
    assert (model.model.decoder.final_layer_norm is not None) == (variant == "125m")
    assert len({len(i) for i in case["prompt_ids"]}) >= 5                  # prompts of different lengths
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    if config == "preempt+chunk":
        assert llm.llm_engine.scheduler.num_preemptions > 0
    _check(case, outs)


@pytest.mark.parametrize("variant", ["125m", "350m"])
def test_prefix_cache_hits_keep_greedy_output(variant, cases):
    """Prompts sharing a long prefix, run twice: the second run reads its prefixes from cached blocks."""
    case = cases(variant)
    llm = LLM(case["dir"], enable_prefix_caching=True, block_size=4, max_num_seqs=8)
    kv = llm.llm_engine.kv_cache_manager
    shared = case["prompt_ids"][PROMPTS.index(LONG_PROMPT)]
    prompts = [{"prompt_token_ids": shared + ids} for ids in case["prompt_ids"][:4]]
    ref = hf_greedy(case["dir"], [p["prompt_token_ids"] for p in prompts], GREEDY.max_tokens)
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    hits = kv.num_hit_tokens
    again = [o.outputs[0].token_ids for o in llm.generate(prompts[::-1], GREEDY, use_tqdm=False)][::-1]
    assert kv.num_hit_tokens - hits >= 4 * (len(shared) // 4 * 4)
    assert first == again
    for p, ours, want in zip(prompts, first, ref):
        assert_greedy_close(case["dir"], p["prompt_token_ids"], ours, want)


@pytest.mark.parametrize("variant", OPT_VARIANTS)
def test_first_token_logprobs_match_hf(variant, cases):
    """Logits, not only their argmax."""
    case = cases(variant)
    assert_first_token_logprobs_match_hf(case["dir"], case["prompt_ids"])


def test_context_reaches_max_position_embeddings(tmp_path):
    """max_model_len defaults to max_position_embeddings (64 here): the last token's position 63 reads the table's
    last row (63 + 2; the table has 64 + 2), and the ids equal HF's all the way."""
    d = save_tiny_opt(tmp_path, "125m", max_position_embeddings=64)
    llm = LLM(d, max_num_seqs=2)
    assert llm.llm_engine.config.model_config.max_model_len == 64
    assert llm.llm_engine.runner.model.model.decoder.embed_positions.weight.shape[0] == 66
    prompt = llm.get_tokenizer()(LONG_PROMPT).input_ids
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=64 - len(prompt),
                                                                    ignore_eos=True), use_tqdm=False)[0]
    ours = out.outputs[0].token_ids
    assert len(prompt) + len(ours) == 64
    assert_greedy_close(d, prompt, ours, hf_greedy(d, [prompt], len(ours))[0])


def test_original_facebook_checkpoint_layout(cases, tmp_path):
    """facebook/opt-*'s files: the decoder's keys without the ``model.`` prefix and the tied lm_head stored."""
    from safetensors.torch import load_file, save_file

    src = cases("125m")["dir"]
    state = load_file(os.path.join(src, "model.safetensors"))
    assert "lm_head.weight" not in state and "model.decoder.embed_positions.weight" in state
    renamed = {k.removeprefix("model."): v for k, v in state.items()}
    renamed["lm_head.weight"] = state["model.decoder.embed_tokens.weight"].clone()
    for name in os.listdir(src):
        if name != "model.safetensors":
            os.symlink(os.path.join(src, name), tmp_path / name)
    save_file(renamed, str(tmp_path / "model.safetensors"))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    a = LLM(src).generate(PROMPTS[:2], params, use_tqdm=False)
    b = LLM(str(tmp_path)).generate(PROMPTS[:2], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    assert [o.outputs[0].token_ids for o in a] == [r[:8] for r in cases("125m")["ref"][:2]]


def test_tensor_parallel_is_refused_by_name(cases):
    from hayabusa.errors import HayabusaValidationError

    with pytest.raises(HayabusaValidationError) as e:
        LLM(cases("125m")["dir"], tensor_parallel_size=2)
    assert "OPTForCausalLM" in str(e.value) and e.value.parameter == "tensor_parallel_size"
