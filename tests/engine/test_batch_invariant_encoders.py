"""Batch-invariant mode on the models with a second input path (bfloat16): Qwen2.5-VL's vision tower (seed 000
is a page-image job whose accuracy moved with max_num_seqs) and T5's encoder. One request's greedy token ids and
logprobs are bit-identical alone and among other requests (other images, other encoder lengths), at several
max_num_seqs, in prefill chunks and after a prefix-cache hit; and the runner gives the tower one image, the encoder
one request, per run, which is what makes the tower's and the encoder's shapes the request's own (the default
batches them).

On CPU the bits also held with the tower and the encoder batched (tried with the per-request runs taken out: only
the run-size checks failed), so there the run sizes are what these tests check; the ``[cuda]`` cases, on the device,
check the bits where the kernels (cuBLAS / bi_gemm launches, FlashAttention, SDPA) see the shapes."""

from __future__ import annotations

import pytest

from hayabusa import LLM, SamplingParams
from tests.models._t5 import T5_EN_PROMPTS, T5_JA_PROMPTS, save_tiny_t5
from tests.vl_checkpoints import make_vl_checkpoint, random_image, vl_prompt_ids

PARAMS = SamplingParams(temperature=0.0, max_tokens=8, logprobs=3, ignore_eos=True)
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def _on(device: str) -> dict:
    """Engine arguments for ``device`` (on a GPU a small KV cache: these models are tiny)."""
    return {"device": device, **({"kv_cache_memory_bytes": 1 << 28} if device == "cuda" else {})}


def _key(out) -> tuple:
    c = out.outputs[0]
    return tuple(c.token_ids), tuple(tuple(sorted((t, lp.logprob) for t, lp in d.items())) for d in c.logprobs)


def _spy(monkeypatch, obj, name: str, sizes: list[int], size_of) -> None:
    """Record size_of(args) of every call of obj.name (a method of the class), then run it."""
    real = getattr(obj, name)

    def spy(self, *args, **kwargs):
        sizes.append(size_of(*args))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(obj, name, spy)


# ---------------------------------------------------------------------------------------------------- Qwen2.5-VL
@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory) -> str:
    return make_vl_checkpoint(tmp_path_factory.mktemp("qwen2_5_vl_bi"), "qwen2_5_vl")


