"""Qwen2-VL / Qwen2.5-VL: the model against HF transformers (float32, CPU) on tiny random checkpoints: vision tower
and logits of one forward, M-RoPE positions, and greedy ids through the engine with 0, 1, 2 and 5 images per
prompt for several batch sizes, with image tokens split across prefill chunks, under preemption, and with prefix
caching where prompts share the text but not the images."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch

from hayabusa import LLM, SamplingParams
from tests.vl_checkpoints import hf_vl_greedy, hf_vl_model, make_vl_checkpoint, random_image, vl_prompt_ids

ARCHS = ["qwen2_5_vl", "qwen2_vl"]
MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
# (width, height) of each prompt's images: 0, 1, 2 and 5 images of different sizes and aspect ratios
IMAGE_SIZES = [[], [(56, 28)], [(112, 84), (28, 56)], [(56, 56), (84, 28), (28, 84), (112, 56), (70, 98)]]


@pytest.fixture(scope="module", params=ARCHS)
def vl_dir(request, tmp_path_factory) -> str:
    return make_vl_checkpoint(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def vl_prompts(vl_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(vl_dir)
    prompts = []
    for k, sizes in enumerate(IMAGE_SIZES):
        images = [random_image(w, h, 10 * k + j) for j, (w, h) in enumerate(sizes)]
        prompts.append({"prompt_token_ids": vl_prompt_ids(tok, f"What is in picture {k}?", len(images)),
                        "multi_modal_data": {"image": images} if images else {}})
    return prompts


@pytest.fixture(scope="module")
def hf_refs(vl_dir, vl_prompts):
    """HF's greedy ids per prompt, from the engine's expanded prompt ids (checked against the HF count)."""
    llm = LLM(vl_dir, max_num_seqs=4)
    outs = llm.generate(vl_prompts, SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    return [hf_vl_greedy(vl_dir, o.prompt_token_ids, p["multi_modal_data"].get("image", []), MAX_TOKENS)
            for o, p in zip(outs, vl_prompts)]


def _hf_inputs(model_dir, images, expanded_ids):
    from hayabusa.multimodal.processor import load_image_processor

    x = load_image_processor(model_dir)(images=images, return_tensors="pt")
    ids = torch.tensor([expanded_ids])
    kw = dict(pixel_values=x["pixel_values"], image_grid_thw=x["image_grid_thw"])
    if "mm_token_type_ids" in inspect.signature(hf_vl_model(model_dir).forward).parameters:
        kw["mm_token_type_ids"] = (ids == hf_vl_model(model_dir).config.image_token_id).int()
    return ids, kw


@pytest.mark.parametrize("layout", ["5.x", "4.x", "4.x-flat"])
def test_forward_matches_hf(vl_dir, vl_prompts, layout, tmp_path):
    """One prefill of 5 images: the vision tower's rows and the logits at every position equal HF's, from a
    checkpoint in either key layout (and a released-style flat config.json)."""
    from hayabusa.attention.backends import get_attention_backend
    from hayabusa.attention.metadata import AttentionMetadata, ForwardContext
    from hayabusa.config import EngineArgs
    from hayabusa.model.loader import build_model
    from hayabusa.multimodal.processor import make_mm_processor

    arch = "qwen2_5_vl" if "Qwen2_5" in open(f"{vl_dir}/config.json").read() else "qwen2_vl"
    model_dir = vl_dir if layout == "5.x" else make_vl_checkpoint(tmp_path / "ckpt", arch, layout=layout)
    mc = EngineArgs(model=model_dir, device="cpu", dtype="float32").create_engine_config().model_config
    ours = build_model(mc, torch.device("cpu"))
    prompt = vl_prompts[3]
    images = prompt["multi_modal_data"]["image"]
    ids, mm = make_mm_processor(mc).process(prompt["prompt_token_ids"], images)
    hf = hf_vl_model(vl_dir)
    x, kw = _hf_inputs(vl_dir, images, ids)
    with torch.no_grad():
        feats = hf.model.get_image_features(kw["pixel_values"], kw["image_grid_thw"])
        feats = torch.cat(list(getattr(feats, "pooler_output", feats)))
        ref_logits = hf(input_ids=x, **kw).logits[0]
        ours_feats = ours.get_image_embeddings(torch.from_numpy(np.concatenate([m.pixel_values for m in mm])),
                                               [m.grid_thw for m in mm])
        torch.testing.assert_close(torch.cat(ours_feats), feats, rtol=1e-4, atol=1e-5)
        from hayabusa.worker.mrope import mrope_prompt_positions

        pos, _ = mrope_prompt_positions(len(ids), mm, 2)
        T = len(ids)
        nb = (T + 15) // 16
        kv = [(torch.zeros(nb, 16, 2, 16), torch.zeros(nb, 16, 2, 16)) for _ in range(2)]
        meta = AttentionMetadata(torch.tensor([0, T], dtype=torch.int32), torch.tensor([T], dtype=torch.int32),
                                 torch.arange(nb, dtype=torch.int32)[None], torch.arange(T), 1, T, T)
        embeds = ours.embed_input_ids(x[0])
        embeds[x[0] == hf.config.image_token_id] = torch.cat(ours_feats)
        hidden = ours(x[0], torch.from_numpy(pos), ForwardContext(meta, kv, get_attention_backend(
            torch.device("cpu"))), inputs_embeds=embeds)
        torch.testing.assert_close(ours.compute_logits(hidden), ref_logits, rtol=1e-4, atol=1e-4)


def test_mrope_positions_match_hf_get_rope_index(vl_dir, vl_prompts):
    from hayabusa.config import EngineArgs
    from hayabusa.multimodal.processor import make_mm_processor
    from hayabusa.worker.mrope import mrope_prompt_positions

    mc = EngineArgs(model=vl_dir, device="cpu").create_engine_config().model_config
    proc = make_mm_processor(mc)
    hf = hf_vl_model(vl_dir)
    for prompt in vl_prompts[1:]:
        images = prompt["multi_modal_data"]["image"]
        ids, mm = proc.process(prompt["prompt_token_ids"], images)
        x, kw = _hf_inputs(vl_dir, images, ids)
        args = dict(image_grid_thw=kw["image_grid_thw"], attention_mask=torch.ones_like(x))
        if "mm_token_type_ids" in kw:
            args["mm_token_type_ids"] = kw["mm_token_type_ids"]
        ref_pos, ref_delta = hf.model.get_rope_index(x, **args)
        pos, delta = mrope_prompt_positions(len(ids), mm, 2)
        assert pos.tolist() == ref_pos[:, 0].tolist()
        assert delta == int(ref_delta.reshape(-1)[0]) <= 0
    assert delta < 0                    # the 5-image prompt: images take fewer positions than tokens


CONFIGS = {
    "max_num_seqs=1": dict(max_num_seqs=1),
    "max_num_seqs=3": dict(max_num_seqs=3),
    "max_num_seqs=16": dict(max_num_seqs=16),
    # 8-token chunks: images of more than 8 tokens are split across steps, and the encoder budget (8) cuts chunks
    "chunked_prefill": dict(max_num_seqs=4, max_num_batched_tokens=8),
    "preemption": dict(max_num_seqs=16, block_size=4, num_gpu_blocks_override=20, max_model_len=64,
                       max_num_batched_tokens=16),
}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_greedy_matches_hf(vl_dir, vl_prompts, hf_refs, config):
    llm = LLM(vl_dir, **CONFIGS[config])
    outs = llm.generate(vl_prompts, GREEDY, use_tqdm=False)
    if config == "preemption":
        assert llm.llm_engine.scheduler.num_preemptions > 0
    if config == "chunked_prefill":   # an image longer than a step's 8 tokens: its rows come in two chunks
        _, mm = llm.llm_engine.input_processor.mm_processor.process(vl_prompts[2]["prompt_token_ids"],
                                                                     vl_prompts[2]["multi_modal_data"]["image"])
        assert max(m.length for m in mm) > CONFIGS[config]["max_num_batched_tokens"]
    assert [o.outputs[0].token_ids for o in outs] == hf_refs
    assert len({tuple(r) for r in hf_refs}) == len(hf_refs)      # the prompts' answers differ


def test_prefix_caching_keys_images(vl_dir):
    """Same text, different images: no KV shared (each output equals HF's with its own images, and they differ);
    the same text and images again: served from the cache, same output."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(vl_dir)
    ids = vl_prompt_ids(tok, "Read the two pages and answer in one word.", 2)
    sets = [[random_image(56, 56, 100), random_image(84, 56, 101)],
            [random_image(56, 56, 200), random_image(84, 56, 201)]]
    llm = LLM(vl_dir, enable_prefix_caching=True, block_size=4, max_num_seqs=1)
    outs, hits = [], []
    kv = llm.llm_engine.kv_cache_manager
    for s in sets + sets[:1]:
        before = kv.num_hit_tokens
        outs.append(llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": s}}, GREEDY,
                                 use_tqdm=False)[0])
        hits.append(kv.num_hit_tokens - before)
    refs = [hf_vl_greedy(vl_dir, o.prompt_token_ids, s, MAX_TOKENS) for o, s in zip(outs, sets)]
    assert [o.outputs[0].token_ids for o in outs[:2]] == refs and refs[0] != refs[1]
    assert outs[2].outputs[0].token_ids == refs[0]
    # the second request shared only the blocks before its first image; the third hit (almost) all of the first's
    first_image = outs[0].prompt_token_ids.index(tok.convert_tokens_to_ids("<|image_pad|>"))
    assert hits[0] == 0 and hits[1] <= first_image
    assert hits[2] >= len(outs[0].prompt_token_ids) - 4 > first_image


