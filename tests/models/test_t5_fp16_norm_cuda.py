"""On a GPU: T5 fp16's fused residual add + clamp + T5LayerNorm (``kernels/t5_fp16_norm.py``, issue #17).

1. The kernel against ``model/t5.py``'s torch path (``_add_norm`` with the switch off) on the cases of
   ``tests/kernels/test_t5_fp16_norm.py``: the residual bit for bit, normed within one fp16 ulp before the weight.
2. The kernel inside a CUDA graph: replays with an inf present, then absent, then present, each equal to the torch
   path (the device flag and counter reset themselves; no host sync in the graph).
3. The engine: greedy ids of tiny T5 v1.0 and v1.1 checkpoints in fp16 on CUDA (graphs on, and eager) with the
   kernel on equal those with it off (``HAYABUSA_T5_FP16_FUSED_NORM=0``'s path); also with FFN outputs past fp16's
   range (the fp32 residual stream)."""

from __future__ import annotations

import gc

import pytest
import torch

from tests.kernels.test_t5_fp16_norm import CASES, SHAPES, check_case, make_inputs, torch_path, \
    within_one_ulp_before_the_weight
from tests.models._t5 import T5_EN_PROMPTS, T5_JA_PROMPTS, save_tiny_t5

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

LONG = "Receipt: " + " ".join(f"item{i} ¥{100 + i * 7}" for i in range(20)) + " 合計 ¥9,999"
PROMPTS = (T5_EN_PROMPTS + T5_JA_PROMPTS + [LONG, "a"]) * 3      # 21 requests: decode batches of several sizes


@pytest.mark.parametrize("T,d", SHAPES + [(4096, 768), (8192, 512)])
@pytest.mark.parametrize("case", CASES)
def test_kernel_matches_the_torch_path_on_cuda(case, T, d):
    check_case(case, T, d, "cuda")


def test_kernel_in_a_cuda_graph_inf_present_then_absent():
    from hayabusa.kernels.t5_fp16_norm import _SYNC, reserve_t5_fp16_norm_sync, t5_fp16_add_norm

    reserve_t5_fp16_norm_sync("cuda")
    T, d, eps = 257, 768, 1e-6
    inputs = {case: make_inputs(case, T, d, "cuda") for case in ("fp16_inf", "fp16_no_inf")}
    delta, residual, weight = (t.clone() for t in inputs["fp16_no_inf"])
    t5_fp16_add_norm(delta, residual, weight, eps)                 # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, res = t5_fp16_add_norm(delta, residual, weight, eps)
    for case in ("fp16_inf", "fp16_no_inf", "fp16_inf", "fp16_inf", "fp16_no_inf"):
        d_in, r_in, _ = inputs[case]
        delta.copy_(d_in)
        residual.copy_(r_in)
        graph.replay()
        torch.cuda.synchronize()
        ref_out, ref_res = torch_path(delta, residual, weight, eps)
        assert torch.equal(res.nan_to_num(0.0), ref_res.nan_to_num(0.0)), case
        assert bool(within_one_ulp_before_the_weight(out, res, weight, eps).all()), case
        assert float(res[T // 2, 0]) == (64512.0 if case == "fp16_inf" else 64992.0)
        assert all(s.tolist() == [0, 0] for s in _SYNC.values())


def _greedy(model_dir: str, fused: bool, enforce_eager: bool, monkeypatch) -> list[list[int]]:
    from hayabusa import LLM, SamplingParams
    from hayabusa.kernels import t5_fp16_norm
    from hayabusa.model import t5

    monkeypatch.setattr(t5, "USE_FP16_FUSED_NORM", fused)
    calls = []
    real = t5.t5_fp16_add_norm
    monkeypatch.setattr(t5, "t5_fp16_add_norm", lambda *a: calls.append(1) or real(*a))
    llm = LLM(model_dir, device="cuda", dtype="float16", max_num_seqs=8, max_model_len=256,
              enforce_eager=enforce_eager)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    if not enforce_eager:
        assert llm.llm_engine.runner.graphs is not None and llm.llm_engine.runner.graphs.graphs
    assert bool(calls) == fused                          # the kernel ran (eager and while capturing) or never did
    assert all(s.tolist() == [0, 0] for s in t5_fp16_norm._SYNC.values())
    ids = [list(o.outputs[0].token_ids) for o in outs]
    del llm, outs
    gc.collect()
    torch.cuda.empty_cache()
    return ids


def _first_difference(on: list[list[int]], off: list[list[int]]) -> str:
    diff = [(i, next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)) for i, (a, b) in enumerate(zip(on, off))
            if a != b]
    return f"{len(diff)} of {len(on)} requests differ; (request, first differing position): {diff}"


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
@pytest.mark.parametrize("version", ["v1.0", "v1.1"])
def test_greedy_ids_with_the_kernel_equal_those_without(version, enforce_eager, tmp_path, monkeypatch):
    model_dir = save_tiny_t5(tmp_path, version, initializer_factor=1.0)
    on = _greedy(model_dir, True, enforce_eager, monkeypatch)
    off = _greedy(model_dir, False, enforce_eager, monkeypatch)
    assert all(len(ids) == 24 for ids in on)
    assert on == off, _first_difference(on, off)


def test_greedy_ids_equal_where_the_ffn_overflows(tmp_path, monkeypatch):
    """FFN outputs past fp16's range (wo x 30000, as tests/models/test_t5_cuda.py): the fp32 residual stream."""
    from safetensors.torch import load_file, save_file

    model_dir = save_tiny_t5(tmp_path, "v1.1", num_decoder_layers=2, initializer_factor=1.0)
    path = tmp_path / "model.safetensors"
    sd = load_file(str(path))
    save_file({k: v * 30000 if "DenseReluDense.wo" in k else v for k, v in sd.items()}, str(path),
              metadata={"format": "pt"})
    on, off = _greedy(model_dir, True, False, monkeypatch), _greedy(model_dir, False, False, monkeypatch)
    assert on == off, _first_difference(on, off)
