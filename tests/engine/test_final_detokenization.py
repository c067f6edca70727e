"""The final-only detokenization of LLM.generate (issue #17): the samples that end in a step are detokenized
together (``detokenizer.finish_all``: one batched decode per tokenizer where that decode is the answer) and give
the same text and token ids as ``update`` on each (the general path), for byte-level BPE (the fast path) and
SentencePiece byte fallback (the general path); end to end, W9-like T5 requests give the same ids and texts
through LLM.generate (final only) and the engine's cumulative outputs, stop strings, min_tokens, special tokens
and n > 1 included."""

from __future__ import annotations

import random
import shutil

import pytest
import torch

from hayabusa import LLM, SamplingParams
from hayabusa.engine import detokenizer as dt
from tests.conftest import TOKENIZERS, require_asset
from tests.helpers import step_until_done


@pytest.fixture(scope="module")
def tokenizers() -> dict:
    """Loaded once for the module (Qwen3's takes ~2 s)."""
    from transformers import AutoTokenizer

    return {name: AutoTokenizer.from_pretrained(str(require_asset(TOKENIZERS / name)))
            for name in ("qwen3", "llm-jp-v2.2")}


def _cases(tok, rng: random.Random) -> list[tuple[list[int], list[int], SamplingParams, bool]]:
    """(prompt ids, output ids, params, stop_terminated): plain ids, text ids (English, Japanese), special ids
    inside and at the end, outputs cut inside a character, with and without skip_special_tokens,
    include_stop_str_in_output and min_tokens."""
    V = len(tok)
    special = sorted(dt.special_ids(tok))
    texts = ["Total ¥1,280 paid by card.", "領収書 合計 ¥540 (税込)", "吾輩は猫である。", " leading space", "😀 ok"]
    cases = []
    for i in range(60):
        prompt = [rng.randrange(100, V - 300) for _ in range(rng.randrange(1, 40))]
        out = tok(texts[i % len(texts)], add_special_tokens=False).input_ids
        if i % 3 == 1:
            out = [rng.randrange(100, V - 300) for _ in range(rng.randrange(1, 20))]
        if i % 5 == 2:
            out = out[:-1] if len(out) > 1 else out          # may end inside a character (held-back bytes)
        if i % 4 == 3 and special:
            out = out[:2] + [special[i % len(special)]] + out[2:]
        stop_terminated = i % 6 == 5
        if stop_terminated:
            out = out + [tok.eos_token_id if tok.eos_token_id is not None else special[0]]
        params = SamplingParams(temperature=0.0, max_tokens=64, skip_special_tokens=i % 7 != 4,
                                include_stop_str_in_output=i % 9 == 8, min_tokens=2 if i % 11 == 10 else 0)
        cases.append((prompt, out, params, stop_terminated))
    # a lone lead byte of a 3-byte character at the end (byte-level BPE: the token "ç" is byte 0xE7; with byte
    # fallback "<0xE7>"): decode shows U+FFFD, the fast path's check sends it to update
    lead = tok.convert_tokens_to_ids("<0xE7>" if dt.byte_fallback_ids(tok) else "ç")
    for j in range(3):
        ids = tok(texts[j], add_special_tokens=False).input_ids
        cases.append(([rng.randrange(100, V - 300) for _ in range(8)], ids + [lead], SamplingParams(temperature=0.0),
                      False))
    return cases


@pytest.mark.parametrize("name, fast", [("qwen3", True), ("llm-jp-v2.2", False)])
def test_finish_all_equals_update_on_each(name, fast, tokenizers, monkeypatch):
    tok = tokenizers[name]
    cases = _cases(tok, random.Random(0))
    general = [dt.IncrementalDetokenizer(tok, p, sp) for p, _, sp, _ in cases]
    for d, (_, out, _, st) in zip(general, cases):
        d.update(list(out), st, finished=True)
    batched = [dt.IncrementalDetokenizer(tok, p, sp) for p, _, sp, _ in cases]
    calls = []
    update = dt.IncrementalDetokenizer.update

    def counted(self, *a, **kw):
        calls.append(self)
        return update(self, *a, **kw)

    monkeypatch.setattr(dt.IncrementalDetokenizer, "update", counted)
    dt.finish_all([(d, list(out), st) for d, (_, out, _, st) in zip(batched, cases)])
    for g, b, (_, out, sp, st) in zip(general, batched, cases):
        assert b.output_text == g.output_text, (out, sp.skip_special_tokens, st)
        assert b.token_ids == g.token_ids == out
        assert b.get_next_output_text(True, delta=False) == g.get_next_output_text(True, delta=False)
        assert b.get_next_output_text(True, delta=True) == g.get_next_output_text(True, delta=True)
    if fast:     # most took the batched decode; min_tokens, held-back endings and id runs without text did not
        assert len(cases) // 2 < len(cases) - len(calls) < len(cases)
        assert any(g.output_text.endswith(dt.REPLACEMENT_CHAR) for g in general)   # a held-back case was there
    else:        # byte fallback: every one through update
        assert len(calls) == len(cases)


