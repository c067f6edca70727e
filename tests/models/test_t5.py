"""T5 (encoder-decoder) in the engine: greedy token ids equal HF ``generate`` (float32, CPU) on tiny random-weight
checkpoints of original T5 (ReLU, tied and scaled head) and T5 v1.1 (gated-GELU, untied head), with a real
SentencePiece tokenizer (Japanese and English); batch sizes, very different encoder lengths in one batch,
preemption, n = 2 seeded sampling, explicit encoder/decoder prompts, logprobs, abort, and the encoder limit."""

from __future__ import annotations

import math

import pytest
import torch

from hayabusa import LLM, SamplingParams
from hayabusa.errors import HayabusaValidationError, KVCacheCapacityError
from tests.helpers import step_until_done
from tests.models._t5 import T5_EN_PROMPTS, T5_JA_PROMPTS, hf_t5, hf_t5_greedy, save_tiny_t5

MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
# a long encoder input next to 1-3 token ones: very different lengths in one batch
LONG = "Receipt: " + " ".join(f"item{i} ¥{100 + i * 7}" for i in range(20)) + " 合計 ¥9,999"
PROMPTS = T5_EN_PROMPTS + T5_JA_PROMPTS + [LONG, "a"]

CONFIGS = {
    "max_num_seqs=1": dict(max_num_seqs=1),
    "max_num_seqs=3": dict(max_num_seqs=3),
    "max_num_seqs=16": dict(max_num_seqs=16),
    # 72 cross-attention blocks + 4 decoder blocks per request do not fit 96 blocks: preemption
    "preemption": dict(max_num_seqs=16, block_size=4, num_gpu_blocks_override=96, max_model_len=192),
    # a small encoder budget: the long input's step runs it alone
    "small_step": dict(max_num_seqs=16, max_num_batched_tokens=200),
    # step N+1 scheduled before step N's tokens are back: decoder inputs read from the device (placeholders)
    "async_scheduling": dict(max_num_seqs=16, async_scheduling=True),
}


# the model's limit (config.json n_positions): the encoder limit, and the default max_model_len; small so that the
# KV sizing's one full sequence (decoder + cross blocks of an encoder input this long) leaves room for preemption
N_POSITIONS = 192


@pytest.fixture(scope="session")
def tiny_t5(tmp_path_factory) -> str:
    return save_tiny_t5(tmp_path_factory.mktemp("tiny_t5"), "v1.0", n_positions=N_POSITIONS)


@pytest.fixture(scope="session")
def tiny_t5_v11(tmp_path_factory) -> str:
    return save_tiny_t5(tmp_path_factory.mktemp("tiny_t5_v11"), "v1.1", n_positions=N_POSITIONS)


@pytest.fixture(scope="module")
def refs():
    return {}


def _hf_ref(refs, model_dir, tok):
    if model_dir not in refs:
        enc = [tok(p).input_ids for p in PROMPTS]
        refs[model_dir] = enc, hf_t5_greedy(model_dir, enc, MAX_TOKENS)
    return refs[model_dir]


