"""The VL step's host -> device copies on CUDA (run on the device): ``host_to_device`` gives the same values as a
plain copy (float32 pixels converted to bf16 on the host, int64 indices), and a step with images (the vision
tower and MultiModalState.prepare) makes no synchronizing call (no pageable blocking copy, no .item()), so the
engine's launch does not wait for the device; the tower gives the same features from bf16 pixels as from
float32 ones (its first op casts them)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from hayabusa.model.qwen2_vl import VisionTransformer, host_to_device
from hayabusa.multimodal.inputs import ImageInput
from hayabusa.worker.mm_inputs import MultiModalState

pytestmark = pytest.mark.cuda

VISION = SimpleNamespace(hidden_size=64, intermediate_size=96, num_heads=4, depth=4, patch_size=14,
                         spatial_merge_size=2, temporal_patch_size=2, window_size=112, fullatt_block_indexes=[1, 3],
                         hidden_act="silu", in_channels=3, out_hidden_size=32)
GRIDS = [(1, 12, 20), (1, 8, 6), (1, 16, 10)]


class TowerOnly:
    """The model interface MultiModalState needs, over a real Qwen2.5-VL vision tower."""

    spatial_merge_size = 2

    def __init__(self, visual: VisionTransformer) -> None:
        self.visual = visual

    def get_image_embeddings(self, pixels, grids):
        return list(self.visual(pixels, grids).split([t * h * w // 4 for t, h, w in grids]))


def _tower() -> VisionTransformer:
    torch.manual_seed(0)
    vt = VisionTransformer(VISION, 32, True, torch.bfloat16, torch.device("cuda"))
    for p in vt.parameters():
        torch.nn.init.normal_(p, std=0.1)
    return vt


def _pixels(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 3 * 2 * 14 * 14)).astype(np.float32)


def test_host_to_device_values():
    parts = [_pixels(0, 40), _pixels(1, 24)]
    out = host_to_device(parts, torch.device("cuda"), torch.bfloat16)
    ref = torch.from_numpy(np.concatenate(parts)).cuda().to(torch.bfloat16)
    assert out.is_cuda and out.dtype == torch.bfloat16 and torch.equal(out, ref)
    idx = host_to_device(np.arange(7, dtype=np.int64), torch.device("cuda"))
    assert idx.dtype == torch.int64 and idx.tolist() == list(range(7))


def test_tower_same_features_from_bf16_pixels():
    vt = _tower()
    px = np.concatenate([_pixels(i, t * h * w) for i, (t, h, w) in enumerate(GRIDS)])
    with torch.inference_mode():
        a = vt(torch.from_numpy(px).cuda(), GRIDS)
        b = vt(host_to_device(px, torch.device("cuda"), torch.bfloat16), GRIDS)
    assert torch.equal(a, b)


def test_image_step_makes_no_synchronizing_call():
    mm = MultiModalState(TowerOnly(_tower()), torch.device("cuda"))
    images, offset = [], 4
    for i, (t, h, w) in enumerate(GRIDS):
        images.append(ImageInput(_pixels(i, t * h * w), (t, h, w), offset, t * h * w // 4, f"h{i}"))
        offset += t * h * w // 4 + 3
    P = offset + 5
    new = SimpleNamespace(req_id="a", prompt_token_ids=list(range(P)), mm_inputs=images)
    mm.update(SimpleNamespace(finished_req_ids=set(), preempted_req_ids=set(), scheduled_new_reqs=[new]))
    out = SimpleNamespace(scheduled_encoder_inputs={"a": [0, 1, 2]})
    positions = np.arange(P, dtype=np.int64)
    qsl = np.array([0, P], dtype=np.int32)
    with torch.inference_mode():
        # warm-up (kernel compiles, handles): the tower once, and a chunk without image tokens
        mm.model.get_image_embeddings(torch.from_numpy(np.concatenate([img.pixel_values for img in images]))
                                      .cuda().to(torch.bfloat16), GRIDS)
        mm.prepare(SimpleNamespace(scheduled_encoder_inputs={}), ["a"], positions[:1], np.array([0, 1], np.int32),
                   [0])
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            rope, step = mm.prepare(out, ["a"], positions, qsl, [0])
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert step is not None and step.image_rows.shape == (sum(img.length for img in images), 32)
    assert step.image_dst.tolist() == [i for img in images for i in range(img.offset, img.end)]
    assert step.positions.shape == (3, P) and step.positions[0].cpu().numpy().tolist() == rope.tolist()
