"""SamplingParams(prompt_logprobs=k): per prompt position the actual token's logprob and rank and the top k, equal
to HF's float32 log-softmax; across chunked prefill, with prefix caching, n > 1 and preemption."""

from __future__ import annotations

import pytest
import torch

from hayabusa import LLM, SamplingParams
from hayabusa.errors import HayabusaValidationError
from tests.helpers import _hf_model

K = 3
TOL = 2e-4   # float32 on CPU; on CUDA the matmuls order their sums differently
BLOCKS = 128  # a fixed KV size: on a GPU the engines of later tests must fit beside earlier ones


def _hf_prompt_logprobs(model_dir: str, ids: list[int]) -> torch.Tensor:
    """[P - 1, V] float32 log-softmax: row p is the distribution of token p + 1."""
    with torch.no_grad():
        logits = _hf_model(model_dir)(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1]


def _check(model_dir: str, ids: list[int], got, k: int = K) -> None:
    ref = _hf_prompt_logprobs(model_dir, ids)
    assert len(got) == len(ids) and got[0] is None
    for p in range(1, len(ids)):
        row, d = ref[p - 1], got[p]
        actual = d[ids[p]]
        assert actual.logprob == pytest.approx(float(row[ids[p]]), abs=TOL), p
        # the rank, up to tokens within float noise of the actual one (a random model has near-ties deep down)
        v = row[ids[p]]
        assert int((row > v + 1e-4).sum()) + 1 <= actual.rank <= int((row > v - 1e-4).sum()) + 1, p
        top_vals, top_ids = row.topk(k)
        assert len(d) == len({ids[p], *top_ids.tolist()}), p
        assert sorted(d[t].logprob for t in d if t != ids[p] or d[t].rank <= k)[::-1] == \
            pytest.approx([x for t, x in zip(top_ids.tolist(), top_vals.tolist())
                           if t != ids[p] or actual.rank <= k][:len(d)], abs=TOL), p
        for tid in d:
            assert d[tid].logprob == pytest.approx(float(row[tid]), abs=TOL)


def _prompts(llm: LLM) -> list[list[int]]:
    tok = llm.get_tokenizer()
    texts = ["Once upon a time, there was a little girl named Lily who loved to play outside in the park.",
             "The cat sat on the mat and looked at the dog.", "Tom"]
    return [tok(t).input_ids for t in texts]


@pytest.mark.parametrize("arch", ["stories_dir", "tiny_qwen2"])
@pytest.mark.parametrize("extra", [{}, {"max_num_batched_tokens": 7, "max_num_seqs": 4}], ids=["one_chunk", "chunked"])
def test_prompt_logprobs_equal_hf(arch, extra, request):
    model_dir = request.getfixturevalue(arch)
    llm = LLM(model_dir, dtype="float32", max_model_len=256, num_gpu_blocks_override=BLOCKS, **extra)
    prompts = _prompts(llm)
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=K)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for ids, out in zip(prompts, outs):
        _check(model_dir, ids, out.prompt_logprobs)


def test_prompt_logprobs_with_prefix_cache_hit(stories_dir):
    """A prompt whose blocks are cached by an earlier request is recomputed for its prompt logprobs (a cached
    block has no logits); a request without prompt_logprobs still takes the hit."""
    llm = LLM(stories_dir, dtype="float32", block_size=4, enable_prefix_caching=True, max_model_len=256,
              num_gpu_blocks_override=BLOCKS)
    kv = llm.llm_engine.kv_cache_manager
    ids = _prompts(llm)[0]
    llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1), use_tqdm=False)
    hits = kv.num_hit_tokens
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    assert kv.num_hit_tokens == hits
    _check(stories_dir, ids, out[0].prompt_logprobs, k=0)
    assert all(len(d) == 1 for d in out[0].prompt_logprobs[1:])    # k = 0: the actual token only
    llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1), use_tqdm=False)
    assert kv.num_hit_tokens > hits


def test_prompt_logprobs_n_and_mixed_batch(stories_dir):
    """n > 1 returns the prompt's logprobs once; requests without prompt_logprobs in the same batch get None,
    and their outputs do not change."""
    llm = LLM(stories_dir, dtype="float32", max_num_batched_tokens=9, max_num_seqs=4, max_model_len=256,
              num_gpu_blocks_override=BLOCKS)
    prompts = _prompts(llm)
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    want = [o.outputs[0].token_ids for o in
            llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)]
    params = [SamplingParams(temperature=0.0, max_tokens=8, prompt_logprobs=2, n=2), greedy,
              SamplingParams(temperature=0.0, max_tokens=8, prompt_logprobs=1)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    _check(stories_dir, prompts[0], outs[0].prompt_logprobs, k=2)
    assert outs[1].prompt_logprobs is None
    _check(stories_dir, prompts[2], outs[2].prompt_logprobs, k=1)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert outs[0].outputs[1].token_ids == want[0]


def test_prompt_logprobs_under_preemption(stories_dir):
    """A request preempted after part of its prompt logprobs were returned is recomputed; none is returned
    twice or lost."""
    llm = LLM(stories_dir, dtype="float32", block_size=4, num_gpu_blocks_override=16, max_model_len=64,
              max_num_batched_tokens=8, max_num_seqs=4, enable_prefix_caching=False)
    tok = llm.get_tokenizer()
    prompts = [tok("Once upon a time there was a girl named Lily. She").input_ids,
               tok("The dog ran to the park and saw a big red ball.").input_ids]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, prompt_logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    for ids, out in zip(prompts, outs):
        _check(stories_dir, ids, out.prompt_logprobs, k=1)


def test_prompt_logprobs_validation():
    with pytest.raises(HayabusaValidationError) as e:
        SamplingParams(prompt_logprobs=-2)
    assert e.value.parameter == "prompt_logprobs"


def _mixed_run(model_dir: str, **kw):
    """Prompt-logprob requests arriving while others decode, their prompts split into chunks."""
    llm = LLM(model_dir, dtype="float32", max_model_len=256, max_num_batched_tokens=16, max_num_seqs=4,
              num_gpu_blocks_override=BLOCKS, **kw)
    prompts = _prompts(llm)
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=5, prompt_logprobs=3),
              SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=0, logprobs=2)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    return prompts, outs


def test_prompt_logprobs_with_async_scheduling(stories_dir):
    prompts, outs = _mixed_run(stories_dir, async_scheduling=True)
    _, sync = _mixed_run(stories_dir, async_scheduling=False)
    assert outs[0].prompt_logprobs is None
    _check(stories_dir, prompts[1], outs[1].prompt_logprobs, k=3)
    _check(stories_dir, prompts[2], outs[2].prompt_logprobs, k=0)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in sync]


@pytest.mark.cuda
@pytest.mark.parametrize("arch", ["stories_dir", "tiny_qwen2"])
def test_prompt_logprobs_cuda(arch, request):
    """On the GPU: async scheduling and CUDA graphs on (their defaults); a 1-token prompt chunk of a
    prompt-logprob request in a decode step runs eagerly, its logprobs copied back with the step's sync."""
    model_dir = request.getfixturevalue(arch)
    prompts, outs = _mixed_run(model_dir, device="cuda")
    assert outs[1].prompt_logprobs is not None and outs[0].prompt_logprobs is None
    _check(model_dir, prompts[1], outs[1].prompt_logprobs, k=3)
    _check(model_dir, prompts[2], outs[2].prompt_logprobs, k=0)
