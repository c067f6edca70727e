"""M-RoPE positions of a prompt with images (Qwen2-VL / Qwen2.5-VL), as transformers' ``get_rope_index`` computes
them; plain numpy, per request, once at admission.

Text tokens count up by one on all three rows (t, h, w). An image of (t, h, w) patches, merged to
(t, h / m, w / m) tokens, gets ``start + (frame, row, column)`` on the rows; the text after it starts at
``start + max(h / m, w / m)``. Tokens after the prompt (outputs) sit at ``index + rope_delta`` on every row, where
``rope_delta = max prompt position + 1 - prompt length`` (<= 0: images take fewer positions than tokens).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from hayabusa.multimodal.inputs import ImageInput


def mrope_prompt_positions(num_prompt_tokens: int, images: Sequence[ImageInput], merge: int
                           ) -> tuple[np.ndarray, int]:
    """Returns (positions [3, P] int64, rope_delta) for a prompt of P tokens whose image placeholders are
    ``images`` (in prompt order, ranges inside the prompt)."""
    P = num_prompt_tokens
    pos = np.empty((3, P), dtype=np.int64)
    cur, prev = 0, 0            # next position; prompt index after the previous image
    for img in images:
        n_text = img.offset - prev
        pos[:, prev:img.offset] = cur + np.arange(n_text, dtype=np.int64)
        cur += n_text
        t, h, w = img.grid_thw
        gh, gw = h // merge, w // merge
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
        pos[0, img.offset:img.end] = tt.reshape(-1) + cur
        pos[1, img.offset:img.end] = hh.reshape(-1) + cur
        pos[2, img.offset:img.end] = ww.reshape(-1) + cur
        cur += max(gh, gw)
        prev = img.end
    pos[:, prev:] = cur + np.arange(P - prev, dtype=np.int64)
    delta = int(pos.max()) + 1 - P if P else 0
    return pos, delta
