"""Many streams at once: the engine thread hands a step's outputs to each event loop through one inbox (woken only
when idle), and the server builds SSE chunks from pre-serialized pieces. Every concurrent stream must still be
complete and equal to the same request answered alone, from one event loop or from several at once."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from hayabusa import AsyncEngineArgs, AsyncLLMEngine, SamplingParams  # noqa: E402
from tests.conftest import EN_PROMPTS, JA_PROMPTS  # noqa: E402
from tests.entrypoints.conftest import wait_idle  # noqa: E402

NUM_STREAMS = 48
MAX_TOKENS = 20


def test_concurrent_streams_equal_their_non_streamed_answers(qwen_server):
    prompts = (EN_PROMPTS + JA_PROMPTS)[:6]
    client = qwen_server.client()
    alone = {}
    for p in prompts:
        kw = dict(model=qwen_server.name, max_tokens=MAX_TOKENS, temperature=0.0, extra_body={"ignore_eos": True})
        alone[("completion", p)] = client.completions.create(prompt=p, **kw).choices[0].text
        alone[("chat", p)] = client.chat.completions.create(
            messages=[{"role": "user", "content": p}], **kw).choices[0].message.content

    async def one(aclient, i: int) -> tuple[tuple[str, str], str, int, int, str | None]:
        kind, p = ("chat" if i % 2 else "completion"), prompts[i % len(prompts)]
        kw = dict(model=qwen_server.name, max_tokens=MAX_TOKENS, temperature=0.0, stream=True,
                  stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        if kind == "chat":
            stream = await aclient.chat.completions.create(messages=[{"role": "user", "content": p}], **kw)
        else:
            stream = await aclient.completions.create(prompt=p, **kw)
        text, chunks, usage, finish = "", 0, 0, None
        async for ch in stream:
            if ch.usage is not None:
                usage = ch.usage.completion_tokens
            for c in ch.choices:
                text += c.text if kind == "completion" else (c.delta.content or "")
                finish = c.finish_reason or finish
                chunks += 1
        return (kind, p), text, chunks, usage, finish

    async def main():
        aclient = qwen_server.async_client(timeout=60)
        try:
            return await asyncio.wait_for(asyncio.gather(*[one(aclient, i) for i in range(NUM_STREAMS)]), 90)
        finally:
            await aclient.close()

    for key, text, chunks, usage, finish in asyncio.run(main()):
        assert text == alone[key], key
        assert usage == MAX_TOKENS and finish == "length"
        assert 2 <= chunks <= MAX_TOKENS + 2        # role chunk (chat), one per token or fewer (coalesced), finish
    wait_idle(qwen_server.engine)


def test_sse_chunks_are_json_dumps_of_the_chunk_dict(qwen_server):
    """The pre-serialized chunks are byte for byte what json.dumps(chunk, ensure_ascii=False) gives."""
    common = {"model": qwen_server.name, "max_tokens": 6, "temperature": 0.0, "n": 2, "stream": True,
              "stop": ["\u3002"], "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    requests = [("/v1/completions", {**common, "prompt": JA_PROMPTS[0], "logprobs": 2}),
                ("/v1/chat/completions", {**common, "messages": [{"role": "user", "content": JA_PROMPTS[0]}],
                                          "logprobs": True, "top_logprobs": 2})]
    for path, body in requests:
        r = httpx.post(qwen_server.url + path, json=body, headers=qwen_server.headers(), timeout=60)
        events = [e for e in r.content.split(b"\n\n") if e]
        assert events[-1] == b"data: [DONE]" and len(events) > 3
        for e in events[:-1]:
            assert e.startswith(b"data: ")
            data = e[len(b"data: "):]
            assert data == json.dumps(json.loads(data), ensure_ascii=False).encode()


def test_streams_from_two_event_loops_share_one_engine(stories_dir):
    engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=stories_dir, disable_log_requests=True,
                                                             max_model_len=256, max_num_seqs=32))
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = ["Once upon a time", "Lily had a red ball", "The sun was", "Tom and his dog"]
    try:
        async def run(tag: str) -> list[tuple[str, list[int], int]]:
            async def one(i: int):
                outs = [o async for o in engine.generate(prompts[i % 4], params, f"{tag}-{i}")]
                assert outs[-1].finished and not any(o.finished for o in outs[:-1])
                return outs[-1].outputs[0].text, outs[-1].outputs[0].token_ids, len(outs)
            return await asyncio.gather(*[one(i) for i in range(12)])

        solo = asyncio.run(run("solo"))
        results: dict[str, list] = {}
        threads = [threading.Thread(target=lambda t=t: results.__setitem__(t, asyncio.run(run(t)))) for t in "ab"]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert sorted(results) == ["a", "b"]
        for tag in "ab":
            for (text, ids, _), (solo_text, solo_ids, _) in zip(results[tag], solo):
                assert ids == solo_ids and len(ids) == 24 and text == solo_text
        assert engine._inboxes == {} and engine._req_inbox == {}      # nothing left behind for closed loops
    finally:
        engine.shutdown()
