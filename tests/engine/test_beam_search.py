"""LLM.beam_search equals HF generate(num_beams=k, do_sample=False) on float32 tiny models: the k returned
sequences, their order and their scores, with and without a length penalty, with EOS and ignore_eos."""

from __future__ import annotations

import math

import pytest
import torch

from hayabusa import LLM
from hayabusa.errors import HayabusaValidationError
from hayabusa.sampling_params import BeamSearchParams
from tests.helpers import _hf_model


def _hf_beams(model_dir, ids, k, max_new, length_penalty, eos):
    model = _hf_model(model_dir)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), num_beams=k, num_return_sequences=k, do_sample=False,
                             max_new_tokens=max_new, length_penalty=length_penalty, return_dict_in_generate=True,
                             output_scores=True, eos_token_id=eos, pad_token_id=eos if eos is not None else 0,
                             early_stopping=False)
    seqs = []
    for row in out.sequences.tolist():
        gen = row[len(ids):]
        if eos is not None and eos in gen:
            gen = gen[:gen.index(eos) + 1]
        seqs.append(gen)
    return seqs, out.sequences_scores.tolist()


@pytest.mark.parametrize("arch", ["stories_dir", "tiny_qwen2"])
@pytest.mark.parametrize("k,length_penalty", [(2, 1.0), (3, 0.5), (4, 2.0)])
def test_beam_search_equals_hf(arch, k, length_penalty, request):
    model_dir = request.getfixturevalue(arch)
    llm = LLM(model_dir, dtype="float32", max_model_len=256, num_gpu_blocks_override=128)
    tok = llm.get_tokenizer()
    prompts = ["Once upon a time, there was a", "The dog"]
    eos = llm.llm_engine.config.model_config.eos_token_ids[0]
    max_new = 10
    outs = llm.beam_search([{"prompt_token_ids": tok(p).input_ids} for p in prompts],
                           BeamSearchParams(beam_width=k, max_tokens=max_new, length_penalty=length_penalty))
    assert len(outs) == len(prompts)
    for p, out in zip(prompts, outs):
        ids = tok(p).input_ids
        want, want_scores = _hf_beams(model_dir, ids, k, max_new, length_penalty, eos)
        got = [s.tokens[len(ids):] for s in out.sequences]
        assert all(s.tokens[:len(ids)] == ids for s in out.sequences)
        assert got == want
        assert [s.score for s in out.sequences] == pytest.approx(want_scores, abs=1e-4)
        for s in out.sequences:
            assert s.finish_reason == ("stop" if s.tokens[-1] == eos else "length")
            assert s.text == tok.decode(s.tokens, skip_special_tokens=True)


def test_beam_search_ignore_eos_runs_to_max_tokens(stories_dir):
    llm = LLM(stories_dir, dtype="float32", max_model_len=256, num_gpu_blocks_override=128)
    ids = llm.get_tokenizer()("Tom had a red ball. He").input_ids
    out = llm.beam_search([{"prompt_token_ids": ids}], BeamSearchParams(beam_width=2, max_tokens=12,
                                                                        ignore_eos=True))[0]
    want, scores = _hf_beams(stories_dir, ids, 2, 12, 1.0, None)
    assert [s.tokens[len(ids):] for s in out.sequences] == want
    assert all(len(s.tokens) == len(ids) + 12 and s.finish_reason == "length" for s in out.sequences)
    assert out.sequences[0].cum_logprob == pytest.approx(scores[0] * 12, abs=1e-3)


def test_beam_search_params_are_checked(stories_dir):
    with pytest.raises(HayabusaValidationError) as e:
        BeamSearchParams(beam_width=0, max_tokens=4)
    assert e.value.parameter == "beam_width"
    llm = LLM(stories_dir, max_logprobs=4, num_gpu_blocks_override=64)
    with pytest.raises(HayabusaValidationError) as e:
        llm.beam_search(["Hi"], BeamSearchParams(beam_width=3, max_tokens=4))
    assert e.value.parameter == "beam_width"


@pytest.mark.parametrize("length_penalty", [1.0, 0.0, 3.0])
def test_beam_search_with_finished_beams_equals_hf(stories_dir, tmp_path, length_penalty):
    """EOS = "." (which stories260K writes every few tokens), so beams finish at different lengths and the
    length penalty and HF's early-stop rule decide the ranking."""
    import json
    import shutil

    model = tmp_path / "m"
    shutil.copytree(stories_dir, model)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(stories_dir)
    period = tok.convert_tokens_to_ids(".")
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": period}))
    llm = LLM(str(model), dtype="float32", max_model_len=256, num_gpu_blocks_override=128)
    assert llm.llm_engine.config.model_config.eos_token_ids == (period,)
    finished = 0
    for p in ["Once upon a time, there was a", "Lily was sad. She", "The dog"]:
        ids = tok(p).input_ids
        out = llm.beam_search([{"prompt_token_ids": ids}], BeamSearchParams(3, 24, length_penalty=length_penalty))[0]
        want, scores = _hf_beams(str(model), ids, 3, 24, length_penalty, period)
        assert [s.tokens[len(ids):] for s in out.sequences] == want
        assert [s.score for s in out.sequences] == pytest.approx(scores, abs=1e-4)
        finished += sum(s.finish_reason == "stop" for s in out.sequences)
    assert finished >= 3


@pytest.mark.parametrize("length_penalty", [1e308, -1e308])
def test_extreme_length_penalty_ranks_without_overflow(stories_dir, length_penalty):
    """A finite but extreme length_penalty: ``n ** 1e308`` overflows (OverflowError was a 500 on the server) and
    ``n ** -1e308`` underflows to 0.0 (ZeroDivisionError); the scores are their limits, -0.0 and -inf."""
    from hayabusa.beam_search import _length_normalized

    assert _length_normalized(-3.0, 4, 1.0) == -0.75
    assert _length_normalized(-3.0, 1, 1e308) == -3.0
    llm = LLM(stories_dir, dtype="float32", max_model_len=256, num_gpu_blocks_override=128)
    out = llm.beam_search(["Once upon"], BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True,
                                                          length_penalty=length_penalty))[0]
    assert len(out.sequences) == 2
    want = 0.0 if length_penalty > 0 else -math.inf
    assert [s.score for s in out.sequences] == [want, want]
    assert all(s.cum_logprob < 0 for s in out.sequences)