@pytest.fixture(scope="module")
def tiny_t5_bpe(tmp_path_factory, tokenizers) -> str:
    """A random 2 + 2 layer T5 on Qwen3's byte-level BPE tokenizer (no byte fallback: the batched decode)."""
    from transformers import T5Config, T5ForConditionalGeneration

    tok = tokenizers["qwen3"]
    out = tmp_path_factory.mktemp("t5_bpe")
    cfg = T5Config(vocab_size=len(tok), d_model=16, d_kv=4, d_ff=32, num_layers=2, num_decoder_layers=2,
                   num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=16,
                   eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                   decoder_start_token_id=tok.pad_token_id, initializer_factor=4.0)
    torch.manual_seed(0)
    T5ForConditionalGeneration(cfg).save_pretrained(str(out), safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):   # copied: saving Qwen3's tokenizer again takes seconds
        shutil.copy(TOKENIZERS / "qwen3" / f, out / f)
    return str(out)


def test_generate_final_texts_equal_the_cumulative_path(tiny_t5_bpe, monkeypatch):
    """W9-like requests (encoder ids -> greedy tokens): LLM.generate's final-only outputs (batched final decode,
    or the general path for stop strings / min_tokens) equal the cumulative outputs of the same requests stepped
    through the engine (incremental detokenization every step)."""
    llm = LLM(tiny_t5_bpe, device="cpu", max_num_seqs=8, max_model_len=64)
    rng = random.Random(1)
    prompts = [{"prompt_token_ids": [rng.randrange(100, 150000) for _ in range(rng.randrange(4, 40))]}
               for _ in range(8)]
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, skip_special_tokens=False),
              SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[4]),
              SamplingParams(temperature=0.0, max_tokens=12, min_tokens=3, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=5, n=2, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, include_stop_str_in_output=True)]
    params = [params[i % len(params)] for i in range(len(prompts))]
    from hayabusa.engine import output_processor

    ended, updates = [], []
    real_finish_all, real_update = output_processor.finish_all, dt.IncrementalDetokenizer.update
    monkeypatch.setattr(output_processor, "finish_all", lambda items: (ended.extend(items), real_finish_all(items)))
    monkeypatch.setattr(dt.IncrementalDetokenizer, "update",
                        lambda self, *a, **kw: (updates.append(self), real_update(self, *a, **kw))[1])
    final = llm.generate(prompts, params, use_tqdm=False)
    # every sample (8 prompts, one with n = 2) ended through finish_all; the batched decode served most of them
    # (update ran only for min_tokens and whatever ended inside a character)
    assert len(ended) == 9 and len(updates) <= 3
    monkeypatch.undo()
    engine = llm.llm_engine
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"c{i}", p, sp, output_kind="cumulative")
    cumulative = step_until_done(engine)
    # stop strings from the greedy text (general path for those): cut where the cumulative path cuts
    texts = [o.outputs[0].text for o in final]
    assert sum(bool(t) for t in texts) >= 6
    for i, o in enumerate(final):
        c = cumulative[f"c{i}"]
        assert [x.token_ids for x in o.outputs] == [x.token_ids for x in c.outputs]
        assert [x.text for x in o.outputs] == [x.text for x in c.outputs]
        assert [x.finish_reason for x in o.outputs] == [x.finish_reason for x in c.outputs]
    stop_params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=[t[3:5]],
                                  include_stop_str_in_output=j % 2 == 1)
                   for j, t in enumerate(texts) if len(t) > 6]
    stopped = llm.generate(prompts[:len(stop_params)], stop_params, use_tqdm=False)
    for j, (o, sp) in enumerate(zip(stopped, stop_params)):
        engine.add_request(f"s{j}", prompts[j], sp, output_kind="cumulative")
    cum = step_until_done(engine)
    for j, o in enumerate(stopped):
        assert o.outputs[0].text == cum[f"s{j}"].outputs[0].text
        assert o.outputs[0].token_ids == cum[f"s{j}"].outputs[0].token_ids
    assert any(o.outputs[0].finish_reason == "stop" for o in stopped)
