"""Images through the engine (issue #16): the seed's script as written on a tiny Qwen2.5-VL checkpoint, the
``multi_modal_data`` forms, refusals that name their parameter (``limit_mm_per_prompt``, placeholder count, length,
a text-only model) with the engine serving the next request, n > 1 and abort with images, and the scheduler's
encoder budget (plain Python). CPU."""

from __future__ import annotations

import functools
import pickle

import numpy as np
import pytest
import torch
from PIL import Image

from hayabusa import LLM, HayabusaValidationError, SamplingParams
from hayabusa.core.encoder_budget import EncoderBudget
from hayabusa.core.request import Request
from hayabusa.multimodal.inputs import ImageInput
from tests.helpers import step_until_done
from tests.vl_checkpoints import hf_vl_greedy, make_vl_checkpoint, random_image, vl_prompt_ids

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory) -> str:
    return make_vl_checkpoint(tmp_path_factory.mktemp("qwen2_5_vl"), "qwen2_5_vl")


@pytest.fixture(scope="module")
def llm(vl_dir):
    return LLM(vl_dir, max_model_len=256, max_num_seqs=4, limit_mm_per_prompt={"image": 5})


@pytest.fixture(scope="module")
def tok(vl_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(vl_dir)


def _prompt(tok, images, text="Describe."):
    return {"prompt_token_ids": vl_prompt_ids(tok, text, len(images)), "multi_modal_data": {"image": images}}


def _serves(llm, tok) -> None:
    out = llm.generate(_prompt(tok, [random_image(28, 28, 1)]), GREEDY, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 6 and not llm.llm_engine.has_unfinished_requests()


@functools.lru_cache(maxsize=2)
def _processor(model_dir):
    """The seed's ``processor``; transformers 5 loads Qwen2-VL's AutoProcessor only with torchvision, so without
    it the tokenizer (its chat template is the checkpoint's) renders the same text."""
    try:
        from transformers import AutoProcessor

        processor = AutoProcessor.from_pretrained(model_dir)
    except Exception:  # noqa: BLE001 -- ImportError (torchvision) in several disguises
        from transformers import AutoTokenizer

        processor = AutoTokenizer.from_pretrained(model_dir)
    return processor


def _chat_prompt(model_dir, messages):
    return _processor(model_dir).apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_seed_script_runs_as_written(vl_dir):
    llm = LLM(model=vl_dir, gpu_memory_utilization=0.95, trust_remote_code=True, max_model_len=8192,
              tensor_parallel_size=1, dtype=torch.bfloat16, limit_mm_per_prompt={"image": 5}, seed=0,
              max_num_seqs=14)
    params = SamplingParams(temperature=0.0, top_p=1, top_k=1, max_tokens=8)
    items = []
    for k, n in enumerate([2, 5, 3]):
        images = [random_image(28 * (1 + (k + j) % 3), 28 * (1 + j % 2), 10 * k + j) for j in range(n)]
        messages = [{"role": "user", "content": [{"type": "image", "image": im} for im in images]
                     + [{"type": "text", "text": "Extract the personnel changes as JSON."}]}]
        items.append((_chat_prompt(vl_dir, messages), images))
    outs = llm.generate([{"prompt": p, "multi_modal_data": {"image": ims}} for p, ims in items], params)
    for o in outs:   # 8 tokens, or fewer ending at EOS
        c = o.outputs[0]
        assert (len(c.token_ids), c.finish_reason) == (8, "length") or (c.finish_reason == "stop" and c.token_ids)
    pad = llm.get_tokenizer().convert_tokens_to_ids("<|image_pad|>")
    assert sum(t == pad for t in outs[1].prompt_token_ids) > 5           # placeholders expanded
    # 6 images with limit 5: a clear error, and the engine serves the next request
    six = [random_image(28, 28, 50 + j) for j in range(6)]
    prompt6 = _chat_prompt(vl_dir, [{"role": "user", "content": [{"type": "image"}] * 6 + [
        {"type": "text", "text": "Six pages."}]}])
    with pytest.raises(HayabusaValidationError, match="limit_mm_per_prompt") as e:
        llm.generate([{"prompt": prompt6, "multi_modal_data": {"image": six}}], params)
    assert e.value.parameter == "limit_mm_per_prompt" and e.value.value == 6
    again = llm.generate([{"prompt": items[0][0], "multi_modal_data": {"image": items[0][1]}}], params)[0]
    assert again.outputs[0].token_ids == outs[0].outputs[0].token_ids
    text_only = llm.generate([{"prompt": "Hello", "multi_modal_data": {}}], params)[0]
    assert len(text_only.outputs[0].token_ids) > 0


def test_image_forms_and_text_only(llm, tok, vl_dir):
    im = random_image(56, 28, 3)
    arr = np.asarray(im)
    one = llm.generate(_prompt(tok, [im]), GREEDY, use_tqdm=False)[0]
    single = {"prompt_token_ids": vl_prompt_ids(tok, "Describe.", 1), "multi_modal_data": {"image": im}}
    as_array = {"prompt_token_ids": vl_prompt_ids(tok, "Describe.", 1), "multi_modal_data": {"image": arr}}
    outs = llm.generate([single, as_array], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [one.outputs[0].token_ids] * 2
    assert one.outputs[0].token_ids == hf_vl_greedy(vl_dir, one.prompt_token_ids, [im], 6)
    # the HF processor's input_ids (placeholders already expanded) are taken as they are
    expanded = {"prompt_token_ids": one.prompt_token_ids, "multi_modal_data": {"image": [im]}}
    again = llm.generate(expanded, GREEDY, use_tqdm=False)[0]
    assert again.prompt_token_ids == one.prompt_token_ids and again.outputs[0].token_ids == one.outputs[0].token_ids
    ids = vl_prompt_ids(tok, "No picture.", 0)
    plain = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)[0]
    for mm in ({}, {"image": []}, {"image": None}):
        out = llm.generate({"prompt_token_ids": ids, "multi_modal_data": mm}, GREEDY, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == plain.outputs[0].token_ids
    assert plain.outputs[0].token_ids == hf_vl_greedy(vl_dir, ids, [], 6)


@pytest.mark.parametrize("case", ["more_placeholders", "fewer_placeholders", "wrong_run", "bad_type", "video",
                                  "too_long", "aspect_ratio", "grayscale_2d", "chw"])
def test_bad_image_input_is_refused_by_name(llm, tok, case):
    im = random_image(28, 28, 7)
    prompt = {
        "more_placeholders": {"prompt_token_ids": vl_prompt_ids(tok, "x", 2), "multi_modal_data": {"image": [im]}},
        "fewer_placeholders": {"prompt_token_ids": vl_prompt_ids(tok, "x", 1),
                               "multi_modal_data": {"image": [im, im]}},
        "wrong_run": {"prompt_token_ids": [t for t in vl_prompt_ids(tok, "x", 1) for _ in range(
            3 if t == tok.convert_tokens_to_ids("<|image_pad|>") else 1)], "multi_modal_data": {"image": [im]}},
        "bad_type": {"prompt_token_ids": vl_prompt_ids(tok, "x", 1), "multi_modal_data": {"image": "cat.png"}},
        "video": {"prompt_token_ids": vl_prompt_ids(tok, "x", 0), "multi_modal_data": {"video": [im]}},
        # 5 images of 112 x 112 px (16 tokens each) + ~190 text tokens > max_model_len 256 once expanded
        "too_long": _prompt(tok, [random_image(112, 112, j) for j in range(5)], "word " * 180),
        "aspect_ratio": _prompt(tok, [Image.new("RGB", (10000, 3))]),   # transformers' resize rule refuses it
        "grayscale_2d": {"prompt_token_ids": vl_prompt_ids(tok, "x", 1),
                         "multi_modal_data": {"image": np.zeros((28, 28), dtype=np.uint8)}},
        "chw": {"prompt_token_ids": vl_prompt_ids(tok, "x", 1),
                "multi_modal_data": {"image": np.zeros((3, 28, 28), dtype=np.uint8)}},
    }[case]
    engine = llm.llm_engine
    known = set(engine.runner.mm.requests)
    with pytest.raises(HayabusaValidationError) as e:
        llm.generate(prompt, GREEDY, use_tqdm=False)
    assert e.value.parameter == ("prompt" if case == "too_long" else "multi_modal_data")
    if case in ("grayscale_2d", "chw"):   # named by its index and shape, not dumped
        assert "multi_modal_data['image'][0] has shape" in str(e.value) and "HWC" in str(e.value)
    # refused before any work: nothing queued, no image reached the runner
    assert not engine.has_unfinished_requests() and set(engine.runner.mm.requests) <= known
    _serves(llm, tok)


def test_images_whose_tokens_exceed_max_model_len_are_refused_from_their_sizes(llm, tok, monkeypatch):
    # a huge image costs seconds to resize: its token count comes from its size alone (the processor's own rule)
    mp = llm.llm_engine.input_processor.mm_processor
    real = mp.image_processor

    class CountOnly:   # the processor's counting rule, but no resizing allowed
        get_number_of_image_patches = staticmethod(real.get_number_of_image_patches)

        def __call__(self, *args, **kwargs):
            raise AssertionError("the image processor ran on images that were refused by their sizes")

    monkeypatch.setattr(mp, "_image_processor", CountOnly())
    monkeypatch.setattr(mp, "max_model_len", 20)
    images = [Image.new("RGB", (9400, 9400)), Image.new("RGB", (9400, 9400))]   # 16 tokens each here
    with pytest.raises(HayabusaValidationError, match=r"take 32 tokens \(\[16, 16\]\).*max_model_len=20") as e:
        llm.generate(_prompt(tok, images), GREEDY, use_tqdm=False)
    assert e.value.parameter == "multi_modal_data"
    monkeypatch.undo()
    _serves(llm, tok)


def test_text_model_refuses_images(tiny_qwen2):
    llm = LLM(tiny_qwen2)
    with pytest.raises(HayabusaValidationError) as e:
        llm.generate({"prompt": "hi", "multi_modal_data": {"image": [random_image(28, 28, 0)]}}, GREEDY)
    assert e.value.parameter == "multi_modal_data"
    with pytest.raises(HayabusaValidationError, match="takes text only") as e:   # LLM.chat says so too
        llm.chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": random_image(28, 28, 0)},
                                               {"type": "text", "text": "hi"}]}], GREEDY, use_tqdm=False)
    assert e.value.parameter == "messages"
    assert llm.generate({"prompt": "hi", "multi_modal_data": {}}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(HayabusaValidationError, match="limit_mm_per_prompt"):
        LLM(tiny_qwen2, limit_mm_per_prompt={"image": 2})


def test_bad_limit_mm_per_prompt_is_refused(vl_dir):
    for bad in ({"image": -1}, {"audio": 1}, "image=3", [5], {"image": 2, "video": 1}):
        with pytest.raises(HayabusaValidationError) as e:
            LLM(vl_dir, limit_mm_per_prompt=bad)
        assert e.value.parameter == "limit_mm_per_prompt"


def test_n_and_abort_with_images(llm, tok, vl_dir):
    images = [random_image(56, 56, 9), random_image(28, 56, 10)]
    single = llm.generate(_prompt(tok, images), GREEDY, use_tqdm=False)[0]
    out = llm.generate(_prompt(tok, images), SamplingParams(n=3, temperature=0.0, max_tokens=6, ignore_eos=True),
                       use_tqdm=False)[0]
    assert [c.token_ids for c in out.outputs] == [single.outputs[0].token_ids] * 3
    engine = llm.llm_engine
    engine.add_request("a", _prompt(tok, images), GREEDY)
    engine.add_request("b", _prompt(tok, images[:1]), GREEDY)
    engine.step()
    engine.abort_request("a")
    done = step_until_done(engine)
    assert list(done) == ["b"] and "a" not in engine.runner.mm.requests   # a's images dropped on abort
    _serves(llm, tok)                   # the runner hears of b's end with the next step that runs
    assert "b" not in engine.runner.mm.requests
    assert done["b"].outputs[0].token_ids == hf_vl_greedy(vl_dir, done["b"].prompt_token_ids, images[:1], 6)


def _req(images: list[tuple[int, int]], num_tokens: int = 64) -> Request:
    req = Request("r", list(range(num_tokens)), SamplingParams(), (), 8)
    req.mm_inputs = [ImageInput(np.zeros((4 * n, 1), np.float32), (1, 2, 2 * n), off, n, f"h{off}")
                     for off, n in images]
    return req


def test_encoder_budget_cuts_chunks_before_an_image_it_cannot_encode():
    req = _req([(2, 6), (10, 6), (20, 30)])
    budget = EncoderBudget(10)
    assert budget.fit(req, 0, 16) == (10, [0])            # image 1 (6 more tokens) does not fit: stop at 10
    budget.charge(req, [0])
    assert budget.left == 4 and req.mm_encoded == {0}
    assert EncoderBudget(10).fit(req, 8, 10) == (10, [1])  # image 0 already encoded; image 1 fits
    assert EncoderBudget(10).fit(req, 8, 16) == (12, [1])  # image 2 (30 tokens) not after image 1: stop at 20
    big = EncoderBudget(10)
    assert big.fit(req, 16, 30) == (30, [2])                # larger than the budget: runs alone
    big.left = 9
    assert big.fit(req, 16, 30) == (4, [])                  # ... but not after other work in the step
    req.mm_encoded.clear()
    spent = EncoderBudget(10)
    spent.left = 3
    assert spent.fit(req, 4, 8) == (0, [])                  # starts inside image 0 (prefix hit), which cannot run


def test_prefix_cache_block_keys_include_image_hashes():
    """Blocks holding image placeholders are keyed by the images' content hashes too (plain KVCacheManager): same
    tokens with another image hit only the blocks before the image; with the same image, every full block."""
    from hayabusa.core.kv_cache_manager import KVCacheManager

    mgr = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=True)

    def req(rid, image_hash):
        r = Request(rid, list(range(14)), SamplingParams(), (), 8)    # image tokens 5..8 (blocks 1 and 2)
        r.mm_inputs = [ImageInput(np.zeros((16, 1), np.float32), (1, 4, 4), 5, 4, image_hash)]
        return r

    a = req("a", "cat")
    assert mgr.allocate_slots(a, 14) == [0, 1, 2, 3]
    mgr.cache_full_blocks(a)                                   # blocks 0, 1, 2 are full
    assert mgr.get_computed_blocks(req("b", "dog")) == ([0], 4)
    assert mgr.get_computed_blocks(req("c", "cat")) == ([0, 1, 2], 12)


