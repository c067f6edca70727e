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


@pytest.mark.timeout(300)
def test_ray_data_offline_batch_example(tmp_path):
    """examples/ray_data_batch.py: one LLM per Ray Data actor over a JSONL job gives the rows a single LLM gives."""
    pytest.importorskip("ray.data", reason="ray[data] is not installed (pyarrow, pandas): Ray Data test skipped")
    import importlib.util
    import json

    from tests.conftest import REPO

    path = _build("qwen2", tmp_path / "m")
    src = tmp_path / "requests.jsonl"
    src.write_text("".join(json.dumps({"prompt": p, "max_tokens": 6, "temperature": 0.0}) + "\n" for p in PROMPTS))
    spec = importlib.util.spec_from_file_location("ray_data_batch", REPO / "examples" / "ray_data_batch.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)   # logical CPUs: 2 actors + the reads
    try:
        rows = example.run(path, str(src), actors=2, gpus_per_actor=0, batch_size=4, dtype="float32",
                           device="cpu", max_model_len=64).take_all()
    finally:
        ray.shutdown()
    ref = LLM(path, dtype="float32", device="cpu", max_model_len=64).generate(
        PROMPTS, SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)
    got = {r["prompt"]: list(r["token_ids"]) for r in rows}
    assert len(rows) == len(PROMPTS)
    assert [got[p] for p in PROMPTS] == [list(o.outputs[0].token_ids) for o in ref]
