"""EncoderBudget: which images' vision-tower runs a step schedules, under a per-step budget (plain Python).

An image runs in the step whose prompt chunk first touches its placeholder range (or again after preemption: the
runner dropped its output); the runner keeps its embeddings until the prefill has consumed them, so chunked prefill
may split one image's tokens across steps. When the step's encoder budget (``max_num_encoder_input_tokens``, in
image tokens) cannot take the next image, the chunk stops just before that image's placeholders.

    prompt:  | text | img 0 placeholders | text | img 1 placeholders | text |
    chunk:          |<------ c .. c + num_new ------>|
    runs:            img 0 (unless already encoded)   img 1 when it fits, else the chunk ends at its offset
"""

from __future__ import annotations

from hayabusa.core.request import Request


class EncoderBudget:
    """One step's encoder budget.

    Args:
        total: image tokens the step's vision-tower runs may produce; an image larger than ``total`` runs alone
            (in a step where nothing else used the budget), so no image waits forever.
    """

    def __init__(self, total: int) -> None:
        self.total = total
        self.left = total

    def fit(self, req: Request, start: int, num_new: int) -> tuple[int, list[int]]:
        """The chunk [start, start + num_new) of ``req`` cut to what the budget allows, and the indices of the
        images to run for it (not yet charged: ``charge`` does that once the request is scheduled).

        Returns:
            (num_new, possibly smaller, 0 when the chunk would start inside an image that cannot run;
            indices into ``req.mm_inputs``).
        """
        if start >= req.mm_inputs[-1].end:   # past every image (decode): nothing to check
            return num_new, []
        end = start + num_new
        run: list[int] = []
        left = self.left
        for i, img in enumerate(req.mm_inputs):
            if img.offset >= end:
                break
            if img.end <= start or i in req.mm_encoded:
                continue
            if img.length > left and not (left == self.total and not run):
                return max(0, img.offset - start), run
            left -= img.length
            run.append(i)
        return num_new, run

    def charge(self, req: Request, run: list[int]) -> None:
        """Count the images ``fit`` chose as scheduled (the runner will hold their outputs)."""
        for i in run:
            self.left -= req.mm_inputs[i].length
            req.mm_encoded.add(i)
