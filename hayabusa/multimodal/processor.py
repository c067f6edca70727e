"""MultiModalProcessor: a prompt's ``multi_modal_data`` -> expanded prompt ids + ImageInputs, in add_request (off
the step loop).

Images go through transformers' own image processor of the checkpoint (its resize with min / max pixels,
normalisation and patching); each ``<|image_pad|>`` placeholder of the prompt becomes the image's token count
(t * h * w / merge_size ** 2) copies of itself, as the HF processor does.
"""

from __future__ import annotations

import hashlib
import importlib.util
from dataclasses import dataclass
from typing import Any

import numpy as np

from hayabusa.errors import HayabusaTypeError, HayabusaValidationError
from hayabusa.multimodal.inputs import ImageInput

# vLLM's default limit_mm_per_prompt (V1 engine, vLLM >= 0.10): 999 items per modality
DEFAULT_LIMIT_PER_PROMPT = 999
SUPPORTED_MODALITIES = ("image",)


def _torchvision_usable() -> bool:
    if importlib.util.find_spec("torchvision") is None:
        return False
    try:
        importlib.import_module("torchvision")
    except Exception:  # noqa: BLE001 -- a torchvision built for another torch fails in many ways
        return False
    return True


def load_image_processor(model_dir: str, trust_remote_code: bool = False) -> Any:
    """The checkpoint's image processor (transformers). transformers 5 defaults to its torchvision-backed class;
    without a usable torchvision the PIL-backed ``Qwen2VLImageProcessorPil`` (5.x) or the slow class (4.x) loads
    the same ``preprocessor_config.json``."""
    import transformers
    from transformers import AutoImageProcessor

    if _torchvision_usable():
        return AutoImageProcessor.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    pil_cls = getattr(transformers, "Qwen2VLImageProcessorPil", None)
    if pil_cls is not None:
        return pil_cls.from_pretrained(model_dir)
    return AutoImageProcessor.from_pretrained(model_dir, use_fast=False, trust_remote_code=trust_remote_code)


