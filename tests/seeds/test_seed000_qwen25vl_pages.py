"""Report 000 (Sansan: a fine-tuned Qwen2.5-VL-7B reads personnel-change records off 2-5 PDF page images, offline
batch, vLLM 0.8.5): the user's vLLM script as written, with only ``from vllm`` -> ``from hayabusa``, on a tiny random
Qwen2.5-VL checkpoint (tests/vl_checkpoints.py, the real Qwen tokenizer). Every vLLM argument the user passed is
kept (gpu_memory_utilization, trust_remote_code, max_model_len, tensor_parallel_size, dtype=torch.bfloat16,
limit_mm_per_prompt, seed, max_num_seqs) and so are the report's max_num_seqs settings 1 / 4 / 14 / 16 (16 broke
vLLM's accuracy to 0.000 in the report). Checks: one output per row, in order, max_tokens or EOS; greedy within a
bf16 near-tie of HF float32's argmax on the same weights and images; the same ids for every max_num_seqs; an
over-limit page count refused by name. Substitutions are marked ``# seed:``."""

from __future__ import annotations

import time

import pytest
import torch

from tests.helpers import assert_near_greedy, greedy_margins
from tests.vl_checkpoints import hf_vl_model, make_vl_checkpoint, random_image

MAX_NUM_PAGE = 5
MAX_TOKEN = 8          # seed: the report's MAX_TOKEN is not shown; 8 tokens keep the tier fast on 2 CPU cores
SEED = 0               # seed: the report's SEED is not shown
NUM_ROWS = 4           # seed: 100 rows in the report


# ---- seed: stand-ins for what the report elides ("# 中略") or what is not installed -------------------------------
class _Frame:
    """seed: ``polars`` is not installed; the two things the script uses (``iter_rows(named=True)``, ``height``)."""

    def __init__(self, rows):
        self.rows = rows
        self.height = len(rows)

    def iter_rows(self, named=True):
        return iter(self.rows)


class pl:  # noqa: N801 -- seed: polars stand-in, ``pl.read_csv(TEST_DATA_PATH)``
    @staticmethod
    def read_csv(path):
        rows = []
        for k in range(NUM_ROWS):     # 2-5 page images per row, as in the report; sizes stay tiny
            pages = [random_image(28 * (1 + (k + j) % 3), 28 * (1 + j % 2), 10 * k + j) for j in range(2 + k % 4)]
            rows.append({"pages": pages, "company": f"株式会社サンプル{k}", "page_no": k + 1,
                         "note": "人事異動の欄のみ"})
        return _Frame(rows)


def tqdm(it, total=None):  # seed: tqdm over the rows, kept out of the test log
    return it


class MakePrompter:  # seed: elided in the report ("# 中略"); holds the answer schema
    def __init__(self, path):
        self.path = path


def get_messages(row, make_prompter):
    """seed: elided in the report; the page images then the instruction, in qwen_vl_utils' message format."""
    return [{"role": "user", "content": [{"type": "image", "image": im} for im in row["pages"]] + [
        {"type": "text", "text": f"{row['company']} p.{row['page_no']}: {row['note']}。人事異動情報をJSONで出力。"}]}]


def process_vision_info(messages):
    """seed: ``qwen_vl_utils.process_vision_info`` is not installed: the images of the messages' image parts, in
    order (the PIL images already fit the tiny processor's pixel range), and no videos."""
    images = [p["image"] for m in messages for p in m["content"] if p.get("type") == "image"]
    return (images or None), None


def _auto_processor(path):
    """seed: transformers 5 loads Qwen2.5-VL's AutoProcessor only with torchvision (not installed here); the
    tokenizer holds the checkpoint's chat template and renders the same text."""
    from transformers import AutoProcessor, AutoTokenizer

    try:
        return AutoProcessor.from_pretrained(path)
    except Exception:  # noqa: BLE001 -- ImportError (torchvision) in several disguises
        return AutoTokenizer.from_pretrained(path)


