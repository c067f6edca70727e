"""MultiModalState.prepare (worker/mm_inputs.py) on hand-built steps: the rope positions of every request (prompt
rows from ``mrope_prompt_positions`` inside the prompt, index + rope_delta past it, plain index without images), the
[3, T] positions and image rows of a step with image tokens, none for a decode step; and ``host_to_device``'s
concatenation and dtype conversion. A fake model (its "tower" returns rows of the pixels), CPU, no checkpoint."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from hayabusa.model.qwen2_vl import host_to_device
from hayabusa.multimodal.inputs import ImageInput
from hayabusa.worker.mm_inputs import MultiModalState
from hayabusa.worker.mrope import mrope_prompt_positions

MERGE, PATCH_DIM, HIDDEN = 2, 12, 8


class FakeVL:
    """The tower's interface: image i's embedding row j = its pixel row 4 j, first HIDDEN columns."""

    spatial_merge_size = MERGE

    def __init__(self) -> None:
        self.visual = SimpleNamespace(patch_embed=SimpleNamespace(proj=SimpleNamespace(weight=torch.zeros(1))),
                                      patch_dim=PATCH_DIM)
        self.calls: list[list] = []

    def get_image_embeddings(self, pixels: torch.Tensor, grids) -> list[torch.Tensor]:
        self.calls.append([tuple(g) for g in grids])
        rows = pixels[::MERGE * MERGE, :HIDDEN]
        return list(rows.split([t * h * w // MERGE ** 2 for t, h, w in grids]))


def _image(grid, offset, seed):
    n = grid[0] * grid[1] * grid[2]
    pv = np.random.default_rng(seed).standard_normal((n, PATCH_DIM)).astype(np.float32)
    return ImageInput(pv, grid, offset, n // MERGE ** 2, f"hash{seed}")


def _new(rid, P, images):
    return SimpleNamespace(req_id=rid, prompt_token_ids=list(range(P)), mm_inputs=images)


def _out(new=(), encode=None):
    return SimpleNamespace(finished_req_ids=set(), preempted_req_ids=set(), scheduled_new_reqs=list(new),
                           scheduled_encoder_inputs=encode or {})


def _step(mm, out, chunks):
    """chunks: (request id, num_computed, num_scheduled) in batch order -> (positions, prepare's result)."""
    qsl = np.zeros(len(chunks) + 1, dtype=np.int32)
    qsl[1:] = np.cumsum([n for _, _, n in chunks])
    positions = np.concatenate([np.arange(c, c + n) for _, c, n in chunks]).astype(np.int64)
    return positions, mm.prepare(out, [r for r, _, _ in chunks], positions, qsl, [c for _, c, _ in chunks])


def test_prepare_positions_and_image_rows():
    a_imgs = [_image((1, 4, 6), 3, 0), _image((1, 2, 4), 12, 1)]     # 6 tokens at 3..8, 2 at 12..13; P = 20
    c_imgs = [_image((1, 4, 4), 2, 2)]                                # 4 tokens at 2..5; P = 10
    mm = MultiModalState(FakeVL(), torch.device("cpu"))
    mm.update(_out([_new("a", 20, a_imgs), _new("c", 10, c_imgs)]))
    pos_a, delta_a = mrope_prompt_positions(20, a_imgs, MERGE)
    pos_c, delta_c = mrope_prompt_positions(10, c_imgs, MERGE)
    assert delta_a == -3 and delta_c == -2   # a: 6 tokens on 3 positions, 2 on 2; c: 4 tokens on 2 positions
    # step 1: a's first 12 prompt tokens (image 0 encoded), b (no images) at 7..11, c decoding at 10
    positions, (rope, step) = _step(mm, _out(encode={"a": [0]}), [("a", 0, 12), ("b", 7, 5), ("c", 10, 1)])
    assert mm.model.calls == [[(1, 4, 6)]]
    np.testing.assert_array_equal(rope, np.concatenate([pos_a[0, :12], np.arange(7, 12), [10 + delta_c]]))
    expected3 = np.broadcast_to(rope, (3, 18)).copy()
    expected3[:, :12] = pos_a[:, :12]
    np.testing.assert_array_equal(step.positions.numpy(), expected3)
    np.testing.assert_array_equal(step.image_dst.numpy(), np.arange(3, 9))
    torch.testing.assert_close(step.image_rows, torch.from_numpy(a_imgs[0].pixel_values[::4, :HIDDEN]),
                               rtol=0, atol=0)
    assert list(mm.requests["a"].cache) == []       # image 0 consumed whole: its embeddings freed
    # step 2: the rest of a's prompt (image 1 encoded) after c and b
    positions, (rope, step) = _step(mm, _out(encode={"a": [1]}), [("c", 11, 1), ("b", 12, 1), ("a", 12, 8)])
    np.testing.assert_array_equal(rope, np.concatenate([[11 + delta_c, 12], pos_a[0, 12:]]))
    np.testing.assert_array_equal(step.positions.numpy()[:, 2:], pos_a[:, 12:])
    np.testing.assert_array_equal(step.image_dst.numpy(), [2, 3])
    torch.testing.assert_close(step.image_rows, torch.from_numpy(a_imgs[1].pixel_values[::4, :HIDDEN]),
                               rtol=0, atol=0)
    # step 3: every request decodes: 1-D positions only (a CUDA graph may replay it)
    positions, (rope, step) = _step(mm, _out(), [("a", 20, 1), ("b", 13, 1), ("c", 12, 1)])
    assert step is None and mm.model.calls == [[(1, 4, 6)], [(1, 2, 4)]]
    np.testing.assert_array_equal(rope, [20 + delta_a, 13, 12 + delta_c])
    assert pos_a[:, -1].max() + 1 == 20 + delta_a  # the first output sits one past the prompt's largest position


def test_prepare_without_images_returns_positions():
    mm = MultiModalState(FakeVL(), torch.device("cpu"))
    positions, (rope, step) = _step(mm, _out(), [("x", 0, 3), ("y", 5, 1)])
    assert rope is positions and step is None


def test_host_to_device_concatenates_and_converts():
    parts = [np.linspace(-3, 3, 12, dtype=np.float32).reshape(4, 3) * 1.001, np.full((2, 3), 1 / 3, np.float32)]
    out = host_to_device(parts, torch.device("cpu"), torch.bfloat16)
    assert out.dtype == torch.bfloat16 and out.shape == (6, 3)
    assert torch.equal(out, torch.from_numpy(np.concatenate(parts)).to(torch.bfloat16))
    one = host_to_device(np.arange(5), torch.device("cpu"))
    assert one.dtype == torch.int64 and one.tolist() == [0, 1, 2, 3, 4]