def max_image_tokens(model_dir: str, merge_size: int) -> int:
    """The most tokens one image can take: the checkpoint's image processor's ``max_pixels`` (5.x:
    ``size.longest_edge``; default Qwen2-VL's 12845056) over (patch * merge) ** 2 pixels per token."""
    import json
    import os

    cfg: dict = {}
    path = os.path.join(model_dir, "preprocessor_config.json")
    if os.path.exists(path):
        with open(path) as f:
            cfg = json.load(f)
    size = cfg.get("size") if isinstance(cfg.get("size"), dict) else {}
    max_pixels = cfg.get("max_pixels") or size.get("longest_edge") or 12845056
    patch = cfg.get("patch_size") or 14
    return max(1, int(max_pixels) // (patch * merge_size) ** 2)


def check_limit_mm_per_prompt(limit: Any) -> dict[str, int]:
    """``limit_mm_per_prompt`` as {modality: int} (None -> {}); unknown modalities or bad counts refused.

    Raises:
        HayabusaValidationError: naming ``limit_mm_per_prompt``.
    """
    if limit is None:
        return {}
    if isinstance(limit, str):   # the command line's JSON
        import json

        try:
            limit = json.loads(limit)
        except ValueError:
            raise HayabusaValidationError(f"limit_mm_per_prompt must be JSON like '{{\"image\": 5}}', got "
                                          f"{limit!r}.", parameter="limit_mm_per_prompt", value=limit) from None
    if not isinstance(limit, dict):
        raise HayabusaValidationError(f"limit_mm_per_prompt must be a dict like {{'image': 5}}, got {limit!r}.",
                                      parameter="limit_mm_per_prompt", value=limit)
    for k, v in limit.items():
        if k not in SUPPORTED_MODALITIES and k != "video":
            raise HayabusaValidationError(f"limit_mm_per_prompt has unknown modality {k!r}; known: image, video.",
                                          parameter="limit_mm_per_prompt", value=limit)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise HayabusaValidationError(f"limit_mm_per_prompt[{k!r}] must be a non-negative integer, got {v!r}.",
                                          parameter="limit_mm_per_prompt", value=limit)
        if k not in SUPPORTED_MODALITIES and v:
            raise HayabusaValidationError(f"limit_mm_per_prompt[{k!r}]={v}: {k} inputs are not supported yet in "
                                          f"hayabusa (only {', '.join(SUPPORTED_MODALITIES)}); leave it out or 0.",
                                          parameter="limit_mm_per_prompt", value=limit)
    return dict(limit)


@dataclass
class ProcessedImages:
    """A prompt's images after the image processor (``MultiModalProcessor.preprocess``), so that the heavy part
    can run on another thread (AsyncLLMEngine) and ``multi_modal_data={"image": ProcessedImages}`` is accepted.

    pixel_values: [sum t * h * w, patch_dim] float32; grids: per image (t, h, w) in patches; hashes: per image,
    the content hash that keys its prefix-cache blocks (``image_hash``), computed where the processor ran.
    """

    pixel_values: np.ndarray
    grids: list[tuple[int, int, int]]
    hashes: list[str] | None = None

    def __post_init__(self) -> None:
        if self.hashes is None:
            self.hashes, row = [], 0
            for grid in self.grids:
                n = grid[0] * grid[1] * grid[2]
                self.hashes.append(image_hash(self.pixel_values[row:row + n], grid))
                row += n


def image_hash(pixel_values: np.ndarray, grid: tuple[int, int, int]) -> str:
    """128-bit BLAKE2b of one image's processed pixels [t * h * w, patch_dim] and its grid: what its prefix-cache
    block keys hold. Hashes the array's buffer in place (no copy; ~20 ms for a 1024 x 768 page), so it runs on the
    preprocessing thread, not the engine's."""
    pv = np.ascontiguousarray(pixel_values)
    h = hashlib.blake2b(memoryview(pv).cast("B"), digest_size=16)
    h.update(np.asarray(grid, dtype=np.int64).tobytes())
    return h.hexdigest()


class MultiModalProcessor:
    """Checks and preprocesses the images of a prompt.

    Args:
        hf_config: the checkpoint's whole HF config (``image_token_id``, ``vision_config.spatial_merge_size``).
        model_dir: the checkpoint folder (its ``preprocessor_config.json``).
        limit_mm_per_prompt: {modality: most items per prompt} (vLLM's meaning); missing modalities get 999.
        trust_remote_code: passed to transformers.
        max_model_len: images whose tokens alone reach it are refused from their sizes, before any resizing.
    """

    def __init__(self, hf_config: Any, model_dir: str, limit_mm_per_prompt: dict[str, int] | None,
                 trust_remote_code: bool = False, max_model_len: int | None = None) -> None:
        self.max_model_len = max_model_len
        self.image_token_id = int(hf_config.image_token_id)
        self.merge_size = int(hf_config.vision_config.spatial_merge_size)
        self.limits = dict(limit_mm_per_prompt or {})
        self.model_dir, self.trust_remote_code = model_dir, trust_remote_code
        self._image_processor = None

    @property
    def image_processor(self) -> Any:
        if self._image_processor is None:   # loaded on first use: text-only engines never pay for it
            self._image_processor = load_image_processor(self.model_dir, self.trust_remote_code)
        return self._image_processor

    @staticmethod
    def parse_images(mm_data: Any) -> list:
        """``multi_modal_data`` -> a list of images (PIL images or HWC uint8 numpy arrays); [] when it has none.

        Raises:
            HayabusaTypeError / HayabusaValidationError: naming ``multi_modal_data``.
        """
        if mm_data is None:
            return []
        if not isinstance(mm_data, dict):
            raise HayabusaTypeError(f"multi_modal_data must be a dict like {{'image': [...]}}, got "
                                    f"{type(mm_data).__name__}.", parameter="multi_modal_data",
                                    value=type(mm_data).__name__)
        unknown = sorted(set(mm_data) - set(SUPPORTED_MODALITIES))
        if unknown:
            raise HayabusaValidationError(f"multi_modal_data has unsupported modality {unknown}; supported: "
                                          f"{', '.join(SUPPORTED_MODALITIES)}.", parameter="multi_modal_data",
                                          value=unknown)
        images = mm_data.get("image")
        if images is None:
            return []
        if isinstance(images, ProcessedImages):
            return images
        if not isinstance(images, (list, tuple)):
            images = [images]
        from PIL import Image

        for i, im in enumerate(images):
            ok = isinstance(im, Image.Image) or (isinstance(im, np.ndarray) and im.ndim in (2, 3)
                                                 and im.dtype == np.uint8)
            if not ok:
                raise HayabusaTypeError(
                    f"multi_modal_data['image'][{i}] must be a PIL image or an HWC uint8 numpy array, got "
                    f"{type(im).__name__}{'' if not isinstance(im, np.ndarray) else f' {im.dtype} {im.shape}'}.",
                    parameter="multi_modal_data", value=type(im).__name__)
            if isinstance(im, np.ndarray) and (im.ndim != 3 or im.shape[2] != 3):
                raise HayabusaValidationError(
                    f"multi_modal_data['image'][{i}] has shape {im.shape}: a numpy image is HWC RGB (height, width, "
                    "3). Pass a grayscale or RGBA image as a PIL image (the processor converts it to RGB), and "
                    "transpose a CHW array with .transpose(1, 2, 0).", parameter="multi_modal_data",
                    value=tuple(im.shape))
            size = im.size if isinstance(im, Image.Image) else (im.shape[1], im.shape[0])
            if min(size) < 1:
                raise HayabusaValidationError(f"multi_modal_data['image'][{i}] is empty ({size[0]} x {size[1]}).",
                                              parameter="multi_modal_data", value=size)
        return list(images)

    def preprocess(self, images: list | ProcessedImages) -> ProcessedImages:
        """The image processor over all of a prompt's images (one batched call); thread-safe.

        Raises:
            HayabusaValidationError: more images than ``limit_mm_per_prompt``.
        """
        if isinstance(images, ProcessedImages):
            return images
        self.check_limit(len(images))
        if self.max_model_len is not None:   # from the sizes alone: a huge image costs seconds to resize
            tokens = self.num_image_tokens(images)
            if sum(tokens) >= self.max_model_len:
                raise HayabusaValidationError(
                    f"the prompt's {len(images)} image(s) take {sum(tokens)} tokens ({tokens}) at the image "
                    f"processor's resolution, which leaves no room in max_model_len={self.max_model_len}; send "
                    "smaller or fewer images, or raise max_model_len.", parameter="multi_modal_data",
                    value=sum(tokens))
        try:
            # "pt": the one tensor type both the PIL-backed and the torchvision-backed processors return
            out = self.image_processor(images=images, return_tensors="pt")
        except (ValueError, TypeError) as e:
            raise HayabusaValidationError(f"the image processor refused the prompt's images: {e}",
                                          parameter="multi_modal_data", value=len(images)) from None
        return ProcessedImages(out["pixel_values"].float().cpu().numpy(),
                               [tuple(int(x) for x in g) for g in out["image_grid_thw"].tolist()])

    def num_image_tokens(self, images: list) -> list[int]:
        """Tokens each image will take, from its size alone (transformers' ``get_number_of_image_patches`` of the
        checkpoint's processor: its resize rule, min / max pixels), without resizing anything.

        Raises:
            HayabusaValidationError: an image the processor's resize rule refuses (e.g. an aspect ratio over 200),
                naming ``multi_modal_data`` and the image's index. ([] when the processor cannot count.)
        """
        proc = self.image_processor
        if not hasattr(proc, "get_number_of_image_patches"):   # an older processor class: no early count
            return []
        out = []
        for i, im in enumerate(images):
            w, h = im.size if hasattr(im, "size") and not isinstance(im, np.ndarray) else (im.shape[1], im.shape[0])
            try:
                out.append(int(proc.get_number_of_image_patches(h, w)) // self.merge_size ** 2)
            except ValueError as e:
                raise HayabusaValidationError(f"multi_modal_data['image'][{i}] ({w} x {h}) is refused by the image "
                                              f"processor: {e}", parameter="multi_modal_data", value=[w, h]) from None
        return out

    def check_limit(self, num_images: int) -> None:
        limit = self.limits.get("image", DEFAULT_LIMIT_PER_PROMPT)
        if num_images > limit:
            raise HayabusaValidationError(
                f"the prompt has {num_images} images, more than limit_mm_per_prompt={{'image': {limit}}} allows; "
                "send fewer images or raise the engine argument limit_mm_per_prompt.",
                parameter="limit_mm_per_prompt", value=num_images)

    def process(self, prompt_ids: list[int], images: list) -> tuple[list[int], list[ImageInput]]:
        """Expand the prompt's image placeholders and preprocess the images (one batched processor call).

        Args:
            prompt_ids: the tokenized prompt with one run of ``<|image_pad|>`` per image, in image order: a single
                token (as the chat template writes it; expanded here), or already the image's token count (as
                the HF processor's ``input_ids`` have it; kept).
            images: the images (``parse_images``), or already ``preprocess``-ed.
        Returns:
            (expanded prompt ids, one ImageInput per image in prompt order).
        Raises:
            HayabusaValidationError: more images than ``limit_mm_per_prompt``, or placeholders that do not match
                the images (their number, or a run whose length is neither 1 nor the image's token count)
                (``multi_modal_data``).
        """
        num_images = len(images.grids) if isinstance(images, ProcessedImages) else len(images)
        self.check_limit(num_images)
        runs = self._placeholder_runs(prompt_ids)        # [(start, length)] of consecutive <|image_pad|>
        if len(runs) != num_images:
            raise HayabusaValidationError(
                f"the prompt has {len(runs)} image placeholder(s) (<|image_pad|>, token id {self.image_token_id}) "
                f"but multi_modal_data has {num_images} image(s); put one "
                "<|vision_start|><|image_pad|><|vision_end|> per image in the prompt (the chat template does).",
                parameter="multi_modal_data", value=num_images)
        if not num_images:
            return prompt_ids, []
        processed = self.preprocess(images)
        pixels, grids, hashes = processed.pixel_values, processed.grids, processed.hashes
        unit = self.merge_size ** 2
        ids: list[int] = []
        inputs: list[ImageInput] = []
        prev, row = 0, 0
        for k, ((start, run), grid) in enumerate(zip(runs, grids)):
            n_patch = grid[0] * grid[1] * grid[2]
            length = n_patch // unit
            if run not in (1, length):
                raise HayabusaValidationError(
                    f"image {k} has {run} <|image_pad|> tokens in the prompt; it takes {length} (write one "
                    "placeholder per image and hayabusa expands it, or exactly its token count).",
                    parameter="multi_modal_data", value=run)
            pv = pixels[row:row + n_patch]          # a view: rows of a C-contiguous array
            row += n_patch
            ids.extend(prompt_ids[prev:start])
            inputs.append(ImageInput(pv, grid, len(ids), length, hashes[k]))
            ids.extend([self.image_token_id] * length)
            prev = start + run
        ids.extend(prompt_ids[prev:])
        return ids, inputs

    def _placeholder_runs(self, ids: list[int]) -> list[tuple[int, int]]:
        arr = np.asarray(ids, dtype=np.int64) == self.image_token_id
        if not arr.any():
            return []
        edges = np.flatnonzero(np.diff(np.concatenate([[0], arr.astype(np.int8), [0]])))   # starts, ends
        return [(int(a), int(b - a)) for a, b in zip(edges[::2], edges[1::2])]


def preprocess_prompt_images(mm_processor: MultiModalProcessor | None, prompt: Any) -> Any:
    """``prompt`` with its ``multi_modal_data`` images run through the image processor (a new dict; any other
    prompt unchanged), for callers that do this heavy part on their own thread (AsyncLLMEngine.add_request);
    the engine's add_request then only expands placeholders. Bad input is left for add_request to refuse."""
    if mm_processor is None or not isinstance(prompt, dict) or not prompt.get("multi_modal_data"):
        return prompt
    try:
        images = mm_processor.parse_images(prompt["multi_modal_data"])
        if not images or isinstance(images, ProcessedImages):
            return prompt
        processed = mm_processor.preprocess(images)
    except HayabusaValidationError:
        return prompt
    return {**prompt, "multi_modal_data": {**prompt["multi_modal_data"], "image": processed}}


class PreprocessStream:
    """``preprocess_prompt_images`` over a batch of prompts on a background thread pool (the image processors'
    resize and normalisation release the GIL), handed back in prompt order as each is ready, so ``LLM.generate``
    queues the first prompts and the GPU starts while later pages are still being processed (issue #16's W8: 338
    page images took ~9 s of processing on the H200 box's CPU before the first step when done all up front).

    Prompts without images are ready at once. ``take(block)`` returns the next ready prompts in order as
    ``(index, prompt)`` pairs; with ``block`` it waits for at least one (when nothing else can run). ``close()``
    cancels what has not started. Use as a context manager."""

    def __init__(self, mm_processor: MultiModalProcessor | None, prompts: list, max_workers: int = 8) -> None:
        self.prompts = prompts
        self._next = 0
        self._futures: dict[int, Any] = {}
        self._pool = None
        with_images = [i for i, p in enumerate(prompts) if isinstance(p, dict) and p.get("multi_modal_data")]
        if mm_processor is None or not with_images:
            return
        import concurrent.futures
        import os

        mm_processor.image_processor            # loaded once, before the threads
        workers = min(max_workers, os.cpu_count() or 1, len(with_images))
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="hayabusa-images")
        for i in with_images:
            self._futures[i] = self._pool.submit(preprocess_prompt_images, mm_processor, prompts[i])

    @property
    def done(self) -> bool:
        """True when every prompt has been handed out."""
        return self._next >= len(self.prompts)

    def take(self, block: bool = False) -> list[tuple[int, Any]]:
        """The next prompts, in order, whose images are processed; waits for one when ``block`` is set."""
        out: list[tuple[int, Any]] = []
        while self._next < len(self.prompts):
            fut = self._futures.get(self._next)
            if fut is not None and not fut.done() and not (block and not out):
                break
            out.append((self._next, fut.result() if fut is not None else self.prompts[self._next]))
            self._next += 1
        return out

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def __enter__(self) -> "PreprocessStream":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def make_mm_processor(model_config: Any) -> MultiModalProcessor | None:
    """The engine's MultiModalProcessor for a model with a vision tower (``ModelConfig.multimodal_config``), else
    None (then ``limit_mm_per_prompt`` must not be given)."""
    if model_config.multimodal_config is None:
        if model_config.limit_mm_per_prompt:
            raise HayabusaValidationError(
                f"limit_mm_per_prompt was given but model {model_config.architecture} takes text only.",
                parameter="limit_mm_per_prompt", value=model_config.limit_mm_per_prompt)
        return None
    return MultiModalProcessor(model_config.multimodal_config, model_config.model,
                               model_config.limit_mm_per_prompt, model_config.trust_remote_code,
                               max_model_len=model_config.max_model_len)