def run_user_script(FINE_TUNED_PATH, MAX_NUM_SEQS, ANSWER_DATA_PATH="answers.json", TEST_DATA_PATH="test.csv"):
    """The report's vLLM script; the body of its ``if __name__ == "__main__":``. Returns what the test checks."""
    from hayabusa import LLM, SamplingParams     # the one change: ``from vllm import LLM, SamplingParams``

    make_prompter = MakePrompter(ANSWER_DATA_PATH)

    test_data = pl.read_csv(TEST_DATA_PATH)

    preprocessor = _auto_processor(FINE_TUNED_PATH)   # seed: AutoProcessor.from_pretrained(FINE_TUNED_PATH)

    model = LLM(
        model=FINE_TUNED_PATH,
        gpu_memory_utilization=0.95,
        trust_remote_code=True,
        max_model_len=8192,
        tensor_parallel_size=1,
        dtype=torch.bfloat16,
        limit_mm_per_prompt={"image": MAX_NUM_PAGE},
        seed=SEED,
        max_num_seqs=MAX_NUM_SEQS
    )

    sampling_params = SamplingParams(
        temperature=0.0,
        top_p=1,
        top_k=1,
        max_tokens=MAX_TOKEN
    )

    make_prompter = MakePrompter(ANSWER_DATA_PATH)

    all_inputs = []
    for row in tqdm(test_data.iter_rows(named=True), total=test_data.height):
        messages = get_messages(
            row, make_prompter  # seed: the report elides the arguments
        )

        image_inputs, _ = process_vision_info(
            messages
        )

        prompt = preprocessor.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=True,
        )

        mm_data = {}
        if image_inputs is not None:
            mm_data["image"] = image_inputs

        llm_inputs = {
            "prompt": prompt,
            "multi_modal_data": mm_data,
        }

        all_inputs.append(llm_inputs)

    if torch.cuda.is_available():   # seed: the CUDA timing calls only where there is CUDA
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.synchronize()

    start = time.time()

    responses = model.generate(all_inputs, sampling_params=sampling_params)

    if torch.cuda.is_available():   # seed: as above
        torch.cuda.synchronize()
    end = time.time()
    elapsed_time = end - start
    elapsed_time_per_workspace = elapsed_time / test_data.height

    elapsed_time_text = f"Elapsed time: {end - start:.4f} sec"
    print(elapsed_time_text)
    return model, all_inputs, responses, elapsed_time_per_workspace


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory) -> str:
    return make_vl_checkpoint(tmp_path_factory.mktemp("seed000_qwen2_5_vl"), "qwen2_5_vl")


def _margins(model_dir, inputs, responses):
    """Per response, each token's distance (nats) below HF float32's best token, teacher-forced on our sequence."""
    from tests.models.test_qwen2_vl import _hf_inputs

    hf, res = hf_vl_model(model_dir), []
    with torch.no_grad():
        for inp, o in zip(inputs, responses):
            full = list(o.prompt_token_ids) + list(o.outputs[0].token_ids[:-1])
            ids, kw = _hf_inputs(model_dir, inp["multi_modal_data"]["image"], full)
            lp = hf(input_ids=ids, **kw).logits[0, len(o.prompt_token_ids) - 1:].float().log_softmax(-1)
            res.append(greedy_margins(lp, list(o.outputs[0].token_ids)))
    return res


def test_seed000_script_runs_and_matches_hf(vl_dir):
    from hayabusa import HayabusaValidationError, SamplingParams

    ids = {}
    for max_num_seqs in (14, 1, 4, 16):       # the report's settings; 16 gave accuracy 0.000 on vLLM
        model, inputs, responses, per_row = run_user_script(vl_dir, max_num_seqs)
        assert per_row > 0
        assert len(responses) == NUM_ROWS                     # no row lost, in input order
        pad = model.get_tokenizer().convert_tokens_to_ids("<|image_pad|>")
        for inp, o in zip(inputs, responses):
            c = o.outputs[0]
            assert o.prompt == inp["prompt"] and o.finished and len(o.outputs) == 1
            assert (len(c.token_ids), c.finish_reason) == (MAX_TOKEN, "length") or (
                c.finish_reason == "stop" and 0 < len(c.token_ids) <= MAX_TOKEN)
            assert o.prompt_token_ids.count(pad) >= len(inp["multi_modal_data"]["image"])   # placeholders expanded
        ids[max_num_seqs] = [list(o.outputs[0].token_ids) for o in responses]
        assert_near_greedy(_margins(vl_dir, inputs, responses))
        if max_num_seqs == 14:
            # one page more than limit_mm_per_prompt: refused by name, the engine serves the next request
            six = dict(inputs[0], multi_modal_data={"image": [random_image(28, 28, 90 + j) for j in range(6)]})
            with pytest.raises(HayabusaValidationError, match="limit_mm_per_prompt") as e:
                model.generate([six], SamplingParams(temperature=0.0, max_tokens=2))
            assert e.value.parameter == "limit_mm_per_prompt"
            del e   # its traceback holds the engine's frames: the next LLM at 0.95 would see this one's memory
        del model
    # greedy output does not depend on the batch size (the report's max_num_seqs=16 failure); on CUDA bf16 GEMMs
    # may pick other tiles per batch size (near-ties only: checked above), so the exact equality is the CPU's
    same = sum(ids[s] == ids[14] for s in (1, 4, 16))
    print(f"seed000: {same} of 3 max_num_seqs settings give max_num_seqs=14's ids exactly")
    if not torch.cuda.is_available():
        assert same == 3, ids
