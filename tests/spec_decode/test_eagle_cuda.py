"""EAGLE / EAGLE-3 heads on CUDA (run on the device): greedy ids equal speculation off, and the proposals equal
the dense transformers-based reference of the CPU tests (fp32, tiny random heads in the public formats)."""

from __future__ import annotations

import pytest

from hayabusa import LLM, SamplingParams
from tests.spec_decode.eagle_heads import write_eagle_head
from tests.spec_decode.test_eagle import PROMPTS, _ids, _reference_proposals, _spec

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
@pytest.mark.parametrize("max_num_seqs", [1, 3])
def test_eagle_on_cuda(tiny_llama, tmp_path, method, max_num_seqs):
    head = str(tmp_path / method)
    aux = [1, 0, 1]
    write_eagle_head(tiny_llama, head, eagle3=method == "eagle3", seed=3, aux_ids=aux, draft_vocab_size=300)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    kwargs = dict(device="cuda", dtype="float32", max_num_seqs=max_num_seqs, kv_cache_memory_bytes=256 << 20)
    base = LLM(tiny_llama, **kwargs).generate(PROMPTS, params, use_tqdm=False)
    llm = LLM(tiny_llama, speculative_config=_spec(method, head), **kwargs)
    drafter = llm.llm_engine.runner.draft
    seen, propose = [], drafter.propose

    def record(req_index, num_drafts, rows, *args):
        out = propose(req_index, num_drafts, rows, *args)
        b = llm.llm_engine.runner.batch
        for i, (row, k) in enumerate(zip(rows.tolist(), num_drafts.tolist())):
            seen.append((b.token_ids[row, :b.num_tokens[row]].tolist(), out[i, :k].tolist()))
        return out

    drafter.propose = record
    assert _ids(llm.generate(PROMPTS, params, use_tqdm=False)) == _ids(base)
    assert llm.get_metrics()["spec_decode_num_draft_tokens"] > 0 and len(seen) >= 4
    for tokens, props in seen[:6]:
        assert props == _reference_proposals(tiny_llama, head, method == "eagle3", aux, tokens, len(props))