def test_varlen_attention_equals_per_segment_reference():
    """The vision tower's segment attention (equal-length segments batched) equals one SDPA per segment."""
    from hayabusa.model.vision_attention import segment_groups, varlen_attention

    torch.manual_seed(0)
    cu = [0, 16, 32, 36, 52, 53, 80]
    q, k, v = (torch.randn(cu[-1], 2, 8) for _ in range(3))
    out = varlen_attention(q, k, v, segment_groups(cu, q.device), 8 ** -0.5)
    for a, b in zip(cu[:-1], cu[1:]):
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[a:b].transpose(0, 1), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1), scale=8 ** -0.5)
        torch.testing.assert_close(out[a:b], ref.transpose(0, 1), rtol=1e-5, atol=1e-6)


def test_prefix_hit_ending_inside_an_image(vl_dir):
    """Same image, different text after it: the cached prefix ends inside the image's placeholders, so the tower
    runs again and the prefill takes its rows from the middle; the output still equals HF's."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(vl_dir)
    image = random_image(56, 112, 7)                       # 8 tokens at prompt index 4..11
    llm = LLM(vl_dir, enable_prefix_caching=True, block_size=8, max_num_seqs=1)
    kv = llm.llm_engine.kv_cache_manager
    outs, hits = [], []
    for text in ("Answer A.", "Answer B."):
        before = kv.num_hit_tokens
        outs.append(llm.generate({"prompt_token_ids": vl_prompt_ids(tok, text, 1),
                                  "multi_modal_data": {"image": image}}, GREEDY, use_tqdm=False)[0])
        hits.append(kv.num_hit_tokens - before)
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    first, last = outs[1].prompt_token_ids.index(pad), len(outs[1].prompt_token_ids) - 1 - \
        outs[1].prompt_token_ids[::-1].index(pad)
    assert hits == [0, 8] and first < 8 <= last            # the hit ends inside the image
    assert outs[1].outputs[0].token_ids == hf_vl_greedy(vl_dir, outs[1].prompt_token_ids, [image], MAX_TOKENS)
