"""Report 004's AsyncLLMEngine script (Llama-2-7B on two T4s: tensor_parallel_size=2, swap_space=3, an fp8_e5m2
KV cache, eager, no request logs; 100 samples per prompt at temperature 0.9 with stop strings) on a tiny Llama on
CPU, scaled to 12 samples per prompt of 24 tokens (2 CPU cores); then a worker killed mid-stream fails the
open requests within seconds, the engine thread stops and no worker process is left."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid

import pytest

from hayabusa import AsyncLLMEngine, SamplingParams
from hayabusa.engine.arg_utils import AsyncEngineArgs
from tests.distributed.test_tensor_parallel import _build

PROMPTS = ["About 200 words, please give me some tourist information about Tokyo.",
           "About 200 words, please give me some tourist information about Osaka."]
STOP = ["```output", "```python", "```\nOutput", ")\n```", "``````output", "e"]   # "e": a stop that does hit
SAMPLES = 12


async def _gen(engine, prompt: str, params: SamplingParams):
    final = None
    async for out in engine.generate(prompt, params, uuid.uuid4()):
        final = out
    return final


async def _script(engine) -> list:
    params = SamplingParams(temperature=0.9, top_p=1, max_tokens=24, stop=STOP, include_stop_str_in_output=True)
    results = []
    for prompt in PROMPTS:
        tasks = [asyncio.create_task(_gen(engine, prompt, params)) for _ in range(SAMPLES)]
        results.append([await t for t in tasks])
    return results


async def _kill_mid_stream(engine, pid: int) -> float:
    params = SamplingParams(temperature=0.9, max_tokens=200, ignore_eos=True)
    stream = engine.generate(PROMPTS[0], params, "victim")
    killed_at = None
    with pytest.raises(Exception, match="worker 1 .*died|worker 0 failed"):
        async for out in stream:
            if killed_at is None and len(out.outputs[0].token_ids) >= 3:
                os.kill(pid, signal.SIGKILL)
                killed_at = time.monotonic()
    return time.monotonic() - killed_at


def test_seed004_script_tp2_then_killed_worker(tmp_path):
    path = _build("llama", tmp_path / "m")
    engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(
        model=path, dtype="float32", device="cpu", enforce_eager=True, swap_space=3, max_model_len=256,
        kv_cache_dtype="fp8_e5m2", tensor_parallel_size=2, disable_log_requests=True))
    procs = engine.engine.runner.procs
    try:
        results = asyncio.run(_script(engine))
        assert [len(r) for r in results] == [SAMPLES, SAMPLES]
        texts = [o.outputs[0].text for r in results for o in r]
        stopped = [o.outputs[0] for r in results for o in r if o.outputs[0].finish_reason == "stop"]
        assert stopped and all(c.text.endswith("e") for c in stopped)        # stop string kept in the output
        assert all(o.outputs[0].finish_reason == "length" and len(o.outputs[0].token_ids) == 24
                   for r in results for o in r if o.outputs[0].finish_reason != "stop")
        assert len(set(texts)) > SAMPLES                                      # unseeded samples differ
        elapsed = asyncio.run(_kill_mid_stream(engine, procs[1].pid))
        assert elapsed < 10.0
        deadline = time.monotonic() + 5.0
        while engine.is_running and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not engine.is_running and engine.errored
        assert not any(p.is_alive() for p in procs)
    finally:
        engine.shutdown()
    assert not any(p.is_alive() for p in procs)
