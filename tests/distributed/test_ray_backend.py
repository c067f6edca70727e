"""distributed_executor_backend="ray" on a local 2-CPU Ray cluster: the same greedy ids as "mp" (and as one
process). A slower tier (Ray starts its own daemons): marked ``ray``; skips, saying why, without ray."""

from __future__ import annotations

import pytest

from hayabusa import LLM, SamplingParams
from tests.distributed.test_tensor_parallel import ENGINE, PROMPTS, _build

ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'hayabusa[ray]'): Ray tier skipped")
pytestmark = pytest.mark.ray


def test_ray_backend_greedy_equals_single_process(tmp_path):
    path = _build("qwen2", tmp_path / "m")
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in LLM(path, **ENGINE).generate(PROMPTS, params, use_tqdm=False)]
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        llm = LLM(path, tensor_parallel_size=2, distributed_executor_backend="ray", **ENGINE)
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        llm.llm_engine.shutdown()
    finally:
        ray.shutdown()
    assert got == ref
