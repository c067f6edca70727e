"""SamplingParams.logit_bias, allowed_token_ids and bad_words (vLLM's semantics) on stories260K, CPU.

The reference for greedy: HF's logits of the same sequence, edited by hand (masked / biased), argmaxed.
"""

from __future__ import annotations

import math

import pytest
import torch

from hayabusa import LLM, SamplingParams
from hayabusa.errors import HayabusaTypeError, HayabusaValidationError
from hayabusa.sample import Sampler, build_sampling_metadata
from hayabusa.sample.metadata import bad_word_bans

PROMPTS = ["Once upon a time", "The little dog"]
GIRL = [298, 315, 421]          # " girl" in stories260K's tokenizer: "▁g", "ir", "l"
LILY = 317                      # " Lily", one token


@pytest.fixture(scope="module")
def llm(stories_dir):
    return LLM(stories_dir, async_scheduling=False)


@pytest.fixture(scope="module")
def hf_model(stories_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(stories_dir, torch_dtype=torch.float32).eval()


def greedy(max_tokens=20, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def ids_of(outs):
    return [list(o.outputs[0].token_ids) for o in outs]


def contains(seq, sub):
    return any(seq[i:i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))


@pytest.fixture(scope="module")
def base(llm):
    return ids_of(llm.generate(PROMPTS, greedy(), use_tqdm=False))


def hf_logits(hf_model, llm, prompt, out_ids):
    """HF's fp32 logits [len(out_ids), V] predicting each output token of prompt + out_ids."""
    ids = llm.get_tokenizer()(prompt)["input_ids"]
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids + out_ids])).logits[0].float()
    return logits[len(ids) - 1:len(ids) - 1 + len(out_ids)]


def test_base_output_has_the_words_the_tests_ban(base):
    # the bad_words / bias tests below mean something only if greedy without them emits these
    assert all(contains(b, GIRL) and LILY in b for b in base)


def test_allowed_token_ids_greedy_is_the_best_allowed_token(llm, hf_model, base):
    allowed = sorted(set(base[0][:8]) | {13, 400, 500})          # some of greedy's own tokens + others
    outs = ids_of(llm.generate(PROMPTS, greedy(allowed_token_ids=allowed), use_tqdm=False))
    for prompt, out in zip(PROMPTS, outs):
        assert set(out) <= set(allowed) and len(set(out)) > 1
        logits = hf_logits(hf_model, llm, prompt, out)
        masked = torch.full_like(logits, -math.inf)
        masked[:, allowed] = logits[:, allowed]
        top2 = masked.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 1e-3              # skip near-ties (fp32 noise between engines)
        assert clear.sum() >= len(out) - 2
        assert masked.argmax(-1)[clear].tolist() == torch.tensor(out)[clear].tolist()


def test_allowed_token_ids_hold_when_sampling_with_n(llm):
    allowed = [261, 298, 317, 395, 13]
    outs = llm.generate(PROMPTS, SamplingParams(temperature=1.0, n=3, seed=7, max_tokens=12, ignore_eos=True,
                                                 allowed_token_ids=allowed), use_tqdm=False)
    for o in outs:
        assert len(o.outputs) == 3
        for c in o.outputs:
            assert len(c.token_ids) == 12 and set(c.token_ids) <= set(allowed)


def test_logit_bias_plus_100_makes_greedy_emit_the_token(llm, base):
    assert 77 not in base[0] + base[1]
    outs = ids_of(llm.generate(PROMPTS, greedy(8, logit_bias={77: 100.0}), use_tqdm=False))
    assert outs == [[77] * 8, [77] * 8]
    # -100 on greedy's first token: another token comes first
    outs = ids_of(llm.generate(PROMPTS, greedy(4, logit_bias={base[0][0]: -100.0}), use_tqdm=False))
    assert outs[0][0] != base[0][0]


def test_logit_bias_greedy_matches_biased_hf_argmax(llm, hf_model, base):
    bias = {base[0][1]: -3.0, 261: 2.5, 376: 1.5}
    out = ids_of(llm.generate(PROMPTS[:1], greedy(12, logit_bias=bias), use_tqdm=False))[0]
    assert out != base[0][:12]
    logits = hf_logits(hf_model, llm, PROMPTS[0], out)
    for t, b in bias.items():
        logits[:, t] += b
    top2 = logits.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 1e-3
    assert clear.sum() >= len(out) - 2
    assert logits.argmax(-1)[clear].tolist() == torch.tensor(out)[clear].tolist()