def test_scheduler_sends_each_image_in_the_step_that_first_touches_it():
    from hayabusa.config import SchedulerConfig
    from hayabusa.core.kv_cache_manager import KVCacheManager
    from hayabusa.core.scheduler import Scheduler

    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=10, max_model_len=64,
                                      max_num_encoder_input_tokens=8),
                      KVCacheManager(num_blocks=16, block_size=4))
    r = _req([(4, 8), (16, 8)], num_tokens=30)
    sched.add_request(r)
    steps = []
    for _ in range(3):
        out = sched.schedule()
        steps.append((out.num_scheduled_tokens.get("r"), out.scheduled_encoder_inputs))
        assert out.scheduled_encoder_prompt_req_ids == []     # encoder-decoder models' field: no encoder prompt
        if out.scheduled_new_reqs:
            assert out.scheduled_new_reqs[0].mm_inputs is r.mm_inputs
            sent = pickle.loads(pickle.dumps(out))            # plain data: it pickles, images included
            assert sent.scheduled_new_reqs[0].mm_inputs[1].content_hash == "h16"
        sched.update_from_output(out, {"r": []})
    # [0, 10) touches image 0; [10, 20) image 1 (image 0 is held by the runner); [20, 30) none
    assert steps == [(10, {"r": [0]}), (10, {"r": [1]}), (10, {})]


