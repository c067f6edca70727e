"""Load on 127.0.0.1: 64 concurrent streaming clients, a quarter of them hanging up after a few chunks (one round,
and a 60 s soak of back-to-back requests with random hang-ups). No error responses; every client that stays gets
its whole completion; nothing runs and the KV cache is back to its baseline after."""

from __future__ import annotations

import asyncio
import json
import os
import random
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from tests.conftest import EN_PROMPTS, JA_PROMPTS  # noqa: E402
from tests.entrypoints.conftest import wait_idle  # noqa: E402

NUM_CLIENTS = 64
MAX_TOKENS = 24
SOAK_SECONDS = float(os.environ.get("HAYABUSA_SOAK_SECONDS", 60))


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


@pytest.mark.soak
def test_soak_64_streaming_clients_with_random_disconnects(qwen_server):
    """SOAK_SECONDS of 64 clients, each sending streamed requests back to back; 25 % of the requests (at random)
    hang up after a random number of chunks. Every other request must end with all its tokens, no error event and
    [DONE]."""
    prompts = EN_PROMPTS + JA_PROMPTS
    before = wait_idle(qwen_server.engine)
    end = time.monotonic() + SOAK_SECONDS
    headers = {**qwen_server.headers(), "Content-Type": "application/json"}

    async def one_request(client, rng: random.Random) -> str:
        leaves = rng.random() < 0.25
        chat = rng.random() < 0.5
        body = {"model": qwen_server.name, "max_tokens": 200 if leaves else MAX_TOKENS, "temperature": 0.0,
                "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
        prompt = prompts[rng.randrange(len(prompts))]
        if chat:
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        hang_up_after = rng.randint(1, 8)
        events = []
        async with client.stream("POST", "/v1/chat/completions" if chat else "/v1/completions",
                                 content=json.dumps(body), headers=headers) as r:
            if r.status_code != 200:
                return f"status {r.status_code}: {(await r.aread())[:200]!r}"
            async for line in r.aiter_lines():
                if not line:
                    continue
                events.append(line)
                if leaves and len(events) == hang_up_after:
                    return "left"                       # leaving the block closes the connection mid-stream
        if events[-1:] != ["data: [DONE]"]:
            return f"no [DONE]: {events[-2:]}"
        chunks = [json.loads(e[6:]) for e in events[:-1]]
        if any("error" in c for c in chunks):
            return f"error event: {[c for c in chunks if 'error' in c][0]}"
        usage = [c["usage"] for c in chunks if c.get("usage")]
        if not usage or usage[-1]["completion_tokens"] != MAX_TOKENS:
            return f"usage {usage[-1:]}"
        return "done"

    async def client_loop(client, i: int) -> list[str]:
        rng = random.Random(i)
        results = []
        while time.monotonic() < end:
            try:
                results.append(await one_request(client, rng))
            except Exception as e:  # noqa: BLE001 -- counted as an error
                results.append(f"{type(e).__name__}: {e}")
        return results

    async def main():
        limits = httpx.Limits(max_connections=NUM_CLIENTS, max_keepalive_connections=NUM_CLIENTS)
        async with httpx.AsyncClient(base_url=qwen_server.url, timeout=60, limits=limits) as client:
            return await asyncio.wait_for(asyncio.gather(*[client_loop(client, i) for i in range(NUM_CLIENTS)]),
                                          SOAK_SECONDS + 90)

    results = [r for rs in asyncio.run(main()) for r in rs]
    errors = [r for r in results if r not in ("done", "left")]
    assert not errors, (len(errors), errors[:5])
    assert results.count("done") >= NUM_CLIENTS and results.count("left") >= NUM_CLIENTS // 8
    stats = wait_idle(qwen_server.engine)
    assert stats["num_requests_running"] == 0 and stats["num_requests_waiting"] == 0
    assert stats["kv_cache_usage"] == before["kv_cache_usage"] and stats["num_free_kv_blocks"] == before[
        "num_free_kv_blocks"]