def test_logprobs_stay_raw_under_logit_bias(llm, hf_model):
    # vLLM's default logprobs_mode is raw_logprobs: the bias changes the token, not the logprobs returned
    out = llm.generate(PROMPTS[:1], greedy(1, logit_bias={77: 100.0}, logprobs=1), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [77]
    raw = torch.log_softmax(hf_logits(hf_model, llm, PROMPTS[0], [77])[0], -1)
    assert out.logprobs[0][77].logprob == pytest.approx(raw[77].item(), abs=1e-3)
    assert out.logprobs[0][77].rank > 1


def test_bad_words_never_appear_while_greedy_would_emit_them(llm, base):
    outs = llm.generate(PROMPTS, greedy(bad_words=["girl", "Lily"]), use_tqdm=False)
    for o in outs:
        ids = list(o.outputs[0].token_ids)
        assert not contains(ids, GIRL) and LILY not in ids
        assert "girl" not in o.outputs[0].text and "Lily" not in o.outputs[0].text
    # only the last token of " girl" is banned, after its other tokens: greedy still starts the word
    assert contains(list(outs[0].outputs[0].token_ids), GIRL[:2])


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_mixed_batch_leaves_the_other_requests_unchanged(stories_dir, base, async_scheduling):
    llm = LLM(stories_dir, async_scheduling=async_scheduling)
    params = [greedy(bad_words=["girl"]), greedy(), greedy(logit_bias={77: 100.0}), greedy(),
              greedy(allowed_token_ids=[261, 298, 13])]
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[0], PROMPTS[0], PROMPTS[1]]
    outs = ids_of(llm.generate(prompts, params, use_tqdm=False))
    assert outs[1] == base[1] and outs[3] == base[0]       # the plain requests: as alone
    assert not contains(outs[0], GIRL) and outs[2] == [77] * 20 and set(outs[4]) <= {261, 298, 13}
    # the same requests each alone (the fast path batch without edits is the same greedy output)
    alone = [ids_of(llm.generate([p], q, use_tqdm=False))[0] for p, q in zip(prompts, params)]
    assert alone == outs


def test_bad_words_sync_and_async_scheduling_agree(stories_dir):
    # async scheduling: the last output token is on the device only; the multi-token test reads it there
    params = [greedy(30, bad_words=["girl", "play with"]), SamplingParams(temperature=0.8, seed=3, max_tokens=30,
                                                                         bad_words=["girl"], ignore_eos=True)]
    sync = ids_of(LLM(stories_dir, async_scheduling=False).generate(PROMPTS, params, use_tqdm=False))
    async_ = ids_of(LLM(stories_dir, async_scheduling=True).generate(PROMPTS, params, use_tqdm=False))
    assert sync == async_
    assert not any(contains(o, GIRL) for o in sync)


def test_structured_outputs_with_logit_bias(llm):
    pytest.importorskip("xgrammar")
    choice = {"choice": ["cat", "dog"]}
    plain = llm.generate(PROMPTS[:1], greedy(8, structured_outputs=choice), use_tqdm=False)[0].outputs[0].text
    other = "dog" if plain == "cat" else "cat"
    # the grammar spells the word from its letters (no leading "▁"): bias the other word's first letter
    first = llm.get_tokenizer().convert_tokens_to_ids(other[0])
    out = llm.generate(PROMPTS[:1], greedy(8, structured_outputs=choice, logit_bias={first: 100.0}),
                       use_tqdm=False)[0].outputs[0].text
    assert plain in ("cat", "dog") and out == other


def test_speculative_decoding_leaves_edited_requests_alone(stories_dir, base):
    llm = LLM(stories_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                               "prompt_lookup_max": 3, "prompt_lookup_min": 1})
    params = [greedy(bad_words=["girl"]), greedy(logit_bias={77: 100.0}), greedy()]
    outs = ids_of(llm.generate([PROMPTS[0], PROMPTS[0], PROMPTS[1]], params, use_tqdm=False))
    ref = ids_of(LLM(stories_dir).generate([PROMPTS[0], PROMPTS[0], PROMPTS[1]], params, use_tqdm=False))
    assert outs == ref and outs[2] == base[1] and outs[1] == [77] * 20


def test_edit_free_batches_keep_the_greedy_fast_path(stories_dir):
    llm = LLM(stories_dir, async_scheduling=False)
    calls = []
    sampler = llm.llm_engine.runner.sampler
    orig = sampler.forward
    sampler.forward = lambda *a, **k: calls.append(1) or orig(*a, **k)
    plain = ids_of(llm.generate(PROMPTS, greedy(), use_tqdm=False))
    assert not calls                                            # plain greedy: argmax only, no Sampler
    mixed = ids_of(llm.generate(PROMPTS, [greedy(logit_bias={5: 0.0}), greedy()], use_tqdm=False))
    assert calls and mixed == plain                             # a zero bias: the Sampler's argmax, same tokens


