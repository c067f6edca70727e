"""Final-only outputs (LLM.generate's output_kind="final": ids kept, text detokenized once at the end) equal the
cumulative ones step by step, for every kind of sample: plain greedy, n > 1, logprobs, stop strings; and the
request metrics count every generated token (issue #17: the output processor's per-token fast path)."""

from __future__ import annotations

from hayabusa import LLM, SamplingParams
from tests.helpers import step_until_done

PROMPTS = ["Once upon a time", "The little dog", "Lily and Ben went to the park.", "Tom had a red ball"]


def _run(engine, kind, params_list):
    for i, (prompt, params) in enumerate(zip(PROMPTS, params_list)):
        engine.add_request(f"{kind}-{i}", prompt, params, output_kind=kind)
    done = step_until_done(engine)
    return [done[f"{kind}-{i}"] for i in range(len(PROMPTS))]


def test_final_outputs_equal_cumulative_ones(stories_dir):
    llm = LLM(stories_dir, max_num_seqs=8)
    engine = llm.llm_engine
    free = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].text
    stop = free.split()[2]                       # a word the greedy text reaches: a stop-string hit
    params_list = [
        SamplingParams(temperature=0, max_tokens=24, stop=[stop]),
        SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=20),
        SamplingParams(temperature=0, max_tokens=16, logprobs=2),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
    ]
    cumulative = _run(engine, "cumulative", params_list)
    final = _run(engine, "final", params_list)
    assert cumulative[0].outputs[0].finish_reason == "stop" and cumulative[0].outputs[0].stop_reason == stop
    assert len(cumulative[1].outputs) == 2 and cumulative[2].outputs[0].logprobs
    for c, f in zip(cumulative, final):
        assert [(o.text, o.token_ids, o.finish_reason, o.stop_reason, o.cumulative_logprob, o.logprobs)
                for o in c.outputs] == [(o.text, o.token_ids, o.finish_reason, o.stop_reason,
                                         o.cumulative_logprob, o.logprobs) for o in f.outputs]
        for out in (c, f):
            m = out.metrics
            assert m.num_generation_tokens == sum(len(o.token_ids) for o in out.outputs)
            assert m.first_token_time is not None and m.arrival_time <= m.first_token_time <= m.last_token_time
    assert not engine.output_processor.states and not engine.output_processor._child_state
