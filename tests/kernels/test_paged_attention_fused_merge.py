"""The fused split-KV merge (paged_attention.FUSED_MERGE, HAYABUSA_ATTN_FUSED_MERGE): each tile's last split program
merges the partials instead of _merge_splits_kernel. Its output must equal the two-kernel path's bit for bit (both
run _merge_partials: splits summed in order), match paged_attention_ref within TOL, and leave every counter at zero
(the next launch, or a CUDA-graph replay, reuses the buffer unzeroed).

Cases come from test_paged_attention.make_case (shuffled block table with holes, NaN in unowned cache slots, q a
strided view, padding tokens). Contexts range from one key (seq_len 1) to three 128-key tiles, so with up to 8 splits
many splits hold no key at all (m = -inf, weight 0) and each tile's counter still reaches NUM_SPLITS.
"""

import pytest
import torch

from hayabusa.kernels import paged_attention as pa
from hayabusa.kernels.fp8 import quantize_fp8_ref
from hayabusa.kernels.paged_attention import paged_attention, paged_attention_ref, split_counters
from tests.kernels.test_paged_attention import SENTINEL, TOL, make_case

# (cached, new): contexts of 1 to 261 keys, an empty row (seq_len 0), one context shorter than a split
DECODE = [(260, 1), (0, 0), (5, 1), (130, 1), (0, 1), (40, 1)]
# verify-step rows of 2-5 tokens next to a plain decode row; (3, 5): 8 keys, every split but the first empty
SHORT = [(260, 5), (3, 5), (130, 4), (0, 0), (90, 1), (40, 2)]
HEADS = {1: (2, 2), 7: (14, 2)}   # GQA group -> (H, H_kv)


def _out(case: dict) -> torch.Tensor:
    return torch.full(case["q"].shape, SENTINEL, dtype=case["q"].dtype, device=case["q"].device)


def _run(case: dict, fused: bool, monkeypatch, **kwargs) -> torch.Tensor:
    monkeypatch.setattr(pa, "FUSED_MERGE", fused)
    out = _out(case)
    paged_attention(out=out, **case, **kwargs)
    return out


def check_fused(case: dict, monkeypatch, **kwargs) -> None:
    """Fused == two-kernel bit for bit, twice on the same counter buffer (zero after each call); both within TOL
    of the reference; padding rows untouched."""
    monkeypatch.setattr(pa, "_COUNTERS", {})
    two_kernel = _run(case, False, monkeypatch, **kwargs)
    assert not pa._COUNTERS                                  # the default path allocates no counters
    device = torch.device(case["q"].device)
    for _ in range(2):
        fused = _run(case, True, monkeypatch, **kwargs)
        assert torch.equal(fused, two_kernel)
        counters = pa._COUNTERS[device]
        assert counters.numel() >= 1 and not counters.any()
    ref = _out(case)
    paged_attention_ref(out=ref, **case, **kwargs)
    atol, rtol = TOL[case["q"].dtype]
    valid = int(case["query_start_loc"][-1])
    torch.testing.assert_close(fused[:valid].float(), ref[:valid].float(), atol=atol, rtol=rtol)
    assert torch.isfinite(fused[:valid].float()).all() and (fused[valid:] == SENTINEL).all()


@pytest.mark.parametrize("num_kv_splits", [2, 3, 4, 8])
@pytest.mark.parametrize("reqs", [DECODE, SHORT], ids=["decode", "short_query"])
@pytest.mark.parametrize("group", sorted(HEADS))
def test_fused_merge_equals_two_kernels(device, num_kv_splits, reqs, group, monkeypatch):
    H, H_kv = HEADS[group]
    case = make_case(reqs, H, H_kv, 64, 16, torch.float32, device, seed=num_kv_splits + group)
    assert case["max_query_len"] == (1 if reqs is DECODE else 5)
    check_fused(case, monkeypatch, num_kv_splits=num_kv_splits)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("reqs", [DECODE, SHORT], ids=["decode", "short_query"])