@pytest.mark.parametrize("arch", ["tiny_t5", "tiny_t5_v11"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_greedy_matches_hf_generate(arch, config, request, refs):
    model_dir = request.getfixturevalue(arch)
    llm = LLM(model_dir, **CONFIGS[config])
    enc, ref = _hf_ref(refs, model_dir, llm.get_tokenizer())
    assert max(map(len, enc)) > 100 and min(map(len, enc)) <= 3
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    if config == "preemption":
        assert llm.llm_engine.scheduler.num_preemptions > 0
    start = llm.llm_engine.config.model_config.decoder_start_token_id
    for out, r, ids, p in zip(outs, ref, enc, PROMPTS):
        assert out.prompt_token_ids == [start]
        assert out.encoder_prompt_token_ids == ids and out.encoder_prompt == p
        assert out.outputs[0].token_ids == r
    # every block (decoder and cross-attention) is back in the pool
    kv = llm.llm_engine.kv_cache_manager
    assert kv.num_free_blocks == llm.llm_engine.num_blocks and not kv.req_to_cross_blocks


def test_token_id_prompts_and_eos(tiny_t5, refs):
    """Token-id prompts are encoder inputs too; without ignore_eos a request stops at EOS as HF does."""
    llm = LLM(tiny_t5, max_num_seqs=4)
    enc, ref = _hf_ref(refs, tiny_t5, llm.get_tokenizer())
    outs = llm.generate([{"prompt_token_ids": ids} for ids in enc[:4]], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref[:4]
    # make EOS the 3rd greedy token of the first prompt: the request stops right after it
    eos = ref[0][2]
    out = llm.generate({"prompt_token_ids": enc[0]}, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                                    stop_token_ids=[eos]), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == ref[0][:3] and out.outputs[0].finish_reason == "stop"


def test_explicit_encoder_decoder_prompt_matches_hf(tiny_t5_v11):
    llm = LLM(tiny_t5_v11, max_num_seqs=4)
    tok = llm.get_tokenizer()
    start = llm.llm_engine.config.model_config.decoder_start_token_id
    dec = tok("合計", add_special_tokens=False).input_ids
    out = llm.generate({"encoder_prompt": T5_JA_PROMPTS[1], "decoder_prompt": "合計"}, GREEDY, use_tqdm=False)[0]
    assert out.prompt_token_ids == [start] + dec
    # vLLM's RequestOutput: for encoder-decoder models prompt / prompt_token_ids are the decoder's, encoder_prompt /
    # encoder_prompt_token_ids the encoder's (vLLM's encoder_decoder example prints prompt as the decoder prompt)
    assert out.prompt == "合計" and out.encoder_prompt == T5_JA_PROMPTS[1]
    assert out.encoder_prompt_token_ids == tok(T5_JA_PROMPTS[1]).input_ids
    by_ids = llm.generate({"encoder_prompt": T5_JA_PROMPTS[1], "decoder_prompt": [start] + dec}, GREEDY,
                          use_tqdm=False)[0]
    assert by_ids.prompt is None and by_ids.encoder_prompt == T5_JA_PROMPTS[1]   # ids given: no decoder text
    assert by_ids.outputs[0].token_ids == out.outputs[0].token_ids
    plain = llm.generate(T5_JA_PROMPTS[1], GREEDY, use_tqdm=False)[0]   # a plain prompt is the encoder's input
    assert plain.prompt == plain.encoder_prompt == T5_JA_PROMPTS[1] and plain.prompt_token_ids == [start]
    model = hf_t5(tiny_t5_v11)
    with torch.no_grad():
        g = model.generate(torch.tensor([tok(T5_JA_PROMPTS[1]).input_ids]),
                           decoder_input_ids=torch.tensor([[start] + dec]), max_new_tokens=MAX_TOKENS,
                           do_sample=False, eos_token_id=None, pad_token_id=start, use_cache=False)
    assert out.outputs[0].token_ids == g[0, 1 + len(dec):].tolist()


def test_n2_seeded_sampling_is_batch_invariant(tiny_t5):
    params = SamplingParams(n=2, temperature=1.0, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True)

    def run(**kw):
        outs = LLM(tiny_t5, **kw).generate(PROMPTS, params, use_tqdm=False)
        return [[c.token_ids for c in o.outputs] for o in outs]

    one = run(max_num_seqs=1)
    assert run(max_num_seqs=16) == one
    assert run(**CONFIGS["preemption"]) == one
    assert all(len(s) == 2 for s in one)
    # two different samples for most prompts (a near-one-hot distribution, as after "a", may give one sample twice)
    assert sum(s[0] != s[1] for s in one) >= len(one) - 2


@pytest.mark.parametrize("arch", ["tiny_t5", "tiny_t5_v11"])
def test_logprobs_match_hf(arch, request):
    """Logprob values (not only the argmax) equal HF's: they see the head's d_model ** -0.5 scaling of T5 v1.0
    and its absence in v1.1."""
    tiny_t5_v11 = request.getfixturevalue(arch)
    llm = LLM(tiny_t5_v11)
    tok = llm.get_tokenizer()
    out = llm.generate(T5_EN_PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=3, logprobs=5),
                       use_tqdm=False)[0]
    c = out.outputs[0]
    model = hf_t5(tiny_t5_v11)
    start = llm.llm_engine.config.model_config.decoder_start_token_id
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tok(T5_EN_PROMPTS[1]).input_ids]),
                       decoder_input_ids=torch.tensor([[start] + c.token_ids[:-1]])).logits[0]
    ref = torch.log_softmax(logits.float(), -1)
    for i, (tid, lp) in enumerate(zip(c.token_ids, c.logprobs)):
        # 2e-3: the random v1.0 (ReLU, initializer_factor 4) grows large activations, and summation order differs;
        # a missing or extra d_model ** -0.5 on the head would move these by far more than that
        assert lp[tid].logprob == pytest.approx(float(ref[i, tid]), abs=2e-3)
        top = ref[i].topk(5).indices.tolist()
        assert set(lp) >= set(top)


