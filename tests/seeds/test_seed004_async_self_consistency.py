"""Report 004 (Kaggle AIMO: vLLM 0.4's AsyncLLMEngine samples 100 answers per math prompt for self-consistency,
Llama-2-7B on two T4s): the user's async script as written, with only ``from vllm`` -> ``from hayabusa``, on a tiny
random Llama with a real SentencePiece tokenizer, every AsyncEngineArgs argument kept (dtype="half",
enforce_eager, gpu_memory_utilization=0.99, swap_space=3, max_model_len=1024, kv_cache_dtype="fp8_e5m2",
tensor_parallel_size=2: two worker processes over gloo on CPU, disable_log_requests) and 100 samples per prompt;
then the report's stop-string SamplingParams (include_stop_str_in_output=True) and its opt-125m quickstart.
Checks: 100 results per prompt, none lost, each between min_tokens and max_tokens tokens; stop strings kept when
asked and dropped otherwise (the same seeded sample); the quickstart runs on a tiny OPT (greedy: HF's ids).
Substitutions are marked ``# seed:``."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
import torch

from tests.conftest import TOKENIZERS, require_asset

MAX_TOKENS, MIN_TOKENS = 12, 8      # seed: max_tokens=300, min_tokens=200 in the report (2 CPU cores here)


def _tiny_llama2(out) -> str:
    """seed: /kaggle/input/llama-2/pytorch/7b-chat-hf/1 -> a 2-layer random Llama (4096 positions as Llama-2)
    with a real Llama-style SentencePiece tokenizer (llm-jp v3.1)."""
    import transformers as tf

    tok = tf.AutoTokenizer.from_pretrained(str(require_asset(TOKENIZERS / "llm-jp-v3.1")))
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=4096, initializer_range=0.2, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, tie_word_embeddings=False))
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    return str(out)


def run_user_script(MODEL_PATH, out_dir, finals: list):
    """The report's script; its module-level code and ``if __name__ == "__main__":`` block. Returns ``results``
    (per prompt, the 100 texts) and the engine (still running, for the snippets after)."""
    from hayabusa import AsyncLLMEngine, SamplingParams          # the one change: ``from vllm import ...``
    from hayabusa.engine.arg_utils import AsyncEngineArgs        # the one change: ``from vllm.engine.arg_utils``

    st = time.time()

    example_inputs = [
        {
            "prompt": "About 200 words, please give me some tourist information about Tokyo.",
            "temperature": 0.9,
        },
        {
            "prompt": "About 200 words, please give me some tourist information about Osaka.",
            "temperature": 0.9,
        },
    ]

    async def gen(engine, example_input, id):
        results_generator = engine.generate(
            example_input["prompt"],
            SamplingParams(temperature=example_input["temperature"], max_tokens=MAX_TOKENS,
                           min_tokens=MIN_TOKENS,),   # seed: 300 / 200 in the report
            id,
        )

        final_output = None

        async for request_output in results_generator:
            final_output = request_output

        prompt = final_output.prompt
        text_output = [output.text for output in final_output.outputs]
        finals.append(final_output)   # seed: kept for the test's checks
        return text_output[0]

    async def main():
        engine = AsyncLLMEngine.from_engine_args(
            AsyncEngineArgs(
                model=MODEL_PATH,
                dtype="half",
                enforce_eager=True,
                gpu_memory_utilization=0.99,
                swap_space=3,
                max_model_len=1024,
                kv_cache_dtype="fp8_e5m2",
                tensor_parallel_size=2,
                disable_log_requests=True
            )
        )

        results = []

        for example_input in example_inputs:
            tasks = []
            for i in range(100):
                tasks.append(asyncio.create_task(gen(engine, example_input, uuid.uuid4())))

            res = [await task for task in tasks]

            results.append(res)

        with open(out_dir / "async_res.txt", "w") as f:   # seed: "async_res.txt" in the working folder
            for r in results:
                f.writelines(r)
        return results, engine   # seed: returned for the test (the report lets the process exit)

    results, engine = asyncio.run(main())

    print("Async vLLM inference time: ", time.time() - st)
    return results, engine


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> str:
    return _tiny_llama2(tmp_path_factory.mktemp("seed004_llama"))


# the report's stop strings, and one that a random tiny model hits ("e": most English-ish tokens hold one)
STOP = ["```output", "```python", "```\nOutput", ")\n```", "``````output"]


async def _final(engine, prompt, params):
    final = None
    async for out in engine.generate(prompt, params, uuid.uuid4()):
        final = out
    return final


def test_seed004_async_script_tp2_100_samples_and_stop_strings(llama_dir, tmp_path):
    from hayabusa import SamplingParams

    if torch.cuda.is_available() and torch.cuda.device_count() < 2:
        pytest.skip("tensor_parallel_size=2 on CUDA needs 2 GPUs (CPU runs it with gloo; on the device: "
                    "nvidia-h200-x2)")
    finals = []
    results, engine = run_user_script(llama_dir, tmp_path, finals)
    try:
        assert engine.engine.config.parallel_config.tensor_parallel_size == 2
        assert [len(r) for r in results] == [100, 100] and len(finals) == 200          # no request lost
        for o in finals:
            c = o.outputs[0]
            assert o.finished and MIN_TOKENS <= len(c.token_ids) <= MAX_TOKENS
            assert c.finish_reason == "stop" or len(c.token_ids) == MAX_TOKENS
        assert sorted(o.prompt for o in finals).count(finals[0].prompt) == 100
        assert len({o.outputs[0].text for o in finals}) > 150                          # unseeded samples differ
        with open(tmp_path / "async_res.txt", newline="") as f:   # the file holds every text (some hold "\r")
            assert f.read() == "".join(t for r in results for t in r)

        # the report's stop-string SamplingParams (max_tokens 2048 -> MAX_TOKENS; "e" added so that stops happen)
        def params(include, seed=None):
            return SamplingParams(
                temperature=0.9,
                top_p=1,
                max_tokens=MAX_TOKENS,   # seed: 2048 in the report
                stop=STOP + ["e"],       # seed: + "e", a stop string the random tiny model hits
                include_stop_str_in_output=include,
                seed=seed,               # seed: to compare the same sample with the stop string dropped
            )

        async def both():
            prompt = "Solve: what is 2 + 3? Write Python code."
            kept = await asyncio.gather(*[_final(engine, prompt, params(True, s)) for s in range(12)])
            dropped = await asyncio.gather(*[_final(engine, prompt, params(False, s)) for s in range(12)])
            return kept, dropped

        kept, dropped = asyncio.run(both())
        stops = 0
        for k, d in zip(kept, dropped):
            ck, cd = k.outputs[0], d.outputs[0]
            assert ck.token_ids == cd.token_ids and ck.finish_reason == cd.finish_reason
            if ck.finish_reason == "stop":
                stops += 1
                assert ck.stop_reason == "e" and ck.text == cd.text + "e" and "e" not in cd.text
            else:
                assert ck.text == cd.text and "e" not in ck.text
        assert stops >= 6, [k.outputs[0].text for k in kept]
    finally:
        engine.shutdown()


def test_seed004_opt125m_quickstart(tmp_path):
    """The report's quickstart (vLLM's README) as written: facebook/opt-125m -> a tiny random OPT of opt-125m's
    layout (pre-LayerNorm, ReLU, tied head) with OPT's GPT-2 BPE tokenizer. Both prompts get 1..16 tokens (vLLM's
    default max_tokens), text that is the decode of those ids; the same code greedy gives HF's greedy ids."""
    import transformers as tf

    from hayabusa import LLM, SamplingParams   # the one change: ``from vllm import LLM, SamplingParams``
    from tests.helpers import hf_greedy

    tok = tf.AutoTokenizer.from_pretrained(str(require_asset(TOKENIZERS / "gpt2")))   # OPT's BPE is GPT-2's
    opt = tmp_path / "opt-125m"
    torch.manual_seed(0)
    tf.OPTForCausalLM(tf.OPTConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, ffn_dim=64,
                                   num_attention_heads=4, max_position_embeddings=128, init_std=0.2,
                                   bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                   word_embed_proj_dim=32)).save_pretrained(str(opt))
    tok.save_pretrained(str(opt))
    prompts = ["Hello, my name is", "The future of AI is"]   # seed: the report leaves ``prompts`` out

    sampling_params = SamplingParams(temperature=0.8, top_p=0.95)
    llm = LLM(model=str(opt))   # seed: "facebook/opt-125m" -> the tiny local OPT checkpoint
    outputs = llm.generate(prompts, sampling_params)

    assert type(llm.llm_engine.runner.model).__name__ == "OPTForCausalLM"
    assert [o.prompt for o in outputs] == prompts
    for o in outputs:
        c = o.outputs[0]
        assert o.prompt_token_ids == tok(o.prompt).input_ids and o.finished
        assert 0 < len(c.token_ids) <= 16                                          # vLLM's default max_tokens
        assert len(c.token_ids) == 16 or c.token_ids[-1] == tok.eos_token_id
        assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)
    # the same model greedy: HF's ids (seed: added, the quickstart samples)
    greedy = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    ids = [tok(p).input_ids for p in prompts]
    assert [o.outputs[0].token_ids for o in greedy] == hf_greedy(str(opt), ids, 16)