def test_async_engine_preprocesses_images_off_the_engine_thread(vl_dir, llm, tok, monkeypatch):
    import asyncio
    import threading

    from hayabusa import AsyncEngineArgs, AsyncLLMEngine
    from hayabusa.multimodal import processor as mm_processor

    threads = []
    real = mm_processor.MultiModalProcessor.preprocess

    def spy(self, images):   # where the image processor really runs (not the pass-through of processed images)
        if not isinstance(images, mm_processor.ProcessedImages):
            threads.append(threading.current_thread().name)
        return real(self, images)

    monkeypatch.setattr(mm_processor.MultiModalProcessor, "preprocess", spy)
    images = [random_image(56, 84, 21), random_image(84, 56, 22)]
    ref = llm.generate(_prompt(tok, images), GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    eng = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=vl_dir, disable_log_requests=True,
                                                          max_model_len=256, max_num_seqs=4,
                                                          limit_mm_per_prompt={"image": 2}))
    try:
        async def run(prompt, rid):
            last = None
            async for out in eng.generate(prompt, GREEDY, rid):
                last = out
            return last

        threads.clear()
        out = asyncio.run(run(_prompt(tok, images), "img"))
        assert out.outputs[0].token_ids == ref
        assert len(threads) == 1 and threads[0] not in ("hayabusa-engine", threading.current_thread().name)
        with pytest.raises(HayabusaValidationError, match="limit_mm_per_prompt"):
            asyncio.run(run(_prompt(tok, images + images[:1]), "three"))
        assert asyncio.run(run(_prompt(tok, images[:1]), "next")).finished
    finally:
        eng.shutdown()