def test_too_long_encoder_input_is_refused_and_the_next_request_served(tiny_t5, refs):
    """The encoder limit is the model's (config.json n_positions); max_model_len limits the decoder alone."""
    llm = LLM(tiny_t5, max_model_len=64)
    tok = llm.get_tokenizer()
    assert llm.llm_engine.config.model_config.max_encoder_len == N_POSITIONS
    too_long = tok(LONG * 2).input_ids
    assert len(too_long) > N_POSITIONS
    with pytest.raises(HayabusaValidationError) as e:
        llm.generate(LONG * 2, GREEDY, use_tqdm=False)
    assert e.value.parameter == "prompt" and e.value.value == len(too_long)
    assert f"encoder limit of {N_POSITIONS} tokens" in str(e.value) and "max_model_len=64" in str(e.value)
    with pytest.raises(HayabusaValidationError) as e:
        llm.generate({"encoder_prompt": {"prompt_token_ids": [5] * (N_POSITIONS + 1)}}, GREEDY, use_tqdm=False)
    assert e.value.parameter == "encoder_prompt" and e.value.value == N_POSITIONS + 1
    # an encoder input longer than max_model_len (LONG: 165 tokens) but within the model's limit is served, with
    # HF's ids; so is one of exactly the limit
    enc, ref = _hf_ref(refs, tiny_t5, tok)
    assert 64 < len(enc[5]) <= N_POSITIONS
    assert llm.generate(LONG, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == ref[5]
    out = llm.generate({"prompt_token_ids": [5] * N_POSITIONS}, GREEDY, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == MAX_TOKENS
    with pytest.raises(HayabusaValidationError) as e:
        llm.generate({"encoder_prompt": "x", "decoder_prompt": [5] * 64}, GREEDY, use_tqdm=False)
    assert e.value.parameter == "decoder_prompt"                 # the decoder prompt leaves no room: named
    assert str(e.value).startswith("decoder_prompt: prompt has 65 tokens") and "max_model_len=64" in str(e.value)
    with pytest.raises(HayabusaValidationError) as e:                # an out-of-vocabulary decoder id: named too
        llm.generate({"encoder_prompt": "x", "decoder_prompt": [5, 10**6]}, GREEDY, use_tqdm=False)
    assert e.value.parameter == "decoder_prompt" and e.value.value == 10**6
    for bad in ({"prompt": "Hi", "multi_modal_data": {"image": 1}},                      # T5 takes text only
                {"encoder_prompt": {"prompt": "Hi", "multi_modal_data": {"image": 1}}}):
        with pytest.raises(HayabusaValidationError) as e:
            llm.generate(bad, GREEDY, use_tqdm=False)
        assert e.value.parameter == "multi_modal_data" and "takes text only" in str(e.value)
    out = llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == ref[0]


def test_stop_string_and_abort(tiny_t5, refs):
    llm = LLM(tiny_t5, max_num_seqs=4)
    tok = llm.get_tokenizer()
    _, ref = _hf_ref(refs, tiny_t5, tok)
    engine = llm.llm_engine
    engine.add_request("a", PROMPTS[0], GREEDY)
    engine.add_request("b", PROMPTS[6], GREEDY)
    engine.step()
    engine.abort_request("a")
    done = step_until_done(engine)
    assert "a" not in done and done["b"].outputs[0].token_ids == ref[6]
    assert engine.kv_cache_manager.num_free_blocks == engine.num_blocks
    # a stop string cut from the greedy text
    text = tok.decode(ref[3], skip_special_tokens=True)
    stop = text[len(text) // 2:len(text) // 2 + 2].strip() or text[-1]
    out = llm.generate(PROMPTS[3], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                                  stop=[stop]), use_tqdm=False)[0]
    assert stop not in out.outputs[0].text and text.startswith(out.outputs[0].text)
    assert out.outputs[0].finish_reason == "stop"


def test_triton_attention_path_matches_hf(tiny_t5_v11, refs):
    """The engine with the CUDA backend's Triton kernels (in Triton's interpreter here): decoder self-attention
    with the position bias, and cross-attention as one-token sequences over the cross blocks."""
    from tests.kernels.conftest import SKIP_REASON   # importing it patches the interpreter for numpy >= 2.4

    if SKIP_REASON is not None:
        pytest.skip(SKIP_REASON)
    from hayabusa.attention.backends import AttentionBackend
    from hayabusa.kernels.paged_attention import paged_attention
    from hayabusa.kernels.store_kv import store_kv

    llm = LLM(tiny_t5_v11, max_num_seqs=4)
    llm.llm_engine.runner.backend = AttentionBackend("triton", store_kv, paged_attention)
    _, ref = _hf_ref(refs, tiny_t5_v11, llm.get_tokenizer())
    prompts = [PROMPTS[0], PROMPTS[5], PROMPTS[6]]   # 11, 165 and 2 encoder tokens
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [ref[0][:4], ref[5][:4], ref[6][:4]]


def test_plan_counts_t5_and_its_cross_attention_kv():
    """`hayabusa plan` on T5 shapes: parameters as transformers counts them (t5-small: 60,506,624), the KV cache
    of the decoder layers (d_kv heads), and each request's cross-attention K/V in the formula."""
    from transformers import T5Config

    from hayabusa.eval.plan import PlanInputs, count_params, make_plan

    small = T5Config()                                             # t5-small's shape
    small.architectures = ["T5ForConditionalGeneration"]
    assert count_params(small)["total"] == 60_506_624
    v11 = T5Config(d_model=512, d_kv=64, d_ff=1024, num_heads=6, num_layers=8, feed_forward_proj="gated-gelu",
                   tie_word_embeddings=False)                      # google/t5-v1_1-small: 76,961,152 in HF's card
    assert count_params(v11)["total"] == 76_961_152
    p = make_plan(small, PlanInputs(dtype="bfloat16", max_model_len=512), gpu_memory_gib=80)
    per_token = 2 * 6 * 8 * 64 * 2
    assert p["kv_bytes_per_token"] == per_token and p["cross_kv_bytes_per_request"] == per_token * 512
    assert p["max_num_seqs_at_max_model_len"] == p["max_num_tokens"] // 1024
    assert "encoder tokens" in p["kv_formula"]
    # max_model_len limits the decoder alone: a request still holds the cross K/V of the model's encoder limit
    short = make_plan(small, PlanInputs(dtype="bfloat16", max_model_len=65), gpu_memory_gib=80)
    assert short["max_encoder_len"] == 512 and short["cross_kv_bytes_per_request"] == per_token * 512
    assert short["max_num_seqs_at_max_model_len"] == short["max_num_tokens"] // (65 + 512)


def test_memory_profile_runs_the_encoder_at_the_encoder_limit(tiny_t5, monkeypatch):
    """The KV sizing's profile pass (a forward without a cache) runs the encoder too, over max(T, max_encoder_len)
    tokens in sequences of the model's encoder limit, so the largest encoder step's activations are in the peak
    whatever max_model_len is."""
    from hayabusa.attention.metadata import ForwardContext

    runner = LLM(tiny_t5, max_model_len=32, max_num_seqs=4, max_num_batched_tokens=100).llm_engine.runner
    model = runner.model
    assert model.max_encoder_len == N_POSITIONS and model.max_position == 32
    seen = []
    encode = model.encode
    monkeypatch.setattr(model, "encode", lambda ids, lens: seen.append((ids.shape[0], list(lens))) or encode(ids, lens))
    for T, lens in ((100, [N_POSITIONS]), (500, [N_POSITIONS, N_POSITIONS, 500 - 2 * N_POSITIONS])):
        seen.clear()
        hidden = model(torch.zeros(T, dtype=torch.int64), torch.zeros(T, dtype=torch.int64),
                       ForwardContext(None, None, runner.backend))
        assert seen == [(sum(lens), lens)] and hidden.shape == (T, model.config.d_model)
    seen.clear()   # one token: still one sequence of the encoder limit
    runner.model.profile_encoder(1)
    assert seen == [(N_POSITIONS, [N_POSITIONS])]


def test_hayabusa_generate_cli(tiny_t5, refs, tmp_path, capsys):
    """`hayabusa generate` with a T5 model: text lines are encoder inputs (HF's greedy ids), vLLM's explicit
    encoder/decoder form works, and a too-long encoder input is named by its line before anything runs."""
    import json

    from hayabusa.entrypoints.cli import main

    enc, ref = _hf_ref(refs, tiny_t5, LLM(tiny_t5).get_tokenizer())
    rows = [{"prompt": PROMPTS[0]}, {"encoder_prompt": PROMPTS[1], "decoder_prompt": [5, 6]},
            {"prompt_token_ids": enc[3]}]
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\n", encoding="utf-8")
    out = tmp_path / "out.jsonl"
    assert main(["generate", "--model", tiny_t5, "--prompts", str(path), "--output", str(out), "--no-tqdm",
                 "--temperature", "0", "--max-tokens", str(MAX_TOKENS), "--ignore-eos"]) == 0
    got = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert got[0]["outputs"][0]["token_ids"] == ref[0] and got[2]["outputs"][0]["token_ids"] == ref[3]
    assert got[1]["prompt_token_ids"][1:] == [5, 6] and len(got[1]["outputs"][0]["token_ids"]) == MAX_TOKENS
    # each line holds the input it was given: the encoder's ids (and text), next to the decoder prompt's
    assert got[2]["encoder_prompt_token_ids"] == enc[3] and got[0]["encoder_prompt_token_ids"] == enc[0]
    assert got[0]["encoder_prompt"] == PROMPTS[0] and got[1]["encoder_prompt"] == PROMPTS[1]
    n_in = sum(len(g["prompt_token_ids"]) + len(g["encoder_prompt_token_ids"]) for g in got)
    assert f" {n_in} prompt tokens" in capsys.readouterr().err
    # max_model_len limits the decoder alone: LONG (165 tokens) runs with --max-model-len 64, HF's ids; an encoder
    # input over the model's limit (n_positions) is named by its line
    path.write_text(json.dumps({"prompt": LONG}) + "\n", encoding="utf-8")
    assert main(["generate", "--model", tiny_t5, "--prompts", str(path), "--output", str(out), "--no-tqdm",
                 "--temperature", "0", "--max-tokens", str(MAX_TOKENS), "--ignore-eos", "--max-model-len", "64"]) == 0
    assert json.loads(out.read_text(encoding="utf-8"))["outputs"][0]["token_ids"] == ref[5]
    path.write_text(json.dumps({"prompt": "a"}) + "\n" + json.dumps({"prompt": LONG * 2}) + "\n", encoding="utf-8")
    assert main(["generate", "--model", tiny_t5, "--prompts", str(path), "--output", str(tmp_path / "o2.jsonl"),
                 "--no-tqdm", "--max-model-len", "64"]) == 2
    err = capsys.readouterr().err
    assert f"{path}:2:" in err and f"encoder limit of {N_POSITIONS} tokens" in err and "Traceback" not in err


def test_hayabusa_eval_on_the_bundled_receipts(tmp_path, capsys):
    """`hayabusa eval --data receipts --reference hf` runs a T5 model end to end: hayabusa and HF's generate
    give the same answers (random weights, so accuracy is 0: agreement is what is checked)."""
    import json

    from hayabusa.entrypoints.cli import main

    model = save_tiny_t5(tmp_path / "t5", "v1.1", num_decoder_layers=2)
    summary = tmp_path / "summary.json"
    assert main(["eval", "--model", model, "--data", "receipts", "--reference", "hf", "--max-tokens", "12",
                 "--no-tqdm", "--json", str(summary)]) == 0
    rows = {r["setting"]: r for r in json.loads(summary.read_text())["rows"]}
    ours = rows["default"]
    # random weights: the texts agree exactly; answer agreement is 1.0, or None (-) where no answer parses on either
    # side (there is then no answer to compare)
    assert ours["num_errors"] == 0 and ours["agreement"] in (None, 1.0) and ours["text_agreement"] == 1.0
    assert not rows["hf (reference)"].get("error")


def test_hayabusa_eval_max_model_len_bounds_the_decoder_only(tmp_path):
    """`hayabusa eval --max-model-len` on a T5 bounds the decoder alone, as the engine does: receipts of 150-280
    encoder tokens still run (in hayabusa and in the HF reference) under a decoder max_model_len of 16, and agree
    (the reference's answers also end where the engine's decoder does: 15 tokens after the start token)."""
    import json

    from hayabusa.entrypoints.cli import main

    model = save_tiny_t5(tmp_path / "t5", "v1.1", num_decoder_layers=2)
    summary = tmp_path / "summary.json"
    out = tmp_path / "results.jsonl"     # 24 > 15: without the reference's cap its answers run on and differ
    assert main(["eval", "--model", model, "--data", "receipts", "--reference", "hf", "--max-tokens", "24",
                 "--max-model-len", "16", "--no-tqdm", "--json", str(summary), "--output", str(out)]) == 0
    rows = {r["setting"]: r for r in json.loads(summary.read_text())["rows"]}
    ours, hf = rows["default"], rows["hf (reference)"]
    assert ours["num_errors"] == 0 and hf["num_errors"] == 0 and not hf.get("error")
    assert ours["agreement"] in (None, 1.0) and ours["text_agreement"] == 1.0     # None: no answer on either side
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(recs) == 2 * 5 and all(r["outputs"] is not None and r.get("error") is None for r in recs)


def test_hayabusa_eval_fidelity_refuses_t5_by_name(tmp_path, capsys):
    """`hayabusa eval --fidelity` measures a decoder-only model's next-token distributions over a text; on a T5 it
    says so (exit 2, naming --fidelity and the architecture), not a KV-cache error about a
    num_gpu_blocks_override the user never gave."""
    from hayabusa.entrypoints.cli import main

    model = save_tiny_t5(tmp_path / "t5", "v1.0", num_decoder_layers=2)
    text = tmp_path / "t.txt"
    text.write_text("吾輩は猫である。名前はまだ無い。 The total was 1,200 yen. " * 4)
    assert main(["eval", "--fidelity", "--model", model, "--text", str(text), "--no-tqdm"]) == 2
    err = capsys.readouterr().err
    assert "--fidelity" in err and "T5ForConditionalGeneration" in err and "encoder-decoder" in err, err
    assert "num_gpu_blocks_override" not in err and "Traceback" not in err


def test_w9_workload_and_t5_bench_shapes():
    """W9's requests as BENCHMARKS.md defines them, and the T5 shapes of `hayabusa bench --make-model`."""
    from hayabusa.bench.models import shape_config, shape_stats
    from hayabusa.bench.workloads import get_workload

    w = get_workload("W9")
    assert len(w.requests) == 2000 and {len(r.prompt_token_ids) for r in w.requests} == {256}
    assert {r.max_tokens for r in w.requests} == {64} and w.hf_batch1_requests == 100
    assert [v["hf_batch_size"] for v in w.variants] == [1, 16, 64, 256]
    assert shape_stats("t5-small-shape")["params"] == 60_506_624        # google-t5/t5-small
    assert shape_stats("t5-base-shape")["params"] == 222_903_552        # google-t5/t5-base
    large = shape_config("flan-t5-large-shape")
    assert large.feed_forward_proj == "gated-gelu" and large.architectures == ["T5ForConditionalGeneration"]


def test_padded_decode_path_matches_hf(tiny_t5, refs):
    """The CUDA-graph decode path (rows padded to a capture size; padding rows get cross seq_len 0), run eagerly
    on CPU: the same greedy ids."""
    from hayabusa.worker.cuda_graph import CUDAGraphRunner

    llm = LLM(tiny_t5, max_num_seqs=16)
    runner = llm.llm_engine.runner
    runner.decode_runner = CUDAGraphRunner.for_runner(runner, use_graphs=False)
    _, ref = _hf_ref(refs, tiny_t5, llm.get_tokenizer())
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)       # 7 requests: decode steps padded to 8
    assert [o.outputs[0].token_ids for o in outs] == ref


def test_kv_capacity_error_says_max_model_len_does_not_lower_the_encoder_part(tiny_t5_v11):
    """The KV sizing reserves the cross K/V of an encoder input of the model's limit (n_positions, 192 here: 48
    blocks of 4) whatever max_model_len. With 40 blocks no max_model_len fits, so the error must not send the user
    to lower it; with 60 blocks a lower max_model_len does fit, and the advice says it bounds the decoder only."""
    kw = dict(block_size=4, max_model_len=64)
    with pytest.raises(KVCacheCapacityError) as e:
        LLM(tiny_t5_v11, num_gpu_blocks_override=40, **kw)
    msg = str(e.value)
    assert "max_encoder_len=192" in msg and "Lower max_model_len" not in msg, msg
    assert "n_positions" in msg and "raise num_gpu_blocks_override" in msg.lower(), msg
    with pytest.raises(KVCacheCapacityError) as e:
        LLM(tiny_t5_v11, num_gpu_blocks_override=60, **kw)   # 16 decoder + 48 cross blocks > 60
    msg = str(e.value)
    assert "Lower max_model_len (it bounds the decoder only" in msg, msg
    assert len(LLM(tiny_t5_v11, num_gpu_blocks_override=60, block_size=4, max_model_len=48).generate(
        PROMPTS[0], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == MAX_TOKENS   # 12 + 48 blocks: it fits


def test_long_decoder_prompt_in_chunks_and_preempted(tiny_t5_v11):
    """A 40-token decoder prompt prefilled in chunks of 16 (its cross blocks taken once, at admission), and the
    same under preemption: the ids of one unchunked run."""
    dec = list(range(100, 140))
    prompts = [{"encoder_prompt": p, "decoder_prompt": dec} for p in PROMPTS[:4]]
    params = SamplingParams(temperature=0.0, max_tokens=23, ignore_eos=True)      # 41 + 23 = max_model_len 64

    def run(**kw):
        return [o.outputs[0].token_ids for o in LLM(tiny_t5_v11, **kw).generate(prompts, params, use_tqdm=False)]

    base = run(max_num_seqs=4)
    assert run(max_num_seqs=4, max_num_batched_tokens=16) == base
    # the smallest pool the KV sizing allows: one sequence's 16 decoder blocks + the 48 cross blocks of an encoder
    # input of the model's limit (192 tokens). Three requests are admitted (3 + 13 + 1 cross blocks, 11 decoder
    # blocks each at 41 tokens); growing to 64 tokens they need 15 more blocks than the 14 left: preemption
    llm_kw = dict(max_num_seqs=4, block_size=4, num_gpu_blocks_override=64, max_model_len=64)
    with pytest.raises(KVCacheCapacityError, match="max_encoder_len=192") as e:
        LLM(tiny_t5_v11, **{**llm_kw, "num_gpu_blocks_override": 63})
    assert "(64 blocks" in str(e.value)
    llm = LLM(tiny_t5_v11, **llm_kw)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == base
    assert llm.llm_engine.scheduler.num_preemptions > 0


def test_mt5_matches_hf(tmp_path):
    """MT5ForConditionalGeneration: gated-GELU, its own lm_head, no output scaling."""
    from transformers import AutoTokenizer, MT5Config, MT5ForConditionalGeneration

    from tests.conftest import TOKENIZERS

    tok = AutoTokenizer.from_pretrained(str(TOKENIZERS / "llm-jp-v2.2"))
    cfg = MT5Config(vocab_size=len(tok), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                    relative_attention_num_buckets=8, relative_attention_max_distance=16,
                    eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                    decoder_start_token_id=tok.pad_token_id, initializer_factor=4.0)
    torch.manual_seed(2)
    MT5ForConditionalGeneration(cfg).save_pretrained(str(tmp_path))
    tok.save_pretrained(str(tmp_path))
    prompts = [T5_JA_PROMPTS[0], T5_EN_PROMPTS[1], "a"]
    ref = hf_t5_greedy(str(tmp_path), [tok(p).input_ids for p in prompts], MAX_TOKENS)
    outs = LLM(str(tmp_path), max_num_seqs=3).generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    first = LLM(str(tmp_path)).generate(prompts[0], SamplingParams(temperature=0.0, max_tokens=1, logprobs=1),
                                        use_tqdm=False)[0].outputs[0]
    with torch.no_grad():   # no output scaling: the logprob of the first token equals HF's
        logits = hf_t5(str(tmp_path))(input_ids=torch.tensor([tok(prompts[0]).input_ids]),
                                      decoder_input_ids=torch.tensor([[cfg.decoder_start_token_id]])).logits[0, -1]
    want = float(torch.log_softmax(logits.float(), -1)[first.token_ids[0]])
    assert first.logprobs[0][first.token_ids[0]].logprob == pytest.approx(want, abs=1e-4)


@pytest.mark.parametrize("version", ["v1.0", "v1.1"])
def test_fp16_equals_hf_fp16_where_the_ffn_overflows(version, tmp_path):
    """fp16 as transformers runs it (Flan-T5's case): FFN outputs past fp16's range (wo scaled up) go into an
    fp32 residual stream, the first block's fp16 sums are clamped: greedy ids equal HF's fp16 ``generate`` (which
    here equals HF fp32), every logprob finite. A residual kept in fp16 and clamped gives other ids."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForSeq2SeqLM

    model_dir = save_tiny_t5(tmp_path, version, num_decoder_layers=2, initializer_factor=1.0)
    path = tmp_path / "model.safetensors"
    sd = load_file(str(path))
    sd = {k: v * 30000 if "DenseReluDense.wo" in k else v for k, v in sd.items()}
    save_file(sd, str(path), metadata={"format": "pt"})
    prompts = T5_EN_PROMPTS + T5_JA_PROMPTS
    llm = LLM(model_dir, dtype="float16", max_num_seqs=8)
    tok = llm.get_tokenizer()
    enc = [tok(p).input_ids for p in prompts]
    refs = {}
    with torch.no_grad():
        for dtype in (torch.float32, torch.float16):
            hf = AutoModelForSeq2SeqLM.from_pretrained(model_dir, dtype=dtype).eval()
            if dtype == torch.float32:   # the residual stream does leave fp16's range
                hidden = hf.encoder(input_ids=torch.tensor([enc[1]]), output_hidden_states=True).hidden_states
                assert max(float(h.abs().max()) for h in hidden) > torch.finfo(torch.float16).max
            refs[dtype] = [hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                                       pad_token_id=hf.config.pad_token_id)[0, 1:].tolist() for ids in enc]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == refs[torch.float16] == refs[torch.float32]
    assert all(math.isfinite(lp[t].logprob) for o in outs for t, lp in zip(o.outputs[0].token_ids,
                                                                           o.outputs[0].logprobs))


def test_prefill_warm_up_runs_on_the_triton_backend(tiny_t5):
    """EncoderDecoderRunner.warm_up_prefill (called on CUDA after the KV cache is allocated) runs the Triton
    kernel's prefill variant with the position bias (here in Triton's interpreter)."""
    from tests.kernels.conftest import SKIP_REASON

    if SKIP_REASON is not None:
        pytest.skip(SKIP_REASON)
    from hayabusa.kernels.paged_attention import paged_attention
    from hayabusa.kernels.store_kv import store_kv
    from hayabusa.attention.backends import AttentionBackend

    runner = LLM(tiny_t5).llm_engine.runner
    runner.encdec.warm_up_prefill(runner.kv_caches, AttentionBackend("triton", store_kv, paged_attention),
                                  runner.buffers)


def test_structured_output_json_with_t5(tiny_t5_v11):
    """The receipts job's constraint: a JSON schema on a T5 model's decoder gives parseable, schema-shaped JSON."""
    import json

    from hayabusa.sampling_params import StructuredOutputsParams

    schema = {"type": "object", "properties": {"merchant": {"type": "string", "maxLength": 10},
                                               "total": {"type": "integer"}},
              "required": ["merchant", "total"], "additionalProperties": False}
    params = SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=StructuredOutputsParams(json=schema))
    outs = LLM(tiny_t5_v11, max_num_seqs=2).generate([T5_EN_PROMPTS[1], T5_JA_PROMPTS[1]], params, use_tqdm=False)
    for o in outs:
        doc = json.loads(o.outputs[0].text)
        assert set(doc) == {"merchant", "total"} and isinstance(doc["total"], int)
