"""Multimodal inputs (images): the plain per-image data that crosses the scheduler / runner seam, and the
preprocessing that turns a request's ``multi_modal_data`` into it (transformers' image processor)."""

from hayabusa.multimodal.inputs import ImageInput

__all__ = ["ImageInput"]
