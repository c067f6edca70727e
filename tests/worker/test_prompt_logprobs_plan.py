"""plan_prompt_logprobs pins which of a step's tokens give prompt logprobs (exact indices, by hand)."""

from __future__ import annotations

import numpy as np

from hayabusa.worker.prompt_logprobs import plan_prompt_logprobs


def test_plan_over_chunks_and_after_preemption():
    token_ids = np.zeros((3, 16), dtype=np.int32)
    token_ids[0, :5] = [10, 11, 12, 13, 14]            # row 0: "a", prompt of 5 tokens, k = 2
    token_ids[2, :3] = [20, 21, 22]                    # row 2: "b", prompt of 3 tokens, no prompt logprobs
    num_prompt = np.array([5, 0, 3])
    wanted, done = {"a": 2}, {}
    # step 1: "b" decodes (1 token), "a" computes positions 0..2 -> logprobs of tokens 1..3 (its 3 tokens follow b's)
    plan = plan_prompt_logprobs(["b", "a"], np.array([2, 0]), np.array([3, 0]), np.array([0, 1, 4]), wanted, done,
                                token_ids, num_prompt)
    assert plan.req_ids == ["a"] and plan.counts == [3]
    assert plan.token_index.tolist() == [1, 2, 3] and plan.target_ids.tolist() == [11, 12, 13]
    assert plan.num_logprobs.tolist() == [2, 2, 2] and done == {"a": 3} and wanted == {"a": 2}
    # step 2: positions 3..4; position 4 (the last) samples, so only token 4's logprob; "a" is complete
    plan = plan_prompt_logprobs(["a"], np.array([0]), np.array([3]), np.array([0, 2]), wanted, done, token_ids,
                                num_prompt)
    assert plan.token_index.tolist() == [0] and plan.target_ids.tolist() == [14]
    assert wanted == {} and done == {"a": 4}
    # preempted and recomputed from 0: nothing is planned twice (and "a" is no longer wanted anyway)
    wanted["a"] = 2
    assert plan_prompt_logprobs(["a"], np.array([0]), np.array([0]), np.array([0, 5]), wanted, done, token_ids,
                                num_prompt) is None
    assert wanted == {}