def test_generate_steps_while_later_prompts_images_are_processed(llm, tok, vl_dir, monkeypatch):
    """LLM.generate queues each prompt as soon as its images are processed (in prompt order) and steps the engine
    meanwhile: with the last prompt's processing held until the engine has stepped, the batch still completes,
    outputs come back in prompt order and equal a run without the hold."""
    import threading

    import hayabusa.multimodal.processor as proc

    prompts = [_prompt(tok, [random_image(28 + 14 * k, 28, k)], f"Page {k}.") for k in range(4)]
    ref = llm.generate(prompts, GREEDY, use_tqdm=False)
    stepped, real_step = threading.Event(), llm.llm_engine.step
    real = proc.preprocess_prompt_images

    def held(mm, prompt):
        if prompt is prompts[-1]:
            assert stepped.wait(60), "the engine never stepped while the last prompt was being processed"
        return real(mm, prompt)

    def step():
        stepped.set()
        return real_step()

    monkeypatch.setattr(proc, "preprocess_prompt_images", held)
    monkeypatch.setattr(llm.llm_engine, "step", step)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    assert [o.prompt_token_ids for o in outs] == [o.prompt_token_ids for o in ref]


def test_bad_prompt_late_in_a_batch_aborts_the_call(llm, tok):
    """A bad image found while earlier prompts already run: the error names its index, nothing stays queued, the
    LLM serves the next call."""
    good = [_prompt(tok, [random_image(28, 28, k)]) for k in range(3)]
    bad = {"prompt_token_ids": vl_prompt_ids(tok, "x", 2), "multi_modal_data": {"image": [random_image(28, 28, 9)]}}
    with pytest.raises(HayabusaValidationError) as e:
        llm.generate(good + [bad], GREEDY, use_tqdm=False)
    assert str(e.value).startswith("prompts[3]") and e.value.parameter == "multi_modal_data"
    assert not llm.llm_engine.has_unfinished_requests()
    _serves(llm, tok)