def test_fused_merge_model_dtypes(device, dtype, reqs, monkeypatch):
    """fp16 / bf16 at Qwen2.5-7B's group (7) and head dim (128), block size 32; a row with queries but seq_len 0
    (skipped before its counter: its tile is never counted)."""
    case = make_case(reqs, 14, 2, 128, 32, dtype, device, seed=5)
    case["seq_lens"][2] = 0
    check_fused(case, monkeypatch, num_kv_splits=3)


def test_fused_merge_wide_short_query_tile(device, monkeypatch):
    """The 64-row short-query tile (group 7 x 5 tokens) with a sliding window and a soft-cap."""
    monkeypatch.setattr(pa, "SHORT_QUERY_WIDE_MAX_PROGRAMS", 1 << 30)
    case = make_case(SHORT, 14, 2, 64, 16, torch.float32, device, seed=9, q_mult=4.0)
    check_fused(case, monkeypatch, num_kv_splits=4, sliding_window=50, softcap=5.0)


@pytest.mark.parametrize("reqs", [DECODE, SHORT], ids=["decode", "short_query"])
def test_fused_merge_fp8_cache(device, reqs, monkeypatch):
    """An e4m3 cache with scales != 1: v_scale multiplies each split's accumulator before it is stored."""
    case = make_case(reqs, 14, 2, 64, 16, torch.float32, device, seed=13)
    k_scale, v_scale = 0.05, 4.0
    case.update(q=case["q"].half(), k_cache=quantize_fp8_ref(3.0 * case["k_cache"], k_scale, torch.float8_e4m3fn),
                v_cache=quantize_fp8_ref(case["v_cache"], v_scale, torch.float8_e4m3fn),
                k_scale=torch.tensor([k_scale], device=device), v_scale=torch.tensor([v_scale], device=device))
    check_fused(case, monkeypatch, num_kv_splits=3)


def test_fused_merge_graph_padding(device, monkeypatch):
    """A padded graph batch: max_query_len above every row's, trailing rows without queries (never counted)."""
    case = make_case(SHORT + [(0, 0), (0, 0)], 14, 2, 64, 16, torch.float32, device, seed=11)
    case["max_query_len"] = 8
    check_fused(case, monkeypatch, num_kv_splits=4)


def test_unsplit_and_batch_invariant_steps_use_no_counters(device, monkeypatch):
    """FUSED_MERGE changes only split steps: one pass, and batch-invariant mode (never split), take no counters."""
    monkeypatch.setattr(pa, "_COUNTERS", {})
    case = make_case(DECODE, 14, 2, 64, 16, torch.float32, device, seed=2)
    off = _run(case, False, monkeypatch, num_kv_splits=1)
    assert torch.equal(_run(case, True, monkeypatch, num_kv_splits=1), off)
    bi = _run(case, False, monkeypatch, batch_invariant=True, num_kv_splits=4)
    assert torch.equal(_run(case, True, monkeypatch, batch_invariant=True, num_kv_splits=4), bi)
    assert not pa._COUNTERS


def test_split_counters_grow_and_keep_old_buffers(monkeypatch):
    """At least _MIN_COUNTERS zeros; a larger need allocates a new buffer and keeps the old one alive (a CUDA
    graph captured with it still points at it); a smaller need reuses the current one."""
    monkeypatch.setattr(pa, "_COUNTERS", {})
    monkeypatch.setattr(pa, "_RETIRED_COUNTERS", [])
    cpu = torch.device("cpu")
    first = split_counters(cpu, 3)
    assert first.dtype == torch.int32 and first.numel() == pa._MIN_COUNTERS and not first.any()
    assert split_counters(cpu, pa._MIN_COUNTERS) is first
    bigger = split_counters(cpu, pa._MIN_COUNTERS + 1)
    assert bigger.numel() == pa._MIN_COUNTERS + 1 and not bigger.any()
    assert pa._RETIRED_COUNTERS == [first] and split_counters(cpu, 5) is bigger


def test_switch_is_listed():
    from hayabusa.envs import SWITCHES

    assert "HAYABUSA_ATTN_FUSED_MERGE" in SWITCHES and pa.FUSED_MERGE in (True, False)
