"""A bounded load test on 127.0.0.1: 64 concurrent streaming clients, a quarter of them hanging up after a few
chunks. No error responses; every client that stays gets its whole completion; the KV cache is empty after."""

from __future__ import annotations

import asyncio

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from tests.conftest import EN_PROMPTS, JA_PROMPTS  # noqa: E402
from tests.entrypoints.conftest import wait_idle  # noqa: E402

NUM_CLIENTS = 64
MAX_TOKENS = 24


def test_64_streaming_clients_a_quarter_disconnecting(qwen_server):
    prompts = EN_PROMPTS + JA_PROMPTS
    before = qwen_server.engine.get_stats()

    async def one(client, i: int) -> tuple[str, int, int]:
        leaves = i % 4 == 3
        kind = "chat" if i % 2 else "completion"
        kw = dict(model=qwen_server.name, max_tokens=200 if leaves else MAX_TOKENS, temperature=0.0,
                  stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        if kind == "chat":
            stream = await client.chat.completions.create(
                messages=[{"role": "user", "content": prompts[i % len(prompts)]}], **kw)
        else:
            stream = await client.completions.create(prompt=prompts[i % len(prompts)], **kw)
        chunks, usage = 0, None
        async for ch in stream:
            chunks += 1
            usage = ch.usage or usage
            if leaves and chunks == 3:
                await stream.close()               # hang up mid-stream
                return "left", chunks, 0
        return "done", chunks, usage.completion_tokens

    async def main():
        client = qwen_server.async_client(timeout=60)
        try:
            return await asyncio.wait_for(asyncio.gather(*[one(client, i) for i in range(NUM_CLIENTS)]), 80)
        finally:
            await client.close()

    results = asyncio.run(main())
    done = [r for r in results if r[0] == "done"]
    assert len(done) == NUM_CLIENTS * 3 // 4 and all(r[2] == MAX_TOKENS for r in done)
    assert sum(r[0] == "left" for r in results) == NUM_CLIENTS // 4
    stats = wait_idle(qwen_server.engine)              # aborted requests gave their blocks back
    generated = stats["num_generation_tokens"] - before["num_generation_tokens"]
    assert generated < NUM_CLIENTS * 3 // 4 * MAX_TOKENS + NUM_CLIENTS // 4 * 200   # the leavers were cut short
    metrics = httpx.get(qwen_server.url + "/metrics", headers=qwen_server.headers()).text
    assert 'hayabusa:kv_cache_usage_perc{model_name="tiny-qwen"} 0.0' in metrics
    assert 'hayabusa:num_requests_running{model_name="tiny-qwen"} 0.0' in metrics
