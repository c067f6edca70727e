"""ImageInput: one preprocessed image of a request, as plain data (numpy; it pickles)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class ImageInput:
    """One image of a prompt, preprocessed, and where its placeholder tokens sit in the prompt.

    Attributes:
        pixel_values: [t * h * w, C * temporal_patch * patch * patch] float32, the image processor's patches.
        grid_thw: (t, h, w), the image in patches.
        offset: prompt index of its first placeholder token.
        length: number of placeholder tokens, t * h * w / merge_size ** 2 (= rows of its embeddings).
        content_hash: hex digest of the pixel values and grid (prefix-cache key; equal images hash equal).
    """

    pixel_values: np.ndarray
    grid_thw: tuple[int, int, int]
    offset: int
    length: int
    content_hash: str

    @property
    def end(self) -> int:
        """One past its last placeholder token."""
        return self.offset + self.length