def test_preprocess_stream_hands_prompts_out_in_order():
    """take() returns the ready prefix in prompt order (text prompts at once), waits for one only when asked."""
    import threading

    from hayabusa.multimodal.processor import PreprocessStream

    gates = {1: threading.Event(), 3: threading.Event()}

    class Fake:
        image_processor = object()

        def parse_images(self, data):
            return data["image"]

        def preprocess(self, images):
            gates[images[0]].wait(30)
            return ("done", images[0])

    prompts = ["t0", {"multi_modal_data": {"image": [1]}}, "t2", {"multi_modal_data": {"image": [3]}}, "t4"]
    with PreprocessStream(Fake(), prompts) as s:
        assert s.take() == [(0, "t0")] and s.take() == []
        gates[1].set()
        got = s.take(block=True)
        assert got[0] == (1, {"multi_modal_data": {"image": ("done", 1)}}) and [i for i, _ in got] == [1, 2]
        assert not s.done
        gates[3].set()
        assert [i for i, _ in s.take(block=True)] == [3, 4] and s.done


def test_image_hashes_are_computed_where_the_processor_runs(llm, tok, monkeypatch):
    """The content hash of each image (its prefix-cache key) is made with the pixels, on the preprocessing thread:
    add_request of an already-processed prompt hashes nothing (W8's 338 pages cost ~9 s of engine-thread time)."""
    import hayabusa.multimodal.processor as proc

    mm = llm.llm_engine.input_processor.mm_processor
    images = [random_image(56, 28, 1), random_image(28, 84, 2)]
    done = mm.preprocess(images)
    row = 0
    for grid, h in zip(done.grids, done.hashes):
        n = grid[0] * grid[1] * grid[2]
        assert h == proc.image_hash(done.pixel_values[row:row + n], grid)
        row += n
    assert len(set(done.hashes)) == 2

    def no_hash(*a):
        raise AssertionError("hashed on the engine thread")

    monkeypatch.setattr(proc, "image_hash", no_hash)
    ids, inputs = mm.process(vl_prompt_ids(tok, "x", 2), done)
    assert [i.content_hash for i in inputs] == done.hashes