@pytest.fixture(scope="module")
def tok(vl_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(vl_dir)


def _vl_prompt(tok, sizes: list[tuple[int, int]], seed: int, text: str = "Read the page.") -> dict:
    images = [random_image(w, h, seed + i) for i, (w, h) in enumerate(sizes)]
    return {"prompt_token_ids": vl_prompt_ids(tok, text, len(images)), "multi_modal_data": {"image": images}}


def _vl_others(tok, n: int, seed: int) -> list[dict]:
    shapes = [[(56, 84)], [(112, 56), (28, 28)], [], [(84, 112)], [(28, 56), (56, 28), (56, 56)]]
    return [_vl_prompt(tok, shapes[i % len(shapes)], 100 * seed + 10 * i, f"Item {i}: total?") for i in range(n)]


def _vl_llm(vl_dir, device: str = "cpu", **kw) -> LLM:
    return LLM(vl_dir, dtype="bfloat16", batch_invariant=True, seed=0, max_model_len=512,
               limit_mm_per_prompt={"image": 4}, **_on(device), **kw)


@pytest.mark.parametrize("device", DEVICES)
def test_vl_request_alone_batched_chunked_and_prefix_hit_agree(vl_dir, tok, monkeypatch, device):
    from hayabusa.model.qwen2_vl import Qwen2VLForConditionalGeneration

    calls: list[int] = []
    _spy(monkeypatch, Qwen2VLForConditionalGeneration, "get_image_embeddings", calls, lambda px, grids: len(grids))
    target = _vl_prompt(tok, [(84, 56), (56, 112)], 7)
    alone = _key(_vl_llm(vl_dir, device, max_num_seqs=1, enable_prefix_caching=False).generate(
        [target], PARAMS, use_tqdm=False)[0])
    assert len(alone[0]) == 8 and all(len(d) >= 3 for d in alone[1])
    got = {}
    llm = _vl_llm(vl_dir, device, max_num_seqs=8)
    outs = llm.generate(_vl_others(tok, 3, 1) + [target] + _vl_others(tok, 4, 2), PARAMS, use_tqdm=False)
    got["7 others, max_num_seqs=8"] = _key(outs[3])
    # the same engine again: the target's full blocks (image hashes in their keys) are a prefix-cache hit
    kv = llm.llm_engine.kv_cache_manager
    hits = kv.num_hit_tokens
    outs = llm.generate(_vl_others(tok, 2, 3) + [target], PARAMS, use_tqdm=False)
    assert kv.num_hit_tokens >= hits + 16, (hits, kv.num_hit_tokens)
    got["prefix hit, 2 others"] = _key(outs[2])
    # prefill in 24-token chunks (the encoder budget still fits one image: each step encodes what it reaches)
    chunked = _vl_llm(vl_dir, device, max_num_seqs=4, max_num_batched_tokens=24)
    assert len(target["prompt_token_ids"]) + 8 > 24    # with its image tokens the prompt spans several chunks
    outs = chunked.generate([target] + _vl_others(tok, 3, 4), PARAMS, use_tqdm=False)
    got["3 others, chunks of 24"] = _key(outs[0])
    if device == "cuda":   # decode steps replayed from CUDA graphs above; eagerly here
        outs = _vl_llm(vl_dir, device, max_num_seqs=8, enforce_eager=True).generate(
            _vl_others(tok, 5, 5) + [target], PARAMS, use_tqdm=False)
        got["5 others, CUDA graphs off"] = _key(outs[5])
    for name, key in got.items():
        assert key == alone, name
    assert calls and set(calls) == {1}, calls    # the mode's tower runs: one image each


def test_vl_default_mode_batches_the_tower(vl_dir, tok, monkeypatch):
    """The control for the test above: without the mode, one tower run takes several images."""
    from hayabusa.model.qwen2_vl import Qwen2VLForConditionalGeneration

    calls: list[int] = []
    _spy(monkeypatch, Qwen2VLForConditionalGeneration, "get_image_embeddings", calls, lambda px, grids: len(grids))
    LLM(vl_dir, dtype="bfloat16", max_model_len=512, max_num_seqs=8, limit_mm_per_prompt={"image": 4}).generate(
        _vl_others(tok, 5, 5), SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    assert max(calls) > 1, calls


def test_vl_mode_swaps_the_tower_and_text_linears(vl_dir):
    from hayabusa.kernels.batch_invariant import linear_bi
    from hayabusa.model.layers.linear import Linear
    from hayabusa.quantization.base import BatchInvariantLinearMethod

    runner = _vl_llm(vl_dir).llm_engine.runner
    tower = [m for m in runner.model.visual.modules() if isinstance(m, Linear)]
    text = [m for m in runner.model.model.modules() if isinstance(m, Linear)]
    assert tower and text
    assert all(isinstance(m.quant_method, BatchInvariantLinearMethod) for m in tower + text)
    assert runner.model.logits_linear is linear_bi and runner.mm.batch_invariant


# ------------------------------------------------------------------------------------------------------------ T5
@pytest.fixture(scope="module")
def t5_dir(tmp_path_factory) -> str:
    return save_tiny_t5(tmp_path_factory.mktemp("tiny_t5_bi"), "v1.1", n_positions=256)


LONG = "Receipt: " + " ".join(f"item{i} ¥{100 + i * 7}" for i in range(20)) + " 合計 ¥9,999"
T5_OTHERS = T5_EN_PROMPTS + T5_JA_PROMPTS + [LONG, "a"]
T5_TARGET = "summarize: Invoice 2024-117. Seller: Sato Trading. Amount due 48,600 yen by 2024-06-30."


def _t5_llm(t5_dir, device: str = "cpu", **kw) -> LLM:
    return LLM(t5_dir, dtype="bfloat16", batch_invariant=True, seed=0, **_on(device), **kw)


@pytest.mark.parametrize("device", DEVICES)
def test_t5_request_alone_and_among_other_encoder_lengths_agree(t5_dir, monkeypatch, device):
    from hayabusa.model.t5 import T5ForConditionalGeneration

    runs: list[int] = []
    _spy(monkeypatch, T5ForConditionalGeneration, "encode", runs, lambda ids, seq_lens: len(seq_lens))
    alone = _key(_t5_llm(t5_dir, device, max_num_seqs=1).generate([T5_TARGET], PARAMS, use_tqdm=False)[0])
    assert len(alone[0]) == 8 and all(len(d) >= 3 for d in alone[1])
    got = {}
    settings = [dict(max_num_seqs=16), dict(max_num_seqs=3), dict(max_num_seqs=16, max_num_batched_tokens=64)]
    if device == "cuda":
        settings.append(dict(max_num_seqs=16, enforce_eager=True))
    for kw in settings:
        outs = _t5_llm(t5_dir, device, **kw).generate(T5_OTHERS[:3] + [T5_TARGET] + T5_OTHERS[3:], PARAMS,
                                              use_tqdm=False)
        got[str(kw)] = _key(outs[3])
    for name, key in got.items():
        assert key == alone, name
    assert runs and set(runs) == {1}, runs       # the mode's encoder runs: one request each


@pytest.mark.cuda
def test_t5_cross_attention_small_decode_tile_same_bits(tmp_path, monkeypatch):
    """On a GPU: cross-attention is a decode-form paged attention (one query per "sequence"), so on 64-dim heads a
    step with enough programs takes the mode's 16-row one-warp tile (paged_attention.batch_invariant_tile_config,
    measured on decoder heads). The threshold lowered to 6 programs: the target alone (4 heads, one token a step)
    keeps the mode's tile, among 15 others its steps take the small one; ids and logprobs stay identical."""
    import torch

    import hayabusa.kernels.paged_attention as pa

    t5_64 = save_tiny_t5(tmp_path, "v1.1", n_positions=256, d_kv=64)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    monkeypatch.setattr(pa, "BI_DECODE_MIN_PROGRAMS_PER_SM", 6 / sms)
    tiles: list[int] = []
    real = pa.batch_invariant_tile_config

    def spy(*args, **kwargs):
        cfg = real(*args, **kwargs)
        tiles.append(cfg["num_warps"])
        return cfg

    monkeypatch.setattr(pa, "batch_invariant_tile_config", spy)
    alone = _key(_t5_llm(t5_64, "cuda", max_num_seqs=1).generate([T5_TARGET], PARAMS, use_tqdm=False)[0])
    assert 1 not in tiles
    outs = _t5_llm(t5_64, "cuda", max_num_seqs=16, enforce_eager=True).generate(
        T5_OTHERS * 2 + [T5_TARGET], PARAMS, use_tqdm=False)
    assert 1 in tiles                                    # the small tile ran
    assert _key(outs[-1]) == alone


def test_t5_default_mode_batches_the_encoder(t5_dir, monkeypatch):
    """The control: without the mode, one encoder run takes several requests."""
    from hayabusa.model.t5 import T5ForConditionalGeneration

    runs: list[int] = []
    _spy(monkeypatch, T5ForConditionalGeneration, "encode", runs, lambda ids, seq_lens: len(seq_lens))
    LLM(t5_dir, dtype="bfloat16", max_num_seqs=16).generate(T5_OTHERS, SamplingParams(max_tokens=2),
                                                            use_tqdm=False)
    assert max(runs) > 1, runs


def test_t5_mode_never_pads_the_encoder(t5_dir):
    """No bucket padding (its length would come from the step's longest input) and no encoder graphs: even with the
    padded path switched on (as on CUDA), every encoder input runs alone on the packed path."""
    llm = _t5_llm(t5_dir, max_num_seqs=16)
    encdec = llm.llm_engine.runner.encdec
    assert encdec.batch_invariant and not encdec.padded_encoder
    assert llm.llm_engine.runner.backend.name == "torch-batch-invariant"
    encdec.padded_encoder = True
    llm.generate(T5_OTHERS, SamplingParams(max_tokens=2), use_tqdm=False)
    assert encdec.num_padded_runs == 0 and encdec.num_packed_runs == len(T5_OTHERS)


def test_t5_in_float16_is_refused_in_the_mode(t5_dir):
    """transformers' fp16 overflow clamp (kernels/t5_fp16_norm.py) is decided over the whole step: refused by name."""
    from hayabusa.config import EngineArgs
    from hayabusa.errors import HayabusaValidationError

    with pytest.raises(HayabusaValidationError, match="bfloat16") as e:
        EngineArgs.from_kwargs(t5_dir, device="cpu", dtype="float16", batch_invariant=True).create_engine_config()
    assert e.value.parameter == "dtype"


def test_bi_attention_reference_adds_the_position_bias_by_distance():
    """paged_attention_bi_ref with T5's bias equals the plain reference (the same scores, another sum order) to
    fp32 rounding, distances past the table clamped as there, and a query row's bits do not change with the rows
    around it."""
    import torch

    from hayabusa.kernels.batch_invariant import paged_attention_bi_ref
    from hayabusa.kernels.paged_attention import paged_attention_ref

    g = torch.Generator().manual_seed(0)
    H, D, bs, S = 4, 16, 4, 23
    k_cache = torch.randn(8, bs, H, D, generator=g)
    v_cache = torch.randn(8, bs, H, D, generator=g)
    bias = torch.randn(H, 16, generator=g)      # shorter than S: distances past 15 take the table's last entry
    table = torch.arange(8, dtype=torch.int32)[None]
    q = torch.randn(S, H, D, generator=g)

    def run(fn, rows: slice) -> torch.Tensor:
        n = rows.stop - rows.start
        out = torch.empty(n, H, D)
        fn(q[rows], k_cache, v_cache, out, torch.tensor([0, n], dtype=torch.int32),
           torch.tensor([rows.stop], dtype=torch.int32), table, 0.25, n, num_seqs=1, position_bias=bias)
        return out

    full = run(paged_attention_bi_ref, slice(0, S))
    torch.testing.assert_close(full, run(paged_attention_ref, slice(0, S)), rtol=1e-5, atol=1e-5)
    no_bias = torch.empty(S, H, D)
    paged_attention_bi_ref(q, k_cache, v_cache, no_bias, torch.tensor([0, S], dtype=torch.int32),
                           torch.tensor([S], dtype=torch.int32), table, 0.25, S, num_seqs=1)
    assert (no_bias - full).abs().max() > 0.05          # the bias is applied
    assert torch.equal(run(paged_attention_bi_ref, slice(20, 23)), full[20:23])   # a chunk: the same bits
