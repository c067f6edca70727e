"""The runner's multimodal state: per request its images, M-RoPE prompt positions and encoder cache (image
embeddings from the vision tower, kept until the prefill has consumed them); per step the rope positions, the
vision-tower runs (batched across requests; one image per run in batch-invariant mode) and the embedding rows that
replace the image placeholders.

ModelRunner calls ``update`` after applying a SchedulerOutput, ``prepare`` after building a step's host inputs,
and ``StepMultiModal.run`` instead of the plain forward when a step has image rows or 3-D positions.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from hayabusa.attention.metadata import ForwardContext
from hayabusa.core.scheduler_output import SchedulerOutput
from hayabusa.model.vision_attention import host_to_device
from hayabusa.worker.mrope import mrope_prompt_positions


@dataclass
class RequestImages:
    """One request's images as the runner keeps them (across preemption; dropped when it finishes)."""

    images: list                       # ImageInputs, prompt order
    prompt_positions: np.ndarray       # [3, P] int64, M-RoPE positions of the prompt
    rope_delta: int                    # tokens at index p >= P sit at p + rope_delta on every row
    cache: dict[int, torch.Tensor] = field(default_factory=dict)   # image index -> [length, hidden] embeddings


@dataclass
class StepMultiModal:
    """A step's multimodal inputs (device tensors).

    positions: [3, T] int64 M-RoPE positions when a token of the step is an image token, else None (every row
        equals the 1-D positions the runner copies, which already include rope_delta).
    image_dst: [K] int64, step token indices that take an image embedding row; image_rows: [K, hidden].
    """

    positions: torch.Tensor | None = None
    image_dst: torch.Tensor | None = None
    image_rows: torch.Tensor | None = None

    @property
    def graph_safe(self) -> bool:
        """True when the step is an ordinary forward over 1-D positions (a CUDA graph may replay it)."""
        return self.positions is None and self.image_dst is None

    def run(self, model, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """The model's forward with image rows scattered into the input embeddings: hidden [T, hidden]."""
        embeds = None
        if self.image_dst is not None:
            embeds = model.embed_input_ids(input_ids)                   # [T, hidden]
            embeds[self.image_dst] = self.image_rows.to(embeds.dtype)
        return model(input_ids, self.positions if self.positions is not None else positions, ctx,
                     inputs_embeds=embeds)


class MultiModalState:
    """Per-request images and encoder cache of the runner (the model has ``get_image_embeddings``).

    Args:
        model: the multimodal model (``get_image_embeddings``, ``spatial_merge_size``).
        device: where its tensors live.
        batch_invariant: batch-invariant mode (hayabusa/batch_invariant.py): the tower runs one image at a time,
            so an image's embeddings depend on that image alone (every tower op sees the same shapes whatever
            else the step encodes).
    """

    def __init__(self, model, device: torch.device, batch_invariant: bool = False) -> None:
        self.model = model
        self.batch_invariant = batch_invariant
        self.device = device
        self.merge = int(model.spatial_merge_size)
        self.requests: dict[str, RequestImages] = {}

    def profile(self, cfg) -> None:
        """Run the vision tower once at the largest work one step may give it (the encoder budget, or one image
        at the processor's max_pixels if larger), so memory profiling reserves room for it."""
        from hayabusa.multimodal.processor import max_image_tokens

        tokens = max(cfg.scheduler_config.max_num_encoder_input_tokens,
                     max_image_tokens(cfg.model_config.model, self.merge))
        side = int(np.ceil(np.sqrt(tokens)))           # a square image of side x side tokens
        grid = (1, side * self.merge, side * self.merge)
        visual = self.model.visual
        pixels = torch.zeros(grid[1] * grid[2], visual.patch_dim, device=self.device)
        self.model.get_image_embeddings(pixels, [grid])

    def update(self, out: SchedulerOutput) -> None:
        """Drop finished requests; forget preempted requests' embeddings (the tower runs again when they
        resume); register new requests with images."""
        for rid in out.finished_req_ids:
            self.requests.pop(rid, None)
        for rid in out.preempted_req_ids:
            state = self.requests.get(rid)
            if state is not None:
                state.cache.clear()
        for new in out.scheduled_new_reqs:
            if new.mm_inputs:
                pos, delta = mrope_prompt_positions(len(new.prompt_token_ids), new.mm_inputs, self.merge)
                self.requests[new.req_id] = RequestImages(list(new.mm_inputs), pos, delta)

    def prepare(self, out: SchedulerOutput, req_ids: list[str], positions: np.ndarray,
                query_start_loc: np.ndarray, num_computed: list[int]) -> tuple[np.ndarray, StepMultiModal | None]:
        """Run the step's vision-tower work and lay out its multimodal inputs.

        Args:
            out: the step (``scheduled_encoder_inputs``: request id -> image indices to encode now).
            req_ids: the step's requests in batch order; positions: [T] int64 token indices in their sequences;
            query_start_loc: [R + 1] int32; num_computed: each request's num_computed_tokens before the step.
        Returns:
            (rope positions [T] int64 for the 1-D buffer: index + rope_delta past each prompt, the t row inside
            it; the StepMultiModal, or None when no request of the step has images).
        """
        if not self.requests:
            return positions, None
        self._encode(out.scheduled_encoder_inputs)
        R = len(req_ids)
        states = [self.requests.get(rid) for rid in req_ids]
        P = np.fromiter((0 if s is None else s.prompt_positions.shape[1] for s in states), np.int64, count=R)
        delta = np.fromiter((0 if s is None else s.rope_delta for s in states), np.int64, count=R)
        # past its prompt a request's tokens sit at index + rope_delta on every row (decode steps: all of them)
        rope = positions + np.repeat(delta, np.diff(query_start_loc))
        with_images: list[tuple[int, int, np.ndarray]] = []   # (a, b, M-RoPE rows) of requests with image tokens
        dst: list[np.ndarray] = []
        rows: list[torch.Tensor] = []
        for r in np.flatnonzero(np.asarray(num_computed, dtype=np.int64) < P).tolist():   # prompt tokens in step
            state = states[r]
            a, b = int(query_start_loc[r]), int(query_start_loc[r + 1])
            rows3 = self._prompt_rows(state, positions[a:b], a, num_computed[r], rope, dst, rows)
            if rows3 is not None:
                with_images.append((a, b, rows3))
        if not dst:
            return rope, None
        pos3 = np.broadcast_to(rope, (3, len(rope))).copy()        # [3, T]
        for a, b, rows3 in with_images:
            pos3[:, a:b] = rows3
        step = StepMultiModal(positions=host_to_device(pos3, self.device),
                              image_dst=host_to_device(dst, self.device), image_rows=torch.cat(rows))
        return rope, step

    @staticmethod
    def _rows3(state: RequestImages, p: np.ndarray) -> np.ndarray:
        """[3, n] M-RoPE positions of a request's tokens at indices p: the prompt's rows inside it, index +
        rope_delta after it."""
        P = state.prompt_positions.shape[1]
        return np.where(p < P, state.prompt_positions[:, np.minimum(p, P - 1)], p + state.rope_delta)

    def _prompt_rows(self, state: RequestImages, p: np.ndarray, a: int, c: int, rope: np.ndarray,
                     dst: list[np.ndarray], rows: list[torch.Tensor]) -> np.ndarray | None:
        """A request's step tokens p (from step index a, c computed before) that reach into its prompt: their t
        rows into ``rope``, the image embedding rows they take onto ``dst`` / ``rows`` (an image's embeddings
        are freed once the prefill has consumed it). Returns their [3, n] M-RoPE rows when any of them is an
        image token, else None."""
        rows3 = self._rows3(state, p)
        rope[a:a + len(p)] = rows3[0]
        n, touched = len(p), False
        for i, img in enumerate(state.images):
            lo, hi = max(img.offset, c), min(img.end, c + n)
            if lo >= hi:
                continue
            touched = True
            emb = state.cache[i]
            dst.append(np.arange(a + lo - c, a + hi - c, dtype=np.int64))
            rows.append(emb[lo - img.offset:hi - img.offset])
            if hi == img.end:           # the prefill has consumed the whole image: free its embeddings
                del state.cache[i]
        return rows3 if touched else None

    def _encode(self, encoder_inputs: dict[str, list[int]]) -> None:
        """One vision-tower call for every distinct image (by content hash) the step encodes, across requests
        (the n samples of a request share their images); in batch-invariant mode one call per distinct image."""
        todo = [(rid, i) for rid, idx in encoder_inputs.items() for i in idx if rid in self.requests]
        if not todo:
            return
        unique: dict[str, int] = {}          # content hash -> row in the batch
        images = []
        for rid, i in todo:
            img = self.requests[rid].images[i]
            if img.content_hash not in unique:
                unique[img.content_hash] = len(images)
                images.append(img)
        # pinned, non-blocking, already in the tower's dtype (its first op casts to it: the same numbers)
        dtype = self.model.visual.patch_embed.proj.weight.dtype
        calls = [[img] for img in images] if self.batch_invariant else [images]
        embeds = []
        for call in calls:
            pixels = host_to_device([img.pixel_values for img in call], self.device, dtype)
            embeds += self.model.get_image_embeddings(pixels, [img.grid_thw for img in call])
        for rid, i in todo:
            self.requests[rid].cache[i] = embeds[unique[self.requests[rid].images[i].content_hash]]
