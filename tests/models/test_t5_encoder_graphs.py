"""T5's padded encoder runs (the shapes the encoder's CUDA graphs capture, issue #17 / W9), run eagerly on CPU:
bucket choice, the padded inputs' layout, the padded encoder's output equal to the packed one's, and greedy ids
equal to HF's and to the packed path's with encoder inputs of very different lengths admitted in one step."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hayabusa import LLM
from hayabusa.errors import HayabusaValidationError
from hayabusa.worker.encoder_decoder import encoder_buckets
from tests.models.test_t5 import GREEDY, PROMPTS, _hf_ref, refs, tiny_t5, tiny_t5_v11  # noqa: F401 (fixtures)


def test_encoder_buckets():
    b = encoder_buckets(512, 256)
    assert b[:4] == [(1, 32), (1, 64), (2, 32), (1, 128)]
    assert max(b, key=lambda x: x[0] * x[1])[0] * max(b, key=lambda x: x[0] * x[1])[1] == 8192
    assert (32, 256) in b and (64, 128) in b and (64, 256) not in b and (1, 512) in b
    assert {n for _, n in b} == {32, 64, 128, 256, 512} and {r for r, _ in b} == {1, 2, 4, 8, 16, 32, 64}
    assert len(b) == 32
    # max_num_reqs 3 caps B at 3; max_encoder_len 100 is the last L
    assert encoder_buckets(100, 3) == [(1, 32), (1, 64), (2, 32), (3, 32), (1, 100), (2, 64), (3, 64), (2, 100),
                                       (3, 100)]
    assert encoder_buckets(20, 1) == [(1, 20)]
    for kw, name in ((dict(max_encoder_len=0, max_num_reqs=4), "max_encoder_len"),
                     (dict(max_encoder_len=64, max_num_reqs=-1), "max_num_reqs"),
                     (dict(max_encoder_len=64, max_num_reqs=4, max_tokens=0), "max_tokens")):
        with pytest.raises(HayabusaValidationError) as e:
            encoder_buckets(**kw)
        assert e.value.parameter == name


def test_bucket_choice_and_padded_inputs(tiny_t5):
    llm = LLM(tiny_t5, max_num_seqs=16, block_size=4, max_model_len=192)
    encdec = llm.llm_engine.runner.encdec
    assert encdec.bucket_for(1, 1) == (1, 32)
    assert encdec.bucket_for(3, 33) == (4, 64)
    assert encdec.bucket_for(16, 192) == (16, 192)
    encdec.set_buckets([(1, 32), (2, 32), (2, 64)])
    assert encdec.bucket_for(2, 40) == (2, 64) and encdec.bucket_for(3, 5) is None and encdec.bucket_for(1, 65) is None
    # request 0: 6 tokens in blocks [7, 2]; request 1: 3 tokens in block [5]; bucket (3, 8): request 2 is padding
    enc = [np.arange(10, 16), np.array([20, 21, 22])]
    arr = encdec.padded_inputs(3, 8, enc, np.array([6, 3]), [[7, 2], [5]])
    T = 24
    assert arr.dtype == np.int64 and arr.shape == (2 * T + 3,)
    assert arr[:T].tolist() == [10, 11, 12, 13, 14, 15, 0, 0, 20, 21, 22, 0, 0, 0, 0, 0] + [0] * 8
    assert arr[T:2 * T].tolist() == [28, 29, 30, 31, 8, 9, -1, -1, 20, 21, 22, -1, -1, -1, -1, -1] + [-1] * 8
    assert arr[2 * T:].tolist() == [6, 3, 8]


@pytest.mark.parametrize("arch", ["tiny_t5", "tiny_t5_v11"])
def test_encode_padded_equals_encode(arch, request):
    """Real rows of the padded encoder equal the packed encoder's (masked keys add exact zeros); padding rows are
    finite."""
    llm = LLM(request.getfixturevalue(arch), max_num_seqs=4)
    model = llm.llm_engine.runner.model
    g = torch.Generator().manual_seed(0)
    lens = [70, 3, 1]
    seqs = [torch.randint(3, 1000, (n,), generator=g) for n in lens]
    with torch.inference_mode():
        packed = model.encode(torch.cat(seqs), lens)                                    # [74, d]
        L, B = 96, 4
        ids = torch.zeros(B * L, dtype=torch.int64)
        for i, s in enumerate(seqs):
            ids[i * L:i * L + len(s)] = s
        padded = model.encode_padded(ids, torch.tensor(lens + [L]), L)                 # [384, d]
        with pytest.raises(HayabusaValidationError) as e:
            model.encode_padded(ids[:-1], torch.tensor(lens + [L]), L)
        assert e.value.parameter == "input_ids"
    real = torch.cat([padded[i * L:i * L + n] for i, n in enumerate(lens)])
    torch.testing.assert_close(real, packed, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(padded).all()
    assert packed.abs().max() > 0.1          # not a vacuous comparison


@pytest.mark.parametrize("arch", ["tiny_t5", "tiny_t5_v11"])
@pytest.mark.parametrize("max_num_seqs", [1, 3, 16])
def test_greedy_padded_encoder_on_and_off(arch, max_num_seqs, request, refs):  # noqa: F811
    """Greedy ids equal HF's with the padded encoder path on (the graph shapes, run eagerly: counted) and off (the
    packed path: counted); with max_num_seqs 16 every input (1 to 100+ tokens) is admitted in one step."""
    model_dir = request.getfixturevalue(arch)
    got = {}
    for on in (True, False):
        llm = LLM(model_dir, max_num_seqs=max_num_seqs)
        encdec = llm.llm_engine.runner.encdec
        encdec.padded_encoder = on
        steps = []
        orig = encdec._run_padded

        def spy(bucket, enc, lens, blocks, kv_caches, backend, orig=orig):
            steps.append((bucket, lens.tolist()))
            return orig(bucket, enc, lens, blocks, kv_caches, backend)

        encdec._run_padded = spy
        enc, ref = _hf_ref(refs, model_dir, llm.get_tokenizer())
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        got[on] = [o.outputs[0].token_ids for o in outs]
        assert got[on] == ref
        if on:
            assert encdec.num_padded_runs == len(steps) > 0 and encdec.num_packed_runs == 0
            assert encdec.num_encoder_replays == 0                          # CPU: no graphs, the same shapes eagerly
            assert sum(len(lens) for _, lens in steps) == len(PROMPTS)
            for (B, L), lens in steps:
                assert len(lens) <= B <= max(2 * len(lens) - 1, 1) and max(lens) <= L <= max(2 * max(lens) - 1, 32)
            if max_num_seqs == 16:   # one step admitted them all: 1 to 100+ tokens padded to one L
                assert len(steps) == 1 and min(steps[0][1]) <= 3 and max(steps[0][1]) > 100
        else:
            assert encdec.num_padded_runs == 0 and encdec.num_packed_runs > 0 and not steps
    assert got[True] == got[False]


def test_steps_beyond_the_buckets_take_the_packed_path(tiny_t5_v11, refs):  # noqa: F811
    """With small buckets some admission steps fit (padded) and some do not (packed): the same greedy ids."""
    llm = LLM(tiny_t5_v11, max_num_seqs=3)
    encdec = llm.llm_engine.runner.encdec
    assert not encdec.padded_encoder            # CPU's default: the packed path
    encdec.padded_encoder = True
    encdec.set_buckets([(1, 32), (2, 32), (3, 32)])
    _, ref = _hf_ref(refs, tiny_t5_v11, llm.get_tokenizer())
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert encdec.num_padded_runs > 0 and encdec.num_packed_runs > 0