# ------------------------------------------------------------------ validation
@pytest.mark.parametrize("kwargs, parameter, is_type_error", [
    (dict(logit_bias={1: math.nan}), "logit_bias", False),
    (dict(logit_bias={1: math.inf}), "logit_bias", False),
    (dict(logit_bias={1: "x"}), "logit_bias", True),
    (dict(logit_bias={"a": 1.0}), "logit_bias", True),
    (dict(logit_bias={-1: 1.0}), "logit_bias", False),
    (dict(logit_bias=[1, 2]), "logit_bias", True),
    (dict(allowed_token_ids=[]), "allowed_token_ids", False),
    (dict(allowed_token_ids=[-3]), "allowed_token_ids", False),
    (dict(allowed_token_ids=[1.5]), "allowed_token_ids", True),
    (dict(allowed_token_ids=5), "allowed_token_ids", True),
    (dict(bad_words=[""]), "bad_words", False),
    (dict(bad_words=["ok", 3]), "bad_words", True),
    (dict(bad_words=["\ud800"]), "bad_words", False),
])
def test_bad_values_are_named(kwargs, parameter, is_type_error):
    with pytest.raises(HayabusaValidationError) as e:
        SamplingParams(**kwargs)
    assert e.value.parameter == parameter and parameter in str(e.value)
    assert isinstance(e.value, ValueError) and isinstance(e.value, HayabusaTypeError) == is_type_error


def test_good_values_are_normalised():
    sp = SamplingParams(logit_bias={"5": 1, 3: -2.5}, allowed_token_ids=(4, 2), bad_words=("x",))
    assert sp.logit_bias == {5: 1.0, 3: -2.5} and sp.allowed_token_ids == [4, 2] and sp.bad_words == ["x"]
    assert sp.has_logit_edits and not SamplingParams().has_logit_edits
    assert SamplingParams(logit_bias={}).has_logit_edits is False   # empty: nothing to do (fast path kept)


@pytest.mark.parametrize("kwargs, parameter", [(dict(logit_bias={512: 1.0}), "logit_bias"),
                                               (dict(allowed_token_ids=[1, 512]), "allowed_token_ids")])
def test_out_of_vocab_ids_are_refused_by_the_engine(llm, kwargs, parameter):
    with pytest.raises(HayabusaValidationError) as e:
        llm.generate(PROMPTS[:1], greedy(2, **kwargs), use_tqdm=False)
    assert e.value.parameter == parameter and "512" in str(e.value)
    assert not llm.llm_engine.has_unfinished_requests()


def test_bad_words_tokenized_as_vllm(llm):
    ip = llm.llm_engine.input_processor
    assert ip.bad_words_token_ids(["girl", " Lily"]) == [GIRL, [LILY]]


# ------------------------------------------------------------------ host helpers and the sampler alone
def test_bad_word_bans_prefix_rule_and_pending_token():
    words = [[5], [1, 2, 3], [7, 8]]
    assert bad_word_bans(words, [], 0) == [(5, -1)]                 # a 3-token word needs 2 outputs first
    assert bad_word_bans(words, [9, 1, 2], 3) == [(5, -1), (3, -1)]
    assert bad_word_bans(words, [9, 1, 4], 3) == [(5, -1)]
    assert bad_word_bans(words, [9, 1], 3) == [(5, -1), (3, 2), (8, 7)]   # last output on the device only
    assert bad_word_bans(words, [9, 7], 2) == [(5, -1), (8, -1)]


def test_sampler_applies_edits_in_vllm_order():
    V = 8
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]] * 3)
    ps = [SamplingParams(temperature=0.0, allowed_token_ids=[1, 2, 3], logit_bias={1: 10.0, 7: 100.0}),
          SamplingParams(temperature=0.0, bad_words=["w"], logprobs=2),
          SamplingParams(temperature=0.0)]
    ps[1].bad_words_token_ids = [[7], [4, 6]]
    md = build_sampling_metadata(ps, [[1]] * 3, [[], [4], []], [None] * 3, None, V, "cpu")
    out = Sampler()(logits, md)
    # row 0: 7 masked by allowed_token_ids before its bias; 1 + 10 wins. row 1: 7 banned, 6 banned after 4.
    assert out.sampled_token_ids.tolist() == [1, 5, 7]
    raw = torch.log_softmax(logits[1], -1)
    assert out.logprobs[1, 0].item() == pytest.approx(raw[5].item())       # raw logprobs
